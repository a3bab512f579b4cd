"""How much longer zerojax's step takes to compile than a plain `jax.jit` step: trace + lower
and XLA compile seconds of bench/jax_lm.py's LM unrolled at 8 layers (the case where compile
time grows with depth; a scanned stack is traced once), a plain `jax.jit` step on one device
against zerojax stages 0 and 3 with defaults and stage 3 with `recompute_units=True`, and
stages 0 and 3 with `explicit_collectives=False` (XLA's partitioner inserts the collectives), on
8 simulated devices. Each measurement is a fresh process (no cache of an earlier compile), the
contenders alternated round after round; figures are medians with the spread. The compiled
peak per device (arguments + temporaries, exact) is printed beside them.

    python bench/compile_time.py [--rounds 3] [--layers 8]

Writes bench/results/compile_time.json and .md. With `--xla-passes` it instead compiles each
contender with XLA's pass timings logged and prints, not writes, the seconds XLA's pass
pipelines take and their costliest passes (Shardy's `shardy-xla`, the SPMD partitioner),
medians over the rounds; the rest of the compile is the CPU back end's code generation.
"""

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile

from benchlib import markdown_table, run_with_devices, write_results

CONTENDERS = {  # name -> zero_shard options, None: plain jax.jit
    "plain jax.jit": None,
    "zerojax stage 0": dict(stage=0),
    "zerojax stage 3": dict(stage=3),
    "zerojax stage 3, recompute_units=True": dict(stage=3, recompute_units=True),
    # the same placements with XLA's partitioner inserting the collectives: what zerojax's own
    # collectives (the hook, its shard_map and per-unit VJPs) add to the compile
    "stage 0, explicit_collectives=False": dict(stage=0, explicit_collectives=False),
    "stage 3, explicit_collectives=False": dict(stage=3, explicit_collectives=False),
}


def compile_seconds(options: dict | None, layers: int) -> dict:
    """{'trace': s, 'compile': s, 'peak': bytes} of one contender's first step, in this (fresh)
    process."""
    import time

    import jax
    import jax.numpy as jnp
    import optax
    from jax_lm import SHAPE, lm_config

    import zerojax as zj
    from zerojax.models.gpt import make_init, train_step
    from zerojax.models.lm import LM

    cfg = lm_config().replace(n_layers=layers, scan_layers=False)
    init_fn = make_init(LM(cfg), optax.adamw(1e-3))
    batch = jax.ShapeDtypeStruct((SHAPE["batch"], cfg.seq_len + 1), jnp.int32)
    if options is None:
        step, state = jax.jit(train_step), jax.eval_shape(init_fn, jax.random.key(0))
    else:
        zero = zj.zero_shard(**options)
        step, state = zero(train_step), zero.eval_shape(init_fn, jax.random.key(0))
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    return {"trace": traced - start, "compile": done - traced, "peak": peak}


_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) ")
_PIPELINE = re.compile(r"Running HLO pass pipeline on module \S+: (.+)$", re.M)
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def pass_seconds(options: dict | None, layers: int) -> dict:
    """`compile_seconds` of one contender with XLA's pass timings read from its log: adds
    'passes' ({pass name: seconds, summed over the pipelines that run it; a pipeline run as a
    pass of another is left out, its passes counted}). Call it in a fresh process: the log
    level is read when XLA loads."""
    os.environ.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_pipeline=1")
    with tempfile.TemporaryFile("w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)  # XLA logs to the process's stderr
        try:
            got = compile_seconds(options, layers)
        finally:
            os.dup2(saved, 2)
        log.seek(0)
        text = log.read()
    pipelines = {m.group(1).strip() for m in _PIPELINE.finditer(text)}
    passes: dict = collections.Counter()
    for m in _PASS.finditer(text):
        if m.group(1) not in pipelines:
            passes[m.group(1)] += float(m.group(2)) * _UNIT[m.group(3)]
    return {**got, "passes": dict(passes)}


def print_passes(layers: int, rounds: int, top: int = 4) -> None:
    """Each contender's compile seconds, of which XLA's pass pipelines, and the costliest
    passes: medians over `rounds` fresh processes, the contenders alternated."""
    got: dict = {name: [] for name in CONTENDERS}
    for _ in range(rounds):
        for name, options in CONTENDERS.items():
            call = f"pass_seconds({options!r}, {layers})"
            got[name].append(run_with_devices(8 if options else 1, "compile_time", call))
    for name, runs in got.items():
        names = {k for r in runs for k in r["passes"]}
        passes = {k: statistics.median(r["passes"].get(k, 0.0) for r in runs) for k in names}
        costliest = sorted(passes.items(), key=lambda kv: -kv[1])[:top]
        compile_s = statistics.median(r["compile"] for r in runs)
        in_passes = statistics.median(sum(r["passes"].values()) for r in runs)
        listed = ", ".join(f"{k} {v:.2f}" for k, v in costliest)
        print(f"{name:<40} compile {compile_s:5.2f} s, XLA passes {in_passes:5.2f} s ({listed})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--xla-passes", action="store_true", help="print where XLA's compile goes")
    args = p.parse_args(argv)
    if args.xla_passes:
        print_passes(args.layers, args.rounds)
        return 0
    times: dict = {name: [] for name in CONTENDERS}
    for r in range(args.rounds):
        for name, options in CONTENDERS.items():
            call = f"compile_seconds({options!r}, {args.layers})"
            got = run_with_devices(8 if options else 1, "compile_time", call)
            times[name].append(got)
            print(
                f"round {r + 1}: {name:<40} trace {got['trace']:6.2f} s, "
                f"compile {got['compile']:6.2f} s",
                flush=True,
            )
    total = lambda t: t["trace"] + t["compile"]
    base = statistics.median(total(t) for t in times["plain jax.jit"])
    rows, body = [], []
    for name, got in times.items():
        med = {k: statistics.median(t[k] for t in got) for k in ("trace", "compile")}
        whole = statistics.median(total(t) for t in got)
        rows.append(
            {
                "contender": name,
                **med,
                "total": whole,
                "ratio": whole / base,
                "totals": [total(t) for t in got],
                "peak_bytes": got[0]["peak"],
            }
        )
        spread = f"{min(total(t) for t in got):.2f}-{max(total(t) for t in got):.2f}"
        body.append(
            [
                name,
                f"{med['trace']:.2f}",
                f"{med['compile']:.2f}",
                f"{whole:.2f} ({spread})",
                f"{whole / base:.2f}",
                f"{got[0]['peak'] / 2**20:.1f}",
            ]
        )
        print(f"{name:<40} {whole:6.2f} s  x{whole / base:.2f}")
    headers = [
        f"contender ({args.layers} unrolled layers)",
        "trace + lower s",
        "compile s",
        "total s (spread)",
        "vs plain jit",
        "peak MiB/device",
    ]
    write_results("compile_time", rows, markdown=markdown_table(headers, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
