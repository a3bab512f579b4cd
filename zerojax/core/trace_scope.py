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
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Scope:
    """The step's values seen by the callbacks of the code it traces."""

    said: set | None = None  # warnings a zero has given (`errors.once_per`)
    update: Callable | None = None  # ZeroTx.update's managed update (`optim.updating`)
    running_model: bool = False  # the per-device model is traced: its calls are not hooked
    gather: Any = None  # the stage-3 GatherContext of the per-device model (`flax.gather`)
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
