"""Local gradient accumulation (stages 0-2, k > 1): the whole step runs per device, as under
DDP's `no_sync`: each device sums its own gradients, and only the k-th micro-batch reduces them,
once, before the managed update (`traced.traced_local` runs `local_body` in `shard_map`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.comm.device_values import device_mean, from_device_0
from zerojax.comm.hierarchy import reduce_gradient
from zerojax.core.policy import working_dtype
from zerojax.core.rules import OPT_STATE, PARAMS, category_of, split_dim
from zerojax.engine.hook import local_apply_fn
from zerojax.engine.outputs import one_capture, split_output
from zerojax.engine.variant import Variant
from zerojax.flax.model_calls import apply_fn_hooked, linen_calls_hooked
from zerojax.update.managed import capture_gradients
from zerojax.update.transforms import in_working_dtype


def local_body(v: Variant, param_grad_specs, state, batch, extra):
    """The variant's step on this device's slice of the batch, summing its own gradients into
    the `per_device` buffer; unless a micro-batch, the sums are reduced once (mean over
    devices, as DDP) into the stage's gradient layout (`param_grad_specs`). Returns (new
    state, reduced gradients or (), the step's other outputs averaged over devices)."""
    comm = v.placement.comm
    axis, n = comm.data_axis, comm.data_size
    original = state.apply_fn
    scale = state.opt_state.scale if v.update.scales_loss else None
    rows = local_rows(batch)
    hook = lambda apply, stateful=None: local_apply_fn(  # noqa: E731
        apply, v.placement.unit, v.log, axis, rows, scale
    )
    view = state.replace(
        params=in_working_dtype(state.params, jnp.float32),
        apply_fn=apply_fn_hooked(original, hook, v.log),  # however the step calls it
    )
    with capture_gradients() as sink, linen_calls_hooked(hook, rows):
        out = v.fn((view,), batch, *extra)
    grads = one_capture(sink)
    new_state, rest = split_output(out, state)
    opt = state.opt_state
    sums = jax.tree_util.tree_map(lambda a, g: a + g[None].astype(a.dtype), opt.per_device, grads)
    reduced = ()
    if not v.micro:  # one reduction per optimizer step; the mean over devices, as DDP
        reduced = jax.tree_util.tree_map(
            lambda s, spec: (
                reduce_gradient(
                    s[0],
                    split_dim(spec, comm.shard_axis),
                    comm,
                    v.placement.unit.reduce_dtype,
                ).astype(working_dtype(s.dtype, jnp.float32))
                / n
            ),
            sums,
            param_grad_specs,
        )
        sums = jax.tree_util.tree_map(jnp.zeros_like, sums)
    new_state = _sync_other_fields(
        new_state.replace(
            params=state.params,
            opt_state=opt._replace(per_device=sums),
            step=state.step,
            apply_fn=original,
        ),
        axis,
    )
    return new_state, reduced, device_mean(rest, axis)


def local_rows(batch) -> set:
    """The leading dims of this device's batch leaves."""
    return {jnp.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if jnp.ndim(x)}


def _sync_other_fields(state, axis):
    """Fields besides params and opt_state (an rng, user counters) from device 0."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if category_of(p) in (PARAMS, OPT_STATE) else from_device_0(x, axis), state
    )
