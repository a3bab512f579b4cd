"""Device meshes for zerojax.

Axes are created with `AxisType.Auto` on purpose: XLA's partitioner then propagates shardings
through an unchanged model (with `Explicit` axes, which `jax.make_mesh` defaults to, Flax
embedding lookups need explicit output shardings), and zerojax places its own collectives.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zerojax.core.config import ZeroError


def make_mesh(devices=None, axis: str = "data", *, local: int | None = None) -> Mesh:
    """A 1-D mesh of `devices` (default: all devices of all processes) on `axis`; with `local`,
    a ('node', 'local') mesh of groups of `local` devices (a node: devices are grouped by
    process first, so `local=jax.local_device_count()` makes one group per process), as
    ZeRO++'s hpZ and qgZ and MiCS use it."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device.")
    if local is None:
        return Mesh(np.array(devices), (axis,), axis_types=(AxisType.Auto,))
    if not isinstance(local, int) or local < 1 or len(devices) % local:
        raise ZeroError(
            f"make_mesh(local={local!r}): the group size must divide the {len(devices)} devices."
        )
    devices.sort(key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(len(devices) // local, local)
    return Mesh(grid, ("node", "local"), axis_types=(AxisType.Auto, AxisType.Auto))


def default_mesh(cfg) -> Mesh:
    """The mesh `zero_shard` uses when given none: all devices on the config's axis, or a
    ('node', 'local') mesh with hpZ or MiCS, whose group size is the node's."""
    group = max(cfg.hpz_partition_size, cfg.mics_shard_size)
    if group > 1:
        return make_mesh(local=group)
    return make_mesh(axis=cfg.axis) if isinstance(cfg.axis, str) else make_mesh()


def tpu_devices(topology: str) -> list:
    """The abstract devices of a TPU slice such as 'v5e:2x4' (8 chips) or 'v4:2x2x2', from
    libtpu with no TPU present: a mesh of them compiles a step ahead of time for that slice
    (`zero.report`, `zerojax plan --topology`), nothing can run on them."""
    import importlib.util

    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:
        raise ZeroError(
            f"compiling for the TPU topology {topology!r} needs libtpu, which is not installed: "
            "pip install 'zerojax[tpu]' (it installs the libtpu release paired with your jax)."
        )
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as e:  # libtpu's own message, whatever its type, names what it rejected
        raise ZeroError(
            f"libtpu could not describe the TPU topology {topology!r}: "
            f"{str(e).splitlines()[0][:300]} A topology is a TPU generation and its chip "
            "grid, e.g. 'v5e:2x4', 'v5e:4x4', 'v4:2x2x2'."
        ) from None
