"""A unit is called as its module is: positional and keyword arguments, arrays of any dtype
(differentiable or not, computed by another unit), Python values that stay static (a
`train: bool`, a string, None, an enum, a callable, a dataclass) and NNX objects given at call
time. Each case trains at stages 0-3 and matches one device; a property test draws the
argument structures, and fails when a static value is traced."""

import dataclasses
import enum

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close
from flax import nnx
from flax.training.train_state import TrainState
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerojax as zj
from zerojax.flax import unit_calls

D, ROWS = 16, 16
STAGES = (0, 1, 2, 3)


def linen_parity(model, inputs: dict, stages=STAGES):
    """`model` trained 2 SGD steps at each stage against one device (`inputs`: the model's
    call's batch arrays, passed as keywords); returns each stage's units."""

    def init_fn(key):
        params = model.init(key, **inputs)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1, 0.9))

    def step(state, batch):
        loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, **batch) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with jax.default_device(jax.devices()[0]):
        ref = jax.jit(init_fn)(jax.random.key(0))
        for _ in range(2):
            ref, _ = jax.jit(step)(ref, inputs)
    units = {}
    for stage in stages:
        zero = zj.zero_shard(stage=stage, persistence_threshold=0)
        state, zstep = zero.init(init_fn, jax.random.key(0)), zero(step)
        for _ in range(2):
            state, _ = zstep(state, inputs)
        assert_trees_close(state.params, ref.params, rtol=1e-5, atol=1e-6)
        units[stage] = zstep.units
    assert units.get(3, ("x",)), "stage 3 found no units: the test tests nothing"
    return units


# ---- the regression: `train: bool` on a block, positional ------------------------------------
class FlagBlock(nn.Module):
    """The commonest Flax block signature: a Python flag switching dropout and attention."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.MultiHeadDotProductAttention(num_heads=2, deterministic=not train)(x)
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return x + nn.Dense(D)(nn.gelu(h))


class FlagModel(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        for _ in range(3):
            x = FlagBlock()(x, train)  # positional, as most published models pass it
        return x


def test_a_block_with_a_python_train_flag_trains_at_every_stage():
    x = np.random.default_rng(0).normal(size=(ROWS, 4, D)).astype(np.float32)
    units = linen_parity(FlagModel(), {"x": x})
    assert units[3] == ("FlagBlock_0", "FlagBlock_1", "FlagBlock_2")


# ---- an array by keyword, computed by another unit (Gemma 4's kv_shared_cache) ----------------
class SharedKV(nn.Module):
    """Computes its own keys (`shared=None`) or reuses the ones an earlier layer made."""

    @nn.compact
    def __call__(self, x, *, shared=None, positions=None, scale=1.0):
        kv = nn.Dense(D, name="kv")(x) if shared is None else shared
        if positions is not None:  # an integer array by keyword: not differentiated
            kv = kv + jnp.sin(positions[..., None].astype(kv.dtype))
        h = nn.Dense(D)(x) * jax.nn.sigmoid(kv) * scale
        return x + h, kv


class SharingModel(nn.Module):
    @nn.compact
    def __call__(self, x, positions):
        x, kv = SharedKV()(x, positions=positions)
        for _ in range(2):
            x, _ = SharedKV()(x, shared=kv, scale=0.5)  # kv's gradient flows back to layer 0
        return x


def test_an_array_by_keyword_from_another_unit_is_differentiated_through():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, D)).astype(np.float32)
    positions = rng.integers(0, 8, ROWS).astype(np.int32)
    units = linen_parity(SharingModel(), {"x": x, "positions": positions})
    assert units[3] == ("SharedKV_0", "SharedKV_1", "SharedKV_2")


# ---- NNX: an nnx.Rngs given to each block at call time (Flax's NNX gemma example) -----------
class RngBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin, self.drop = nnx.Linear(D, D, rngs=rngs), nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return x + self.drop(self.lin(x), rngs=rngs)


class RngModel(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([RngBlock(rngs) for _ in range(3)])
        self.head = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, x, rngs=None):
        for block in self.blocks:
            x = block(x, rngs=rngs)
        return self.head(x)


def rng_build():
    model = RngModel(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), nnx.Rngs(dropout=1)


def rng_step(model, optimizer, rngs, batch):
    def loss_fn(model, rngs):
        logits = model(batch["x"], rngs=rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model, rngs.fork())
    optimizer.update(model, grads)
    return loss


def test_nnx_blocks_given_rngs_at_call_time_train_at_every_stage_as_stage_0():
    """Stage 0's dropout masks are what each device draws from its keys; every stage draws
    the same ones (stages 1-3 inside units, forward and backward alike) and advances the
    stream as `nnx.jit` does."""
    x = np.random.default_rng(0).normal(size=(ROWS, D)).astype(np.float32)
    batch = {"x": x, "y": np.arange(ROWS) % 4}
    results = {}
    for stage in STAGES:
        zero = zj.zero_shard(stage=stage, persistence_threshold=0)
        model, optimizer, rngs = zero.init(rng_build)
        step = zero(rng_step)
        losses = [float(step(model, optimizer, rngs, batch)) for _ in range(2)]
        assert int(rngs.dropout.count[...]) == 2
        results[stage] = (losses, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        assert stage == 0 or step.units == ("blocks/0", "blocks/1", "blocks/2")
    for stage in STAGES[1:]:
        np.testing.assert_allclose(results[stage][0], results[0][0], rtol=1e-5)
        assert_trees_close(results[stage][1], results[0][1], rtol=1e-5, atol=1e-6)
    assert results[0][0][0] != results[0][0][1]  # the masks changed between steps


# ---- property: argument structures drawn for a unit -----------------------------------------
class Mode(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclasses.dataclass(frozen=True)
class Scaling:
    factor: float


def _use(h, value):
    """`h` changed by one drawn argument, as a module would use it (a Python value in Python
    control flow: it must stay static)."""
    if isinstance(value, bool):
        return h * 2.0 if value else h
    if isinstance(value, float):
        return h * value
    if isinstance(value, str):
        return getattr(jax.nn, value)(h)
    if isinstance(value, Mode):
        return jnp.tanh(h) if value is Mode.TANH else jax.nn.relu(h)
    if isinstance(value, Scaling):
        return h * value.factor
    if callable(value):
        return value(h)
    if isinstance(value, dict):  # a pytree of arrays: float, int, bool
        h = h + value["f"]
        return jnp.where(value["b"][:, None], h, -h) + value["i"][:, None]
    if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
        return h + jax.random.normal(value, h.shape[-1:])
    return h * value  # a float array: differentiated


class Drawn(nn.Module):
    names: tuple  # the keyword arguments' names; the rest come positionally

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        h = nn.Dense(D)(x)
        for value in (*args, *(kwargs[k] for k in self.names)):
            if value is not None:
                h = _use(h, value)
        return x + nn.Dense(D)(h)


def _value(kind: str, x):
    """A value of `kind` for a call on `x` (arrays computed from `x` row by row: each device
    runs the model on its own rows)."""
    return {
        "flag": True,
        "number": 0.5,
        "string": "gelu",
        "none": None,
        "enum": Mode.TANH,
        "callable": jnp.sin,
        "dataclass": Scaling(0.75),
        "float array": jnp.tanh(x),
        "pytree": {
            "f": jnp.cos(x),
            "i": (x[:, 0] > 0).astype(jnp.int32) * 3,
            "b": x[:, 1] > 0,
        },
        "key": jax.random.key(7),
    }[kind]


KINDS = [
    "flag",
    "number",
    "string",
    "none",
    "enum",
    "callable",
    "dataclass",
    "float array",
    "pytree",
    "key",
]


class DrawnModel(nn.Module):
    kinds: tuple
    keyword: tuple  # per kind: passed by keyword?

    @nn.compact
    def __call__(self, x):
        names = tuple(f"k{i}" for i, kw in enumerate(self.keyword) if kw)
        for _ in range(2):
            values = [_value(kind, x) for kind in self.kinds]
            args = [v for v, kw in zip(values, self.keyword, strict=True) if not kw]
            pairs = enumerate(zip(values, self.keyword, strict=True))
            kwargs = {f"k{i}": v for i, (v, kw) in pairs if kw}
            x = Drawn(names)(x, *args, **kwargs)
        return x


calls = st.lists(st.tuples(st.sampled_from(KINDS), st.booleans()), min_size=1, max_size=4)


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(calls)
def test_drawn_argument_structures_train_at_every_stage_as_on_one_device(drawn):
    kinds, keyword = zip(*drawn, strict=True)
    x = np.random.default_rng(0).normal(size=(ROWS, D)).astype(np.float32)
    units = linen_parity(DrawnModel(kinds, keyword), {"x": x}, stages=(0, 1, 3))
    assert units[3] == ("Drawn_0", "Drawn_1")


def test_the_property_fails_when_static_arguments_are_traced(monkeypatch):
    """The check behind the property: were Python values traced into the unit (as they were
    before units split their arguments), the drawn flag would reach the module as an array:
    `if flag:` would raise, and the model's `isinstance(flag, bool)` takes another branch, so
    stage 3 no longer matches one device."""
    traced = lambda x: isinstance(x, (jax.Array, np.ndarray, bool, int, float))
    monkeypatch.setattr(unit_calls, "is_array", traced)
    x = np.random.default_rng(0).normal(size=(ROWS, D)).astype(np.float32)
    with pytest.raises(AssertionError, match="L2 difference"):
        linen_parity(DrawnModel(("flag",), (False,)), {"x": x}, stages=(3,))
    with pytest.raises(jax.errors.TracerBoolConversionError):
        linen_parity(FlagModel(), {"x": x[:, None].repeat(4, 1)}, stages=(3,))
