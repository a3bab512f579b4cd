"""Mixed precision with fp32 master weights, fp16 loss scaling, gradient accumulation and
clipping, each against plain single-device optax."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import (
    EXACT_RTOL,
    assert_trees_close,
    batches,
    initial_state,
    make_init,
    relative_l2,
    rounded_state,
    slow,
    train_single_device,
    train_step,
    train_zero,
)

import zerojax as zj
from zerojax.models import GPT, PRESETS
from zerojax.models.data import random_windows, stdlib_tokens

ADAMW = lambda: optax.adamw(1e-3, eps=1e-5)  # eps: tests/common.py, "Parity"


_REFERENCES = {}


def reference(name, make_tx, steps, batch_size):
    """Single-device training on batches(steps, batch_size), computed once per test session
    (and dtype: float64 under the `x64` fixture)."""
    key = (name, steps, batch_size, jax.config.jax_enable_x64)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_single_device(make_tx(), batches(steps, batch_size=batch_size))
    return _REFERENCES[key]


def _tree_equal(a, b):
    return all(
        bool(jnp.array_equal(x, y))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


# ---- bf16 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [30, pytest.param(200, marks=pytest.mark.slow)])
def test_bf16_follows_fp32_on_the_demo_model(steps):
    cfg = PRESETS["demo"]
    model = GPT(cfg)
    data = [
        {"inputs": w[:, :-1], "targets": w[:, 1:]}
        for w in random_windows(stdlib_tokens(), steps + 1, 16, cfg.seq_len)
    ]
    exact = jax.jit(
        lambda p, m: jax.tree_util.tree_map(
            lambda x, y: jnp.array_equal(x, y.astype(x.dtype)), p, m
        )
    )
    curves = {}
    for precision in ("fp32", "bf16"):
        zero = zj.zero_shard(stage=3, precision=precision)
        state = zero.init(make_init(optax.adamw(1e-3), model, cfg), jax.random.key(0))
        step = zero(train_step)
        losses = []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            if precision == "bf16":  # the 16-bit copy is exactly master.astype(bf16), always
                assert all(jax.tree_util.tree_leaves(exact(state.params, state.opt_state.master)))
        curves[precision] = losses
        if precision == "bf16":
            assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {
                jnp.dtype(jnp.bfloat16)
            }
            assert {x.dtype for x in jax.tree_util.tree_leaves(state.opt_state.master)} == {
                jnp.dtype(jnp.float32)
            }
    for i in range(0, steps + 1, 20):
        assert abs(curves["bf16"][i] - curves["fp32"][i]) <= 0.02 * curves["fp32"][i], i
    assert curves["bf16"][steps] < (0.7 if steps >= 200 else 0.8) * curves["bf16"][0]  # learned


@pytest.mark.parametrize(
    "stage,reduce_kind",
    [(1, "reduce-scatter"), (3, "reduce-scatter"), *slow((2, "reduce-scatter"))],
)
def test_16_bit_weights_are_gathered_and_grads_reduced_in_the_configured_dtype(stage, reduce_kind):
    # stage 3 gathers weights for compute, stages 1-2 gather the updated weights: both in bf16
    for reduce_dtype, sent_dtype in (("fp32", "f32"), ("bf16", "bf16")):
        zero = zj.zero_shard(stage=stage, precision="bf16", grad_reduce_dtype=reduce_dtype)
        state = zero.eval_shape(make_init(ADAMW()), jax.random.key(0))
        rep = zero.report(zero(train_step), state, batches(1)[0])
        kinds = {(c.kind, c.dtype) for c in rep.collectives if c.buffer_bytes > 1024}
        # stages 1-2 also all-reduce each unit's unsplit (small) leaves as one bucket, in the
        # reduce dtype too
        bucket = {("all-reduce", sent_dtype)} if stage < 3 else set()
        assert {("all-gather", "bf16"), (reduce_kind, sent_dtype)} <= kinds, kinds
        assert kinds <= {("all-gather", "bf16"), (reduce_kind, sent_dtype)} | bucket, kinds


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize(
    "grad, option, reduced",
    [
        ("bfloat16", "fp32", "float32"),  # widened: fp32 sums of 16-bit gradients
        ("float32", "fp32", "float32"),
        ("float64", "fp32", "float64"),  # never narrowed by the default
        ("float32", "bf16", "bfloat16"),  # asked for: half the bytes
        ("float64", "fp16", "float16"),
    ],
)
def test_grad_reduce_dtype_widens_16_bit_gradients_and_narrows_only_to_16_bits(
    grad, option, reduced
):
    from zerojax.comm.hierarchy import in_reduce_dtype
    from zerojax.core.policy import UnitPolicy

    policy = UnitPolicy.of(zj.ZeroConfig(grad_reduce_dtype=option))
    assert in_reduce_dtype(jnp.ones((4,), grad), policy.reduce_dtype).dtype == reduced
    assert in_reduce_dtype(jnp.ones((4,), jnp.int32), policy.reduce_dtype).dtype == jnp.int32


# ---- fp16 loss scaling --------------------------------------------------------------------------
def poisonable_step(state, batch):
    """The usual step; a batch with poison = inf makes every gradient non-finite."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return loss * batch["poison"].mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _fp16(data, **options):
    zero = zj.zero_shard(stage=2, precision="fp16", **options)
    state = zero.shard(initial_state(ADAMW()))
    return zero, state, zero(poisonable_step)


def _no_nan(state):
    return all(
        bool(jnp.all(jnp.isfinite(x)))
        for x in jax.tree_util.tree_leaves(state)
        if jnp.issubdtype(x.dtype, jnp.floating)
    )


def test_fp16_huge_initial_scale_skips_then_trains():
    data = [{**b, "poison": np.ones(16, np.float32)} for b in batches(30)]
    zero, state, step = _fp16(data, initial_scale_power=32)
    scales, skipped = [], []
    for batch in data:
        state, m = step(state, batch)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["step_skipped"]))
        assert _no_nan(state)
    assert skipped[0] and skipped[1] and not skipped[-1]
    first_good = skipped.index(False)
    assert scales[first_good] < 2.0**32  # the scale fell ...
    assert int(state.step) == len(data) - first_good  # ... skipped steps did not count
    assert int(m["skipped_steps"]) == first_good
    assert float(m["loss"]) < float(np.mean([1.0]) * 6)  # and training proceeded


def test_injected_inf_is_skipped_with_hysteresis():
    ok = {"poison": np.ones(16, np.float32)}
    bad = {"poison": np.full(16, np.inf, np.float32)}
    data = batches(8)
    zero, state, step = _fp16(data, initial_scale_power=8, hysteresis=2)
    for batch in data[:3]:
        state, m = step(state, {**batch, **ok})
    scale, step_count = float(m["loss_scale"]), int(state.step)
    before = jax.tree_util.tree_map(np.array, (state.params, state.opt_state.inner))
    state, m = step(state, {**data[3], **bad})  # 1st overflow: skipped, hysteresis absorbs it
    assert bool(m["step_skipped"]) and float(m["loss_scale"]) == scale
    state, m = step(state, {**data[4], **bad})  # 2nd overflow: skipped, the scale halves
    assert bool(m["step_skipped"]) and float(m["loss_scale"]) == scale / 2
    assert int(state.step) == step_count and _no_nan(state)
    assert _tree_equal((state.params, state.opt_state.inner), before)
    state, m = step(state, {**data[5], **ok})
    assert not bool(m["step_skipped"]) and int(state.step) == step_count + 1
    assert int(m["skipped_steps"]) == 2


def test_overflow_at_min_loss_scale_is_an_error_not_a_loop():
    bad = {"poison": np.full(16, np.inf, np.float32)}
    zero, state, step = _fp16(None, initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    with pytest.raises(zj.ZeroError, match="min_loss_scale"):
        for batch in batches(5):
            state, _ = step(state, {**batch, **bad})


def test_static_loss_scale():
    zero, state, step = _fp16(None, loss_scale=128.0)
    for batch in batches(3):
        state, m = step(state, {**batch, "poison": np.ones(16, np.float32)})
    assert float(m["loss_scale"]) == 128.0 and int(state.step) == 3


# ---- accumulation -------------------------------------------------------------------------------
def _micro(batch, k):
    b = len(batch["inputs"]) // k
    return [jax.tree_util.tree_map(lambda x, i=i: x[i * b : (i + 1) * b], batch) for i in range(k)]


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize(
    "stage,mode", [(2, "local"), (3, "reduced"), *slow((0, "local"), (2, "reduced"))]
)
def test_k_micro_batches_equal_one_big_batch(stage, mode):
    data = batches(3, batch_size=32)
    ref_state, _ = reference("adamw", ADAMW, 3, 32)
    zero = zj.zero_shard(stage=stage, gradient_accumulation_steps=4, accumulate=mode)
    state = zero.shard(initial_state(ADAMW()))
    step = zero(train_step)
    for batch in data:
        for micro in _micro(batch, 4):
            state, metrics = step(state, micro)
        assert int(metrics["micro_step"]) == 0
    assert int(state.step) == 3
    assert_trees_close(state.params, ref_state.params)


@pytest.mark.parametrize("stage", [2, *slow(0)])  # reduce-scatter (stage 1 = 2's), all-reduce
def test_local_accumulation_communicates_once_per_optimizer_step(stage):
    sent = {}
    for k in (1, 4):
        zero = zj.zero_shard(stage=stage, gradient_accumulation_steps=k, gradient_clipping=1e9)
        state = zero.eval_shape(make_init(ADAMW()), jax.random.key(0))
        rep = zero.report(zero(train_step), state, batches(1, batch_size=8)[0])
        sent[k] = sum(c.buffer_bytes for c in rep.collectives)
    # gradient (4Ψ) and parameter collectives are the same for every k; what grows is scalars
    # only (the loss averaged over devices on each accumulate-only call): < 0.1% of the bytes
    assert sent[4] - sent[1] < 1e-3 * sent[1], sent


def test_reduced_accumulation_reduces_every_micro_batch():
    sizes = {}
    for k in (1, 4):
        zero = zj.zero_shard(stage=3, gradient_accumulation_steps=k, gradient_clipping=1e9)
        state = zero.eval_shape(make_init(ADAMW()), jax.random.key(0))
        rep = zero.report(zero(train_step), state, batches(1, batch_size=8)[0])
        sizes[k] = rep.bytes_of("reduce-scatter")
    assert sizes[4] == 4 * sizes[1]


# ---- clipping and any optimizer -----------------------------------------------------------------
@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("stage", [1, 3])  # the norm of a whole, then of a split gradient
def test_clipping_equals_optax_clip_by_global_norm(stage):
    data = batches(4)
    ref_state, ref_losses = reference(
        "clip", lambda: optax.chain(optax.clip_by_global_norm(0.05), ADAMW()), 4, 16
    )
    zero = zj.zero_shard(stage=stage, gradient_clipping=0.05)
    state, losses = train_zero(zero, ADAMW(), data)
    np.testing.assert_allclose(losses, ref_losses, rtol=EXACT_RTOL)
    assert_trees_close(state.params, ref_state.params)


OPTIMIZERS = {
    "adamw": ADAMW,
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=32),
    "lion": lambda: optax.lion(1e-4),
    "multi_transform": lambda: optax.multi_transform(
        {"adamw": ADAMW(), "lion": optax.lion(1e-4)},
        lambda p: jax.tree_util.tree_map_with_path(
            lambda path, _: "lion" if "block" in jax.tree_util.keystr(path) else "adamw", p
        ),
    ),
    "inject_hyperparams_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-3, 1e-4, 4), eps=1e-5
    ),
}


# at stage 3 (parameters, gradients and state split) one optimizer of each kind of state
# (per-parameter moments, factored moments, a partition of transforms, injected schedules),
# and the two other layouts of the managed update (stage 1: whole gradients; stage 2: split);
# the slow lane runs every optimizer at stage 3 and two more at stages 1 and 2
ANY_OPTIMIZER = [
    ("adamw", 3),
    ("adafactor", 3),
    ("multi_transform", 3),
    ("inject_hyperparams_schedule", 3),
    ("adamw", 1),
    ("adafactor", 2),
] + slow(
    ("sgd_momentum", 3), ("lion", 3), ("multi_transform", 1), ("inject_hyperparams_schedule", 2)
)


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("name,stage", ANY_OPTIMIZER)
def test_managed_update_matches_single_device_for_any_optimizer(name, stage):
    data = batches(2, batch_size=32)
    ref_state, _ = reference(name, OPTIMIZERS[name], 2, 32)
    zero = zj.zero_shard(stage=stage, gradient_accumulation_steps=2)
    state = zero.shard(initial_state(OPTIMIZERS[name]()))
    step = zero(train_step)
    for batch in data:
        for micro in _micro(batch, 2):
            state, _ = step(state, micro)
    assert_trees_close(state.params, ref_state.params)


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += record.getMessage().startswith("Compiling jit(traced)")


@pytest.mark.parametrize(
    "options",
    [
        {"precision": "fp16", "gradient_accumulation_steps": 2, "accumulate": "reduced"},
        *slow({"precision": "bf16"}, {"gradient_accumulation_steps": 2}),
    ],
)
def test_each_step_variant_compiles_once(options):
    # the state a step returns must have the avals (dtype, weak type) of the one it received
    zero = zj.zero_shard(stage=1, **options)
    state = zero.shard(initial_state(ADAMW()))
    step = zero(train_step)
    compiles = _Compiles()
    logging.getLogger("jax").addHandler(compiles)
    try:
        with jax.log_compiles():
            for batch in batches(6, batch_size=8):
                state, _ = step(state, batch)
    finally:
        logging.getLogger("jax").removeHandler(compiles)
    assert compiles.count == len(step._jitted) == options.get("gradient_accumulation_steps", 1)


def test_report_splits_master_weights_and_gradient_buffers():
    # bf16, stage 2, k = 2 local: params 2Ψ (replicated), master 4Ψ/N, gradient buffer 4Ψ
    # (each device's own full-size sum), all within the bytes of leaves kept whole (< 1024 el.)
    zero = zj.zero_shard(stage=2, precision="bf16", gradient_accumulation_steps=2)
    state = zero.eval_shape(make_init(ADAMW()), jax.random.key(0))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    rep = zero.report(zero(train_step), state, batches(1, batch_size=8)[0])
    assert rep.resident["params"] == 2 * psi
    assert rep.resident["gradient buffers"] == 4 * psi
    assert abs(rep.resident["master weights"] - 4 * psi / 8) <= rep.kept_replicated
    assert "master weights" in str(rep)


# ---- optimizer_state_dtype ---------------------------------------------------------------------
@pytest.mark.parametrize("stage", [3, *slow(1)])
def test_bf16_optimizer_state_is_the_fp32_update_on_rounded_moments(stage):
    data = batches(3)
    rounded, _ = reference("adamw_bf16_state", lambda: rounded_state(ADAMW()), 3, 16)
    fp32, _ = reference("adamw", ADAMW, 3, 16)
    zero = zj.zero_shard(stage=stage, optimizer_state_dtype="bf16")
    state, _ = train_zero(zero, ADAMW(), data)
    inner = state.opt_state.inner
    moments = [x for x in jax.tree_util.tree_leaves(inner) if x.ndim > 0]
    assert {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree_util.tree_leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert all(x.dtype == jnp.int32 for x in jax.tree_util.tree_leaves(inner) if x.ndim == 0)
    assert_trees_close(state.params, rounded.params)
    # and the rounding is real: the fp32-state run is measurably elsewhere
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)])
    got = flat(state.params)
    assert relative_l2(got, flat(fp32.params)) > 10 * relative_l2(got, flat(rounded.params))


def test_bf16_optimizer_state_saves_4_bytes_per_parameter_over_n_at_stage_3():
    # Adam's two fp32 moments are 8Ψ/N per device at stage 3; in bf16 4Ψ/N (formula: 2 · 2 B · Ψ/N)
    resident = {}
    for dtype in ("fp32", "bf16"):
        zero = zj.zero_shard(stage=3, optimizer_state_dtype=dtype)
        state = zero.eval_shape(make_init(ADAMW()), jax.random.key(0))
        rep = zero.report(zero(train_step), state, batches(1, batch_size=8)[0])
        resident[dtype] = rep.resident["optimizer state"]
        kept = rep.kept_replicated
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    fp32, bf16 = resident["fp32"], resident["bf16"]
    assert abs((fp32 - bf16) - 4 * psi / 8) <= kept  # leaves kept whole save 4Ψ_kept, not /N


@pytest.mark.parametrize("stage", [2, 3])
def test_grad_reduce_dtype_reaches_the_unsplit_leaves_of_a_unit(stage):
    """A unit's leaves below the persistence threshold (its biases) enter its per-device body
    whole, and the body's transpose sums their gradients: in grad_reduce_dtype, through a
    carrier in that dtype (`engine.hook._with_gradient_carriers`), like every other gradient
    reduction of the step."""
    import re

    from test_option_sweep import BATCH, init_fn, step

    zero = zj.zero_shard(stage=stage, grad_reduce_dtype="bf16", units="Block")
    text = zero(step).lower(zero.eval_shape(init_fn, jax.random.key(0)), BATCH).as_text()
    starts = [m.start() for m in re.finditer(r"stablehlo\.(all_reduce|reduce_scatter)", text)]
    operands = [re.search(r"\(tensor<([^>]*)>", text[i : i + 800])[1] for i in starts]
    assert len(operands) >= 5, operands  # the blocks' 4 biases and the head's leaves at least
    assert all(o.endswith("bf16") for o in operands), operands
