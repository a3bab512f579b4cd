"""Every option at every stage either acts or says it does not: set away from its default on a
model written here (two residual MLP blocks and a head, Linen, a TrainState with Adam), it
changes the lowered step, or it is refused with a ZeroError naming it, or it leaves the step
exactly as it was and `zero_shard` warns once that it does nothing there
(`ZeroConfig.inert_options`). Never silently ignored."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import zerojax as zj

SAMPLES = {  # one value away from the default for each option the sweep sets
    "persistence_threshold": 0,
    "rules": ((r"Dense_1/kernel", None),),
    "prefetch": 0,
    "units": (),
    "recompute_units": True,
    "keep_gathered": (r".*",),
    "unit_buffers": True,
    "explicit_collectives": False,
    "donate": False,
    "precision": "bf16",
    "optimizer_state_dtype": "bf16",
    "grad_reduce_dtype": "bf16",
    "grad_accum_dtype": "bf16",
    "loss_scale": 128.0,
    "initial_scale_power": 8,
    "loss_scale_window": 10,
    "hysteresis": 1,
    "min_loss_scale": 2.0,
    "quantized_weights": True,
    "quantized_weights_block": 64,
    "hpz_partition_size": 4,
    "quantized_gradients": True,
    "quantized_gradients_bits": 8,
    "quantized_gradients_block": 16,
    "mics_shard_size": 4,
    "gradient_accumulation_steps": 2,
    "accumulate": "reduced",
    "gradient_clipping": 1.0,
    "on_nonfinite": "skip",
    "offload_optimizer": "cpu",
    "offload_param": "cpu",
    "offload_activations": True,
    "offload_update": "host",
}
NOT_SWEPT = {  # option -> where it is tested instead
    "stage": "the sweep's own axis",
    "axis": "mesh-dependent: test_the_axis_option_on_a_node_local_mesh_says_it_is_unused below",
    "logical_rules": "acts on the names a model declares: tests/test_tensor_parallel.py",
    "memory_budget": "acts at the first call, by compiling, at every stage: tests/test_budget.py",
    "train_batch_size": "a check of the batch's size at every stage: tests/test_config.py",
    "micro_batch_size": "a check of the batch's size at every stage: tests/test_config.py",
}


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32)(nn.relu(nn.Dense(64)(x)))


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(8)(x)


def init_fn(key):
    model = Model()
    params = model.init(key, jnp.zeros((1, 32)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def step(state, batch):
    def loss_fn(params):
        out = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


BATCH = {"x": jnp.ones((16, 32)), "y": jnp.ones((16, 8))}


def lowered(**options):
    """(the lowered step's text, the ZeroWarnings zero_shard and lowering gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero = zj.zero_shard(**options)
        state = zero.eval_shape(init_fn, jax.random.key(0))
        text = zero(step).lower(state, BATCH).as_text()
    return text, [str(w.message) for w in caught if issubclass(w.category, zj.ZeroWarning)]


def test_every_option_is_swept_or_says_where_it_is_tested():
    assert set(SAMPLES) | set(NOT_SWEPT) == set(zj.ZeroConfig.defaults())
    assert all(zj.ZeroConfig.defaults()[k] != v for k, v in SAMPLES.items())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_option_acts_or_is_refused_or_warns_that_it_does_nothing(stage):
    plain, _ = lowered(stage=stage)
    wrong = []
    for name, value in SAMPLES.items():
        try:
            text, said = lowered(stage=stage, **{name: value})
        except zj.ZeroError as e:
            if name not in str(e):
                wrong.append(f"{name}={value!r}: refused without naming it: {e}")
            continue
        idle = [m for m in said if f"{name}={value!r} does nothing" in m]
        if idle and text != plain:
            wrong.append(f"{name}={value!r}: warned that it does nothing, but the step changed")
        if not idle and text == plain:
            wrong.append(f"{name}={value!r}: the step is unchanged and nothing said so")
    assert not wrong, f"stage {stage}:\n" + "\n".join(wrong)


def test_an_unused_option_is_named_once_with_why():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zj.zero_shard(stage=1, prefetch=0, keep_gathered="Block_0", accumulate="reduced")
    (message,) = [str(w.message) for w in caught if issubclass(w.category, zj.ZeroWarning)]
    assert "prefetch=0 does nothing at stages 0-2: only stage 3 gathers parameters" in message
    assert "keep_gathered=('Block_0',) does nothing at stages 0-2" in message
    assert "accumulate='reduced' does nothing with one micro-batch per step" in message


def test_the_axis_option_on_a_node_local_mesh_says_it_is_unused():
    mesh = zj.make_mesh(local=4)
    with pytest.warns(
        zj.ZeroWarning, match="axis='batch' does nothing on a .'node', 'local'. mesh"
    ):
        zj.zero_shard(stage=3, mesh=mesh, axis="batch")
