"""Shared by the bench commands: where they leave their tables (bench/results/NAME.json, and
NAME.png when matplotlib is installed: `pip install 'zerojax[examples]'`), and running a
worker function in a fresh process with N simulated devices."""

import json
import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).parent
RESULTS = BENCH / "results"


def run_with_devices(n: int, module: str, call: str, timeout: int = 1800):
    """`call` (a Python expression such as "worker(8, 3)" over the names of bench/`module`.py)
    evaluated in a fresh process with `n` simulated CPU devices; its JSON-able result."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    code = (
        f"import sys, json; sys.path.insert(0, {str(BENCH)!r}); "
        f"from {module} import *; print(json.dumps({call}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH.parent,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_results(name: str, data, draw=None) -> None:
    """Write `data` as JSON and, with `draw(plt) -> figure`, the chart; print the paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    if draw is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no chart)")
        return
    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / f'{name}.png'}")
