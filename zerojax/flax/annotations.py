"""Tensor-parallel layouts a Flax model declares, read into zerojax's rules.

A Linen model marks its parameters with `nn.with_logical_partitioning` (boxes named with
logical axes such as 'mlp') or `nn.with_partitioning` (mesh axes); an NNX model puts the same
names in its variables' sharding metadata. zerojax maps logical names to mesh axes with
`ZeroConfig.logical_rules` (or the rules of an enclosing `nn.logical_axis_rules` context) and
keeps one `TensorSpec` per parameter path; a state zerojax placed keeps its layout in its
shardings (`carried_tensor_specs`), so nothing has to remember it. `rules.split_spec` then adds
the ZeRO axis on a dimension the model left free.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import NamedSharding

from zerojax.core.config import ZeroConfig, ZeroError
from zerojax.core.rules import PARAMS, TensorSpec, category_of, path_str, spec_entry, spec_names


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def read_linen_boxes(state, mesh, cfg: ZeroConfig):
    """(`state` with every Linen partitioning box removed, {parameter path: TensorSpec})."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_box)[0]
    if not any(_is_box(x) for _, x in flat):
        return state, {}
    layouts = {}
    for path, box in flat:
        if _is_box(box) and category_of(path) == PARAMS:
            names = tuple(box.get_partition_spec())
            rules = tuple(getattr(box, "rules", None) or ())
            layouts[path_str(path[1:])] = tensor_spec(
                names, box.unbox().shape, mesh, cfg, path_str(path[1:]), rules
            )
    return nn.meta.unbox(state), layouts


def carried_tensor_specs(state, mesh, cfg: ZeroConfig) -> dict:
    """{parameter path: TensorSpec} of the tensor-parallel axes the parameters of a placed (or
    abstract, sharded) state already carry on `mesh`: their shardings without the ZeRO axes."""
    zero_axes, sizes, layouts = spec_names(cfg.axis), dict(mesh.shape), {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        sharding = getattr(leaf, "sharding", None)  # none on a tracer or numpy array
        if category_of(path) != PARAMS or not isinstance(sharding, NamedSharding):
            continue
        if sharding.mesh.axis_names != mesh.axis_names:
            continue
        entries = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
        axes = [tuple(a for a in spec_names(e) if a not in zero_axes) for e in entries]
        if any(axes):
            layouts[path_str(path[1:])] = TensorSpec(
                tuple(spec_entry(a) for a in axes),
                tuple(math.prod(sizes[n] for n in a) for a in axes),
            )
    return layouts


def tensor_spec(names, shape, mesh, cfg: ZeroConfig, path: str, extra_rules=()) -> TensorSpec:
    """The mesh axes a leaf's declared `names` (logical or mesh axes, one per dimension) map to,
    checked against the mesh, the ZeRO axes and the leaf's shape."""
    names = tuple(names) + (None,) * (len(shape) - len(names))
    rules: dict[str, Any] = {}
    for name, axis in (*cfg.logical_rules, *extra_rules, *nn.get_logical_axis_rules()):
        rules.setdefault(name, axis)
    zero_axes = set(cfg.axis) if isinstance(cfg.axis, tuple) else {cfg.axis}
    sizes = dict(mesh.shape)
    axes, divisors = [], []
    for dim, name in enumerate(names):
        resolved: list[str] = []
        for one in spec_names(name):
            axis = one if one in sizes else rules.get(one, KeyError)
            if axis is KeyError:
                raise ZeroError(
                    f"parameter {path} declares axis {one!r} on dim {dim}, which is neither a "
                    f"mesh axis {tuple(mesh.axis_names)} nor in logical_rules: add a rule such "
                    f"as ({one!r}, 'model') or ({one!r}, None)."
                )
            resolved += spec_names(axis)
        for axis in resolved:
            if axis in zero_axes:
                raise ZeroError(
                    f"parameter {path} puts dim {dim} on {axis!r}, the axis ZeRO shards over: "
                    "zerojax places that axis itself; map the logical name to None or to a "
                    "tensor-parallel axis."
                )
            if axis not in sizes:
                raise ZeroError(
                    f"parameter {path}: logical rule maps dim {dim} to {axis!r}, "
                    f"which is not an axis of the mesh {tuple(mesh.axis_names)}."
                )
        divisor = math.prod(sizes[a] for a in resolved)
        if shape[dim] % divisor:
            raise ZeroError(
                f"parameter {path} (shape {tuple(shape)}) splits dim {dim} over "
                f"{resolved} ({divisor} devices), which does not divide it."
            )
        axes.append(spec_entry(tuple(resolved)))
        divisors.append(divisor)
    return TensorSpec(tuple(axes), tuple(divisors))
