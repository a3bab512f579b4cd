"""Device meshes for zerojax.

Axes are created with `AxisType.Auto` on purpose: XLA's partitioner then propagates shardings
through an unchanged model (with `Explicit` axes, which `jax.make_mesh` defaults to, Flax
embedding lookups need explicit output shardings), and zerojax places its own collectives.
"""
from __future__ import annotations

import numpy as np
import jax
from jax.sharding import AxisType, Mesh


def make_mesh(devices=None, axis: str = "data") -> Mesh:
    """A 1-D mesh of `devices` (default: all devices of all processes) on one axis."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device.")
    return Mesh(np.array(devices), (axis,), axis_types=(AxisType.Auto,))
