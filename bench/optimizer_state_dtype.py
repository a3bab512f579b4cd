"""bf16 optimizer state against fp32, measured on the example: the 300-step pretraining run of
examples/pretrain_lm.py (preset tiny, stage 3, 8 simulated devices) once with each
`--optimizer-state-dtype`, then the final training and eval losses and the state at rest.

    python bench/optimizer_state_dtype.py            # about 3 minutes on 2 cores

Formula: Adam's two moments are 8Ψ/N bytes per device at stage 3 in fp32, 4Ψ/N in bf16.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from benchlib import markdown_table, write_results

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run(dtype: str, steps: int, log_dir: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "pretrain_lm.py"),
            "--steps",
            str(steps),
            "--no-progress",
            "--optimizer-state-dtype",
            dtype,
            "--log-dir",
            log_dir,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    rest = re.search(r"state at rest ([\d,.]+) MiB", out)
    return {
        "loss": next(r["loss"] for r in reversed(records) if "loss" in r),
        "eval_loss": next(r["eval_loss"] for r in reversed(records) if "eval_loss" in r),
        "at_rest_mib": float(rest.group(1).replace(",", "")) if rest else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("fp32", "bf16"):
            results[dtype] = run(dtype, args.steps, os.path.join(tmp, dtype))
    f, b = results["fp32"], results["bf16"]
    print(f"{args.steps} steps, preset tiny, stage 3, N = 8")
    print(f"{'optimizer state':<16}{'train loss':>11}{'eval loss':>11}{'at rest MiB':>13}")
    for dtype, r in results.items():
        print(f"{dtype:<16}{r['loss']:>11.4f}{r['eval_loss']:>11.4f}{r['at_rest_mib']:>13.1f}")
    diff = (
        f"bf16 - fp32: train {(b['loss'] - f['loss']) / f['loss']:+.2%}, eval "
        f"{(b['eval_loss'] - f['eval_loss']) / f['eval_loss']:+.2%}"
    )
    print(diff)
    body = [
        [dtype, f"{r['loss']:.4f}", f"{r['eval_loss']:.4f}", f"{r['at_rest_mib']:.1f}"]
        for dtype, r in results.items()
    ]
    headers = ["optimizer state", "train loss", "eval loss", "at rest MiB"]
    md = markdown_table(headers, body) + f"\n{args.steps} steps. {diff}.\n"
    write_results("optimizer_state_dtype", results, markdown=md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
