"""ZeroConfig: every option validated, unknown names named with the nearest; JSON files."""

import json
import pathlib

import pytest

import zerojax as zj
from zerojax.core.config_files import presets

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"


def test_defaults_and_overrides():
    cfg = zj.ZeroConfig()
    assert (cfg.stage, cfg.axis, cfg.persistence_threshold) == (0, "data", 1024)
    assert cfg.replace(stage=2).stage == 2 and cfg.stage == 0
    with pytest.raises(zj.ZeroError, match="did you mean 'persistence_threshold'"):
        cfg.replace(persistance_threshold=3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "'nvme' is not supported"),
        ({"stage": 3, "offload_param": "gpu"}, "did you mean 'cpu'"),
        ({"stage": 0, "offload_optimizer": "cpu"}, "needs stage >= 1"),
        ({"stage": 2, "offload_param": "cpu"}, "needs stage 3"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}, "pin_memory"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "pinned": True}}, "'pinned' is not"),
        ({"stage": 2, "offload_update": "host"}, "set offload_optimizer='cpu'"),
        ({"stage": 2, "offload_activations": True, "explicit_collectives": False}, "apply_fn"),
        ({"stage": 3, "prefetch": 2}, "prefetch must be 0 or 1"),
        ({"explicit_collectives": "no"}, "explicit_collectives must be True or False"),
        ({"donate": 1}, "donate must be True or False"),
    ],
)
def test_bad_offload_and_prefetch_options(kwargs, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig(**kwargs)


def test_json_path_then_keyword_overrides():
    zero = zj.zero_shard(config=str(CONFIGS / "zero3.json"), persistence_threshold=0)
    assert zero.config.stage == 3 and zero.config.persistence_threshold == 0
    assert zj.zero_shard(stage=1, config=str(CONFIGS / "zero3.json")).config.stage == 1


def test_shipped_presets_are_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the presets ship inside the package
    for name in ("zero3_offload", "zero3_offload.json", "configs/zero3_offload.json"):
        cfg = zj.ZeroConfig.from_json(name)
        assert cfg.stage == 3 and cfg.offload_optimizer == "cpu"
    assert sorted(p.stem for p in CONFIGS.glob("*.json")) == presets()
    with pytest.raises(zj.ZeroError, match="not a zerojax preset .did you mean 'zero3'"):
        zj.zero_shard(config="zero9")


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


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"precision": "bf16", "hysteresis": 4}, "only apply with precision='fp16'"),
        ({"precision": "fp8"}, "precision must be one of"),
        ({"stage": 3, "accumulate": "local", "gradient_accumulation_steps": 2}, "stage 3 exists"),
        ({"gradient_accumulation_steps": 0}, ">= 1"),
        ({"precision": "fp16", "min_loss_scale": 0.0}, "min_loss_scale > 0"),
        ({"train_batch_size": -1}, "train_batch_size must be an integer"),
        ({"micro_batch_size": 2.5}, "micro_batch_size must be an integer"),
        ({"gradient_accumulation_steps": "many"}, "or 'auto'"),
    ],
)
def test_bad_update_options(kwargs, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig(**kwargs)


@pytest.mark.parametrize(
    "given,n,want",
    [
        (
            dict(train_batch_size=64, micro_batch_size=2, gradient_accumulation_steps="auto"),
            8,
            (64, 2, 4),
        ),  # accumulation inferred
        (dict(train_batch_size=64, gradient_accumulation_steps=4), 8, (64, 2, 4)),  # micro
        (dict(micro_batch_size=2, gradient_accumulation_steps=4), 8, (64, 2, 4)),  # global
        (dict(train_batch_size="auto", micro_batch_size=2), 4, (8, 2, 1)),
        (dict(gradient_accumulation_steps="auto"), 8, (0, 0, 1)),  # nothing to infer from: 1
        (dict(), 8, (0, 0, 1)),
    ],
)
def test_deepspeed_batch_arithmetic(given, n, want):
    cfg = zj.ZeroConfig(**given).for_devices(n)
    assert (cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps) == want


@pytest.mark.parametrize(
    "given,n,match",
    [
        (
            dict(train_batch_size=32, micro_batch_size=2, gradient_accumulation_steps=4),
            8,
            "train_batch_size 32 != train_micro_batch_size_per_gpu 2 x "
            "gradient_accumulation_steps 4 x 8 devices \\(64\\)",
        ),
        (
            dict(train_batch_size=30, micro_batch_size=2, gradient_accumulation_steps="auto"),
            4,
            "not train_micro_batch_size_per_gpu 2 x 4 devices x a whole number",
        ),
        (dict(train_batch_size=30, gradient_accumulation_steps=4), 4, "does not divide"),
    ],
)
def test_deepspeed_batch_contradictions_fail_with_the_numbers(given, n, match):
    with pytest.raises(zj.ZeroError, match=match):
        zj.ZeroConfig(**given).for_devices(n)


def test_what_needs_the_accumulation_count_says_when_it_is_not_known_yet():
    # 'auto' is inferred from the batch sizes for a device count; asked before, a ZeroError
    # says where to read it (it was a TypeError comparing 'auto' with 1)
    cfg = zj.ZeroConfig(
        stage=2, gradient_accumulation_steps="auto", train_batch_size=64, micro_batch_size=4
    )
    with pytest.raises(zj.ZeroError, match="for_devices"):
        _ = cfg.manages_update
    resolved = cfg.for_devices(8)  # 64 = 4 per device x k x 8 devices
    assert resolved.accumulation_steps == 2 and resolved.manages_update
