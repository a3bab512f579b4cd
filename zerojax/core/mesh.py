"""Device meshes for zerojax.

Axes are created with `AxisType.Auto` on purpose: XLA's partitioner then propagates shardings
through an unchanged model (with `Explicit` axes, which `jax.make_mesh` defaults to, Flax
embedding lookups need explicit output shardings), and zerojax places its own collectives.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zerojax.core.errors import ZeroError


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


# GPUs `gpu_devices` compiles for: name -> the target config file in zerojax/gpu_specs/ (XLA:GPU's
# device description of one such GPU, which is all its compiler needs to know of it)
GPU_KINDS = {"a100": "a100_80gb", "h100": "h100", "h200": "h200", "b200": "b200"}
GPU_PLUGIN_EXTRA = "pip install 'zerojax[gpu-compile]'"


def gpu_target(spec: str) -> tuple[str, int, int]:
    """('h100', nodes, GPUs per node) of a GPU target such as 'h100:8' or 'H100:2x8'."""
    import re

    m = re.fullmatch(r"([a-z0-9]+):(?:(\d+)x)?(\d+)", spec.strip().lower())
    if not m or m.group(1) not in GPU_KINDS or int(m.group(3)) < 1 or int(m.group(2) or 1) < 1:
        raise ZeroError(
            f"{spec!r} is not a GPU target: write KIND:GPUS or KIND:NODESxGPUS, e.g. 'h100:8' "
            f"or 'h100:2x8', with KIND one of {', '.join(GPU_KINDS)}."
        )
    return m.group(1), int(m.group(2) or 1), int(m.group(3))


def gpu_devices(spec: str) -> list:
    """Compile-only devices of `spec`: 'h100:8' (one node of 8 GPUs) or 'h100:2x8' (2 nodes of
    8, InfiniBand between nodes; devices are grouped by node as processes are), and 'a100',
    'h200', 'b200'. XLA:GPU compiles a step for them with no GPU present (`zero.report`,
    `zerojax plan --topology`): its own program (NCCL collectives after its combiners, the
    latency-hiding schedule, its memory), with default gemm configs (no autotuning)."""
    from jax.experimental import topologies

    kind, nodes, per_node = gpu_target(spec)
    if not has_gpu_compiler():
        raise ZeroError(
            f"compiling for {spec!r} needs JAX's CUDA plugin (no GPU and no NVIDIA libraries "
            f"are needed): {GPU_PLUGIN_EXTRA}, which installs the plugin of your jax release."
        )
    platforms = jax.config.jax_platforms  # JAX_PLATFORMS, as jax read it when imported
    if (platforms or "").strip().lower() != "cpu":
        raise ZeroError(
            f"compiling for {spec!r} with no GPU present needs JAX_PLATFORMS=cpu in the "
            f"environment before jax is imported (jax has {platforms!r}): else the CUDA plugin "
            "looks for a GPU (and, when it finds none, offers no compile-only GPUs). `zerojax "
            "plan --topology` sets it itself."
        )
    described = topologies.get_topology_desc(
        platform="cuda", target_config=_gpu_spec(kind), topology=f"{nodes}x1x{per_node}"
    )
    return list(described.devices)


def has_gpu_compiler() -> bool:
    """Whether JAX's CUDA plugin, which compiles for GPUs that are not present, is installed."""
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def _gpu_spec(kind: str) -> str:
    """The XLA:GPU target config of one GPU of `kind` ('h100'), as text."""
    import importlib.resources

    spec = importlib.resources.files("zerojax") / "gpu_specs" / f"{GPU_KINDS[kind]}.txtpb"
    return spec.read_text()


def gpu_memory_bytes(spec: str) -> int:
    """Device memory of one GPU of `spec` ('h100:8' -> 84,942,979,072 bytes: an H100 80GB's
    memory as CUDA reports it, less than 80 GiB)."""
    import re

    found = re.search(r"device_memory_size: (\d+)", _gpu_spec(gpu_target(spec)[0]))
    assert found, spec  # every file in gpu_specs/ has it
    return int(found.group(1))


def without_memories(devices) -> bool:
    """Whether `devices` describe no memories: the CUDA plugin's compile-only GPUs do not, and
    JAX drops every memory kind on them (a host-offloaded step is lowered on CPU devices and
    compiled for them instead: zerojax.inspect.cross_compile). libtpu's devices do describe
    theirs."""
    return any(not d.addressable_memories() for d in devices)
