"""The keys of DeepSpeed's `optimizer` and `scheduler` blocks, as data: each type's parameters
with DeepSpeed's defaults, and `explain_block` saying what zerojax does with each key. The
config layer reads JSON with them (no optax needed); `zerojax.deepspeed.optimizer` builds the
optax transformation a block describes from the same tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerojax.core.errors import ZeroError, closest

AUTO = "auto"
REQUIRED = "(required)"  # a parameter DeepSpeed has no default for
HF_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "warmup_min_lr": 0.0}


_BASE = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_ADAM = {**_BASE, "adam_w_mode": True}
_ADAM_FIXED = {"bias_correction": True, "amsgrad": False, "torch_adam": None}
# per optimizer type: (DeepSpeed's defaults for its params (betas -> b1, b2), params accepted only
# at the value DeepSpeed uses by default)
OPTIMIZER_PARAMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "adam": (_ADAM, _ADAM_FIXED),
    "adamw": (_ADAM, _ADAM_FIXED),
    "lamb": (
        {**_BASE, "max_coeff": 10.0, "min_coeff": 0.01},
        {"bias_correction": True, "amsgrad": False, "eps_inside_sqrt": False, "max_grad_norm": 0.0},
    ),
    "lion": ({"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}, {}),
    "sgd": (
        {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
        {"dampening": 0.0, "maximize": False},
    ),
    "muon": ({**_BASE, "momentum": 0.95, "ns_steps": 5}, {"adam_w_mode": True, "torch_adam": None}),
}
NAMES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "lamb": "Lamb",
    "lion": "Lion",
    "sgd": "SGD",
    "muon": "Muon",
}
# communication-compressed optimizers: the same update without the compression
COMPRESSED = {"onebitadam": "Adam", "zerooneadam": "Adam", "onebitlamb": "Lamb"}


# per scheduler type: DeepSpeed's defaults for its params
SCHEDULER_PARAMS: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupDecayLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    },
    "WarmupCosineLR": {
        "total_num_steps": REQUIRED,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 1e-4,
        "warmup_type": "log",
    },
    "OneCycle": {
        "cycle_min_lr": REQUIRED,
        "cycle_max_lr": REQUIRED,
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    },
}


def block_type(block: Mapping, section: str, table: Mapping) -> str:
    """The block's `type` as the key of `table`, or a ZeroError naming the nearest one."""
    name = block.get("type")
    key = str(name).lower() if section == "optimizer" else str(name)
    if key in table:
        return key
    if key.replace("_", "").lower() in COMPRESSED:
        instead = COMPRESSED[key.replace("_", "").lower()]
        why = (
            f"a communication-compressed optimizer; use {instead!r}, the same update (XLA "
            "reduces the gradients uncompressed)"
        )
    else:
        names = [NAMES.get(k, k) for k in table]
        near = closest(str(name), names)
        why = (f"not supported; the nearest is {near!r}" if near else "not supported") + (
            f" (supported: {', '.join(names)})"
        )
    raise ZeroError(f"{section}.type {name!r} is {why}.")


def explain_block(section: str, block) -> tuple[list[tuple[str, str]], list[tuple[str, str, list]]]:
    """For `zerojax config explain`: (key, what zerojax does with it) for each key of an
    `optimizer` or `scheduler` block, and the unknown keys as (dotted name, key, valid keys).
    An unsupported type is explained, not refused: the user's optax code may provide it."""
    if not isinstance(block, Mapping):
        raise ZeroError(
            f'{section} must be an object such as {{"type": ..., "params": {{...}}}}; '
            f"got {block!r}."
        )
    unknown = [
        (f"{section}.{k}", k, ["type", "params"]) for k in block if k not in ("type", "params")
    ]
    table = OPTIMIZER_PARAMS if section == "optimizer" else SCHEDULER_PARAMS
    try:
        kind = block_type(block, section, table)
        what = f"{block.get('type')}: zj.optimizer_from_config(config, ...) builds it"
    except ZeroError as e:
        kind, what = None, f"{e} Your optax code provides it"
    params = block.get("params") or {}
    if not isinstance(params, Mapping):
        raise ZeroError(
            f'{section}.params must be an object such as {{"lr": ...}}; got {params!r}.'
        )
    if params and all(v == AUTO for v in params.values()):
        what += "; all its values are 'auto': your optax code provides them, or pass them to it"
    rows = [(f"{section}.type", what)]
    valid: Mapping[str, Any] = {}
    if kind is not None:
        if section == "optimizer":
            defaults, fixed = OPTIMIZER_PARAMS[kind]
            valid = {**defaults, **fixed}
        else:
            valid = SCHEDULER_PARAMS[kind]
    for key, value in params.items():
        name = f"{section}.params.{key}"
        if kind is not None and key not in valid:
            unknown.append((name, key, list(valid)))
        elif value == AUTO:
            filled = f"HF's default {HF_DEFAULTS[key]!r}" if key in HF_DEFAULTS else "required"
            rows.append((name, f"'auto': optimizer_from_config(config, {key}=...), else {filled}"))
        else:
            rows.append((name, f"{value!r}" + ("" if kind else " (not read)")))
    return rows, unknown
