"""MaxText's own train step on bench/jax_lm.py's model, compiled ahead of time for a TPU slice
the way MaxText's `train_compile.py` does it, and read as zerojax reads its own step.

A benchmark-only install, never a dependency of zerojax: MaxText needs Python >= 3.12 and
2.8 GB (about 12 minutes to install), and brings its own jax and libtpu, so zerojax's rows of
bench/accelerator_compile.py are compiled in the same environment, by the same compiler:

    python3.12 -m venv ~/maxtext-env && . ~/maxtext-env/bin/activate
    pip install "maxtext[tpu]==0.2.5" && pip install --no-deps -e .
    python bench/accelerator_compile.py

The model is MaxText's llama2 decoder at bench/jax_lm.py's SHAPE (pre-norm RMSNorm, 4 heads of
64, SwiGLU, untied head: the same 3,295,488 parameters as zerojax's LM), fp32 weights and
activations, AdamW with clipping at 1.0, plain dot-product attention (not a Pallas kernel, as
zerojax's LM), FSDP over all chips (MaxText's default mesh rules); `remat_policy=full`
(recompute each layer, as zerojax's `recompute_units=True`) or `minimal` (keep the layer's
projections' and MLP's matmul outputs, as zerojax's default keeps its activations).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # only compiling: no TPU VM metadata lookups
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax  # noqa: E402
from accelerator_compile import schedule_figures  # noqa: E402
from jax_lm import SHAPE  # noqa: E402

from zerojax.inspect.hlo import matmul_flops  # noqa: E402
from zerojax.inspect.report import compile_with_partitioned_hlo  # noqa: E402
from zerojax.inspect.schedule import scheduled_collectives  # noqa: E402


def _is_gpu(topology: str) -> bool:
    from zerojax.core.mesh import GPU_KINDS

    return topology.split(":")[0] in GPU_KINDS


def maxtext_argv(topology: str, chips: int, remat: str) -> list[str]:
    """train_compile's command line for SHAPE on `chips` chips of `topology` (e.g. v5e:2x4, or
    GPUs: h100:8, whose mesh `compile_maxtext` builds) with MaxText's `remat_policy=remat`."""
    import maxtext

    base = pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml"
    target = (
        ["compile_topology=a3", "hardware=gpu"]  # MaxText's H100 node ('a3'); mesh: ours
        if _is_gpu(topology)
        else [f"compile_topology={topology.split(':')[0]}-{chips}"]
    )
    return [
        "train_compile",
        str(base),
        "run_name=zerojax_bench",
        *target,
        "compile_topology_num_slices=1",
        f"base_emb_dim={SHAPE['d_model']}",
        f"base_num_query_heads={SHAPE['heads']}",
        f"base_num_kv_heads={SHAPE['heads']}",
        f"head_dim={SHAPE['d_model'] // SHAPE['heads']}",
        f"base_mlp_dim={SHAPE['ffn']}",
        f"base_num_decoder_layers={SHAPE['layers']}",
        f"vocab_size={SHAPE['vocab']}",
        f"max_target_length={SHAPE['seq']}",
        f"per_device_batch_size={SHAPE['batch'] // chips}",
        "dtype=float32",
        "weight_dtype=float32",
        f"remat_policy={remat}",
        "attention=dot_product",
        "opt_type=adamw",
        "gradient_clipping_threshold=1.0",
        "enable_checkpointing=false",
        "dataset_type=synthetic",
        "skip_jax_distributed_system=true",
    ]


def compile_maxtext(topology: str, chips: int, remat: str) -> dict:
    """{'compiled', 'partitioned' (HLO text after SPMD partitioning), 'params', 'at_rest_bytes'}
    of MaxText's train step, from `train_compile.main` with its compile step replaced by one
    that also keeps the partitioned module (MaxText's steps otherwise: jit with its shardings
    under its mesh and logical-axis rules, lower, compile)."""
    from maxtext.trainers.pre_train import train_compile

    kept: dict = {}

    def jit_and_compile(func, args, kwargs, mesh, in_shardings, out_shardings, static_argnums,
                        donate_argnums, config, logical_axis_rules):  # fmt: skip
        with jax.set_mesh(mesh), logical_axis_rules:
            jitted = jax.jit(
                func,
                in_shardings=in_shardings,
                out_shardings=out_shardings,
                static_argnums=static_argnums,
                donate_argnums=donate_argnums,
            )
            lowered = jitted.lower(*args, **kwargs)
        compiled, partitioned, _ = compile_with_partitioned_hlo(lowered, mesh.size)
        state, state_shardings = args[0], in_shardings[0]
        kept.update(
            compiled=compiled,
            partitioned=partitioned,
            params=sum(  # MaxText 0.2.5's state is NNX: {'model': ..., 'optimizer': ...}
                x.size
                for x in jax.tree_util.tree_leaves(state["model"])
                if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
            ),
            at_rest_bytes=sum(
                math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                for x, s in zip(
                    jax.tree_util.tree_leaves(state),
                    jax.tree_util.tree_leaves(state_shardings),
                    strict=True,
                )
            ),
        )
        return compiled

    def gpu_mesh(config):  # MaxText's own mesh code, on the compile-only GPUs: its
        # train_compile asks jax.devices() for GPUs, which needs GPUs present
        import zerojax as zj

        devices = maxtext_utils.create_device_mesh(config, zj.gpu_devices(topology))
        return jax.sharding.Mesh(
            devices, config.mesh_axes, axis_types=(AxisType.Auto,) * len(config.mesh_axes)
        )

    from jax.sharding import AxisType
    from maxtext.utils import maxtext_utils

    originals = train_compile.jit_and_compile, train_compile.get_topology_mesh
    train_compile.jit_and_compile = jit_and_compile
    if _is_gpu(topology):
        train_compile.get_topology_mesh = gpu_mesh
    try:
        train_compile.main(maxtext_argv(topology, chips, remat))
    finally:
        train_compile.jit_and_compile, train_compile.get_topology_mesh = originals
    return kept


def maxtext_row(topology: str, remat: str) -> dict:
    """bench/accelerator_compile.py's row for MaxText with `remat_policy=remat`, read as
    `zero.report` reads zerojax's step (run in its own process: MaxText sets process-wide jax
    options, e.g. its PRNG)."""
    chips = math.prod(int(d) for d in topology.split(":")[1].split("x"))  # v5e:2x4, h100:8: 8
    got = compile_maxtext(topology, chips, remat)
    mem = got["compiled"].memory_analysis()
    scheduled = scheduled_collectives(got["compiled"].as_text(), chips)
    return {
        "contender": f"MaxText {importlib.metadata.version('maxtext')} FSDP, remat {remat}",
        "params": got["params"],
        "peak_bytes": int(mem.argument_size_in_bytes + mem.temp_size_in_bytes),
        "at_rest_bytes": got["at_rest_bytes"],
        **schedule_figures(scheduled),
        "matmul_flops": matmul_flops(got["partitioned"]),
    }
