"""`zerojax plan --model MODULE:FUNCTION` on a model that lives outside zerojax
(`tests/plan_user_model.py`): its per-stage table on simulated CPU devices and, with libtpu,
for a TPU slice; at-rest bytes against the ZeRO formulas (fp32 params and AdamW: 4 bytes param
+ 8 optimizer state per parameter, Ψ = parameters, N = 8); and its mistakes named."""

import json
import os
import subprocess
import sys

import pytest
from common import subprocess_env
from test_tpu_compile import needs_libtpu

HERE = os.path.dirname(os.path.abspath(__file__))
N = 8


def _plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "zerojax.commands.cli", "plan", *args],
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        cwd=HERE,  # the user's directory: plan_user_model.py is importable from it
        capture_output=True,
        text=True,
        timeout=600,
    )


def _check_rows(out, target):
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [(r["stage"], r["target"]) for r in rows] == [(s, target) for s in range(4)]
    psi = rows[0]["params"]
    assert psi == 256 * 1024 + 1024 * 1024 + 1024 * 10 + 1024 + 1024 + 10 + 2 * (256 + 1024)
    assert rows[0]["at_rest_bytes"] == pytest.approx(12 * psi, rel=1e-3)  # all replicated
    assert rows[1]["at_rest_bytes"] == pytest.approx(4 * psi + 8 * psi / N, rel=0.01)
    # everything split but the small leaves (biases, norms: 0.5% of Ψ) kept whole
    assert rows[3]["at_rest_bytes"] == pytest.approx(12 * psi / N, rel=0.05)
    assert rows[3]["comm_sent_bytes"] > rows[1]["comm_sent_bytes"] > 0
    return rows


def test_plan_a_users_model_on_cpu_devices():
    out = _plan("--model", "plan_user_model:build", "--precision", "fp32", "--no-offload", "--json")
    _check_rows(out, "cpu")
    table = _plan("--model", "plan_user_model:build", "--precision", "fp32", "--stage", "3")
    assert table.returncode == 0, table.stderr[-2000:]
    assert "model plan_user_model:build: 1,325,578 parameters, 4 example(s) per device" in (
        table.stdout
    )


@needs_libtpu
def test_plan_a_users_model_for_a_tpu_slice():
    out = _plan(
        "--model",
        "plan_user_model:build",
        "--precision",
        "fp32",
        "--no-offload",
        "--json",
        "--topology",
        "v5e:2x4",
    )
    _check_rows(out, "tpu v5e:2x4")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "plan_user_model"], "must be MODULE:FUNCTION"),
        (["--model", "no_such_module:build"], "cannot import 'no_such_module'"),
        (["--model", "plan_user_model:nothing"], "has no function 'nothing'"),
        (["--model", "plan_user_model:train_step"], "must take no arguments and return"),
        (["--model", "plan_user_model:build", "--layers", "4"], "--layers shape the example"),
        (["--model", "plan_user_model:build", "--preset", "tiny"], "not allowed with argument"),
    ],
)
def test_plan_model_mistakes_are_named(args, message):
    out = _plan(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
