"""The three traced bodies of a zerojax step, side by side, each reading one `Variant`:

- global (`traced_global`): the user's step as is, in XLA's global view, its model calls sent
  through the per-device hook; with a managed update (16-bit, clipping, 'reduced'
  accumulation) the step sees fp32 views of its parameters and its `apply_gradients` hands
  the gradients to `managed_update`;
- local (`traced_local`; stages 0-2, k > 1, local accumulation): the whole step per device,
  as under DDP's `no_sync` (`local_step.local_body`), then one reduction and `apply_update`;
- objects (`traced_objects`): NNX objects merged from the placed dict state, their calls
  hooked and a managed update applied through `flax.nnx_managed`.

`traced` is what `jax.jit` compiles: it places the state, picks the body and pins what the
body returns to the storage layout (`outputs.finish`).
"""

from __future__ import annotations

import contextlib
import functools
from contextlib import AbstractContextManager

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.comm.hierarchy import manual_over_data
from zerojax.comm.offload import optimizer_on_host, to_device, to_storage
from zerojax.core.errors import ZeroError
from zerojax.core.rules import OPT_STATE, PARAMS, category_of
from zerojax.engine.hook import Site, hooked_apply_fn
from zerojax.engine.local_step import local_body
from zerojax.engine.outputs import finish, one_capture, same_structure, split_output, with_metrics
from zerojax.engine.variant import Variant
from zerojax.flax.model_calls import apply_fn_hooked, linen_calls_hooked, nnx_calls_hooked
from zerojax.flax.nnx_managed import ManagedObjects
from zerojax.update.managed import (
    UpdateCall,
    ZeroOptState,
    accumulate,
    apply_update,
    managed_update,
    present,
    settle,
    updating,
    zero_opt_state,
)
from zerojax.update.transforms import in_working_dtype


def traced(v: Variant, state, batch, *extra):
    """The step `jax.jit` compiles: `state` placed, the variant's body run, its new state
    pinned to the storage layout (NNX objects: `(new dict state, fn's return value)`)."""
    v.log.calls.clear()  # a trace again (jax retraces) notes its calls afresh
    state = jax.lax.with_sharding_constraint(state, v.shardings)
    on_host = (lambda p: category_of(p) == OPT_STATE) if v.update.on_host else None
    state = to_device(state, v.shardings, keep=on_host)
    if v.objects is not None:
        return traced_objects(v, state, batch, extra)
    if v.update.manages and present(state.opt_state.per_device):  # managed.prepare_state
        out = traced_local(v, state, batch, extra)
    else:
        out = traced_global(v, state, batch, extra)
    return finish(out, state, v.shardings, cast=v.update.uses_16bit and not v.micro)


def traced_global(v: Variant, state, batch, extra: tuple):
    """The user's step on the placed state, its `apply_fn` (and a Linen model it applies
    itself) hooked; a managed update captured from its `apply_gradients` and settled."""
    original = getattr(state, "apply_fn", None)
    managed = v.update.manages
    view = state
    if managed:  # fp32 views laid out as the parameters are stored (not as the master)
        params = in_working_dtype(state.params, jnp.float32)
        view = view.replace(params=_constrain(params, v.shardings.params))
    scale = state.opt_state.scale if managed and v.update.scales_loss else None
    hook = hook_for(v, scale)
    if v.explicit and callable(original) and hasattr(state, "replace"):
        view = view.replace(apply_fn=apply_fn_hooked(original, hook, v.log))
    elif managed and v.update.uses_16bit:
        raise ZeroError(
            "16-bit precision casts parameters where state.apply_fn uses them, which the "
            "step does not do: keep explicit_collectives=True and call state.apply_fn in "
            "the step."
        )
    # a Linen model the step applies itself (a closure's model.apply) is hooked too
    hooked: AbstractContextManager = contextlib.nullcontext()
    if v.explicit:
        hooked = linen_calls_hooked(hook, v.batch_rows)
    update = functools.partial(_managed_update, v)
    capturing: AbstractContextManager = updating(update) if managed else contextlib.nullcontext([])
    with capturing as updates, hooked:
        out = v.fn((view,), batch, *extra)
    new_state, rest = split_output(out, state)
    if original is not None:
        new_state = new_state.replace(apply_fn=original)
    if not managed:
        return (new_state, *rest) if rest is not None else new_state
    one_capture(updates)
    new_state = new_state.replace(params=_split_like_master(new_state.params, v.shardings))
    return with_metrics(settle(state, new_state, v.update, v.micro), rest)


def traced_local(v: Variant, state, batch, extra: tuple):
    """Local accumulation: the step per device on its parameters' and optimizer state's
    storage layout, and on whole other fields (an EMA split at rest is gathered for it)."""
    mesh, comm = v.placement.mesh, v.placement.comm
    specs = jax.tree_util.tree_map_with_path(
        lambda p, s: s.spec if category_of(p) in (PARAMS, OPT_STATE) else P(), v.shardings
    )
    param_grad_specs = v.layout.param_specs(state.params, "grad_spec")
    body = functools.partial(local_body, v, param_grad_specs)
    batch_specs = jax.tree_util.tree_map(lambda x: P(comm.data_axis) if np.ndim(x) else P(), batch)
    new_state, reduced, rest = manual_over_data(
        body,
        mesh,
        comm,
        (specs, batch_specs, P()),
        (specs, param_grad_specs if not v.micro else P(), P()),
        check_vma=False,
    )(state, batch, extra)
    if v.micro:
        new_state = new_state.replace(opt_state=accumulate(new_state.opt_state, ()))
    else:
        run = host_optimizer(v, new_state.params)
        new_state = apply_update(new_state, state.step, reduced, v.update, run)
    return with_metrics(new_state, rest)


def traced_objects(v: Variant, state, batch, extra: tuple):
    """NNX objects: `fn(objects, batch, *extra)` on objects merged from the placed dict
    state; their calls on the batch run through the per-device hook, and a managed update is
    applied as for a TrainState (`flax.nnx_managed`)."""
    objects = v.objects
    assert objects is not None, "the NNX body runs for NNX objects"
    objs = objects.merge(state)
    managed = _managed_objects(v, objs, state) if v.update.manages else None
    hooked: AbstractContextManager = contextlib.nullcontext()
    if v.explicit:
        hook = hook_for(v, managed and managed.scale)
        hooked = nnx_calls_hooked(hook, v.batch_rows, objs, objects.prefixes)
    capturing: AbstractContextManager = contextlib.nullcontext([])
    if managed:
        capturing = updating(managed.update)
    with hooked, capturing as updates:
        out = _call_objects(v, objs, batch, extra)
    if managed and v.update.uses_16bit and not v.log.hooked:
        why = fallback_reason(v.explicit, v.name)
        raise ZeroError(
            f"precision={v.placement.config.precision!r} casts the parameters where the model "
            f"runs per device, which this step rules out: {why}. Train in fp32 (give the "
            "model a bf16 dtype for 16-bit compute)."
        )
    if managed:
        one_capture(updates)
        managed.finish()
    new = objects.to_state(objs)
    if not v.micro:
        new = {**new, PARAMS: _split_like_master(new[PARAMS], v.shardings)}
    return to_storage(new, v.shardings), out


def _managed_objects(v: Variant, objs, state) -> ManagedObjects:
    """The managed step's objects, with the optimizer on the host CPU for a host update."""
    master = getattr(zero_opt_state(v.shardings), "master", ())
    layouts = (_device(v.shardings[PARAMS]), _device(master) if present(master) else None)
    managed = ManagedObjects(objs, v.update, v.micro, layouts)
    if v.update.on_host and not v.micro:
        # the objects hold the state's arrays: their shardings found by identity
        leaves = map(jax.tree_util.tree_leaves, (state, v.shardings))
        by_id = {id(x): sh for x, sh in zip(*leaves, strict=True)}
        inner = jax.tree_util.tree_map(lambda x: by_id[id(x)], managed.inner)
        managed.run = host_optimizer(v, managed.params, inner)
    return managed


def _call_objects(v: Variant, objs, batch, extra: tuple):
    """`fn(objs, batch, *extra)`; a step reading a TrainState's field off an NNX object
    fails saying how to write it for NNX."""
    try:
        return v.fn(objs, batch, *extra)
    except AttributeError as e:
        if not any(getattr(e, "obj", None) is o for o in objs):
            raise
        raise ZeroError(
            f"{v.name} reads `.{e.name}` of an NNX {type(e.obj).__name__}, as a step written "
            "for a Linen TrainState does. Pass it a TrainState (step(state, batch)), or write "
            "it for NNX: step(model, optimizer, batch), taking nnx.grad of the model and "
            "calling optimizer.update(model, grads)."
        ) from None


def hook_for(v: Variant, scale):
    """`hook(apply)`: `apply` run per device with the explicit collectives."""
    p = v.placement
    site = Site(p.mesh, p.comm, p.unit, v.layout, v.batch_rows, v.log)
    return lambda apply, stateful=None: hooked_apply_fn(apply, site, scale, stateful)


def _managed_update(v: Variant, tx, grads, opt, params):
    """`ZeroTx.update` inside the step: `managed.managed_update`, with the optimizer on the
    device or (offload_update='host') on the host CPU."""
    if not isinstance(opt, ZeroOptState):
        raise ZeroError(
            "a managed zerojax step's apply_gradients must call tx.update with the "
            f"state's own opt_state; it passed {type(opt).__name__}."
        )
    call = UpdateCall(v.update, v.micro, host_optimizer(v, params))
    return managed_update(tx, opt, grads, params, call)


def host_optimizer(v: Variant, params, inner=None):
    """`run` of the managed update for offload_update='host' (the user's optax step on the
    host CPU, beside the offloaded master and state), None on the device or for a
    micro-batch. The master and optimizer state (`inner`: its shardings, when the state does
    not hold them as a TrainState's opt_state) travel in their storage shardings, the
    gradients split like the master (`params`' sharded specs)."""
    if not v.update.on_host or v.micro:
        return None
    mesh, opt = v.placement.mesh, zero_opt_state(v.shardings)
    assert opt is not None, "a host update is a managed one: its state holds a ZeroOptState"
    stored = v.shardings[PARAMS] if isinstance(v.shardings, dict) else v.shardings.params
    grads = jax.tree_util.tree_map(
        lambda spec: NamedSharding(mesh, spec),
        v.layout.param_specs(params, "sharded_spec"),
        is_leaf=lambda x: isinstance(x, P),
    )
    master = opt.master if present(opt.master) else stored
    host = (master, opt.inner if inner is None else inner, grads, NamedSharding(mesh, P()))
    return functools.partial(optimizer_on_host, shardings=host)


def fallback_reason(explicit: bool, name: str) -> str:
    """Why the traced step `name` placed no explicit collectives."""
    if not explicit:
        return "explicit_collectives=False"
    return (
        f"{name} does not call state.apply_fn, a Linen model's apply or an NNX model it "
        "receives on the batch"
    )


def _device(shardings):
    """`shardings`' splits, in device memory."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(s.mesh, s.spec), shardings)


def _split_like_master(params, shardings):
    """The new 16-bit `params` split like the fp32 master weights (as stages 1-2 split the
    optimizer state), so that what the next step gathers is the 16-bit copy, not fp32
    updates; `params` as they are without a master."""
    master = getattr(zero_opt_state(shardings), "master", ())
    if not present(master) or not same_structure(params, master):
        return params
    return _constrain(params, master)


def _constrain(tree, shardings):
    """`tree` laid out like `shardings` (their split, in device memory)."""
    return jax.lax.with_sharding_constraint(tree, _device(shardings))
