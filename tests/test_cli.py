"""`zerojax plan` in a fresh process (it sets the simulated device count before jax starts)."""
import json
import os
import subprocess
import sys

import pytest


def _plan(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-m", "zerojax.cli", "plan", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_plan_json_rows(tmp_path):
    out = _plan("--preset", "tiny", "--devices", "8", "--json", "--device-memory", "1GB",
                "--dump-hlo", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert {"stage", "offload", "peak_bytes", "at_rest_bytes", "comm_bytes",
                "cross_node_bytes", "fits"} <= set(r) and r["fits"] is True
    psi = rows[0]["params"]
    # bf16 params + fp32 master + Adam: 14Ψ at stage 0, 14Ψ/N at stage 3 (small leaves whole)
    assert rows[0]["at_rest_bytes"] == pytest.approx(14 * psi, rel=1e-3)
    assert rows[3]["at_rest_bytes"] == pytest.approx(14 * psi / 8, rel=0.03)
    assert rows[3]["at_rest_bytes"] < rows[1]["at_rest_bytes"] < rows[0]["at_rest_bytes"]
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".hlo.txt")]) == 8


def test_plan_table_and_bad_input():
    out = _plan("--preset", "tiny", "--devices", "4", "--stage", "3", "--device-memory",
                "1MB")
    assert out.returncode == 0 and "cheapest that fits 0.001 GB: none" in out.stdout
    bad = _plan("--preset", "tiny", "--mesh", "2x4")
    assert bad.returncode == 2 and "not supported yet" in bad.stderr
    unknown = _plan("--preset", "13b")
    assert unknown.returncode == 2 and "unknown preset" in unknown.stderr
