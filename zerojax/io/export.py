"""Consolidated parameters out of a zerojax checkpoint, one leaf at a time; its summary; and
`verify`, every step's arrays read back.

`export` writes the full (unsharded) parameters of one checkpoint step to a `.safetensors`
file (Hugging Face's format: a JSON header of names, dtypes, shapes and offsets, then raw
little-endian data) or a `.msgpack` file that `flax.serialization.msgpack_restore` reads. The
header is computed from the checkpoint's metadata first, then each leaf is read alone from
disk (no devices, no mesh), converted and appended, so host memory stays near the largest
leaf, not the model. `info` says what a checkpoint directory holds.
"""

from __future__ import annotations

import json
import os
import struct

import jax.numpy as jnp
import msgpack
import numpy as np
import orbax.checkpoint as ocp

from zerojax.core.config import DTYPE_NAMES
from zerojax.core.errors import ZeroError
from zerojax.io.checkpoint import nest, orbax_manager
from zerojax.io.checkpoint_health import saved_leaves, saved_step, step_problems
from zerojax.io.interop import FILE_DTYPES

SAFETENSORS_DTYPES = {dtype.name: name for name, dtype in FILE_DTYPES.items()}


def _manager(directory):
    if not os.path.isdir(directory):
        raise ZeroError(f"{directory} is not a directory.")
    return orbax_manager(
        os.path.abspath(directory),
        ocp.CheckpointManagerOptions(create=False, save_interval_steps=0),
    )


def _step_and_tree(directory, step):
    mgr = _manager(directory)
    return (mgr, *saved_step(mgr, step))


def info(directory, step: int | None = None) -> dict:
    """Steps present and, for one step (latest by default), every saved leaf: shape, dtype,
    bytes and how it was sharded when saved; plus the step's `extra`."""
    mgr, step, tree = _step_and_tree(directory, step)
    leaves = []
    for keys, meta in saved_leaves(tree):
        sharding = getattr(meta, "sharding", None)
        leaves.append(
            {
                "path": "/".join(keys),
                "shape": list(meta.shape),
                "dtype": str(np.dtype(meta.dtype)),
                "bytes": int(np.prod(meta.shape)) * np.dtype(meta.dtype).itemsize,
                "saved_sharding": str(getattr(sharding, "partition_spec", sharding)),
            }
        )
    extra = mgr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))["extra"]
    return {
        "directory": os.path.abspath(directory),
        "steps": list(mgr.all_steps()),
        "step": step,
        "extra": dict(extra or {}),
        "leaves": leaves,
        "total_bytes": sum(x["bytes"] for x in leaves),
    }


def _read_leaf(path, keys, meta, dtype):
    """One saved array as a host numpy array in `dtype` (only this leaf is read)."""
    item = restore_args = None
    for k in reversed(keys):
        item = {k: item if item is not None else np.zeros((), np.float32)}
        restore_args = {
            k: restore_args
            if restore_args is not None
            else ocp.RestoreArgs(restore_type=np.ndarray)
        }
    with ocp.PyTreeCheckpointer() as ckptr:
        out = ckptr.restore(
            path,
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
        )
    for k in keys:
        out = out[k]
    return np.ascontiguousarray(np.asarray(out).astype(dtype, copy=False))


def verify(directory, step: int | None = None) -> dict:
    """{step: [problems]} for every step in `directory` (or one), each array read back from
    disk and checked against its saved shape and dtype: empty lists are steps that restore."""
    mgr = _manager(directory)
    steps = list(mgr.all_steps()) if step is None else [int(step)]
    if step is not None and int(step) not in mgr.all_steps():
        raise ZeroError(f"no step {step} in {directory} (steps there: {list(mgr.all_steps())}).")
    out = {}
    for s in steps:
        path = os.path.join(mgr.directory, str(s), "state")
        read = lambda keys, meta, path=path: _read_leaf(path, keys, meta, np.dtype(meta.dtype))
        out[s] = step_problems(mgr.directory, mgr, s, read)
    return out


def export(directory, out: str, step: int | None = None, dtype: str = "fp32") -> dict:
    """Write checkpoint `step`'s parameters (the fp32 master when it has one) to `out`
    (.safetensors or .msgpack) in `dtype` ('fp32', 'bf16' or 'fp16'), leaf by leaf."""
    if dtype not in DTYPE_NAMES:
        raise ZeroError(f"export dtype must be one of {', '.join(DTYPE_NAMES)}; got {dtype!r}.")
    if not out.endswith((".safetensors", ".msgpack")):
        raise ZeroError(f"export writes .safetensors or .msgpack files; got {out!r}.")
    mgr, step, tree = _step_and_tree(directory, step)
    if "params" not in tree:
        raise ZeroError(f"checkpoint step {step} in {directory} holds no params.")
    params = saved_leaves(tree["params"])
    np_dtype = np.dtype(getattr(jnp, DTYPE_NAMES[dtype]))
    path = os.path.join(mgr.directory, str(step), "state")
    tmp = out + ".partial"  # never leave a half-written file under `out`
    with open(tmp, "wb") as f:
        if out.endswith(".safetensors"):
            _write_safetensors(f, params, path, np_dtype, step)
        else:
            _write_msgpack(f, params, path, np_dtype)
    os.replace(tmp, out)
    return {
        "step": step,
        "leaves": len(params),
        "dtype": dtype,
        "out": out,
        "bytes": os.path.getsize(out),
    }


def _write_safetensors(f, params, path, dtype, step):
    header, offset = {"__metadata__": {"format": "flax", "zerojax_step": str(step)}}, 0
    for keys, meta in params:
        n = int(np.prod(meta.shape)) * dtype.itemsize
        header[".".join(keys)] = {
            "dtype": SAFETENSORS_DTYPES[dtype.name],
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)) + text)
    for keys, meta in params:  # written from the array's own buffer: no extra copy
        f.write(_read_leaf(path, ("params", *keys), meta, dtype).reshape(-1).view(np.uint8).data)


MSGPACK_NDARRAY = 1  # the msgpack extension code flax.serialization reads an array from


def _pack_array(x: np.ndarray) -> msgpack.ExtType:
    """An array as flax.serialization's ndarray extension: (shape, dtype name, C-order bytes)."""
    data = (x.shape, x.dtype.name, np.ascontiguousarray(x).tobytes())
    return msgpack.ExtType(MSGPACK_NDARRAY, msgpack.packb(data, use_bin_type=True))


def _write_msgpack(f, params, path, dtype):
    """A nested map, packed as flax.serialization does, written key by key."""
    packer = msgpack.Packer(default=_pack_array, use_bin_type=True)

    def write(node: dict, prefix: tuple):
        f.write(packer.pack_map_header(len(node)))
        for k in sorted(node):
            f.write(packer.pack(k))
            if isinstance(node[k], dict):
                write(node[k], prefix + (k,))
            else:
                f.write(packer.pack(_read_leaf(path, ("params", *prefix, k), node[k], dtype)))

    write(nest(params), ())
