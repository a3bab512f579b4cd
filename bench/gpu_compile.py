"""zerojax's train step compiled for H100 nodes with no GPU present (XLA:GPU through JAX's CUDA
plugin): its stages side by side with two `jax.jit` FSDPs and MaxText, and the largest model
that fits one H100 and a node of 8.

    python bench/gpu_compile.py [--models bench 125m 1.3b 7b] [--targets h100:8 h100:2x8]
                                [--without-maxtext] [--without-largest]

Needs the CUDA plugin (`pip install 'zerojax[gpu-compile]'`: no NVIDIA wheels) and, for the
MaxText row, MaxText installed beside zerojax (bench/maxtext_lm.py says how; its jax must be
one the plugin exists for). Without MaxText it exits 2 (bench/all.py then leaves the tables as
they were) unless `--without-maxtext` is given.

Models: bench/jax_lm.py's LM (4 layers, d_model 256, seq 128, global batch 64, fp32, clip +
AdamW), and the example LM's presets 125m (fp32), 1.3b and 7b (bf16 over fp32 master
weights, seq 2048), one sequence per GPU, scanned remat blocks, AdamW. Each contender's step
is compiled for the target and read as `zero.report` reads it: per-GPU peak (arguments +
temporaries; fits: against the H100's 79.1 GiB), collective launches per step after XLA:GPU's
combiners, bytes one GPU sends (ring algorithms) and of those the share sent while a matmul
runs (the latency-hiding schedule's overlap), bytes crossing nodes (2x8 meshes), matmul GFLOP
per GPU (scanned layers counted), and the seconds to trace, compile and read it here.
Contenders: zerojax stages 0-3 (units as `zerojax plan` names them), on 2x8 zerojax's ZeRO++
(qwZ + hpZ + qgZ), two `jax.jit` FSDPs of the same model, state layout and compute dtype (one
leaves every gather and reduction to XLA's sharding propagation, one gathers the parameters
whole at the start of the step), and MaxText's FSDP (bench LM, 8 H100s).

Largest model: the 7b preset's width (d_model 4096, SwiGLU 11008, 32 heads, seq 2048, bf16)
with as many layers as fit, found by compiling: the peak of a scanned model grows about
linearly with its layers, so the line through 4 and 16 layers gives a guess, and steps that
double away from it, then bisection, find the count that fits with one more that does not.
Host offload rows run the update on the GPU (`offload_update='device'`: a host update is not
compiled for compile-only GPUs).
Writes bench/results/gpu_compile.json and .md.
"""

import argparse
import importlib.metadata
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only GPUs need it; offload: CPU twin
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from accelerator_compile import schedule_figures  # noqa: E402
from benchlib import markdown_table, maxtext_missing, run_with_devices, write_results  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_lm import SHAPE, lm_config  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.core.mesh import gpu_memory_bytes, gpu_target  # noqa: E402
from zerojax.inspect.hlo import matmul_flops  # noqa: E402
from zerojax.inspect.report import compile_with_partitioned_hlo  # noqa: E402
from zerojax.inspect.schedule import scheduled_collectives  # noqa: E402
from zerojax.models.gpt import lm_units, make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

GIB = 2**30


def workload(model: str, gpus: int, layers: int | None = None):
    """(LMConfig, init_fn, batch, precision) of `model` on `gpus` GPUs."""
    if model == "bench":
        cfg, batch, precision = lm_config(), SHAPE["batch"], "fp32"
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    else:
        cfg = LM_PRESETS[model].replace(seq_len=min(LM_PRESETS[model].seq_len, 2048), remat=True)
        batch, precision, tx = gpus, ("fp32" if model == "125m" else "bf16"), optax.adamw(1e-4)
    cfg = cfg.replace(n_layers=layers) if layers else cfg
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), jnp.int32)
    return cfg, make_init(LM(cfg), tx), tokens, precision


def mesh_of(target: str):
    """`target`'s compile-only GPUs as a mesh: one axis, or ('node', 'local') across nodes."""
    _, nodes, per_node = gpu_target(target)
    return zj.make_mesh(zj.gpu_devices(target), local=per_node if nodes > 1 else None)


def zerojax_row(name, target, model, options, layers=None) -> dict:
    """One zerojax contender compiled for `target`, read by `zero.report`."""
    mesh = mesh_of(target)
    cfg, init_fn, batch, precision = workload(model, mesh.size, layers)
    units = {"units": lm_units(cfg)} if options["stage"] == 3 else {}
    options = {**units, "precision": precision, **options}
    started = time.perf_counter()
    zero = zj.zero_shard(mesh=mesh, **options)
    state = zero.eval_shape(init_fn, jax.random.key(0))
    rep = zero.report(zero(train_step), state, batch)
    return {
        "contender": name,
        "params": sum(x.size for x in jax.tree_util.tree_leaves(state.params)),
        "peak_bytes": rep.peak_bytes,
        "peak_bound_bytes": rep.peak_bound_bytes,
        "at_rest_bytes": sum(rep.resident.values()),
        "host_bytes": sum(rep.host_resident.values()),
        "host_copies": {kind: list(pair) for kind, pair in rep.host_copies.items()},
        "cross_node_bytes": int(rep.cross_node_bytes) if "node" in mesh.shape else None,
        **schedule_figures(rep.scheduled),
        "matmul_flops": rep.matmul_flops,
        "compile_s": round(time.perf_counter() - started, 1),
    }


def jit_fsdp_row(target: str, model: str, gather_at_start: bool) -> dict:
    """A `jax.jit` FSDP: the state at rest in zerojax's stage-3 layout (in and out shardings),
    the parameters cast to the compute dtype and, with `gather_at_start`, gathered whole at the
    start of the step (one sharding constraint); else XLA's sharding propagation decides where
    each gather and reduction goes. XLA places every collective."""
    mesh = mesh_of(target)
    cfg, init_fn, batch, precision = workload(model, mesh.size)
    compute = jnp.bfloat16 if precision == "bf16" else jnp.float32
    started = time.perf_counter()
    state = jax.eval_shape(init_fn, jax.random.key(0))
    shardings = zj.zero_shard(stage=3, mesh=mesh).state_shardings(state)
    whole = NamedSharding(mesh, P())

    def step(state, batch):
        params = jax.tree_util.tree_map(lambda p: p.astype(compute), state.params)
        if gather_at_start:
            params = jax.lax.with_sharding_constraint(params, whole)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        grads = jax.grad(loss_fn)(params)
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, state.params)
        return state.apply_gradients(grads=grads)

    data = NamedSharding(mesh, P(mesh.axis_names))
    lowered = jax.jit(step, in_shardings=(shardings, data), out_shardings=shardings).lower(
        state, batch
    )
    compiled, partitioned, _ = compile_with_partitioned_hlo(lowered, mesh.size)
    mem = compiled.memory_analysis()
    return {
        "contender": "jax.jit FSDP, "
        + ("parameters gathered at the start" if gather_at_start else "XLA's propagation"),
        "params": sum(x.size for x in jax.tree_util.tree_leaves(state.params)),
        "peak_bytes": int(mem.argument_size_in_bytes + mem.temp_size_in_bytes),
        "at_rest_bytes": sum(
            math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
            for x, s in zip(
                jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(shardings), strict=True
            )
        ),
        "cross_node_bytes": None,
        **schedule_figures(scheduled_collectives(compiled.as_text(), mesh.size)),
        "matmul_flops": matmul_flops(partitioned),
        "compile_s": round(time.perf_counter() - started, 1),
    }


def compare(target: str, model: str) -> list[dict]:
    """Every contender of the comparison table for `model` on `target`."""
    named = {f"zerojax stage {s}": dict(stage=s) for s in range(4)}
    _, nodes, per_node = gpu_target(target)
    if nodes > 1:
        named["zerojax stage 3, qwZ+hpZ+qgZ"] = dict(
            stage=3, quantized_weights=True, hpz_partition_size=per_node, quantized_gradients=True
        )
    rows = []
    for name, options in named.items():
        rows.append(zerojax_row(name, target, model, options))
        print(f"{target} {model} {name}: {rows[-1]['compile_s']} s", file=sys.stderr, flush=True)
    rows += [jit_fsdp_row(target, model, gather) for gather in (False, True)]
    return [{"target": target, "model": model, **r} for r in rows]


LARGEST = {  # (target, name) -> zero_shard options
    ("h100:1", "no ZeRO"): dict(stage=0),
    ("h100:1", "offload optimizer"): dict(stage=2, offload_optimizer="cpu"),
    ("h100:1", "offload optimizer + params"): dict(
        stage=3, offload_optimizer="cpu", offload_param="cpu"
    ),
    **{("h100:8", f"stage {s}"): dict(stage=s) for s in range(4)},
    ("h100:8", "stage 3, offload optimizer"): dict(stage=3, offload_optimizer="cpu"),
    ("h100:8", "stage 3, offload optimizer + params"): dict(
        stage=3, offload_optimizer="cpu", offload_param="cpu"
    ),
}


def largest(target: str, name: str, options: dict) -> dict:
    """The most layers of the 7b width that fit `target`'s GPUs with `options`: a guess from
    the line through the peaks at 4 and 16 layers, then steps that double away from the guess
    until one count fits and a larger one does not, then bisection between them."""
    memory = gpu_memory_bytes(target)
    options = {**options, "offload_update": "device"} if "offload_optimizer" in options else options
    peaks: dict[int, dict] = {}

    def fits(layers: int) -> bool:
        if layers not in peaks:
            peaks[layers] = zerojax_row(name, target, "7b", options, layers=layers)
        return peaks[layers]["peak_bound_bytes"] <= memory

    fits(4), fits(16)
    per_layer = (peaks[16]["peak_bound_bytes"] - peaks[4]["peak_bound_bytes"]) / 12
    guess = max(int((memory - peaks[4]["peak_bound_bytes"]) // per_layer) + 4, 1)
    step = max(guess // 16, 1)
    if fits(guess):
        lo, hi = guess, guess + step
        while fits(hi):
            lo, step = hi, 2 * step
            hi = lo + step
    else:
        lo, hi = max(guess - step, 0), guess
        while lo and not fits(lo):
            hi, step = lo, 2 * step
            lo = max(hi - step, 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo == 0:
        return {"target": target, "contender": name, "layers": 0, "compiles": len(peaks)}
    fits(lo + 1)  # compiled: the next count's peak goes in the table
    print(f"largest {target} {name}: {lo} layers", file=sys.stderr, flush=True)
    return {
        "target": target,
        "contender": name,
        "layers": lo,
        "params": peaks[lo]["params"],
        "peak_bound_bytes": peaks[lo]["peak_bound_bytes"],
        "at_rest_bytes": peaks[lo]["at_rest_bytes"],
        "host_bytes": peaks[lo]["host_bytes"],
        "per_layer_bytes": per_layer,
        "next_layer_peak_bytes": peaks[lo + 1]["peak_bound_bytes"],
        "compiles": len(peaks),
    }


def flags_row(model: str) -> dict:
    """zerojax stage 3 of `model` on 8 H100s, compiled in a process whose XLA flags are as
    its environment says (run twice: with zerojax's default XLA:GPU flags, and without)."""
    from zerojax.core import xla_flags

    row = zerojax_row("zerojax stage 3", "h100:8", model, dict(stage=3))
    return {"model": model, "flags": xla_flags.effective(), **row}


def flag_comparison(models: list[str]) -> list[dict]:
    """flags_row with zerojax's default XLA:GPU flags, then without (each a fresh process:
    XLA reads its flags once)."""
    rows = []
    for model in models:
        for defaults in ("1", "0"):
            os.environ["ZEROJAX_DEFAULT_XLA_FLAGS"] = defaults
            try:
                rows.append(run_with_devices(8, "gpu_compile", f"flags_row({model!r})"))
            finally:
                os.environ.pop("ZEROJAX_DEFAULT_XLA_FLAGS")
            rows[-1]["defaults"] = defaults == "1"
    return rows


def _pct(part, whole) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def tables(rows: list[dict], biggest: list[dict], flagged: list[dict]) -> str:
    gib = lambda b: f"{b / GIB:.3f}"
    memory = gpu_memory_bytes("h100:8")
    body = [
        [
            f"{r['model']} on {r['target']}",
            r["contender"],
            gib(r["peak_bytes"]),
            "yes" if r["peak_bytes"] <= memory else "no",
            ", ".join(f"{n} {k}" for k, n in r["collectives"].items()) or "none",
            gib(r["sent_bytes"]),
            "-" if r["cross_node_bytes"] is None else gib(r["cross_node_bytes"]),
            _pct(r["overlapped_bytes"], r["sent_bytes"]),
            f"{r['matmul_flops'] / 1e9:,.1f}",
            r.get("compile_s", "-"),
        ]
        for r in rows
    ]
    compared = markdown_table(
        [
            "model, GPUs",
            "contender",
            "peak (GiB/GPU)",
            "fits 80 GB",
            "collective launches per step",
            "sent (GiB/GPU)",
            "cross-node (GiB/GPU)",
            "overlapped",
            "matmul GFLOP/GPU",
            "compile (s)",
        ],
        body,
    )
    largest_rows = [
        [
            b["target"],
            b["contender"],
            b["layers"],
            f"{b.get('params', 0) / 1e9:.1f}",
            gib(b["peak_bound_bytes"]) if b["layers"] else "-",
            gib(b["host_bytes"]) if b["layers"] else "-",
            gib(b["next_layer_peak_bytes"]) if b["layers"] else "-",
        ]
        for b in biggest
    ]
    found = markdown_table(
        [
            "GPUs",
            "ZeRO",
            "layers of 7b width that fit",
            "parameters (B)",
            "peak (GiB/GPU)",
            "host (GiB/GPU)",
            "peak with one layer more",
        ],
        largest_rows,
    )
    flag_rows = [
        [
            f"{f['model']} stage 3 on h100:8",
            "on" if f["defaults"] else "off (ZEROJAX_DEFAULT_XLA_FLAGS=0)",
            gib(f["peak_bytes"]),
            ", ".join(f"{n} {k}" for k, n in f["collectives"].items()),
            _pct(f["overlapped_bytes"], f["sent_bytes"]),
            _pct(*f["reduce_scatter_bytes"]),
        ]
        for f in flagged
    ]
    flags = markdown_table(
        [
            "model",
            "zerojax's XLA:GPU flags",
            "peak (GiB/GPU)",
            "collective launches per step",
            "overlapped",
            "reduce-scatter bytes overlapped",
        ],
        flag_rows,
    )
    return compared + "\n" + found + "\n" + flags


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["bench", "125m", "1.3b", "7b"])
    p.add_argument("--targets", nargs="+", default=["h100:8", "h100:2x8"])
    p.add_argument("--without-maxtext", action="store_true", help="no MaxText row")
    p.add_argument("--without-largest", action="store_true", help="no largest-model table")
    args = p.parse_args(argv)
    if not args.without_maxtext and maxtext_missing("gpu_compile"):
        return 2
    try:
        zj.gpu_devices(args.targets[0])
    except zj.ZeroError as e:  # no plugin, or not JAX_PLATFORMS=cpu
        print(f"gpu_compile: {e}", file=sys.stderr)
        return 2
    rows = [
        row for target in args.targets for model in args.models for row in compare(target, model)
    ]
    versions = {
        "jax": jax.__version__,
        "jax-cuda12-plugin": importlib.metadata.version("jax-cuda12-plugin"),
    }
    if not args.without_maxtext and "bench" in args.models:
        for remat in ("full", "minimal"):
            row = run_with_devices(1, "maxtext_lm", f"maxtext_row('h100:8', {remat!r})")
            rows.append({"target": "h100:8", "model": "bench", "cross_node_bytes": None, **row})
        versions["maxtext"] = importlib.metadata.version("maxtext")
    biggest = [] if args.without_largest else [largest(*key, o) for key, o in LARGEST.items()]
    flagged = flag_comparison(["125m", "7b"] if "7b" in args.models else args.models[:1])
    md = tables(rows, biggest, flagged)
    print(md)
    write_results(
        "gpu_compile",
        {"versions": versions, "rows": rows, "largest": biggest, "flags": flagged},
        markdown=md,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
