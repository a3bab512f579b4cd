"""DeepSpeed JSON keys -> ZeroConfig options.

A key either maps to an option that acts, or is refused with a message saying why; nothing is
accepted and then ignored (strict=False turns refusals of known-but-unsupported keys into one
loud warning listing them).
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

from zerojax.config import ZeroError, nearest

# zero_optimization keys that act, and the ZeroConfig option each sets.
ZERO_KEYS = {
    "stage": "stage",
    "stage3_param_persistence_threshold": "persistence_threshold",
}

# Offload blocks: device and pin_memory act (ZeroConfig checks them); the rest tune DeepSpeed's
# own CPU optimizer and NVMe swapper.
OFFLOAD_BLOCKS = ("offload_optimizer", "offload_param")
OFFLOAD_TUNING = ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "ratio",
                  "nvme_path", "pipeline", "pipeline_read", "pipeline_write")

# DeepSpeed keys zerojax knows but does not implement yet; each is refused with its reason.
NOT_YET = "not implemented in zerojax yet"
KNOWN_ZERO_KEYS = {
    "overlap_comm": NOT_YET, "contiguous_gradients": NOT_YET, "reduce_scatter": NOT_YET,
    "reduce_bucket_size": NOT_YET, "allgather_bucket_size": NOT_YET,
    "allgather_partitions": NOT_YET, "round_robin_gradients": NOT_YET,
    "sub_group_size": NOT_YET,
    "stage3_model_persistence_threshold": NOT_YET, "stage3_max_live_parameters": NOT_YET,
    "stage3_max_reuse_distance": NOT_YET, "stage3_gather_16bit_weights_on_model_save": NOT_YET,
    "stage3_gather_fp16_weights_on_model_save": NOT_YET,
    "gather_16bit_weights_on_model_save": NOT_YET, "zero_hpz_partition_size": NOT_YET,
    "zero_quantized_weights": NOT_YET, "zero_quantized_gradients": NOT_YET,
    "mics_shard_size": NOT_YET, "ignore_unused_parameters": NOT_YET,
    "elastic_checkpoint": NOT_YET, "load_from_fp32_weights": NOT_YET,
}
# Top-level keys that act: handled by _top_level below.
TOP_KEYS = ("fp16", "bf16", "gradient_accumulation_steps", "gradient_clipping",
            "communication_data_type", "data_types")
FP16_KEYS = {"loss_scale": "loss_scale", "initial_scale_power": "initial_scale_power",
             "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
             "min_loss_scale": "min_loss_scale"}
KNOWN_TOP_KEYS = {
    "train_batch_size": NOT_YET, "train_micro_batch_size_per_gpu": NOT_YET,
    "wall_clock_breakdown": NOT_YET, "memory_breakdown": NOT_YET,
    "steps_per_print": NOT_YET, "zero_allow_untested_optimizer": NOT_YET,
    "optimizer": "zerojax takes the optimizer from your optax code, not from the config",
    "scheduler": "zerojax takes the schedule from your optax code, not from the config",
}


def options_from_deepspeed(data: Mapping[str, Any], strict: bool = True) -> dict:
    """ZeroConfig keyword arguments for a DeepSpeed config dict."""
    if not isinstance(data, Mapping):
        raise ZeroError(f"a DeepSpeed config is a JSON object; got {type(data).__name__}.")
    options, refused = {}, []
    for key, value in data.items():
        if key == "zero_optimization":
            continue
        if key in TOP_KEYS:
            options.update(_top_level(key, value, refused))
        elif key in KNOWN_TOP_KEYS:
            refused.append((key, KNOWN_TOP_KEYS[key]))
        else:
            raise ZeroError(f"unknown DeepSpeed config key {key!r}"
                              f"{nearest(key, [*TOP_KEYS, *KNOWN_TOP_KEYS, 'zero_optimization'])}.")
    if data.get("fp16", {}).get("enabled") and data.get("bf16", {}).get("enabled"):
        raise ZeroError("fp16 and bf16 are both enabled; enable one of them.")
    zero = data.get("zero_optimization", {})
    if isinstance(zero, bool):  # legacy form: "zero_optimization": true means stage 1
        zero = {"stage": 1 if zero else 0}
    if not isinstance(zero, Mapping):
        raise ZeroError("zero_optimization must be an object such as {\"stage\": 3}.")
    for key, value in zero.items():
        if key in ZERO_KEYS:
            options[ZERO_KEYS[key]] = _number(f"zero_optimization.{key}", value)
        elif key in OFFLOAD_BLOCKS:
            options[key] = _offload(f"zero_optimization.{key}", value, refused)
        elif key == "stage3_prefetch_bucket_size":   # zerojax prefetches whole layers: 0 or 1
            options["prefetch"] = int(_number(f"zero_optimization.{key}", value) > 0)
        elif key in KNOWN_ZERO_KEYS:
            refused.append((f"zero_optimization.{key}", KNOWN_ZERO_KEYS[key]))
        else:
            raise ZeroError(f"unknown key zero_optimization.{key!r}"
                              f"{nearest(key, [*ZERO_KEYS, *KNOWN_ZERO_KEYS])}.")
    if refused:
        lines = "\n".join(f"  {k}: {why}" for k, why in refused)
        if strict:
            raise ZeroError("these DeepSpeed keys cannot be honoured:\n" + lines +
                              "\nremove them, or pass strict=False to proceed without them.")
        warnings.warn("zerojax proceeds WITHOUT these DeepSpeed keys:\n" + lines, stacklevel=3)
    return options


DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16",
               "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}


def _top_level(key: str, value, refused: list) -> dict:
    """ZeroConfig options for one of TOP_KEYS."""
    if key in ("fp16", "bf16"):
        if not isinstance(value, Mapping):
            raise ZeroError(f"{key} must be an object such as {{\"enabled\": true}}.")
        allowed = ["enabled", *(FP16_KEYS if key == "fp16" else ())]
        out = {}
        for sub, v in value.items():
            if sub in allowed[1:]:
                out[FP16_KEYS[sub]] = float(v) if sub in ("loss_scale", "min_loss_scale") \
                    else _number(f"fp16.{sub}", v)
            elif sub == "enabled":
                continue
            elif sub in ("consecutive_hysteresis", "auto_cast", "immediate_grad_update",
                         "check_grad_overflow"):
                if v:
                    refused.append((f"{key}.{sub}", NOT_YET))
            else:
                raise ZeroError(f"unknown key {key}.{sub!r}{nearest(sub, allowed)}.")
        if not value.get("enabled", False):
            if any(k in FP16_KEYS for k in value):
                raise ZeroError(f"{key} sets loss-scaling keys but is not enabled.")
            return {}
        return {"precision": key, **out}
    if key == "gradient_accumulation_steps":
        return {"gradient_accumulation_steps": _number(key, value)}
    if key == "gradient_clipping":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ZeroError(f"gradient_clipping must be a number; got {value!r}.")
        return {"gradient_clipping": float(value)}
    if key == "communication_data_type":
        return {"grad_reduce_dtype": _dtype(key, value)}
    if not isinstance(value, Mapping):   # data_types
        raise ZeroError("data_types must be an object such as {\"grad_accum_dtype\": \"fp32\"}.")
    out = {}
    for sub, v in value.items():
        if sub != "grad_accum_dtype":
            raise ZeroError(f"unknown key data_types.{sub!r}{nearest(sub, ['grad_accum_dtype'])}.")
        out["grad_accum_dtype"] = _dtype(f"data_types.{sub}", v)
    return out


def _offload(name: str, value, refused: list) -> dict:
    """An offload block with DeepSpeed's tuning keys set aside (refused if set)."""
    if not isinstance(value, Mapping):
        raise ZeroError(f"{name} must be an object such as {{\"device\": \"cpu\"}}.")
    for sub in value:
        if sub in OFFLOAD_TUNING:
            refused.append((f"{name}.{sub}", "tunes DeepSpeed's CPU optimizer / NVMe swapper; "
                            "zerojax offloads through XLA's host memory copies"))
    return {k: v for k, v in value.items() if k not in OFFLOAD_TUNING}


def _dtype(name: str, value) -> str:
    if value not in DTYPE_NAMES:
        raise ZeroError(f"{name} must be one of fp32, fp16, bf16; got {value!r}"
                        f"{nearest(str(value), DTYPE_NAMES)}.")
    return DTYPE_NAMES[value]


def _number(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ZeroError(f"{name} must be a whole number; got {value!r}.")
    return int(value)
