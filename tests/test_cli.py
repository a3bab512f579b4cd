"""`zerojax plan` in a fresh process (it sets the simulated device count before jax starts)."""

import json
import os
import subprocess
import sys

import pytest
from common import subprocess_env


def _plan(*args):
    env = subprocess_env(JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "zerojax.commands.cli", "plan", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_plan_json_rows(tmp_path):
    out = _plan(
        "--preset",
        "tiny",
        "--devices",
        "8",
        "--json",
        "--device-memory",
        "1GB",
        "--dump-hlo",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [(r["stage"], r["offload"]) for r in rows] == [
        (0, "none"),
        (1, "none"),
        (2, "none"),
        (3, "none"),
        (1, "optimizer"),
        (2, "optimizer"),
        (3, "optimizer"),
        (3, "optimizer+param"),
    ]
    for r in rows:
        assert {
            "stage",
            "offload",
            "peak_bytes",
            "at_rest_bytes",
            "comm_bytes",
            "cross_node_bytes",
            "fits",
            "peak_by_category",
        } <= set(r) and r["fits"] is True
        assert sum(r["peak_by_category"].values()) <= r["peak_bytes"]
    psi = rows[0]["params"]
    # bf16 params + fp32 master + Adam: 14Ψ at stage 0, 14Ψ/N at stage 3 (small leaves whole)
    assert rows[0]["at_rest_bytes"] == pytest.approx(14 * psi, rel=1e-3)
    assert rows[3]["at_rest_bytes"] == pytest.approx(14 * psi / 8, rel=0.03)
    assert rows[3]["at_rest_bytes"] < rows[1]["at_rest_bytes"] < rows[0]["at_rest_bytes"]
    # offloaded optimizer at stage 3: bf16 shard 2Ψ/N on the device, master + Adam 12Ψ/N on the
    # host; with the parameters offloaded too, only scalars (step counts, loss scale) stay
    assert rows[6]["at_rest_bytes"] == pytest.approx(2 * psi / 8, rel=0.03)
    assert rows[6]["host_bytes"] == pytest.approx(12 * psi / 8, rel=0.03)
    assert rows[7]["at_rest_bytes"] < 64
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".hlo.txt")]) == 2 * len(rows)


def test_plan_table_and_bad_input():
    out = _plan(
        "--preset",
        "tiny",
        "--devices",
        "4",
        "--stage",
        "3",
        "--device-memory",
        "1MB",
        "--no-offload",
        "--explain-peak",
        "--memory-budget",
        "1GB",
    )
    assert out.returncode == 0 and "cheapest that fits 0.001 GB: none" in out.stdout
    # what is alive at the peak, and the planning flag that keeps CPU-only weight copies out
    assert "alive at the peak" in out.stdout and "of the compiled peak" in out.stdout
    assert "while-loop-invariant-code-motion (zerojax plan" in out.stdout
    # the budget's choice (remat blocks: keeping them gathered would save nothing)
    assert "memory_budget 953.7 MiB: stage 3 needs at least" in out.stdout
    assert "kept gathered: none" in out.stdout
    bad = _plan("--preset", "tiny", "--mesh", "3x3")
    assert bad.returncode != 0 and "NODES x LOCAL = --devices 8" in bad.stderr
    unknown = _plan("--preset", "13b")
    assert unknown.returncode == 2 and "unknown preset" in unknown.stderr


def test_plan_on_a_node_local_mesh_counts_cross_node_bytes():
    out = _plan(
        "--preset",
        "tiny",
        "--mesh",
        "2x4",
        "--stage",
        "3",
        "--no-offload",
        "--json",
        "--device-memory",
        "1GB",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["zeropp"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"none", "qwZ+hpZ+qgZ", "MiCS"}
    assert all(r["mesh"] == {"node": 2, "local": 4} for r in rows.values())
    plain, zeropp = rows["none"], rows["qwZ+hpZ+qgZ"]
    assert plain["cross_node_bytes"] == plain["comm_sent_bytes"]  # every group spans nodes
    assert zeropp["cross_node_bytes"] < 0.3 * plain["cross_node_bytes"]
    assert rows["MiCS"]["at_rest_bytes"] > plain["at_rest_bytes"]  # sharded over 4, not 8


@pytest.mark.slow
def test_plan_max_batch_finds_the_largest_batch_that_fits():
    """Each row's max_batch fits the device memory and one more sequence does not (checked by
    planning those batch sizes), and ZeRO's stages fit at least stage 0's batch."""
    small = ["--preset", "tiny", "--layers", "1", "--seq-len", "32", "--devices", "2"]
    memory = ["--device-memory", "40MB"]
    out = _plan(*small, *memory, "--no-offload", "--max-batch", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["stage"]: r for r in json.loads(out.stdout)}
    assert rows[0]["max_batch"] > 1
    assert all(rows[s]["max_batch"] >= rows[0]["max_batch"] for s in (1, 2, 3))
    for batch, fits in ((rows[2]["max_batch"], True), (rows[2]["max_batch"] + 1, False)):
        check = _plan(
            *small, *memory, "--stage", "2", "--no-offload", "--batch-size", str(batch), "--json"
        )
        assert json.loads(check.stdout)[0]["fits"] is fits
