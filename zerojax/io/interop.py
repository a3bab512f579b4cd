"""Parameters from a Hugging Face style `.safetensors` file into a sharded zerojax state.

`load_safetensors(zero, state, path)` fills the state's parameters from the file shard by
shard: the file is memory-mapped, and each device's slice of each tensor is read alone
(`jax.make_array_from_callback`), in the layout the rules give it, so no tensor is ever whole on
one device or in host memory (the OS pages in only the bytes read). Names map from parameter
paths ('layers/0/mlp/kernel') to file keys with `names` (default: the path with dots, as
`zerojax checkpoint export` writes them); `transpose` names the 2-D leaves stored the other
way round (PyTorch's Linear keeps (out, in), Flax's Dense (in, out)).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zerojax.core.errors import ZeroError
from zerojax.core.rules import path_str
from zerojax.update.managed import ZeroOptState, present
from zerojax.update.transforms import in_working_dtype

# safetensors dtype names and the numpy dtypes zerojax reads them as
FILE_DTYPES = {name: np.dtype(t) for name, t in (("BF16", jnp.bfloat16), ("BOOL", np.bool_))} | {
    f"{k[0].upper()}{bits}": np.dtype(f"{k}{bits}")
    for k in ("float", "int", "uint")
    for bits in (8, 16, 32, 64)
    if k != "float" or bits > 8
}


def read_header(path: str) -> tuple[dict, int]:
    """({tensor name: {dtype, shape, data_offsets}}, offset where the data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ZeroError(
                f"{path} is not a safetensors file (shorter than its 8-byte header length)."
            )
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ZeroError(f"{path}: the safetensors header is not valid JSON ({e}).") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _tensor(path: str, header: dict, start: int, name: str) -> np.ndarray:
    """Tensor `name` of the file as a read-only memory map (nothing is read yet)."""
    entry = header[name]
    if entry["dtype"] not in FILE_DTYPES:
        raise ZeroError(
            f"{path}: tensor {name} has dtype {entry['dtype']}, which zerojax does "
            f"not read (it reads {', '.join(FILE_DTYPES)})."
        )
    begin, _ = entry["data_offsets"]
    return np.memmap(
        path,
        dtype=FILE_DTYPES[entry["dtype"]],
        mode="r",
        offset=start + begin,
        shape=tuple(entry["shape"]),
    )


def _field(tree, name):
    return tree[name] if isinstance(tree, dict) else getattr(tree, name)


def load_safetensors(
    zero,
    state,
    path: str,
    *,
    names: Callable[[str], str] | None = None,
    transpose: Callable[[str], bool] | None = None,
):
    """`state` (from `zero.init` or `zero.eval_shape`) with its parameters (and fp32 master
    weights, if any) read from the safetensors file at `path`, each device reading its slice."""
    if not hasattr(state, "replace") and not isinstance(state, dict):
        raise ZeroError(
            f"load_safetensors fills a TrainState, a dataclass with `replace` or a "
            f"dict with `params`; got {type(state).__name__}."
        )
    header, start = read_header(path)
    names = names or (lambda p: p.replace("/", "."))
    transpose = transpose or (lambda p: False)
    shardings = zero.state_shardings(state)
    params = state["params"] if isinstance(state, dict) else state.params
    opt_state = state.get("opt_state") if isinstance(state, dict) else state.opt_state
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    missing = [names(path_str(p)) for p, _ in flat if names(path_str(p)) not in header]
    if missing:
        raise ZeroError(
            f"{path} has no tensor named {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''} (file keys: "
            f"{', '.join(sorted(header)[:5])}, ...): pass names= mapping "
            "parameter paths to the file's keys."
        )

    def load(p, leaf, sharding):
        key, flip = names(path_str(p)), transpose(path_str(p))
        data = _tensor(path, header, start, key)
        want = tuple(reversed(leaf.shape)) if flip else tuple(leaf.shape)
        if data.shape != want:
            raise ZeroError(
                f"tensor {key} in {path} has shape {data.shape}; parameter "
                f"{path_str(p)} needs {tuple(leaf.shape)}" + (" (transposed)" if flip else "") + "."
            )

        def read(index):  # one device's slice, read from the map and converted alone
            part = data[tuple(reversed(index))].T if flip else data[index]
            return np.asarray(part).astype(leaf.dtype)

        return jax.make_array_from_callback(tuple(leaf.shape), sharding, read)

    master = opt_state.master if isinstance(opt_state, ZeroOptState) else None
    master = master if master is not None and present(master) else None
    targets = shardings.opt_state.master if master is not None else _field(shardings, "params")
    loaded = jax.tree_util.tree_map_with_path(load, params if master is None else master, targets)
    if master is None:
        return (
            {**state, "params": loaded} if isinstance(state, dict) else state.replace(params=loaded)
        )
    params = jax.jit(
        lambda m: in_working_dtype(m, zero.placement.update.param_dtype),
        out_shardings=shardings.params,
    )(loaded)
    return state.replace(params=params, opt_state=state.opt_state._replace(master=loaded))
