"""The fastest way to run 8 devices' work on this CPU machine, found by measurement: the LM of
bench/peers_speed.py at zerojax stages 0 and 3 (global batch 64 x 128, fp32 AdamW) under each
candidate set-up — processes x devices layouts (1 x 8 simulated devices, 2 x 4 and 8 x 1
through `zerojax launch`), one intra-op thread per process instead of XLA's pool
(`--xla_cpu_multi_thread_eigen=false`), and the CPU back-end flags this jaxlib has
(`--xla_cpu_use_onednn`, `--xla_cpu_use_xnnpack`, `--xla_cpu_enable_fast_math`).

    python bench/cpu_setup.py [--rounds 2] [--steps 4]

Candidates alternate, round after round, each a fresh process timing --steps steps after 2
warm-up steps; figures are the median over rounds of the per-round median step time, with the
spread. Writes bench/results/cpu_setup.json and .md.
"""

import argparse
import pathlib
import statistics
import sys

from benchlib import markdown_table, run_json, write_results

BENCH = pathlib.Path(__file__).parent
PY = sys.executable
ZEROJAX = str(pathlib.Path(PY).parent / "zerojax")
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false"


def candidates() -> dict:
    """name -> (launcher prefix, XLA flags besides the device count)."""
    eight = "--xla_force_host_platform_device_count=8"

    def launch(p: int, d: int) -> list:
        return [ZEROJAX, "launch", "-n", str(p), "--devices-per-process", str(d), "--"]

    return {
        "1 x 8 (default)": ([], eight),
        "1 x 8, oneDNN": ([], f"{eight} --xla_cpu_use_onednn=true"),
        "1 x 8, XNNPACK": ([], f"{eight} --xla_cpu_use_xnnpack=true"),
        "1 x 8, fast math": ([], f"{eight} --xla_cpu_enable_fast_math=true"),
        "1 x 8, one thread": ([], f"{eight} {ONE_THREAD}"),
        "2 x 4": (launch(2, 4), ""),
        "8 x 1": (launch(8, 1), ""),
        "8 x 1, one thread each": (launch(8, 1), ONE_THREAD),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    table = candidates()
    times: dict = {(name, s): [] for name in table for s in (0, 3)}
    for r in range(args.rounds):
        for (name, stage), got in times.items():
            prefix, flags = table[name]
            cmd = [*prefix, PY, str(BENCH / "jax_lm.py"), "--stage", str(stage)]
            cmd += ["--steps", str(args.steps), "--warmup", "2"]
            got.append(run_json(cmd, {"XLA_FLAGS": flags} if flags else {})["step_s_median"])
            print(f"round {r + 1}: {name:<24} stage {stage} {got[-1]:.3f} s/step", flush=True)
    med = {key: statistics.median(t) for key, t in times.items()}
    default = "1 x 8 (default)"
    rows = []
    for name in table:
        cells = [name]
        for stage in (0, 3):
            t = times[(name, stage)]
            ratio = med[(default, stage)] / med[(name, stage)]
            cells += [f"{med[(name, stage)]:.3f} ({min(t):.3f}–{max(t):.3f})", f"{ratio:.2f}"]
        rows.append(cells)
    best = min(table, key=lambda n: med[(n, 0)] + med[(n, 3)])
    speedup = (med[(default, 0)] + med[(default, 3)]) / (med[(best, 0)] + med[(best, 3)])
    headers = [
        "set-up",
        "stage 0 s/step (spread)",
        "default / it",
        "stage 3 s/step (spread)",
        "default / it",
    ]
    md = markdown_table(headers, rows) + (
        f"\n{args.rounds} rounds x {args.steps} steps. Fastest over both stages: **{best}** "
        f"({speedup:.2f}x the default's speed).\n"
    )
    print("\n" + md)
    data = {
        "times": {f"{n} | stage {s}": t for (n, s), t in times.items()},
        "fastest": best,
        "fastest_over_default": speedup,
    }
    write_results("cpu_setup", data, markdown=md)


if __name__ == "__main__":
    sys.exit(main())
