"""DeepSpeed JSON configs: every key acts, is ignored with a reason, or fails clearly; the
presets train; random and mutated configs never raise anything but a named ValueError."""

import json
import pathlib
import subprocess
import sys
import warnings

import jax
import optax
import pytest
from common import batches, make_init, slow, train_step, train_zero
from hypothesis import given, settings
from hypothesis import strategies as st

import zerojax as zj
from zerojax.core import deepspeed_json as ds

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
TABLES = {
    "": ds.TOP_LEVEL,
    "zero_optimization.": ds.ZERO_OPTIMIZATION,
    "fp16.": ds.FP16,
    "bf16.": ds.BF16,
    "zero_optimization.offload_optimizer.": ds.OFFLOAD,
}

# A config a DeepSpeed user brings (HF Accelerate / DeepSpeed docs style).
SEED = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "reduce_bucket_size": 5e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "sub_group_size": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_every_key_is_classified_with_a_reason():
    for prefix, table in TABLES.items():
        for key, entry in table.items():
            assert entry.kind in (ds.ACTS, ds.IGNORED, ds.ERROR), prefix + key
            assert entry.why, prefix + key


def test_a_deepspeed_users_config_is_read_and_explained():
    with pytest.warns(UserWarning, match="(?s)no effect here.*overlap_comm.*latency-hiding"):
        cfg = zj.ZeroConfig.from_json(SEED)
    assert (
        cfg.stage,
        cfg.precision,
        cfg.offload_optimizer,
        cfg.offload_param,
        cfg.prefetch,
        cfg.persistence_threshold,
        cfg.gradient_clipping,
        cfg.loss_scale,
        cfg.gradient_accumulation_steps,
        cfg.train_batch_size,
        cfg.micro_batch_size,
    ) == (3, "fp16", "cpu", "cpu", 1, 100000, 1.0, 0.0, 4, 32, 2)
    rows, _, unknown = ds.explain(SEED, zj.ZeroConfig.defaults())
    kinds = {r.key: r.kind for r in rows}
    # one row per key: 8 top-level, 12 in zero_optimization, 2 x 2 offload keys, 5 fp16 keys
    assert not unknown and len(kinds) == 8 + 12 + 4 + 5
    assert kinds["zero_optimization.overlap_comm"] == ds.IGNORED
    assert kinds["zero_optimization.offload_param.pin_memory"] == ds.ACTS
    assert kinds["fp16.hysteresis"] == ds.ACTS
    # 32 = 2 per device x 4 accumulation x 4 devices: right for 4 devices, wrong for 8
    assert cfg.for_devices(4).train_batch_size == 32
    with pytest.raises(zj.ZeroError, match="train_batch_size 32 != .* 8 devices \\(64\\)"):
        zj.zero_shard(config=SEED)


@pytest.mark.parametrize(
    "data,want",
    [
        ({"zero_optimization": True}, {"stage": 1}),  # legacy form
        ({}, {"stage": 0}),  # DeepSpeed's default
        ({"bfloat16": {"enabled": True}}, {"precision": "bf16"}),
        ({"fp16": {"enabled": "auto"}}, {"precision": "fp32"}),  # HF 'auto': our default
        ({"gradient_clipping": "auto"}, {"gradient_clipping": 0.0}),
        (
            {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}},
            {"persistence_threshold": 1024},
        ),
        ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}, {"prefetch": 0}),
        ({"zero_optimization": {"stage": 2, "cpu_offload": True}}, {"offload_optimizer": "cpu"}),
        (
            {"communication_data_type": "bfloat16", "data_types": {"grad_accum_dtype": "fp32"}},
            {"grad_reduce_dtype": "bf16", "grad_accum_dtype": "fp32"},
        ),
        (
            {"amp": {"enabled": False}, "fp16": {"enabled": True, "consecutive_hysteresis": False}},
            {"precision": "fp16"},
        ),  # features off: accepted
        (
            {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2},
            {"gradient_accumulation_steps": "auto", "train_batch_size": 64, "micro_batch_size": 2},
        ),
    ],
)
def test_keys_that_act(data, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        cfg = zj.ZeroConfig.from_json(data)
    assert {k: getattr(cfg, k) for k in want} == want


@pytest.mark.parametrize(
    "data,match",
    [
        (
            {"zero_optimisation": {"stage": 3}},
            "'zero_optimisation' \\(did you mean 'zero_optimization'\\?\\)",
        ),
        ({"zero_optimization": {"stag": 3}}, "'zero_optimization.stag' \\(did you mean 'stage'"),
        ({"zero_optimization": {"stage": 3.5}}, "zero_optimization.stage must be a whole number"),
        ({"zero_optimization": {"stage": 4}}, "stage must be 0, 1, 2 or 3"),
        ({"zero_optimization": {"zero_quantized_weights": True}}, "qwZ\\) need stage 3"),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
            "nvme_path: NVMe offload is not supported",
        ),
        ({"amp": {"enabled": True}}, "amp: apex AMP is not supported"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, "consecutive_hysteresis"),
        (
            {"fp16": {"enabled": True, "hysterisis": 2}},
            "'fp16.hysterisis' \\(did you mean 'hysteresis'",
        ),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled must be true or false"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
        ({"fp16": {"enabled": False, "loss_scale": 8}}, "fp16 sets loss_scale but is not enabled"),
        ({"communication_data_type": "fp8"}, "communication_data_type must be one of"),
        ({"data_types": {"grad_acum_dtype": "fp32"}}, "did you mean 'grad_accum_dtype'"),
        ({"train_batch_size": 0}, "train_batch_size must be a whole number >= 1"),
        ({"zero_optimization": 3}, "zero_optimization must be an object"),
    ],
)
def test_bad_configs_name_the_key(data, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig.from_json(data)


def test_non_strict_turns_unknown_keys_into_one_warning():
    with pytest.warns(UserWarning, match="WITHOUT these keys: unknown DeepSpeed key 'stagee'"):
        cfg = zj.ZeroConfig.from_json(
            {"stagee": 1, "zero_optimization": {"stage": 2}}, strict=False
        )
    assert cfg.stage == 2


PRESETS = sorted(CONFIGS.glob("*.json"))
TRAINED = ("zero2_fp16.json", "zero3_offload.json", "zero3_zeropp.json")


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_traces_a_step(path):
    # tracing runs every decision the preset's options make (layout, hook, update, offload
    # moves) without compiling; the presets below, and all of them in the slow lane, train
    zero = zj.zero_shard(config=str(path))
    abstract = zero.eval_shape(make_init(optax.adam(1e-3)), jax.random.key(0))
    traced = zero(train_step).trace(abstract, batches(1)[0])
    assert traced.jaxpr.eqns


@pytest.mark.parametrize(
    "path",
    [p for p in PRESETS if p.name in TRAINED]
    + slow(*(p for p in PRESETS if p.name not in TRAINED)),
    ids=lambda p: p.name,
)
def test_presets_train_one_step(path):
    zero = zj.zero_shard(config=str(path))
    _, losses = train_zero(zero, optax.adam(1e-3), batches(1))
    assert len(losses) == 1 and losses[0] > 0


def test_config_explain_command():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.commands.cli",
            "config",
            "explain",
            str(CONFIGS / "zero3_offload.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "zero_optimization.offload_param.device" in out.stdout and "acts" in out.stdout
    assert "ZeroConfig(stage=3" in out.stdout


# ---- property-based: random and mutated configs ------------------------------------------
def _values():
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 10**9),
        st.floats(allow_nan=True),
        st.text(max_size=6),
        st.sampled_from(["auto", "cpu", "nvme", "bf16", "fp32"]),
        st.lists(st.integers(), max_size=2),
        st.just({}),
    )


def _sections():
    keys = st.sampled_from(sorted(ds.ZERO_OPTIMIZATION) + ["stag", "offload"])
    zero = st.dictionaries(
        keys,
        st.one_of(
            _values(),
            st.fixed_dictionaries(
                {}, optional={"device": _values(), "pin_memory": _values(), "ratio": _values()}
            ),
        ),
    )
    prec = st.dictionaries(st.sampled_from(["enabled", *ds.FP16, "bogus"]), _values())
    top = st.sampled_from(sorted(ds.TOP_LEVEL) + ["zero_optimisation", "train_batch"])
    return st.dictionaries(top, st.one_of(_values(), zero, prec), max_size=6)


@settings(max_examples=1500, deadline=None)
@given(_sections())
def test_random_configs_give_a_config_or_a_named_error(data):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = zj.ZeroConfig.from_json(data)
    except (ValueError, TypeError) as e:
        assert isinstance(e, zj.ZeroError), f"{type(e).__name__}: {e}"
        assert str(e)
        return
    assert isinstance(cfg, zj.ZeroConfig)


@settings(max_examples=800, deadline=None)
@given(
    st.sampled_from([p for p in sorted(CONFIGS.glob("*.json"))]),
    st.sampled_from(["replace", "rename"]),
    st.data(),
)
def test_one_mutation_of_a_preset_is_named(path, how, data):
    config = json.loads(path.read_text())
    sections = [("", config)] + [(k + ".", v) for k, v in config.items() if isinstance(v, dict)]
    prefix, section = data.draw(st.sampled_from(sections))
    key = data.draw(st.sampled_from(sorted(section)))
    if how == "rename":
        section[key + "x"] = section.pop(key)
        name = key + "x"
    else:
        section[key] = data.draw(st.sampled_from([["x"], "nvme", -3, 2.5, "", None]))
        name = key
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zj.ZeroConfig.from_json(config)
    except zj.ZeroError as e:
        assert name in str(e) or key in str(e), (config, str(e))
    else:
        assert how == "replace", f"renamed key {name!r} was accepted: {config}"
