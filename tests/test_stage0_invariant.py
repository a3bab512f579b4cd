"""The invariant "whatever `jax.jit` runs, zerojax runs", held over every model the suite trains:
stage 0 with default options (plain data parallelism, nothing but `zero_shard(stage=0)`) runs
each model and matches the same step under `jax.jit` (`nnx.jit`) on one device, in float64 at
the exact bound, and so does stage 3 with its defaults. A census keeps "every" true: each module
class the suite defines is trained here, trained here as part of a model, or excluded with the
reason and the test that holds it instead. The conformance lanes (tests/test_conformance*.py:
Flax's examples, gemma, Hugging Face's family) and tests/test_jit_semantics.py hold it for
published code and for the constructs that had broken it."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_architecture
import test_audit
import test_block_forms
import test_errors
import test_inference
import test_lm
import test_model_state
import test_nnx_units
import test_option_sweep
import test_other_state
import test_peak
import test_published_patterns
import test_rules
import test_tensor_parallel
import test_unit_calls
import test_unit_methods
import test_units
import test_user_patterns
import test_user_update
from common import (
    PARITY_ATOL,
    PARITY_RTOL,
    assert_trees_close,
    batches,
    in_float64,
    make_init,
    train_step,
)
from flax import nnx
from flax.training import train_state
from nnx_model import GPT, nnx_train_step
from plan_user_model import Classifier
from plan_user_model import train_step as classifier_step

import zerojax as zj
from zerojax.models.gpt import GPT as ZerojaxGPT
from zerojax.models.lm import LM

pytestmark = pytest.mark.usefixtures("x64")
ROWS = 16  # the global batch: 2 rows per simulated device


def _rows(make, n=3):
    return [make(np.random.default_rng(i)) for i in range(n)]


def _tokens(vocab: int, length: int = 9):
    return lambda: _rows(lambda r: r.integers(0, vocab, (ROWS, length)).astype(np.int32))


def _lm_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# ---- Linen: a TrainState and a step written as users write them ---------------------------------
def adam_state(model, params):
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def linen_lm(cls, vocab: int, *args, length: int = 9):
    """(cls, init_fn, step, data) training `cls(*args)` on next-token cross-entropy."""
    model = cls(*args)

    def init_fn(key):
        return adam_state(model, model.init(key, jnp.zeros((1, length - 1), jnp.int32))["params"])

    def step(state, tokens):
        loss = lambda p: _lm_loss(state.apply_fn({"params": p}, tokens[:, :-1]), tokens)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    return cls, init_fn, step, _tokens(vocab, length)


def linen_regression(cls, inputs, *args):
    """(cls, init_fn, step, data) training `cls(*args)` on squared error against a random target
    of its output's shape; `inputs(rng)`: the call's arrays, `ROWS` rows each. SGD with momentum:
    an attention's key bias has a true gradient of exactly 0 (softmax ignores a shift), which
    Adam would turn from rounding noise into full-size updates, in one run and the other."""
    model = cls(*args)

    def init_fn(key):
        first = (a[:1] for a in inputs(np.random.default_rng(0)))
        params = model.init(key, *first)["params"]
        tx = optax.sgd(0.01, momentum=0.9)
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def step(state, batch):
        args, target = batch
        loss = lambda p: jnp.mean((state.apply_fn({"params": p}, *args) - target) ** 2)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads), value

    def batch(rng):
        args = inputs(rng)
        out = jax.eval_shape(lambda a: model.init_with_output(jax.random.key(0), *a)[0], args)
        return args, rng.normal(size=out.shape)

    return cls, init_fn, step, lambda: _rows(batch)


def classifier_init(key):
    model = Classifier()
    params = model.init(key, np.zeros((1, 256)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))


normal = lambda *shape: lambda r: (r.normal(size=(ROWS, *shape)),)  # noqa: E731
D = test_unit_calls.D
ALL_KINDS = tuple(test_unit_calls.KINDS)

# model class (for the census): (init_fn(key) -> state, step(state, batch), batches)
LINEN = {
    "common GPT (AdamW)": (
        ZerojaxGPT, make_init(optax.adamw(1e-3)), train_step, lambda: batches(3)
    ),
    "option sweep residual MLP": (
        test_option_sweep.Model, test_option_sweep.init_fn, test_option_sweep.step,
        lambda: _rows(lambda r: {"x": r.normal(size=(ROWS, 32)), "y": r.normal(size=(ROWS, 8))}),
    ),
    "peak tanh MLP": (
        test_peak.Net, test_peak.init, test_peak.step,
        lambda: _rows(lambda r: {"x": r.normal(size=(ROWS, 256)), "y": r.normal(size=(ROWS, 4))}),
    ),
    "nn.jit language model (SGD momentum)": (
        test_published_patterns.JittedLM, test_published_patterns.init_fn,
        test_published_patterns.step_fn, lambda: test_published_patterns.tokens(3),
    ),
    "inference TinyLM": (
        test_inference.TinyLM, test_inference.init_fn, test_inference.train_step,
        _tokens(test_inference.VOCAB, test_inference.SEQ),
    ),
    "plan's user classifier": (
        Classifier, classifier_init, classifier_step,
        lambda: _rows(lambda r: {"x": r.normal(size=(ROWS, 256)), "y": r.integers(0, 10, ROWS)}),
    ),
    "unit-test transformer": linen_lm(test_units.Transformer, 128, 2, False),
    "unit-test transformer, nn.scan": linen_lm(test_units.Transformer, 128, 2, True),
    "zerojax LM, scanned and rematerialised": linen_lm(
        LM, 203, test_lm.CFG.replace(scan_layers=True, remat=True), length=17
    ),
    "shared block and unused head": linen_regression(test_user_patterns.Net, normal(32)),
    "tied embedding head": linen_lm(test_unit_methods.TiedLM, 128),
    "embedder with encode/decode": linen_lm(test_unit_methods.EmbedderLM, 128),
    "blocks with a train flag": linen_regression(test_unit_calls.FlagModel, normal(4, D)),
    "an array by keyword from another block": linen_regression(
        test_unit_calls.SharingModel,
        lambda r: (r.normal(size=(ROWS, D)), r.integers(0, 8, ROWS).astype(np.int32)),
    ),
    "every kind of block argument": linen_regression(
        test_unit_calls.DrawnModel, normal(D), ALL_KINDS, tuple(i % 2 == 0 for i in range(10))
    ),
    "LoRA test MLP": linen_regression(test_other_state.Mlp, normal(32)),
    "EMA test MLP": linen_regression(test_user_update.Mlp, normal(32)),
    "GQA attention beside a one-kernel stack": linen_regression(test_rules._Model, normal(32)),
    "scanned residual MLP": linen_regression(test_audit.ScannedMLP, normal(32)),
    "multi-head self-attention": linen_regression(test_audit.SelfAttention, normal(4, 64), 4),
    "plain head": linen_lm(test_architecture.PlainHead, 64),
    "blocks under nn.jit": linen_lm(test_block_forms.LinenModel, 128, 2, "nn.jit"),
    "blocks under nn.remat": linen_lm(test_block_forms.LinenModel, 128, 2, "nn.remat"),
    "blocks returning a cache first": linen_lm(
        test_block_forms.LinenModel, 128, 2, "cache first"
    ),
    "logically partitioned (tensor-parallel) model": linen_lm(
        test_tensor_parallel.TPModel, test_tensor_parallel.VOCAB
    ),
    "sowing model": linen_regression(test_model_state.Sowing, normal(4)),
}  # fmt: skip


# models whose code computes in float32 whatever their dtype (the LM's RoPE; the softmax of
# nnx.MultiHeadAttention): held to the float32 bound in float64
FLOAT32_ISLANDS = {
    "zerojax LM, scanned and rematerialised",
    "common GPT (NNX)",
    "unit-test transformer (NNX)",
    "unit-test transformer, nnx.vmap/nnx.scan",
    "blocks under nnx.jit",
    "blocks under nnx.remat",
    "blocks returning a cache first (NNX)",
}
# models default options refuse with a ZeroError naming the option that runs them: (the error's
# words, that option)
REFUSED = {
    "logically partitioned (tensor-parallel) model": (
        "logical_rules=",
        dict(logical_rules=(("embed", None), ("vocab", None), ("mlp", None))),
    ),
}


def assert_as_jit(name: str, got, want):
    """`got` within the exact bound of `want` (the float32 bound for `FLOAT32_ISLANDS`)."""
    bound = dict(rtol=PARITY_RTOL, atol=PARITY_ATOL) if name in FLOAT32_ISLANDS else {}
    assert_trees_close(got, jax.device_get(want), **bound)


def train(step, state, data):
    for batch in data:
        out = step(state, batch)
        state = out[0] if isinstance(out, tuple) else out
    return state


@pytest.mark.parametrize("name", LINEN)
@pytest.mark.parametrize("stage", [0, 3])
def test_stage_with_default_options_runs_the_suites_linen_model_as_jit_on_one_device(name, stage):
    _, init_fn, step, data = LINEN[name]
    data = [in_float64(b) for b in data()]
    with jax.default_device(jax.devices()[0]):
        start = in_float64(jax.jit(init_fn)(jax.random.key(0)))
        want = train(jax.jit(step), start, data)
    zero = zj.zero_shard(stage=stage)
    if name in REFUSED:
        words, options = REFUSED[name]
        with pytest.raises(zj.ZeroError, match=words):
            zero.shard(start)
        zero = zj.zero_shard(stage=stage, **options)
    got = train(zero(step), zero.shard(start), data)
    assert_as_jit(name, got.params, want.params)


# ---- NNX: objects and a step written as Flax's NNX docs write them ------------------------------
def nnx_lm_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(lambda m: _lm_loss(m(tokens[:, :-1]), tokens))(model)
    optimizer.update(model, grads)
    return loss


def nnx_regression_step(model, optimizer, batch):
    args, target = batch
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(*args) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def nnx_regression_data(make_model, inputs):
    def batch(rng):
        args = inputs(rng)
        out = jax.eval_shape(lambda a: make_model()(*a), args)
        return args, rng.normal(size=out.shape)

    return lambda: _rows(batch)


def nnx_gpt_data():
    return batches(3)


lm_model = lambda cls, *a, **k: lambda: cls(*a, rngs=nnx.Rngs(0), **k)  # noqa: E731
one = lambda cls: lambda: cls(nnx.Rngs(0))  # noqa: E731

# model class: (make_model() -> nnx.Module, step(model, optimizer, batch), batches)
NNX = {
    "common GPT (NNX)": (GPT, lambda: GPT(rngs=nnx.Rngs(0)), nnx_train_step, nnx_gpt_data),
    "unit-test transformer (NNX)": (
        test_nnx_units.Transformer, lm_model(test_nnx_units.Transformer, 2), nnx_lm_step,
        _tokens(128),
    ),
    "unit-test transformer, nnx.vmap/nnx.scan": (
        test_nnx_units.Transformer, lm_model(test_nnx_units.Transformer, 2, scan=True),
        nnx_lm_step, _tokens(128),
    ),
    "blocks under nnx.jit": (
        test_block_forms.NnxModel,
        lambda: test_block_forms.NnxModel(2, nnx.Rngs(0), "nnx.jit"), nnx_lm_step, _tokens(128),
    ),
    "blocks under nnx.remat": (
        test_block_forms.NnxModel,
        lambda: test_block_forms.NnxModel(2, nnx.Rngs(0), "nnx.remat"), nnx_lm_step, _tokens(128),
    ),
    "blocks returning a cache first (NNX)": (
        test_block_forms.NnxModel,
        lambda: test_block_forms.NnxModel(2, nnx.Rngs(0), "cache first"),
        nnx_lm_step,
        _tokens(128),
    ),
    "tied embedding head (NNX)": (
        test_unit_methods.NnxTiedLM, one(test_unit_methods.NnxTiedLM), nnx_lm_step, _tokens(128)
    ),
    "user-update MLP": (
        test_user_update.NnxMlp, one(test_user_update.NnxMlp), nnx_regression_step,
        nnx_regression_data(one(test_user_update.NnxMlp), normal(32)),
    ),
    "published-pattern MLP": (
        test_published_patterns.Mlp, one(test_published_patterns.Mlp), nnx_regression_step,
        nnx_regression_data(one(test_published_patterns.Mlp), normal(16)),
    ),
    "frozen batch norm in blocks": (
        test_published_patterns.FrozenNet, one(test_published_patterns.FrozenNet),
        nnx_regression_step,
        nnx_regression_data(one(test_published_patterns.FrozenNet), normal(16)),
    ),
    "user's first NNX model": (
        test_errors.Net, one(test_errors.Net), nnx_regression_step,
        nnx_regression_data(one(test_errors.Net), normal(16)),
    ),
}  # fmt: skip


def nnx_objects(make_model):
    """The model in float64 (its variables, and the dtypes its modules compute in, as a model
    built with float64 dtypes has them), and an AdamW optimizer made for it."""
    model = make_model()
    nnx.update(model, in_float64(nnx.state(model)))
    for _, module in nnx.iter_graph(model):
        for attr in ("dtype", "param_dtype"):
            if isinstance(module, nnx.Module) and getattr(module, attr, None) == jnp.float32:
                setattr(module, attr, jnp.float64)
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


@pytest.mark.parametrize("name", NNX)
@pytest.mark.parametrize("stage", [0, 3])
def test_stage_with_default_options_runs_the_suites_nnx_model_as_nnx_jit_on_one_device(name, stage):
    _, make_model, step, data = NNX[name]
    data = [in_float64(b) for b in data()]
    with jax.default_device(jax.devices()[0]):
        want = nnx_objects(make_model)
        jitted = nnx.jit(step)
        for batch in data:
            jitted(*want, batch)
    zero = zj.zero_shard(stage=stage)
    got, zstep = zero.shard(nnx_objects(make_model)), zero(step)
    for batch in data:
        zstep(*got, batch)
    assert_as_jit(name, nnx.state(got[0], nnx.Param), nnx.state(want[0], nnx.Param))


# ---- the census ---------------------------------------------------------------------------------
TESTS = pathlib.Path(__file__).parent
# a class trained here only inside a model above: the model that trains it
PARTS = {
    "nnx_model.Block": "common GPT (NNX)",
    "test_audit.Block": "scanned residual MLP",
    "test_block_forms.CacheFirst": "blocks returning a cache first",
    "test_block_forms.JitBlock": "blocks under nnx.jit",
    "test_block_forms.RematBlock": "blocks under nnx.remat",
    "test_nnx_units.Block": "unit-test transformer (NNX)",
    "test_block_forms.CacheFirstBlock": "blocks returning a cache first (NNX)",
    "test_option_sweep.Block": "option sweep residual MLP",
    "test_published_patterns.Block": "nn.jit language model (SGD momentum)",
    "test_published_patterns.FrozenBlock": "frozen batch norm in blocks",
    "test_rules._Residual": "GQA attention beside a one-kernel stack",
    "test_rules._Attention": "GQA attention beside a one-kernel stack",
    "test_rules._SingleKernelStack": "GQA attention beside a one-kernel stack",
    "test_tensor_parallel.MLPBlock": "logically partitioned (tensor-parallel) model",
    "test_unit_calls.FlagBlock": "blocks with a train flag",
    "test_unit_calls.SharedKV": "an array by keyword from another block",
    "test_unit_calls.Drawn": "every kind of block argument",
    "test_unit_methods.Block": "tied embedding head",
    "test_unit_methods.Embedder": "embedder with encode/decode",
    "test_unit_methods.NnxBlock": "tied embedding head (NNX)",
    "test_units.Block": "unit-test transformer",
    "test_user_patterns.Block": "shared block and unused head",
}
# a class whose semantics are not one device's by design, or that is refused by design
EXCLUDED = {
    "test_architecture.DropoutNet": "dropout masks per device: tests/test_randomness.py",
    "test_randomness.Wide": "dropout masks per device: tests/test_randomness.py",
    "test_published_patterns.Dropped": "dropout masks per device: tests/test_randomness.py",
    "test_unit_calls.RngBlock": "dropout masks per device: tests/test_unit_calls.py",
    "test_unit_calls.RngModel": "dropout masks per device: tests/test_unit_calls.py",
    "test_call_plan.Mlp": "dropout masks per device: tests/test_randomness.py",
    "test_call_plan.Net": "batch statistics per device: tests/test_model_state.py",
    "test_call_plan.Layer": "batch statistics per device: tests/test_model_state.py",
    "test_call_plan.Stacked": "batch statistics per device: tests/test_model_state.py",
    "test_model_state.CNN": "batch statistics per device: tests/test_model_state.py",
    "test_model_state.NNXNet": "batch statistics per device: tests/test_model_state.py",
    "test_errors.MeanOfModel": "a mean over the batch, refused: tests/test_errors.py",
    "test_jit_semantics.Recurrent": "stages 0 and 3 against jit: tests/test_jit_semantics.py",
}


MODULE_BASES = ("nn.Module", "nnx.Module", "test_nnx_units.Block", "test_nnx_units.Transformer")


def _module_classes() -> set[str]:
    """'file.Class' for every Flax module class (Linen or NNX) the suite's files define."""
    found: set[str] = set()
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            bases = [ast.unparse(b) for b in getattr(node, "bases", ())]
            if isinstance(node, ast.ClassDef) and any(b in MODULE_BASES for b in bases):
                found.add(f"{path.stem}.{node.name}")
    return found


def _trained() -> set[str]:
    return {
        f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
        for cls, *_ in (*LINEN.values(), *NNX.values())
    }


def test_every_module_class_the_suite_defines_is_trained_here_or_excluded_with_its_reason():
    trained, parts = _trained(), set(PARTS)
    assert not set(LINEN) & set(NNX), "one name per model: FLOAT32_ISLANDS and PARTS name them"
    assert set(PARTS.values()) <= {*LINEN, *NNX}, set(PARTS.values()) - {*LINEN, *NNX}
    unaccounted = _module_classes() - trained - parts - set(EXCLUDED)
    assert not unaccounted, f"add each to LINEN/NNX, PARTS or EXCLUDED: {sorted(unaccounted)}"
    assert not (trained & set(EXCLUDED)), trained & set(EXCLUDED)
