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

from zerojax.core.config import ZeroConfig
from zerojax.core.errors import ZeroError
from zerojax.core.policy import UpdatePolicy
from zerojax.flax.nnx import NnxLayout, is_nnx_object
from zerojax.flax.nnx_managed import manage_objects
from zerojax.update.managed import prepare_state


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
        pytree state's Linen boxes and shardings are read by the API's `zero.layout`)."""
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


def managed(user: Boundary, tree, policy: UpdatePolicy, axis_size: int) -> Boundary:
    """The boundary of the state `user` rebuilds from `tree`, as `policy` trains it: with
    precision, accumulation or clipping on, 16-bit params with master weights and buffers
    (`managed.prepare_state`; NNX objects: `flax.nnx_managed`). Run it under a trace."""
    if not policy.manages:
        return dataclasses.replace(user, tree=tree)
    if user.objects is None:
        return Boundary(prepare_state(tree, policy, axis_size), user.rebuild)
    objs = user.rebuild(tree)  # new objects, managed in place
    manage_objects(objs if isinstance(objs, tuple) else (objs,), policy, axis_size)
    return boundary(objs)


@dataclasses.dataclass(frozen=True)
class StepCall:
    """A step call taken apart: the state's boundary (NNX objects: all of them, wherever they
    stood, as `nnx.jit` takes them), the batch, the other arguments in order (`extra`), and
    where each stood, so that the step runs on its arguments in the user's order."""

    state: Boundary
    batch: Any
    extra: tuple
    objects: tuple  # the user's NNX objects (updated in place after the step), or (state,)
    order: tuple  # (the objects' positions, the batch's): part of the compile key


def in_order(fn, order: tuple):
    """`fn`, the user's step, as `g(objs, batch, *extra)`: the state's objects (a tuple: the
    NNX objects, or the one pytree state), the batch and the other traced arguments put back
    in the order of the user's call, with its static arguments (`StepCall.order`)."""
    objects_at, batch_at, static = order
    fixed = dict(static)

    def ordered(objs: tuple, batch, *extra):
        placed = {**dict(zip(objects_at, objs, strict=True)), batch_at: batch, **fixed}
        rest = iter(extra)  # the traced arguments fill the positions left, in order
        count = len(placed) + len(extra)
        return fn(*(placed[i] if i in placed else next(rest) for i in range(count)))

    return ordered


def split_call(
    args: tuple, batch_argnum: int | None = None, static_argnums: tuple = ()
) -> StepCall:
    """A step call taken apart: `step(state, batch, *extra)` for a pytree state; for NNX
    objects, every top-level argument that is one (or a tuple of them, taken as its items) is
    the state, and the batch is the first other argument (`step(model, optimizer, rngs, batch,
    metrics, pad_id)`, Flax's NNX gemma example), or the one at `batch_argnum`. The arguments
    at `static_argnums` are static, as `jax.jit`'s: part of the compile key, never traced."""
    if _is_objects(args[0] if args else None):  # a tuple of objects stands for its items
        splat = lambda a: a if _is_objects(a) and isinstance(a, tuple) else (a,)
        args = tuple(x for a in args for x in splat(a))
    at = tuple(i for i, a in enumerate(args) if _is_objects(a))
    if not at or at[0] != 0:  # a pytree state, first
        if at:
            raise ZeroError(
                f"the step's argument {at[0]} is an NNX {type(args[at[0]]).__name__} but its "
                f"first is a {type(args[0]).__name__}: a step takes either a pytree train "
                "state first (step(state, batch, *extra)) or NNX objects (step(model, "
                "optimizer, ..., batch, ...)), not both."
            )
        if len(args) < 2:
            raise ZeroError("a zerojax step is called as step(state, batch, *extra).")
        at = (0,)
    static = _static(args, static_argnums, at)
    rest = [i for i in range(len(args)) if i not in at and i not in dict(static)]
    if not rest:
        raise ZeroError(
            "a zerojax step is called as step(state, batch, ...) or step(model, optimizer, "
            "..., batch, ...): no argument but the state and static ones, so no batch."
        )
    batch_at = rest[0] if batch_argnum is None else batch_argnum
    if batch_at not in rest:
        raise ZeroError(
            f"batch_argnum={batch_argnum} names no batch among this call's {len(args)} "
            f"arguments (the state or NNX objects are at {list(at)}, static ones at "
            f"{[i for i, _ in static]}): give the position of the argument whose arrays have "
            "the global batch's leading dimension."
        )
    extra = tuple(args[i] for i in rest if i != batch_at)
    _check_no_objects_inside((args[batch_at], extra))
    objs = tuple(args[i] for i in at)
    state = boundary(objs if len(objs) > 1 else objs[0])
    return StepCall(state, args[batch_at], extra, objs, (at, batch_at, static))


def _static(args: tuple, static_argnums: tuple, at: tuple) -> tuple:
    """((position, value), ...) of the static arguments, each checked hashable (the compile
    key holds them, as jax.jit's does)."""
    out = []
    for i in static_argnums:
        if i in at or not 0 <= i < len(args):
            raise ZeroError(
                f"static_argnums names argument {i}, which this call of {len(args)} arguments "
                "has not, or which is the state: name the positions of the step's Python "
                "values (a config, a learning-rate function)."
            )
        try:
            hash(args[i])
        except TypeError:
            raise ZeroError(
                f"static argument {i} (a {type(args[i]).__name__}) is not hashable, and a "
                "static argument is part of the compile key: make it hashable (a frozen "
                "dataclass, a tuple), or pass it as a traced argument."
            ) from None
        out.append((i, args[i]))
    return tuple(out)


def _check_no_objects_inside(rest) -> None:
    """An NNX object inside the batch or another argument's pytree would be changed on a copy
    inside the compiled step and its changes lost: refused, with where it goes."""
    found = [x for x in jax.tree_util.tree_leaves(rest, is_leaf=is_nnx_object) if is_nnx_object(x)]
    if found:
        names = ", ".join(type(x).__name__ for x in found)
        raise ZeroError(
            f"an NNX object ({names}) is passed inside the batch or another argument's "
            "pytree, where a zerojax step would update a copy and drop its changes: pass "
            "each NNX object as an argument of its own, e.g. step(model, optimizer, metrics, "
            "batch)."
        )
