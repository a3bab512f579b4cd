"""ZeroConfig and DeepSpeed JSON: every option validated, unknown keys named with the nearest."""
import json
import pathlib

import pytest

import zerojax as zj

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"


def test_defaults_and_overrides():
    cfg = zj.ZeroConfig()
    assert (cfg.stage, cfg.axis, cfg.persistence_threshold) == (0, "data", 1024)
    assert cfg.replace(stage=2).stage == 2 and cfg.stage == 0
    with pytest.raises(zj.ZeroError, match="did you mean 'persistence_threshold'"):
        cfg.replace(persistance_threshold=3)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_presets_load(stage):
    cfg = zj.ZeroConfig.from_json(CONFIGS / f"zero{stage}.json")
    assert cfg.stage == stage and cfg.persistence_threshold == 1024


def test_offload_preset_and_deepspeed_offload_blocks():
    cfg = zj.ZeroConfig.from_json(CONFIGS / "zero3_offload.json")
    assert (cfg.stage, cfg.precision, cfg.offload_optimizer, cfg.offload_param, cfg.prefetch) \
        == (3, "bf16", "cpu", "cpu", 1)
    no_prefetch = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}}
    assert zj.ZeroConfig.from_json(no_prefetch).prefetch == 0
    tuned = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                      "buffer_count": 4}}}
    with pytest.raises(zj.ZeroError, match="offload_optimizer.buffer_count"):
        zj.ZeroConfig.from_json(tuned)
    with pytest.warns(UserWarning, match="buffer_count"):
        assert zj.ZeroConfig.from_json(tuned, strict=False).offload_optimizer == "cpu"


@pytest.mark.parametrize("kwargs,match", [
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "'nvme' is not supported"),
    ({"stage": 3, "offload_param": "gpu"}, "did you mean 'cpu'"),
    ({"stage": 0, "offload_optimizer": "cpu"}, "needs stage >= 1"),
    ({"stage": 2, "offload_param": "cpu"}, "needs stage 3"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, "pin_memory"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "pinned": True}}, "'pinned' is not"),
    ({"stage": 2, "offload_update": "host"}, "set offload_optimizer='cpu'"),
    ({"stage": 2, "offload_activations": True, "explicit_collectives": False}, "apply_fn"),
    ({"stage": 3, "prefetch": 2}, "prefetch must be 0 or 1"),
])
def test_bad_offload_and_prefetch_options(kwargs, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig(**kwargs)


def test_json_path_then_keyword_overrides():
    zero = zj.zero_shard(config=str(CONFIGS / "zero3.json"), persistence_threshold=0)
    assert zero.config.stage == 3 and zero.config.persistence_threshold == 0
    assert zj.zero_shard(stage=1, config=str(CONFIGS / "zero3.json")).config.stage == 1


def test_deepspeed_dict_and_legacy_bool():
    assert zj.ZeroConfig.from_json({"zero_optimization": {"stage": 2}}).stage == 2
    assert zj.ZeroConfig.from_json({"zero_optimization": True}).stage == 1
    assert zj.ZeroConfig.from_json({}).stage == 0      # DeepSpeed's default


@pytest.mark.parametrize("data,match", [
    ({"zero_optimisation": {"stage": 3}}, "unknown DeepSpeed config key 'zero_optimisation' "
                                          "\\(did you mean 'zero_optimization'\\?\\)"),
    ({"zero_optimization": {"stag": 3}}, "did you mean 'stage'"),
    ({"zero_optimization": {"stage": 3.5}}, "whole number"),
    ({"zero_optimization": {"stage": 4}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}},
     "zero_optimization.zero_hpz_partition_size: not implemented"),
    ({"train_batch_size": 64}, "train_batch_size: not implemented"),
    ({"fp16": {"enabled": True, "hysterisis": 2}}, "did you mean 'hysteresis'"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"fp16": {"enabled": False, "loss_scale": 8}}, "not enabled"),
    ({"communication_data_type": "fp8"}, "must be one of fp32, fp16, bf16"),
    ({"data_types": {"grad_acum_dtype": "fp32"}}, "did you mean 'grad_accum_dtype'"),
    ({"gradient_accumulation_step": 2}, "did you mean 'gradient_accumulation_steps'"),
])
def test_bad_deepspeed_configs(data, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig.from_json(data)


def test_non_strict_warns_loudly_and_keeps_what_acts():
    with pytest.warns(UserWarning, match="(?s)WITHOUT these DeepSpeed keys.*overlap_comm"):
        cfg = zj.ZeroConfig.from_json(
            {"zero_optimization": {"stage": 2, "overlap_comm": True}}, strict=False)
    assert cfg.stage == 2


def test_bad_files(tmp_path):
    with pytest.raises(zj.ZeroError, match="does not exist"):
        zj.ZeroConfig.from_json(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 3")
    with pytest.raises(zj.ZeroError, match="not valid JSON"):
        zj.ZeroConfig.from_json(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert zj.ZeroConfig.from_json(good).stage == 3


def test_deepspeed_precision_accumulation_and_clipping_keys():
    cfg = zj.ZeroConfig.from_json({
        "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
        "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
        "communication_data_type": "bf16", "data_types": {"grad_accum_dtype": "fp32"}})
    assert (cfg.stage, cfg.precision, cfg.gradient_accumulation_steps, cfg.gradient_clipping,
            cfg.grad_reduce_dtype, cfg.grad_accum_dtype) == (2, "bf16", 4, 1.0, "bf16", "fp32")
    fp16 = zj.ZeroConfig.from_json({"fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
        "hysteresis": 3, "min_loss_scale": 0.5}})
    assert (fp16.precision, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window,
            fp16.hysteresis, fp16.min_loss_scale) == ("fp16", 0.0, 12, 500, 3, 0.5)


@pytest.mark.parametrize("kwargs,match", [
    ({"precision": "bf16", "hysteresis": 4}, "only apply with precision='fp16'"),
    ({"precision": "fp8"}, "precision must be one of"),
    ({"stage": 3, "accumulate": "local", "gradient_accumulation_steps": 2}, "stage 3 exists"),
    ({"gradient_accumulation_steps": 0}, ">= 1"),
    ({"precision": "fp16", "min_loss_scale": 0.0}, "min_loss_scale > 0"),
])
def test_bad_update_options(kwargs, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig(**kwargs)
