"""Rerun every benchmark of BENCHMARKS.md and rewrite its tables, in one command:

    python bench/all.py [--only peers_speed cpu_setup] [--skip-run]

Each benchmark runs as its own process (one at a time: they time or compile on the same
cores) and leaves its table in bench/results/NAME.md; the table then replaces what stands
between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in BENCHMARKS.md, and the header
between `<!-- bench:header -->` markers gets today's date, the machine, the versions and each
benchmark's wall time. `--skip-run` only rewrites BENCHMARKS.md from the tables already there.
The speed benchmarks need the benchmark-only installs of bench/torch_lm.py's docstring.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from importlib import metadata

BENCH = pathlib.Path(__file__).parent
DOC = BENCH.parent / "BENCHMARKS.md"
RUNS = BENCH / "results" / "runs.json"  # each benchmark's last run: date and wall time
# name -> its arguments, in BENCHMARKS.md's order
BENCHMARKS = {
    "peers_memory": [],
    "memory_at_peak": [],
    "inference_cost": [],
    "accelerator_compile": [],  # needs libtpu and MaxText (bench/maxtext_lm.py), else left
    "gpu_compile": [],  # needs the CUDA plugin and MaxText (bench/maxtext_lm.py), else left
    "optimizer_state_dtype": [],
    "recompute_units": [],
    "peers_comm": [],
    "unit_collectives": [],
    "hlo_audit": [],
    "compile_time": ["--rounds", "3"],
    "peers_speed": ["--rounds", "3"],
    "cpu_setup": ["--rounds", "2"],
    "peers_scaling": ["--budget", "40GB"],
}


def versions() -> str:
    names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "deepspeed"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB RAM"


def splice(text: str, name: str, table: str) -> str:
    """`text` with the block between NAME's markers replaced by `table`."""
    pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(<!-- /bench:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"BENCHMARKS.md has no <!-- bench:{name} --> markers: add them")
    return pattern.sub(lambda m: m.group(1) + table + m.group(2), text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="these benchmarks")
    parser.add_argument("--skip-run", action="store_true", help="only rewrite BENCHMARKS.md")
    args = parser.parse_args()
    chosen = args.only or list(BENCHMARKS)
    for name in ["header", *chosen]:  # before hours of running, not after
        splice(DOC.read_text(), name, "")
    walls = {}
    for name in [] if args.skip_run else chosen:
        print(f"== {name} {' '.join(BENCHMARKS[name])}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call([sys.executable, str(BENCH / f"{name}.py"), *BENCHMARKS[name]])
        walls[name] = time.perf_counter() - t0
        if code:
            print(f"{name} failed (exit {code}); its table in BENCHMARKS.md is left as it was")
            del walls[name]
    runs = json.loads(RUNS.read_text()) if RUNS.exists() else {}
    today = datetime.date.today().isoformat()
    runs.update({n: {"date": today, "wall_min": round(w / 60, 1)} for n, w in walls.items()})
    RUNS.write_text(json.dumps(runs, indent=1))
    text = DOC.read_text()
    for name in chosen:
        result = BENCH / "results" / f"{name}.md"
        if result.exists():
            text = splice(text, name, result.read_text())
    each = "; ".join(f"{n} {r['wall_min']} min ({r['date']})" for n, r in runs.items())
    total = sum(r["wall_min"] for r in runs.values())
    header = (
        f"Tables rewritten by `python bench/all.py` (last {today}). **Machine**: {machine()}. "
        f"**Versions**: {versions()}. **Wall time** of every benchmark, {total:.0f} min in all: "
        f"{each or 'none recorded yet'}.\n"
    )
    DOC.write_text(splice(text, "header", header))
    print(f"rewrote {DOC}\n{header}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
