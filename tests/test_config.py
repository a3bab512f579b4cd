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
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param: not implemented"),
    ({"fp16": {"enabled": True}}, "fp16: not implemented"),
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
