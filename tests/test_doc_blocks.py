"""Every Python block of README.md and docs/*.md runs as a reader copies it: each in a fresh
process with 8 simulated CPU devices, in an empty directory (what it writes stays there). A
block that stops running fails here."""

import pathlib
import re
import subprocess
import sys

import pytest
from common import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


BLOCKS = [
    pytest.param(code, id=f"{page.name}#{i}")
    for page in PAGES
    for i, code in enumerate(python_blocks(page), start=1)
]


def run_block(code: str, cwd) -> subprocess.CompletedProcess:
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize("code", BLOCKS)
def test_doc_block_runs_as_written(code, tmp_path):
    out = run_block(code, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_broken_block_fails(tmp_path):
    code = python_blocks(ROOT / "README.md")[0].replace(
        "train_step(state, batch)", "train_stp(state, batch)"
    )
    out = run_block(code, tmp_path)
    assert out.returncode != 0 and "NameError" in out.stderr
