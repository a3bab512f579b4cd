"""Which Linen modules stage 3 gathers as units, chosen from outside the model.

A unit's parameters rest as shards and are gathered only while it runs (`flax.unit_calls`). The
units are found by tracing the model once, abstractly, with a Flax method interceptor
(`nn.intercept_methods`) that records every module call: its path, class, whether it is the
body of a lifted transform (`nn.scan`, `nn.remat`) and what it reads. `ZeroConfig.units`
then picks them: regexes matched (whole) against module class names or paths, or 'auto', the
repeated blocks of the model (each body of a scanned stack, each module among two or more
same-class siblings), as FSDP2 users wrap each transformer block. Classes marked with
`gather_on_use` are units either way. A unit nested in another is part of the outer one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import sys
import types

import flax.linen as nn
import jax
import numpy as np
from flax.core.scope import Scope

from zerojax.core.errors import warn
from zerojax.core.trace_scope import current, fresh_traces, retrace_from_here, scoped
from zerojax.flax.unit_calls import (
    GatherContext,
    current_context,
    gather_context,
    gather_unit,
    inside_unit,
)

UNIT_MARK = "_zerojax_unit"


def gather_on_use(module_cls):
    """`module_cls` marked as a stage-3 unit from inside the model's code (the same as naming
    its class in `units`); outside a zerojax stage-3 step it is the module itself."""
    marked = type(module_cls.__name__, (module_cls,), {UNIT_MARK: True})
    marked.__qualname__ = module_cls.__qualname__
    return marked


@dataclasses.dataclass(frozen=True)
class ModuleCall:
    """One module call seen while tracing the model."""

    path: str  # 'layers' or 'blocks_0/mlp'
    cls: str
    lifted: bool  # the body of a lifted transform (nn.scan, nn.remat; `stacks_only` narrows it)
    marked: bool  # its class went through gather_on_use
    has_params: bool
    param_ndims: tuple = ()  # ((leaf path below the module, ndim seen by the call), ...)
    in_loop: bool = False  # traced inside a loop body (lax.scan, while_loop) of the model


def intercept(next_fun, args, kwargs, context):
    """The interceptor zerojax's per-device Linen model runs under (see `dispatch`): every
    public method of a module (`__call__`, `Embed.attend`, ...), so that any method called
    on a unit runs on its gathered weights."""
    module, method = context.module, context.method_name
    path = "/".join(module.path)
    if method == "setup" and current().discovery is None and _is_unit(path):
        return None  # on this device's shards it would fail; it runs on the gathered weights
    if isinstance(module.parent, Scope) and not inside_unit():
        # the model, or the body of a lifted transform (`nn.jit`): the next such block is
        # traced anew and its module calls seen (not a unit's own: a jit inside a unit may
        # reuse its traces, as jax.numpy's do)
        retrace_from_here()
    if not is_public_method(method) or module.is_initializing():
        return next_fun(*args, **kwargs)
    return dispatch(
        path,
        lambda: _record(module, path),
        lambda: gather_unit(module, context.orig_method.func, args, kwargs),
        lambda: next_fun(*args, **kwargs),
    )


def is_public_method(name: str) -> bool:
    """Whether calls of a module's method `name` are a module call zerojax sees: `__call__`
    and every public method but Flax's own set-up."""
    return name == "__call__" or not (name.startswith("_") or name == "setup")


def dispatch(path: str, record, run_unit, run):
    """One module call at `path` inside zerojax's per-device model: recorded (`record()` gives
    its ModuleCall) while units are being found, run as a gathered unit (`run_unit()`) when it
    is one of the step's units, else run as is (`run()`)."""
    found = current().discovery
    if found is not None:
        if path not in found:
            found[path] = record()
        elif not found[path].in_loop and in_loop_body():  # a lifted scan traces a call first
            found[path] = dataclasses.replace(found[path], in_loop=True)
        return run()
    return run_unit() if _is_unit(path) else run()


def _is_unit(path: str) -> bool:
    """Whether the module at `path` runs as a unit of the stage-3 step being traced."""
    ctx = current_context()
    return ctx is not None and path in ctx.units


def _record(module, path) -> ModuleCall:
    return ModuleCall(
        path,
        type(module).__name__,
        lifted=bool(module.path) and isinstance(module.parent, Scope),
        marked=bool(getattr(type(module), UNIT_MARK, False)),
        has_params=bool(module.variables.get("params")),
        param_ndims=leaf_ndims(module.variables.get("params", {})),
        in_loop=in_loop_body(),
    )


def in_loop_body() -> bool:
    """Whether the code being traced runs in the body of a JAX loop (`lax.scan`, `while_loop`,
    `fori_loop`: an `nn.scan` or `nn.RNN` of the model), read from the Python stack while the
    model is traced abstractly to find its units."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _LOOPS and code.co_filename.endswith(_LOOPS_FILE):
            return True
        frame = frame.f_back
    return False


_LOOPS = frozenset({"scan", "while_loop", "fori_loop"})
_LOOPS_FILE = os.path.join("lax", "control_flow", "loops.py")


def leaf_ndims(params) -> tuple:
    return tuple(
        ("/".join(str(getattr(k, "key", k)) for k in p), np.ndim(x))
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    )


@contextlib.contextmanager
def discovering():
    """Inside, a traced model's module calls are recorded in the dict it yields."""
    calls: dict = {}
    with scoped(discovery=calls), nn.intercept_methods(intercept), fresh_traces():
        yield calls


@contextlib.contextmanager
def running_units(ctx: GatherContext | None):
    """Inside, the per-device Linen model runs with `ctx` in force: each call on one of its
    units gathers the unit's weights (or, stages 1-2, reduces its gradient in place)."""
    with gather_context(ctx), nn.intercept_methods(intercept), fresh_traces():
        yield


def stacks_only(calls: dict, params) -> dict:
    """`calls` with `lifted` kept only for the bodies of a lifted transform that stacks their
    parameters (`nn.scan` or `nn.vmap` over 'params': the call sees fewer dims than `params`,
    the stored parameters, hold), and `in_loop` only for a call inside a loop body that sees
    its parameters whole (an `nn.RNN` cell, sst2's `nn.scan`-ned LSTM: the loop runs it once
    per time step on the same weights, so gathering it as a unit would gather them once per
    time step). An `nn.remat` block, which sees its parameters whole once, is a unit only by
    the other rules."""
    stored = dict(leaf_ndims(params))
    stacked = lambda call: bool(_sliced(call, stored))  # noqa: E731
    return {
        path: dataclasses.replace(
            call, lifted=call.lifted and stacked(call), in_loop=call.in_loop and not stacked(call)
        )
        for path, call in calls.items()
    }


def revealed_stacks(calls: dict, params) -> frozenset:
    """The parameter paths (below `params`) some call in `calls` sees with fewer dims than
    `params` stores them: a stack's layers lead them. The facts a step's calls give the layout
    of a state Flax's build did not describe (`StateLayout.stacks`)."""
    stored = dict(leaf_ndims(params))
    return frozenset(path for call in calls.values() for path in _sliced(call, stored))


def _sliced(call: ModuleCall, stored: dict) -> list:
    """The paths of the parameters `call` sees with fewer dims than `stored` holds."""
    prefix = f"{call.path}/" if call.path else ""
    paths = [(prefix + leaf, ndim) for leaf, ndim in call.param_ndims]
    return [path for path, ndim in paths if stored.get(path, ndim) > ndim]


def select_units(calls: dict, units) -> frozenset:
    """The paths of the units among `calls` ({path: ModuleCall}) by the `units` option."""
    candidates = {p: c for p, c in calls.items() if p and c.has_params}
    if units == "auto":
        parent = lambda p: p.rpartition("/")[0]
        siblings = collections.Counter((parent(p), c.cls) for p, c in candidates.items())
        chosen = [
            p
            for p, c in candidates.items()
            if c.marked or (not c.in_loop and (c.lifted or siblings[(parent(p), c.cls)] > 1))
        ]
    else:
        patterns = (units,) if isinstance(units, str) else tuple(units)
        matches = lambda x, p, c: bool(re.fullmatch(x, c.cls) or re.fullmatch(x, p))
        chosen = [
            p for p, c in candidates.items() if c.marked or any(matches(x, p, c) for x in patterns)
        ]
        unused = [x for x in patterns if not any(matches(x, p, c) for p, c in candidates.items())]
        if unused:
            seen = sorted({c.cls for c in candidates.values()})
            seen += sorted(p for p in candidates if p.count("/") <= 1)[:12]
            warn(
                f"zerojax: units {unused} match no module with parameters (patterns match a "
                f"whole class name or path; the model has {', '.join(seen)}, ...)."
            )
    return frozenset(p for p in chosen if not any(p.startswith(q + "/") for q in chosen))
