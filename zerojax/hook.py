"""The `apply_fn` hook: run the model per device with explicit ZeRO collectives.

Inside a zerojax step, `state.apply_fn(variables, *args)` runs the unchanged model once per
device on that device's slice of the batch (`shard_map`), with full parameter copies from
`comm.device_copies` in the compute dtype. Gradients therefore leave the model unreduced, one
block per device, and `device_copies`' backward reduces them: all-reduce for stages 0-1,
reduce-scatter for 2-3. Everything outside the model (loss, optimizer update) stays in XLA's
global view, so any optax transformation, global-norm clipping included, sees exactly the
single-device numbers. With fp16, the cotangent entering the model is multiplied by the loss
scale and the parameter gradients are divided by it (in fp32) as they leave. "Per device"
means per position on the data axes: a mesh's other axes (the model's tensor parallelism)
stay XLA's. Each device draws its own RNG stream and the state a call writes comes back as
one value (`zerojax.device_values`). `zerojax.model_calls` sends a step's model calls here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools

import flax.linen as nn
import jax
import numpy as np
from jax._src import config as jax_config  # the trace-context option, see fresh_traces
from jax.sharding import PartitionSpec as P

from zerojax.comm.gather import compute_copies, device_copies, scale_cotangent, to_compute
from zerojax.comm.hierarchy import Comm, manual_over_data
from zerojax.config import ZeroConfig, ZeroError
from zerojax.device_values import combine_state, fold_keys
from zerojax.errors import warn
from zerojax.flax.gather import LAYER, GatherContext, gather_context
from zerojax.flax.units import discovering, intercept, select_units
from zerojax.offload import activation_policy
from zerojax.optim import DTYPES
from zerojax.rules import PARAMS, StateLayout, key_name, path_str

_RUNNING_MODEL = contextvars.ContextVar("zerojax_running_model", default=False)


def running_model() -> bool:
    """Whether the per-device model is being traced (its own module calls are not hooked)."""
    return _RUNNING_MODEL.get()


@contextlib.contextmanager
def model_running():
    """Inside, `running_model()` is true."""
    token = _RUNNING_MODEL.set(True)
    try:
        yield
    finally:
        _RUNNING_MODEL.reset(token)


NNX_STATE = "nnx_state"  # the key an NNX model's other state travels under through the hook


class ApplyHookError(ZeroError):
    """The model's inputs or outputs cannot be split per device; the message says why."""


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def with_values(flat: list, positions: list, values, tree):
    """(args, kwargs) from flattened call arguments with the array leaves at `positions`
    replaced by `values` (traced per-device or abstract stand-ins)."""
    local = list(flat)
    for i, v in zip(positions, values, strict=True):
        local[i] = v
    return jax.tree_util.tree_unflatten(tree, local)


def _compute_dtypes(variables, cfg: ZeroConfig) -> tuple:
    """Per leaf: the 16-bit compute dtype for parameters, None (keep) for everything else."""
    dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
    return tuple(
        dtype if path and key_name(path[0]) == PARAMS else None
        for path, _ in jax.tree_util.tree_flatten_with_path(variables)[0]
    )


def hooked_apply_fn(
    apply_fn,
    mesh,
    comm: Comm,
    cfg: ZeroConfig,
    layout: StateLayout,
    batch_rows: set,
    calls: list,
    scale=None,
    stateful: bool | None = None,
):
    """`apply_fn` with explicit collectives over `comm`'s axes; `layout` is the state's (each
    parameter's storage and gradient spec), `batch_rows` holds the global batch sizes (leading
    dims of the step's batch leaves), each call appends its stage-3 units to `calls`, and
    `scale` is the fp16 loss scale (None without loss scaling). `stateful`: whether `apply_fn`
    returns `(outputs, written state)`; None reads it from a Linen call's `mutable=` and
    `capture_intermediates=` (and takes its `rngs=` as the keys each device folds). See
    `zerojax.device_values` for what each device draws and how written state becomes one."""
    n, dtypes_reduce = comm.data_size, DTYPES[cfg.grad_reduce_dtype]
    linen = stateful is None

    def plans(variables) -> list:
        """Per variable leaf: the state's plan of that parameter (None for other leaves)."""
        return [
            layout.param_plan(p[1:], x) if p and key_name(p[0]) == PARAMS else None
            for p, x in jax.tree_util.tree_flatten_with_path(variables)[0]
        ]

    def apply(variables, *args, **kwargs):
        returns_state = _linen_stateful(kwargs) if linen else stateful
        rngs = _rngs_dict(kwargs.pop("rngs", None)) if linen else None
        flat_vars = jax.tree_util.tree_flatten_with_path(variables)[0]
        leaves, var_tree = jax.tree_util.tree_flatten(variables)
        leaf_plans = plans(variables)
        is_param = [bool(p) and key_name(p[0]) == PARAMS for p, _ in flat_vars]
        store = tuple(P() if p is None else p.spec for p in leaf_plans)
        grads = tuple(P() if p is None else p.grad_spec for p in leaf_plans)
        stored = {  # each parameter's shape as the state stores it (a stack's with its layers)
            path_str(p[1:]): np.shape(x) for p, x in flat_vars if key_name(p[0]) == PARAMS
        }
        # leaves of units enter as shards: stage 3 gathers them per unit; stages 1-2 use the
        # step's whole copy and reduce-scatter each unit's gradient as backward leaves it
        units, layers = (), {}
        if cfg.shards_parameters or cfg.reduces_per_unit:
            keys = {} if rngs is None else {"rngs": rngs}
            found = _units(apply_fn, variables, args, {**kwargs, **keys}, cfg)
            layers = {u: _layer_dims(found[u], u, stored) for u in found}
            if not cfg.shards_parameters and not linen:  # NNX stacks: no layer index to read
                layers = {u: d for u, d in layers.items() if not d}
            units = tuple(layers)
        calls.append(frozenset(units))
        prefixes = tuple(u + "/" for u in units)
        claimed = [
            param and path_str(p[1:]).startswith(prefixes)
            for param, (p, _) in zip(is_param, flat_vars, strict=True)
        ]
        if comm.secondary and not any(claimed):
            warn(
                "zerojax: hpz_partition_size has nothing to do: the model has no stage-3 "
                "units, so its parameters are gathered once per step and kept for backward "
                "(no backward gather to keep inside the node). Name its blocks with units=."
            )
        whole = [i for i, c in enumerate(claimed) if is_param[i] and not c]
        others = tuple(x for x, param in zip(leaves, is_param, strict=True) if not param)
        given = {p: x for (p, x), param in zip(flat_vars, is_param, strict=True) if not param}
        compute = _compute_dtypes(variables, cfg)
        copies = device_copies(
            tuple(leaves[i] for i in whole),
            scale,
            tuple(store[i] for i in whole),
            tuple(grads[i] for i in whole),
            mesh,
            comm,
            (
                tuple(compute[i] for i in whole),
                dtypes_reduce,
                tuple(leaves[i].dtype for i in whole),
            ),
        )
        shards = tuple(leaves[i] for i, c in enumerate(claimed) if c)
        in_place = bool(units) and not cfg.shards_parameters  # stages 1-2: no gather
        wholes = tuple(
            jax.lax.stop_gradient(to_compute(leaves[i], compute[i]))
            for i, c in enumerate(claimed)
            if c and in_place
        )
        gather_ctx = GatherContext(
            comm=comm,
            compute_dtype=DTYPES[cfg.precision] if cfg.precision != "fp32" else None,
            reduce_dtype=dtypes_reduce,
            config=cfg,
            units=frozenset(units),
            split_dims={
                path_str(p[1:]): plan.split_dim
                for (p, _), plan in zip(flat_vars, leaf_plans, strict=True)
                if plan is not None
            },
            stored_ndim={path: len(shape) for path, shape in stored.items()},
        )

        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(flat) if is_array(x)]
        batch_spec = P(comm.data_axis)
        in_specs = tuple(
            batch_spec if np.ndim(flat[i]) >= 1 and np.shape(flat[i])[0] in batch_rows else P()
            for i in dynamic
        )
        if not any(spec == batch_spec for spec in in_specs):
            raise ApplyHookError(
                "zerojax: no argument of state.apply_fn has the batch's leading dimension "
                f"{sorted(batch_rows)}, so the model cannot be split per device. Pass batch "
                "arrays with the batch first, or use zero_shard(..., explicit_collectives=False)."
            )

        model = _model(apply_fn, flat, dynamic, in_tree, cfg.offload_activations)

        claimed_paths = [path_str(p[1:]) for (p, _), c in zip(flat_vars, claimed, strict=True) if c]

        def body(copies, shards, wholes, others, rngs, values, scale):
            axis, local_rows = comm.data_axis, {r // n for r in batch_rows}
            copies, shards, folded = iter(copies), iter(shards), iter(fold_keys(others, axis))
            variables_local = jax.tree_util.tree_unflatten(
                var_tree,
                [
                    next(folded) if not param else next(shards) if c else next(copies)[0]
                    for param, c in zip(is_param, claimed, strict=True)
                ],
            )
            if in_place:
                variables_local = _with_layer_index(variables_local, layers)
            # the scale: an argument, no outer tracer
            ctx = None
            if units:
                # not differentiated (the gradient flows through the split leaf): no zero
                # cotangent is built, or all-reduced, for the whole weights
                wholes = jax.lax.stop_gradient(wholes)
                whole = dict(zip(claimed_paths, wholes, strict=True)) if in_place else None
                ctx = dataclasses.replace(gather_ctx, scale=scale, whole=whole)
            extra = {} if rngs is None else {"rngs": fold_keys(rngs, axis, raw=True)}
            with gather_context(ctx), nn.intercept_methods(intercept):
                out = model(variables_local, values, extra)
            if not returns_state:
                _check_outputs(out, local_rows)
                return out
            out, written = _split_stateful(out)
            _check_outputs(out, local_rows)
            received = dict(zip(given, others, strict=True))  # unfolded, keyed as written
            return out, combine_state(written, received, axis, local_rows)

        # stages 1-2: a unit's leaf enters split as its gradient is (no communication: the
        # leaf is whole), so backward's reduce-scatter gives this device's slice
        shard_specs = tuple((grads if in_place else store)[i] for i, c in enumerate(claimed) if c)
        whole_specs = tuple(store[i] for i, c in enumerate(claimed) if c and in_place)
        out = manual_over_data(
            body,
            mesh,
            comm,
            (tuple(batch_spec for _ in whole), shard_specs, whole_specs, P(), P(), in_specs, P()),
            (batch_spec, P()) if returns_state else batch_spec,
        )(copies, shards, wholes, others, rngs, tuple(flat[i] for i in dynamic), scale)
        if returns_state:
            out, written = out
            out = out if scale is None else scale_cotangent(out, scale)
            return out, written
        return out if scale is None else scale_cotangent(out, scale)

    return apply


def _linen_stateful(kwargs) -> bool:
    """Whether a Linen `apply` called with `kwargs` returns `(outputs, mutated variables)`."""
    return kwargs.get("mutable", False) is not False or bool(kwargs.get("capture_intermediates"))


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


_TRACES = itertools.count()


@contextlib.contextmanager
def fresh_traces():
    """Inside, a `jax.jit` the model calls (Flax's `nn.jit`, as gemma's Transformer wraps its
    `__call__`) traces its function again instead of reusing a trace cached outside, so the
    module calls in it are seen by zerojax (units found, units gathered). JAX keys its trace
    caches on its "trace context" configuration; this sets one option of it that only names
    source files in lowered HLO (never lowered in here) to a pattern matching nothing."""
    with jax_config.hlo_source_file_canonicalization_regex(f"(?!)zerojax-{next(_TRACES)}"):
        yield


def _model(apply_fn, flat: list, positions: list, tree, offload_activations: bool):
    """`model(variables, array args)`: `apply_fn` with the call's non-array arguments closed
    over, rematerialised with the activation-offload policy when offload_activations is on."""

    def model(variables, values, extra=None):
        args, kwargs = with_values(flat, positions, values, tree)
        with model_running(), fresh_traces():  # its own module calls are not hooked again
            return apply_fn(variables, *args, **kwargs, **(extra or {}))

    return jax.checkpoint(model, policy=activation_policy()) if offload_activations else model


def _layer_dims(call, unit: str, stored: dict) -> tuple:
    """The leading dims a lifted unit's call does not see (its stack's layers), () if none."""
    if not call.param_ndims:
        return ()
    leaf, ndim = call.param_ndims[0]
    shape = stored[f"{unit}/{leaf}"]
    return tuple(shape[: len(shape) - ndim])


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


def _units(apply_fn, variables, args, kwargs, cfg: ZeroConfig) -> dict:
    """{path: ModuleCall} of the modules gathered as units (`flax.units`), from an abstract
    trace of the model that records its module calls."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [i for i, x in enumerate(flat) if is_array(x)]
    run = _model(apply_fn, flat, arrays, tree, offload_activations=False)
    shape = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    with discovering() as found:
        jax.eval_shape(
            run, jax.tree_util.tree_map(shape, variables), [shape(flat[i]) for i in arrays]
        )
    return {u: found[u] for u in sorted(select_units(found, cfg.units))}


def local_apply_fn(apply_fn, cfg: ZeroConfig, calls: list, axis, local_rows: set, scale=None):
    """`apply_fn` for steps that already run per device (over the data axes `axis`, on
    batches of `local_rows` rows): compute-dtype casts and loss scaling, each device's own RNG
    stream and written state combined (`zerojax.device_values`), no gradient collectives (the
    step reduces the gradients itself)."""

    def apply(variables, *args, **kwargs):
        calls.append(frozenset())
        stateful, rngs = _linen_stateful(kwargs), kwargs.pop("rngs", None)
        if rngs is not None:
            kwargs["rngs"] = fold_keys(_rngs_dict(rngs), axis, raw=True)
        leaves, var_tree = jax.tree_util.tree_flatten(variables)
        copies = compute_copies(
            tuple(leaves), scale, (_compute_dtypes(variables, cfg), tuple(x.dtype for x in leaves))
        )
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, x in enumerate(flat) if is_array(x)]
        model = _model(apply_fn, flat, dynamic, in_tree, cfg.offload_activations)
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
