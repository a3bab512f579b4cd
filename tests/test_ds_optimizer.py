"""DeepSpeed's `optimizer` and `scheduler` blocks: the Hugging Face accelerate templates train,
each optimizer type equals its hand-written optax, and each schedule follows DeepSpeed's
formulas (written out below, as DeepSpeed's lr_schedules.py computes them)."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import batches, initial_state, train_step
from optax import contrib

import zerojax as zj
from zerojax.core import deepspeed_json as ds

# The shape of accelerate's / the HF Trainer's DeepSpeed templates: every value "auto".
AUTO_ADAMW = {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
}
HF_ZERO2 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": AUTO_ADAMW,
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **HF_ZERO2,
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _leaf_keys(data, prefix=""):
    """Every key of a config that holds a value (not a block), nested ones as dotted paths;
    a precision block's `enabled` is its block's own row."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out += _leaf_keys(value, f"{prefix}{key}.")
        elif key != "enabled":
            out.append(prefix + key)
    return out


@pytest.mark.parametrize("config", [HF_ZERO2, HF_ZERO3], ids=["zero2", "zero3"])
def test_an_accelerate_template_trains_three_steps(config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zj.ZeroWarning)  # the ignored keys, listed once
        zero = zj.zero_shard(config=config, gradient_clipping=1.0)  # HF fills "auto" so
    assert zero.config.gradient_clipping == 1.0 and zero.config.precision == "fp32"
    tx = zj.optimizer_from_config(config, lr=1e-3, warmup_num_steps=2, total_num_steps=10)
    state = zero.shard(initial_state(tx))
    losses = []
    for batch in batches(3):
        state, metrics = zero(train_step)(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses))
    # clipping makes zerojax manage the update: the user's optax state is `inner`
    rate = state.opt_state.inner.hyperparams["learning_rate"]  # update 2: iteration 1, warm
    assert float(rate) == pytest.approx(1e-3)
    rows, _, unknown = ds.explain(config, zj.ZeroConfig.defaults())
    keys = [r.key for r in rows]  # one line per key
    assert not unknown and len(keys) == len(set(keys)) and set(_leaf_keys(config)) <= set(keys)


def test_auto_takes_the_keyword_option_passed_beside_the_config():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zj.ZeroWarning)
        assert zj.zero_shard(config=HF_ZERO2, precision="bf16").config.precision == "bf16"
        fp16 = zj.zero_shard(config=HF_ZERO2, precision="fp16").config
    assert fp16.precision == "fp16" and fp16.hysteresis == 2  # its block's keys now act


# ---- each optimizer type against the optax a user would write by hand -----------------------
STEPS = 20


def _updates(tx, seed=0):
    """The updates `tx` gives over STEPS steps of fixed random gradients on a small model."""
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32), "b": jnp.ones((16,))}
    state, out = tx.init(params), []
    for _ in range(STEPS):
        grads = jax.tree_util.tree_map(
            lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params
        )
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def _optimizer(kind, **params):
    return zj.optimizer_from_config({"optimizer": {"type": kind, "params": params}})


BETAS = [0.8, 0.95]
OPTIMIZERS = [
    (
        "Adam",
        {"lr": 0.01, "betas": BETAS, "eps": 1e-6, "weight_decay": 0.1},
        optax.adamw(0.01, 0.8, 0.95, 1e-6, weight_decay=0.1),
    ),  # adam_w_mode defaults to true
    (
        "Adam",
        {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False},
        optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01)),
    ),  # L2
    (
        "AdamW",
        {"lr": 0.01, "betas": BETAS, "weight_decay": 0.01},
        optax.adamw(0.01, 0.8, 0.95, 1e-8, weight_decay=0.01),
    ),
    (
        "Lamb",
        {"lr": 0.01, "betas": BETAS, "weight_decay": 0.01, "max_coeff": 1e9, "min_coeff": 0},
        optax.lamb(0.01, 0.8, 0.95, 1e-8, weight_decay=0.01),
    ),  # bounds that never bind
    (
        "Lion",
        {"lr": 0.001, "betas": [0.9, 0.99], "weight_decay": 0.1},
        optax.lion(0.001, 0.9, 0.99, weight_decay=0.1),
    ),
    (
        "SGD",
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        optax.chain(optax.add_decayed_weights(0.01), optax.sgd(0.1, 0.9, nesterov=True)),
    ),
    (
        "Muon",
        {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.01},
        contrib.muon(0.02, beta=0.9, weight_decay=0.01, adam_weight_decay=0.01),
    ),
]


@pytest.mark.parametrize(
    "kind,params,by_hand", OPTIMIZERS, ids=[f"{k}-{i}" for i, (k, *_) in enumerate(OPTIMIZERS)]
)
def test_each_optimizer_type_equals_its_optax(kind, params, by_hand):
    for ours, theirs in zip(_updates(_optimizer(kind, **params)), _updates(by_hand), strict=True):
        jax.tree_util.tree_map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), ours, theirs
        )


def test_lamb_clamps_its_trust_ratio_as_fused_lamb_does():
    """A tiny update on large weights: ||p|| / ||update|| far above max_coeff = 10, so the
    step is 10 x lr x update (optax's unclamped LAMB would take the whole ratio)."""
    tx = _optimizer("Lamb", lr=0.1)
    params = {"w": jnp.full((4,), 100.0)}
    updates, _ = tx.update({"w": jnp.full((4,), 1e-3)}, tx.init(params), params)
    adam = 1e-3 / (1e-3 + 1e-8)  # Adam's first step: g / (|g| + eps); ratio 200 / 2 -> 10
    np.testing.assert_allclose(updates["w"], -0.1 * 10.0 * adam, rtol=1e-4)


# ---- schedules, against DeepSpeed's formulas ---------------------------------------------------
def ds_warmup(i, low, high, steps, kind):
    steps = max(2, steps)
    if i < 0:
        return low
    gamma = 1.0
    if i < steps:
        gamma = math.log(i + 1) / math.log(steps) if kind == "log" else i / steps
    return low + (high - low) * gamma


def ds_warmup_decay(i, low, high, steps, total, kind):
    if i < 0 or i < max(2, steps):
        return ds_warmup(i, low, high, steps, kind)
    steps = max(2, steps)
    return low + (high - low) * max(0.0, (total - i) / max(1.0, total - steps))


def ds_warmup_cosine(i, lr, start, steps, total, floor, kind):
    steps = max(2, steps)
    if i < 0:
        return 0.0
    if i < steps:
        ramp = math.log(i + 1) / math.log(steps) if kind == "log" else i / steps
        return lr * (start + ramp * (1 - start))
    progress = min(1.0, (i - steps + 1) / max(1, total - steps))
    return lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def ds_one_cycle(i, low, high, first, second, decay_rate, decay_every, mom_low, mom_high):
    """(lr, beta1) at iteration i; i = -1: the values OneCycle sets when it is built."""
    if i < 0:
        return low, mom_low
    total = first + second
    if i < total:
        x = 1.0 + (i + 1) / total - math.floor(1 + (i + 1) / total)
        scale = x / (first / total) if x <= first / total else (x - 1) / (first / total - 1)
        return low + (high - low) * scale, mom_high - (mom_high - mom_low) * scale
    return low / (1 + decay_rate * (i - total + 1) / decay_every), mom_high


SCHEDULES = [
    (
        "WarmupLR",
        {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 8},
        lambda i: ds_warmup(i, 1e-4, 1e-2, 8, "log"),
    ),
    (
        "WarmupLR",
        {"warmup_max_lr": 1e-2, "warmup_num_steps": 8, "warmup_type": "linear"},
        lambda i: ds_warmup(i, 0.0, 1e-2, 8, "linear"),
    ),
    (
        "WarmupDecayLR",
        {"warmup_max_lr": 1e-2, "warmup_num_steps": 5, "total_num_steps": 15},
        lambda i: ds_warmup_decay(i, 0.0, 1e-2, 5, 15, "log"),
    ),
    (
        "WarmupCosineLR",
        {
            "warmup_num_steps": 5,
            "total_num_steps": 15,
            "warmup_min_ratio": 0.1,
            "warmup_type": "linear",
        },
        lambda i: ds_warmup_cosine(i, 1e-2, 0.1, 5, 15, 1e-4, "linear"),
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 6,
            "cycle_second_step_size": 4,
            "decay_lr_rate": 0.5,
            "decay_step_size": 2,
        },
        lambda i: ds_one_cycle(i, 1e-3, 1e-2, 6, 4, 0.5, 2, 0.8, 0.9)[0],
    ),
]


@pytest.mark.parametrize(
    "kind,params,want", SCHEDULES, ids=[f"{k}-{i}" for i, (k, *_) in enumerate(SCHEDULES)]
)
def test_each_schedule_follows_deepspeeds_formula(kind, params, want):
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": kind, "params": params},
    }
    tx = zj.optimizer_from_config(config)
    params_ = {"w": jnp.ones((3,))}
    state = tx.init(params_)
    for k in range(STEPS):  # update k runs with the scheduler at iteration k - 1
        _, state = tx.update({"w": jnp.ones((3,))}, state, params_)
        assert float(state.hyperparams["learning_rate"]) == pytest.approx(want(k - 1), rel=1e-5)
        if kind == "OneCycle":  # beta1 cycles with it, beta2 is set to 0.99
            mom = ds_one_cycle(k - 1, 1e-3, 1e-2, 6, 4, 0.5, 2, 0.8, 0.9)[1]
            assert float(state.hyperparams["b1"]) == pytest.approx(mom, rel=1e-5)
            assert float(state.hyperparams["b2"]) == pytest.approx(0.99)


# ---- what fails, and how ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "config,auto,match",
    [
        ({"optimizer": {"type": "OneBitAdam"}}, {}, "communication-compressed.*use 'Adam'"),
        ({"optimizer": {"type": "ZeroOneAdam"}}, {}, "use 'Adam'"),
        ({"optimizer": {"type": "Adamm"}}, {}, "not supported; the nearest is 'Adam'"),
        (
            {"optimizer": {"type": "Adam"}, "scheduler": {"type": "LRRangeTest"}},
            {},
            "LRRangeTest' is not supported.*WarmupLR",
        ),
        ({"optimizer": AUTO_ADAMW}, {}, r"optimizer.params.lr is 'auto'.*lr=\.\.\."),
        (HF_ZERO2, {"lr": 1e-3}, r"warmup_num_steps is 'auto'.*warmup_num_steps=\.\.\."),
        (
            {"optimizer": {"type": "Adam", "params": {"betaz": [0.9, 0.9]}}},
            {},
            "did you mean 'betas'",
        ),
        (
            {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
            {},
            "amsgrad=True is not supported",
        ),
        (
            {"optimizer": AUTO_ADAMW},
            {"learning_rate": 1e-3},
            "unknown values \\['learning_rate'\\]",
        ),
        ({"zero_optimization": {"stage": 2}}, {}, "no optimizer block"),
        (
            {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupDecayLR"}},
            {},
            "needs total_num_steps",
        ),
    ],
)
def test_what_cannot_be_built_is_named(config, auto, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.optimizer_from_config(config, **auto)


def test_a_config_with_an_unsupported_optimizer_still_configures_zero():
    """The user's optax code may provide the optimizer: the block is explained, not refused."""
    config = {
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    assert zj.ZeroConfig.from_json(config).stage == 2
    rows = {r.key: r.what for r in ds.explain(config)[0]}
    assert "communication-compressed" in rows["optimizer.type"]
