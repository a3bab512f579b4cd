"""Whatever `jax.jit` runs, zerojax runs: user code inside zerojax's per-device model sees
`jax.jit`'s semantics, not `shard_map`'s varying-axes typing (a scan carry built from zeros,
exact GELU's JVP failed to type-check there at every stage), and a model is found however its
`apply_fn` is called. Each construct trains at stages 0 and 3 as under `jax.jit` on one device,
in float64 at the exact bound."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, in_float64, run_dtype
from flax.training import train_state

import zerojax as zj

pytestmark = pytest.mark.usefixtures("x64")
ROWS, TIME, FEATURES = 16, 6, 8


class Recurrent(nn.Module):
    """A recurrent encoder as users write one, then a classifier head."""

    kind: str

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        if self.kind == "nn.RNN":  # Flax's RNN: an nn.scan over time from the cell's zeros carry
            x = nn.RNN(nn.LSTMCell(16, param_dtype=run_dtype()))(x)
        elif self.kind == "lax.scan":  # a plain scan from a zeros carry, inside the module
            w = self.param("w", nn.initializers.normal(0.3), (16, 16))
            step = lambda h, xt: (jnp.tanh(h @ w + xt),) * 2
            _, x = jax.lax.scan(step, jnp.zeros((x.shape[0], 16)), x.swapaxes(0, 1))
            x = x.swapaxes(0, 1)
        elif self.kind == "fori_loop":  # a loop whose state starts from constants
            w = self.param("w", nn.initializers.normal(0.3), (16, 16))
            context = x.mean(1)  # per example: a batch statistic differs per device by design
            start = jnp.ones((x.shape[0], 16))
            h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + context, start)
            x = x + h[:, None]
        elif self.kind == "exact GELU":  # BERT's activation: erfc's JVP
            x = jax.nn.gelu(nn.Dense(16)(x), approximate=False)
        return nn.Dense(3)(x.mean(1))


def make_state(model, apply_fn=None):
    x = jnp.zeros((1, TIME, FEATURES))
    params = in_float64(model.init(jax.random.key(0), x)["params"])
    return train_state.TrainState.create(
        apply_fn=apply_fn or model.apply, params=params, tx=optax.adamw(1e-2)
    )


def data(n=3):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(ROWS, TIME, FEATURES)), "y": rng.integers(0, 3, ROWS)}
        for _ in range(n)
    ]


def loss_of(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def step(state, batch):
    def loss_fn(params):
        return loss_of(state.apply_fn({"params": params}, batch["x"]), batch["y"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def train(fn, state):
    for batch in data():
        state, _ = fn(state, batch)
    return state


def assert_trains_as_under_jit(fn, state, stages=(0, 3), **options):
    with jax.default_device(jax.devices()[0]):
        want = train(jax.jit(fn), state)
    for stage in stages:
        split_all = {"persistence_threshold": 0} if stage else {}  # tiny leaves split at all
        zero = zj.zero_shard(stage=stage, **split_all, **options)
        got = train(zero(fn), zero.shard(state))
        assert_trees_close(got.params, jax.device_get(want.params))


@pytest.mark.parametrize("kind", ["nn.RNN", "lax.scan", "fori_loop", "exact GELU"])
def test_code_jit_accepts_trains_unchanged_at_stages_0_and_3(kind):
    assert_trains_as_under_jit(step, make_state(Recurrent(kind)))


def test_an_rnn_cell_named_a_unit_runs_the_lifted_body_flax_calls_it_with():
    """`units='LSTMCell'`: `nn.RNN` calls the cell through its scanned `scan_fn(cell, carry,
    x)`, a function, not a method of the cell: the unit runs that function on its gathered
    weights (once per time step: the cell is no unit by default)."""
    assert_trains_as_under_jit(step, make_state(Recurrent("nn.RNN")), stages=(3,), units="LSTMCell")


class KeywordOnlyModel:
    """A wrapper object whose keyword-only `__call__` applies its Linen module, as Hugging
    Face's `FlaxPreTrainedModel` does (`state.apply_fn(**batch, params=params)`)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *, x, params, train=False):
        return self.module.apply({"params": params}, x)


def keyword_step(state, batch):
    def loss_fn(params):
        return loss_of(state.apply_fn(x=batch["x"], params=params, train=True), batch["y"])

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("form", ["keyword-only __call__", "functools.partial", "lambda"])
def test_a_model_is_found_however_apply_fn_calls_it(form):
    """Stage 3 gathers the model's blocks (its units) whatever `apply_fn` is."""
    module = Recurrent("exact GELU")
    if form == "keyword-only __call__":
        apply_fn, fn = KeywordOnlyModel(module).__call__, keyword_step
    elif form == "functools.partial":
        apply_fn, fn = functools.partial(module.apply, mutable=False), step
    else:
        apply_fn, fn = (lambda variables, x: module.apply(variables, x)), step
    state = make_state(module, apply_fn)
    assert_trains_as_under_jit(fn, state)
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    compiled = zero(fn)
    compiled(zero.shard(state), data(1)[0])
    assert compiled.units == ("Dense_0", "Dense_1", "Dense_2")


def test_a_step_already_jitted_is_unwrapped_with_a_warning_naming_static_argnums():
    """A `@jax.jit` step (its static argument named there) trains once zero is told which
    arguments are static; the warning says so (it had failed with jax's non-hashable static
    argument error, a tracer where the jit expected a Python value)."""

    @functools.partial(jax.jit, static_argnums=(2,))
    def scaled_step(state, batch, scale):
        def loss_fn(params):
            return scale * loss_of(state.apply_fn({"params": params}, batch["x"]), batch["y"])

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params)), None

    state = make_state(Recurrent("exact GELU"))
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    with pytest.warns(zj.ZeroWarning, match="static_argnums"):
        step = zero(scaled_step, static_argnums=(2,))
    got, _ = step(zero.shard(state), data(1)[0], 2.0)
    want, _ = jax.jit(scaled_step.__wrapped__, static_argnums=(2,))(state, data(1)[0], 2.0)
    assert_trees_close(got.params, jax.device_get(want.params))


def test_a_keyword_only_apply_fn_accumulates_locally_as_one_step_on_the_whole_batch():
    """Local accumulation runs the whole step per device; the model inside the keyword-only
    `apply_fn` is caught there too (it had raised "missing 1 required positional argument:
    'variables'"): two micro-batches then the update, as one step on both under jit."""
    module = Recurrent("exact GELU")
    state = make_state(module, KeywordOnlyModel(module).__call__)
    micro = data(2)
    whole = jax.tree_util.tree_map(lambda a, b: np.concatenate([a, b]), *micro)
    with jax.default_device(jax.devices()[0]):
        want, _ = jax.jit(keyword_step)(state, whole)
    zero = zj.zero_shard(stage=1, gradient_accumulation_steps=2, accumulate="local")
    got = zero.shard(state)
    for batch in micro:
        got, _ = zero(keyword_step)(got, batch)
    assert_trees_close(got.params, jax.device_get(want.params))
