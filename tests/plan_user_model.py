"""A model written the way a user writes one, importing nothing from zerojax, for
`zerojax plan --model plan_user_model:build` (tests/test_plan_model.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (1024, 1024):
            x = nn.gelu(nn.Dense(width)(nn.LayerNorm()(x)))
        return nn.Dense(10)(x)


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def build():
    """(init_fn, train_step, one device's batch) for `zerojax plan --model`."""
    model = Classifier()
    init_fn = lambda key: train_state.TrainState.create(
        apply_fn=model.apply,
        params=model.init(key, jnp.zeros((1, 256)))["params"],
        tx=optax.adamw(1e-3),
    )
    batch = {
        "x": jax.ShapeDtypeStruct((4, 256), jnp.float32),
        "y": jax.ShapeDtypeStruct((4,), jnp.int32),
    }
    return init_fn, train_step, batch
