"""Units: a module's parameters exist whole only while it runs (stage 3), and its gradient is
reduced as soon as backward leaves it (stages 1-3).

Which modules are units is decided in `zerojax.flax.units`; this module runs one.
Inside a zerojax stage-3 step a unit receives its parameters as this device's shards and runs
through `LayerCall`, a custom VJP: forward all-gathers the weights, runs the layer and keeps
its activations (the outputs of its matmuls and other non-elementwise operations, never its
weights; backward redoes elementwise work, re-layouts and casts from them: no matmul is
computed twice); backward all-gathers the weights again, runs the layer's backward,
reduce-scatters the weight gradient at once and drops the gathered copy.
With `recompute_units=True` forward keeps only the shards and the layer input and backward
recomputes the layer (the least memory, a forward's FLOPs more). At stages 1-2 a unit runs on
the step's whole weights and gathers nothing; its gradient is reduce-scattered as backward
leaves it. A unit's unsplit leaves enter the per-device body whole, and the body's `shard_map`
sums their gradients as backward leaves the model (`engine.hook.Runner`).
Each gather is made to depend on the layer's input (forward) or cotangent (backward), so XLA
cannot issue them all up front, and the backward gather cannot be merged with the forward one.
With `prefetch=1` an unrolled layer's gather depends instead on the previous gathered layer's
input (cotangent in backward), so it can run while that layer computes. Inside a scanned loop
body no gather has an anchor: each reads only its stored shard, so XLA's scheduler may run a
module's gather while the body's earlier modules compute (and its collective pipeliner, on GPU,
may move the next iteration's first gather into the current one); the body holds at most its
own modules' weights.
With `offload_activations`, the activations a layer saves for backward (its input alone when
recomputing) are kept in pinned host memory until its backward needs them. ZeRO++: the gathers
may move int8 blocks (qwZ) and the reduce-scatters quantized blocks (qgZ), see
`comm.hierarchy`; with hpZ the layer also keeps its node-local secondary shard of the gathered
weights, and backward re-gathers from it inside the node instead of across all devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import bind as bind_scope
from flax.core.tracers import current_trace

from zerojax.comm.flat import gather_leaves, reduce_leaves
from zerojax.comm.gather import to_compute, unscale
from zerojax.comm.hierarchy import (
    Comm,
    gather_secondary,
    gather_weight,
    reduce_gradient,
    secondary_shard,
)
from zerojax.core.call_plan import is_array, with_values
from zerojax.core.policy import UnitPolicy
from zerojax.core.trace_scope import current, scoped

LAYER = "zerojax_layer"  # the leaf a stacked unit reads its layer index from (stages 1-2)


@dataclasses.dataclass
class GatherContext:
    """What a unit needs inside a step's per-device body."""

    comm: Comm | None  # axes of the gathers and reduce-scatters (None: discovery only)
    policy: UnitPolicy  # prefetch, recompute_units, keep_gathered, dtypes, offload_activations
    split_dims: dict = dataclasses.field(default_factory=dict)  # parameter path -> dim or None
    stored_ndim: dict = dataclasses.field(default_factory=dict)  # path -> ndim stored (scanned)
    scale: object = None  # fp16 loss scale (the cotangent arrives multiplied by it)
    units: frozenset = frozenset()  # paths of the modules gathered as units ('layers')
    anchors: dict = dataclasses.field(default_factory=dict)  # 'fwd'/'bwd' -> (trace, value)
    whole: dict | None = None  # stages 1-2: path -> the step's whole weight (nothing gathered)
    shards: dict = dataclasses.field(default_factory=dict)  # path -> shard, where the model's
    # variables hold the whole weight instead (`engine.hook.Runner.body`)

    @property
    def compute_dtype(self):
        """The dtype units compute in (None: the stored one)."""
        return self.policy.compute_dtype

    @property
    def reduce_dtype(self):
        """The dtype gradients are reduced in."""
        return self.policy.reduce_dtype


@contextlib.contextmanager
def gather_context(ctx: GatherContext | None):
    """`ctx` in force for the units of the model traced inside."""
    with scoped(gather=ctx):
        yield ctx


def inside_unit() -> bool:
    """Whether a unit's own modules are being traced (they run on its gathered weights)."""
    return current().inside_unit


def current_context() -> GatherContext | None:
    """The context of the stage-3 step being traced, or None outside one and inside a unit."""
    return None if current().inside_unit else current().gather


def gather_unit(module, function, args, kwargs):
    """Run `function(module, *args, **kwargs)`, the function Flax was about to call on the bound
    Linen `module` (its method; in the body of a lifted transform, the undecorated method or
    the transform's own body, such as `nn.RNN`'s `scan_fn(cell, carry, x)`), as a stage-3 unit
    (see the module docstring):
    its parameters enter as this device's shards, are gathered only while it runs and their
    gradients are reduce-scattered as soon as backward leaves it. It reads the module's other
    collections, draws from the module's own RNG streams (Flax's lazy keys: its submodules
    get the keys they would get bound) and writes back the collections it mutates."""
    plain = module.clone(parent=None)  # unbound: applied functionally on the gathered weights
    scope = module.scope
    mutable, counters, after = scope.mutable, _copy_counters(scope.rng_counters), []

    def apply(params, extra, a, k):
        collections, rngs = extra
        root = bind_scope({"params": params, **collections}, rngs=rngs or None, mutable=mutable)
        # each run (forward, backward's recomputation) from the counters the module had when
        # called: its submodules draw the keys they would bound, the same ones every run
        root.rng_counters = _copy_counters(counters)
        with root.temporary() as bound:
            clone = plain.clone(parent=bound, _deep_clone=True)
            # through Flax's method handler, as Flax calls it (not the class attribute: in a
            # lifted body that is the transform, `nn.scan`, which would run again)
            out = clone._call_wrapped_method(function, a, k)
            written = bound.mutable_variables() if mutable is not False else {}
        after.append(root.rng_counters)
        return out, written

    extra = ({c: v for c, v in module.variables.items() if c != "params"}, dict(scope.rngs))
    params = dict(module.variables["params"])
    layer = params.pop(LAYER, None)  # stages 1-2: which layer of a stack this call is
    out, written = run_unit("/".join(module.path), params, apply, extra, (args, kwargs), layer)
    _merge_counters(scope.rng_counters, after[0])  # as if the module had run bound
    for col, tree in written.items():
        for name, value in tree.items() if col != "params" else ():
            scope.put_variable(col, name, value)
    return out


def _copy_counters(counters: dict) -> dict:
    """A copy of Flax's nested RNG counters (its keys, Flax's own sentinels, kept as they are)."""
    return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _merge_counters(into: dict, counters: dict) -> None:
    """Flax's nested RNG counters `counters` written into `into` in place (child scopes hold
    references to the nested dicts)."""
    for key, value in counters.items():
        if isinstance(value, dict):
            _merge_counters(into.setdefault(key, {}), value)
        else:
            into[key] = value


def run_unit(prefix: str, shards, apply, extra, call: tuple, layer=None):
    """`apply(params, extra, args, kwargs) -> (outputs, written state)` run as the stage-3 unit
    at path `prefix` whose parameters (`shards`, a pytree of this device's shards keyed below
    `prefix`) are gathered only while it runs; `extra` holds what else it reads (other
    collections, RNG keys), passed through undifferentiated. `call`, `(args, kwargs)`, is the
    module's call as written: their arrays are differentiated (floats) or passed through
    (integers, bools, keys), everything else stays a Python value. Linen's and NNX's units
    both run through here."""
    ctx = current().gather
    assert ctx is not None, "a unit runs inside a zerojax stage-3 step"

    # the call's arrays (any pytree, by position or keyword) enter the custom VJP as its
    # inputs; every other value (a `train: bool`, a string, None, a dataclass, a callable) is
    # closed over as the module would see it called plainly: static, never traced
    flat, tree = jax.tree_util.tree_flatten(call)
    arrays = [i for i, x in enumerate(flat) if is_array(x)]
    shards = jax.tree_util.tree_map_with_path(  # its shards, where the model reads whole ones
        lambda p, x: ctx.shards.get(_full_path(prefix, p), x), shards
    )

    def inside(params, extra, values):
        a, k = with_values(flat, arrays, values, tree)
        with scoped(inside_unit=True):  # modules inside the unit run on the gathered weights
            return apply(params, extra, a, k)

    dims = jax.tree_util.tree_map_with_path(lambda p, x: _layer_dim(ctx, prefix, p, x), shards)
    scanned = any(
        ctx.stored_ndim[_full_path(prefix, p)] > x.ndim
        for p, x in jax.tree_util.tree_flatten_with_path(shards)[0]
    )
    whole, stacks = None, ctx.whole
    if stacks is not None:  # stages 1-2: the step's whole weights (stacks), with the layer
        # index: sliced inside the unit, so backward keeps no per-layer copy of a stack (a
        # leaf the call receives whole, such as a stack's small per-layer leaves: itself)
        whole = jax.tree_util.tree_map_with_path(
            lambda p, x: stacks.get(_full_path(prefix, p), x), shards
        )
        whole = (whole, layer)
    keep = whole is None and any(re.fullmatch(r, prefix) for r in ctx.policy.keep_gathered)
    values = [flat[i] for i in arrays]
    return LayerCall(inside, dims, ctx, scanned, keep)(shards, extra, values, whole)


def _layer_slice(stack, leaf, layer):
    """The slice of a whole stacked weight `stack` that layer `layer` (flat index over the
    stack's leading dims, None when unstacked) of a unit whose leaf is `leaf` uses (`stack`
    itself when it has no more dims than `leaf`)."""
    if layer is None or stack.ndim == leaf.ndim:
        return stack
    rows = stack.reshape(-1, *stack.shape[stack.ndim - leaf.ndim :])
    return jax.lax.dynamic_index_in_dim(rows, layer.reshape(()), 0, keepdims=False)


def _full_path(prefix, path) -> str:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return f"{prefix}/{name}" if prefix else name


def _layer_dim(ctx, prefix, path, leaf):
    """The dim this per-layer leaf is split on (a scanned leaf's stored dim minus one)."""
    full = _full_path(prefix, path)
    dim = ctx.split_dims.get(full)
    if dim is None:
        return -1
    dim -= ctx.stored_ndim[full] - leaf.ndim
    if dim < 0:
        raise ValueError(
            f"zerojax: {full} is split along its layer axis, so a scanned layer "
            "cannot gather it alone; split another dimension (rules=...)."
        )
    return dim


def _to_memory(tree, space):
    """The array leaves of `tree` copied to memory `space` (layer inputs saved on the host)."""
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, space) if isinstance(x, jax.Array) else x, tree
    )


def _scalar(anchor):
    """A float32 scalar read from every floating leaf of `anchor` (a pytree; one element each),
    or None when it holds none. Every leaf, not the first: a cotangent's first leaf may be the
    zeros of an output nothing used (gemma 4's blocks return their KV cache first), which
    depends on nothing, and a gather waiting on it would be issued at the start of backward."""
    leaves = [
        x.reshape(-1)[0].astype(jnp.float32)
        for x in jax.tree_util.tree_leaves(anchor)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x)
    ]
    return sum(leaves[1:], leaves[0]) if leaves else None


def _depend(tree, scalar):
    """`tree` plus zero times `scalar`: a data dependency XLA keeps (none when None). Not an
    `optimization_barrier`, which would cost no kernel: XLA:CPU schedules as if it were not
    there (tests/test_dependencies.py)."""
    if scalar is None:
        return tree
    zero = scalar * 0
    return jax.tree_util.tree_map(
        lambda x: x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _anchor(ctx, direction: str, own, scanned: bool):
    """What a module's gather waits for (see the module docstring): its own input (prefetch=0),
    or with prefetch=1 the previous gathered module's input in the same trace (unrolled), or,
    inside a scanned body, nothing: each gather reads only its stored shard, free to run while
    the body's earlier modules compute (or, moved by XLA's pipeliner, the previous iteration).
    Records `own` for the next module in `direction`."""
    if ctx.policy.prefetch == 0:
        return own
    if scanned:
        return None
    trace = current_trace()
    previous = ctx.anchors.get(direction)
    ctx.anchors[direction] = (trace, own)
    same_trace = previous is not None and previous[0] == trace
    return previous[1] if same_trace else own


def _gather(shards, dims, ctx):
    """The unit's weights, gathered leaf by leaf or (unit_buffers) as one buffer per dtype."""
    flat, tree = jax.tree_util.tree_flatten(shards)
    flat = [to_compute(x, ctx.compute_dtype) for x in flat]
    split = [d if d >= 0 else None for d in jax.tree_util.tree_leaves(dims)]
    gather = lambda x, d: gather_weight(x, d, ctx.comm, x.dtype)
    full = gather_leaves(flat, split, gather, ctx.comm.shard_size, ctx.comm.buffers)
    return jax.tree_util.tree_unflatten(tree, full)


def _scatter(grads, dims, shards, ctx, scale):
    """Split leaves' gradients reduce-scattered now (leaf by leaf, or with unit_buffers as one
    buffer per dtype). Whole leaves' gradients leave per device: the unit's body received them
    as one value for all devices, so the `shard_map` that runs the model sums their
    cotangents over the devices as backward leaves it (in the reduce dtype they entered in,
    `engine.hook.Runner`), as it sums split leaves' over MiCS's replica axes."""
    flat, tree = jax.tree_util.tree_flatten(grads)
    local = jax.tree_util.tree_leaves(shards)
    reduce = lambda g, d: reduce_gradient(g, d, ctx.comm, ctx.reduce_dtype, replicas=False)
    split = [d if d >= 0 else None for d in jax.tree_util.tree_leaves(dims)]
    out = reduce_leaves(flat, split, reduce, ctx.comm.shard_size, ctx.comm.buffers)
    out = [unscale(g, scale, x.dtype) for g, x in zip(out, local, strict=True)]
    return jax.tree_util.tree_unflatten(tree, out)


def _secondary(params, dims, ctx) -> list:
    """hpZ: per split leaf, this device's node-local slice of the gathered weight."""
    flat, dims = jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(dims)
    return [secondary_shard(p, d, ctx.comm) for p, d in zip(flat, dims, strict=True) if d >= 0]


def _from_secondary(secondary: list, shards, dims, ctx):
    """hpZ: the layer's weights re-gathered inside the node (whole leaves from their shard)."""
    flat, tree = jax.tree_util.tree_flatten(shards)
    parts = iter(secondary)
    return jax.tree_util.tree_unflatten(
        tree,
        [
            to_compute(x, ctx.compute_dtype)
            if d < 0
            else gather_secondary(next(parts), d, ctx.comm)
            for x, d in zip(flat, jax.tree_util.tree_leaves(dims), strict=True)
        ],
    )


def _no_cotangent(x):
    """The zero cotangent of an undifferentiated input (float0 for integers and keys)."""
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _weights(shards, dims, ctx, whole, wait):
    """The unit's full weights: gathered from the shards (stage 3), or (stages 1-2) the step's
    whole weights for split leaves and the leaf itself for whole ones."""
    if whole is None:
        return _gather(_depend(shards, wait), dims, ctx)
    stacks, layer = whole
    return jax.tree_util.tree_map(
        lambda x, w, d: _layer_slice(w, x, layer) if d >= 0 else to_compute(x, ctx.compute_dtype),
        shards,
        stacks,
        dims,
    )


# what a unit's backward redoes from the values it keeps rather than keep their results (as
# MaxText's `minimal` remat policy does): re-layouts and casts, so a module that casts (`dtype=`)
# or reshapes its weights keeps no copy of them, and elementwise work (an activation, a residual
# add, a norm's scaling, a dropout mask from its key). Every other value is kept: the outputs of
# matmuls, convolutions, reductions and of any operation not listed here (a name missing here
# costs memory, never a matmul). tests/test_dependencies.py checks that every primitive jax
# batches elementwise is listed.
_RELAYOUTS = frozenset(
    """
    convert_element_type reshape transpose broadcast_in_dim squeeze slice split concatenate pad rev
    iota select_n clamp random_wrap
    """.split()
)
_ELEMENTWISE = frozenset(
    """
    abs acos acosh add and asin asinh atan atan2 atanh bessel_i0e bessel_i1e bitcast_convert_type
    cbrt ceil clz complex conj copy cos cosh digamma div eq eq_to erf erf_inv erfc exp exp2 expm1
    floor from_edtype ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le le_to
    lgamma log log1p log2 logistic lt lt_to max min mul mulhi ne neg nextafter not
    one_minus_square or philox2x32 philox4x32 polygamma polynomial population_count pow
    random_bits random_clone random_fold_in random_seed random_split random_unwrap real
    reduce_precision regularized_incomplete_beta rem round rsqrt shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square stage sub tan tanh threefry2x32 threefry4x32 tie
    to_edtype with_memory_space_constraint xor zeta
    """.split()
)
_REDONE_IN_BACKWARD = _RELAYOUTS | _ELEMENTWISE


def _saved_in_forward(primitive, *_, **__) -> bool:
    """The `jax.checkpoint` policy of a unit that keeps its activations: every value but a
    re-layout, cast or elementwise result (no matmul is ever redone)."""
    return primitive.name not in _REDONE_IN_BACKWARD


def _forward_saving_activations(apply, params, extra, args):
    """(outputs, (treedef, slots, saved)): the unit's forward with autodiff's residuals for its
    backward, less its weights (`slots[i]`: the index of the weight residual i is, or None for
    an activation kept in `saved`), which backward gathers again rather than keep. A value a
    matmul computes from the weights (a merged LoRA update) is kept like any other.
    No `prevent_cse` barrier: what backward redoes (elementwise work, re-layouts and casts) reads
    values kept for it and, at stage 3, weights gathered again, so there is little of forward's to
    merge it with; the barrier made the compiler hold every saved activation at one point
    (BENCHMARKS.md 1d)."""
    run = jax.checkpoint(
        lambda p, a: apply(p, extra, a), policy=_saved_in_forward, prevent_cse=False
    )
    out, vjp, state = jax.vjp(run, params, args, has_aux=True)
    residuals, treedef = jax.tree_util.tree_flatten(vjp)
    position = {id(w): i for i, w in enumerate(jax.tree_util.tree_leaves(params))}
    slots = [position.get(id(r)) for r in residuals]
    saved = [r for r, s in zip(residuals, slots, strict=True) if s is None]
    return (out, state), (treedef, slots, saved)


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """`apply(gathered params, extra, args) -> (outputs, written state)` with the memory
    behaviour of the module docstring; backward recomputes it with the same `extra` (the same
    RNG keys, so the same dropout masks). `dims`: each leaf's split dim (-1: whole); `keep`:
    the gathered weights stay alive from forward to backward (`keep_gathered`), which then
    gathers nothing. `saved_layout` (filled by forward, read by backward, which runs later in
    the same trace): the residuals' structure and where the weights go among them."""

    apply: Callable
    dims: Any
    ctx: GatherContext
    scanned: bool = False
    keep: bool = False
    saved_layout: dict = dataclasses.field(default_factory=dict)

    def __call__(self, shards, extra, args, whole=None):
        """The unit on this device's `shards` (stage 3) or, `whole`, the step's whole weights
        and the layer index (stages 1-2, nothing gathered)."""
        run = jax.custom_vjp(self._plain)
        run.defvjp(self._fwd, self._bwd)
        gathers = whole is None  # stages 1-2 use the step's whole weights: no gather to order
        anchor = _scalar(_anchor(self.ctx, "fwd", args, self.scanned)) if gathers else None
        return run(shards, whole, args, extra, anchor, self.ctx.scale)

    def _plain(self, shards, whole, args, extra, anchor, scale):
        return self.apply(_weights(shards, self.dims, self.ctx, whole, anchor), extra, args)

    def _fwd(self, shards, whole, args, extra, anchor, scale):
        ctx, apply = self.ctx, self.apply
        params = _weights(shards, self.dims, ctx, whole, anchor)
        hpz = ctx.comm.secondary is not None
        secondary = _secondary(params, self.dims, ctx) if hpz and not self.keep else []
        if self.keep:  # the gathered weights themselves are backward's, nothing to gather again
            whole = params
        if ctx.policy.recompute_units:
            out, saved = apply(params, extra, args), args
        else:
            out, saved = _forward_saving_activations(apply, params, extra, args)
            self.saved_layout["treedef"], self.saved_layout["slots"], saved = saved
        if ctx.policy.offload_activations:
            saved = _to_memory(saved, jax.memory.Space.Host)
        return out, (shards, whole, secondary, saved, extra, anchor, scale)

    def _bwd(self, res, ct):  # the loss scale arrives as a residual: bwd runs in another trace
        shards, whole, secondary, saved, extra, anchor, scale = res
        ct = ct[0]  # the written state is not differentiated
        if self.ctx.policy.offload_activations:
            saved = _to_memory(saved, jax.memory.Space.Device)
        dparams, dargs = self._backward_vjp(self._weights_again(res, ct), saved, extra)(ct)
        zero = lambda x: None if x is None else jnp.zeros_like(x)
        return (
            _scatter(dparams, self.dims, shards, self.ctx, scale),
            None,  # the whole weights are the step's copy, not differentiated here
            dargs,
            jax.tree_util.tree_map(_no_cotangent, extra),
            zero(anchor),
            zero(scale),
        )

    def _weights_again(self, res, ct):
        """Backward's weights: kept from forward, re-gathered in the node (hpZ), gathered
        again, or (stages 1-2) the step's whole weights."""
        shards, whole, secondary = res[:3]
        ctx, gathers = self.ctx, whole is None or self.keep  # keep: forward's gathered weights
        wait = _scalar(_anchor(ctx, "bwd", ct, self.scanned)) if gathers else None
        if self.keep:
            return whole
        if ctx.comm.secondary is not None:
            return _from_secondary(_depend(secondary, wait), shards, self.dims, ctx)
        return _weights(shards, self.dims, ctx, whole, wait)

    def _backward_vjp(self, params, saved, extra):
        """The unit's vjp: recomputed from its inputs, or from the saved activations with the
        weights gathered again where they were used."""
        if self.ctx.policy.recompute_units:
            return jax.vjp(lambda p, a: self.apply(p, extra, a)[0], params, saved)[1]
        weights = jax.tree_util.tree_leaves(params)
        found = iter(saved)
        slots = self.saved_layout["slots"]
        leaves = [next(found) if s is None else weights[s] for s in slots]
        return jax.tree_util.tree_unflatten(self.saved_layout["treedef"], leaves)
