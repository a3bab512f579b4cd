"""A unit is a module, not one method: every method called on a unit (a tied head's
`Embed.attend`, an embedder's `encode`/`decode` as published models write it) runs on the
gathered weights and its gradient is reduce-scattered, Linen and NNX, against one device.
Models written here as a user would, importing nothing from zerojax."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, slow
from flax import nnx

import zerojax as zj

VOCAB, D = 128, 64


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * D)(nn.LayerNorm()(x))
        return x + nn.Dense(D)(nn.gelu(h))


class TiedLM(nn.Module):
    """Input embedding and output head share one table: `embed.attend` is the head."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D)
        x = embed(tokens)
        for _ in range(2):
            x = Block()(x)
        return embed.attend(nn.LayerNorm()(x))


class Embedder(nn.Module):
    """An embedder with `encode` and `decode` and no `__call__`, as gemma's is written."""

    def setup(self):
        self.table = self.param("table", nn.initializers.normal(1.0), (VOCAB, D))

    def encode(self, tokens):
        return jnp.take(self.table, tokens, axis=0)

    def decode(self, x):
        return x @ self.table.T


class EmbedderLM(nn.Module):
    def setup(self):
        self.embedder = Embedder()
        self.blocks = [Block() for _ in range(2)]
        self.norm = nn.LayerNorm()

    def __call__(self, tokens):
        x = self.embedder.encode(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embedder.decode(self.norm(x))


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, (16, 17)).astype(np.int32) for _ in range(n)]


def loss_of(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


# ---- Linen --------------------------------------------------------------------------------
def linen_init(model):
    def init_fn(key):
        from flax.training.train_state import TrainState

        params = model.init(key, jnp.zeros((1, 16), jnp.int32))["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2))

    return init_fn


def linen_step(state, batch):
    def loss_fn(params):
        return loss_of(state.apply_fn({"params": params}, batch[:, :-1]), batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


# model, the unit naming its table, the table's module path
LINEN = {"TiedLM": (TiedLM, "Embed", "Embed_0"), "EmbedderLM": (EmbedderLM, "Embedder", "embedder")}


@pytest.mark.parametrize(
    "name,stage", [("TiedLM", 3), ("EmbedderLM", 3), *slow(("TiedLM", 2), ("EmbedderLM", 1))]
)
def test_linen_unit_methods_run_on_gathered_weights(name, stage):
    cls, table, path = LINEN[name]
    batches = data(3)
    ref = jax.jit(linen_init(cls()))(jax.random.key(0))
    ref_step, want = jax.jit(linen_step), []
    for b in batches:
        ref, loss = ref_step(ref, b)
        want.append(float(loss))
    zero = zj.zero_shard(stage=stage, units=("Block", table), persistence_threshold=0)
    state = zero.init(linen_init(cls()), jax.random.key(0))
    step, got = zero(linen_step), []
    for b in batches:
        state, loss = step(state, b)
        got.append(float(loss))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(state.params, ref.params)
    units = step.units_of(state, batches[0])
    assert path in units, units
    if stage == 3:  # the table's gradient leaves reduce-scattered, its uses gathered
        rep = zero.report(step, state, batches[0])
        assert rep.bytes_of("reduce-scatter") > 0


# ---- NNX ----------------------------------------------------------------------------------
class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxTiedLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def nnx_build():
    model = NnxTiedLM(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def nnx_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: loss_of(m(batch[:, :-1]), batch))(model)
    optimizer.update(model, grads)
    return loss


NNX_CONFIGS = [
    (3, ("NnxBlock", "Embed")),
    (3, "Embed"),
    (3, "auto"),
    *slow((2, ("NnxBlock", "Embed")), (1, "Embed"), (3, ())),
]


@pytest.mark.parametrize("stage,units", NNX_CONFIGS)
def test_nnx_unit_methods_run_on_gathered_weights(stage, units):
    # every NNX configuration here must give one device's finite losses: a unit method run on
    # a shard once trained to nan with no error
    batches = data(3)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = nnx_build()
        single = nnx.jit(nnx_step)
        want = [float(single(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(stage=stage, units=units, persistence_threshold=0)
    model, optimizer = zero.init(nnx_build)
    step = zero(nnx_step)
    got = [float(step(model, optimizer, b)) for b in batches]
    assert np.all(np.isfinite(got)), got
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)))
