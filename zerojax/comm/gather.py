"""Per-device parameter copies whose backward is the ZeRO gradient reduction.

`device_copies` turns stored leaves (replicated, or split on one dim) into a stacked
`(n, *shape)` array whose block on device i is device i's full copy: no communication for a
replicated leaf, an all-gather for a split one. Its backward receives each device's own,
unreduced gradient block and reduces it with the collective the stage calls for: a
reduce-scatter (`psum_scatter`) when the gradient is to be stored split, else an all-reduce.
Written with `shard_map` because XLA's partitioner on CPU never emits reduce-scatter.
"""
from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec as P


def split_dim(spec: P, axis: str):
    """The dimension `spec` splits over `axis`, or None when it keeps the leaf whole."""
    for dim, name in enumerate(spec):
        if name == axis or (isinstance(name, tuple) and axis in name):
            return dim
    return None


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def device_copies(leaves: tuple, store_specs: tuple, grad_specs: tuple, mesh, axis: str):
    """Stacked full copies, one per device, of each leaf (see the module docstring)."""
    def gather(*xs):
        out = []
        for x, spec in zip(xs, store_specs):
            dim = split_dim(spec, axis)
            full = x if dim is None else jax.lax.all_gather(x, axis, axis=dim, tiled=True)
            out.append(full[None])
        return tuple(out)
    return jax.shard_map(gather, mesh=mesh, in_specs=store_specs,
                         out_specs=tuple(P(axis) for _ in leaves))(*leaves)


def _copies_fwd(leaves, store_specs, grad_specs, mesh, axis):
    return device_copies(leaves, store_specs, grad_specs, mesh, axis), None


def _copies_bwd(store_specs, grad_specs, mesh, axis, _, cotangents):
    def reduce(*cts):
        out = []
        for ct, spec in zip(cts, grad_specs):
            ct, dim = ct[0], split_dim(spec, axis)
            out.append(jax.lax.psum(ct, axis) if dim is None else
                       jax.lax.psum_scatter(ct, axis, scatter_dimension=dim, tiled=True))
        return tuple(out)
    grads = jax.shard_map(reduce, mesh=mesh, in_specs=tuple(P(axis) for _ in cotangents),
                          out_specs=grad_specs)(*cotangents)
    return (grads,)


device_copies.defvjp(_copies_fwd, _copies_bwd)
