"""NNX module calls routed onto zerojax's explicit path, with no change to the model's code.

Linen has a method interceptor; NNX has none. So inside a zerojax step each module object of
the step's freshly merged copy of the user's objects gets a subclass of its own class, made
once per (class, path), whose `__call__` and other public methods route the call.
`nnx.split` and `nnx.merge` carry a node's type, so the copies that `nnx.value_and_grad`,
`nnx.scan` or the per-device model make keep it. A routed `__call__` of an object the user
passed (a root) goes to the handler `zerojax.engine.hook` installs (the per-device hook); any other
module call is recorded while units are found, and run as a gathered stage-3 unit when it is
one (`flax.units.dispatch`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import jax
from flax import nnx

from zerojax.core.trace_scope import current, scoped
from zerojax.flax.nnx import objects_in, objects_out
from zerojax.flax.unit_calls import run_unit
from zerojax.flax.units import (
    UNIT_MARK,
    ModuleCall,
    dispatch,
    in_loop_body,
    is_public_method,
    leaf_ndims,
)


@functools.cache  # one routed subclass per (class, path, root?): a model traced again reuses it
def _routed_class(cls, path: str, root: bool):
    routed = type(
        cls.__name__,
        (cls,),
        {
            **{name: _routed_method(name) for name in _methods(cls)},
            "_zerojax_class": cls,
            "_zerojax_path": path,
            "_zerojax_root": root,
        },
    )
    routed.__qualname__, routed.__module__ = cls.__qualname__, cls.__module__
    return routed


def _methods(cls) -> list[str]:
    """The methods of an NNX module class routed: `__call__` and every public method its
    classes below nnx.Module define (`Embed.attend`, a user's `encode`)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in nnx.Module.__mro__:
            continue
        names |= {
            name
            for name, value in vars(klass).items()
            if is_public_method(name) and inspect.isfunction(value)
        }
    return sorted(names)


def _routed_method(name: str):
    """The routed `name` method: a root's `__call__` goes to the step's handler (the
    per-device hook); any other call is recorded while units are found and runs as a
    gathered stage-3 unit when its module is one (`flax.units.dispatch`)."""

    def method(self, *args, **kwargs):
        sub = type(self)
        cls, path = sub._zerojax_class, sub._zerojax_path
        original = lambda m, *a, **k: getattr(cls, name)(m, *a, **k)
        handler = current().nnx_handler
        if name == "__call__" and sub._zerojax_root and handler is not None:
            return handler(self, original, path, args, kwargs)
        return dispatch(
            path,
            lambda: _record(self, path),
            lambda: _run_unit(self, path, original, args, kwargs),
            lambda: original(self, *args, **kwargs),
        )

    method.__name__ = name
    return method


def _path(prefix: str, path: tuple) -> str:
    return "/".join(str(k) for k in ((prefix,) if prefix else ()) + tuple(path))


@contextlib.contextmanager
def routed(objs: tuple, prefixes: tuple, handler):
    """Inside, the modules of `objs` (objects this step merged; `prefixes[i]`, the keys their
    parameters sit under in the zerojax state) route their calls, the roots' to `handler`."""
    dims = {}
    for obj, prefix in zip(objs, prefixes, strict=True):
        for path, node in nnx.iter_graph(obj):
            cls = type(node)
            if isinstance(node, nnx.Module) and not hasattr(cls, "_zerojax_class"):
                # (a class is hashable; mypy's stubs for functools.cache say otherwise)
                sub = _routed_class(cls, _path(prefix, path), root=not path)  # type: ignore[arg-type]
                object.__setattr__(node, "__class__", sub)
                dims[sub._zerojax_path] = _param_dims(node)
    # the roots' calls go to `handler`; a scanned stack's parameters have one more dim as
    # stored than the slice `nnx.scan` calls
    with scoped(nnx_handler=handler, nnx_dims=dims):
        yield


def _param_dims(module) -> int:
    return sum(x.ndim for x in jax.tree_util.tree_leaves(nnx.state(module, nnx.Param)))


def split_params(module):
    """(graphdef, the module's nnx.Param state, the rest of its state)."""
    return nnx.split(module, nnx.Param, ...)


def with_params(params_state, pure: dict):
    """A copy of the nnx.Param state `params_state` holding the arrays of the pure dict `pure`."""
    fresh = jax.tree_util.tree_map(lambda x: x, params_state)
    nnx.replace_by_pure_dict(fresh, pure)
    return fresh


def _record(module, path: str) -> ModuleCall:
    _, params, _ = split_params(module)
    return ModuleCall(
        path,
        type(module)._zerojax_class.__name__,
        lifted=_param_dims(module) < (current().nnx_dims or {}).get(path, 0),  # nnx.scan's slice
        marked=bool(getattr(type(module), UNIT_MARK, False)),
        has_params=bool(jax.tree_util.tree_leaves(params)),
        param_ndims=leaf_ndims(nnx.to_pure_dict(params)),
        in_loop=in_loop_body(),
    )


def _run_unit(module, path: str, original, args, kwargs):
    """The NNX `module`'s call as a stage-3 unit: it reads its other NNX state (RNG streams,
    batch statistics) as they are and writes back what the call changed. NNX objects passed to
    the call (an `nnx.Rngs` given at call time, as Flax's NNX gemma example gives each block)
    enter as their state, so that the unit's forward and backward draw the same keys, and
    advance as they would have in a plain call."""
    graphdef, params, rest = split_params(module)
    (args, kwargs), passed = objects_out((args, kwargs))
    splits = [nnx.split(obj) for obj in passed]

    def apply(pure, extra, a, k):
        rest, states = jax.tree_util.tree_map(lambda x: x, extra)  # this trace's Variables
        before = {path: var.get_value() for path, var in nnx.to_flat_state(rest)}
        copy = nnx.merge(graphdef, with_params(params, pure), rest)
        given = [nnx.merge(g, s) for (g, _), s in zip(splits, states, strict=True)]
        a, k = objects_in((a, k), given)
        out = original(copy, *a, **k)
        # only what the call changed is written back: a frozen BatchNorm's statistics (read
        # only) live outside this trace, where they cannot be written
        after = nnx.to_flat_state(nnx.state(copy, nnx.Not(nnx.Param)))
        changed = [(p, v) for p, v in after if p not in before or v.get_value() is not before[p]]
        return out, (nnx.from_flat_state(changed), [nnx.state(o) for o in given])

    extra = (rest, [state for _, state in splits])
    out, (written, states) = run_unit(path, nnx.to_pure_dict(params), apply, extra, (args, kwargs))
    nnx.update(module, written)
    for obj, state in zip(passed, states, strict=True):
        nnx.update(obj, state)
    return out
