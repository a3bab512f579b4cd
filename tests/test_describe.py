"""`zero.describe`: the table of every leaf (golden file for the example 'small' preset) and the
guard on leaves that stay replicated."""

import os
import pathlib
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zerojax as zj
from zerojax.models import LM, LM_PRESETS
from zerojax.models.gpt import make_init

GOLDEN = pathlib.Path(__file__).parent / "golden" / "describe_small_stage3_bf16_offload.txt"


def test_describe_small_preset_matches_golden_file(capsys):
    """Regenerate with ZEROJAX_UPDATE_GOLDEN=1 after a deliberate change to the rules; the diff
    of this file is the review of that change."""
    zero = zj.zero_shard(
        stage=3, precision="bf16", offload_optimizer="cpu", mesh=zj.make_mesh(jax.devices()[:8])
    )
    state = zero.eval_shape(
        make_init(LM(LM_PRESETS["small"]), optax.adamw(3e-4)), jax.random.key(0)
    )
    out = zero.describe(state)
    text = capsys.readouterr().out
    assert text == str(out)
    if os.environ.get("ZEROJAX_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    # the figures the table adds up: 4 bytes per fp32 master/moment element over 8 devices
    master = [r for r in out.rows if r.path == "opt_state/master/layers/MLP_0/up/kernel"][0]
    assert master.bytes_per_device == 6 * 256 * 704 * 4 // 8 and master.memory == "pinned_host"
    param = [r for r in out.rows if r.path == "params/layers/MLP_0/up/kernel"][0]
    assert param.bytes_per_device == 6 * 256 * 704 * 2 // 8 and param.memory == "device"
    assert out.replicated_fraction < 0.001


def odd_state(key):
    params = {"table": jnp.zeros((203, 7)), "kernel": jnp.zeros((64, 256))}
    tx = optax.sgd(0.1)
    return {"params": params, "opt_state": tx.init(params)}


def test_replicated_leaves_warn_and_tolerance_raises():
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    # 203 x 7 x 4 bytes of 203 x 7 x 4 + 64 x 256 x 4: 7.98% stays whole on every device,
    # said once, when the zero first plans the state
    with pytest.warns(
        zj.ZeroWarning, match=r"divides by 8 devices, 7\.98% .* params/table \(203, 7\)"
    ):
        state = zero.eval_shape(odd_state, jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", zj.ZeroWarning)
        out = zero.describe(state, show=False)
    assert out.replicated_fraction == pytest.approx(203 * 7 / (203 * 7 + 64 * 256))
    with pytest.raises(zj.ZeroError, match=r"tolerance 2\.00%.*params/table"):
        zero.describe(state, tolerance=0.02, show=False)
    zero.describe(
        zj.zero_shard(stage=3, persistence_threshold=0).shard(
            {"params": {"kernel": jnp.zeros((64, 256))}, "opt_state": ()}
        ),
        tolerance=0.0,
        show=False,
    )  # nothing replicated: passes a zero tolerance
