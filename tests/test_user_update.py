"""The user's update code stays in charge under the managed update: a TrainState whose
`apply_gradients` does more than the default (an EMA of the parameters, a weight projection),
and NNX code around `optimizer.update`, see the real updated parameters with clipping,
accumulation, 16-bit parameters and on_nonfinite, and what they return is the new state.
Models written here as a user would, importing nothing from zerojax."""

from typing import Any

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


class Mlp(nn.Module):
    """A two-layer classifier with a layer norm, as a user writes one."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(128)(x)
        x = nn.LayerNorm()(nn.gelu(x))
        return nn.Dense(10)(x)


class EMAState(TrainState):
    """An exponential moving average of the parameters, updated in `apply_gradients`."""

    ema: Any = None

    def apply_gradients(self, *, grads, **kwargs):
        new = super().apply_gradients(grads=grads, **kwargs)
        return new.replace(ema=jax.tree.map(lambda e, p: 0.5 * e + 0.5 * p, self.ema, new.params))


class ProjectedState(TrainState):
    """Every kernel projected back into the unit-norm ball after the update (max-norm)."""

    def apply_gradients(self, *, grads, **kwargs):
        new = super().apply_gradients(grads=grads, **kwargs)
        clip = lambda w: w / jnp.maximum(1.0, jnp.linalg.norm(w, axis=0, keepdims=True))
        return new.replace(params=jax.tree.map(lambda w: clip(w) if w.ndim == 2 else w, new.params))


MODEL = Mlp()
ADAMW = lambda: optax.adamw(1e-2, eps=1e-5)


def init(cls, tx):
    def init_fn(key):
        params = MODEL.init(key, jnp.zeros((1, 32)))["params"]
        extra = {"ema": params} if cls is EMAState else {}
        return cls.create(apply_fn=MODEL.apply, params=params, tx=tx, **extra)

    return init_fn


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def data(n, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(batch, 32)).astype(np.float32), "y": rng.integers(0, 10, batch)}
        for _ in range(n)
    ]


def halves(batch):
    return [jax.tree.map(lambda x, i=i: x[i * 16 : (i + 1) * 16], batch) for i in range(2)]


# what each managed option is compared with on one device: the same optax transformation
# with the option written as optax (clipping, MultiSteps for accumulation: the user's
# apply_gradients runs on every micro-batch and sees the parameters unchanged until the
# k-th, as under optax.MultiSteps; on_nonfinite is apply_if_finite's skip)
OPTIONS = {
    "clip": (
        dict(gradient_clipping=0.1),
        lambda: optax.chain(optax.clip_by_global_norm(0.1), ADAMW()),
    ),
    "accumulation": (dict(gradient_accumulation_steps=2), lambda: optax.MultiSteps(ADAMW(), 2)),
    "on_nonfinite": (dict(on_nonfinite="skip"), ADAMW),
    "skip_nan": (dict(on_nonfinite="skip"), lambda: optax.apply_if_finite(ADAMW(), 10)),
}


def single_device(cls, make_tx, batches):
    state = jax.jit(init(cls, make_tx()))(jax.random.key(0))
    step = jax.jit(train_step)
    for b in batches:
        state, _ = step(state, b)
    return state


def zero_run(zero, cls, batches):
    state = zero.init(init(cls, ADAMW()), jax.random.key(0))
    step = zero(train_step)
    for b in batches:
        state, _ = step(state, b)
    return state


CASES = [
    ("EMAState", "clip", 2),
    ("EMAState", "clip", 3),
    ("EMAState", "accumulation", 3),
    ("EMAState", "on_nonfinite", 2),
    ("EMAState", "skip_nan", 3),
    ("ProjectedState", "clip", 3),
    ("ProjectedState", "accumulation", 1),
    *slow(
        ("EMAState", "clip", 1),
        ("EMAState", "accumulation", 1),
        ("EMAState", "accumulation", 2),
        ("EMAState", "on_nonfinite", 3),
        ("ProjectedState", "on_nonfinite", 2),
    ),
]


@pytest.mark.parametrize("cls_name,option,stage", CASES)
def test_apply_gradients_override_matches_single_device(cls_name, option, stage):
    cls = {"EMAState": EMAState, "ProjectedState": ProjectedState}[cls_name]
    options, make_tx = OPTIONS[option]
    batches = data(3)
    if option == "skip_nan":  # the second step's gradients are NaN: skipped, as one device's
        batches[1] = {**batches[1], "x": np.full_like(batches[1]["x"], np.nan)}
    micro = [m for b in batches for m in halves(b)] if option == "accumulation" else batches
    want = single_device(cls, make_tx, micro)
    got = zero_run(zj.zero_shard(stage=stage, **options), cls, micro)
    assert_trees_close(got.params, want.params)
    if cls is EMAState:
        assert_trees_close(got.ema, want.ema)
        assert relative_change(got.ema, got.params) > 1e-3  # the EMA lags: not a copy
    if cls is ProjectedState:  # the projection holds on the parameters zerojax keeps
        assert all(float(jnp.linalg.norm(w, axis=0).max()) <= 1 + 1e-5 for w in kernels(got))
        assert max(float(jnp.linalg.norm(w, axis=0).max()) for w in kernels(want)) > 0.99
    applied = len(batches) - (option == "skip_nan")
    assert int(got.step) == applied  # optimizer steps applied, not micro-batches or skipped


def kernels(tree):
    return [w for w in jax.tree.leaves(getattr(tree, "params", tree)) if w.ndim == 2]


def relative_change(a, b) -> float:
    num = sum(
        float(jnp.sum((x - y) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


# ---- 16-bit parameters: the user's code sees (and keeps) the fp32 master weights -------------
@pytest.mark.parametrize("stage", [3, *slow(1, 2)])
def test_apply_gradients_override_sees_the_fp32_master_in_bf16(stage):
    # one device has no fp32-master bf16 training to compare with, so the EMA is checked
    # against the master weights zerojax itself trained: ema_n = (ema_{n-1} + master_n) / 2
    zero = zj.zero_shard(stage=stage, precision="bf16")
    state = zero.init(init(EMAState, ADAMW()), jax.random.key(0))
    step = zero(train_step)
    want = jax.tree.map(np.asarray, state.ema)
    for b in data(3):
        state, _ = step(state, b)
        master = state.opt_state.master
        want = jax.tree.map(lambda e, m: 0.5 * e + 0.5 * np.asarray(m), want, master)
        same = jax.tree.map(
            lambda p, m: bool(jnp.all(p == m.astype(p.dtype))), state.params, master
        )
        assert all(jax.tree.leaves(same))
    assert_trees_close(state.ema, want)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}

    zero = zj.zero_shard(stage=stage, precision="bf16")  # a projection lands in the master
    state = zero.init(init(ProjectedState, ADAMW()), jax.random.key(0))
    step = zero(train_step)
    for b in data(3):
        state, _ = step(state, b)
    norms = [float(jnp.linalg.norm(w, axis=0).max()) for w in kernels(state.opt_state.master)]
    assert max(norms) <= 1 + 1e-5, norms


# ---- NNX: the user's code after optimizer.update sees the updated model ---------------------
class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(32, 128, rngs=rngs), nnx.Linear(128, 10, rngs=rngs)
        self.norm = nnx.LayerNorm(128, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.gelu(self.up(x))))


def nnx_objects(tx):
    def build():
        model = NnxMlp(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.clone(model)

    return build


def nnx_step(model, optimizer, ema, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    average = lambda e, p: 0.5 * e + 0.5 * p
    nnx.update(ema, jax.tree.map(average, nnx.state(ema, nnx.Param), nnx.state(model, nnx.Param)))
    return loss


@pytest.mark.parametrize(
    "option,stage",
    [("clip", 3), ("accumulation", 2), ("skip_nan", 3), *slow(("clip", 1), ("on_nonfinite", 2))],
)
def test_nnx_code_after_optimizer_update_matches_single_device(option, stage):
    options, make_tx = OPTIONS[option]
    batches = data(3)
    if option == "skip_nan":
        batches[1] = {**batches[1], "x": np.full_like(batches[1]["x"], np.nan)}
    micro = [m for b in batches for m in halves(b)] if option == "accumulation" else batches
    with jax.default_device(jax.devices()[0]):
        ref = nnx_objects(make_tx())()
        single = nnx.jit(nnx_step)
        for b in micro:
            single(*ref, b)
    zero = zj.zero_shard(stage=stage, **options)
    objs = zero.init(nnx_objects(ADAMW()))
    step = zero(nnx_step)
    for b in micro:
        step(*objs, b)
    pure = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
    assert_trees_close(pure(objs[0]), pure(ref[0]))
    assert_trees_close(pure(objs[2]), pure(ref[2]))  # the EMA, from the updated model
    assert relative_change(pure(objs[2]), pure(objs[0])) > 1e-3
    assert int(objs[1].step[...]) == len(batches) - (option == "skip_nan")


def test_nnx_code_after_optimizer_update_sees_the_fp32_master_in_bf16():
    zero = zj.zero_shard(stage=3, precision="bf16")
    objs = zero.init(nnx_objects(ADAMW()))
    step = zero(nnx_step)
    pure = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Param))
    want = jax.tree.map(np.asarray, pure(objs[2]))
    for b in data(3):
        step(*objs, b)
        master = objs[1].zerojax.get_value().master
        want = jax.tree.map(lambda e, m: 0.5 * e + 0.5 * np.asarray(m), want, master)
    assert_trees_close(pure(objs[2]), want)
    assert {x.dtype for x in jax.tree.leaves(pure(objs[0]))} == {jnp.dtype(jnp.bfloat16)}
