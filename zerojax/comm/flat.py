"""One buffer per unit and dtype (`unit_buffers=True`): a unit's split leaves cross the network
as one array each way, one all-gather and one reduce-scatter, instead of one per leaf; the
parameters no unit holds (gathered once per step) likewise.

Each leaf's shard is laid out with its split dim first and flattened, and the shards are
concatenated into an `(S,)` buffer, zero-padded to whole blocks of `ROWS` x `LANES` elements;
gathered over the n shard devices it is `(n * S,)`, part i device i's buffer, from which each
full leaf is read back (its n pieces stacked on the split dim). Gradients go the other way:
each full gradient, split dim first, as `(n, size / n)` rows, concatenated (and padded) into
`(n, S)` and reduce-scattered, as rows of `LANES`, into this device's `(S,)`.
A single split leaf of a dtype is gathered and reduced as itself (nothing to pack), and so is
a leaf of `ALONE_BYTES` or more: its collective is large enough on its own, and packing would
copy it in and out (at 125m libtpu also ran the reduce-scatter of the embedding packed with
two norm stacks as an all-reduce and a slice). Reading
the leaves out of the gathered buffer copies them (as FSDP2's copy-out does), so a unit's
weights exist twice for a moment: fewer, larger collectives for more bytes moved in memory
(`bench/unit_collectives.py` and `bench/hlo_audit.py` measure both).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LANES = 128  # a buffer is reduce-scattered as rows of this many elements (a TPU's tile width)
ROWS = 16  # and each device's part padded to whole blocks of ROWS rows: else libtpu compiles
# the reduce-scatter as an all-reduce and a slice, twice the bytes (measured on v5e:2x4)
# a leaf at least this large (whole, in the dtype it moves in) moves as itself: PyTorch DDP's
# default bucket cap. bench/hlo_audit.py --topology v5e:2x4, 125m, unit_buffers: 954.2 -> 832.0
# MiB sent per chip (the embedding's reduce-scatter no longer an all-reduce), peak 9,780.0 ->
# 9,735.6 MiB
ALONE_BYTES = 25 * 2**20
COPY_OUT = "unit_buffer_copy_out"  # the name scope of the leaves read out of a gathered buffer


def _padded(size: int) -> int:
    """`size` elements rounded up to whole blocks of `ROWS` x `LANES`."""
    step = ROWS * LANES
    return -(-size // step) * step


def _moved(shape: tuple, dim: int) -> tuple:
    """`shape` with `dim` first (what `jnp.moveaxis(x, dim, 0)` gives)."""
    return (shape[dim], *shape[:dim], *shape[dim + 1 :])


def _shard(shape: tuple, dim: int, n: int) -> tuple:
    """The shape of one of `n` shards of `shape` split on `dim`."""
    return (*shape[:dim], shape[dim] // n, *shape[dim + 1 :])


def _pack_shards(shards: list) -> jnp.ndarray:
    """`(S,)`: the shards (each `(dim, x)`), split dim first, flattened, concatenated and
    padded with zeros to whole blocks of `ROWS` x `LANES`."""
    flat = [jnp.moveaxis(x, d, 0).reshape(-1) for d, x in shards]
    size, dtype = sum(x.size for x in flat), flat[0].dtype
    return jnp.concatenate([*flat, jnp.zeros(_padded(size) - size, dtype)])


def _unpack_full(buffer, shards: list) -> list:
    """The full leaves in the gathered `(n * S,)` buffer of `shards` (each `(dim, x)`)."""
    buffer = buffer.reshape(-1, _padded(sum(x.size for _, x in shards)))
    n, out, at = buffer.shape[0], [], 0
    for d, x in shards:
        moved = _moved(x.shape, d)
        size = math.prod(moved)
        part = buffer[:, at : at + size].reshape((n * moved[0], *moved[1:]))
        out.append(jnp.moveaxis(part, 0, d))
        at += size
    return out


def _pack_full(grads: list, n: int) -> jnp.ndarray:
    """`(n * S,)`: the full gradients (each `(dim, g)`), part i the `S` device i keeps (its
    rows, padded as `_pack_shards` pads)."""
    rows = [jnp.moveaxis(g, d, 0).reshape(n, -1) for d, g in grads]
    size, dtype = sum(r.shape[1] for r in rows), rows[0].dtype
    pad = jnp.zeros((n, _padded(size) - size), dtype)
    return jnp.concatenate([*rows, pad], axis=1).reshape(-1)


def _unpack_shards(buffer, shards: list) -> list:
    """This device's shards (each `(dim, shard shape)`) in its reduced `(S,)` buffer."""
    out, at = [], 0
    for d, shape in shards:
        moved = _moved(tuple(shape), d)
        size = math.prod(moved)
        out.append(jnp.moveaxis(buffer[at : at + size].reshape(moved), 0, d))
        at += size
    return out


def _groups(nbytes: list, dtypes: list, dims: list, buffers: bool) -> list:
    """Positions of the split leaves (dim not None) moved together: one per leaf, or with
    `buffers` one group per dtype of the leaves under `ALONE_BYTES` (`nbytes`: whole leaves')
    and one per larger leaf."""
    split = [i for i, d in enumerate(dims) if d is not None]
    if not buffers:
        return [[i] for i in split]
    alone = [[i] for i in split if nbytes[i] >= ALONE_BYTES]
    by_dtype: dict = {}
    for i in split:
        if nbytes[i] < ALONE_BYTES:
            by_dtype.setdefault(dtypes[i], []).append(i)
    return alone + list(by_dtype.values())


def gather_leaves(shards: list, dims: list, gather, n: int, buffers: bool) -> list:
    """Each split shard gathered whole by `gather(x, dim)` over `n` devices, leaf by leaf or
    (`buffers`) one buffer per dtype; a leaf whose dim is None is returned as is."""
    out = list(shards)
    whole = [x.nbytes * n for x in shards]
    for group in _groups(whole, [x.dtype for x in shards], dims, buffers):
        if len(group) == 1:
            out[group[0]] = gather(shards[group[0]], dims[group[0]])
            continue
        parts = [(dims[i], shards[i]) for i in group]
        gathered = gather(_pack_shards(parts), 0)
        with jax.named_scope(COPY_OUT):  # the leaves read out are gathered weights too
            leaves = _unpack_full(gathered, parts)
        for i, x in zip(group, leaves, strict=True):
            out[i] = x
    return out


def reduce_leaves(grads: list, dims: list, reduce, n: int, buffers: bool) -> list:
    """Each split gradient reduce-scattered by `reduce(g, dim)` to this device's shard (one
    n-th of its dim), leaf by leaf or (`buffers`) one buffer per dtype over `n` devices; a
    gradient whose dim is None is returned as is."""
    out = list(grads)
    for group in _groups([g.nbytes for g in grads], [g.dtype for g in grads], dims, buffers):
        if len(group) == 1:
            out[group[0]] = reduce(grads[group[0]], dims[group[0]])
            continue
        buffer = _pack_full([(dims[i], grads[i]) for i in group], n)
        mine = reduce(buffer.reshape(-1, LANES), 0).reshape(-1)
        shards = _unpack_shards(
            mine, [(dims[i], _shard(grads[i].shape, dims[i], n)) for i in group]
        )
        for i, g in zip(group, shards, strict=True):
            out[i] = g
    return out
