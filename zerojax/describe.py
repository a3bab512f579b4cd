"""`zero.describe(state)`: every leaf of a train state with where it lives, and a guard against
leaves that stay replicated.

The table reads the state's own shardings (or, for an unplaced state, the ones the rules would
give it): path, shape, dtype, PartitionSpec, memory kind and bytes per device. The guard is
MaxText's "sufficiently sharded" check: of the bytes this stage is meant to split (optimizer
state from stage 1, parameters too at stage 3), the fraction that stays whole on every device.
Above 1% it warns with the largest such leaves; above `tolerance`, if given, it raises.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import numpy as np

from zerojax.config import ZeroError
from zerojax.errors import ZeroWarning
from zerojax.rules import category_of, path_str, stage_splits

WARN_FRACTION = 0.01


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
        return "\n".join(lines) + "\n"


def leaf_rows(zero, state, units: dict | None = None) -> list[LeafRow]:
    """A `LeafRow` per leaf of `state` (arrays or ShapeDtypeStructs, placed or not): its own
    sharding when it has one, else the one `zero` gives it; `units`: {path: its unit}."""
    shardings = jax.tree_util.tree_leaves(zero.state_shardings(state))
    rows = []
    for (path, leaf), want in zip(
        jax.tree_util.tree_flatten_with_path(state)[0], shardings, strict=True
    ):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            sharding = want
        shape, dtype = tuple(np.shape(leaf)), leaf.dtype  # numpy or typed PRNG key dtype
        split = bool(shape) and stage_splits(zero.config, category_of(path))
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


def describe(zero, state, tolerance: float | None = None, units: dict | None = None) -> Description:
    """The `Description` of `state` under `zero`, with the replicated-bytes guard; `units`:
    {leaf path: its unit}, shown as a column when given."""
    out = Description(tuple(leaf_rows(zero, state, units)), zero.mesh.size, zero.config.stage)
    fraction = out.replicated_fraction
    names = ", ".join(
        f"{r.path} {r.shape} ({r.total_bytes:,} bytes)" for r in out.largest_replicated()
    )
    if tolerance is not None and fraction > tolerance:
        raise ZeroError(
            f"{fraction:.2%} of the bytes stage {zero.config.stage} should split "
            f"stay replicated (tolerance {tolerance:.2%}); largest: {names}. Lower "
            "persistence_threshold, add a rule naming a dimension, or pad shapes "
            "to a multiple of the device count."
        )
    if fraction > WARN_FRACTION:
        warnings.warn(
            f"zerojax: {fraction:.2%} of the bytes stage {zero.config.stage} should "
            f"split stay replicated on every device; largest: {names}.",
            category=ZeroWarning,
            stacklevel=3,
        )
    return out


def _spec_text(spec) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"
