"""What one model call through the per-device hook does with each leaf and argument.

`plan_call` decides it from shapes alone, without tracing anything: for each variable leaf
whether it is a parameter the call receives whole (through `comm.device_copies`), a
parameter of a unit (its shard at stage 3, its split gradient at stages 1-2) or other model
state (folded keys, combined written state), with its storage and gradient specs and compute
dtype; which units take part and the layers of a scanned one; which array argument is the
batch. `zerojax.engine.hook` runs a `CallPlan`; tests build one for any model's variables.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax.core.errors import ZeroError, warn
from zerojax.core.policy import UnitPolicy
from zerojax.core.rules import PARAMS, StateLayout, key_name, path_str

WHOLE, UNIT, OTHER = "whole", "unit", "other"  # a leaf's role in a call


class ApplyHookError(ZeroError):
    """The model's inputs or outputs cannot be split per device; the message says why."""


@dataclasses.dataclass(frozen=True)
class LeafCall:
    """One variable leaf of a call: how it enters the per-device model."""

    path: str  # below `params` for a parameter ('Dense_0/kernel'), else the whole path
    role: str  # WHOLE, UNIT or OTHER
    store: P = P()  # its storage spec (P() for other state)
    grad: P = P()  # where its reduced gradient lives
    split_dim: int | None = None  # the dim the ZeRO axes split (None: replicated)
    stored_ndim: int = 0  # its ndim as the state stores it (a scanned stack's with its layers)
    compute_dtype: object = None  # the 16-bit dtype the model computes in; None: as stored


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """Each leaf's `LeafCall`, the units gathered (or reduced in place), the stacked layer
    dims of each unit, and per array argument whether it is split on the batch."""

    leaves: tuple[LeafCall, ...]
    layers: Mapping[str, tuple]  # unit -> the leading dims its call does not see (a stack's)
    in_place: bool  # stages 1-2: units use the step's whole weights and gather nothing
    batch_args: tuple[bool, ...]  # per array argument of the call: split on the batch

    @property
    def units(self) -> tuple[str, ...]:
        """The paths of the units taking part in the call."""
        return tuple(self.layers)

    def where(self, role: str) -> list[int]:
        """Positions of the leaves with `role`."""
        return [i for i, leaf in enumerate(self.leaves) if leaf.role == role]

    @property
    def split_in_place(self) -> list[int]:
        """Stages 1-2: positions of the unit leaves that enter split as their gradient is, and
        so need the step's whole copy beside them."""
        if not self.in_place:
            return []
        return [i for i in self.where(UNIT) if self.leaves[i].split_dim is not None]

    @property
    def split_dims(self) -> dict:
        """{parameter path: the dim a unit gathers it on}, None for a leaf it receives whole."""
        return {
            x.path: x.split_dim if x.role == UNIT else None for x in self.leaves if x.role != OTHER
        }

    @property
    def stored_ndim(self) -> dict:
        return {x.path: x.stored_ndim for x in self.leaves if x.role != OTHER}


@dataclasses.dataclass(frozen=True)
class FoundUnits:
    """The units an abstract trace of a call found: {unit path: ((leaf below the unit, ndim
    its call sees), ...)}, and whether a stacked unit can be handed its layer index at stages
    1-2 (Linen; NNX stacks are reduced with the whole step instead)."""

    leaves: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    stacks_indexable: bool = True


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def on_batch(x, batch_rows: set) -> bool:
    """Whether `x` has the batch's leading dimension (one of the global batch sizes)."""
    return np.ndim(x) >= 1 and np.shape(x)[0] in batch_rows


def with_values(flat: list, positions: list, values, tree):
    """(args, kwargs) from flattened call arguments with the array leaves at `positions`
    replaced by `values` (traced per-device or abstract stand-ins)."""
    local = list(flat)
    for i, v in zip(positions, values, strict=True):
        local[i] = v
    return jax.tree_util.tree_unflatten(tree, local)


def plan_call(
    layout: StateLayout,
    policy: UnitPolicy,
    variables,
    arrays: list,
    batch_rows: set,
    found: FoundUnits = FoundUnits(),
) -> CallPlan:
    """The plan of a call with `variables` (arrays or shape structs) and array arguments
    `arrays`; `batch_rows` are the step's global batch sizes, `found` the units found in the
    model (none by default)."""
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    params = {path_str(p[1:]): np.shape(x) for p, x in flat if p and key_name(p[0]) == PARAMS}
    layers = {u: _layer_dims(leaves, u, params) for u, leaves in found.leaves.items()}
    if not policy.shards_parameters and not found.stacks_indexable:
        layers = {u: dims for u, dims in layers.items() if not dims}
    dtype = policy.compute_dtype
    leaves = []
    for p, x in flat:
        if not (p and key_name(p[0]) == PARAMS):
            leaves.append(LeafCall(jax.tree_util.keystr(p), OTHER))
            continue
        path, plan = path_str(p[1:]), layout.param_plan(p[1:], x)
        spec, grad = (P(), P()) if plan is None else (plan.spec, plan.grad_spec or P())
        unit = next((u for u in layers if path.startswith(u + "/")), None)
        if (
            unit is not None
            and plan is not None
            and _whole_per_step(path, plan, x, layers[unit], policy, layout.stacks is None)
        ):
            unit = None  # gathered once per step with the whole parameters, not per layer
        leaves.append(
            LeafCall(
                path,
                WHOLE if unit is None else UNIT,
                spec,
                grad,
                None if plan is None else plan.split_dim,
                len(np.shape(x)),
                dtype,
            )
        )
    batch = [on_batch(x, batch_rows) for x in arrays]
    if not any(batch):
        raise ApplyHookError(
            "zerojax: no argument of state.apply_fn has the batch's leading dimension "
            f"{sorted(batch_rows)}, so the model cannot be split per device. Pass batch "
            "arrays with the batch first, or use zero_shard(..., explicit_collectives=False)."
        )
    in_place = bool(layers) and not policy.shards_parameters
    return CallPlan(tuple(leaves), layers, in_place, tuple(batch))


def _whole_per_step(
    path: str, plan, leaf, layer_dims: tuple, policy: UnitPolicy, provisional: bool
) -> bool:
    """Whether a unit's stacked leaf is gathered (and reduced) once per step, whole, rather
    than layer by layer: its layers are small, or it is split on a layer dim, which no single
    layer can gather: a user's rule did it (said here), or a `provisional` layout made before
    anything said where the stacks are (the step re-decides it from its calls' facts)."""
    if _small_layers(leaf, layer_dims, policy.persistence_threshold):
        return True
    if plan.split_dim is None or plan.split_dim >= len(layer_dims):
        return False
    if not provisional:
        warn(
            f"zerojax: {path} is split along its stack's layer dimension {plan.split_dim}, so "
            "each step gathers it (stage 3) and reduces its gradient whole, once, instead of "
            "one layer at a time. Split "
            f"another dimension: zero_shard(rules=(({path!r}, {len(layer_dims)}),))."
        )
    return True


def _small_layers(leaf, layer_dims: tuple, threshold: int) -> bool:
    """Whether a unit's stacked `leaf`, split at rest, is below the persistence threshold
    layer by layer: gathering it (stage 3) and reducing its gradient (stages 1-3) once per
    step beats a small collective per layer."""
    if not layer_dims:
        return False
    return math.prod(np.shape(leaf)) // math.prod(layer_dims) < threshold


def _layer_dims(leaves: tuple, unit: str, stored: dict) -> tuple:
    """The leading dims a lifted unit's call does not see (its stack's layers), () if none:
    `leaves` are ((leaf below the unit, ndim the call sees), ...)."""
    if not leaves:
        return ()
    leaf, ndim = leaves[0]
    shape = stored[f"{unit}/{leaf}"]
    return tuple(shape[: len(shape) - ndim])
