"""The per-device hook: run a model call once per device with explicit ZeRO collectives.

Inside a zerojax step each model call that `zerojax.flax.model_calls` catches (a Linen model
applied wherever Flax applies it, a plain-JAX `state.apply_fn`, an NNX module's call) runs
through `hooked_apply_fn`: once per device on that device's slice of the batch (`shard_map`
over the data axes, the mesh's other axes staying XLA's), planned from shapes
(`zerojax.core.call_plan`) and run by a `Runner`:
- whole parameters enter as full copies from `comm.device_copies` in the compute dtype, so
  their gradients leave the model unreduced, one block per device, and `device_copies`'
  backward reduces them: an all-reduce at stage 0, a reduce-scatter from stage 1 (the
  gradient each device keeps is its slice);
- a unit's parameters enter as this device's shards (stage 3) or split as their gradient is
  (stages 1-2), and the unit gathers and reduces them itself (`zerojax.flax.unit_calls`);
- other state enters with its RNG keys folded per device and what a call writes comes back
  as one value (`zerojax.comm.device_values`).
User code runs there with `jax.jit`'s semantics: the `shard_map` does no varying-axes checking
(so a scan carry built from zeros or exact GELU's JVP runs as under `jax.jit`), and autodiff
follows its specs: an input it receives whole has its per-device gradients summed as backward
leaves it. Everything outside the model (loss, optimizer update) stays in XLA's global view,
so any optax transformation, global-norm clipping included, sees exactly the single-device
numbers. With fp16, the cotangent entering the model is multiplied by the loss scale and the
parameter gradients are divided by it (in fp32) as they leave.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax.comm.device_values import combine_state, fold_keys
from zerojax.comm.gather import compute_copies, device_copies, scale_cotangent, to_compute
from zerojax.comm.hierarchy import Comm, in_reduce_dtype, manual_over_data
from zerojax.comm.offload import activation_policy
from zerojax.core.call_plan import (
    OTHER,
    UNIT,
    WHOLE,
    ApplyHookError,
    CallPlan,
    FoundUnits,
    is_array,
    on_batch,
    plan_call,
    with_values,
)
from zerojax.core.errors import warn
from zerojax.core.policy import UnitPolicy
from zerojax.core.rules import PARAMS, StateLayout, key_name, split_dim
from zerojax.core.trace_scope import fresh_traces, scoped
from zerojax.flax.unit_calls import LAYER, GatherContext
from zerojax.flax.units import (
    discovering,
    revealed_stacks,
    running_units,
    select_units,
    stacks_only,
)


@dataclasses.dataclass
class TraceLog:
    """What one trace of a step found in its model calls, read once that trace is done: the
    stage-3 units of each call sent through the hook. A step keeps one per compiled variant,
    so what it reports is that variant's, and nothing is written on the step while tracing."""

    calls: list[frozenset] = dataclasses.field(default_factory=list)
    # the parameter paths the calls saw sliced by a lifted transform: a stack's layers lead them
    stacks: set = dataclasses.field(default_factory=set)

    @property
    def hooked(self) -> bool:
        """Whether any model call ran per device with zerojax's collectives."""
        return bool(self.calls)

    @property
    def units(self) -> tuple[str, ...]:
        """The units gathered in the trace, sorted."""
        return tuple(sorted(frozenset().union(*self.calls)))


@dataclasses.dataclass(frozen=True)
class Site:
    """Where one traced step's model calls run: the mesh and the axes of its collectives,
    what a unit run reads of the options, the state's layout (each parameter's storage and
    gradient spec), the step's global batch sizes (leading dims of its batch leaves) and the
    log each call notes its stage-3 units in."""

    mesh: Any
    comm: Comm
    policy: UnitPolicy
    layout: StateLayout
    batch_rows: set
    log: TraceLog


def hooked_apply_fn(apply_fn, site: Site, scale=None, stateful: bool | None = None):
    """`apply_fn(variables, *args, **kwargs)` run per device with explicit collectives over
    `site`'s axes; `scale` is the fp16 loss scale (None without loss scaling). `stateful`:
    whether `apply_fn` returns `(outputs, written state)`; None reads it from a Linen call's
    `mutable=` and `capture_intermediates=` (and takes its `rngs=` as the keys each device
    folds). Each call is planned (`_plan`) and run per device by a `Runner`."""
    linen = stateful is None

    def apply(variables, *args, **kwargs):
        returns_state = _linen_stateful(kwargs) if linen else stateful
        rngs = _rngs_dict(kwargs.pop("rngs", None)) if linen else None
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(flat) if is_array(x)]
        values = tuple(flat[i] for i in dynamic)
        keys = {} if rngs is None else {"rngs": rngs}
        plan = _plan(apply_fn, variables, (args, {**kwargs, **keys}), values, site, linen)
        model = _model(apply_fn, flat, dynamic, in_tree, site.policy.offload_activations)
        out = Runner(plan, model, site, returns_state)(variables, rngs, values, scale)
        if scale is None:
            return out
        if not returns_state:
            return scale_cotangent(out, scale)
        out, written = out
        return scale_cotangent(out, scale), written

    return apply


def _plan(apply_fn, variables, call: tuple, values: tuple, site: Site, linen: bool) -> CallPlan:
    """The plan of one call (`call`: its `(args, kwargs)`, `values`: its array arguments): its
    units found by an abstract trace (`_units`) when the options use units, each leaf's role
    from shapes (`call_plan.plan_call`); the units noted in the step's log."""
    policy = site.policy
    found = _units(apply_fn, variables, call, site, policy.units) if policy.uses_units else {}
    unit_leaves = {unit: module_call.param_ndims for unit, module_call in found.items()}
    plan = plan_call(
        site.layout, policy, variables, list(values), site.batch_rows,
        FoundUnits(unit_leaves, linen),
    )  # fmt: skip
    site.log.calls.append(frozenset(plan.units))
    if site.comm.secondary and not plan.where(UNIT):
        warn(
            "zerojax: hpz_partition_size has nothing to do: the model has no stage-3 "
            "units, so its parameters are gathered once per step and kept for backward "
            "(no backward gather to keep inside the node). Name its blocks with units=."
        )
    return plan


@dataclasses.dataclass(frozen=True)
class Runner:
    """One planned call run once per device (`shard_map` manual over the data axes): whole
    parameters enter through `device_copies`, units' leaves as their shards (stage 3) or
    split as their gradient is (stages 1-2, beside the step's whole copy), other state with
    its RNG keys folded per device; written state comes back combined."""

    plan: CallPlan
    model: object  # model(variables, array args, extra kwargs)
    site: Site
    returns_state: bool

    def __call__(self, variables, rngs, values: tuple, scale):
        plan, comm, mesh = self.plan, self.site.comm, self.site.mesh
        leaves = jax.tree_util.tree_leaves(variables)
        whole, units = plan.where(WHOLE), plan.where(UNIT)
        pick = lambda idx, field: tuple(getattr(plan.leaves[i], field) for i in idx)
        copies = device_copies(
            tuple(leaves[i] for i in whole),
            scale,
            pick(whole, "store"),
            pick(whole, "grad"),
            mesh,
            comm,
            (
                pick(whole, "compute_dtype"),
                self.site.policy.reduce_dtype,
                tuple(leaves[i].dtype for i in whole),
            ),
        )
        unit_specs = pick(units, "grad" if plan.in_place else "store")
        shards, carriers = _with_gradient_carriers(
            [leaves[i] for i in units], unit_specs, comm, self.site.policy.reduce_dtype
        )
        wholes = tuple(  # stages 1-2: the unit's whole weights, beside its split gradient
            jax.lax.stop_gradient(to_compute(leaves[i], plan.leaves[i].compute_dtype))
            for i in plan.split_in_place
        )
        others = tuple(leaves[i] for i in plan.where(OTHER))
        batch = P(comm.data_axis)
        out_specs = (batch, P()) if self.returns_state else batch
        in_specs = (
            (
                tuple(batch for _ in whole),
                (unit_specs, {i: P() for i in carriers}),
                pick(plan.split_in_place, "store"),
                P(),
            ),
            P(),
            tuple(batch if b else P() for b in plan.batch_args),
            P(),
        )
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(variables)[0]]
        other_paths = [paths[i] for i in plan.where(OTHER)]  # to match the state written
        body = functools.partial(self.body, jax.tree_util.tree_structure(variables), other_paths)
        run = manual_over_data(body, mesh, comm, in_specs, out_specs, check_vma=False)
        return run((copies, (shards, carriers), wholes, others), rngs, values, scale)

    def body(self, var_tree, other_paths, entering, rngs, values, scale):
        """The model on this device's rows, with its parameters as the plan says: `entering`
        holds the whole parameters' copies, the units' leaves, stages 1-2's whole weights
        beside them and the other state."""
        plan, axis = self.plan, self.site.comm.data_axis
        copies, shards, wholes, others = entering
        local_rows = {r // self.site.comm.data_size for r in self.site.batch_rows}
        shards, carriers = shards
        shards = tuple(  # a carrier adds zeros whose gradient is the leaf's, in the reduce dtype
            x + carriers[i].astype(x.dtype) if i in carriers else x for i, x in enumerate(shards)
        )
        readable, own_shards = self.readable_units(shards)
        entering = {
            WHOLE: (c[0] for c in copies),
            UNIT: iter(readable),
            OTHER: iter(fold_keys(others, axis)),
        }
        variables_local = jax.tree_util.tree_unflatten(
            var_tree, [next(entering[leaf.role]) for leaf in plan.leaves]
        )
        if plan.in_place:
            variables_local = _with_layer_index(variables_local, plan.layers)
        ctx = None
        if plan.units:
            # not differentiated (the gradient flows through the split leaf): no zero
            # cotangent is built, or all-reduced, for the whole weights
            whole = None
            if plan.in_place:
                paths = [plan.leaves[i].path for i in plan.split_in_place]
                whole = dict(zip(paths, jax.lax.stop_gradient(wholes), strict=True))
            ctx = dataclasses.replace(self.gather_context(scale, whole), shards=own_shards)
        extra = {} if rngs is None else {"rngs": fold_keys(rngs, axis, raw=True)}
        with running_units(ctx):
            out = self.model(variables_local, values, extra)
        if not self.returns_state:
            _check_outputs(out, local_rows)
            return out
        out, written = _split_stateful(out)
        _check_outputs(out, local_rows)
        received = dict(zip(other_paths, others, strict=True))  # unfolded, keyed as written
        return out, combine_state(written, received, axis, local_rows)

    def readable_units(self, shards: tuple) -> tuple[list, dict]:
        """The units' leaves as the model's variables hold them, and {path: shard} of those
        held whole: a leaf split on a dim its call sees is held gathered, so that code reading
        it without calling its unit (a tied head reading the embedding through `.variables`)
        reads the whole weight, and its gradient comes back reduce-scattered (the gather's
        transpose); the unit itself runs on the shard (`flax.unit_calls.run_unit`). A gather
        nothing reads is dropped by jit: one that reads none costs nothing. A stacked unit's
        leaves (sliced by the lifted transform) stay shards."""
        plan, comm = self.plan, self.site.comm
        held, own = [], {}
        for i, shard in zip(plan.where(UNIT), shards, strict=True):
            leaf = plan.leaves[i]
            unit = next(u for u in plan.units if leaf.path.startswith(u + "/"))
            spec = leaf.grad if plan.in_place else leaf.store
            dim = split_dim(spec, comm.shard_axis)
            if dim is None or plan.layers[unit]:
                held.append(shard)
                continue
            held.append(jax.lax.all_gather(shard, comm.shard_axis, axis=dim, tiled=True))
            own[leaf.path] = shard
        return held, own

    def gather_context(self, scale, whole) -> GatherContext:
        """What the units of this call need to gather (or, `whole`, to reduce in place)."""
        return GatherContext(
            comm=self.site.comm,
            policy=self.site.policy,
            units=frozenset(self.plan.units),
            split_dims=self.plan.split_dims,
            stored_ndim=self.plan.stored_ndim,
            scale=scale,
            whole=whole,
        )


def _with_gradient_carriers(leaves: list, specs: tuple, comm: Comm, reduce_dtype):
    """The units' leaves as the model's body takes them, and {position: carrier}. A leaf the
    body receives whole (its spec splits no dim) has its per-device gradients summed by the
    `shard_map`'s transpose, in the dtype it enters in; where that is not the reduce dtype
    (`in_reduce_dtype`: a float32 leaf with grad_reduce_dtype='bf16', a bf16 one with fp32),
    the leaf enters without its gradient and a carrier beside it, zeros in the reduce dtype
    whose gradient reaches the leaf: the body adds it back, so forward reads the leaf exactly
    and backward sums the gradient in the reduce dtype."""
    out, carriers = list(leaves), {}
    for i, (x, spec) in enumerate(zip(leaves, specs, strict=True)):
        if split_dim(spec, comm.shard_axis) is not None:
            continue
        reduced = in_reduce_dtype(x, reduce_dtype)
        if reduced.dtype != x.dtype:
            out[i] = jax.lax.stop_gradient(x)
            carriers[i] = reduced - jax.lax.stop_gradient(reduced)
    return tuple(out), carriers


def _compute_dtypes(variables, dtype) -> tuple:
    """Per leaf: the 16-bit compute `dtype` for parameters, None (keep) for everything else."""
    return tuple(
        dtype if path and key_name(path[0]) == PARAMS else None
        for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0]
    )


def _linen_stateful(kwargs) -> bool:
    """Whether a Linen `apply` called with `kwargs` returns `(outputs, mutated variables)`."""
    return kwargs.get("mutable", False) is not False or bool(kwargs.get("capture_intermediates"))


def _rows_spec(x, batch_rows: set, comm: Comm):
    """A call argument split over the data axes when it has the batch's leading dimension."""
    return P(comm.data_axis) if on_batch(x, batch_rows) else P()


def _rngs_dict(rngs):
    """Linen's `rngs=` as a dict (one key is shorthand for {'params': key})."""
    return rngs if rngs is None or isinstance(rngs, dict) else {"params": rngs}


def _split_stateful(out):
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ApplyHookError(
            "zerojax: a model applied with mutable collections returned "
            f"{type(out).__name__}, not (outputs, mutated variables)."
        )
    return out


def _model(apply_fn, flat: list, positions: list, tree, offload_activations: bool):
    """`model(variables, array args)`: `apply_fn` with the call's non-array arguments closed
    over, rematerialised with the activation-offload policy when offload_activations is on."""

    def model(variables, values, extra=None):
        args, kwargs = with_values(flat, positions, values, tree)
        with scoped(running_model=True), fresh_traces():  # its module calls: not hooked again
            return apply_fn(variables, *args, **kwargs, **(extra or {}))

    return jax.checkpoint(model, policy=activation_policy()) if offload_activations else model


def _with_layer_index(variables, layers: dict):
    """`variables` with, under each stacked unit's parameters, a `LAYER` leaf holding each
    layer's flat index, so the unit can take its slice of the whole stack (stages 1-2)."""
    params = dict(variables[PARAMS])
    for unit, dims in layers.items():
        if not dims:
            continue
        keys = unit.split("/")
        node = params
        for key in keys[:-1]:
            node[key] = dict(node[key])
            node = node[key]
        index = jax.numpy.arange(int(np.prod(dims)), dtype=np.int32).reshape(dims)
        node[keys[-1]] = {**node[keys[-1]], LAYER: index}
    return {**variables, PARAMS: params}


def _units(apply_fn, variables, call: tuple, site: Site, selected) -> dict:
    """{path: ModuleCall} of the modules gathered as units (`flax.units`; `selected`: the
    `units` option), from an abstract trace of the model's `call` (`(args, kwargs)`) that
    records its module calls, run per device as the model runs (a collective the model itself
    runs over the data axes, such as `nn.BatchNorm(axis_name=...)` naming the mesh's axis, is
    bound there too)."""
    flat, tree = jax.tree_util.tree_flatten(call)
    arrays = [i for i, x in enumerate(flat) if is_array(x)]
    run = _model(apply_fn, flat, arrays, tree, offload_activations=False)
    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    body = lambda variables, values: (run(variables, values), ())[1]  # the calls, not outputs
    in_specs = (P(), [_rows_spec(flat[i], site.batch_rows, site.comm) for i in arrays])
    with discovering() as found:
        jax.eval_shape(
            manual_over_data(body, site.mesh, site.comm, in_specs, P(), check_vma=False),
            jax.tree_util.tree_map(shape, variables),
            [shape(flat[i]) for i in arrays],
        )
    site.log.stacks.update(revealed_stacks(found, variables.get(PARAMS, {})))
    found = stacks_only(found, variables.get(PARAMS, {}))
    return {u: found[u] for u in sorted(select_units(found, selected))}


def local_apply_fn(apply_fn, policy: UnitPolicy, log: TraceLog, axis, local_rows: set, scale=None):
    """`apply_fn` for steps that already run per device (over the data axes `axis`, on
    batches of `local_rows` rows): compute-dtype casts and loss scaling, each device's own RNG
    stream and written state combined (`zerojax.comm.device_values`), no gradient collectives (the
    step reduces the gradients itself)."""

    def apply(variables, *args, **kwargs):
        log.calls.append(frozenset())
        stateful, rngs = _linen_stateful(kwargs), kwargs.pop("rngs", None)
        if rngs is not None:
            kwargs["rngs"] = fold_keys(_rngs_dict(rngs), axis, raw=True)
        leaves, var_tree = jax.tree_util.tree_flatten(variables)
        copies = compute_copies(
            tuple(leaves),
            scale,
            (_compute_dtypes(variables, policy.compute_dtype), tuple(x.dtype for x in leaves)),
        )
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(flat) if is_array(x)]
        model = _model(apply_fn, flat, dynamic, in_tree, policy.offload_activations)
        out = model(
            jax.tree_util.tree_unflatten(var_tree, list(copies)), tuple(flat[i] for i in dynamic)
        )
        written = None
        if stateful:
            out, written = _split_stateful(out)
            given = dict(jax.tree_util.tree_flatten_with_path(variables)[0])
            written = combine_state(written, given, axis, local_rows)
        out = out if scale is None else scale_cotangent(out, scale)
        return out if written is None else (out, written)

    return apply


def _check_outputs(out, local_rows: set):
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] not in local_rows:
            raise ApplyHookError(
                f"zerojax: the model (state.apply_fn, model.apply or an NNX model) returned "
                f"{jax.tree_util.keystr(path) or 'its output'} "
                f"with shape {np.shape(leaf)}, whose leading dimension is not the per-device "
                f"batch {sorted(local_rows)}; explicit collectives need every output to be "
                "per-example. Return per-example outputs (reduce them in the loss), or use "
                "zero_shard(..., explicit_collectives=False)."
            )
