"""The checks of a user's call, made before anything is traced: a step called on what is not
a state placed by its zero, with arguments its function cannot take, or inside another
transformation; `zero.init` given a state or arguments its function does not take. Each fails
with a ZeroError that says what to write instead (docs/errors.md)."""

from __future__ import annotations

import contextlib
import inspect
import re

import jax

from zerojax.core.errors import ZeroError
from zerojax.core.rules import PARAMS, category_of


def check_call(tree, batch, extra) -> None:
    """A step called inside another jax transformation, on something that is not a train
    state, or on a state zero did not place (made with TrainState.create, abstract, donated
    to an earlier call) fails here with what to do, not deep inside jax or with a crash."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((tree, batch, extra))):
        raise ZeroError(
            "this zerojax step was called inside another JAX transformation (jax.jit, vmap, "
            "grad, scan...): it is jitted already, with the state's shardings and donation. "
            "Call it directly, from Python; to inspect it use step.trace(...) / step.lower(...)."
        )
    if not any(category_of(path) == PARAMS for path, _ in leaves):
        keys = list(tree) if isinstance(tree, dict) else []
        raise ZeroError(
            f"the step's first argument is a {type(tree).__name__}"
            + (f" with keys {keys}" if keys else "")
            + " and holds no `params`: a zerojax step is called step(state, batch, *extra) "
            "with the train state zero.init / zero.shard returned first (NNX: step(model, "
            "optimizer, ..., batch))."
        )
    for path, leaf in leaves:
        where = f"state leaf {jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ZeroError(
                f"{where} is abstract (a ShapeDtypeStruct, e.g. from zero.eval_shape): there "
                "are no values to train. Allocate the state with zero.init(init_fn, key); to "
                "compile or size the step without allocating, use step.lower(state, batch) "
                "or zero.report(step, state, batch)."
            )
        if not isinstance(leaf, jax.Array):
            raise ZeroError(
                f"{where} is a {type(leaf).__name__}, not an array placed by this zero_shard "
                "(a state made with TrainState.create(...) directly?): create it with "
                "zero.init(init_fn, key), or place it with zero.shard(state)."
            )
        if leaf.is_deleted():
            raise ZeroError(
                f"{where} was donated to an earlier call of this step, which reused its "
                "memory for the state it returned (donate=True). Pass the state each call "
                "returns: `state, metrics = step(state, batch)`; to keep old states usable "
                "set donate=False (more memory)."
            )


def check_arity(fn, count: int, kinds: str) -> None:
    """`fn` must take the `count` arguments of this call (`kinds` describes them), else a
    ZeroError naming the two calling conventions rather than a TypeError from inside jit."""
    try:
        inspect.signature(fn).bind(*([None] * count))
    except ValueError:  # a builtin or C function: no signature to read
        return
    except TypeError as e:
        name = getattr(fn, "__name__", "the step")
        raise ZeroError(
            f"{name}{inspect.signature(fn)} cannot take this call's {count} arguments "
            f"({kinds}): {e}. A TrainState (or pytree) step is called step(state, batch, "
            "*extra); an NNX step step(model, optimizer, ..., batch, *extra), with the "
            "objects zero.init / zero.shard returned, and takes them as its arguments."
        ) from None


def check_init_fn(init_fn, args, kwargs) -> None:
    """`zero.init` takes the function that makes the state and its arguments: a state given
    instead, or arguments the function does not take, fail with what to write."""
    if not callable(init_fn):
        raise ZeroError(
            f"zero.init takes the function that creates the state (and its arguments, e.g. "
            f"a PRNG key), not a {type(init_fn).__name__}: to place an existing state use "
            "zero.shard(state); to create one use zero.init(lambda key: TrainState.create("
            "...), jax.random.key(0))."
        )
    try:
        signature = inspect.signature(init_fn)
    except ValueError:  # a builtin: no signature to read
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(init_fn, "__name__", "init_fn")
        raise ZeroError(
            f"zero.init calls {name}{signature} with the arguments given after it, and "
            f"{len(args)} positional and {len(kwargs)} keyword arguments do not fit: {e}. "
            "E.g. zero.init(init_fn, jax.random.key(0))."
        ) from None


@contextlib.contextmanager
def pmap_collectives_named(fn, mesh_axes: tuple):
    """A step or model written for `jax.pmap` (a `lax.pmean` over its axis name, as Flax's
    imagenet example's step; a layer given `axis_name=`, as its BatchNorm) fails with a
    ZeroError saying what to change, not jax's unbound-axis NameError or AssertionError."""
    try:
        yield
    except (NameError, AssertionError) as e:
        missing = _axes_not_in_mesh(e, mesh_axes)  # a layer that names its axis (BatchNorm)
        unbound = re.search(r"unbound axis name: (\S+?)\.", str(e))
        if missing:
            raise ZeroError(
                f"the model reduces over the axis {missing[0]!r}, which the mesh does not have: "
                "a layer given axis_name= for jax.pmap, as Flax's BatchNorm(axis_name='batch') "
                "in its imagenet example. The model runs once per device on zerojax's data "
                f"axis: name that axis after the layer's, zero_shard(..., axis={missing[0]!r}), "
                "and it reduces over all devices as under jax.pmap (or drop axis_name= to keep "
                "each device's own)."
            ) from None
        if unbound is None:
            raise
        raise ZeroError(
            f"{getattr(fn, '__name__', 'the step')} reduces over the axis {unbound[1]!r} "
            "(lax.pmean / lax.psum), as a step written for jax.pmap does. A zerojax step is "
            "one program over the global batch whose gradients zerojax reduces, as under "
            "jax.jit: remove the collective (its gradients and metrics are global already)."
        ) from None


def _axes_not_in_mesh(error: Exception, mesh_axes: tuple) -> list:
    """The axis names not in `mesh_axes` that the innermost frame naming an `axis_name` (a
    collective's caller: Flax's normalisation layers, a user's `lax.pmean(x, axis_name)`)
    passed, when jax failed under it (an unbound axis); empty when none does.
    JAX drops its own frames from the traceback, so the caller's are what is left to read."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        name = frame.f_locals.get("axis_name")
        names = (name,) if isinstance(name, str) else name
        if isinstance(names, tuple) and all(isinstance(n, str) for n in names):
            return [n for n in names if n not in mesh_axes]
    return []
