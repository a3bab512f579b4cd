"""Sharding rules: (leaf path, shape, stage, options) -> PartitionSpec.

One rule serves every leaf of a train state, optimizer state included: a leaf is split along
its first (outermost) dimension that divides the axis size, a stack's layer dimension last, so
that a gather lays the shards end to end and a collective needs no transpose (FSDP2 splits dim
0 for the same reason); unless a user rule names the dimension or the leaf is too small to be
worth a collective. Optimizer-state leaves are matched to the parameter of
the same path suffix and shape (never by optimizer type), so Adam's moments follow their
parameter while Adafactor's factored moments get the default rule for their own shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Collection

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.core.config import ZeroConfig
from zerojax.core.errors import ZeroError, warn

PARAMS, OPT_STATE, OTHER = "params", "opt_state", "other"
PER_DEVICE = "per_device"  # opt_state field of per-device buffers: (devices, *shape), split dim 0
DEVICE, HOST = "device", "pinned_host"  # JAX memory kinds a leaf may rest in


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """Where one state leaf lives and why."""

    path: str  # e.g. 'params/Dense_0/kernel'
    category: str  # PARAMS, OPT_STATE or OTHER
    shape: tuple
    dtype: str
    spec: P
    reason: str  # 'sharded dim 1', 'replicated: below persistence threshold', ...
    memory: str = DEVICE  # memory kind at rest: DEVICE, or HOST when offloaded
    itemsize: int = 4  # bytes per element (a typed PRNG key: its key data's)
    # parameters only: the spec split over the ZeRO axis (storage at stage 3; the gradient
    # from stage 2, the optimizer state from stage 1), the dim it splits, where the reduced
    # gradient lives, and the model's tensor-parallel layout (None: it declares none)
    sharded_spec: P | None = None
    split_dim: int | None = None
    grad_spec: P | None = None
    tensor: TensorSpec | None = None
    unit: str | None = None  # the stage-3 unit gathering it (`zero.plan(..., step=, batch=)`)
    meant: bool = False  # whether this stage splits the leaf at rest (`stage_splits`)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Every leaf's `LeafPlan` for one state structure, computed once (`ZeroShard.layout`) and
    read by everything that needs a spec: storage, the hook, the gathers, the step's gradients,
    offload, report, describe, plan and checkpoints."""

    treedef: object
    plans: tuple[LeafPlan, ...]
    # the parameter paths that lie in a stack of layers, as Flax built them or a step's calls
    # revealed them (`flax.stacks`, `flax.units.revealed_stacks`); None until something has
    # said: a provisional layout, with no stacks, that the first step's facts re-decide
    stacks: frozenset | None = None

    def shardings(self, mesh):
        """The storage NamedShardings (spec and memory kind) as a pytree of the state's
        structure."""
        return jax.tree_util.tree_unflatten(
            self.treedef,
            [
                NamedSharding(mesh, p.spec, memory_kind=None if p.memory == DEVICE else p.memory)
                for p in self.plans
            ],
        )

    @functools.cached_property
    def params(self) -> dict[str, LeafPlan]:
        """{parameter path inside `params` ('Dense_0/kernel'): its plan}."""
        return {
            p.path.split("/", 1)[1] if "/" in p.path else "": p
            for p in self.plans
            if p.category == PARAMS
        }

    def param_plan(self, path, leaf) -> LeafPlan | None:
        """The plan of the state parameter at `path` (keys below `params`) if `leaf` has its
        shape; None for a leaf the state does not hold (a step may pass anything)."""
        plan = self.params.get(path_str(path))
        return plan if plan is not None and plan.shape == tuple(np.shape(leaf)) else None

    def param_specs(self, params, which: str = "spec"):
        """A pytree like `params` of each parameter's `which` spec ('spec': storage,
        'grad_spec': reduced gradient, 'sharded_spec': split over the ZeRO axis); P() for
        leaves the state does not hold."""

        def spec(path, leaf):
            plan = self.param_plan(path, leaf)
            return P() if plan is None else getattr(plan, which)

        return jax.tree_util.tree_map_with_path(spec, params)


def with_units(plans, units) -> list[LeafPlan]:
    """`plans` with each parameter's `unit`: the outermost of `units` (module paths below
    `params`) its path lies under."""

    def unit_of(plan):
        inside = [u for u in units if plan.path.startswith(f"{PARAMS}/{u}/")]
        return min(inside, key=len) if plan.category == PARAMS and inside else None

    return [dataclasses.replace(p, unit=unit_of(p)) for p in plans]


def key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path) -> str:
    return "/".join(key_name(k) for k in path)


def split_spec(
    shape, n: int, cfg: ZeroConfig, path: str = "", tensor=None, stacked: bool = False
) -> tuple[P, str]:
    """Spec for a leaf that this stage shards over `cfg.axis` (`n` devices), and the reason
    for the choice: the user's `rules` on `path` first, else the default rule. `tensor`, the
    leaf's tensor-parallel `TensorSpec` (if the model declares any), stays in the spec; the
    ZeRO axis goes on a dimension it leaves free, else joins one of its axes when the split
    divides. `stacked`: dim 0 is a stack's layers (as Flax says: `StateLayout.stacks`), split
    only when nothing else is."""
    tensor = tensor or TensorSpec((None,) * len(shape), (1,) * len(shape))
    return _rule_spec(shape, n, cfg, path, tensor) or _default_spec(shape, n, cfg, tensor, stacked)


def _rule_spec(shape, n: int, cfg: ZeroConfig, path: str, tensor) -> tuple[P, str] | None:
    """The spec the first of the user's `rules` matching `path` gives, None if none does."""
    ndim = len(shape)
    local = [size // div for size, div in zip(shape, tensor.divisors, strict=True)]
    for pattern, dim in cfg.rules:
        if not re.search(pattern, path):
            continue
        if dim is None:
            return tensor.spec(), f"replicated: rule {pattern!r}"
        if not -ndim <= dim < ndim:
            raise ZeroError(
                f"rule {pattern!r} splits dim {dim} of {path!r}, which has shape {tuple(shape)}."
            )
        dim %= ndim
        if local[dim] % n:
            raise ZeroError(
                f"rule {pattern!r} splits dim {dim} of {path!r} (shape "
                f"{tuple(shape)}), which does not divide by {n} devices; "
                "name another dim or None to replicate it."
            )
        return tensor.spec(dim, cfg.axis), f"sharded dim {dim} (rule {pattern!r})"
    return None


def _default_spec(shape, n: int, cfg: ZeroConfig, tensor, stacked: bool) -> tuple[P, str]:
    """The default rule: the last dim that divides by `n` devices (dim 0 of a stack last),
    nothing below the persistence threshold."""
    ndim = len(shape)
    # the sizes each tensor-parallel shard has
    local = [size // div for size, div in zip(shape, tensor.divisors, strict=True)]
    if n == 1:
        return tensor.spec(), "replicated: one device"
    if math.prod(local) < cfg.persistence_threshold or ndim == 0:
        return tensor.spec(), "replicated: below persistence threshold"
    divisible = [d for d in range(ndim) if local[d] % n == 0]
    if not divisible:
        return tensor.spec(), f"replicated: no dim divides by {n}"
    dim = max(divisible, key=lambda d: (tensor.axes[d] is None, d > 0 or not stacked, -d))
    why = " (dim 0: a stack's layers)" if stacked and dim > 0 else ""
    # a split past a layer's first dim (of size > 1) is not a block of rows: XLA lays the
    # gathered shards out by that dim, and copies them back around every collective
    first = next((d for d in range(int(stacked), ndim) if shape[d] > 1), dim)
    if dim > first and local[first] % n:
        why += (
            f"; re-laid out around each collective: dim {first} ({local[first]}) does not "
            f"divide by {n}"
        )
    return tensor.spec(dim, cfg.axis), f"sharded dim {dim}{why}"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A leaf's tensor-parallel layout as the model declares it: per dimension the mesh axes
    (None, a name or a tuple of names) and how many ways they split it."""

    axes: tuple
    divisors: tuple

    def spec(self, dim: int | None = None, axis=None) -> P:
        """This layout as a PartitionSpec, with the ZeRO `axis` added on `dim` (outermost)."""
        entries = list(self.axes)
        if dim is not None:
            entries[dim] = spec_entry((*spec_names(axis), *spec_names(entries[dim])))
        return P(*entries) if any(e is not None for e in entries) else P()


def category_of(path) -> str:
    """PARAMS, OPT_STATE or OTHER from a leaf's path: the `params` / `opt_state` field or key,
    or position 0 / 1 of a tuple state `(params, opt_state, *others)`."""
    if not path:
        return OTHER
    if isinstance(path[0], jax.tree_util.SequenceKey):
        return {0: PARAMS, 1: OPT_STATE}.get(path[0].idx, OTHER)
    head = key_name(path[0])
    return head if head in (PARAMS, OPT_STATE) else OTHER


def _state_spec(path, leaf, param_specs: dict, cfg: ZeroConfig, n: int) -> tuple[P, str]:
    """(spec, reason) of an optimizer-state leaf or another field's, once the parameters'
    specs (`param_specs`) are known."""
    cat = category_of(path)
    if cat == OPT_STATE and len(path) > 1 and key_name(path[1]) == PER_DEVICE:
        return P(cfg.axis), "per-device buffer"
    if cat == OPT_STATE:
        tensor_only = not cfg.shards_optimizer_state
        return _follow_param(path_str(path[1:]), leaf.shape, param_specs, cfg, n, tensor_only)
    return _other_spec(path_str(path), leaf, param_specs, cfg, n)


def _param_specs(leaf, sub: str, cfg: ZeroConfig, n: int, layout, stacks) -> tuple:
    """(split spec, spec at rest, gradient spec, reason) of the parameter at `sub`."""
    sharded, reason = split_spec(leaf.shape, n, cfg, sub, tensor=layout, stacked=sub in stacks)
    whole = layout.spec() if layout else P()  # over the ZeRO axis
    spec = sharded if cfg.shards_parameters else whole
    grad = sharded if cfg.shards_optimizer_state else whole  # reduce-scattered
    return sharded, spec, grad, reason


def stage_splits(cfg: ZeroConfig, category: str, floating=False, mirrors=False) -> bool:
    """Whether `cfg`'s stage splits a leaf of `category` at rest: the optimizer state from
    stage 1, the parameters at stage 3 (gradients are not stored), and a floating leaf of
    the state's other fields as what it is like: at stage 3 every one (a frozen base model in
    its own field), from stage 1 one that `mirrors` a parameter (its path ends with the
    parameter's and it has its shape: an EMA of the parameters, optimizer-like state)."""
    if category == OPT_STATE:
        return cfg.shards_optimizer_state
    if category == PARAMS:
        return cfg.shards_parameters
    return floating and (cfg.shards_parameters or (mirrors and cfg.shards_optimizer_state))


def plan_state(
    state,
    cfg: ZeroConfig,
    axis_size: int,
    tensor: dict | None = None,
    stacks: Collection | None = None,
) -> StateLayout:
    """The `StateLayout` of `state` (a pytree of arrays or ShapeDtypeStructs) holding its
    parameters under a `params` field or key, or a tuple `(params, opt_state, ...)`. `tensor`
    maps parameter paths to their `TensorSpec`; `stacks`, the parameter paths a lifted
    transform stacks, as Flax built them or a step's calls revealed them; None where nothing
    has said yet (a provisional layout with no stacks: never guessed from shapes). Use
    `ZeroShard.layout`, which caches it."""
    tensor = tensor or {}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    _check_has_params(state, params_by_path(state))
    known = frozenset(stacks) if stacks is not None else None
    stacks = known or frozenset()
    param_specs = {}
    plans = []
    for path, leaf in leaves:
        cat = category_of(path)
        sharded = dim = grad = layout = None  # parameters only
        if cat == PARAMS:
            sub = path_str(path[1:])
            layout = tensor.get(sub)
            sharded, spec, grad, reason = _param_specs(leaf, sub, cfg, axis_size, layout, stacks)
            param_specs[sub] = (tuple(leaf.shape), sharded, reason)
            if not cfg.shards_parameters:
                reason = f"replicated: stage {cfg.stage} keeps parameters whole"
            if layout and any(layout.axes):
                reason += f" (tensor axes {layout.spec()})"
            dim = split_dim(sharded, cfg.axis)
        else:
            spec, reason = _state_spec(path, leaf, param_specs, cfg, axis_size)
        meant = bool(leaf.shape) and stage_splits(
            cfg, cat, _floating(leaf), _mirrored(path_str(path), leaf.shape, param_specs)
        )
        plans.append(
            LeafPlan(
                path_str(path),
                cat,
                tuple(leaf.shape),
                str(leaf.dtype),
                spec,
                reason,
                _memory_kind(cat, path, leaf, cfg),
                leaf.dtype.itemsize,
                sharded_spec=sharded,
                split_dim=dim,
                grad_spec=grad,
                tensor=layout,
                meant=meant,
            )
        )
    _warn_unmatched_rules(cfg, [*param_specs, *(x.path for x in plans if x.category == OTHER)])
    return StateLayout(treedef, tuple(plans), known)


def _warn_unmatched_rules(cfg: ZeroConfig, paths: list) -> None:
    """Warn about each of the user's `rules` that no parameter or other-state path matches: a
    typo there would otherwise leave the default layout silently in place. (Stage 0 splits
    nothing: `inert_options` says the rules do nothing there.)"""
    if not cfg.shards_optimizer_state:
        return
    for pattern, _ in cfg.rules:
        if not any(re.search(pattern, p) for p in paths):
            warn(
                f"zerojax: rule {pattern!r} matches no leaf, so it changes nothing; parameter "
                f"paths look like {paths[0]!r} (`zero.plan(state)` lists them all)."
            )


def _check_has_params(state, params: dict) -> None:
    """A state without parameters fails with what zerojax needs."""
    if params:
        return
    named = PARAMS in state if isinstance(state, dict) else hasattr(state, PARAMS)
    raise ZeroError(
        "the state's `params` holds no arrays: there is nothing to train or shard (did the "
        "model's init return empty variables?)."
        if named
        else f"the state ({type(state).__name__}) has no `params`: zerojax needs the "
        "parameters under a field or key named `params` (a flax TrainState, or a "
        "dict/dataclass with `params` and `opt_state`), or a tuple `(params, opt_state)`."
    )


def params_by_path(state) -> dict:
    """{parameter path below `params`: leaf} of a state."""
    return {
        path_str(p[1:]): x
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if category_of(p) == PARAMS
    }


def _floating(leaf) -> bool:
    return bool(jax.dtypes.issubdtype(leaf.dtype, np.floating))  # typed PRNG keys: False


def _mirrored(path: str, shape, param_specs: dict) -> str | None:
    """The path of the parameter a leaf at `path` mirrors (its path ends with the parameter's,
    its shape is the parameter's), the longest such; None when it mirrors none. An optimizer
    leaf that mirrors a parameter follows it (Adam's moments); so does an EMA."""
    for ppath in sorted(param_specs, key=len, reverse=True):
        if param_specs[ppath][0] == tuple(shape) and (path == ppath or path.endswith("/" + ppath)):
            return ppath
    return None


def _other_spec(path: str, leaf, param_specs: dict, cfg: ZeroConfig, n: int):
    """A leaf of the state's other fields: split as `stage_splits` says (like the parameter
    it mirrors, else by the default rule and the user's rules on its path), else whole."""
    mirrored = _mirrored(path, leaf.shape, param_specs)
    if not (leaf.shape and stage_splits(cfg, OTHER, _floating(leaf), mirrored is not None)):
        why = "not floating" if not _floating(leaf) else f"stage {cfg.stage} keeps it whole"
        return P(), f"replicated: other state, {why}"
    for pattern, dim in cfg.rules:  # the user's rules first, on the leaf's own path
        if dim is None and re.search(pattern, path):
            return P(), f"replicated: rule {pattern!r}"
    if mirrored is not None:
        return param_specs[mirrored][1], f"{param_specs[mirrored][2]} (like params/{mirrored})"
    return split_spec(leaf.shape, n, cfg, path)


def split_dim(spec: P, axis) -> int | None:
    """The dimension `spec` splits over `axis`, or None when it keeps the leaf whole."""
    for dim, name in enumerate(spec):
        if name == axis or (isinstance(name, tuple) and axis in name):
            return dim
    return None


def _memory_kind(cat: str, path, leaf, cfg: ZeroConfig) -> str:
    """HOST for offloaded leaves: every parameter with offload_param; with offload_optimizer
    every array of the optimizer state (master weights, moments, the 'reduced' accumulation
    buffer) except scalars (step counts, loss scale: read by the host loop) and the per-device
    buffers that local accumulation adds to on every micro-batch."""
    if cat == PARAMS and cfg.offloads_params:
        return HOST
    if (
        cat == OPT_STATE
        and cfg.offloads_optimizer
        and len(leaf.shape) >= 1
        and not (len(path) > 1 and key_name(path[1]) == PER_DEVICE)
    ):
        return HOST
    return DEVICE


def _follow_param(
    path: str, shape, param_specs: dict, cfg: ZeroConfig, n: int, tensor_only: bool = False
):
    """An optimizer leaf takes the spec of the parameter whose path ends its own and whose shape
    is its own (`tensor_only`, stage 0: only its tensor-parallel axes); any other leaf (factored
    moments, counts) gets the default rule."""
    ppath = _mirrored(path, shape, param_specs)
    if ppath is not None:
        _, spec, reason = param_specs[ppath]
        if tensor_only:
            kept = [_without(e, cfg.axis) for e in spec]
            return P(*kept) if any(kept) else P(), "replicated: stage 0"
        return spec, reason
    if tensor_only:
        return P(), "replicated: stage 0"
    whole = TensorSpec((None,) * len(shape), (1,) * len(shape))
    return _default_spec(shape, n, cfg, whole, stacked=False)


def _without(entry, axis):
    """A spec entry with the ZeRO axis (or axes) taken out."""
    return spec_entry(tuple(a for a in spec_names(entry) if a not in spec_names(axis)))


def spec_names(entry) -> tuple:
    """A spec entry (None, an axis name or a tuple of them) as a tuple of names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(names: tuple):
    """The spec entry for `names`: None, one name, or the tuple."""
    return None if not names else names[0] if len(names) == 1 else names


def placed_state(state, shardings):
    """`state` as the step takes it: a leaf besides the parameters and optimizer state that the
    layout keeps whole on every device (a metric's count, an RNG key: an NNX object made outside
    `zero.init`) is placed there, as `jax.jit` and `nnx.jit` place such an argument; any other
    leaf not placed by zero fails with a clear message (not an XLA device mismatch)."""
    flat, tree = jax.tree_util.tree_flatten_with_path(state)
    out = []
    for (path, leaf), want in zip(flat, jax.tree_util.tree_leaves(shardings), strict=True):
        have = getattr(leaf, "sharding", None)
        if have is not None and have.is_equivalent_to(want, np.ndim(leaf)):
            out.append(leaf)
            continue
        mesh = getattr(have, "mesh", None)
        on_a_mesh = isinstance(mesh, jax.sharding.Mesh)
        if category_of(path) == OTHER and want.is_fully_replicated and not on_a_mesh:
            out.append(jax.device_put(leaf, want))
            continue
        if on_a_mesh and mesh != want.mesh:
            how = (
                f"it lives on a mesh {dict(mesh.shape)}, this zero_shard's is "
                f"{dict(want.mesh.shape)}: a state from another zero_shard?"
            )
        else:
            how = f"it has {have}, expected {want.spec} on the mesh"
        raise ZeroError(
            f"state leaf {path_str(path)} is not placed as this zero_shard expects ({how}): "
            "create the state with this zero's zero.init(...), or move it here with "
            "zero.shard(state)."
        )
    return jax.tree_util.tree_unflatten(tree, out)


def relaid(state, provisional, shardings, donate: bool):
    """`state` with each leaf a provisional layout placed (`provisional`: its shardings, None
    when nothing moves) moved to `shardings`, the layout its step's facts decided: once, at the
    step's first call (`donate`: the old copy's memory goes, as the step would donate it). An
    abstract leaf takes the new sharding."""
    if provisional is None:
        return state

    def move(leaf, old, new):
        have = getattr(leaf, "sharding", None)
        ndim = np.ndim(leaf)
        if have is None or not have.is_equivalent_to(old, ndim) or have.is_equivalent_to(new, ndim):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=new)
        return jax.device_put(leaf, new, donate=donate)

    return jax.tree_util.tree_map(move, state, provisional, shardings)
