"""The conformance lane: published model code, unchanged (Flax's own examples, from Flax's
source distribution on the package registry: tests/published.py), driven by its own train step
with its own argument order, at stages 0-3 with zerojax's defaults (and every leaf split, so
that the tiny configurations shard at all), against the same step under `jax.jit` /
`nnx.jit` on one device. docs/units.md has the table these tests hold."""

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close
from flax import jax_utils, nnx
from published import load

import zerojax as zj

STAGES = (0, 1, 2, 3)
ROWS = 16  # the global batch: 2 rows per simulated device
TOL = 1e-4  # fp32, the bound for 3 AdamW steps


def zero_for(stage, **options):
    """A zero_shard with the defaults, but every leaf of these tiny models split (their leaves
    are under the default persistence_threshold, which would keep stage 3 from gathering)."""
    return zj.zero_shard(stage=stage, **({"persistence_threshold": 0} if stage else {}), **options)


@contextlib.contextmanager
def no_zero_warning():
    """Inside, a ZeroWarning fails the test: the published code needs no change or hint."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", zj.ZeroWarning)
        yield


def assert_restores_across(path, saved_by, state, onto):
    """`state`, saved by the zero `saved_by` (stage 3), restored onto each `(zero, abstract
    state)` of `onto` (another stage's layout): every array bitwise."""
    with zj.CheckpointManager(str(path), saved_by) as ckpt:
        ckpt.save(3, state, force=True)
    want = jax.tree_util.tree_leaves(nnx.state(state) if isinstance(state, tuple) else state)
    for zero, abstract in onto:
        with zj.CheckpointManager(str(path), zero) as ckpt:
            restored, _ = ckpt.restore(abstract)
        got = nnx.state(restored) if isinstance(restored, tuple) else restored
        for a, b in zip(jax.tree_util.tree_leaves(got), want, strict=True):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # a state's dropout key
                a, b = jax.random.key_data(a), jax.random.key_data(b)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- Flax examples/gemma (NNX): its nnx_train_step, call-time Rngs, metrics ------------------
GEMMA_STAND_INS = (
    "clu",
    "clu.metric_writers",
    "clu.periodic_actions",
    "grain",
    "input_pipeline",
    "sampler",
    "tokenizer",
)


@functools.cache
def gemma():
    return load("gemma", ("train", "transformer", "transformer_cfg"), GEMMA_STAND_INS)


def gemma_build(dropout_rate: float, layers: int = 4, embed: int = 32):
    cfg_lib = gemma().transformer_cfg
    kinds = cfg_lib.AttentionType
    config = cfg_lib.TransformerConfig(
        num_layers=layers,
        num_embed=128,
        embed_dim=embed,
        hidden_dim=2 * embed,
        num_heads=2,
        head_dim=embed // 2,
        num_kv_heads=1,
        final_logit_softcap=30.0,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=cfg_lib.make_attention_layers_types(
            (kinds.LOCAL_SLIDING, kinds.GLOBAL), layers
        ),
        use_qk_norm=True,
        sliding_window_size=4,
        dropout_rate=dropout_rate,
    )
    model = gemma().transformer.Transformer(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    return model, optimizer, nnx.Rngs(1), metrics


def gemma_batches(n=3, length=12):
    """What the example's packed input pipeline yields."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        inputs = rng.integers(1, 128, (ROWS, length)).astype(np.int32)
        out.append(
            {
                "inputs": inputs,
                "targets": np.roll(inputs, -1, 1),
                "inputs_position": np.tile(np.arange(length, dtype=np.int32), (ROWS, 1)),
                "inputs_segmentation": np.ones((ROWS, length), np.int32),
            }
        )
    return out


def gemma_train(step, objs, batches):
    model, optimizer, rngs, metrics = objs
    for batch in batches:  # as the example's loop calls it: label_smoothing, pad_id
        step(model, optimizer, rngs, batch, metrics, 0.0, 0)
    return metrics.compute(), nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_flax_nnx_gemma_example_trains_at_every_stage_as_on_one_device_and_restores_across(
    tmp_path,
):
    batches = gemma_batches()
    with jax.default_device(jax.devices()[0]):
        jitted = nnx.jit(
            gemma().train.nnx_train_step, static_argnames=("label_smoothing", "pad_id")
        )
        want, want_params = gemma_train(jitted, gemma_build(0.0), batches)
    for stage in STAGES:
        zero = zero_for(stage)
        with no_zero_warning():
            objs = zero.init(functools.partial(gemma_build, 0.0))
            step = zero(gemma().train.nnx_train_step)
            got, params = gemma_train(step, objs, batches)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=TOL)
        np.testing.assert_allclose(got["accuracy"], want["accuracy"], atol=1e-6)
        assert_trees_close(params, want_params, rtol=TOL, atol=TOL)
        assert step.units == (() if stage == 0 else tuple(f"layers/{i}" for i in range(4)))
        saved = (zero, objs[:2])  # the last, stage 3's: the model and optimizer
    zero = zero_for(0)
    abstract = nnx.eval_shape(lambda: gemma_build(0.0)[:2])
    assert_restores_across(tmp_path, *saved, [(zero, abstract)])


def test_flax_nnx_gemma_example_with_dropout_draws_stage_0s_masks_at_every_stage():
    """Dropout from the Rngs the step passes each block: every stage draws what stage 0 draws
    on each device (one device draws other masks, so stage 0 is the reference)."""
    batches = gemma_batches(2)
    results = []
    for stage in STAGES:
        objs = zero_for(stage).init(functools.partial(gemma_build, 0.1))
        step = zero_for(stage)(gemma().train.nnx_train_step)
        results.append(gemma_train(step, objs, batches))
        assert int(objs[2].default.count[...]) == 2  # rngs.fork() advanced it once a step
    for metrics, params in results[1:]:
        np.testing.assert_allclose(metrics["loss"], results[0][0]["loss"], rtol=TOL)
        assert_trees_close(params, results[0][1], rtol=TOL, atol=TOL)


# ---- Flax examples/lm1b (Linen): its train_step with static config and dropout_rng ------------
LM1B_STAND_INS = (
    "clu",
    "clu.metric_writers",
    "clu.periodic_actions",
    "ml_collections",
    "tensorflow",
    "input_pipeline",
)
# the example's logical names, on a data-only mesh (its own rules name 'fsdp' and 'tensor')
LM1B_RULES = (("embed", None), ("mlp", None), ("kv", None), ("vocab", None))


@functools.cache
def lm1b():
    return load("lm1b", ("train", "models", "utils"), LM1B_STAND_INS)


def lm1b_setup(dropout_rate: float, layers: int = 3, length: int = 16, embed: int = 32):
    ex = lm1b()
    config = ex.models.TransformerConfig(
        vocab_size=64,
        output_vocab_size=64,
        logits_via_embedding=True,
        emb_dim=embed,
        num_heads=2,
        num_layers=layers,
        qkv_dim=embed,
        mlp_dim=2 * embed,
        max_len=length,
        dropout_rate=dropout_rate,
        attention_dropout_rate=dropout_rate,
        deterministic=False,
    )
    lr = ex.train.create_learning_rate_schedule(learning_rate=1e-3, warmup_steps=10)
    tx = optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    model = ex.models.TransformerLM(config.replace(deterministic=True))

    class Lm1bConfig:  # the fields of the example's ml_collections config that init reads
        per_device_batch_size, max_target_length = 2, length

    init_fn = functools.partial(ex.utils.init_train_state, model, tx, Lm1bConfig)
    return config, lr, init_fn


def lm1b_batches(n=3):
    rng = np.random.default_rng(0)
    return [{"inputs": rng.integers(1, 64, (ROWS, 16)).astype(np.int32)} for _ in range(n)]


def lm1b_train(step, state, config, lr, batches):
    for batch in batches:  # as the example's loop calls its jitted step
        state, metrics = step(state, batch, config, lr, 0.0, jax.random.key(1))
    return state, metrics


def test_flax_lm1b_example_trains_at_every_stage_as_on_one_device_and_restores_across(
    tmp_path,
):
    config, lr, init_fn = lm1b_setup(0.0)
    batches = lm1b_batches()
    with jax.default_device(jax.devices()[0]):
        jitted = jax.jit(lm1b().train.train_step, static_argnums=(2, 3, 4))
        want, _ = lm1b_train(jitted, jax.jit(init_fn)(jax.random.key(0)), config, lr, batches)
    states = {}
    for stage in STAGES:
        zero = zero_for(stage, logical_rules=LM1B_RULES)
        with no_zero_warning():
            state = zero.init(init_fn, jax.random.key(0))
            step = zero(lm1b().train.train_step, static_argnums=(2, 3, 4))
            state, _ = lm1b_train(step, state, config, lr, batches)
        assert_trees_close(state.params, want.params, rtol=TOL, atol=TOL)
        blocks = tuple(f"decoder/encoderdecoderblock_{i}" for i in range(3))
        assert step.units == (() if stage == 0 else blocks)
        states[stage] = (zero, state)
    abstract = lambda zero: zero.eval_shape(init_fn, jax.random.key(0))
    onto = [(states[s][0], abstract(states[s][0])) for s in (0, 1)]
    assert_restores_across(tmp_path, *states[3], onto)


def lm1b_peak_setup(layers: int, length: int = 128, embed: int = 64):
    """(init_fn, train_step, its arguments after the state) for a compiled-peak report."""
    config, lr, init_fn = lm1b_setup(0.0, layers, length, embed)
    batch = {"inputs": jax.ShapeDtypeStruct((8, length), np.int32)}
    return init_fn, lm1b().train.train_step, (batch, config, lr, 0.0, jax.random.key(1))


def lm1b_slope(stage: int, **options) -> float:
    """Slope = (peak(L=4) - peak(L=2)) / 2 per device, sequence 128, d_model 64."""
    peaks = []
    for layers in (2, 4):
        init_fn, step, args = lm1b_peak_setup(layers)
        zero = zero_for(stage, logical_rules=LM1B_RULES, **options)
        state = zero.eval_shape(init_fn, jax.random.key(0))
        peaks.append(zero.report(zero(step, static_argnums=(2, 3, 4)), state, *args).peak_bytes)
    return (peaks[1] - peaks[0]) / 2


def test_lm1b_stage3_peak_grows_per_layer_at_most_015_of_stage_0s_recomputing_units():
    """Recomputing units, each keeps only its input (measured 0.09 of stage 0's slope; the
    default, which keeps each unit's activations, 0.64: bench/published_slopes.py)."""
    stage0 = lm1b_slope(0)
    assert lm1b_slope(3, recompute_units=True) <= 0.15 * stage0


def test_plan_and_describe_take_the_steps_arguments_as_it_is_called():
    """lm1b's step takes config, schedule, smoothing and a dropout key after the batch; the NNX
    gemma example's takes its Rngs before the batch and metrics after it."""
    config, lr, init_fn = lm1b_setup(0.0)
    zero = zero_for(3, logical_rules=LM1B_RULES)
    state = zero.eval_shape(init_fn, jax.random.key(0))
    step = zero(lm1b().train.train_step, static_argnums=(2, 3, 4))
    args = (state, lm1b_batches(1)[0], config, lr, 0.0, jax.random.key(1))
    units = {p.unit for p in zero.plan(state, step=step, step_args=args)}
    assert units == {None, *(f"decoder/encoderdecoderblock_{i}" for i in range(3))}
    assert "encoderdecoderblock_2" in str(
        zero.describe(state, step=step, step_args=args, show=False)
    )
    with pytest.raises(zj.ZeroError, match="step_args="):
        zero.plan(state, step=step)
    zero = zero_for(3)
    model, optimizer, rngs, metrics = zero.eval_shape(functools.partial(gemma_build, 0.0))
    step = zero(gemma().train.nnx_train_step)
    args = (model, optimizer, rngs, gemma_batches(1)[0], metrics, 0.0, 0)
    units = {p.unit for p in zero.plan((model, optimizer), step=step, step_args=args)}
    assert units == {None, *(f"layers/{i}" for i in range(4))}


def test_a_missing_logical_rule_error_names_every_missing_name_and_rules_that_work():
    _, _, init_fn = lm1b_setup(0.0)
    with pytest.raises(zj.ZeroError) as raised:
        zero_for(3).init(init_fn, jax.random.key(0))
    for name in ("embed", "mlp", "kv", "vocab"):
        assert repr(name) in str(raised.value), (name, str(raised.value))
    assert "logical_rules=" in str(raised.value)


# ---- Flax examples/imagenet (Linen ResNet, BatchNorm, train: bool): a jax.pmap step ---------
@functools.cache
def imagenet():
    return load("imagenet", ("train", "models"), (*LM1B_STAND_INS, "tensorflow_datasets"))


def imagenet_setup():
    """(init_fn, learning-rate schedule) for the example's ResNet with two blocks, its
    `create_train_state` (SGD with Nesterov momentum, batch statistics in the state)."""
    ex = imagenet()
    model = ex.models.ResNet(
        stage_sizes=[2], block_cls=ex.models.ResNetBlock, num_classes=1000, num_filters=8
    )

    class Config:  # the fields of the example's ml_collections config that init reads
        half_precision, momentum = False, 0.9

    lr = lambda step: 0.1
    return (lambda key: ex.train.create_train_state(key, Config, model, 16, lr)), lr


def imagenet_batches(n=3):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(ROWS, 16, 16, 3)).astype(np.float32),
            "label": rng.integers(0, 1000, ROWS).astype(np.int32),
        }
        for _ in range(n)
    ]


def imagenet_jit_step(state, batch, learning_rate_fn):
    """The example's train_step as a `jax.jit` port writes it: its loss (cross-entropy and the
    weight penalty) and batch-statistics update, without the `lax.pmean`s that make it a
    `jax.pmap` program (of the gradients, the batch statistics and the metrics)."""

    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        loss = imagenet().train.cross_entropy_loss(logits, batch["label"])
        weight_l2 = sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
        return loss + 0.0001 * 0.5 * weight_l2, new_model_state

    (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new, loss


def test_flax_imagenet_resnet_trains_at_every_stage_as_its_released_pmap_step_does(tmp_path):
    """BatchNorm normalises each device's rows, as under the example's own `jax.pmap` loop:
    its released train_step, pmapped over the 8 devices, is the reference (per-device
    statistics averaged, as its `lax.pmean` does)."""
    init_fn, lr = imagenet_setup()
    batches = imagenet_batches()
    pmapped = jax.pmap(imagenet().train.train_step, axis_name="batch", static_broadcasted_argnums=2)
    want = jax_utils.replicate(jax.jit(init_fn)(jax.random.key(0)))
    for batch in batches:  # as the example's loop shards each batch over the local devices
        want, _ = pmapped(
            want, jax.tree_util.tree_map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch), lr
        )
    want = jax_utils.unreplicate(want)
    for stage in STAGES:  # the mesh's axis named as the model's BatchNorm names its axis
        zero = zero_for(stage, axis="batch")
        with no_zero_warning():
            state = zero.init(init_fn, jax.random.key(0))
            step = zero(imagenet_jit_step, static_argnums=(2,))
            for batch in batches:
                state, _ = step(state, batch, lr)
        assert_trees_close(state.params, want.params, rtol=TOL, atol=TOL)
        assert_trees_close(state.batch_stats, want.batch_stats, rtol=TOL, atol=TOL)
        assert step.units == (() if stage == 0 else ("ResNetBlock_0", "ResNetBlock_1"))
    zero0 = zero_for(0, axis="batch")
    assert_restores_across(
        tmp_path, zero, state, [(zero0, zero0.eval_shape(init_fn, jax.random.key(0)))]
    )


def test_flax_imagenet_resnet_on_a_mesh_without_its_batchnorm_axis_is_told_to_name_it():
    """Its BatchNorm reduces over 'batch'; on the default mesh ('data') a ZeroError names the
    axis and the option, where jax raised a bare AssertionError."""
    init_fn, lr = imagenet_setup()
    zero = zero_for(3)
    state = zero.init(init_fn, jax.random.key(0))
    step = zero(imagenet_jit_step, static_argnums=(2,))
    with pytest.raises(zj.ZeroError, match=r"axis 'batch'.*zero_shard\(\.\.\., axis='batch'\)"):
        step(state, imagenet_batches(1)[0], lr)


def test_flax_imagenet_examples_pmap_step_is_refused_with_what_to_remove():
    """Its train_step averages the gradients with `lax.pmean(grads, axis_name='batch')`: a
    program for jax.pmap, which jax.jit cannot trace either. zerojax says what to remove."""
    init_fn, lr = imagenet_setup()
    zero = zero_for(3)
    state = zero.init(init_fn, jax.random.key(0))
    with pytest.raises(zj.ZeroError, match="reduces over the axis 'batch'.*jax.pmap"):
        zero(imagenet().train.train_step, static_argnums=(2,))(state, imagenet_batches(1)[0], lr)


# ---- Flax examples/wmt (Linen encoder-decoder, packed examples): a jax.pmap step -------------
WMT_STAND_INS = (*LM1B_STAND_INS, "bleu", "decode", "orbax.checkpoint")


@functools.cache
def wmt():
    return load("wmt", ("train", "models"), WMT_STAND_INS)


def wmt_setup():
    ex = wmt()
    config = ex.models.TransformerConfig(
        vocab_size=64,
        output_vocab_size=64,
        emb_dim=32,
        num_heads=2,
        num_layers=2,
        qkv_dim=32,
        mlp_dim=64,
        max_len=16,
        dropout_rate=0.0,
        attention_dropout_rate=0.0,
    )
    lr = ex.train.create_learning_rate_schedule(learning_rate=1e-3, warmup_steps=10)

    def init_fn(key):  # as the example's train_and_evaluate creates its state
        model = ex.models.Transformer(config.replace(deterministic=True))
        variables = model.init(key, jnp.ones((1, 16), jnp.float32), jnp.ones((1, 16), jnp.float32))
        tx = optax.adamw(learning_rate=lr, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
        return ex.train.TrainState.create(
            apply_fn=model.apply, params=variables["params"], tx=tx, dynamic_scale=None
        )

    return config, lr, init_fn


def wmt_batches(n=3):
    """Packed examples, as the example's input pipeline yields them: two sequences per row."""
    rng = np.random.default_rng(0)
    halves = lambda: np.tile(np.r_[np.arange(8), np.arange(8)].astype(np.int32), (ROWS, 1))
    segments = np.tile(np.r_[np.ones(8), 2 * np.ones(8)].astype(np.int32), (ROWS, 1))
    out = []
    for _ in range(n):
        batch = {k: rng.integers(1, 64, (ROWS, 16)).astype(np.int32) for k in ("inputs", "targets")}
        batch |= {"inputs_position": halves(), "targets_position": halves()}
        batch |= {"inputs_segmentation": segments, "targets_segmentation": segments}
        out.append(batch)
    return out


def wmt_jit_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """The example's train_step as a `jax.jit` port writes it: its model call and its loss
    (`compute_weighted_cross_entropy`), without the `lax.pmean` of the gradients and the
    `lax.psum` of the metrics that make it a `jax.pmap` program."""
    ex = wmt()
    weights = jnp.where(batch["targets"] > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = ex.models.Transformer(config).apply(
            {"params": params},
            batch["inputs"],
            batch["targets"],
            inputs_positions=batch["inputs_position"],
            targets_positions=batch["targets_position"],
            inputs_segmentation=batch["inputs_segmentation"],
            targets_segmentation=batch["targets_segmentation"],
            rngs={"dropout": dropout_rng},
        )
        loss, weight_sum = ex.train.compute_weighted_cross_entropy(
            logits, batch["targets"], weights, label_smoothing
        )
        return loss / weight_sum

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_flax_wmt_model_trains_at_every_stage_as_on_one_device_from_a_jit_port_of_its_step(
    tmp_path,
):
    config, lr, init_fn = wmt_setup()
    batches = wmt_batches()
    run = lambda step, state: [
        state := step(state, b, config, lr, 0.0, jax.random.key(1))[0] for b in batches
    ][-1]
    with jax.default_device(jax.devices()[0]):
        want = run(
            jax.jit(wmt_jit_step, static_argnums=(2, 3, 4)), jax.jit(init_fn)(jax.random.key(0))
        )
    for stage in STAGES:
        zero = zero_for(stage)
        with no_zero_warning():
            step = zero(wmt_jit_step, static_argnums=(2, 3, 4))
            state = run(step, zero.init(init_fn, jax.random.key(0)))
        assert_trees_close(state.params, want.params, rtol=TOL, atol=TOL)
        blocks = [f"encoder/encoderblock_{i}" for i in range(2)]
        blocks += [f"decoder/encoderdecoderblock_{i}" for i in range(2)]
        assert step.units == (() if stage == 0 else tuple(sorted(blocks)))
    zero0 = zero_for(0)
    assert_restores_across(
        tmp_path, zero, state, [(zero0, zero0.eval_shape(init_fn, jax.random.key(0)))]
    )


def test_flax_wmt_examples_pmap_step_is_refused_with_what_to_remove():
    """Its train_step, as released, averages the gradients with `lax.pmean` over 'batch'."""
    config, lr, init_fn = wmt_setup()
    zero = zero_for(3)
    state = zero.init(init_fn, jax.random.key(0))
    step = zero(wmt().train.train_step, static_argnums=(2, 3, 4))
    with pytest.raises(zj.ZeroError, match="reduces over the axis 'batch'.*jax.pmap"):
        step(state, wmt_batches(1)[0], config, lr, 0.0, jax.random.key(1))


# ---- Flax examples/sst2 (Linen): a bidirectional nn.scan LSTM from a zeros carry ---------------
SST2_STAND_INS = (
    "absl",
    "absl.logging",
    "flax.metrics.tensorboard",
    "ml_collections",
    "tensorflow",
    "input_pipeline",
)


@functools.cache
def sst2():
    return load("sst2", ("train", "models"), SST2_STAND_INS)


def sst2_state():
    ex = sst2()
    model = ex.models.TextClassifier(
        embedding_size=16, hidden_size=32, vocab_size=64, output_size=1, dropout_rate=0.0,
        word_dropout_rate=0.0, unk_idx=1,
    )  # fmt: skip

    class Sst2Config:  # the fields of the example's ml_collections config it reads
        learning_rate, momentum, weight_decay = 0.1, 0.9, 3e-6

    return ex.train.create_train_state(jax.random.key(0), Sst2Config, model)


def sst2_batches(n=3, length=10):
    rng = np.random.default_rng(0)
    return [
        {
            "token_ids": rng.integers(2, 64, (ROWS, length)).astype(np.int32),
            "length": rng.integers(3, length + 1, ROWS).astype(np.int32),
            "label": rng.integers(0, 2, ROWS).astype(np.float32),
        }
        for _ in range(n)
    ]


def sst2_train(step, state):
    rngs = {"dropout": jax.random.key(3)}
    for batch in sst2_batches():  # as the example's train_epoch calls its jitted step
        state, metrics = step(state, batch, rngs)
    return state, metrics


def test_flax_sst2_bilstm_trains_at_every_stage_as_its_released_jit_step_does():
    """Its `SimpleLSTM` is an `nn.scan` over time of an `OptimizedLSTMCell` from a zeros carry
    (`initialize_carry`), whose parameters the scan broadcasts: under varying-axes checking its
    carry failed to type-check at every stage. Neither LSTM nor its cell is a unit of
    `units='auto'` (the scan runs them once per time step on the same weights: a unit would
    gather them once per time step, 11x the bytes sent); the classifier's same-class siblings
    are."""
    with jax.default_device(jax.devices()[0]):
        want, want_metrics = sst2_train(jax.jit(sst2().train.train_step), sst2_state())
    classifier = {
        "classifier/keys_only_mlp_attention/energy",
        "classifier/keys_only_mlp_attention/keys",
        "classifier/mlp/intermediate_layer",
        "classifier/mlp/output_layer",
    }
    for stage in STAGES:
        zero = zero_for(stage)
        with no_zero_warning():
            step = zero(sst2().train.train_step)
            got, metrics = sst2_train(step, zero.shard(sst2_state()))
        np.testing.assert_allclose(metrics.loss, want_metrics.loss, rtol=TOL)
        assert_trees_close(got.params, want.params, rtol=TOL, atol=TOL)
        assert set(step.units) == (classifier if stage else set()), step.units
