"""Blockwise symmetric quantization and the ZeRO++ collectives built on it.

A leaf is flattened, padded to whole blocks, and each block stored as signed integers with one
fp32 scale (its absolute maximum / 127 for int8, / 7 for int4); int4 codes are packed two per
byte so the wire really carries half a byte per element. qwZ gathers such blocks instead of
16-bit weights; qgZ reduce-scatters gradients with all-to-alls of such blocks, one mesh level at
a time (inside the node first, then across nodes), dequantizing and summing in fp32 between
levels, so that only 1/local of the gradient crosses nodes and does so in 4 bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def quantize(x, bits: int, block: int):
    """(codes, scales) of `x`: codes (blocks, block) int8, or (blocks, block // 2) uint8 holding
    two int4 codes per byte; scales (blocks,) fp32."""
    flat = x.reshape(-1).astype(jnp.float32)
    flat = jnp.pad(flat, (0, -flat.size % block)).reshape(-1, block)
    qmax = 2 ** (bits - 1) - 1
    scale = jnp.max(jnp.abs(flat), axis=1) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(flat / safe[:, None]), -qmax, qmax).astype(jnp.int8)
    return (_pack4(codes) if bits == 4 else codes), scale


def dequantize(codes, scale, bits: int, shape, dtype=jnp.float32):
    """The array of `shape` that `quantize` encoded, in `dtype`."""
    if bits == 4:
        codes = _unpack4(codes)
    flat = (codes.astype(jnp.float32) * scale[:, None]).reshape(-1)
    return flat[: math.prod(shape)].reshape(shape).astype(dtype)


def _pack4(codes):
    """int8 codes in [-7, 7], pairs packed into one uint8 (low nibble first)."""
    u = (codes + 8).astype(jnp.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack4(packed):
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(packed.shape[0], -1).astype(jnp.int8) - 8


def quantized_all_gather(x, axis, dim: int, block: int, dtype):
    """qwZ: this device's shard `x`, gathered along `dim` over mesh `axis` as int8 blocks with
    fp32 scales, dequantized to `dtype`. Inside `shard_map`."""
    codes, scale = quantize(x, 8, block)
    codes = jax.lax.all_gather(codes, axis)  # (n, blocks, block)
    scale = jax.lax.all_gather(scale, axis)
    parts = jax.vmap(lambda c, s: dequantize(c, s, 8, x.shape, dtype))(codes, scale)
    full = jnp.moveaxis(parts, 0, dim)  # (..., n, x.shape[dim], ...)
    return full.reshape(*x.shape[:dim], -1, *x.shape[dim + 1 :])


def quantized_reduce_scatter(g, dim: int, levels, bits: int, block: int):
    """qgZ: this device's gradient `g` summed over the mesh axes in `levels` ((name, size)
    pairs, outermost first, e.g. (('node', 2), ('local', 4))) and split along `dim` exactly as
    a tiled `psum_scatter` over those axes splits it; fp32 result. Each level, innermost first,
    quantizes the pieces bound for each peer, exchanges them with one all-to-all, dequantizes
    and sums. Inside `shard_map`."""
    sizes = [size for _, size in levels]
    x = jnp.moveaxis(g.astype(jnp.float32), dim, 0)
    x = x.reshape(*sizes, x.shape[0] // math.prod(sizes), *x.shape[1:])
    for k in reversed(range(len(levels))):
        name, _ = levels[k]
        pieces = jnp.moveaxis(x, k, 0)  # one piece per peer on this level
        shape = pieces.shape[1:]
        codes, scale = jax.vmap(lambda p: quantize(p, bits, block))(pieces)
        codes = jax.lax.all_to_all(codes, name, 0, 0, tiled=True)
        scale = jax.lax.all_to_all(scale, name, 0, 0, tiled=True)
        x = jax.vmap(lambda c, s, shape=shape: dequantize(c, s, bits, shape))(codes, scale).sum(0)
    return jnp.moveaxis(x, 0, dim)
