"""User mistakes fail at once, with a message that says what to change."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import batches, initial_state, train_step

import zerojax as zj


@pytest.fixture(scope="module")
def zero_and_state():
    zero = zj.zero_shard(stage=3)
    return zero, zero.shard(initial_state(optax.adam(1e-3)))


def test_batch_not_divisible_by_devices(zero_and_state):
    zero, state = zero_and_state
    batch = batches(1, batch_size=12)[0]
    with pytest.raises(zj.ZeroError, match=r"inputs has 12 rows.*multiple of 8"):
        zero(train_step)(state, batch)


def test_state_without_params():
    zero = zj.zero_shard(stage=2)
    with pytest.raises(zj.ZeroError, match="no `params`"):
        zero.init(lambda key: {"weights": jnp.zeros((8, 8)), "opt_state": ()}, jax.random.key(0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage": 5}, "stage must be 0, 1, 2 or 3"),
        ({"stag": 3}, "unknown zerojax option 'stag' \\(did you mean 'stage'\\?\\)"),
        ({"persistence_threshold": -1}, "persistence_threshold must be"),
        ({"rules": [("(", 0)]}, "does not compile"),
        ({"axis": "model", "mesh": "default"}, "mesh has axes \\('data',\\)"),
    ],
)
def test_bad_options(kwargs, match):
    if kwargs.get("mesh") == "default":
        kwargs = {**kwargs, "mesh": zj.make_mesh()}
    with pytest.raises(zj.ZeroError, match=match):
        zj.zero_shard(**kwargs)


def test_state_not_placed_by_zero(zero_and_state):
    zero, _ = zero_and_state
    plain = jax.device_put(initial_state(optax.adam(1e-3)), jax.devices()[0])
    with pytest.raises(zj.ZeroError, match="zero.shard\\(state\\)"):
        zero(train_step)(plain, batches(1)[0])


def test_a_state_made_with_train_state_create_names_zero_init(zero_and_state):
    # TrainState.create leaves `step` a Python int and the parameters wherever they were
    zero, _ = zero_and_state
    with pytest.raises(
        zj.ZeroError, match="state leaf .step is a int.*zero.init\\(init_fn, key\\)"
    ):
        zero(train_step)(initial_state(optax.adam(1e-3)), batches(1)[0])


def test_the_step_inside_another_jit_says_to_call_it_directly(zero_and_state):
    zero, _ = zero_and_state
    state, step = zero.shard(initial_state(optax.adam(1e-3))), zero(train_step)
    with pytest.raises(zj.ZeroError, match="inside another JAX transformation.*directly"):
        jax.jit(step)(state, batches(1)[0])
    assert int(step(state, batches(1)[0])[0].step) == 1  # the state is still usable


def test_step_must_return_the_state(zero_and_state):
    zero, state = zero_and_state
    with pytest.raises(zj.ZeroError, match="must return the new state"):
        zero(lambda s, b: {"loss": 0.0})(state, batches(1)[0])


def test_model_output_that_is_not_per_example(zero_and_state):
    zero, state = zero_and_state

    def step(state, batch):
        def loss_fn(params):  # reduces inside apply_fn: the output is a scalar
            return state.apply_fn({"params": params}, batch["inputs"]).mean()

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    wrapped_apply = state.apply_fn
    state = state.replace(apply_fn=lambda v, x: wrapped_apply(v, x).mean())
    with pytest.raises(zj.ZeroError, match="explicit_collectives=False"):
        zj.zero_shard(stage=3)(step)(zero.shard(state), batches(1)[0])


def test_a_good_state_is_left_usable_after_a_failed_call(zero_and_state):
    zero, state = zero_and_state
    with pytest.raises(zj.ZeroError):
        zero(train_step)(state, batches(1, batch_size=12)[0])
    new_state, metrics = zero(train_step)(state, batches(1)[0])  # nothing was donated
    assert np.isfinite(float(metrics["loss"]))


def test_managed_update_needs_a_managed_state():
    zero = zj.zero_shard(stage=2, precision="bf16")
    plain = zj.zero_shard(stage=2).shard(initial_state(optax.adam(1e-3)))
    with pytest.raises(zj.ZeroError, match="zero.init\\(...\\) or zero.shard\\(...\\)"):
        zero(train_step)(plain, batches(1)[0])
    managed = zero.shard(plain)  # shard() adds master weights and buffers
    state, metrics = zero(train_step)(managed, batches(1)[0])
    assert np.isfinite(float(metrics["loss"])) and "loss_scale" in metrics


def test_apply_gradients_twice_in_a_managed_step():
    zero = zj.zero_shard(stage=1, gradient_clipping=1.0)
    state = zero.shard(initial_state(optax.adam(1e-3)))

    def twice(state, batch):
        new, metrics = train_step(state, batch)
        return train_step(new, batch)

    with pytest.raises(zj.ZeroError, match="exactly once"):
        zero(twice)(state, batches(1)[0])


def test_bf16_needs_the_apply_fn_hook():
    zero = zj.zero_shard(stage=2, precision="bf16", explicit_collectives=False)
    state = zero.shard(initial_state(optax.adam(1e-3)))
    with pytest.raises(zj.ZeroError, match="explicit_collectives=True"):
        zero(train_step)(state, batches(1)[0])
