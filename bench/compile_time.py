"""How much longer zerojax's step takes to compile than a plain `jax.jit` step: trace + lower
and XLA compile seconds of bench/jax_lm.py's LM unrolled at 8 layers (the case where compile
time grows with depth; a scanned stack is traced once), a plain `jax.jit` step on one device
against zerojax stages 0 and 3 with defaults and stage 3 with `recompute_units=True`, and
stages 0 and 3 with `explicit_collectives=False` (XLA's partitioner inserts the collectives), on
8 simulated devices. Each measurement is a fresh process (no cache of an earlier compile), the
contenders alternated round after round; figures are medians with the spread. The compiled
peak per device (arguments + temporaries, exact) is printed beside them.

    python bench/compile_time.py [--rounds 3] [--layers 8]

Writes bench/results/compile_time.json and .md.
"""

import argparse
import statistics
import sys

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)
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
