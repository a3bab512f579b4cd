"""Patterns of published model code, written here as that code writes them (importing nothing
from zerojax): a Linen `__call__` wrapped in `nn.jit` (as gemma's Transformer is), NNX objects
passed after the batch (as Flax's NNX gemma example passes its metrics)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, slow
from flax import nnx
from flax.training.train_state import TrainState

import zerojax as zj

VOCAB, D = 64, 64


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))


class JittedLM(nn.Module):
    """A language model whose `__call__` is compiled with Flax's lifted `nn.jit`."""

    @functools.partial(nn.jit)
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        for _ in range(3):
            x = Block()(x)
        return nn.Dense(VOCAB)(x)


def init_fn(key):
    model = JittedLM()
    params = model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
    # SGD with momentum, linear in the gradients: parity is the gradients' (what stage 3 with
    # these units computes). Adam's first steps are sign(g), where a gradient element at float
    # noise level can flip between reduction orders (jax 0.12's CPU dots: 1.8e-5 relative)
    return TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1, momentum=0.9))


def step_fn(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, (16, 9)).astype(np.int32) for _ in range(n)]


def test_nn_jit_wrapped_call_keeps_its_units_in_every_step_of_a_process():
    batches = tokens(2)
    ref = jax.jit(init_fn)(jax.random.key(0))
    ref_step = jax.jit(step_fn)  # the model traced at the batch's shape before any zero step
    for b in batches:
        ref, _ = ref_step(ref, b)
    want = ("Block_0", "Block_1", "Block_2")
    for attempt in range(2):  # a second zero step built in the same process
        zero = zj.zero_shard(stage=3)
        state = zero.init(init_fn, jax.random.key(0))
        step = zero(step_fn)
        for b in batches:
            state, _ = step(state, b)
        assert step.units == want, (attempt, step.units)
        assert_trees_close(state.params, ref.params)
        rep = zero.report(step, state, batches[0])  # describes the program that trained
        assert step.units == want and rep.bytes_of("reduce-scatter") > 0


# ---- NNX: every object the step changes is updated as nnx.jit updates it ---------------------
class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def nnx_build():
    model = Mlp(nnx.Rngs(0))
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), metrics


def nnx_step(model, optimizer, metrics, batch):
    """Flax's NNX examples' step: the metrics object updated in place."""

    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    metrics.update(loss=loss)


def nnx_data(n):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.integers(0, 4, 16)}
        for _ in range(n)
    ]


def test_nnx_objects_the_step_updates_are_updated_as_nnx_jit_updates_them():
    batches = nnx_data(3)
    with jax.default_device(jax.devices()[0]):
        ref = nnx_build()
        for b in batches:
            nnx.jit(nnx_step)(*ref, b)
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    objs = zero.init(nnx_build)
    step = zero(nnx_step)
    for b in batches:
        step(*objs, b)
    np.testing.assert_allclose(
        float(objs[2].compute()["loss"]), float(ref[2].compute()["loss"]), rtol=1e-5
    )
    assert_trees_close(nnx.to_pure_dict(nnx.state(objs[0])), nnx.to_pure_dict(nnx.state(ref[0])))


def after_the_batch(model, optimizer, rngs, batch, metrics, pad_id):
    """Flax's NNX gemma example's argument order: objects before and after the batch, then a
    Python int."""
    del rngs
    nnx_step(model, optimizer, metrics, {**batch, "y": batch["y"] + pad_id})


def test_nnx_objects_after_the_batch_are_updated_as_nnx_jit_updates_them():
    batches = nnx_data(2)
    with jax.default_device(jax.devices()[0]):
        model, optimizer, metrics = nnx_build()
        ref = (model, optimizer, nnx.Rngs(0), metrics)
        for b in batches:
            nnx.jit(after_the_batch, static_argnames="pad_id")(*ref[:3], b, ref[3], pad_id=0)
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer, metrics, rngs = zero.init(lambda: (*nnx_build(), nnx.Rngs(0)))
    step = zero(after_the_batch)
    for b in batches:
        step(model, optimizer, rngs, b, metrics, 0)
    assert step.used_explicit_collectives  # the batch was found after three objects
    np.testing.assert_allclose(
        float(metrics.compute()["loss"]), float(ref[3].compute()["loss"]), rtol=1e-5
    )
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref[0])))


def test_batch_argnum_names_the_batch_and_objects_inside_a_pytree_are_refused():
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer, metrics = zero.init(nnx_build)
    batch = nnx_data(1)[0]
    fresh = lambda: nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    counted = lambda model, optimizer, step_count, batch: nnx_step(model, optimizer, fresh(), batch)
    before = np.asarray(model.up.kernel[...])
    zero(counted, batch_argnum=3)(model, optimizer, np.int32(0), batch)
    assert not np.allclose(np.asarray(model.up.kernel[...]), before)  # it trained
    with pytest.raises(zj.ZeroError, match="batch_argnum=1 names no batch"):
        zero(counted, batch_argnum=1)(model, optimizer, np.int32(0), batch)
    inside = lambda model, optimizer, batch: nnx_step(model, optimizer, batch["m"], batch)
    with pytest.raises(zj.ZeroError, match="as an argument of its own"):
        zero(inside)(model, optimizer, {**batch, "m": metrics})


# ---- NNX: dropout keyed by an nnx.Rngs passed at call time -----------------------------------
class Dropped(nnx.Module):
    """Dropout with no stream of its own: the caller passes `rngs`, as Flax's NNX gemma does."""

    def __init__(self, rngs):
        self.lin, self.head = nnx.Linear(16, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        h = self.drop(self.lin(x), rngs=rngs)
        return self.head(h), h


def dropped_build():
    model = Dropped(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, optimizer, nnx.Rngs(dropout=1)


def dropped_step(model, optimizer, rngs, batch):
    def loss_fn(model, rngs):
        logits, h = model(batch["x"], rngs=rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), h

    (loss, h), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, rngs)
    optimizer.update(model, grads)
    return h


@pytest.mark.parametrize("stage", [0, 3, *slow(1, 2)])
def test_nnx_call_time_rngs_draw_per_device_masks_and_advance(stage):
    x = np.tile(np.random.default_rng(0).normal(size=(1, 16)), (16, 1)).astype(np.float32)
    batch = {"x": x, "y": np.zeros(16, np.int32)}  # 16 identical examples, 2 per device
    with jax.default_device(jax.devices()[0]):
        ref = dropped_build()
        want = [np.asarray(nnx.jit(dropped_step)(*ref, batch)) for _ in range(2)]
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    objs = zero.init(dropped_build)
    step = zero(dropped_step)
    got = [np.asarray(step(*objs, batch)) for _ in range(2)]
    for h, w in zip(got, want, strict=True):
        kept, kept_ref = (h != 0).mean(), (w != 0).mean()
        assert abs(kept - 0.5) < 0.1 and abs(kept_ref - 0.5) < 0.1, (kept, kept_ref)
        masks = {tuple(h[2 * d] != 0) for d in range(8)}  # each device's first example
        assert len(masks) == 8, "devices drew the same dropout mask"
    assert not np.array_equal(got[0] != 0, got[1] != 0)  # the stream advanced between steps
    assert int(objs[2].dropout.count[...]) == int(ref[2].dropout.count[...])


# ---- NNX: a frozen BatchNorm (running statistics read, not written) inside a unit ---------------
class FrozenBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)

    def __call__(self, x):
        return x + self.norm(self.lin(x))


class FrozenNet(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([FrozenBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def frozen_build():
    model = FrozenNet(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def frozen_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("stage", [3, 1, *slow(2)])
def test_nnx_frozen_batch_norm_in_a_unit_matches_single_device(stage):
    batches = nnx_data(3)
    with jax.default_device(jax.devices()[0]):
        ref = frozen_build()
        want = [float(nnx.jit(frozen_step)(*ref, b)) for b in batches]
    zero = zj.zero_shard(stage=stage, units="FrozenBlock", persistence_threshold=0)
    objs = zero.init(frozen_build)
    step = zero(frozen_step)
    got = [float(step(*objs, b)) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(nnx.state(objs[0])), nnx.to_pure_dict(nnx.state(ref[0])))
    assert step.units == ("blocks/0", "blocks/1")
