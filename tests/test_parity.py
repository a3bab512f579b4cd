"""Every stage matches plain single-device optax training: 10 steps in float64, where the
only difference a correct run may show is reduction order (~1e-15; tests/common.py, "Parity"),
and the parity check itself: it passes two one-device programs that sum in different orders
and fails a perturbed leaf or a broken reduction."""

import jax
import numpy as np
import optax
import pytest
from common import (
    EXACT_RTOL,
    PARITY_ATOL,
    PARITY_RTOL,
    assert_trees_close,
    batches,
    data_parallel_jit,
    initial_state,
    make_init,
    placed_as,
    relative_l2,
    train,
    train_single_device,
    train_step,
    train_zero,
)

import zerojax as zj

pytestmark = pytest.mark.usefixtures("x64")

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.01),
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
    zero = zj.zero_shard(
        stage=stage, mesh=zj.make_mesh(jax.devices()[:devices]), persistence_threshold=0
    )
    tx = OPTIMIZERS["adamw"]()
    start = zero.init(make_init(tx), jax.random.key(0))  # sharded from the start
    # Flax's initializers draw in float32 (its param_dtype), here partitioned over the mesh:
    # within float32 rounding of one device's init; the reference starts from the same values
    first = jax.device_get(start)
    assert_trees_close(first.params, initial_state(tx).params, PARITY_RTOL, PARITY_ATOL)
    ref_state, ref_losses = train_single_device(tx, DATA, start=first)
    state, losses = train(zero(train_step), start, DATA)
    np.testing.assert_allclose(losses, ref_losses, rtol=EXACT_RTOL)
    assert_trees_close(state.params, ref_state.params)


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_device_sgd(stage, explicit):
    ref_state, ref_losses = reference("sgd_momentum")
    zero = zj.zero_shard(stage=stage, explicit_collectives=explicit)
    state, losses = train_zero(zero, OPTIMIZERS["sgd_momentum"](), DATA)
    np.testing.assert_allclose(losses, ref_losses, rtol=EXACT_RTOL)
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
    """The bounds above are not so loose that a wrong reduction passes: with the gradient
    reduction broken, the same comparisons fail, by far."""
    import zerojax.comm.gather
    import zerojax.comm.hierarchy
    import zerojax.engine.local_step
    import zerojax.flax.unit_calls

    broken = _broken_reduction(zerojax.comm.hierarchy.reduce_gradient, how)
    for module in (zerojax.comm.gather, zerojax.flax.unit_calls, zerojax.engine.local_step):
        monkeypatch.setattr(module, "reduce_gradient", broken)
    ref_state, ref_losses = reference(opt)
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    state, losses = train_zero(zero, OPTIMIZERS[opt](), DATA)
    with pytest.raises(AssertionError, match="relative L2 difference"):
        assert_trees_close(state.params, ref_state.params)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses, ref_losses, rtol=EXACT_RTOL)
    worst = max(
        relative_l2(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(state.params),
            jax.tree_util.tree_leaves(ref_state.params),
            strict=True,
        )
    )
    print(f"{how} at stage {stage}: worst per-leaf relative L2 {worst:.3g}")
    assert worst > 1e6 * EXACT_RTOL, worst  # far outside the tolerance, not at its edge


def sliced_train_step(state, batch, parts=8):
    """`train_step` with the batch's gradient summed over `parts` slices of its rows, as data
    parallelism sums it: the same mathematics on one device, in another reduction order."""

    def loss_fn(params, rows):
        logits = state.apply_fn({"params": params}, rows["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, rows["targets"]).mean()

    rows = lambda i: jax.tree_util.tree_map(lambda x: x[i::parts], batch)
    grads = [jax.grad(loss_fn)(state.params, rows(i)) for i in range(parts)]
    mean = jax.tree_util.tree_map(lambda *g: sum(g) / parts, *grads)
    return state.apply_gradients(grads=mean), {}


def train_on_one_device(step, data):
    state = jax.device_put(initial_state(OPTIMIZERS["adamw"]()), jax.devices()[0])
    for batch in data:
        state, _ = jax.jit(step)(state, batch)
    return state.params


def worst_relative_l2(got, want) -> float:
    leaves = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True)
    return max(relative_l2(a, b) for a, b in leaves)


def test_the_parity_check_passes_reduction_order_noise_and_fails_a_perturbed_leaf():
    """Noise alone never fails the check: two one-device programs that differ only in the
    order they sum the batch's gradient pass it; a leaf off by 1e-3 of its norm fails it."""
    data = DATA[:3]
    whole = train_on_one_device(train_step, data)
    sliced = train_on_one_device(sliced_train_step, data)
    noise = worst_relative_l2(sliced, whole)
    assert 0 < noise < EXACT_RTOL, noise  # the orders differ, by float64 rounding only
    assert_trees_close(sliced, whole)
    # and plain jax.jit data parallelism on the 8 devices, XLA's own all-reduce
    state = initial_state(OPTIMIZERS["adamw"]())
    parallel, _ = train(data_parallel_jit(train_step), state, data)
    assert_trees_close(parallel.params, whole)
    with jax.enable_x64(False):  # the same two programs in float32: this CPU's noise there
        f32_noise = worst_relative_l2(
            train_on_one_device(sliced_train_step, data), train_on_one_device(train_step, data)
        )
    print(f"reduction-order noise: float64 {noise:.2g}, float32 {f32_noise:.2g}")
    kernel = ("block_0", "Dense_0", "kernel")
    perturbed = jax.tree_util.tree_map(lambda x: x, sliced)
    leaf = perturbed[kernel[0]][kernel[1]]
    leaf[kernel[2]] = leaf[kernel[2]] * (1 + 1e-3)
    with pytest.raises(AssertionError, match=r"\['block_0'\]\['Dense_0'\]\['kernel'\]"):
        assert_trees_close(perturbed, whole)
