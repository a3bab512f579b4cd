"""The peer LM compiled for a TPU slice with no TPU present: zerojax's stages side by side with
MaxText's own train step and with XLA's own GSPMD placement of the same FSDP shardings, as the
accelerator's compiler builds them.

    python bench/accelerator_compile.py [--topology v5e:2x4] [--without-maxtext]

Needs libtpu (`pip install 'zerojax[tpu]'`; jax 0.12 needs Python >= 3.12) and, for the MaxText
row, MaxText installed beside zerojax (bench/maxtext_lm.py says how): the same jax and libtpu
then compile every contender. Without MaxText it exits 2 (bench/all.py then leaves the table as
it was) unless `--without-maxtext` is given.

The model is bench/jax_lm.py's (4 layers, d_model 256, SwiGLU 688, vocab 256, seq 128, global
batch 64, fp32, clip + AdamW); each contender's train step is compiled ahead of time for the
slice by libtpu and read (`zero.report`): per-chip peak (arguments + temporaries), the
collectives the scheduled program launches (after the TPU's combiners, in the dtypes it chose;
one that moves several arrays counts once) by kind, the bytes one chip sends per step, and of
those the bytes sent while a matmul runs (overlapped) or with nothing beside them (exposed),
the reduce-scatters' overlapped and sent bytes, and the matmul FLOPs per chip with every
scanned layer counted (`zerojax.inspect.hlo.matmul_flops`, read from the partitioned module).
Contenders: zerojax stages 0-3 with the units `zerojax plan` uses (attention and MLP apart),
stage 3 with whole blocks as units, with `recompute_units=True` and with `unit_buffers=True`
(one buffer per unit and dtype each way; attention and MLP apart, and whole blocks), MaxText
(its FSDP rules, `remat_policy=full` and `minimal`), and the stage-3 shardings with
`explicit_collectives=False`, where XLA's partitioner places every gather and reduction itself.
Writes
bench/results/accelerator_compile.json and .md.
"""

import argparse
import collections
import importlib.metadata
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # only compiling: no TPU VM metadata lookups
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # MaxText compiles in a second process

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from benchlib import markdown_table, maxtext_missing, run_with_devices, write_results  # noqa: E402
from jax_lm import SHAPE, lm_config  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.inspect.schedule import launches, overlap_bytes  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402
from zerojax.models.lm import LM  # noqa: E402

CONTENDERS = {  # name -> zero_shard options
    **{f"zerojax stage {s}": dict(stage=s, units=("Attention", "MLP")) for s in range(4)},
    "zerojax stage 3, block units": dict(stage=3, units=("Block",)),
    "zerojax stage 3, recompute": dict(stage=3, units=("Attention", "MLP"), recompute_units=True),
    "zerojax stage 3, unit_buffers": dict(stage=3, units=("Attention", "MLP"), unit_buffers=True),
    "zerojax stage 3, block units, unit_buffers": dict(
        stage=3, units=("Block",), unit_buffers=True
    ),
    "stage-3 shardings, XLA's placement": dict(stage=3, explicit_collectives=False),
}


def schedule_figures(scheduled) -> dict:
    """A row's figures read from its scheduled collectives (`zerojax.inspect.schedule`):
    launches by kind, bytes sent, overlapped and exposed, and the reduce-scatters' overlapped
    and sent bytes."""
    hidden, exposed = overlap_bytes(scheduled)
    rs_hidden, rs_exposed = overlap_bytes(scheduled, "reduce-scatter")
    kinds = collections.Counter(kind for kind, _ in launches(scheduled))
    return {
        "collectives": dict(sorted(kinds.items())),
        "sent_bytes": hidden + exposed,
        "overlapped_bytes": hidden,
        "exposed_bytes": exposed,
        "reduce_scatter_bytes": [rs_hidden, rs_hidden + rs_exposed],
    }


def measure(topology: str) -> list[dict]:
    devices = zj.tpu_devices(topology)
    cfg = lm_config()
    init_fn = make_init(LM(cfg), optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    batch = jax.ShapeDtypeStruct((SHAPE["batch"], cfg.seq_len + 1), jnp.int32)
    rows = []
    for name, options in CONTENDERS.items():
        zero = zj.zero_shard(mesh=zj.make_mesh(devices), precision="fp32", **options)
        state = zero.eval_shape(init_fn, jax.random.key(0))
        rep = zero.report(zero(train_step), state, batch)
        rows.append(
            {
                "contender": name,
                "params": sum(x.size for x in jax.tree_util.tree_leaves(state.params)),
                "peak_bytes": rep.peak_bytes,
                "at_rest_bytes": sum(rep.resident.values()),
                **schedule_figures(rep.scheduled),
                "matmul_flops": rep.matmul_flops,
            }
        )
        print(f"{name}: peak {rep.peak_bytes / 2**20:.2f} MiB", file=sys.stderr)
    return rows


def table(rows: list[dict], topology: str) -> str:
    mib = lambda b: f"{b / 2**20:.2f}"
    body = [
        [
            r["contender"],
            mib(r["peak_bytes"]),
            mib(r["at_rest_bytes"]),
            ", ".join(f"{n} {k}" for k, n in r["collectives"].items()) or "none",
            mib(r["sent_bytes"]),
            mib(r["overlapped_bytes"]),
            mib(r["exposed_bytes"]),
            " / ".join(mib(b) for b in r["reduce_scatter_bytes"]),
            f"{r['matmul_flops'] / 1e9:.2f}",
        ]
        for r in rows
    ]
    headers = [
        f"contender ({topology})",
        "peak (MiB/chip)",
        "at rest (MiB/chip)",
        "collective launches per step (scheduled)",
        "sent (MiB/chip)",
        "overlapped",
        "exposed",
        "of it reduce-scattered: overlapped / sent",
        "matmul GFLOP/chip",
    ]
    return markdown_table(headers, body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v5e:2x4", help="TPU slice, e.g. v5e:2x4 (8 chips)")
    p.add_argument("--without-maxtext", action="store_true", help="zerojax's rows only")
    args = p.parse_args(argv)
    if not args.without_maxtext and maxtext_missing("accelerator_compile"):
        return 2
    try:
        rows = measure(args.topology)
    except zj.ZeroError as e:  # no libtpu, or a topology it does not know
        print(f"accelerator_compile: {e}", file=sys.stderr)
        return 2
    versions = {"jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu")}
    if not args.without_maxtext:
        for remat in ("full", "minimal"):
            call = f"maxtext_row({args.topology!r}, {remat!r})"
            rows.insert(-1, run_with_devices(1, "maxtext_lm", call))
        versions["maxtext"] = importlib.metadata.version("maxtext")
    md = table(rows, args.topology)
    print(md)
    write_results(
        "accelerator_compile",
        {"topology": args.topology, "shape": SHAPE, "versions": versions, "rows": rows},
        markdown=md,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
