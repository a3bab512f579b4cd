"""zerojax's managed update (16-bit parameters over fp32 master weights, fp16 loss scaling,
accumulation, clipping) for an NNX model and its `nnx.Optimizer`, with Flax's step unchanged.

`manage_objects` turns the objects into managed ones, as `managed.prepare_state` does a
TrainState: the model's parameters in the 16-bit dtype, the optimizer's `tx` a `ZeroTx`, and a
`ZeroBuffers` variable `optimizer.zerojax` holding the master weights, buffers and loss scaler
(a `ZeroOptState` whose `inner` is left empty: the optax state stays in `optimizer.opt_state`).
In the step, `ManagedObjects` gives the model an fp32 view of its parameters, and Flax's own
`optimizer.update` applies the real update (`managed.managed_update`) that its `ZeroTx` returns,
so the user's code after it sees the new parameters; `managed.settle` then keeps what it left.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from zerojax.core.errors import ZeroError
from zerojax.core.policy import UpdatePolicy
from zerojax.flax.nnx_calls import with_params
from zerojax.update.managed import (
    UpdateCall,
    ZeroTx,
    managed_update,
    prepare_state,
    present,
    settle,
)
from zerojax.update.transforms import in_working_dtype

BUFFERS = "zerojax"  # the optimizer attribute holding the ZeroBuffers variable


class ZeroBuffers(nnx.OptState):
    """The optimizer-side state zerojax keeps for a managed NNX optimizer (a ZeroOptState)."""


@struct.dataclass
class _View:
    """The TrainState-like view `managed.prepare_state` / `apply_update` work on."""

    params: Any
    opt_state: Any
    step: Any
    tx: Any = struct.field(pytree_node=False)


def pair(objs: tuple, policy: UpdatePolicy) -> tuple[nnx.Module, nnx.Optimizer]:
    """The (model, optimizer) of a managed NNX step: the first module and the one optimizer."""
    optimizers = [o for o in objs if isinstance(o, nnx.Optimizer)]
    models = [o for o in objs if isinstance(o, nnx.Module) and not isinstance(o, nnx.Optimizer)]
    if len(optimizers) != 1 or not models:
        raise ZeroError(
            "precision, accumulation and clipping manage one NNX model and its nnx.Optimizer: "
            f"pass (model, optimizer), got {tuple(type(o).__name__ for o in objs)}."
        )
    if policy.accumulates_locally:
        raise ZeroError(
            "accumulate='local' is not available for NNX objects yet: use accumulate='reduced' "
            "(or 'auto'; each micro-batch's gradients reduced at once)."
        )
    return models[0], optimizers[0]


def is_managed(objs: tuple) -> bool:
    return any(isinstance(getattr(o, "tx", None), ZeroTx) for o in objs)


def manage_objects(objs: tuple, policy: UpdatePolicy, axis_size: int) -> None:
    """Make `objs` (fresh objects: changed in place) managed as `policy` trains them
    (accumulate='auto' is 'reduced' for NNX: `UpdatePolicy.for_nnx`)."""
    if is_managed(objs):
        return
    policy = policy.for_nnx()
    model, optimizer = pair(objs, policy)
    params = nnx.state(model, nnx.Param)
    view = _View(
        nnx.to_pure_dict(params),
        nnx.as_pure(optimizer.opt_state),
        optimizer.step.get_value(),
        optimizer.tx,
    )
    view = prepare_state(view, policy, axis_size)
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
    of its parameters; `update` is what the step's `optimizer.update` gets from its `ZeroTx`
    (`managed.managed_update`, with the buffers read from and written to `optimizer.zerojax`);
    `finish` settles what the step's code left in the objects (`managed.settle`)."""

    def __init__(self, objs: tuple, policy: UpdatePolicy, micro: bool, layouts=(None, None)):
        """`layouts`: the shardings of the stored parameters and of the master weights (device
        memory), which the fp32 view and the parameters the step returns are laid out like."""
        self.policy, self.micro, self.run = policy.for_nnx(), micro, None
        self.model, self.optimizer = pair(objs, self.policy)
        self.template = nnx.state(self.model, nnx.Param)
        self.params = nnx.to_pure_dict(self.template)  # 16-bit, as stored
        self.inner = nnx.as_pure(self.optimizer.opt_state)
        self.buffers = getattr(self.optimizer, BUFFERS)
        self.step = self.optimizer.step.get_value()
        self.layouts = layouts
        _set_params(self.model, _laid_out(in_working_dtype(self.params, jnp.float32), layouts[0]))

    @property
    def scale(self):
        return self.buffers.get_value().scale if self.policy.scales_loss else None

    def update(self, tx, grads, state, params):
        """`ZeroTx.update(grads, state, params)` as Flax's `optimizer.update` calls it, with
        nnx.States of arrays: the managed update of the user's `tx` on pure dicts."""
        pure = lambda tree: nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree
        opt = self.buffers.get_value()._replace(inner=state)
        tx = _on_states(tx, self.template)
        call = UpdateCall(self.policy, self.micro, self.run)
        updates, opt = managed_update(tx, opt, pure(grads), pure(params), call)
        self.buffers.set_value(opt._replace(inner=()))
        return nnx.as_pure(with_params(self.template, updates)), opt.inner

    def finish(self) -> None:
        """The objects as zerojax keeps them after the step: master weights that follow the
        model's parameters, 16-bit parameters, the optimizer's step counting applied updates."""
        before = _View(self.params, None, self.step, None)
        params = nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        if present(self.buffers.get_value().master):  # split like the master: the new 16-bit
            params = _laid_out(params, self.layouts[1])  # params are what is gathered
        after = _View(
            params,
            self.buffers.get_value(),
            self.optimizer.step.get_value(),
            None,
        )
        after = settle(before, after, self.policy, self.micro)
        _set_params(self.model, after.params)
        self.optimizer.step.set_value(jnp.asarray(after.step, self.step.dtype))
        self.buffers.set_value(after.opt_state)


def _laid_out(tree, shardings):
    """`tree` constrained to `shardings` when given and of its structure."""
    same = shardings is not None and (
        jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(shardings)
    )
    return jax.lax.with_sharding_constraint(tree, shardings) if same else tree
