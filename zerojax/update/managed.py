"""The update zerojax manages around ANY optax transformation: fp32 master weights for 16-bit
training, fp16 dynamic loss scaling (DeepSpeed's semantics), gradient accumulation and
global-norm clipping.

`prepare_state` turns a user's TrainState into a managed one: 16-bit `params`, a `ZeroOptState`
holding the user's optimizer state beside the master weights and buffers, and a `ZeroTx` in
place of the user's `tx`. Inside a zerojax step the user's own update code stays in charge:
its `state.apply_gradients(grads=grads)` (an override included) calls `ZeroTx.update`, which
returns the real update (`managed_update`: the user's optimizer in fp32 on the master weights,
in XLA's global view, so clipping and factored optimizers see whole tensors), and the state the
user's code returns is the new state. `settle` then lets the master weights follow the
parameters that code returned (a projection it made is kept) and counts optimizer steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zerojax.core.errors import ZeroError
from zerojax.core.policy import UpdatePolicy, working_dtype
from zerojax.core.trace_scope import current, scoped
from zerojax.update.transforms import (
    applied,
    clipped,
    in_working_dtype,
    micro_batch_mean,
    next_loss_scale,
    norm_and_finite,
    skipped_unless_finite,
    state_kept_in_its_dtype,
    store_optimizer_state,
    zero_where_nonfinite,
    zeros_like,
)


class ZeroOptState(NamedTuple):
    """Optimizer-side state of a managed train state (all of it checkpointed with the state)."""

    inner: Any  # the user's optax state, on fp32 master shapes
    master: Any  # fp32 master weights; () when parameters are fp32 already
    accum: Any  # 'reduced' accumulation: summed gradients in parameter layout
    per_device: Any  # 'local' accumulation: (devices, *shape) unreduced sums per leaf
    micro: jax.Array  # int32: micro-batches accumulated since the last update
    scale: jax.Array  # f32: loss scale (1 unless fp16)
    good_steps: jax.Array  # int32: steps since the last overflow (scale growth window)
    hysteresis: jax.Array  # int32: overflows left before the scale drops
    skipped: jax.Array  # int32: optimizer steps skipped because of overflow
    last_skipped: jax.Array  # bool: the last optimizer step was skipped
    grad_norm: jax.Array  # f32: global norm of the last applied mean gradient, unclipped
    overflow_at_min_scale: jax.Array  # bool: overflowed with the scale already at its minimum


@contextlib.contextmanager
def updating(update):
    """While a step is traced, `ZeroTx.update(grads, state, params)` returns
    `update(inner_tx, grads, state, params)`; yields the list of gradients it was called with
    (a step calls its update exactly once: `outputs.one_capture`)."""
    calls: list = []

    def counted(tx, grads, state, params):
        calls.append(grads)
        return update(tx, grads, state, params)

    with scoped(update=counted):
        yield calls


def capture_gradients():
    """`updating` that only collects the gradients and changes nothing (local accumulation:
    the step runs per device, and the update is applied once the gradients are reduced)."""
    return updating(lambda tx, grads, state, params: (zeros_like(grads), state))


class ZeroTx:
    """Stands in for the user's optax transformation in a managed state: inside a zerojax step,
    `update` returns the managed update of the user's transformation (`managed_update`)."""

    def __init__(self, inner: optax.GradientTransformation):
        self.inner = inner

    def __eq__(self, other):
        return isinstance(other, ZeroTx) and other.inner == self.inner

    def __hash__(self):
        return hash((ZeroTx, self.inner))

    def init(self, params):
        raise ZeroError(
            "this state's optimizer is managed by zerojax: create states with "
            "zero.init(...) or zero.shard(state), not tx.init."
        )

    def update(self, grads, state, params=None, **extra_args):
        update = current().update
        if update is None:
            raise ZeroError(
                "apply_gradients on a zerojax-managed state only works inside a "
                "step decorated with its zero_shard."
            )
        if extra_args:
            raise ZeroError(
                f"the managed update does not pass extra arguments ({sorted(extra_args)}) to "
                "the optimizer: drop them, or train without the options that manage the "
                "update (precision, accumulation, clipping, on_nonfinite)."
            )
        if params is None:
            raise ZeroError(
                "the managed update needs the parameters: call tx.update(grads, opt_state, "
                "params), as TrainState.apply_gradients and nnx.Optimizer.update do."
            )
        return update(self.inner, grads, state, params)


def zero_opt_state(tree) -> ZeroOptState | None:
    """The ZeroOptState a managed state holds (a TrainState's opt_state; NNX objects' dict
    state holds it under the optimizer's `zerojax` variable), or None."""
    found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ZeroOptState))
    return next((x for x in found if isinstance(x, ZeroOptState)), None)


def present(tree) -> bool:
    """False for the `()` placeholder of a buffer this configuration does not need."""
    return not (isinstance(tree, tuple) and not tree)


def prepare_state(state, policy: UpdatePolicy, axis_size: int):
    """A managed copy of `state` (unchanged if already managed). Runs under jit in zero.init."""
    if isinstance(getattr(state, "opt_state", None), ZeroOptState):
        return state
    if not all(hasattr(state, f) for f in ("params", "opt_state", "tx", "replace")):
        raise ZeroError(
            "precision, gradient accumulation and clipping need a state with "
            "`params`, `opt_state` and `tx` (a flax TrainState); got "
            f"{type(state).__name__}."
        )
    params32 = in_working_dtype(state.params, jnp.float32)
    k, accum_dtype = policy.accumulation_steps, policy.accum_dtype
    zeros = lambda shape_prefix: jax.tree_util.tree_map(
        lambda p: jnp.zeros(shape_prefix + p.shape, working_dtype(p.dtype, accum_dtype)), params32
    )
    local = policy.accumulates_locally and not _own_update(state, policy)
    opt = ZeroOptState(
        inner=store_optimizer_state(state.opt_state, policy),
        master=params32 if policy.uses_16bit else (),
        accum=zeros(()) if k > 1 and not local else (),
        per_device=zeros((axis_size,)) if local else (),
        micro=jnp.zeros((), jnp.int32),
        **initial_scaler(policy),
    )
    return state.replace(
        params=in_working_dtype(state.params, policy.param_dtype),
        opt_state=opt,
        tx=ZeroTx(state.tx),
    )


def _own_update(state, policy: UpdatePolicy) -> bool:
    """Whether the state's class overrides `apply_gradients` (an EMA, a projection): its code
    must see the updated parameters, which local accumulation cannot give it (the step runs
    per device before the gradients are reduced), so 'auto' accumulates 'reduced' for it."""
    own = getattr(type(state), "apply_gradients", None)
    if own is None or getattr(own, "__module__", "").startswith("flax."):
        return False
    if policy.accumulate == "local":
        raise ZeroError(
            f"accumulate='local' runs the step per device and applies the update after it, "
            f"so {type(state).__name__}.apply_gradients would see the parameters unchanged: "
            "use accumulate='reduced' (or 'auto'), which runs your apply_gradients on the "
            "updated parameters."
        )
    return True


def initial_scaler(policy: UpdatePolicy) -> dict:
    """The loss scaler's counters and metrics as a fresh state starts them."""
    scale = (policy.loss_scale or 2.0**policy.initial_scale_power) if policy.scales_loss else 1.0
    return dict(
        scale=jnp.asarray(scale, jnp.float32),
        good_steps=jnp.zeros((), jnp.int32),
        hysteresis=jnp.asarray(policy.hysteresis, jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
        last_skipped=jnp.zeros((), bool),
        grad_norm=jnp.zeros((), jnp.float32),
        overflow_at_min_scale=jnp.zeros((), bool),
    )


def accumulate(opt: ZeroOptState, grads) -> ZeroOptState:
    """A micro-step that does not update: add `grads` to the 'reduced' buffer (if any)."""
    accum = (
        opt.accum
        if not present(opt.accum)
        else jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), opt.accum, grads)
    )
    return opt._replace(accum=accum, micro=opt.micro + 1)


@dataclasses.dataclass(frozen=True)
class UpdateCall:
    """One traced update: the policy, whether this micro-batch only accumulates its gradients,
    and `run(update, master, inner, grads, finite)` running the optimizer elsewhere (the host
    CPU: `comm.offload.optimizer_on_host`), None on the device."""

    policy: UpdatePolicy
    micro: bool = False
    run: Callable | None = None


def managed_update(tx, opt: ZeroOptState, grads, params, call: UpdateCall):
    """What `ZeroTx.update` returns for the user's optax `tx`: (updates to `params`, the new
    ZeroOptState). A micro-batch only accumulates its gradients (the parameters stay, as under
    optax.MultiSteps); the k-th runs `_optimizer_step` on the fp32 master weights. `params`
    (the fp32 view the step sees) plus the updates are the new master weights."""
    grads = in_working_dtype(grads, jnp.float32)
    master = opt.master if present(opt.master) else params
    if call.micro:
        new_opt, new_master, updates = accumulate(opt, grads), master, zeros_like(params)
    else:
        new_opt, new_master, updates = _optimizer_step(tx, opt, grads, master, call)
    if present(opt.master):  # the user's view holds master.astype(16 bits) in fp32
        updates = jax.tree_util.tree_map(lambda m, p: m - p, new_master, params)
        new_opt = new_opt._replace(master=new_master)
    return updates, new_opt


def _optimizer_step(tx, opt: ZeroOptState, grads, master, call: UpdateCall):
    """(new ZeroOptState, new master, `tx`'s updates) of the k-th micro-batch: the mean over
    micro-batches, the finite check, clipping, `tx` with its state in its dtype (skipped on a
    non-finite step), on the device or where `call.run` runs it, and the next loss scale."""
    policy = call.policy
    grads = micro_batch_mean(opt.accum, grads, policy.accumulation_steps, present(opt.accum))
    norm, finite = norm_and_finite(grads, policy)
    grads = clipped(grads, policy)
    update = applied(state_kept_in_its_dtype(tx, policy))
    if call.run is not None:
        new_master, inner, updates = call.run(update, master, opt.inner, grads, finite)
    else:
        update = skipped_unless_finite(functools.partial(update, grads=grads), finite, policy)
        new_master, inner, updates = update(master, opt.inner)
    updates = zero_where_nonfinite(updates, finite, policy)
    scale, good, hyst, at_min = next_loss_scale(opt, finite, policy)
    opt = opt._replace(
        inner=inner,
        accum=zeros_like(opt.accum),
        micro=jnp.zeros((), jnp.int32),
        scale=scale,
        good_steps=good,
        hysteresis=hyst,
        skipped=opt.skipped + (~finite).astype(jnp.int32),
        last_skipped=~finite,
        grad_norm=jnp.where(finite, norm, opt.grad_norm),
        overflow_at_min_scale=at_min,
    )
    return opt, new_master, updates


def settle(before, after, policy: UpdatePolicy, micro: bool):
    """The state the user's update code returned (`after`, from `before`) as zerojax keeps it:
    the fp32 master weights follow the parameters it returned (exactly the managed update's
    where they are what `params + updates` gives; the user's values where its code changed
    them, e.g. a projection), the 16-bit parameters are the master's, and `step` counts
    optimizer steps applied (a micro-batch or a skipped non-finite step leaves it)."""
    opt = after.opt_state
    if not isinstance(opt, ZeroOptState):
        raise ZeroError(
            "the state a managed zerojax step returns must hold the opt_state its "
            "apply_gradients made (tx.update's); the step replaced it with "
            f"{type(opt).__name__}."
        )
    params = after.params
    if present(opt.master):
        view = in_working_dtype(before.params, jnp.float32)
        master = jax.tree_util.tree_map(_follow, opt.master, view, params)
        opt = opt._replace(master=master)
        params = in_working_dtype(master, policy.param_dtype)
    applied = jnp.asarray(False) if micro else ~opt.last_skipped
    # jnp.where keeps the counter's weak type (TrainState starts it as a Python 0), so the
    # returned state matches the input's avals and the step does not compile twice
    return after.replace(
        params=params, opt_state=opt, step=jnp.where(applied, after.step, before.step)
    )


def _follow(master, view, returned):
    """The new master weight of one leaf: `master` where the user's code returned what
    `optax.apply_updates(view, master - view)` gives, else what it returned."""
    returned = returned.astype(master.dtype)
    return jnp.where(returned == view + (master - view), master, returned)


def apply_update(state, old_step, grads, policy: UpdatePolicy, run=None):
    """The managed update applied by zerojax itself to `state` (local accumulation: the user's
    step ran per device before its gradients were reduced), as `apply_gradients` would."""
    view = in_working_dtype(state.params, jnp.float32)
    call = UpdateCall(policy, False, run)
    updates, opt = managed_update(state.tx.inner, state.opt_state, grads, view, call)
    after = state.replace(
        params=optax.apply_updates(view, updates), opt_state=opt, step=old_step + 1
    )
    return settle(state.replace(step=old_step), after, policy, micro=False)


def update_metrics(opt: ZeroOptState) -> dict:
    """What the step adds to a metrics dict when zerojax manages the update."""
    return {
        "grad_norm": opt.grad_norm,
        "loss_scale": opt.scale,
        "step_skipped": opt.last_skipped,
        "skipped_steps": opt.skipped,
        "micro_step": opt.micro,
    }
