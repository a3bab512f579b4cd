"""What `zero_shard` resolves once, as a value the step receives: the options resolved for a
mesh, the mesh, the axes of its collectives and the views of the options each reader takes.
The step and everything below it read a `Placement`; none calls back into the API object."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.comm.hierarchy import NODE, Comm, comm_for
from zerojax.core.config import ZeroConfig
from zerojax.core.errors import ZeroError
from zerojax.core.mesh import default_mesh
from zerojax.core.policy import UnitPolicy, UpdatePolicy
from zerojax.core.rules import path_str


@dataclasses.dataclass(frozen=True)
class Placement:
    """One config placed on one mesh. `config`: the options resolved for it (batch sizes and
    'auto' known for its device count, `axis` naming the axes the state is split over);
    `comm`: which axes each collective runs over; `unit`, `update`: what a model call and the
    managed update read. `warned`: the causes already warned about under it (each is said
    once), the one thing in it that changes."""

    config: ZeroConfig
    mesh: Mesh
    comm: Comm
    unit: UnitPolicy
    update: UpdatePolicy
    warned: set = dataclasses.field(default_factory=set, compare=False, repr=False)

    @classmethod
    def resolve(cls, requested: ZeroConfig, mesh: Mesh | None = None) -> Placement:
        """`requested` placed on `mesh` (default: every device on the config's axis)."""
        mesh = default_mesh(requested) if mesh is None else mesh
        comm = comm_for(mesh, requested)
        config = requested.for_devices(comm.data_size).replace(axis=comm.shard_axis)
        return cls(config, mesh, comm, UnitPolicy.of(config), UpdatePolicy.of(config))


def inert_options(requested: ZeroConfig, placement: Placement) -> dict[str, str]:
    """{option: when and why it does nothing} for the options `requested` set that the
    resolved options leave without effect (`ZeroConfig.inert_options` of the resolved config:
    `gradient_accumulation_steps='auto'` known to be 1 makes `accumulate` inert), and `axis`
    on a ('node', 'local') mesh, whose both axes zerojax shards over."""
    idle = placement.config.inert_options()
    shard_axis = placement.comm.shard_axis
    if NODE in placement.mesh.shape and requested.axis not in ("data", shard_axis):
        idle["axis"] = "on a ('node', 'local') mesh: zerojax shards over both its axes"
    return idle


def place_batch(placement: Placement, batch):
    """Each batch leaf split on its leading dim over the axis (scalars replicated). In a
    multi-process run each process passes its own slice of the global batch."""
    multiprocess, mesh, comm = jax.process_count() > 1, placement.mesh, placement.comm
    n = comm.data_size
    leading = {
        path_str(p) or "(root)": np.shape(x)[0]
        for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
        if np.ndim(x)
    }
    if len(set(leading.values())) > 1:
        raise ZeroError(
            f"batch leaves have different leading dimensions ({leading}): "
            "zerojax splits every batch leaf on its first dimension, so all "
            "need the batch first and the same number of rows."
        )

    def place(path, leaf):
        if not hasattr(leaf, "shape"):
            leaf = np.asarray(leaf)
        sharding = NamedSharding(mesh, P(comm.data_axis) if np.ndim(leaf) else P())
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        abstract = isinstance(leaf, jax.ShapeDtypeStruct)  # always the global batch
        rows = np.shape(leaf)[0] if np.ndim(leaf) else 0
        rows *= jax.process_count() if multiprocess and not abstract else 1
        micro = placement.config.micro_batch_size
        if micro and np.ndim(leaf) and rows != micro * n:
            raise ZeroError(
                f"batch leaf {path_str(path) or '(root)'} has {rows} rows, but the config "
                f"says train_micro_batch_size_per_gpu {micro} x {n} devices = "
                f"{micro * n} per call of the step."
            )
        if rows % n:
            raise ZeroError(
                f"batch leaf {path_str(path) or '(root)'} has {rows} rows (shape "
                f"{np.shape(leaf)}), which does not divide by the {n} devices "
                f"of axes {comm.data_axis!r}: use a global batch that is a multiple of {n}."
            )
        if abstract:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        if multiprocess and np.ndim(leaf):
            return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))
        return jax.device_put(leaf, sharding)

    return jax.tree_util.tree_map_with_path(place, batch)
