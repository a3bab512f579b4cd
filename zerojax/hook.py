"""The `apply_fn` hook: run the model per device with explicit ZeRO collectives.

Inside a zerojax step, `state.apply_fn(variables, *args)` runs the unchanged model once per
device on that device's slice of the batch (`shard_map`), with full parameter copies from
`comm.device_copies` in the compute dtype. Gradients therefore leave the model unreduced, one
block per device, and `device_copies`' backward reduces them: all-reduce for stages 0-1,
reduce-scatter for 2-3. Everything outside the model (loss, optimizer update) stays in XLA's
global view, so any optax transformation, global-norm clipping included, sees exactly the
single-device numbers. With fp16, the cotangent entering the model is multiplied by the loss
scale and the parameter gradients are divided by it (in fp32) as they leave.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax.comm.gather import compute_copies, device_copies, scale_cotangent
from zerojax.config import ZeroConfig, ZeroError
from zerojax.optim import DTYPES
from zerojax.rules import PARAMS, key_name, path_str, split_spec, variables_specs


class ApplyHookError(ZeroError):
    """The model's inputs or outputs cannot be split per device; the message says why."""


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _compute_dtypes(variables, cfg: ZeroConfig) -> tuple:
    """Per leaf: the 16-bit compute dtype for parameters, None (keep) for everything else."""
    dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    return tuple(dtype if path and key_name(path[0]) == PARAMS else None
                 for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0])


def hooked_apply_fn(apply_fn, mesh, cfg: ZeroConfig, batch_rows: set, calls: list, scale=None):
    """`apply_fn` with explicit collectives; `batch_rows` holds the global batch sizes (leading
    dims of the step's batch leaves), each call appends to `calls`, and `scale` is the fp16
    loss scale (None without loss scaling)."""
    axis = cfg.axis
    n = mesh.shape[axis]
    dtypes_reduce = DTYPES[cfg.grad_reduce_dtype]

    def grad_spec(path, leaf):
        if cfg.stage >= 2 and path and key_name(path[0]) == PARAMS:
            return split_spec(leaf.shape, axis, n, cfg, path_str(path[1:]))[0]
        return P()

    def apply(variables, *args, **kwargs):
        calls.append(True)
        leaves, var_tree = jax.tree_util.tree_flatten(variables)
        store = tuple(jax.tree_util.tree_leaves(variables_specs(variables, cfg, n)))
        grads = tuple(jax.tree_util.tree_leaves(
            jax.tree_util.tree_map_with_path(grad_spec, variables)))
        copies = device_copies(tuple(leaves), scale, store, grads, mesh, axis,
                               (_compute_dtypes(variables, cfg), dtypes_reduce,
                                tuple(x.dtype for x in leaves)))

        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(flat) if _is_array(x)]
        in_specs = tuple(P(axis) if np.ndim(flat[i]) >= 1 and np.shape(flat[i])[0] in batch_rows
                         else P() for i in dynamic)
        if not any(spec == P(axis) for spec in in_specs):
            raise ApplyHookError(
                "zerojax: no argument of state.apply_fn has the batch's leading dimension "
                f"{sorted(batch_rows)}, so the model cannot be split per device. Pass batch "
                "arrays with the batch first, or use zero_shard(..., explicit_collectives=False).")

        def body(copies, values):
            local = list(flat)
            for i, v in zip(dynamic, values):
                local[i] = v
            a, k = jax.tree_util.tree_unflatten(in_tree, local)
            variables_local = jax.tree_util.tree_unflatten(var_tree, [c[0] for c in copies])
            out = apply_fn(variables_local, *a, **k)
            _check_outputs(out, {r // n for r in batch_rows})
            return out

        out = jax.shard_map(body, mesh=mesh, in_specs=(tuple(P(axis) for _ in leaves), in_specs),
                            out_specs=P(axis))(copies, tuple(flat[i] for i in dynamic))
        return out if scale is None else scale_cotangent(out, scale)
    return apply


def local_apply_fn(apply_fn, cfg: ZeroConfig, calls: list, scale=None):
    """`apply_fn` for steps that already run per device: compute-dtype casts and loss scaling,
    no collectives (the step reduces the gradients itself)."""
    def apply(variables, *args, **kwargs):
        calls.append(True)
        leaves, var_tree = jax.tree_util.tree_flatten(variables)
        copies = compute_copies(tuple(leaves), scale, (_compute_dtypes(variables, cfg),
                                                       tuple(x.dtype for x in leaves)))
        out = apply_fn(jax.tree_util.tree_unflatten(var_tree, list(copies)), *args, **kwargs)
        return out if scale is None else scale_cotangent(out, scale)
    return apply


def _check_outputs(out, local_rows: set):
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] not in local_rows:
            raise ApplyHookError(
                f"zerojax: state.apply_fn returned {jax.tree_util.keystr(path) or 'its output'} "
                f"with shape {np.shape(leaf)}, whose leading dimension is not the per-device "
                f"batch {sorted(local_rows)}; explicit collectives need every output to be "
                "per-example. Return per-example outputs (reduce them in the loss), or use "
                "zero_shard(..., explicit_collectives=False).")
