"""Every leaf of the state is placed by a rule: model-sized floating leaves outside `params` and
`opt_state` (a frozen base model in its own TrainState field, the common JAX way to do LoRA;
an EMA of the parameters) are split at stage 3, and an EMA from stage 1 like the optimizer
state, as DeepSpeed's ZeRO-3 partitions frozen parameters. `describe` counts them. Models
written here as a user would."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, slow
from flax.training.train_state import TrainState

import zerojax as zj


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.gelu(nn.Dense(256)(x)))
        return nn.Dense(16)(x)


MODEL, RANK = Mlp(), 4


class LoraState(TrainState):
    """`params` holds the low-rank adapters of the first kernel; `base` the frozen model."""

    base: Any = None


def lora_init(key):
    base = MODEL.init(key, jnp.zeros((1, 64)))["params"]
    k1, _ = jax.random.split(key)
    lora = {"a": 0.01 * jax.random.normal(k1, (64, RANK)), "b": jnp.zeros((RANK, 256))}
    return LoraState.create(apply_fn=MODEL.apply, params=lora, tx=optax.adam(1e-2), base=base)


def merged(base, lora):
    dense = base["Dense_0"]
    return {**base, "Dense_0": {**dense, "kernel": dense["kernel"] + lora["a"] @ lora["b"]}}


def lora_step(state, batch):
    def loss_fn(lora):
        logits = state.apply_fn({"params": merged(state.base, lora)}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


class EMAState(TrainState):
    ema: Any = None


def ema_init(key):
    params = MODEL.init(key, jnp.zeros((1, 64)))["params"]
    return EMAState.create(apply_fn=MODEL.apply, params=params, tx=optax.adam(1e-2), ema=params)


def ema_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    new = state.apply_gradients(grads=grads)
    ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema, new.params)
    return new.replace(ema=ema), loss


def data(n):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(32, 64)).astype(np.float32), "y": rng.integers(0, 16, 32)}
        for _ in range(n)
    ]


def device_share(tree) -> float:
    """Bytes device 0 holds of `tree`'s live shards over the bytes of the whole `tree`."""
    held = whole = 0
    for x in jax.tree.leaves(tree):
        whole += x.nbytes
        held += sum(s.data.nbytes for s in x.addressable_shards if s.device.id == 0)
    return held / whole


CASES = {
    "lora": (lora_init, lora_step, "base"),
    "ema": (ema_init, ema_step, "ema"),
}


@pytest.mark.parametrize(
    "name,stage", [("lora", 3), ("ema", 3), ("ema", 2), *slow(("ema", 1), ("lora", 2))]
)
def test_model_sized_other_fields_are_split_and_train_like_one_device(name, stage):
    init_fn, step_fn, field = CASES[name]
    batches = data(3)
    ref = jax.jit(init_fn)(jax.random.key(0))
    for b in batches:
        ref, _ = jax.jit(step_fn)(ref, b)
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    state = zero.init(init_fn, jax.random.key(0))
    step = zero(step_fn)
    for b in batches:
        state, _ = step(state, b)
    assert_trees_close(state.params, ref.params)
    assert_trees_close(getattr(state, field), getattr(ref, field))
    share = device_share(getattr(state, field))
    split = stage == 3 or name == "ema"  # stages 1-2 split only what mirrors a parameter
    if split:  # each device holds its 1/8, give or take a leaf no dim of which divides by 8
        assert share <= 1.1 / 8, share
    else:
        assert share == 1.0, share
    zero.describe(state, tolerance=0.02, show=False)  # nothing the stage splits kept whole


def test_describe_counts_a_model_sized_other_leaf_kept_whole():
    zero = zj.zero_shard(stage=3, persistence_threshold=0, rules=[("^base/", None)])
    state = zero.init(lora_init, jax.random.key(0))
    assert device_share(state.base) == 1.0  # the rule keeps it whole: the one way to ask
    with pytest.raises(zj.ZeroError, match="base/Dense_0/kernel"):
        zero.describe(state, tolerance=0.02, show=False)
    rows = {r.path: r for r in zero.describe(state, show=False).rows}
    assert rows["base/Dense_0/kernel"].replicated and not rows["step"].split
