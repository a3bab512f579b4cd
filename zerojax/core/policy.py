"""Frozen views of the resolved options, one per reader: what a model call and its units read
(`UnitPolicy`) and what the managed update reads (`UpdatePolicy`), computed once per
`zero_shard` as `comm.hierarchy.Comm` is for the mesh's axes. The public `ZeroConfig` stays
flat; a function below the API takes the view it reads, never the whole config."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from zerojax.core.config import DTYPE_NAMES, ZeroConfig


def working_dtype(dtype, chosen):
    """The dtype a value of `dtype` takes where an option chose `chosen`: a 16-bit choice (bf16,
    fp16: half the bytes) is taken as it is; fp32, every dtype option's default, widens 16-bit
    values and never narrows a wider one (a float64 model trains in float64)."""
    if jnp.finfo(chosen).bits < 32:
        return jnp.dtype(chosen)
    return jnp.promote_types(dtype, chosen)


def dtype_of(option: str):
    """The dtype a precision option names ('fp32', 'bf16', 'fp16')."""
    return jnp.dtype(DTYPE_NAMES[option])


@dataclasses.dataclass(frozen=True)
class UnitPolicy:
    """What a model call run per device, its call plan and its stage-3 units read."""

    uses_units: bool  # stages 1-3 with explicit collectives: blocks are found as units
    units: Any  # the `units` option: 'auto' or the patterns naming them
    shards_parameters: bool  # stage 3: units gather their weights
    persistence_threshold: int  # elements: a stacked leaf's layer below it is gathered whole
    compute_dtype: Any  # the 16-bit dtype parameters compute in, None for their own
    reduce_dtype: Any  # grad_reduce_dtype: comm.hierarchy.in_reduce_dtype applies it
    offload_activations: bool
    prefetch: int
    recompute_units: bool
    keep_gathered: tuple  # patterns of units kept gathered from forward to backward

    @classmethod
    def of(cls, cfg: ZeroConfig) -> UnitPolicy:
        return cls(
            uses_units=cfg.uses_units,
            units=cfg.units,
            shards_parameters=cfg.shards_parameters,
            persistence_threshold=cfg.persistence_threshold,
            compute_dtype=dtype_of(cfg.precision) if cfg.uses_16bit else None,
            reduce_dtype=dtype_of(cfg.grad_reduce_dtype),
            offload_activations=cfg.offload_activations,
            prefetch=cfg.prefetch,
            recompute_units=cfg.recompute_units,
            keep_gathered=tuple(cfg.keep_gathered),
        )


@dataclasses.dataclass(frozen=True)
class UpdatePolicy:
    """What the managed update reads: precision, accumulation, clipping, the non-finite check,
    the loss scaler and where the optimizer runs. Built from resolved options only (k known)."""

    manages: bool  # zerojax takes over the update (ZeroConfig.manages_update)
    param_dtype: Any  # the dtype parameters are stored in (fp32, or the 16-bit precision)
    uses_16bit: bool  # fp32 master weights beside 16-bit parameters
    accumulation_steps: int
    accumulate: str  # 'auto', 'local' or 'reduced', as given
    accumulates_locally: bool
    accum_dtype: Any
    state_dtype: Any  # optimizer_state_dtype
    clipping: float  # global-norm bound, 0 for none
    on_nonfinite: str
    scales_loss: bool  # fp16
    scales_loss_dynamically: bool
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float
    on_host: bool  # offload_update='host': the optimizer step runs on the host CPU

    @classmethod
    def of(cls, cfg: ZeroConfig) -> UpdatePolicy:
        return cls(
            manages=cfg.manages_update,
            param_dtype=dtype_of(cfg.precision),
            uses_16bit=cfg.uses_16bit,
            accumulation_steps=cfg.accumulation_steps,
            accumulate=cfg.accumulate,
            accumulates_locally=cfg.accumulates_locally,
            accum_dtype=dtype_of(cfg.grad_accum_dtype),
            state_dtype=dtype_of(cfg.optimizer_state_dtype),
            clipping=cfg.gradient_clipping,
            on_nonfinite=cfg.on_nonfinite,
            scales_loss=cfg.scales_loss,
            scales_loss_dynamically=cfg.scales_loss_dynamically,
            loss_scale=cfg.loss_scale,
            initial_scale_power=cfg.initial_scale_power,
            loss_scale_window=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
            min_loss_scale=cfg.min_loss_scale,
            on_host=cfg.updates_on_host,
        )

    @property
    def checks_finite(self) -> bool:
        """Whether a non-finite gradient skips the step (fp16's overflow, on_nonfinite)."""
        return self.scales_loss or self.on_nonfinite != "off"

    @property
    def keeps_low_precision_state(self) -> bool:
        return self.state_dtype != jnp.float32

    def for_nnx(self) -> UpdatePolicy:
        """As NNX objects are managed: accumulate='auto' means 'reduced' (local accumulation
        is not available for NNX yet)."""
        if self.accumulate != "auto":
            return self
        return dataclasses.replace(self, accumulate="reduced", accumulates_locally=False)
