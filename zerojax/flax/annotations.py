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

from zerojax.core.config import ZeroConfig
from zerojax.core.errors import ZeroError
from zerojax.core.rules import PARAMS, TensorSpec, category_of, path_str, spec_entry, spec_names


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def read_linen_boxes(state, mesh, cfg: ZeroConfig):
    """(`state` with every Linen partitioning box removed, {parameter path: TensorSpec})."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_box)[0]
    if not any(_is_box(x) for _, x in flat):
        return state, {}
    declared = [
        (
            path_str(path[1:]),
            tuple(box.get_partition_spec()),
            box.unbox().shape,
            tuple(getattr(box, "rules", None) or ()),
        )
        for path, box in flat
        if _is_box(box) and category_of(path) == PARAMS
    ]
    return nn.meta.unbox(state), tensor_specs_of(declared, mesh, cfg)


def tensor_specs_of(declared: list, mesh, cfg: ZeroConfig) -> dict:
    """{path: TensorSpec} of the leaves `declared` as [(path, names, shape, rules)]. Logical
    names that neither the mesh nor any rule knows are named all at once, with a
    `logical_rules=` that works on this mesh."""
    known = {name for name, _ in (*cfg.logical_rules, *nn.get_logical_axis_rules())}
    missing: dict[str, str] = {}
    for path, names, _, rules in declared:
        for name in (one for entry in names for one in spec_names(entry)):
            if name not in mesh.shape and name not in known | {r[0] for r in rules}:
                missing.setdefault(name, path)
    if missing:
        listed = ", ".join(f"{n!r} ({p})" for n, p in missing.items())
        rules = tuple((n, None) for n in missing) + tuple(cfg.logical_rules)
        raise ZeroError(
            f"the model declares logical axes that are neither mesh axes "
            f"{tuple(mesh.axis_names)} nor in logical_rules: {listed}. Map each to a "
            f"tensor-parallel mesh axis or to None (replicated; ZeRO still shards it), e.g. "
            f"zero_shard(..., logical_rules={rules!r})."
        )
    return {
        path: tensor_spec(names, shape, mesh, cfg, path, r) for path, names, shape, r in declared
    }


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
    """The mesh axes a leaf's declared `names` (logical or mesh axes, one per dimension, each
    known: `tensor_specs_of` checks) map to, checked against the mesh, the ZeRO axes and the
    leaf's shape."""
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
            axis = one if one in sizes else rules[one]  # tensor_specs_of named any missing
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
