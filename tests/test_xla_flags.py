"""zerojax's default XLA flags: added before JAX starts, never over the user's, recorded."""

import os
import subprocess
import sys

CODE = (
    "import os, zerojax, zerojax.core.xla_flags as f; "
    "print(os.environ.get('XLA_FLAGS', '')); print(f.effective())"
)


def _run(env_update):
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "ZEROJAX_DEFAULT_XLA_FLAGS")
    }
    env.update(env_update)
    out = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_default_added_user_value_kept_and_opt_out():
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in _run({})
    mine = _run({"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"})
    assert "latency_hiding_scheduler=true" not in mine and "set by you" in mine
    assert "--xla_gpu_enable_pipelined_all_gather=true" in mine  # the others still added
    off = _run({"ZEROJAX_DEFAULT_XLA_FLAGS": "0"})
    assert "latency_hiding_scheduler=true" not in off.splitlines()[0] and "off" in off
