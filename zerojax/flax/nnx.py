"""Flax NNX: a model and an `nnx.Optimizer` trained by the same `zero_shard`.

NNX objects are mutable Python graphs; zerojax's rules work on pytrees. `NnxLayout` turns the
objects a user passes into one dict state, `{'params': the nnx.Param variables, 'opt_state':
the optimizer's variables, 'other': the rest (RNG streams, batch statistics)}`, which the rules
place like any train state, and merges such a state back into objects inside the jitted step,
as `nnx.jit` does; `ZeroStep` runs `fn(model, optimizer, batch, *extra)` that way and updates
the caller's objects in place. Sharding metadata on NNX variables
(`nnx.with_partitioning`) becomes the parameters' tensor-parallel layout, as Linen's boxes do.
`zerojax.engine.state` decides which states are NNX objects.
"""

from __future__ import annotations

import jax
from flax import nnx

from zerojax.core.rules import path_str
from zerojax.flax.annotations import tensor_specs_of

FIELDS = ("params", "opt_state", "other")


def is_nnx_object(x) -> bool:
    """Whether `x` is an NNX object (a module, an optimizer, a graph of them): what
    `zerojax.engine.state`, the one place that asks, tells apart from a pytree state."""
    return isinstance(x, nnx.Pytree)


def nnx_building():
    """The context `zero.init` builds models in: variables keep their sharding metadata but
    are not sharded eagerly (zerojax places the whole state afterwards)."""
    return nnx.use_eager_sharding(False)


class NnxLayout:
    """How one tuple of NNX objects maps to zerojax's dict state and back."""

    def __init__(self, objs: tuple):
        self.graphdef, *states = nnx.split(objs, nnx.Param, nnx.OptState, ...)
        self.templates = [jax.tree_util.tree_map(_abstract, s) for s in states]
        # when one object holds a whole field (the usual model + optimizer), its index is
        # dropped, so optimizer paths end with their parameter's path ('mu/layer/kernel')
        self.heads = [_single_key(s) for s in states]
        self.state = self._pure(states)  # the objects' dict state as they are now
        # per object, the key its parameters sit under in state['params'] ('' when dropped)
        self.prefixes = tuple("" if self.heads[0] == i else str(i) for i in range(len(objs)))

    def to_state(self, objs: tuple) -> dict:
        """The dict state of `objs` (objects of this layout, e.g. after a traced step)."""
        return self._pure(nnx.split(objs, nnx.Param, nnx.OptState, ...)[1:])

    def _pure(self, states) -> dict:
        return {
            field: _strip(nnx.to_pure_dict(state), head)
            for field, state, head in zip(FIELDS, states, self.heads, strict=True)
        }

    def _states(self, state: dict) -> list:
        out = []
        for field, template, head in zip(FIELDS, self.templates, self.heads, strict=True):
            fresh = jax.tree_util.tree_map(lambda x: x, template)  # new Variables
            pure = state[field] if head is None else {head: state[field]}
            if pure:
                nnx.replace_by_pure_dict(fresh, pure)
            out.append(fresh)
        return out

    def merge(self, state: dict) -> tuple:
        return nnx.merge(self.graphdef, *self._states(state))

    def update(self, objs: tuple, state: dict):
        """Write `state`'s arrays into the caller's objects (after a step)."""
        nnx.update(objs, *self._states(state))

    def tensor_specs(self, mesh, cfg) -> dict:
        """{parameter path: TensorSpec} from the variables' sharding metadata."""
        specs = nnx.to_pure_dict(nnx.get_partition_spec(self.templates[0]))
        specs = _strip(specs, self.heads[0])
        shapes = _strip(nnx.to_pure_dict(self.templates[0]), self.heads[0])
        declared = [
            (path_str(path), tuple(spec), shape.shape, ())
            for (path, spec), shape in zip(
                jax.tree_util.tree_flatten_with_path(
                    specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
                )[0],
                jax.tree_util.tree_leaves(shapes),
                strict=True,
            )
            if any(e is not None for e in spec)
        ]
        return tensor_specs_of(declared, mesh, cfg)


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def _single_key(state):
    keys = list(state.keys()) if hasattr(state, "keys") else []
    return keys[0] if len(keys) == 1 else None


def _strip(pure: dict, head):
    return pure if head is None else pure.get(head, {})


class _Passed:
    """Where an NNX object stood in a model call's arguments: it travels as its state through
    the per-device hook (`flax.model_calls.nnx_calls_hooked`) or into a stage-3 unit
    (`flax.nnx_calls`), and is merged again on the other side."""

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
