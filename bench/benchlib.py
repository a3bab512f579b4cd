"""Shared by the bench commands: where they leave their results (bench/results/NAME.json, the
markdown table NAME.md, and NAME.png when matplotlib is installed: `pip install
'zerojax[examples]'`), running a worker function in a fresh process with N simulated devices,
and running a contender's command for the JSON line it prints."""

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


def write_results(name: str, data, draw=None, markdown: str | None = None) -> None:
    """Write `data` as JSON, `markdown` (the table BENCHMARKS.md shows, which bench/all.py
    copies there) as NAME.md and, with `draw(plt) -> figure`, the chart; print the paths."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}")
    if markdown is not None:
        (RESULTS / f"{name}.md").write_text(markdown)
        print(f"wrote {RESULTS / f'{name}.md'}")
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


def run_json(argv: list, env: dict | None = None, timeout: int = 900) -> dict:
    """Run a contender's command in a fresh process tree (this interpreter's packages) and
    return the JSON line its rank 0 prints (`zerojax launch` prefixes it with "[0] ")."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, **(env or {})}
    out = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=BENCH.parent
    )
    for line in reversed(out.stdout.splitlines()):
        line = line.removeprefix("[0] ")
        if line.startswith("{"):  # torchrun may abort at gloo shutdown after printing: fine
            return json.loads(line)
    raise RuntimeError(
        f"{' '.join(argv)} printed no result:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
    )


def markdown_table(headers: list, rows: list) -> str:
    """A GitHub markdown table of `rows` (lists of cells, already formatted)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def maxtext_missing(bench: str) -> bool:
    """Whether MaxText is absent for `bench`'s MaxText rows (and say so, with the fix)."""
    import importlib.util

    if importlib.util.find_spec("maxtext") is not None:
        return False
    print(
        f"{bench}: MaxText is not installed here; install it beside zerojax "
        "(bench/maxtext_lm.py says how) or pass --without-maxtext",
        file=sys.stderr,
    )
    return True
