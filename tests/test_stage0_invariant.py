"""The invariant "whatever `jax.jit` runs, zerojax runs", held over the models the suite trains:
stage 0 with default options (plain data parallelism, nothing but `zero_shard(stage=0)`) runs
each model's own step and matches the same step under `jax.jit` on one device, in float64 at
the exact bound, and so does stage 3 with its defaults. The conformance lanes
(tests/test_conformance*.py: Flax's examples, gemma, Hugging Face's family) and
tests/test_jit_semantics.py hold it for published code and for the constructs that had broken
it; models whose semantics are per device by design (BatchNorm's statistics, dropout's masks:
tests/test_model_state.py, tests/test_randomness.py) are held to those semantics there."""

import jax
import numpy as np
import optax
import pytest
import test_inference
import test_option_sweep
import test_peak
import test_published_patterns
from common import assert_trees_close, batches, in_float64, make_init, train_step
from flax.training import train_state
from plan_user_model import Classifier
from plan_user_model import train_step as classifier_step

import zerojax as zj

pytestmark = pytest.mark.usefixtures("x64")


def classifier_init(key):
    model = Classifier()
    params = model.init(key, np.zeros((1, 256)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))


def _rows(make, n=3):
    return [make(np.random.default_rng(i)) for i in range(n)]


# name: (init_fn(key) -> state, step(state, batch), batches)
MODELS = {
    "common GPT (causal LM, AdamW)": (
        lambda key: make_init(optax.adamw(1e-3))(key), train_step, lambda: batches(3)
    ),
    "option sweep residual MLP (Adam)": (
        test_option_sweep.init_fn, test_option_sweep.step,
        lambda: _rows(lambda r: {"x": r.normal(size=(16, 32)), "y": r.normal(size=(16, 8))}),
    ),
    "peak tanh MLP": (
        test_peak.init, test_peak.step,
        lambda: _rows(lambda r: {"x": r.normal(size=(16, 256)), "y": r.normal(size=(16, 4))}),
    ),
    "nn.jit language model (SGD momentum)": (
        test_published_patterns.init_fn, test_published_patterns.step_fn,
        lambda: test_published_patterns.tokens(3),
    ),
    "inference TinyLM (Adam)": (
        test_inference.init_fn, test_inference.train_step,
        lambda: _rows(lambda r: r.integers(0, test_inference.VOCAB, (16, test_inference.SEQ))),
    ),
    "plan's user classifier (AdamW)": (
        classifier_init, classifier_step,
        lambda: _rows(lambda r: {"x": r.normal(size=(16, 256)), "y": r.integers(0, 10, 16)}),
    ),
}  # fmt: skip


def train(step, state, data):
    for batch in data:
        state = step(state, batch)[0]
    return state


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stage", [0, 3])
def test_stage_with_default_options_runs_the_suites_model_as_jit_on_one_device(name, stage):
    init_fn, step, data = MODELS[name]
    data = [in_float64(b) for b in data()]
    with jax.default_device(jax.devices()[0]):
        start = in_float64(jax.jit(init_fn)(jax.random.key(0)))
        want = train(jax.jit(step), start, data)
    zero = zj.zero_shard(stage=stage)
    got = train(zero(step), zero.shard(start), data)
    assert_trees_close(got.params, jax.device_get(want.params))
