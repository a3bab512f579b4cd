"""Host offload compiled for GPUs that are not here: the step lowered on N CPU devices, its
module compiled by XLA:GPU for the N compile-only GPUs.

The CUDA plugin's compile-only devices describe no memories, so JAX drops every memory kind on
them: a step lowered there rests and streams nothing through host memory, silently. Lowered on
a CPU mesh of the same shape instead, with JAX's own TPU/GPU lowering of memory moves (the
`annotate_device_placement` custom calls) used for the CPU lowering too, the module carries its
host placements; XLA:GPU's host offloader then turns them into asynchronous `copy-start` /
`copy-done` pairs the schedule reader counts. Uses two private JAX names: the lowering rule
table and `compiler.get_compile_options`.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from zerojax.core.errors import ZeroError
from zerojax.core.mesh import without_memories
from zerojax.engine.state import split_call


def needed(zero) -> bool:
    """Whether `zero`'s steps must be lowered on CPU devices to keep their host memory."""
    return zero.config.uses_host_memory and without_memories(zero.mesh.devices.flat)


class Compiled:
    """What `report` reads of a compiled step, for an executable XLA:GPU built from a module
    lowered elsewhere."""

    def __init__(self, executable):
        self.executable = executable

    def as_text(self) -> str:
        return self.executable.hlo_modules()[0].to_string()

    def memory_analysis(self):
        return self.executable.get_compiled_memory_stats()


def on_cpu_twin(zero, step, args: tuple):
    """(the zero, step and arguments of the same config on a CPU mesh shaped as `zero.mesh`,
    compile(lowered, options) -> `Compiled` for `zero.mesh`'s GPUs)."""
    if zero.config.updates_on_host:
        raise ZeroError(
            "offload_update='host' is not compiled for compile-only GPUs: XLA:GPU turns its "
            "compute_on('device_host') update into a host-thread call, but the step's new "
            "parameters come out of device kernels with no host-to-device copy, which zerojax "
            "cannot account for; plan it with offload_update='device' (state streamed to the "
            "GPU and back), or on CPU devices."
        )
    gpu_mesh = zero.mesh
    n = gpu_mesh.size
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise ZeroError(
            f"compiling host offload for {n} GPUs lowers the step on {n} CPU devices first, "
            f"and this process has {len(cpus)}: set XLA_FLAGS=--xla_force_host_platform_device"
            f"_count={n} before jax starts (`zerojax plan --topology` does)."
        )
    mesh = Mesh(
        np.array(cpus[:n]).reshape(gpu_mesh.devices.shape),
        gpu_mesh.axis_names,
        axis_types=gpu_mesh.axis_types,
    )
    twin = type(zero)(zero.config, mesh)
    # what the GPU zero said is not said twice: the twin's placement shares what it warned
    twin.placement = dataclasses.replace(twin.placement, warned=zero.warned)
    twin_step = twin(step.fn, batch_argnum=step.batch_argnum, static_argnums=step.static_argnums)
    call = split_call(args, step.batch_argnum, step.static_argnums)
    if call.state.objects is not None:
        raise ZeroError(
            "host offload compiled for compile-only GPUs takes a train-state pytree; for NNX "
            "objects, report the step on CPU devices or on a TPU topology (whose devices keep "
            "their memory kinds)."
        )
    placed = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        call.state.tree,
        twin.state_shardings(call.state.tree),
    )
    moved = lambda x: (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec))
        if isinstance(getattr(x, "sharding", None), NamedSharding)
        else x
    )
    twin_args = (placed, *[jax.tree_util.tree_map(moved, a) for a in args[1:]])  # state first
    gpus = tuple(gpu_mesh.devices.flat)
    return twin, twin_step, twin_args, lambda lowered, options: _compile(lowered, gpus, options)


@contextlib.contextmanager
def host_moves_lowered_on_cpu():
    """Inside, JAX lowers memory-kind moves for CPU as it does for TPU and GPU (CPU's own rule
    drops them: one memory); its CPU rule is restored after."""
    from jax._src import dispatch
    from jax._src.interpreters import mlir

    table = mlir._platform_specific_lowerings["cpu"]
    before = table.get(dispatch.device_put_p)
    mlir.register_lowering(
        dispatch.device_put_p, dispatch._tpu_gpu_device_put_lowering, platform="cpu"
    )
    try:
        yield
    finally:
        if before is None:
            table.pop(dispatch.device_put_p, None)
        else:
            table[dispatch.device_put_p] = before


def _compile(lowered, gpus: tuple, options: dict) -> Compiled:
    """`lowered`'s module compiled by the GPUs' compile-only client, SPMD-partitioned over them
    in the CPU mesh's device order (same mesh shape, same positions)."""
    from jax._src import compiler
    from jax._src.lib import _jax

    client = gpus[0].client
    compile_options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=len(gpus),
        device_assignment=np.array(gpus, dtype=object).reshape(1, len(gpus)),
        env_options_overrides=dict(options),
        backend=client,
    )
    compile_options.executable_build_options.use_spmd_partitioning = True
    executable = client.compile(
        lowered.compiler_ir("stablehlo"),
        executable_devices=_jax.DeviceList(gpus),
        compile_options=compile_options,
    )
    return Compiled(executable)
