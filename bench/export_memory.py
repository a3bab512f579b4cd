"""Peak host memory of `zerojax checkpoint export`: it streams leaf by leaf.

    python bench/export_memory.py          # about 1 minute; writes ~2 GB under a temp dir

Saves a checkpoint of 16 fp32 parameter leaves of 64 MiB (1 GiB in all) from 8 simulated
devices at stage 3, then runs the export in a fresh process and reads that process's peak
resident set size (VmHWM), and the same for `checkpoint info` (same imports, no array read)
as the baseline. Writes bench/results/export_memory.json.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax.numpy as jnp  # noqa: E402

import zerojax as zj  # noqa: E402

LEAVES, LEAF_ELEMENTS = 16, 16 * 2**20  # 16 x 64 MiB of fp32


def measure() -> dict:
    with tempfile.TemporaryDirectory(prefix="zerojax-export-") as tmp:
        zero = zj.zero_shard(stage=3)
        state = zero.init(
            lambda: {
                "params": {
                    f"w{i:02d}": jnp.full((LEAF_ELEMENTS // 1024, 1024), i, jnp.float32)
                    for i in range(LEAVES)
                }
            }
        )
        with zj.CheckpointManager(os.path.join(tmp, "ckpt"), zero) as ckpt:
            ckpt.save(1, state)
        del state
        out = os.path.join(tmp, "params.safetensors")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        # the peak is read inside the exporting process (VmHWM): a child's ru_maxrss on Linux
        # keeps the high-water mark of the parent it was forked from
        code = (
            "import sys; from zerojax.commands.cli import main; rc = main(sys.argv[1:]); "
            "print('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0]);"
            " sys.exit(rc)"
        )

        def peak_rss(*args: str) -> int:
            done = subprocess.run(
                [sys.executable, "-c", code, "checkpoint", *args, os.path.join(tmp, "ckpt")],
                env=env,
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            return int(done.stdout.split("VmHWM")[1].split()[0]) * 1024

        # `checkpoint info` imports and opens the same things without reading an array: the
        # export's own memory is its peak above that baseline (the baseline differs by machine)
        baseline = peak_rss("info")
        peak = peak_rss("export", "--out", out)
        total = LEAVES * LEAF_ELEMENTS * 4
        result = {
            "total_bytes": total,
            "largest_leaf_bytes": LEAF_ELEMENTS * 4,
            "export_peak_rss_bytes": peak,
            "baseline_rss_bytes": baseline,
            "file_bytes": os.path.getsize(out),
        }
    return result


def main():
    result = measure()
    total = result["total_bytes"]
    print(
        f"model {total / 2**20:.0f} MiB in {LEAVES} leaves of {LEAF_ELEMENTS * 4 / 2**20:.0f} "
        f"MiB: export peak RSS {result['export_peak_rss_bytes'] / 2**20:.0f} MiB, "
        f"{(result['export_peak_rss_bytes'] - result['baseline_rss_bytes']) / 2**20:.0f} MiB "
        f"above `checkpoint info` on the same checkpoint"
    )
    path = pathlib.Path(__file__).parent / "results" / "export_memory.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
