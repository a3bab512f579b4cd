"""DeepSpeed's JSON keys, one table per section, each key's `Key` saying what it does (ACTS:
the options it sets, read by a value reader that names the key in its error; IGNORED: why it
means nothing under XLA; ERROR: what to use instead), and DeepSpeed's batch arithmetic.
`deepspeed_json` reads a config with them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from zerojax.core.errors import ZeroError, nearest

ACTS, IGNORED, ERROR = "acts", "ignored", "error"
AUTO = "auto"
DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"} | {
    name: name for name in ("fp32", "fp16", "bf16")
}


@dataclasses.dataclass(frozen=True)
class Key:
    """What one DeepSpeed key does: `kind` (ACTS / IGNORED / ERROR), `why` (for ACTS the
    option it sets; otherwise the reason shown to the user) and, for ACTS, `act(name, value)`
    returning the options it sets."""

    kind: str
    why: str
    act: Callable[[str, Any], dict] | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of `explain`: a key, what zerojax does with it, and the value it uses."""

    key: str
    kind: str
    what: str


# ---- value readers: each names the key it reads in its error ---------------------------------
def choice(name, value, allowed):
    """Fail unless `value` is one of `allowed`, naming the option and the nearest choice."""
    if value not in allowed:
        raise ZeroError(
            f"{name} must be one of {', '.join(map(repr, allowed))} (got {value!r})"
            f"{nearest(str(value), [str(a) for a in allowed])}."
        )


OFFLOAD_KEYS = ("device", "pin_memory")


def offload_device(name: str, value) -> str:
    """'cpu' or 'none' from 'cpu' / 'none' / None / DeepSpeed's {"device": ..., ...} block."""
    if value is None:
        return "none"
    if isinstance(value, Mapping):
        for key in value:
            if key not in OFFLOAD_KEYS:
                raise ZeroError(
                    f"{name}: {key!r} is not supported{nearest(key, OFFLOAD_KEYS)}; "
                    f"zerojax reads {', '.join(OFFLOAD_KEYS)} (the others tune "
                    "DeepSpeed's CPU Adam and NVMe swapper, which zerojax does not use)."
                )
        if value.get("pin_memory", True) is not True:
            raise ZeroError(
                f"{name}: pin_memory=false is not supported: zerojax offloads to "
                "pinned host memory, which the device can copy asynchronously."
            )
        value = value.get("device", "none")
    if value == "nvme":
        raise ZeroError(
            f"{name}: device 'nvme' is not supported (JAX has no NVMe memory "
            "kind); use 'cpu' (pinned host memory) or 'none'."
        )
    choice(f"{name} device", value, ("none", "cpu"))
    return value


def batch_sizes(tb, mb, k, n: int) -> tuple[int, int, int]:
    """DeepSpeed's batch arithmetic for `n` data-parallel devices: (train_batch_size,
    micro_batch_size, gradient_accumulation_steps) with train = micro x accumulation x n. Any
    two given ('auto' or 0 = not given; accumulation 1 counts as given unless 'auto') infer the
    third; a contradiction fails with the numbers. Sizes not given come back as 0."""
    known = lambda v: v not in (0, AUTO)
    if k == AUTO:
        if not (known(tb) and known(mb)):
            k = 1
        elif tb % (mb * n):
            raise ZeroError(
                f"train_batch_size {tb} is not train_micro_batch_size_per_gpu "
                f"{mb} x {n} devices x a whole number of accumulation steps."
            )
        else:
            k = tb // (mb * n)
    if known(tb) and not known(mb):
        if tb % (k * n):
            raise ZeroError(
                f"train_batch_size {tb} does not divide into "
                f"gradient_accumulation_steps {k} x {n} devices."
            )
        mb = tb // (k * n)
    elif known(mb) and not known(tb):
        tb = mb * k * n
    elif known(tb) and known(mb) and tb != mb * k * n:
        raise ZeroError(
            f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} x "
            f"gradient_accumulation_steps {k} x {n} devices ({mb * k * n})."
        )
    return (tb if known(tb) else 0), (mb if known(mb) else 0), k


def _whole(name, value, low=0) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
        or value < low
    ):
        raise ZeroError(f"{name} must be a whole number >= {low}; got {value!r}.")
    return int(value)


def _real(name, value) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value >= 0
    ):
        raise ZeroError(f"{name} must be a number >= 0; got {value!r}.")
    return float(value)


def read_flag(name, value) -> bool:
    if not isinstance(value, bool):
        raise ZeroError(f"{name} must be true or false; got {value!r}.")
    return value


def read_dtype(name, value) -> str:
    if not isinstance(value, str) or value not in DTYPE_NAMES:
        raise ZeroError(
            f"{name} must be one of fp32, fp16, bf16; got {value!r}"
            f"{nearest(str(value), DTYPE_NAMES)}."
        )
    return DTYPE_NAMES[value]


def _sets(option: str, read: Callable) -> Key:
    """A key that sets `option` to the value read by `read(name, value)`."""
    return Key(ACTS, option, lambda name, value: {option: read(name, value)})


def _batch(option: str) -> Key:
    return _sets(option, lambda name, value: AUTO if value == AUTO else _whole(name, value, 1))


def _ignored(reason: str) -> Key:
    return Key(IGNORED, reason)


def _off_only(reason: str) -> Key:
    """A feature zerojax lacks: false (or {"enabled": false}) is accepted, on is an error."""

    def act(name, value):
        on = value.get("enabled", False) if isinstance(value, Mapping) else value
        if read_flag(name, on):
            raise ZeroError(f"{name}: {reason}.")
        return {}

    return Key(ACTS, f"only false / disabled: {reason}", act)


XLA_COMBINES = (
    "XLA combines collectives by its own size thresholds (e.g. "
    "--xla_gpu_all_gather_combine_threshold_bytes)"
)
FP16 = {
    "loss_scale": _sets("loss_scale", _real),
    "initial_scale_power": _sets("initial_scale_power", _whole),
    "loss_scale_window": _sets("loss_scale_window", lambda n, v: _whole(n, v, 1)),
    "hysteresis": _sets("hysteresis", lambda n, v: _whole(n, v, 1)),
    "min_loss_scale": _sets("min_loss_scale", _real),
    "consecutive_hysteresis": _off_only(
        "not implemented: zerojax's hysteresis counts all "
        "overflows since the last drop, DeepSpeed's default"
    ),
    "auto_cast": _ignored(
        "zerojax casts parameters to the compute dtype where the model uses "
        "them; inputs keep the dtype you pass"
    ),
    "fp16_master_weights_and_grads": _off_only("not supported: master weights are fp32"),
}
BF16 = {
    "immediate_grad_update": _ignored("gradients are applied in one XLA program"),
    "check_grad_overflow": _ignored("bf16 has fp32's range; no overflow check is needed"),
    "bf16_master_weights_and_grads": _off_only("not supported: master weights are fp32"),
}
OFFLOAD = {
    "device": Key(ACTS, "offload_* device ('cpu' or 'none')"),
    "pin_memory": Key(ACTS, "pinned host memory (only true is supported)"),
    **{
        k: _ignored(
            "tunes DeepSpeed's own CPU optimizer / NVMe swapper; zerojax offloads "
            "through XLA's host memory copies"
        )
        for k in (
            "buffer_count",
            "buffer_size",
            "max_in_cpu",
            "fast_init",
            "ratio",
            "pipeline",
            "pipeline_read",
            "pipeline_write",
        )
    },
    "nvme_path": Key(
        ERROR, "NVMe offload is not supported (JAX has no NVMe memory kind); use device 'cpu'"
    ),
}
_GATHER_ON_SAVE = _ignored(
    "`zerojax checkpoint export` writes consolidated weights from any "
    "checkpoint, no gather at save time"
)
ZERO_OPTIMIZATION = {
    "stage": _sets("stage", _whole),
    "stage3_param_persistence_threshold": _sets("persistence_threshold", _whole),
    "stage3_prefetch_bucket_size": Key(
        ACTS,
        "prefetch (0 -> 0; otherwise one layer ahead)",
        lambda n, v: {"prefetch": int(_whole(n, v) > 0)},
    ),
    "offload_optimizer": Key(ACTS, "offload_optimizer"),
    "offload_param": Key(ACTS, "offload_param"),
    "cpu_offload": Key(
        ACTS,
        "offload_optimizer (DeepSpeed's legacy flag)",
        lambda n, v: {"offload_optimizer": "cpu" if read_flag(n, v) else "none"},
    ),
    "overlap_comm": _ignored(
        "XLA's latency-hiding scheduler overlaps collectives with compute "
        "(zerojax sets it on by default, see zerojax.core.xla_flags)"
    ),
    "contiguous_gradients": _ignored("XLA plans gradient buffers itself"),
    "reduce_scatter": _ignored("zerojax always reduce-scatters gradients at stages 1-3"),
    "reduce_bucket_size": _ignored(XLA_COMBINES),
    "allgather_bucket_size": _ignored(XLA_COMBINES),
    "allgather_partitions": _ignored("stages 1-2 always all-gather the updated parameters"),
    "round_robin_gradients": _ignored(
        "gradient placement is a sharding; there is no per-rank gradient copy order to balance"
    ),
    "sub_group_size": _ignored(
        "the optimizer update is one XLA program, not groups of flattened tensors"
    ),
    "stage3_model_persistence_threshold": _ignored(
        "only the per-leaf stage3_param_persistence_threshold applies"
    ),
    "stage3_max_live_parameters": _ignored(
        "stage-3 units with prefetch bound gathered weights to about two units"
    ),
    "stage3_max_reuse_distance": _ignored("each layer is re-gathered in backward"),
    "stage3_gather_16bit_weights_on_model_save": _GATHER_ON_SAVE,
    "stage3_gather_fp16_weights_on_model_save": _GATHER_ON_SAVE,
    "gather_16bit_weights_on_model_save": _GATHER_ON_SAVE,
    "zero_hpz_partition_size": _sets("hpz_partition_size", _whole),
    "zero_quantized_weights": _sets("quantized_weights", read_flag),
    "zero_quantized_gradients": _sets("quantized_gradients", read_flag),
    "mics_shard_size": _sets("mics_shard_size", lambda n, v: -1 if v == -1 else _whole(n, v, 1)),
    "mics_hierarchical_params_gather": _ignored(
        "MiCS gathers stay inside the 'local' axis; XLA picks the algorithm"
    ),
    "ignore_unused_parameters": _ignored("JAX gives unused parameters zero gradients"),
    "elastic_checkpoint": _ignored("zerojax checkpoints restore onto any device count"),
    "load_from_fp32_weights": _ignored("restores always use the fp32 master weights"),
}
TOP_LEVEL = {
    "zero_optimization": Key(ACTS, "its keys, below (or the legacy true: stage 1)"),
    "fp16": Key(ACTS, "precision='fp16' and its loss scaling"),
    "bf16": Key(ACTS, "precision='bf16'"),
    "bfloat16": Key(ACTS, "precision='bf16' (DeepSpeed's alias of bf16)"),
    "train_batch_size": _batch("train_batch_size"),
    "train_micro_batch_size_per_gpu": _batch("micro_batch_size"),
    "gradient_accumulation_steps": _batch("gradient_accumulation_steps"),
    "gradient_clipping": _sets("gradient_clipping", _real),
    "communication_data_type": _sets("grad_reduce_dtype", read_dtype),
    "data_types": Key(ACTS, "grad_accum_dtype"),
    "wall_clock_breakdown": _ignored("zero.report(...) and the JAX profiler show where time goes"),
    "memory_breakdown": _ignored("zero.report(...) shows memory by category"),
    "steps_per_print": _ignored("your train loop decides what to print"),
    "zero_allow_untested_optimizer": _ignored("every optax optimizer is supported"),
    "prescale_gradients": _ignored("gradients are summed in fp32 by default, then averaged"),
    "gradient_predivide_factor": _ignored("gradients are summed in fp32 by default, then averaged"),
    "optimizer": Key(
        ACTS, "read by zj.optimizer_from_config (zerojax config explain lists its keys)"
    ),
    "scheduler": Key(
        ACTS, "read by zj.optimizer_from_config (zerojax config explain lists its keys)"
    ),
    "amp": _off_only("apex AMP is not supported; use the bf16 or fp16 block"),
}
