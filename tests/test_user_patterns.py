"""What users write around a model, each against one device at stage 3 (and one more stage in
the slow lane): LoRA by optax.masked and by multi_transform, a block shared by two calls,
parameters a step does not use, optax.MultiSteps as the user's own accumulation, auxiliary
outputs, and integer counters in the state. docs/nnx.md lists these patterns with this file.
Models written here as a user would, importing nothing from zerojax."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, in_run_dtype, run_rtol, slow
from flax.training.train_state import TrainState

import zerojax as zj


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(64)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))


class Net(nn.Module):
    """Two blocks, one of them called twice (shared weights), and a head never used when
    `probe` is False (unused parameters)."""

    @nn.compact
    def __call__(self, x, probe=False):
        x = nn.Dense(64)(x)
        shared = Block()
        x = shared(Block()(shared(x)))
        head = nn.Dense(10)(x)
        return nn.Dense(10, name="probe")(x) if probe else head


MODEL = Net()


class CountingState(TrainState):
    """A TrainState with integer and boolean counters the step updates."""

    seen: Any = None
    any_large: Any = None


def lora_labels(params):
    """'train' for the input projection and the head (top-level Dense_0, Dense_1), 'freeze'
    for the blocks: the adapters of a LoRA-style fine-tune."""
    top = ("['Dense_0']", "['Dense_1']")
    train = lambda path: "train" if path.startswith(top) else "freeze"
    return jax.tree_util.tree_map_with_path(lambda p, _: train(jax.tree_util.keystr(p)), params)


def marked(params, label):
    return jax.tree.map(lambda x: x == label, lora_labels(params))


TXS = {
    "adamw": lambda: optax.adamw(1e-2, eps=1e-5),
    "masked": lambda: optax.chain(  # optax.masked passes masked-out updates through: zero them
        optax.masked(optax.adamw(1e-2, eps=1e-5), lambda p: marked(p, "train")),
        optax.masked(optax.set_to_zero(), lambda p: marked(p, "freeze")),
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"train": optax.adamw(1e-2, eps=1e-5), "freeze": optax.set_to_zero()}, lora_labels
    ),
    "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-2, eps=1e-5), 2),
}


def init(tx):
    def init_fn(key):
        params = in_run_dtype(MODEL.init(key, jnp.zeros((1, 32)), probe=True)["params"])
        return CountingState.create(
            apply_fn=MODEL.apply,
            params=params,
            tx=tx,
            seen=jnp.zeros((), jnp.int32),
            any_large=jnp.zeros((), bool),
        )

    return init_fn


def train_step(state, batch):
    """Auxiliary outputs through has_aux, and counters updated beside the parameters."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"logits": logits, "accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads)
    new = new.replace(seen=state.seen + batch["y"].shape[0], any_large=state.any_large | (loss > 2))
    return new, {"loss": loss, "accuracy": aux["accuracy"], "logits": aux["logits"]}


def data(n):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(32, 32)).astype(np.float32), "y": rng.integers(0, 10, 32)}
        for _ in range(n)
    ]


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize(
    "tx_name,stage",
    [
        ("adamw", 3),
        ("masked", 3),
        ("multi_transform", 3),
        ("multisteps", 3),
        *slow(("adamw", 2), ("masked", 1), ("multisteps", 2)),
    ],
)
def test_user_patterns_match_single_device(tx_name, stage):
    batches = data(4)
    ref = jax.jit(init(TXS[tx_name]()))(jax.random.key(0))
    ref_step, want = jax.jit(train_step), []
    for b in batches:
        ref, metrics = ref_step(ref, b)
        want.append(metrics)
    zero = zj.zero_shard(stage=stage, units="Block", persistence_threshold=0)
    state = zero.init(init(TXS[tx_name]()), jax.random.key(0))
    step, got = zero(train_step), []
    for b in batches:
        state, metrics = step(state, b)
        got.append(metrics)
    assert_trees_close(state.params, ref.params)
    assert_trees_close(state.opt_state, ref.opt_state)
    for g, w in zip(got, want, strict=True):  # auxiliary outputs, per example and scalar
        np.testing.assert_allclose(g["loss"], w["loss"], rtol=run_rtol())
        np.testing.assert_allclose(g["accuracy"], w["accuracy"], rtol=1e-6)
        np.testing.assert_allclose(g["logits"], w["logits"], rtol=1e-4, atol=1e-5)
    assert int(state.seen) == 4 * 32 and bool(state.any_large) == bool(ref.any_large)
    assert int(state.step) == int(ref.step) == 4
    # the probe head is never used: its gradient is zero, and so is Adam's first moment of it
    # (AdamW's weight decay still moves it: as on one device, which the parameters matched)
    start = jax.jit(init(TXS[tx_name]()))(jax.random.key(0)).params
    if tx_name in ("masked", "multi_transform"):  # frozen: unchanged
        assert_trees_close(state.params["probe"], start["probe"])
        assert_trees_close(state.params["Block_0"], start["Block_0"])
    else:
        leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
        paths = [(jax.tree_util.keystr(p), x) for p, x in leaves]
        moments = [x for p, x in paths if ".mu['probe']" in p]
        assert moments and not any(np.any(np.asarray(m)) for m in moments), paths
    assert step.units == ("Block_0", "Block_1")
