"""Per-device parameter copies whose backward is the ZeRO gradient reduction.

`device_copies` turns stored leaves (replicated, or split on one dim) into a stacked
`(n, *shape)` array whose block on device i is device i's full copy, cast to the compute dtype
first so a stage-3 all-gather moves 16-bit weights; no communication for a replicated leaf.
Its backward receives each device's own, unreduced gradient block and reduces it in the
configured dtype with the collective the stage calls for (`comm.hierarchy.reduce_gradient`): a
reduce-scatter when the gradient is to be stored split, else an all-reduce; then it divides by
the loss scale in fp32 and returns the gradient in the leaf's own dtype. With ZeRO++ the
gather moves int8 blocks (qwZ) and the reduce-scatter quantized blocks (qgZ). Written with
`shard_map` because XLA's partitioner on CPU never emits reduce-scatter.

`compute_copies` is the same cast and unscale without collectives, for steps that already run
per device.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax.comm.flat import gather_leaves, reduce_leaves
from zerojax.comm.hierarchy import Comm, gather_weight, manual_over_data, reduce_gradient
from zerojax.core.rules import split_dim


def to_compute(x, compute_dtype):
    """A floating leaf cast to `compute_dtype` (None keeps it), before it is gathered."""
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    return x.astype(compute_dtype) if floating and compute_dtype is not None else x


def unscale(ct, scale, dtype):
    """Gradient back in the leaf's dtype, divided by the loss scale in fp32 (if scaled)."""
    if scale is None:
        return ct.astype(dtype)
    return (ct.astype(jnp.float32) / scale).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def device_copies(
    leaves: tuple, scale, store_specs: tuple, grad_specs: tuple, mesh, comm: Comm, dtypes: tuple
):
    """Stacked full copies, one per device, of each leaf (see the module docstring); `comm`
    says over which axes, and whether quantized (qwZ, qgZ). `dtypes` = (per-leaf compute
    dtypes, each None to keep the leaf's; reduce dtype or None; per-leaf dtypes of `leaves`,
    the gradients' dtypes)."""

    def gather(*xs):
        xs = [to_compute(x, dt) for x, dt in zip(xs, dtypes[0], strict=True)]
        dims = [split_dim(spec, comm.shard_axis) for spec in store_specs]
        one = lambda x, d: gather_weight(x, d, comm, x.dtype)
        return tuple(x[None] for x in gather_leaves(xs, dims, one, comm.shard_size, comm.buffers))

    return manual_over_data(
        gather, mesh, comm, store_specs, tuple(P(comm.data_axis) for _ in leaves)
    )(*leaves)


def _copies_fwd(leaves, scale, store_specs, grad_specs, mesh, comm, dtypes):
    return device_copies(leaves, scale, store_specs, grad_specs, mesh, comm, dtypes), scale


def _copies_bwd(store_specs, grad_specs, mesh, comm, dtypes, scale, cotangents):
    _, reduce_dtype, primal_dtypes = dtypes

    def reduce(*cts):
        cts = [ct[0] for ct in cts]
        dims = [split_dim(spec, comm.shard_axis) for spec in grad_specs]
        one = lambda g, d: reduce_gradient(g, d, comm, reduce_dtype)
        out = reduce_leaves(cts, dims, one, comm.shard_size, comm.buffers)
        # a whole leaf's gradient is all-reduced alone: XLA combines all-reduces itself
        return tuple(one(g, None) if d is None else g for g, d in zip(out, dims, strict=True))

    grads = manual_over_data(
        reduce, mesh, comm, tuple(P(comm.data_axis) for _ in cotangents), grad_specs
    )(*cotangents)
    grads = tuple(unscale(g, scale, dt) for g, dt in zip(grads, primal_dtypes, strict=True))
    return grads, None if scale is None else jnp.zeros_like(scale)


device_copies.defvjp(_copies_fwd, _copies_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def compute_copies(leaves: tuple, scale, dtypes: tuple):
    """Leaves cast to their compute dtypes; backward divides by the loss scale in fp32.
    `dtypes` = (per-leaf compute dtypes, per-leaf dtypes of `leaves`)."""
    return tuple(to_compute(x, dt) for x, dt in zip(leaves, dtypes[0], strict=True))


def _compute_fwd(leaves, scale, dtypes):
    return compute_copies(leaves, scale, dtypes), scale


def _compute_bwd(dtypes, scale, cotangents):
    primal_dtypes = dtypes[1]
    grads = tuple(unscale(g, scale, dt) for g, dt in zip(cotangents, primal_dtypes, strict=True))
    return grads, None if scale is None else jnp.zeros_like(scale)


compute_copies.defvjp(_compute_fwd, _compute_bwd)


@jax.custom_vjp
def scale_cotangent(tree, scale):
    """Identity whose backward multiplies the cotangent by `scale` (fp16 loss scaling applied
    where the model's output enters the loss)."""
    return tree


def _scale_fwd(tree, scale):
    return tree, scale


def _scale_bwd(scale, ct):
    return (
        jax.tree_util.tree_map(
            lambda c: (
                (c.astype(jnp.float32) * scale).astype(c.dtype)
                if jnp.issubdtype(c.dtype, jnp.floating)
                else c
            ),
            ct,
        ),
        jnp.zeros_like(scale),
    )


scale_cotangent.defvjp(_scale_fwd, _scale_bwd)
