"""`zero.describe(state)`: every leaf of a train state with where it lives, and the guard
against leaves that stay replicated.

The table reads the state's own shardings (or, for an unplaced state, the ones the rules would
give it): path, shape, dtype, PartitionSpec, memory kind and bytes per device. The guard is
MaxText's "sufficiently sharded" check: of the bytes this stage is meant to split (optimizer
state from stage 1, parameters too at stage 3), the share that stays whole on every device.
`replication_warnings` says why, one message per cause, when a zero first plans a state (at
`zero.init`, `zero.shard` or the first step), so ZeRO never silently does nothing;
`describe(..., tolerance=)` raises above a share.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from zerojax.core.config import ZeroConfig
from zerojax.core.errors import ZeroError
from zerojax.core.rules import PARAMS, LeafPlan, path_str

WARN_FRACTION = 0.01  # a cause keeping more than this share of the bytes a stage splits warns
LARGE_LEAF_BYTES = 1 << 20  # ...and so does one leaf this large that no device count divides


@dataclasses.dataclass(frozen=True)
class LeafRow:
    path: str
    shape: tuple
    dtype: str
    spec: str
    memory: str
    bytes_per_device: int
    total_bytes: int
    split: bool  # the stage means to split this leaf
    replicated: bool  # ...and it stays whole on every device
    unit: str = ""  # the unit of this parameter (stage 3: gathers it; 1-2: reduces it), if known


@dataclasses.dataclass(frozen=True)
class Description:
    """The rows of `zero.describe` and the replicated fraction; `str()` is the table."""

    rows: tuple
    devices: int
    stage: int
    # nothing has said yet where the state's stacks of layers are: its first step decides
    provisional: bool = False

    @property
    def replicated_fraction(self) -> float:
        split = sum(r.total_bytes for r in self.rows if r.split)
        return sum(r.total_bytes for r in self.rows if r.replicated) / split if split else 0.0

    def largest_replicated(self, top: int = 5) -> list:
        return sorted(
            (r for r in self.rows if r.replicated), key=lambda r: (-r.total_bytes, r.path)
        )[:top]

    def __str__(self):
        units = any(r.unit for r in self.rows)
        head = ("path", "shape", "dtype", "spec", "memory", "bytes/device") + ("unit",) * units
        cells = [head] + [
            (r.path, str(r.shape), r.dtype, r.spec, r.memory, f"{r.bytes_per_device:,}")
            + (r.unit,) * units
            for r in self.rows
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines = [
            "  ".join(
                c[i].rjust(widths[i]) if i == 5 else c[i].ljust(widths[i]) for i in range(len(head))
            ).rstrip()
            for c in cells
        ]
        lines.insert(1, "-" * len(lines[0]))
        per_device = sum(r.bytes_per_device for r in self.rows)
        total = sum(r.total_bytes for r in self.rows)
        lines.append(
            f"total: {per_device:,} bytes per device, {total:,} bytes in all "
            f"({self.devices} devices, stage {self.stage})"
        )
        lines.append(
            f"replicated: {self.replicated_fraction:.2%} of the bytes stage {self.stage} splits"
        )
        for r in self.largest_replicated():
            lines.append(f"  {r.path} {r.shape} {r.total_bytes:,} bytes")
        if self.provisional:
            lines.append(
                "layout: provisional (built where Flax did not say which parameters a lifted "
                "transform stacks); the step's first call decides it from its calls and "
                "moves the state once: zero.plan(state, step=step, batch=batch) decides it now"
            )
        return "\n".join(lines) + "\n"


def leaf_rows(zero, state, units: dict | None = None) -> list[LeafRow]:
    """A `LeafRow` per leaf of `state` (arrays or ShapeDtypeStructs, placed or not): its own
    sharding when it has one, else the one `zero` gives it; `units`: {path: its unit}."""
    layout = zero.layout(state)
    shardings = jax.tree_util.tree_leaves(layout.shardings(zero.mesh))
    rows = []
    for (path, leaf), want, plan in zip(
        jax.tree_util.tree_flatten_with_path(state)[0], shardings, layout.plans, strict=True
    ):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            sharding = want
        shape, dtype = tuple(np.shape(leaf)), leaf.dtype  # numpy or typed PRNG key dtype
        split = plan.meant
        local = sharding.shard_shape(shape)
        rows.append(
            LeafRow(
                path=path_str(path),
                shape=shape,
                dtype=str(dtype),
                spec=_spec_text(sharding.spec),
                memory=sharding.memory_kind or "device",
                bytes_per_device=math.prod(local) * dtype.itemsize,
                total_bytes=math.prod(shape) * dtype.itemsize,
                split=split,
                replicated=split and local == shape,
                unit=(units or {}).get(path_str(path), ""),
            )
        )
    return rows


def replication_warnings(plans, cfg: ZeroConfig, shard_size: int, device_count: int) -> dict:
    """{cause: message} for each reason ZeRO cannot split what this stage should: a shard
    group of one device; persistence_threshold keeping over WARN_FRACTION of those bytes whole
    (zerojax's default threshold only when it keeps nearly all of them: a model of small
    leaves); leaves no dimension of which divides by the devices. Leaves a user's rule keeps
    whole are the user's choice and say nothing."""
    stage = cfg.stage
    if not cfg.shards_optimizer_state:
        return {}
    if shard_size == 1:
        where = (
            "JAX sees one device: to simulate N CPU devices set XLA_FLAGS="
            "--xla_force_host_platform_device_count=N before jax is imported; on GPUs check "
            "CUDA_VISIBLE_DEVICES; across hosts start with `zerojax launch`"
            if device_count == 1
            else f"JAX sees {device_count} devices but this zero splits over one: pass a "
            "mesh over more of them, or a larger mics_shard_size"
        )
        return {
            "one device": f"zerojax: stage {stage} on one device splits nothing: every device "
            f"holds the whole state. {where}."
        }
    meant = [p for p in plans if p.meant]
    total = sum(p.nbytes for p in meant)
    whole = [p for p in meant if p.reason.startswith("replicated")]
    share = lambda leaves: sum(p.nbytes for p in leaves) / total if total else 0.0
    small = [p for p in whole if "persistence threshold" in p.reason]
    odd = [p for p in whole if "no dim divides" in p.reason]
    out = {}
    default = ZeroConfig.defaults()["persistence_threshold"]
    chosen = cfg.persistence_threshold != default
    if share(small) > (WARN_FRACTION if chosen else 1 - WARN_FRACTION):
        gathers = ", and stage 3 gathers none of them" if cfg.shards_parameters else ""
        out["persistence threshold"] = (
            f"zerojax: persistence_threshold={cfg.persistence_threshold:,} (DeepSpeed's "
            f"stage3_param_persistence_threshold) keeps {len(small)} leaves (those under "
            f"{cfg.persistence_threshold:,} elements) whole on every device, "
            f"{share(small):.2%} of the bytes stage {stage} "
            f"splits: {_largest(small)}. Every device stores them whole{gathers}. To split "
            f"them lower it (zerojax's default is {default:,}; 0 splits every leaf with a "
            f"dimension that divides by {shard_size})."
        )
    if share(odd) > WARN_FRACTION or any(p.nbytes >= LARGE_LEAF_BYTES for p in odd):
        out["divides nothing"] = (
            f"zerojax: {_leaves(odd)} whole on every device because no dimension divides by "
            f"{shard_size} devices, {share(odd):.2%} of the bytes stage {stage} "
            f"splits: {_largest(odd)}. Pad them to a multiple of {shard_size} (e.g. the "
            "vocabulary), or use a device count that divides one of their dimensions."
        )
    return out


def _leaves(plans: list) -> str:
    return "1 leaf stays" if len(plans) == 1 else f"{len(plans)} leaves stay"


def _largest(plans: list[LeafPlan], top: int = 5) -> str:
    """The `top` largest leaves, parameters first (their optimizer state follows them):
    'path shape (bytes)', and how many more there are."""
    ranked = sorted(plans, key=lambda p: (p.category != PARAMS, -p.nbytes, p.path))
    names = ", ".join(f"{p.path} {p.shape} ({p.nbytes:,} bytes)" for p in ranked[:top])
    return names + (f" and {len(ranked) - top} more" if len(ranked) > top else "")


def describe(zero, state, tolerance: float | None = None, units: dict | None = None) -> Description:
    """The `Description` of `state` under `zero`; raises ZeroError when more than `tolerance`
    (a fraction) of the bytes the stage splits stays whole. (Why a share stays whole was
    said when `zero` first planned the state: `replication_warnings`.) `units`: {leaf path:
    its unit}, shown as a column when given."""
    provisional = zero.config.shards_optimizer_state and zero.layout(state).stacks is None
    rows = tuple(leaf_rows(zero, state, units))
    out = Description(rows, zero.mesh.size, zero.config.stage, provisional)
    fraction = out.replicated_fraction
    if tolerance is not None and fraction > tolerance:
        names = ", ".join(
            f"{r.path} {r.shape} ({r.total_bytes:,} bytes)" for r in out.largest_replicated()
        )
        raise ZeroError(
            f"{fraction:.2%} of the bytes stage {zero.config.stage} should split "
            f"stay replicated (tolerance {tolerance:.2%}); largest: {names}. Lower "
            "persistence_threshold, add a rule naming a dimension, or pad shapes "
            "to a multiple of the device count."
        )
    return out


def _spec_text(spec) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"
