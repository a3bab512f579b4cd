"""Flax NNX: a model and an `nnx.Optimizer` trained by the same `zero_shard`.

NNX objects are mutable Python graphs; zerojax's rules work on pytrees. `NnxLayout` turns the
objects a user passes into one dict state, `{'params': the nnx.Param variables, 'opt_state':
the optimizer's variables, 'other': the rest (RNG streams, batch statistics)}`, which the rules
place like any train state, and merges such a state back into objects inside the jitted step,
as `nnx.jit` does. `NnxStep` runs `fn(model, optimizer, batch, *extra)` that way and updates
the caller's objects in place. Sharding metadata on NNX variables (`nnx.with_partitioning`)
becomes the parameters' tensor-parallel layout, as Linen's boxes do.
"""

from __future__ import annotations

import functools
import warnings

import jax
from flax import nnx

from zerojax.config import ZeroError
from zerojax.errors import ZeroWarning
from zerojax.flax.annotations import tensor_spec
from zerojax.offload import to_device, to_storage
from zerojax.rules import check_placed, path_str

FIELDS = ("params", "opt_state", "other")
NNX_UNMANAGED = (
    "with NNX objects zerojax does not manage the update: keep precision='fp32' (give the "
    "model a bf16 dtype for 16-bit compute), and put clipping and accumulation in the optax "
    "chain (optax.clip_by_global_norm, optax.MultiSteps)."
)


def nnx_building():
    """The context `zero.init` builds models in: variables keep their sharding metadata but
    are not sharded eagerly (zerojax places the whole state afterwards)."""
    return nnx.use_eager_sharding(False)


def is_nnx(x) -> bool:
    """Whether `x` (or, for a tuple, its first item) is an NNX module, optimizer or graph."""
    if isinstance(x, tuple) and x:
        x = x[0]
    return isinstance(x, nnx.Pytree)


class NnxLayout:
    """How one tuple of NNX objects maps to zerojax's dict state and back."""

    def __init__(self, objs: tuple):
        self.graphdef, *states = nnx.split(objs, nnx.Param, nnx.OptState, ...)
        self.templates = [jax.tree_util.tree_map(_abstract, s) for s in states]
        # when one object holds a whole field (the usual model + optimizer), its index is
        # dropped, so optimizer paths end with their parameter's path ('mu/layer/kernel')
        self.heads = [_single_key(s) for s in states]
        self.state = self._pure(states)  # the objects' dict state as they are now

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
        out = {}
        for (path, spec), shape in zip(
            jax.tree_util.tree_flatten_with_path(
                specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
            )[0],
            jax.tree_util.tree_leaves(shapes),
            strict=True,
        ):
            if any(e is not None for e in spec):
                out[path_str(path)] = tensor_spec(
                    tuple(spec), shape.shape, mesh, cfg, path_str(path)
                )
        return out


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x


def _single_key(state):
    keys = list(state.keys()) if hasattr(state, "keys") else []
    return keys[0] if len(keys) == 1 else None


def _strip(pure: dict, head):
    return pure if head is None else pure.get(head, {})


def as_objects(out):
    """`init_fn`'s result as a tuple of objects, and a function giving it back in its shape."""
    if isinstance(out, tuple):
        return out, lambda objs: objs
    return (out,), lambda objs: objs[0]


def nnx_state(out) -> dict:
    """The dict state of NNX objects (one, or a tuple), as zerojax's rules see it."""
    return NnxLayout(as_objects(out)[0]).state


def split_args(args: tuple) -> tuple:
    """(objects, batch, extra) of a call `step(model, optimizer, ..., batch, *extra)`."""
    count = next((i for i, a in enumerate(args) if not is_nnx(a)), len(args))
    if count == len(args):
        raise ZeroError(
            "an NNX zerojax step is called as step(model, optimizer, ..., batch, "
            "*extra): no batch came after the NNX objects."
        )
    return args[:count], args[count], args[count + 1 :]


class NnxStep:
    """`fn(*objects, batch, *extra)` jitted with the objects' state placed by `zero`'s rules;
    the objects are updated in place and `fn`'s return value is returned."""

    def __init__(self, zero, fn):
        self.zero, self.fn = zero, fn
        self._jitted = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        objs, batch, extra = split_args(args)
        jitted, shardings, layout, batch = self._prepare(objs, batch, extra)
        check_placed(layout.state, shardings)
        new_state, out = jitted(layout.state, batch, *extra)
        layout.update(objs, new_state)
        return out

    def lower(self, *args):
        objs, batch, extra = split_args(args)
        jitted, _, layout, batch = self._prepare(objs, batch, extra)
        return jitted.lower(layout.state, batch, *extra)

    def _prepare(self, objs, batch, extra):
        """(jitted step, state shardings, the objects' layout, placed batch), compiled once
        per structure and shapes."""
        cfg = self.zero.config
        if cfg.manages_update:
            raise ZeroError(NNX_UNMANAGED)
        batch = self.zero.place_batch(batch)
        layout = NnxLayout(objs)
        key = (
            jax.tree_util.tree_structure((layout.state, batch, extra)),
            layout.graphdef,
            tuple(
                getattr(x, "shape", ()) for x in jax.tree_util.tree_leaves((layout.state, batch))
            ),
        )
        if key not in self._jitted:
            shardings = self.zero.state_shardings(layout.state)
            if cfg.explicit_collectives and cfg.stage >= 2 and not self._jitted:
                warnings.warn(
                    "zerojax: NNX steps leave every collective to XLA's partitioner (the "
                    "per-device apply_fn hook and gather_on_use are Linen's): the state is "
                    f"stored as stage {cfg.stage} says, but on CPU gradients are all-reduced, "
                    "not reduce-scattered.",
                    category=ZeroWarning,
                    stacklevel=4,
                )

            def traced(state, batch, *extra):
                state = to_device(jax.lax.with_sharding_constraint(state, shardings), shardings)
                objs = layout.merge(state)
                out = self.fn(*objs, batch, *extra)
                return to_storage(layout.to_state(objs), shardings), out

            self._jitted[key] = (
                jax.jit(traced, donate_argnums=(0,) if cfg.donate else ()),
                shardings,
            )
        return (*self._jitted[key], layout, batch)
