"""Why the test suite runs XLA's CPU backend at LLVM optimisation level 0 (tests/conftest.py):
compile seconds and seconds per step of three typical test steps (the tests' small GPT, 8
simulated devices) at `--xla_backend_optimization_level` 0 and 2 (XLA's default), each level
in its own process, the levels alternated over `--rounds` so both see the same machine load.

    python bench/compile_levels.py --rounds 2

Prints the median compile and step time per configuration and level, and the ratios.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = [
    {"stage": 3},
    {"stage": 2, "gradient_accumulation_steps": 2},
    {"stage": 1, "precision": "bf16"},
]


def measure() -> list:
    """[(compile s, s per step)] per config, in this process (its XLA_FLAGS set the level)."""
    import time

    import jax
    import optax

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from common import batches, initial_state, train_step

    import zerojax as zj

    out = []
    for options in CONFIGS:
        zero = zj.zero_shard(**options)
        state, step = zero.shard(initial_state(optax.adamw(1e-3))), zero(train_step)
        data = batches(6)
        lowered = step.lower(state, data[0])
        start = time.perf_counter()
        lowered.compile()
        compile_s = time.perf_counter() - start
        state, _ = step(state, data[0])  # compiles the step (and any micro-batch variant)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for batch in data[1:]:
            state, _ = step(state, batch)
        jax.block_until_ready(state)
        out.append((compile_s, (time.perf_counter() - start) / (len(data) - 1)))
    return out


def run_level(level: int) -> list:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count=8 --xla_backend_optimization_level={level}"
    )
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compile for real
    out = subprocess.run(
        [sys.executable, __file__, "--measure"], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    runs = {0: [], 2: []}
    for _ in range(args.rounds):
        for level in runs:
            runs[level].append(run_level(level))
    print(f"{'config':48s} {'level':>5s} {'compile s':>10s} {'s/step':>8s}")
    for i, options in enumerate(CONFIGS):
        med = {
            level: [statistics.median(r[i][j] for r in rs) for j in (0, 1)]
            for level, rs in runs.items()
        }
        for level, (c, s) in med.items():
            print(f"{json.dumps(options):48s} {level:5d} {c:10.2f} {s:8.3f}")
        print(
            f"{'':48s} O0/O2: compile {med[0][0] / med[2][0]:.2f}x, "
            f"step {med[0][1] / med[2][1]:.2f}x"
        )


if __name__ == "__main__":
    main()
