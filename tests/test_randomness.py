"""Dropout on the explicit path: GPT-2-style models written the way users write them (Linen in
tests/test_units.py, NNX in tests/test_nnx_units.py), dropout in every block, stage-3 units
found from outside. Each device draws its own stream (the user's key folded with its position
on the data axes), the same at every stage, so stages 0-3 train identically with dropout on;
units draw exactly the keys the bound modules would, and backward recomputes with them."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zerojax as zj
from tests import test_nnx_units as nnx_lm
from tests import test_units as linen_lm
from tests.common import PARITY_RTOL, assert_trees_close


def linen_step(state, batch):
    """A new dropout key per step, as Flax's examples make one."""
    key = jax.random.fold_in(jax.random.key(7), state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch[:, :-1], rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def tokens(steps, seq=16):
    return np.random.default_rng(0).integers(0, 64, (steps, 16, seq + 1), dtype=np.int32)


def train(stage, fn, build, data, **options):
    """(losses, state or objects, step) after training `fn` at `stage`, with no fallback."""
    zero = zj.zero_shard(stage=stage, **options)
    state = zero.init(*build)
    step, losses = zero(fn), []
    with warnings.catch_warnings():
        warnings.simplefilter("error", zj.ZeroWarning)
        for batch in data:
            if isinstance(state, tuple):  # NNX (model, optimizer)
                losses.append(float(step(*state, batch)))
            else:
                state, loss = step(state, batch)
                losses.append(float(loss))
    assert step.used_explicit_collectives
    return np.array(losses), state, step


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_linen_dropout_stages_0_to_3_train_identically(scan):
    model = linen_lm.Transformer(2, scan, d=32, heads=2, vocab=64, dropout=0.1)
    build, data = (linen_lm.init_fn(model, 16), jax.random.key(0)), tokens(3)
    ref_losses, ref, _ = train(0, linen_step, build, data)
    for stage in (2, 3) if scan else (1, 2, 3):
        losses, state, step = train(stage, linen_step, build, data)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert_trees_close(state.params, ref.params)  # backward used forward's masks
    assert step.units == (("blocks",) if scan else ("block_0", "block_1"))


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_nnx_dropout_stages_0_to_3_train_identically(scan):
    build = (nnx_lm.make(2, d=32, vocab=64, dropout=0.1, scan=scan),)
    data = tokens(3)
    ref_losses, (ref_model, _), _ = train(0, nnx_lm.train_step, build, data)
    for stage in (2, 3):
        losses, (model, _), step = train(stage, nnx_lm.train_step, build, data)
        np.testing.assert_allclose(losses, ref_losses, rtol=PARITY_RTOL)
        params = nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param)
        assert_trees_close(*params, **nnx_lm.FLOAT32_ISLANDS)
        # the RNG streams advanced once per draw, as outside zerojax: the count is the same
        counts = nnx.state(model, nnx.RngCount)
        assert_trees_close(counts, nnx.state(ref_model, nnx.RngCount))
    assert step.units == (("blocks",) if scan else ("blocks/0", "blocks/1"))


class Wide(nn.Module):
    """An MLP with heavy dropout: identical inputs differ only by their masks."""

    @nn.compact
    def __call__(self, x, train=True):
        h = nn.relu(nn.Dense(256)(x))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(1)(h)[:, 0]


@pytest.mark.parametrize("stage", [0, 3])
def test_each_device_draws_its_own_masks(stage):
    """16 identical examples on 8 devices (2 each): were the key replicated, example i and
    i + 2 would share a mask and the per-example outputs would repeat with period 2."""
    model = Wide()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]
    zero = zj.zero_shard(stage=stage, units="Dense")
    state = zero.shard(
        train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0))
    )

    def step(state, x):
        out = state.apply_fn({"params": state.params}, x, rngs={"dropout": jax.random.key(3)})
        return state, out

    state, out = zero(step)(state, np.ones((16, 8), np.float32))
    out = np.asarray(out)
    assert len(np.unique(out.round(5))) == 16, out.reshape(8, 2)
    # the same streams at every stage: stage 0's outputs are stage 3's
    zero0 = zj.zero_shard(stage=0)
    _, out0 = zero0(step)(zero0.shard(jax.device_get(state)), np.ones((16, 8), np.float32))
    np.testing.assert_allclose(out, np.asarray(out0), rtol=1e-6)


def test_dropout_blocks_are_units_so_stage_3_bounds_the_peak():
    """Before units took RNG streams, 'auto' left dropout blocks gathered whole for the step
    (as units=() does): 8 scanned layers, sequence 128, recomputing (each unit keeps only its
    input), 18.58 MiB against 3.42 MiB now."""

    def peak(units):
        zero = zj.zero_shard(stage=3, units=units, recompute_units=bool(units))
        model = linen_lm.Transformer(8, True, dropout=0.1)
        state = zero.eval_shape(linen_lm.init_fn(model, 128), jax.random.key(0))
        batch = jax.ShapeDtypeStruct((8, 129), jnp.int32)
        return zero.report(zero(linen_step), state, batch).peak_bytes

    assert peak("auto") < 0.3 * peak(()), (peak("auto"), peak(()))
