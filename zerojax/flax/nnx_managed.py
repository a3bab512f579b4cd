"""zerojax's managed update (16-bit parameters over fp32 master weights, fp16 loss scaling,
accumulation, clipping) for an NNX model and its `nnx.Optimizer`, with Flax's step unchanged.

`manage_objects` turns the objects into managed ones, as `optim.prepare_state` does a
TrainState: the model's parameters in the 16-bit dtype, the optimizer's `tx` a `ZeroTx` (so
Flax's `optimizer.update(model, grads)` only hands the gradients to the step), and a
`ZeroBuffers` variable `optimizer.zerojax` holding the master weights, buffers and loss scaler
(a `ZeroOptState` whose `inner` is left empty: the optax state stays in `optimizer.opt_state`).
In the step, `ManagedObjects` gives the model an fp32 view of its parameters, then applies the
captured gradients with `optim.apply_update` and writes the result back into the objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx, struct

from zerojax.config import ZeroConfig, ZeroError
from zerojax.flax.nnx_calls import with_params
from zerojax.optim import (
    ZeroTx,
    accumulate,
    apply_update,
    cast_floating,
    prepare_state,
)

BUFFERS = "zerojax"  # the optimizer attribute holding the ZeroBuffers variable


class ZeroBuffers(nnx.OptState):
    """The optimizer-side state zerojax keeps for a managed NNX optimizer (a ZeroOptState)."""


@struct.dataclass
class _View:
    """The TrainState-like view `optim.prepare_state` / `apply_update` work on."""

    params: Any
    opt_state: Any
    step: Any
    tx: Any = struct.field(pytree_node=False)


def for_nnx(cfg: ZeroConfig) -> ZeroConfig:
    """`cfg` as NNX objects are managed: accumulate='auto' means 'reduced' (each micro-batch's
    gradients reduced at once), as local accumulation is not available for NNX yet."""
    return cfg.replace(accumulate="reduced") if cfg.accumulate == "auto" else cfg


def pair(objs: tuple, cfg: ZeroConfig) -> tuple[nnx.Module, nnx.Optimizer]:
    """The (model, optimizer) of a managed NNX step: the first module and the one optimizer."""
    optimizers = [o for o in objs if isinstance(o, nnx.Optimizer)]
    models = [o for o in objs if isinstance(o, nnx.Module) and not isinstance(o, nnx.Optimizer)]
    if len(optimizers) != 1 or not models:
        raise ZeroError(
            "precision, accumulation and clipping manage one NNX model and its nnx.Optimizer: "
            f"pass (model, optimizer), got {tuple(type(o).__name__ for o in objs)}."
        )
    if cfg.accumulates_locally:
        raise ZeroError(
            "accumulate='local' is not available for NNX objects yet: use accumulate='reduced' "
            "(or 'auto'; each micro-batch's gradients reduced at once)."
        )
    return models[0], optimizers[0]


def is_managed(objs: tuple) -> bool:
    return any(isinstance(getattr(o, "tx", None), ZeroTx) for o in objs)


def manage_objects(objs: tuple, cfg: ZeroConfig, axis_size: int) -> None:
    """Make `objs` (fresh objects: changed in place) managed as `cfg` trains them."""
    if is_managed(objs):
        return
    cfg = for_nnx(cfg)
    model, optimizer = pair(objs, cfg)
    params = nnx.state(model, nnx.Param)
    view = _View(
        nnx.to_pure_dict(params),
        nnx.as_pure(optimizer.opt_state),
        optimizer.step.get_value(),
        optimizer.tx,
    )
    view = prepare_state(view, cfg, axis_size)
    _set_params(model, view.params)
    nnx.update(optimizer.opt_state, nnx.state(view.opt_state.inner))  # optimizer_state_dtype
    optimizer.tx = view.tx
    setattr(optimizer, BUFFERS, ZeroBuffers(view.opt_state._replace(inner=())))


def _set_params(model, pure: dict) -> None:
    """The model's nnx.Param variables set to the arrays of the pure dict `pure`."""
    nnx.update(model, with_params(nnx.state(model, nnx.Param), pure))


def _on_states(tx, template) -> optax.GradientTransformation:
    """`tx` taking and giving pure dicts: the optax state nnx.Optimizer made holds nnx.States
    shaped like the parameters (`template`), so gradients and parameters enter as such."""
    as_state = lambda pure: None if pure is None else nnx.as_pure(with_params(template, pure))

    def update(grads, state, params=None, **extra):
        updates, state = tx.update(as_state(grads), state, as_state(params), **extra)
        return nnx.to_pure_dict(updates), state

    return optax.GradientTransformation(tx.init, update)


class ManagedObjects:
    """One managed step's objects: made before the step runs, it gives the model an fp32 view
    of its parameters; `finish` applies (or accumulates) the gradients the step's
    `optimizer.update` handed over."""

    def __init__(self, objs: tuple, cfg: ZeroConfig):
        self.cfg = cfg = for_nnx(cfg)
        self.model, self.optimizer = pair(objs, cfg)
        params = nnx.state(self.model, nnx.Param)
        self.params = nnx.to_pure_dict(params)  # 16-bit, as stored
        opt = getattr(self.optimizer, BUFFERS).get_value()
        self.before = _View(
            self.params,
            opt._replace(inner=nnx.as_pure(self.optimizer.opt_state)),
            self.optimizer.step.get_value(),
            ZeroTx(_on_states(self.optimizer.tx.inner, params)),
        )
        _set_params(self.model, cast_floating(self.params, jnp.float32))

    @property
    def scale(self):
        return self.before.opt_state.scale if self.cfg.precision == "fp16" else None

    def finish(self, grads, micro: bool, run_optimizer=None) -> None:
        """Write the update of `grads` (or, for a micro-batch, their accumulation) into the
        objects, whatever the step's `optimizer.update` did to them; `run_optimizer` as for
        `optim.apply_update` (the host update)."""
        grads = nnx.to_pure_dict(grads) if isinstance(grads, nnx.State) else grads
        if micro:
            after = dataclasses.replace(
                self.before, opt_state=accumulate(self.before.opt_state, grads)
            )
        else:
            after = apply_update(self.before, self.before.step, grads, self.cfg, run_optimizer)
        _set_params(self.model, self.params if micro else after.params)
        nnx.update(self.optimizer.opt_state, nnx.state(after.opt_state.inner))
        self.optimizer.step.set_value(jnp.asarray(after.step, self.before.step.dtype))
        getattr(self.optimizer, BUFFERS).set_value(after.opt_state._replace(inner=()))
