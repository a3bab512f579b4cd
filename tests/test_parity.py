"""Every stage matches plain single-device optax training (float32, 10 steps)."""

import jax
import numpy as np
import optax
import pytest
from common import (
    PARITY_RTOL,
    assert_trees_close,
    batches,
    initial_state,
    placed_as,
    relative_l2,
    train_single_device,
    train_step,
    train_zero,
)

import zerojax as zj

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


# every stage on 8 devices; other device counts (other reduction orders) on two stages
@pytest.mark.parametrize("stage,devices", [(0, 8), (1, 8), (2, 8), (3, 8), (2, 4), (3, 2)])
def test_stage_matches_single_device_adamw(stage, devices):
    ref_state, ref_losses = reference("adamw")
    zero = zj.zero_shard(
        stage=stage, mesh=zj.make_mesh(jax.devices()[:devices]), persistence_threshold=0
    )
    state, losses = train_zero(zero, OPTIMIZERS["adamw"](), DATA, via_init=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.params, ref_state.params)


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_device_sgd(stage, explicit):
    ref_state, ref_losses = reference("sgd_momentum")
    zero = zj.zero_shard(stage=stage, explicit_collectives=explicit)
    state, losses = train_zero(zero, OPTIMIZERS["sgd_momentum"](), DATA)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.params, ref_state.params)
    assert_trees_close(state.opt_state, ref_state.opt_state)


@pytest.mark.parametrize("explicit", [True, False])
def test_the_state_really_is_sharded_and_the_hook_is_used_when_asked(explicit):
    zero = zj.zero_shard(stage=3, persistence_threshold=0, explicit_collectives=explicit)
    state = zero.shard(initial_state(OPTIMIZERS["adamw"]()))
    step = zero(train_step)
    state, _ = step(state, DATA[0])
    assert step.used_explicit_collectives == explicit
    kernel = state.params["block_0"]["Dense_0"]["kernel"]  # (64, 256)
    assert placed_as(kernel, "data")
    assert kernel.addressable_shards[0].data.shape == (64 // 8, 256)


def _broken_reduction(original, how):
    """`comm.hierarchy.reduce_gradient` with a deliberate bug: device 0's gradient dropped, or
    the per-device gradients summed N times too large (as if each device took its own mean)."""

    def reduce(g, dim, comm, *args, **kwargs):
        if how == "drop_device_0":
            g = g * (jax.lax.axis_index(comm.data_axis) != 0).astype(g.dtype)
        else:
            g = g * comm.data_size
        return original(g, dim, comm, *args, **kwargs)

    return reduce


@pytest.mark.parametrize(
    "stage,how,opt", [(3, "drop_device_0", "adamw"), (2, "no_mean", "sgd_momentum")]
)
def test_parity_checks_fail_on_a_broken_reduction(monkeypatch, stage, how, opt):
    """The tolerances above are loose enough for any CPU's rounding, not so loose that a wrong
    reduction passes: with the gradient reduction broken, the same comparisons fail."""
    import zerojax.comm.gather
    import zerojax.comm.hierarchy
    import zerojax.engine.local_step
    import zerojax.flax.gather

    broken = _broken_reduction(zerojax.comm.hierarchy.reduce_gradient, how)
    for module in (zerojax.comm.gather, zerojax.flax.gather, zerojax.engine.local_step):
        monkeypatch.setattr(module, "reduce_gradient", broken)
    ref_state, ref_losses = reference(opt)
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    state, losses = train_zero(zero, OPTIMIZERS[opt](), DATA)
    with pytest.raises(AssertionError, match="relative L2 difference"):
        assert_trees_close(state.params, ref_state.params)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    worst = max(
        relative_l2(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(state.params),
            jax.tree_util.tree_leaves(ref_state.params),
            strict=True,
        )
    )
    print(f"{how} at stage {stage}: worst per-leaf relative L2 {worst:.3g}")
    assert worst > 100 * PARITY_RTOL, worst  # far outside the tolerance, not at its edge
