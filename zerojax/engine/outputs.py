"""What a user's train step returns, as zerojax reads it: the new state apart from the step's
other outputs, the managed update's metrics added to its metrics dict, and the returned state
pinned to its storage layout.
"""

from __future__ import annotations

import jax

from zerojax.comm.offload import to_storage
from zerojax.core.errors import ZeroError
from zerojax.update.managed import update_metrics


def one_capture(sink):
    """The gradients the step's one `apply_gradients` (NNX: `optimizer.update`) handed over."""
    if len(sink) != 1:
        raise ZeroError(
            "a zerojax step must call state.apply_gradients (NNX: optimizer.update) exactly "
            f"once (it was called {len(sink)} times)."
        )
    return sink[0]


def split_output(out, state):
    """(new state, the rest of the step's outputs as a tuple, or None if it returned a state)."""
    if _is_state(out, state):
        return out, None
    if isinstance(out, tuple) and out and _is_state(out[0], state):
        return out[0], tuple(out[1:])
    raise ZeroError(
        "a zerojax step must return the new state, or a tuple whose first item "
        f"is the new state ({type(state).__name__})."
    )


def same_structure(a, b) -> bool:
    """Whether two pytrees have the same structure."""
    return bool(jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b))  # type: ignore[operator]


def _is_state(x, state) -> bool:
    """Whether `x` is a new state for `state`: of its type, and for a plain tuple state
    `(params, opt_state)` also of its tree structure (a `(state, metrics)` pair is a tuple too)."""
    if type(x) is not type(state):
        return False
    if type(state) is tuple:
        return bool(jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(state))  # type: ignore[operator]
    return True


def with_metrics(new_state, rest):
    """Add the update's metrics to a metrics dict the step returned (keys it has win)."""
    if rest is None:
        return new_state
    if rest and isinstance(rest[0], dict):
        rest = ({**update_metrics(new_state.opt_state), **rest[0]}, *rest[1:])
    return (new_state, *rest)


def finish(out, state, shardings, cast: bool):
    """Pin the returned state (alone, or first of a tuple) to the storage shardings; with
    `cast`, new 16-bit params are laid out like their fp32 master first, so that stages 1-2
    all-gather them in 16 bits (XLA would otherwise gather the fp32 master and cast after)."""
    new, rest = split_output(out, state)
    if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(shardings):  # type: ignore[operator]
        raise ZeroError(
            "the state a zerojax step returns must have the structure of the state "
            f"it received ({type(state).__name__}); did the step add or drop fields?"
        )
    if cast:  # NNX objects: the same in traced.traced_objects
        master = shardings.opt_state.master
        new = new.replace(params=jax.lax.with_sharding_constraint(new.params, master))
    new = to_storage(new, shardings)
    return new if rest is None else (new, *rest)
