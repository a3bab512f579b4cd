"""The compute and communication tax of zerojax's step, read from its compiled program: for a
model and each stage with default options, the matmul FLOPs against a plain `jax.jit` step's
(every scanned layer counted, `zerojax.inspect.hlo.matmul_flops`), the collectives per step and
per unit run, those under 64 KiB inside the layer loop, the all-gathers that wait for a
computed value rather than only their stored shard, the bytes a collective's layout makes
transposed or copied beside it against the bytes gathered, and apart from those the
transposes a matmul reads or writes beside a collective (`zerojax.inspect.audit`), and the
compiled peak.

    python bench/hlo_audit.py [--models bench 125m] [--topology v5e:2x4] [--rows-per-device 8]
                              [--devices 8]

Models: `bench` is bench/jax_lm.py's LM (4 scanned layers, d_model 256, batch 64), `125m` and
`tiny` the example LM's presets (batch 8 per device). Rows: stages 0-3 with defaults (units
"auto": one per block), stage 3 with `recompute_units=True`, with attention and MLP as
units (what bench/accelerator_compile.py and `zerojax plan` use) and with `unit_buffers=True`
(one buffer per unit and dtype each way). A collective instruction that moves several arrays
(a combined or variadic one) counts once: it is one launch. Without --topology the step
is compiled for 8 simulated CPU devices (XLA's CPU pipeline combines no collectives); with it,
by libtpu for that TPU slice, ahead of time (Python >= 3.12, `pip install 'zerojax[tpu]'`).
A TPU's optimized module wraps each collective in start and done fusions: with --topology the
collectives are the scheduled program's (`Report.scheduled`, after the TPU's combiners; small
ones counted per step), the dependencies are read from the partitioned module, the table adds
the bytes one chip sends per step and of those the bytes sent while a matmul runs
(`Report.overlap`), and the re-layout column is left out: this audit does not read through
libtpu's collective fusions (its program does re-lay out gathered weights: at 125m each
gathered q/k/v kernel is copied from the gather's tiled layout into the one its matmul reads).
`--rows-per-device` sets the presets' batch (8 rows per device by default) and `--devices` the
number of simulated CPU devices (8 by default, or 2 or 4): another value of either, or libtpu
flags in LIBTPU_INIT_ARGS with --topology, prints the table and writes nothing. A row whose
program does not fit the chip's memory says so.
Writes bench/results/hlo_audit.json and .md (hlo_audit_tpu with --topology).
"""

import argparse
import collections
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a TPU slice is compiled for, not run on
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # only compiling: no TPU VM metadata lookups

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from benchlib import markdown_table, write_results  # noqa: E402
from jax_lm import SHAPE, lm_config  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.inspect.audit import SMALL, audit  # noqa: E402
from zerojax.inspect.hlo import matmul_flops  # noqa: E402
from zerojax.inspect.schedule import launches  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

ROWS_PER_DEVICE = 8  # the presets' batch rows per device, as bench/results records them
DEVICES = 8  # the devices bench/results records
ROWS = {  # name -> (zero_shard options, units per block)
    **{f"stage {s}": (dict(stage=s), 1) for s in range(4)},
    "stage 3, recompute_units=True": (dict(stage=3, recompute_units=True), 1),
    "stage 3, attention + MLP units": (dict(stage=3, units=("Attention", "MLP")), 2),
    "stage 3, unit_buffers=True": (dict(stage=3, unit_buffers=True), 1),
}


def model(name: str, rows_per_device: int = ROWS_PER_DEVICE, devices: int = DEVICES):
    """(LMConfig, global batch rows) of a model name (a preset's: `rows_per_device` x
    `devices`)."""
    if name == "bench":
        return lm_config(), SHAPE["batch"]
    return LM_PRESETS[name], rows_per_device * devices


def audit_row(zero, init_fn, batch, plain_flops: float, units_per_step: int, tpu: bool) -> dict:
    """One contender's figures (see the module docstring). A TPU's optimized module wraps each
    collective in start and done fusions: its collectives are read as scheduled
    (`Report.scheduled`) and its dependencies from the partitioned module, before fusion."""
    state = zero.eval_shape(init_fn, jax.random.key(0))
    step = zero(train_step)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rep = zero.report(step, state, batch, dump_to=os.path.join(tmp, "step"))
        except jax.errors.JaxRuntimeError as e:  # a TPU compile that does not fit the HBM
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return {"does_not_fit": str(e).split("\n")[0]}
        texts = {
            kind: open(os.path.join(tmp, f"step.{kind}.hlo.txt")).read()
            for kind in ("optimized", "partitioned")
        }
    found = audit(texts["partitioned" if tpu else "optimized"], zero.axis_size)
    row = {
        "flops_ratio": rep.matmul_flops * zero.axis_size / plain_flops,
        "collectives": found.collectives,
        "units_per_step": units_per_step if step.units else 0,
        "small": found.small_in_loops,
        # stages 1-2 gather the parameters an update computed, by design: only stage 3's
        # gathers are a stored weight's
        "gathers_not_from_storage": (
            len(found.gathers_not_from_storage) if zero.config.shards_parameters else None
        ),
        "gathered_bytes": found.gathered_bytes,
        "relayout_bytes": found.relayout_bytes,
        "matmul_transpose_bytes": found.matmul_transpose_bytes,
        "peak_bytes": rep.peak_bytes,
    }
    if tpu:
        run = launches(rep.scheduled)
        kinds = collections.Counter(kind for kind, _ in run)
        small = sum(nbytes < SMALL for _, nbytes in run)
        hidden, exposed = rep.overlap
        row |= {
            "collectives": dict(kinds),
            "small": small,
            "relayout_bytes": None,
            "matmul_transpose_bytes": None,
            "overlapped_bytes": hidden,
            "sent_bytes": hidden + exposed,
        }
    return row


def table(rows: dict, where: str, tpu: bool) -> str:
    headers = [
        "model",
        f"zerojax ({where})",
        "matmul FLOPs / plain jit",
        "collectives per step",
        "unit runs",
        "collectives per unit run",
        "under 64 KiB" + (" per step" if tpu else " in the loop"),
        "gathers not from storage",
        "MiB re-laid out / gathered (+ a matmul's transposes)",
        *(["MiB overlapped / sent"] if tpu else []),
        "peak MiB",
    ]
    mib = lambda b: f"{b / 2**20:.1f}"
    body = []
    for (model, name), r in rows.items():
        if "does_not_fit" in r:
            body.append([model, name, "-", r["does_not_fit"], *["-"] * (len(headers) - 4)])
            continue
        n = sum(r["collectives"].values())
        per_unit = f"{n / r['units_per_step']:.1f}" if r["units_per_step"] else "-"
        relayout = r["relayout_bytes"]
        body.append(
            [
                model,
                name,
                f"{r['flops_ratio']:.3f}",
                ", ".join(f"{c} {k}" for k, c in sorted(r["collectives"].items())) or "none",
                r["units_per_step"] or "-",
                per_unit,
                r["small"],
                "-" if r["gathers_not_from_storage"] is None else r["gathers_not_from_storage"],
                "-"
                if relayout is None
                else f"{mib(relayout)} / {mib(r['gathered_bytes'])} "
                f"(+{mib(r['matmul_transpose_bytes'])})",
                *([f"{mib(r['overlapped_bytes'])} / {mib(r['sent_bytes'])}"] if tpu else []),
                mib(r["peak_bytes"]),
            ]
        )
    return markdown_table(headers, body)


def measure(name: str, devices, where: str, rows_per_device: int = ROWS_PER_DEVICE) -> dict:
    """{(model, row): figures} of one model (see the module docstring)."""
    cfg, rows = model(name, rows_per_device, len(devices))
    init_fn = make_init(LM(cfg), optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    batch = jax.ShapeDtypeStruct((rows, cfg.seq_len + 1), jnp.int32)
    plain = jax.jit(train_step).lower(jax.eval_shape(init_fn, jax.random.key(0)), batch)
    plain_flops = matmul_flops(plain.compile().as_text())  # one CPU device, the whole batch
    print(f"{name}: {cfg.n_layers} layers, batch {rows}; {where}", file=sys.stderr)
    results = {}
    for row, (options, per_block) in ROWS.items():
        zero = zj.zero_shard(mesh=zj.make_mesh(devices), **options)
        units = cfg.n_layers * per_block
        found = audit_row(
            zero, init_fn, batch, plain_flops, units, tpu=devices[0].platform == "tpu"
        )
        results[(name, row)] = found
        print(f"  {row}: {found}", file=sys.stderr)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["bench", "125m"], choices=["bench", *LM_PRESETS])
    p.add_argument("--topology", help="a TPU slice to compile for, e.g. v5e:2x4")
    p.add_argument(
        "--rows-per-device",
        type=int,
        default=ROWS_PER_DEVICE,
        help="batch rows per device of the preset models (not the bench LM's); other than 8 "
        "the table is printed, not written",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=DEVICES,
        choices=[2, 4, 8],
        help="simulated CPU devices (not with --topology); other than 8 the table is printed, "
        "not written",
    )
    args = p.parse_args(argv)
    if args.topology and args.devices != DEVICES:
        p.error("--devices is for the CPU lane; with --topology the slice sets the devices")
    try:
        devices = zj.tpu_devices(args.topology) if args.topology else jax.devices()[: args.devices]
    except zj.ZeroError as e:  # no libtpu, or a topology it does not know
        print(f"hlo_audit: {e}", file=sys.stderr)
        return 2
    where = f"{args.topology}, TPU compile" if args.topology else f"{args.devices} CPU devices"
    results = {}
    for name in args.models:
        results |= measure(name, devices, where, args.rows_per_device)
    libtpu_flags = os.environ.get("LIBTPU_INIT_ARGS", "").strip() if args.topology else ""
    recorded = args.rows_per_device == ROWS_PER_DEVICE and args.devices == DEVICES
    recorded = recorded and not libtpu_flags
    if args.rows_per_device != ROWS_PER_DEVICE:
        where += f", presets at {args.rows_per_device} rows per device"
    if libtpu_flags:
        where += f", LIBTPU_INIT_ARGS={libtpu_flags}"
    md = table(results, where, bool(args.topology))
    print(md)
    if not recorded:
        return 0
    write_results(
        "hlo_audit_tpu" if args.topology else "hlo_audit",
        {"where": where, "rows": [{"model": m, "row": r, **v} for (m, r), v in results.items()]},
        markdown=md,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
