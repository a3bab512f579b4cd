"""Recompute a unit in backward, or save its activations? Compiled peak and step time of both
`recompute_units` settings on the example LM (preset small, no remat of its own, units
"auto": one per block, 8 simulated devices), stages 2 and 3, timed in alternating rounds in one
run (the cores are shared: compare the ratios, not the seconds).

    python bench/recompute_units.py [--rounds 3] [--steps 4]

Writes bench/results/recompute_units.json.
"""

import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from benchlib import markdown_table, write_results  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    cfg = LM_PRESETS["small"]
    init_fn = make_init(LM(cfg), optax.adamw(1e-3))
    rng = np.random.default_rng(0)
    batch = rng.integers(0, cfg.vocab, (16, cfg.seq_len + 1), dtype=np.int32)
    runs = {}
    for stage in (2, 3):
        for recompute in (True, False):
            zero = zj.zero_shard(stage=stage, recompute_units=recompute)
            state = zero.init(init_fn, jax.random.key(0))
            step = zero(train_step)
            peak = zero.report(step, state, batch).peak_bytes
            state, _ = step(state, batch)  # compiled, warm
            runs[(stage, recompute)] = {"state": state, "step": step, "peak": peak, "times": []}
    for _ in range(args.rounds):  # alternate the contenders round after round
        for run in runs.values():
            start = time.perf_counter()
            for _ in range(args.steps):
                run["state"], metrics = run["step"](run["state"], batch)
            jax.block_until_ready(metrics)
            run["times"].append((time.perf_counter() - start) / args.steps)
    rows = []
    print(f"preset small, {args.rounds} rounds x {args.steps} steps, batch 16 x {cfg.seq_len}")
    print(
        f"{'stage':>5} {'recompute':>10} {'peak MiB':>9} {'s/step':>7} {'spread':>13} {'time':>6}"
    )
    for (stage, recompute), run in runs.items():
        t = statistics.median(run["times"])
        base = statistics.median(runs[(stage, True)]["times"])
        rows.append(
            {
                "stage": stage,
                "recompute_units": recompute,
                "peak_bytes": run["peak"],
                "seconds_per_step": t,
                "spread": [min(run["times"]), max(run["times"])],
                "time_vs_recompute": t / base,
            }
        )
        print(
            f"{stage:>5} {str(recompute):>10} {run['peak'] / 2**20:9.2f} {t:7.3f} "
            f"{min(run['times']):6.3f}-{max(run['times']):.3f} {t / base:6.2f}"
        )
    body = [
        [
            r["stage"],
            r["recompute_units"],
            f"{r['peak_bytes'] / 2**20:.2f}",
            f"{r['seconds_per_step']:.3f} ({r['spread'][0]:.3f}-{r['spread'][1]:.3f})",
            f"{r['time_vs_recompute']:.2f}",
        ]
        for r in rows
    ]
    headers = [
        "stage",
        "recompute_units",
        "compiled peak MiB",
        "s/step (spread)",
        "time vs recompute",
    ]
    write_results("recompute_units", rows, markdown=markdown_table(headers, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
