"""Host offload (memory kinds): bitwise the same training, state resting where it should, the
device peak it promises, activations saved on the host."""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, host_state

import zerojax as zj
from zerojax.models.gpt import make_init, train_step
from zerojax.models.lm import LM, LM_PRESETS
from zerojax.update.managed import ZeroOptState

CFG = LM_PRESETS["tiny"].replace(n_layers=2, d_model=64, n_heads=4, d_ff=128, seq_len=16)
INIT = make_init(LM(CFG), optax.adamw(1e-3, eps=1e-5, weight_decay=0.01))
DATA = [
    np.random.default_rng(i).integers(0, CFG.vocab, (16, CFG.seq_len + 1), np.int32)
    for i in range(8)
]
RUNS = {}


def train(**options):
    """(losses, final state on the host) of 8 steps; runs of the same options are cached."""
    key = repr(sorted(options.items()))
    if key not in RUNS:
        zero = zj.zero_shard(persistence_threshold=0, **options)
        state, step, losses = zero.shard(host_state(INIT)), zero(train_step), []
        for batch in DATA:
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        RUNS[key] = (losses, jax.device_get(state), state)
    return RUNS[key]


def assert_bitwise(got, want):
    assert got[0] == want[0]
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(got[1].params)[0],
        jax.tree_util.tree_leaves(want[1].params),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "base,offload",
    [
        (dict(stage=1), dict(offload_optimizer="cpu")),
        (dict(stage=2, precision="bf16"), dict(offload_optimizer={"device": "cpu"})),
        (dict(stage=3), dict(offload_optimizer="cpu", offload_param="cpu")),
        (dict(stage=3), dict(offload_activations=True)),
        (dict(stage=2), dict(offload_activations=True)),
        (dict(stage=1, gradient_accumulation_steps=2), dict(offload_optimizer="cpu")),
    ],
    ids=["s1-opt", "s2-bf16-opt", "s3-opt-param", "s3-act", "s2-act", "s1-accum-opt"],
)
def test_offload_trains_bitwise_like_no_offload(base, offload):
    losses, host_state, state = train(**base, **offload)
    assert_bitwise((losses, host_state), train(**base)[:2])
    opt = state.opt_state  # the optimizer's own state (local accumulation's per-device
    opt = (opt.inner, opt.master) if isinstance(opt, ZeroOptState) else opt  # sums stay)
    kinds = {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(opt) if np.ndim(x)}
    assert kinds == ({"pinned_host"} if "offload_optimizer" in offload else {"device"})


def test_update_on_host_matches_update_on_device():
    # The host update is a separately compiled program: its fusion (and so its float rounding)
    # differs from the device step's, so it matches to float32 rounding, not bitwise.
    losses, state, _ = train(stage=2, offload_optimizer="cpu", offload_update="host")
    want_losses, want, _ = train(stage=2)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    assert_trees_close(state.params, want.params)


def _report(model_cfg, **options):
    zero = zj.zero_shard(**options)
    state = zero.eval_shape(make_init(LM(model_cfg), optax.adam(1e-3)), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((8, model_cfg.seq_len + 1), jnp.int32)
    return zero.report(zero(train_step), state, batch), state


def test_offloaded_optimizer_rests_on_host_by_the_formula():
    rep, state = _report(LM_PRESETS["small"], stage=3, precision="bf16", offload_optimizer="cpu")
    psi, n = sum(x.size for x in jax.tree_util.tree_leaves(state.params)), 8
    # device: the bf16 parameter shard 2Ψ/N; host: fp32 master 4Ψ/N + Adam's two moments 8Ψ/N
    assert abs(sum(rep.resident.values()) - 2 * psi / n) <= 0.02 * 2 * psi / n
    assert abs(sum(rep.host_resident.values()) - 12 * psi / n) <= 0.02 * 12 * psi / n
    assert "state offloaded to host memory" in str(rep)


def test_offloaded_parameters_keep_the_device_peak_flat():
    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "bench"))
    from stage3_depth import BASE

    peak = {}
    for name, options in (
        ("stage 3", {}),
        ("offload", dict(offload_optimizer="cpu", offload_param="cpu")),
    ):
        for layers in (4, 8):
            rep, _ = _report(BASE.replace(n_layers=layers), stage=3, **options)
            peak[(name, layers)] = rep.peak_bytes
            if name == "offload":
                assert rep.resident.get("params", 0) == 0  # parameters rest on the host
    slope = lambda name: (peak[(name, 8)] - peak[(name, 4)]) / 4
    assert slope("offload") <= slope("stage 3")


@pytest.mark.parametrize("stage", [2, 3])
def test_activation_offload_saves_residuals_in_host_memory(stage):
    def host_residuals(on):
        zero = zj.zero_shard(stage=stage, offload_activations=on)
        state = zero.eval_shape(INIT, jax.random.key(0))
        batch = jax.ShapeDtypeStruct((16, CFG.seq_len + 1), jnp.int32)
        return len(re.findall(r"<host>\[", str(zero(train_step).trace(state, batch).jaxpr)))

    # on CPU the compiler keeps host and device in one memory, so the jaxpr is where it shows
    assert host_residuals(False) == 0 and host_residuals(True) > 0
