"""DeepSpeed's `optimizer` and `scheduler` blocks as optax: `optimizer_from_config(config, **auto)`.

DeepSpeed builds its optimizer (FusedAdam, FusedLamb, FusedLion, torch.optim.SGD, Muon) and its
LR scheduler (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) from these blocks; zerojax builds
the optax transformation with the same update and learning rates, the schedule injected with
`optax.inject_hyperparams` (so `opt_state.hyperparams["learning_rate"]` shows it). A DeepSpeed
scheduler steps after each optimizer step: update k (k = 0, 1, ...) uses the schedule at
iteration k - 1, and update 0 the value the scheduler set when it was built. "auto" values (the
Hugging Face templates) come from keyword arguments, as the HF Trainer fills them from its own;
those HF's TrainingArguments default (betas, eps, weight_decay, warmup_min_lr) take its default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from zerojax.core.config_files import read_config
from zerojax.core.deepspeed_blocks import (
    AUTO,
    HF_DEFAULTS,
    OPTIMIZER_PARAMS,
    REQUIRED,
    SCHEDULER_PARAMS,
    block_type,
)
from zerojax.core.errors import ZeroError, closest


# ---- optimizers ----------------------------------------------------------------------------
def _adam(learning_rate, b1, b2, eps, weight_decay, decoupled):
    if decoupled:  # AdamW: p -= lr * (adam + wd * p)
        return optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)
    return optax.chain(
        optax.add_decayed_weights(weight_decay), optax.adam(learning_rate, b1, b2, eps)
    )


def _lamb(learning_rate, b1, b2, eps, weight_decay, min_coeff, max_coeff):
    """optax.lamb with FusedLamb's trust ratio ||p|| / ||update||, clamped to its bounds."""
    return optax.chain(
        optax.scale_by_adam(b1, b2, eps),
        optax.add_decayed_weights(weight_decay),
        _clamped_trust_ratio(min_coeff, max_coeff),
        optax.scale_by_learning_rate(learning_rate),
    )


def _clamped_trust_ratio(low, high) -> optax.GradientTransformation:
    def update(updates, state, params):
        def scale(u, p):
            p_norm, u_norm = optax.safe_norm(p, 0.0), optax.safe_norm(u, 0.0)
            ratio = jnp.where((p_norm == 0) | (u_norm == 0), 1.0, p_norm / u_norm)
            return u * jnp.clip(ratio, low, high).astype(u.dtype)

        return jax.tree_util.tree_map(scale, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _lion(learning_rate, b1, b2, weight_decay):
    return optax.lion(learning_rate, b1, b2, weight_decay=weight_decay)


def _sgd(learning_rate, momentum, weight_decay, nesterov):  # torch: weight decay is L2
    return optax.chain(
        optax.add_decayed_weights(weight_decay),
        optax.sgd(learning_rate, momentum or None, nesterov=nesterov),
    )


def _muon(learning_rate, b1, b2, eps, momentum, weight_decay, ns_steps):
    return contrib.muon(
        learning_rate,
        ns_steps=ns_steps,
        beta=momentum,
        eps=eps,
        weight_decay=weight_decay,
        adam_b1=b1,
        adam_b2=b2,
        adam_weight_decay=weight_decay,
    )


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One DeepSpeed optimizer type: its optax factory, DeepSpeed's defaults for its params
    (betas -> b1, b2), and params accepted only at the value DeepSpeed uses by default."""

    factory: Callable
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def has_betas(self) -> bool:
        return "betas" in self.defaults


OPTIMIZERS = {
    name: Optimizer(factory, *OPTIMIZER_PARAMS[name])
    for name, factory in dict[str, Callable](
        adam=_adam,
        adamw=_adam,
        lamb=_lamb,
        lion=_lion,
        sgd=_sgd,
        muon=_muon,
    ).items()
}


# ---- schedules: DeepSpeed's formulas at scheduler iteration i (i = -1 before the first step) --
def _warmup_gamma(i, steps: int, kind: str):
    """WarmupLR's ramp from 0 to 1 over `steps` (at least 2): log(i + 1) / log(steps) or i /
    steps, then 1."""
    ramp = jnp.log(i + 1.0) / math.log(steps) if kind == "log" else i / steps
    return jnp.where(i < steps, ramp, 1.0)


def _warmup_lr(p):
    steps = max(2, p["warmup_num_steps"])
    low, high = p["warmup_min_lr"], p["warmup_max_lr"]
    return lambda i: low + (high - low) * _warmup_gamma(i, steps, p["warmup_type"]), low


def _warmup_decay_lr(p):
    steps, total = max(2, p["warmup_num_steps"]), p["total_num_steps"]
    low, high = p["warmup_min_lr"], p["warmup_max_lr"]

    def lr(i):
        decay = jnp.maximum(0.0, (total - i) / max(1.0, total - steps))
        gamma = jnp.where(i < steps, _warmup_gamma(i, steps, p["warmup_type"]), decay)
        return low + (high - low) * gamma

    return lr, low


def _warmup_cosine_lr(p):
    steps, total, base = max(2, p["warmup_num_steps"]), p["total_num_steps"], p["lr"]
    start, floor = p["warmup_min_ratio"], p["cos_min_ratio"]

    def lr(i):
        warm = start + _warmup_gamma(i, steps, p["warmup_type"]) * (1.0 - start)
        progress = jnp.minimum(1.0, (i - steps + 1) / max(1, total - steps))
        cosine = jnp.maximum(0.0, floor + (1.0 - floor) * (1 + jnp.cos(math.pi * progress)) / 2)
        return base * jnp.where(i < steps, warm, cosine)

    return lr, 0.0  # DeepSpeed's get_lr before the first step


def _one_cycle(p):
    """OneCycle's learning rate and (cycle_momentum) beta1: up for cycle_first_step_size steps,
    down for cycle_second_step_size, then decayed every decay_step_size."""
    first = float(p["cycle_first_step_size"])
    total = first + float(p["cycle_second_step_size"] or first)
    ratio = first / total
    low, high, moms = p["cycle_min_lr"], p["cycle_max_lr"], (p["cycle_min_mom"], p["cycle_max_mom"])
    every = p["decay_step_size"]

    def scale(i):
        x = 1.0 + (i + 1) / total - jnp.floor(1 + (i + 1) / total)
        return jnp.where(x <= ratio, x / ratio, (x - 1) / (ratio - 1))

    def decayed(i, rate):
        return 1.0 + rate * (i - total + 1) / every if every and rate else 1.0

    def lr(i):
        return jnp.where(
            i < total, low + (high - low) * scale(i), low / decayed(i, p["decay_lr_rate"])
        )

    def mom(i):
        cycled = moms[1] - (moms[1] - moms[0]) * scale(i)
        return jnp.where(i < total, cycled, moms[1] * decayed(i, p["decay_mom_rate"]))

    return lr, low, mom, moms[0]


SCHEDULERS = {
    name: (SCHEDULER_PARAMS[name], build)
    for name, build in {
        "WarmupLR": _warmup_lr,
        "WarmupDecayLR": _warmup_decay_lr,
        "WarmupCosineLR": _warmup_cosine_lr,
        "OneCycle": _one_cycle,
    }.items()
}


def _after_each_step(value_at: Callable, initial) -> Callable:
    """An optax schedule of the update count from DeepSpeed's value at scheduler iteration
    i: update k uses iteration k - 1, update 0 the initial value."""
    return lambda count: jnp.where(
        count == 0, initial, value_at(jnp.asarray(count, jnp.float32) - 1)
    )


# ---- reading the blocks ----------------------------------------------------------------------
def _params(
    block: Mapping, section: str, defaults: Mapping, fixed: Mapping, auto: Mapping, lazy=()
) -> dict:
    """`block`'s params over DeepSpeed's `defaults`: 'auto' filled from `auto` (else HF's
    default, else a ZeroError naming the keyword to pass; `lazy` ones become None, for a value
    a scheduler may make unused), `fixed` params checked, unknown params refused."""
    given = block.get("params") or {}
    if not isinstance(given, Mapping):
        raise ZeroError(f'{section}.params must be an object such as {{"lr": ...}}; got {given!r}.')
    out = dict(defaults)
    for key, value in given.items():
        where = f"{section}.params.{key}"
        if key not in defaults and key not in fixed:
            near = closest(key, [*defaults, *fixed])
            raise ZeroError(
                f"{where} is not a parameter of {block.get('type')}"
                + (f" (did you mean {near!r}?)" if near else "")
                + f"; it takes: {', '.join([*defaults, *fixed])}."
            )
        if value == AUTO:
            value = _auto(key, where, auto, lazy)
        if key in fixed:
            if fixed[key] is not None and value != fixed[key]:
                raise ZeroError(f"{where}={value!r} is not supported (only {fixed[key]!r}).")
            continue
        out[key] = value
    missing = [k for k, v in out.items() if v is REQUIRED]
    if missing:
        raise ZeroError(
            f"{section}.params needs {', '.join(missing)} ({block.get('type')} has no default)."
        )
    return out


def _auto(key: str, where: str, auto: Mapping, lazy) -> Any:
    if key in auto:
        return auto[key]
    if key == "warmup_max_lr" and "lr" in auto:  # what the HF Trainer fills it with
        return auto["lr"]
    if key in HF_DEFAULTS:
        return HF_DEFAULTS[key]
    if key in lazy:
        return None
    also = " (or lr=...)" if key == "warmup_max_lr" else ""
    raise ZeroError(
        f"{where} is 'auto': pass its value, optimizer_from_config(config, {key}=...){also} "
        "(the Hugging Face Trainer fills it from its own arguments)."
    )


def optimizer_from_config(config, **auto) -> optax.GradientTransformation:
    """The optax transformation a DeepSpeed config's `optimizer` and `scheduler` blocks
    describe (`config`: a dict, a JSON path or a preset name); `auto`: the values of its
    "auto" entries, by parameter name (lr, betas, eps, weight_decay, warmup_num_steps,
    total_num_steps, ...). The learning rate (and OneCycle's beta1) are injected
    hyperparameters: `opt_state.hyperparams['learning_rate']`."""
    data = read_config(config)
    block, schedule = data.get("optimizer"), data.get("scheduler")
    if not isinstance(block, Mapping):
        raise ZeroError(
            "this config has no optimizer block: write the optax optimizer in your code (or add "
            '{"optimizer": {"type": "AdamW", "params": {...}}}).'
        )
    known = {k for o in OPTIMIZERS.values() for k in o.defaults} | {
        k for d, _ in SCHEDULERS.values() for k in d
    }
    if unknown := sorted(set(auto) - known):
        raise ZeroError(
            f"optimizer_from_config got unknown values {unknown}; they name parameters such "
            "as lr, betas, warmup_num_steps."
        )
    kind_name = block_type(block, "optimizer", OPTIMIZERS)
    kind = OPTIMIZERS[kind_name]
    sched_name = (
        block_type(schedule, "scheduler", SCHEDULERS) if isinstance(schedule, Mapping) else None
    )
    sets_lr = sched_name in ("WarmupLR", "WarmupDecayLR", "OneCycle")  # they replace lr
    p = _params(
        block, "optimizer", kind.defaults, kind.fixed, auto, lazy=("lr",) if sets_lr else ()
    )
    hyper = {k: v for k, v in p.items() if k not in ("lr", "betas", "adam_w_mode")}
    if kind.has_betas:
        hyper["b1"], hyper["b2"] = (float(b) for b in p["betas"])
    if kind.factory is _adam:
        hyper["decoupled"] = kind_name == "adamw" or bool(p["adam_w_mode"])
    hyper["learning_rate"] = p["lr"]
    if sched_name and isinstance(schedule, Mapping):
        defaults, build = SCHEDULERS[sched_name]
        s = _params(schedule, "scheduler", defaults, {}, auto)
        s["lr"] = p["lr"]
        built = build(s)
        hyper["learning_rate"] = _after_each_step(built[0], built[1])
        if sched_name == "OneCycle" and s["cycle_momentum"] and kind.has_betas:
            hyper["b1"], hyper["b2"] = _after_each_step(built[2], built[3]), 0.99
    moved = {"learning_rate"}  # by the schedule: injected (the rest stay Python numbers)
    if sched_name == "OneCycle" and callable(hyper.get("b1")):
        moved |= {"b1", "b2"}
    if hyper["learning_rate"] is None:
        raise ZeroError(
            "optimizer.params.lr is 'auto': pass optimizer_from_config(config, lr=...)."
        )
    static = tuple(k for k in hyper if k not in moved)  # as a user writes them by hand
    return optax.inject_hyperparams(kind.factory, static_args=static)(**hyper)
