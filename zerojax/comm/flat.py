"""One buffer per stage-3 unit (`unit_buffers=True`): a unit's split leaves cross the network as
one array each way, one all-gather and one reduce-scatter, instead of one per leaf; and at
stages 1-2 one all-reduce bucket for a unit's unsplit leaves.

Each leaf's shard is laid out with its split dim first and flattened, and the shards are
concatenated into a `(1, S)` buffer; gathered over the n shard devices it is `(n, S)`, row i
device i's buffer, from which each full leaf is read back (its n pieces stacked on the split
dim). Gradients go the other way: each full gradient, split dim first, as `(n, size / n)`
rows, concatenated into `(n, S)` and reduce-scattered on dim 0 into this device's `(1, S)`.
Reading the leaves out of the buffer copies them, so a unit's weights exist twice for a
moment: fewer, larger collectives for a higher peak (measured by `bench/unit_collectives.py`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def pack_shards(shards: list) -> jnp.ndarray:
    """`(1, S)`: the shards (each `(dim, x)`), split dim first, flattened and concatenated."""
    return jnp.concatenate([jnp.moveaxis(x, d, 0).reshape(-1) for d, x in shards])[None]


def unpack_full(buffer, shards: list) -> list:
    """The full leaves in the gathered `(n, S)` buffer of `shards` (each `(dim, x)`)."""
    n, out, at = buffer.shape[0], [], 0
    for d, x in shards:
        moved = jnp.moveaxis(x, d, 0).shape
        size = math.prod(moved)
        part = buffer[:, at : at + size].reshape((n * moved[0], *moved[1:]))
        out.append(jnp.moveaxis(part, 0, d))
        at += size
    return out


def pack_full(grads: list, n: int) -> jnp.ndarray:
    """`(n, S)`: the full gradients (each `(dim, g)`), row i the part device i keeps."""
    return jnp.concatenate([jnp.moveaxis(g, d, 0).reshape(n, -1) for d, g in grads], axis=1)


def unpack_shards(buffer, shards: list) -> list:
    """This device's shards (shaped like each `(dim, x)` of `shards`) in its `(1, S)` buffer."""
    out, at = [], 0
    for d, x in shards:
        moved = jnp.moveaxis(x, d, 0).shape
        size = math.prod(moved)
        out.append(jnp.moveaxis(buffer[0, at : at + size].reshape(moved), 0, d))
        at += size
    return out


def all_reduce_bucket(grads: list, reduce) -> list:
    """`grads` summed over the devices as one flat buffer (DDP's gradient bucket): one
    `reduce` (a psum) for all of them instead of one per leaf, each back in its shape."""
    sizes = [g.size for g in grads]
    summed = reduce(jnp.concatenate([g.reshape(-1) for g in grads]))
    out, at = [], 0
    for g, size in zip(grads, sizes, strict=True):
        out.append(summed[at : at + size].reshape(g.shape))
        at += size
    return out
