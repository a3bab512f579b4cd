"""Where a step's model calls are caught and sent through the per-device hook
(`zerojax.engine.hook.hooked_apply_fn`): a Linen model applied anywhere in the step (Flax's method
interceptor), and the calls on the batch of the NNX objects the step receives (routed calls,
`zerojax.flax.nnx_calls`). Calls that cannot run per device run as they are.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from flax.core.scope import Scope

from zerojax.core.call_plan import is_array, on_batch, with_values
from zerojax.core.errors import warn
from zerojax.core.rules import PARAMS
from zerojax.core.trace_scope import current, fresh_traces, scoped
from zerojax.flax.nnx import objects_in, objects_out
from zerojax.flax.nnx_calls import routed, split_params, with_params
from zerojax.flax.unit_calls import inside_unit


def apply_fn_hooked(apply_fn, hook, log):
    """`state.apply_fn` as a zerojax step sees it. A Linen module's bound `apply` goes to
    `hook` as it is. Anything else is called however the step calls it (Hugging
    Face's keyword-only `model.__call__(input_ids=..., params=...)`, a lambda, a bound method),
    the Flax model inside it caught where Flax applies it (`linen_calls_hooked`, in force for
    the step).
    An `apply_fn` in which no model call was caught (plain JAX, no Flax module) is run through
    `hook(apply_fn)`, whose first argument is the variables, as `TrainState.apply_fn`'s is;
    one that takes no positional argument runs as it is, in XLA's global view, with a
    warning. `log` (the step's `TraceLog`) counts the calls caught."""

    if _is_linen_apply(apply_fn):  # Linen's own signature: straight to the hook
        return hook(apply_fn)

    def apply(*args, **kwargs):
        before = len(log.calls)
        out = apply_fn(*args, **kwargs)
        if len(log.calls) > before:
            return out
        if args:  # traced once more: jit drops the unused first trace's work
            return hook(apply_fn)(*args, **kwargs)
        warn(
            "zerojax: state.apply_fn ran no Flax module that zerojax could run per device "
            "and takes no positional variables, so it ran as XLA partitions it, without "
            "zerojax's explicit collectives (stage-3 units, the gradient reduce-scatter). Apply "
            "a Flax model on the batch inside it, or pass the variables first."
        )
        return out

    return apply


def _is_linen_apply(fn) -> bool:
    """Whether `fn` is a Linen module's bound `apply`: called as `apply(variables, *args,
    mutable=..., capture_intermediates=...)`, the signature the hook reads (a partial may
    hold some of those keywords, so it goes the general way)."""
    return isinstance(getattr(fn, "__self__", None), nn.Module) and fn.__name__ == "apply"


@contextlib.contextmanager
def linen_calls_hooked(hook, batch_rows: set):
    """Inside, a Linen model applied anywhere in the step (`model.apply` on a module captured
    in a closure, not only `state.apply_fn`) runs through `hook(apply)`, the per-device
    `hooked_apply_fn`, when it can: a top-level call on the batch (an argument with its leading
    dimension), not initializing, its RNG streams plain keys. Collections it mutates are
    written back combined (`zerojax.comm.device_values`). A model whose `__call__` is jitted
    (gemma's `nn.jit`) is seen inside its jit, so the step's trace must not reuse that jit's
    trace from a run outside zerojax (`fresh_traces`), or the model would run unhooked."""

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if not _hookable(module, (args, kwargs), batch_rows):
            return next_fun(*args, **kwargs)
        scope = module.scope
        plain, method = module.clone(parent=None), context.method_name
        run = lambda variables, *a, **k: plain.apply(variables, *a, method=method, **k)
        extra = {"rngs": {name: rng.rng for name, rng in scope.rngs.items()}} if scope.rngs else {}
        if scope.mutable is not False:
            extra["mutable"] = scope.mutable
        out = hook(run)(dict(module.variables), *args, **extra, **kwargs)
        if scope.mutable is False:
            return out
        out, written = out
        for col, tree in written.items():
            for name, value in tree.items() if col != PARAMS else ():
                scope.put_variable(col, name, value)
        return out

    with nn.intercept_methods(intercept), fresh_traces():
        yield


@contextlib.contextmanager
def nnx_calls_hooked(hook, batch_rows: set, objs: tuple, prefixes: tuple):
    """Inside, a call on the batch of an NNX module the step received (`objs`, merged for this
    step; `prefixes`: the keys their parameters sit under in the state) runs through
    `hook(apply, stateful)`, the per-device `hooked_apply_fn`. A call that changes the module's
    other NNX state (RNG counts, batch statistics) is given that state and writes back what
    the devices' calls wrote, combined (`zerojax.comm.device_values`); so is a call given NNX
    objects as arguments (an `nnx.Rngs` passed at call time): each device draws its own keys
    from them and they advance as under `nnx.jit`."""

    def handle(module, call, prefix: str, args, kwargs):
        if current().running_model or inside_unit() or not _on_batch((args, kwargs), batch_rows):
            return call(module, *args, **kwargs)
        (args, kwargs), passed = objects_out((args, kwargs))
        graphdef, params, rest = split_params(module)
        stateful = bool(passed) or bool(_changes_state(graphdef, params, rest, call, args, kwargs))
        splits = [nnx.split(obj) for obj in passed]

        def apply(variables, *a, **k):
            pure = variables[PARAMS]
            for key in prefix.split("/") if prefix else ():
                pure = pure[key]
            copy = nnx.merge(graphdef, with_params(params, pure), variables.get(NNX_STATE, rest))
            states = variables[NNX_ARGS] if splits else []
            given = [nnx.merge(g, s) for (g, _), s in zip(splits, states, strict=True)]
            a, k = objects_in((a, k), given)
            out = call(copy, *a, **k)
            if not stateful:
                return out
            written = {NNX_STATE: nnx.state(copy, nnx.Not(nnx.Param))}
            return out, {**written, **({NNX_ARGS: [nnx.state(o) for o in given]} if given else {})}

        pure = nnx.to_pure_dict(params)
        for key in reversed(prefix.split("/") if prefix else ()):
            pure = {key: pure}
        variables = {PARAMS: pure, **({NNX_STATE: rest} if stateful else {})}
        if splits:
            variables[NNX_ARGS] = [state for _, state in splits]
        out = hook(apply, stateful)(variables, *args, **kwargs)
        if stateful:
            out, written = out
            nnx.update(module, written[NNX_STATE])
            for obj, state in zip(passed, written.get(NNX_ARGS, ()), strict=True):
                nnx.update(obj, state)
        return out

    with routed(objs, prefixes, handle):
        yield


NNX_STATE = "nnx_state"  # the key an NNX model's other state travels under through the hook
NNX_ARGS = "nnx_args"  # the key NNX objects passed to a call travel under through the hook


def _changes_state(graphdef, params, rest, call, args, kwargs) -> list:
    """The types of the NNX variables other than nnx.Param that calling the module split into
    (graphdef, params, rest) writes (found by one abstract trace of the call)."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [i for i, x in enumerate(flat) if is_array(x)]
    written: list = []

    def probe(params, rest, values):  # the Variables here are eval_shape's own copies
        a, k = with_values(flat, arrays, values, tree)
        before = {path: var.get_value() for path, var in nnx.to_flat_state(rest)}
        copy = nnx.merge(graphdef, params, rest)
        with scoped(running_model=True):
            call(copy, *a, **k)
        for path, var in nnx.to_flat_state(nnx.state(copy, nnx.Not(nnx.Param))):
            if path not in before or var.get_value() is not before[path]:
                written.append(type(var).__name__)

    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    jax.eval_shape(probe, params, rest, [shape(flat[i]) for i in arrays])
    return sorted(set(written))


def _on_batch(call_args, batch_rows: set) -> bool:
    """Whether an array argument of a call has the batch's leading dimension."""
    return any(
        is_array(x) and on_batch(x, batch_rows) for x in jax.tree_util.tree_leaves(call_args)
    )


def _hookable(module, call_args, batch_rows: set) -> bool:
    scope = module.scope
    if current().running_model or inside_unit() or module.path or scope is None:
        return False
    if not isinstance(module.parent, Scope) or module.is_initializing():
        return False
    if any(r.suffix for r in scope.rngs.values()) or _has_drawn(scope.rng_counters):
        return False
    return _on_batch(call_args, batch_rows)


def _has_drawn(counters: dict) -> bool:
    """Whether a Linen scope's RNG counters (nested per child scope: a `setup` that made
    submodules adds theirs, at 0) say a key was drawn already."""
    return any(_has_drawn(v) if isinstance(v, dict) else bool(v) for v in counters.values())
