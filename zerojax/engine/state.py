"""The API boundary: every kind of train state a user passes, as the one pytree the engine sees.

A flax `TrainState`, a `struct` dataclass, a dict or a `(params, opt_state, ...)` tuple already
is that pytree: the rules find its parts by field, key or position (`rules.category_of`). NNX
objects (a model, an `nnx.Optimizer`, ..., alone or in a tuple) become the dict
`{params, opt_state, other}` (see zerojax.flax.nnx). `boundary(x)` gives the pytree and a
function that turns such a pytree back into `x`'s kind; past it, nothing asks which kind of
state it holds. This module is the only one that does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from zerojax.core.config import ZeroConfig, ZeroError
from zerojax.engine.optim import prepare_state
from zerojax.flax.nnx import NnxLayout, is_nnx_object
from zerojax.flax.nnx_managed import manage_objects


def _is_objects(x) -> bool:
    """Whether `x` (or, for a tuple, its first item) is an NNX module, optimizer or graph."""
    if isinstance(x, tuple) and x:
        x = x[0]
    return is_nnx_object(x)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """One user state at the boundary: `tree`, the pytree the engine works on, and
    `rebuild(tree)`, a state of the user's kind holding `tree`'s arrays. `objects` is the NNX
    layout when the user passed NNX objects (None for a pytree state)."""

    tree: Any
    rebuild: Callable[[Any], Any]
    objects: NnxLayout | None = None

    def tensor_specs(self, mesh, cfg: ZeroConfig) -> dict:
        """{parameter path: TensorSpec} the NNX variables' sharding metadata declares (a
        pytree state's Linen boxes and shardings are read by `ZeroShard`)."""
        if self.objects is None:
            return {}
        return self.objects.tensor_specs(mesh, cfg)


def boundary(x) -> Boundary:
    """The `Boundary` of a user state (concrete or abstract)."""
    if not _is_objects(x):
        return Boundary(x, lambda tree: tree)
    single = not isinstance(x, tuple)
    layout = NnxLayout((x,) if single else x)

    def rebuild(tree):
        objs = layout.merge(tree)
        return objs[0] if single else objs

    return Boundary(layout.state, rebuild, layout)


def managed(user: Boundary, tree, cfg: ZeroConfig, axis_size: int) -> Boundary:
    """The boundary of the state `user` rebuilds from `tree`, as `cfg` trains it: with
    precision, accumulation or clipping on, 16-bit params with master weights and buffers
    (`optim.prepare_state`; NNX objects: `flax.nnx_managed`). Run it under a trace."""
    if not cfg.manages_update:
        return dataclasses.replace(user, tree=tree)
    if user.objects is None:
        return Boundary(prepare_state(tree, cfg, axis_size), user.rebuild)
    objs = user.rebuild(tree)  # new objects, managed in place
    manage_objects(objs if isinstance(objs, tuple) else (objs,), cfg, axis_size)
    return boundary(objs)


def split_call(args: tuple) -> tuple[Boundary, Any, tuple]:
    """(the state's boundary, batch, extra) of a step call: `step(state, batch, *extra)` for a
    pytree state, `step(model, optimizer, ..., batch, *extra)` for NNX objects."""
    count = next((i for i, a in enumerate(args) if not _is_objects(a)), len(args))
    if count == 0:
        if len(args) < 2:
            raise ZeroError("a zerojax step is called as step(state, batch, *extra).")
        _check_no_objects_after(args[1:])
        return boundary(args[0]), args[1], args[2:]
    if count == len(args):
        raise ZeroError(
            "an NNX zerojax step is called as step(model, optimizer, ..., batch, "
            "*extra): no batch came after the NNX objects."
        )
    _check_no_objects_after(args[count:])
    objs = args[:count]
    return boundary(objs if count > 1 else objs[0]), args[count], args[count + 1 :]


def _check_no_objects_after(rest: tuple) -> None:
    """An NNX object in or after the batch would be changed on a copy inside the compiled
    step and its changes lost (`nnx.jit` keeps them): refused, with where it goes."""
    found = [x for x in jax.tree_util.tree_leaves(rest, is_leaf=is_nnx_object) if is_nnx_object(x)]
    if found:
        names = ", ".join(type(x).__name__ for x in found)
        raise ZeroError(
            f"an NNX object ({names}) is passed in or after the batch, where a zerojax step "
            "would update a copy and drop its changes: pass every NNX object before the "
            "batch, e.g. step(model, optimizer, metrics, batch)."
        )


class _Passed:
    """Where an NNX object stood in a model call's arguments (it travels as state through the
    per-device hook, `flax.model_calls.nnx_calls_hooked`)."""

    def __init__(self, index: int):
        self.index = index


def objects_out(tree):
    """(`tree` with each NNX object in it replaced by a `_Passed`, the objects)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_nnx_object)
    passed: list = []
    for i, x in enumerate(leaves):
        if is_nnx_object(x):
            leaves[i] = _Passed(len(passed))
            passed.append(x)
    return jax.tree_util.tree_unflatten(treedef, leaves), passed


def objects_in(tree, objects: list):
    """`tree` with each `_Passed` replaced by its object from `objects`."""
    return jax.tree_util.tree_map(
        lambda x: objects[x.index] if isinstance(x, _Passed) else x,
        tree,
        is_leaf=lambda x: isinstance(x, _Passed),
    )
