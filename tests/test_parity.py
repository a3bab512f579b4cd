"""Every stage matches plain single-device optax training (float32, 10 steps)."""
import jax
import numpy as np
import optax
import pytest

import zerojax as zj
from common import (assert_params_close, batches, make_init, train_single_device, train_step,
                    train_zero)

# eps=1e-5: keeps float32 reduction-order noise in gradients that are ~0 (e.g. attention
# projections early in training) from being amplified into lr-sized Adam steps; with eps=1e-8
# any data-parallel run, stage 0 included, drifts ~3e-6 from one device after 10 steps.
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3, eps=1e-5, weight_decay=0.01),
    # SGD is sensitive to the gradient's scale (Adam is not): catches a wrong 1/N or missing sum.
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
}
DATA = batches(10)
REFERENCE = {}


def reference(opt):
    if opt not in REFERENCE:
        REFERENCE[opt] = train_single_device(OPTIMIZERS[opt](), DATA)
    return REFERENCE[opt]


@pytest.mark.parametrize("devices", [8, 4, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_device_adamw(stage, devices):
    ref_state, ref_losses = reference("adamw")
    zero = zj.zero_shard(stage=stage, mesh=zj.make_mesh(jax.devices()[:devices]),
                         persistence_threshold=0)
    state, losses = train_zero(zero, OPTIMIZERS["adamw"](), DATA)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_close(state.params, ref_state.params)


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_device_sgd(stage, explicit):
    ref_state, ref_losses = reference("sgd_momentum")
    zero = zj.zero_shard(stage=stage, explicit_collectives=explicit)
    state, losses = train_zero(zero, OPTIMIZERS["sgd_momentum"](), DATA)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_params_close(state.params, ref_state.params)
    assert_params_close(state.opt_state, ref_state.opt_state)


@pytest.mark.parametrize("explicit", [True, False])
def test_the_state_really_is_sharded_and_the_hook_is_used_when_asked(explicit):
    zero = zj.zero_shard(stage=3, persistence_threshold=0, explicit_collectives=explicit)
    state = zero.init(make_init(OPTIMIZERS["adamw"]()), jax.random.key(0))
    step = zero(train_step)
    state, _ = step(state, DATA[0])
    assert step.used_explicit_collectives == explicit
    kernel = state.params["block_0"]["Dense_0"]["kernel"]          # (64, 256)
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "data")
    assert kernel.addressable_shards[0].data.shape == (64, 256 // 8)
