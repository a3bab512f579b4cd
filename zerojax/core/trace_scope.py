"""What a zerojax step being traced hands down to the code that Flax and optax call back.

zerojax runs inside the user's step: Flax calls its method interceptor, an NNX model calls
its routed methods, `apply_gradients` calls `ZeroTx.update`. Those callbacks take no extra
argument, so what they need from the step travels in one immutable `Scope`, the one context
variable of zerojax: each field is set for the extent of a `with scoped(...)` block (nested
blocks see the innermost value) and read with `current()`. Nothing else in zerojax keeps
state between or during traces. Only `discovery` is written into: the dict in which the one
abstract trace that finds units records each module call (`flax.units.discovering`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from jax._src import config as jax_config  # the trace-context option, see fresh_traces


@dataclasses.dataclass(frozen=True)
class Scope:
    """The step's values seen by the callbacks of the code it traces."""

    said: set | None = None  # warnings a zero has given (`errors.once_per`)
    update: Callable | None = None  # ZeroTx.update's managed update (`managed.updating`)
    running_model: bool = False  # the per-device model is traced: its calls are not hooked
    gather: Any = None  # the stage-3 GatherContext of the per-device model (`flax.unit_calls`)
    inside_unit: bool = False  # a unit's own modules run, on its gathered weights
    discovery: dict | None = None  # {path: ModuleCall} recorded while units are found
    nnx_handler: Callable | None = None  # where an NNX root's calls go (`flax.nnx_calls`)
    nnx_dims: dict | None = None  # {NNX module path: its parameters' dims as stored}


OUTSIDE = Scope()  # outside any zerojax step
# the default is frozen: never mutated, only replaced by `scoped`
_SCOPE: contextvars.ContextVar[Scope] = contextvars.ContextVar("zerojax_scope", default=OUTSIDE)  # noqa: B039


def current() -> Scope:
    """The scope in force (all defaults outside a zerojax step)."""
    return _SCOPE.get()


@contextlib.contextmanager
def scoped(**changes):
    """Inside, `current()` is the enclosing scope with `changes`."""
    token = _SCOPE.set(dataclasses.replace(_SCOPE.get(), **changes))
    try:
        yield
    finally:
        _SCOPE.reset(token)


_TRACES = itertools.count()
# an option of JAX's "trace context", the configuration its trace caches are keyed on, that only
# names source files in lowered HLO (never lowered in here): set to patterns matching nothing
_TRACE_KEY = jax_config.hlo_source_file_canonicalization_regex


def _new_key() -> str:
    return f"(?!)zerojax-{next(_TRACES)}"


@contextlib.contextmanager
def fresh_traces():
    """Inside, a `jax.jit` that model code calls (Flax's `nn.jit`: gemma 4 wraps its
    Transformer's `__call__`) traces its function again instead of reusing a trace cached
    outside, so zerojax sees the module calls in it (the model hooked, its units found and
    gathered); `retrace_from_here` renews that inside. Leaving restores JAX's setting."""
    with _TRACE_KEY(_new_key()):
        yield


def retrace_from_here() -> None:
    """Until the enclosing `fresh_traces` ends, a jit called from here on traces again rather
    than reuse a trace made before: `nn.jit` blocks of one shape share a trace, in which
    zerojax would see only the first block's module calls. Called at the model's call and at
    each lifted-transform body (`flax.units.intercept`); a jit's cache is looked up before its
    module calls run, so the key cannot be scoped to the call, only renewed."""
    _TRACE_KEY.set_local(_new_key())
