"""`zerojax plan`: compile the example LM's train step (or your own, `--model`) ahead of time for N
simulated CPU devices, a TPU slice or NVIDIA GPU nodes (`--topology`), without allocating anything
(`zero.eval_shape`), and print per ZeRO stage the per-device bytes at rest and at the compiled
peak and the communication per step, all read from the compiled program.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30 (GB is decimal, GiB binary)."""
    from zerojax.core.config import size_in_bytes
    from zerojax.core.errors import ZeroError

    try:
        return size_in_bytes(text)
    except ZeroError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 80GB or 80GiB") from None


def plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="per-device memory and communication of each ZeRO stage",
        description=" ".join(__doc__.split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows each default
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--preset", default="tiny", help="example LM preset (tiny ... 7b)")
    what.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="plan your own model: FUNCTION() returns (init_fn, train_step, batch) with "
        "init_fn(key) -> train state, train_step(state, batch) -> (state, metrics) unwrapped, "
        "and one device's batch (arrays or jax.ShapeDtypeStruct; leading dimension = batch); "
        "the current directory is importable",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=argparse.SUPPRESS,
        help="data-parallel devices N (default: 8; with --topology, its chip count)",
    )
    p.add_argument(
        "--topology",
        help="compile for a TPU slice (e.g. v5e:2x4, 8 chips; pip install 'zerojax[tpu]') or "
        "NVIDIA GPUs (h100:8, one node of 8; h100:2x8, 2 nodes over InfiniBand; also a100, "
        "h200, b200; pip install 'zerojax[gpu-compile]') instead of N simulated CPU devices. "
        "Nothing runs: the accelerator compiler's own program is measured",
    )
    p.add_argument(
        "--gpu-autotune",
        metavar="FILE",
        help="with a GPU --topology: gemm and fusion configs XLA autotuned on a real GPU of "
        "that kind (a file XLA_FLAGS=--xla_gpu_dump_autotune_results_to=FILE wrote there; "
        "bench/gpu.sh writes one), instead of the default configs a compile without a GPU uses",
    )
    p.add_argument(
        "--mesh",
        help="NODESxLOCAL, e.g. 2x4: a ('node', 'local') mesh (counts "
        "cross-node bytes, adds ZeRO++ and MiCS rows at stage 3); '8' or '1x8': 1-D",
    )
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per device per step")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--unrolled", action="store_true", help="unrolled layers instead of nn.scan")
    p.add_argument("--no-remat", action="store_true", help="keep activations (no remat)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--config", help="DeepSpeed-style JSON; plans its stage only")
    group.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="plan this stage only")
    p.add_argument("--device-memory", type=parse_bytes, help="e.g. 80GB: mark what fits")
    p.add_argument("--no-offload", action="store_true", help="skip the host-offload rows")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--dump-hlo", metavar="DIR", help="write partitioned and optimized HLO")
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        help="e.g. 60GB: stage 3 rows keep units gathered as far as it allows (see budget)",
    )
    p.add_argument(
        "--max-batch",
        action="store_true",
        help="with --device-memory: each row's largest sequences per device that fit, found "
        "by compiling (no allocation), and its ratio to stage 0's",
    )
    p.add_argument(
        "--explain-peak",
        action="store_true",
        help="list what is alive at each row's compiled peak, by category, and its largest buffers",
    )


def _mesh_local(args) -> int | None:
    """Devices per node from --mesh NODESxLOCAL (None: a 1-D mesh); exits on a bad shape."""
    if not args.mesh and is_gpu(args.topology):  # GPU nodes: a ('node', 'local') mesh
        from zerojax.core.mesh import gpu_target

        _, nodes, per_node = gpu_target(args.topology)
        return per_node if nodes > 1 else None
    if not args.mesh:
        return None
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)", args.mesh)
    nodes, local = (int(m.group(1) or 1), int(m.group(2))) if m else (0, 0)
    if not m or nodes * local != args.devices:
        raise SystemExit(
            f"zerojax plan: --mesh {args.mesh!r} must be NODESxLOCAL with NODES x "
            f"LOCAL = --devices {args.devices} (e.g. 2x{args.devices // 2})."
        )
    return local if nodes > 1 else None


ZEROPP = {
    "qwZ+hpZ+qgZ": lambda local: dict(
        quantized_weights=True, hpz_partition_size=local, quantized_gradients=True
    ),
    "MiCS": lambda local: dict(mics_shard_size=local),
}


def is_gpu(topology: str | None) -> bool:
    """Whether --topology names NVIDIA GPUs ('h100:8') rather than a TPU slice ('v5e:2x4')."""
    from zerojax.core.mesh import GPU_KINDS

    return topology is not None and topology.split(":")[0].strip().lower() in GPU_KINDS


def _plan_devices(args) -> list:
    """The devices `plan` compiles for: a TPU slice's or GPU nodes' abstract devices
    (--topology) or N simulated CPU devices, with the CPU-only planning flags
    (`xla_flags.PLANNING`). For GPUs, N CPU devices too: host offload is lowered on them."""
    from zerojax.core.errors import ZeroError

    if args.gpu_autotune and not is_gpu(args.topology):
        raise ZeroError("--gpu-autotune needs a GPU --topology, e.g. --topology h100:8")
    if args.topology and not is_gpu(args.topology):
        import zerojax as zj

        # only compiling: skip libtpu's TPU-VM metadata lookups (and their error lines), and
        # let it load beside another process that holds it (e.g. a notebook)
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return _topology_devices(args, zj.tpu_devices(args.topology), "chips")
    if args.topology:
        import zerojax as zj
        from zerojax.core.mesh import gpu_target

        _, nodes, per_node = gpu_target(args.topology)
        _cpu_devices(nodes * per_node)  # before jax's backends start
        _load_autotune_results(args.gpu_autotune)

        return _topology_devices(args, zj.gpu_devices(args.topology), "GPUs")
    args.devices = getattr(args, "devices", 8)
    _cpu_devices(args.devices)
    from zerojax.core import xla_flags

    xla_flags.apply_planning_flags()
    import jax

    return jax.devices()[: args.devices]


def _load_autotune_results(path: str | None) -> None:
    """Have XLA:GPU read the autotune results at `path` (before jax's backends start: XLA
    reads its flags once)."""
    if not path:
        return
    from zerojax.core.errors import ZeroError

    if not os.path.isfile(path):
        raise ZeroError(f"--gpu-autotune {path!r}: no such file")
    flag = f"--xla_gpu_load_autotune_results_from={os.path.abspath(path)}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _cpu_devices(count: int) -> None:
    """Ask for `count` CPU devices on the CPU platform, before jax's backends start (jax is
    imported already: its platform option is set as well as the environment)."""
    import jax

    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def _topology_devices(args, devices: list, what: str) -> list:
    """A topology's devices, with --devices checked against them (or set from them)."""
    from zerojax.core.errors import ZeroError

    if getattr(args, "devices", len(devices)) != len(devices):
        raise ZeroError(
            f"--devices {args.devices} does not match --topology {args.topology}, which "
            f"has {len(devices)} {what}: leave --devices out."
        )
    args.devices = len(devices)
    return devices


@dataclasses.dataclass(frozen=True)
class Workload:
    """What `plan` compiles: `init_fn(key)` -> state, the unwrapped `step(state, batch)`, the
    global batch (abstract), the units (None: the config's own) and the table's title
    (`{params}` filled in); `seq_len` for presets, whose batch --max-batch can grow."""

    init_fn: Callable
    step: Callable
    batch: Any
    units: Any
    title: str
    seq_len: int | None = None


def _preset_workload(args) -> Workload:
    """The example LM at a preset, with --layers, --seq-len, --unrolled, --no-remat."""
    import jax
    import jax.numpy as jnp
    import optax

    from zerojax.core.errors import ZeroError
    from zerojax.models.gpt import lm_units, make_init, train_step
    from zerojax.models.lm import LM, LM_PRESETS

    if args.preset not in LM_PRESETS:
        raise ZeroError(f"unknown preset {args.preset!r}; presets: {', '.join(LM_PRESETS)}")
    overrides = {k: v for k, v in (("n_layers", args.layers), ("seq_len", args.seq_len)) if v}
    cfg = LM_PRESETS[args.preset].replace(
        scan_layers=not args.unrolled, remat=not args.no_remat, **overrides
    )
    return Workload(
        init_fn=make_init(LM(cfg), optax.adamw(1e-4)),
        step=train_step,
        batch=jax.ShapeDtypeStruct((args.batch_size * args.devices, cfg.seq_len + 1), jnp.int32),
        units=lm_units(cfg),  # attention and MLP apart, unless remat
        title=f"preset {args.preset}: {{params:,}} parameters, {cfg.n_layers} layers "
        f"({'unrolled' if args.unrolled else 'scanned'}, remat {'off' if args.no_remat else 'on'}"
        f"), seq {cfg.seq_len}, {args.batch_size} sequence(s) per device, N = {args.devices}",
        seq_len=cfg.seq_len,
    )


def _model_workload(args) -> Workload:
    """The user's model from --model MODULE:FUNCTION; its batch is one device's, given to each
    of the N devices. Options that shape the example LM are errors here, not ignored."""
    import importlib
    import inspect

    import jax

    from zerojax.core.errors import ZeroError

    preset_only = [
        flag
        for flag, given in (
            ("--layers", args.layers),
            ("--seq-len", args.seq_len),
            ("--unrolled", args.unrolled),
            ("--no-remat", args.no_remat),
            ("--batch-size", args.batch_size != 1),
            ("--max-batch", args.max_batch),
        )
        if given
    ]
    if preset_only:
        raise ZeroError(
            f"{', '.join(preset_only)} shape the example LM's presets, not --model: set them "
            "in your build function (its batch is one device's)."
        )
    module_name, _, fn_name = args.model.partition(":")
    if not module_name or not fn_name:
        raise ZeroError(f"--model {args.model!r} must be MODULE:FUNCTION, e.g. mymodel:build.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does, for the installed command too
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ZeroError(
            f"--model {args.model!r}: cannot import {module_name!r} ({e}); run zerojax plan "
            "from the directory that holds it, or install it."
        ) from None
    build = getattr(module, fn_name, None)
    if not callable(build):
        raise ZeroError(f"--model {args.model!r}: {module_name} has no function {fn_name!r}.")
    try:
        inspect.signature(build).bind()
    except TypeError:
        raise ZeroError(
            f"--model {args.model!r}: {fn_name} must take no arguments and return (init_fn, "
            "train_step, batch)."
        ) from None
    built = build()  # an error inside the user's own code keeps its traceback
    if not (isinstance(built, tuple) and len(built) == 3 and all(map(callable, built[:2]))):
        raise ZeroError(
            f"--model {args.model!r}: {fn_name}() must return (init_fn, train_step, batch); "
            f"it returned {type(built).__name__}."
        )
    init_fn, step, batch = built
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves or any(not getattr(x, "shape", ()) for x in leaves):
        raise ZeroError(
            f"--model {args.model!r}: every leaf of the batch needs a leading batch dimension."
        )
    n = args.devices
    return Workload(
        init_fn=init_fn,
        step=step,
        batch=jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]), x.dtype), batch
        ),
        units=None,
        title=f"model {args.model}: {{params:,}} parameters, "
        f"{leaves[0].shape[0]} example(s) per device, N = {n}",
    )


def plan(args) -> int:
    import zerojax as zj

    try:
        devices = _plan_devices(args)
        local = _mesh_local(args)
    except zj.ZeroError as e:
        print(f"zerojax plan: {e}", file=sys.stderr)
        return 2
    if args.device_memory is None and is_gpu(args.topology):  # what fits: the GPU's memory
        from zerojax.core.mesh import gpu_memory_bytes

        args.device_memory = gpu_memory_bytes(args.topology)
    if args.max_batch and (args.device_memory is None or args.memory_budget):
        print(
            "zerojax plan: --max-batch needs --device-memory (and no --memory-budget)",
            file=sys.stderr,
        )
        return 2
    try:
        work = _model_workload(args) if args.model else _preset_workload(args)
    except zj.ZeroError as e:
        print(f"zerojax plan: {e}", file=sys.stderr)
        return 2
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
    import jax

    try:
        planned = [_plan_row(args, cfg_z, work, devices, local) for cfg_z in _configs(args, local)]
    except jax.errors.JaxRuntimeError as e:  # XLA reads --gpu-autotune's file at first compile
        if not (args.gpu_autotune and "autotune" in str(e).lower()):
            raise
        print(
            f"zerojax plan: --gpu-autotune {args.gpu_autotune!r}: XLA cannot use it: {e}",
            file=sys.stderr,
        )
        return 2
    rows, peaks = [row for row, _ in planned], [peak for _, peak in planned]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_plan(rows, peaks, args, work)
    return 0


def _configs(args, local) -> list:
    """The ZeroConfigs `zerojax plan` compiles: the config given, or every stage asked for
    (with each offload from the stage that has it, and ZeRO++ variants on a node/local mesh)."""
    import zerojax as zj

    if args.config:
        return [zj.ZeroConfig.from_json(args.config)]
    stages = [args.stage] if args.stage is not None else range(4)
    return (
        [zj.ZeroConfig(stage=s, precision=args.precision) for s in stages]
        + [
            zj.ZeroConfig(stage=s, precision=args.precision, **_offload_options(options, args))
            for s in stages
            for _, first, options in OFFLOADS[1:]
            if s >= first and not args.no_offload
        ]
        + [
            zj.ZeroConfig(stage=3, precision=args.precision, **variant(local))
            for variant in ZEROPP.values()
            if local and 3 in stages
        ]
    )


def _offload_options(options: dict, args) -> dict:
    """An offload row's options for this target: on GPUs the update runs on the device (the
    host update is not compiled for compile-only GPUs: zerojax.inspect.cross_compile)."""
    return {**options, "offload_update": "device"} if is_gpu(args.topology) else options


def _plan_row(args, cfg_z, work, devices, local) -> tuple[dict, object]:
    """One config compiled for the workload: its table row (what `--json` prints) and the
    compiled peak's live ranges (for `--explain-peak`)."""
    import jax

    import zerojax as zj
    from zerojax.engine.budget import largest_fitting

    if work.units is not None and cfg_z.uses_units:
        cfg_z = cfg_z.replace(units=work.units)
    if args.memory_budget and cfg_z.shards_parameters:
        cfg_z = cfg_z.replace(memory_budget=args.memory_budget)
    group = local or max(cfg_z.hpz_partition_size, cfg_z.mics_shard_size, 0) or None
    mesh = zj.make_mesh(devices, local=group if group and group > 1 else None)
    zero = zj.zero_shard(config=cfg_z, mesh=mesh)
    state = zero.eval_shape(work.init_fn, jax.random.key(0))
    offload, zeropp = _offload_name(cfg_z), _zeropp_name(cfg_z)
    name = f"stage{cfg_z.stage}_{cfg_z.precision}_offload-{offload}_{zeropp}"
    dump = os.path.join(args.dump_hlo, name) if args.dump_hlo else None
    step = zero(work.step)
    rep = zero.report(step, state, work.batch, dump_to=dump)
    largest = None
    if args.max_batch and work.seq_len:  # presets only (--model refuses --max-batch)
        # the bound moves with the compiled arguments + temporaries
        peak_at = functools.partial(
            _device_peak, step, state, devices=args.devices, seq_len=work.seq_len
        )
        offset = rep.peak_bound_bytes - peak_at(args.batch_size)
        largest = largest_fitting(peak_at, args.device_memory - offset)
    row = {
        "stage": cfg_z.stage,
        "offload": offload,
        "zeropp": zeropp,
        "precision": cfg_z.precision,
        "mesh": dict(zero.mesh.shape),
        "target": _target_name(args),
        "params": sum(x.size for x in jax.tree_util.tree_leaves(state.params)),
        "peak_bytes": rep.peak_bytes,
        "peak_bound_bytes": rep.peak_bound_bytes,
        "at_rest_bytes": sum(rep.resident.values()),
        "at_rest_by_category": rep.resident,
        "peak_by_category": rep.peak.by_category() if rep.peak else None,
        "budget": str(step.budget) if step.budget else None,
        "host_bytes": sum(rep.host_resident.values()),
        "comm_bytes": int(sum(c.buffer_bytes for c in rep.collectives)),
        "comm_sent_bytes": int(sum(c.sent_bytes for c in rep.collectives)),
        # of the compiled schedule's collectives (after combining): sent while a matmul
        # runs, and exposed (on CPU, everything is exposed)
        "overlapped_sent_bytes": int(rep.overlap[0]),
        "exposed_sent_bytes": int(rep.overlap[1]),
        "launches": rep.launches,  # collective launches per step by kind, after combining
        # device<->host copies of the compiled program: (bytes beside a matmul, exposed)
        "host_copies": {kind: list(pair) for kind, pair in rep.host_copies.items()},
        "matmul_flops": rep.matmul_flops,  # per device, loop trips counted
        # a 1-D mesh has no node boundary to count
        "cross_node_bytes": int(rep.cross_node_bytes) if "node" in zero.mesh.shape else None,
        "fits": None if args.device_memory is None else rep.peak_bound_bytes <= args.device_memory,
        "max_batch": largest[0] if largest else None,
        "max_batch_compiles": largest[1] if largest else None,
    }
    return row, rep.peak


def _target_name(args) -> str:
    """'cpu', 'tpu v5e:2x4' or 'gpu h100:2x8'."""
    if not args.topology:
        return "cpu"
    return f"{'gpu' if is_gpu(args.topology) else 'tpu'} {args.topology}"


def _print_plan(rows, peaks, args, work) -> None:
    from zerojax.core import xla_flags

    _print_table(rows, args, work.title.format(params=rows[0]["params"]))
    for name in xla_flags.PLANNING if not args.topology else ():
        print(f"XLA flag {name}: {xla_flags.effective()[name]}")
    if args.max_batch:
        _print_max_batch(rows, args)
    for r in rows:
        if r["budget"]:
            print(f"stage 3, offload {r['offload']}, ZeRO++ {r['zeropp']}: {r['budget']}")
    for r, peak in zip(rows, peaks, strict=True) if args.explain_peak else ():
        print(f"\nstage {r['stage']}, offload {r['offload']}, ZeRO++ {r['zeropp']}: ", end="")
        print(peak.format(top=8) if peak else "no live ranges")


def _print_table(rows, args, title: str) -> None:
    unit, size = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) >= 2**30 else ("MiB", 2**20)
    gib = lambda b: f"{b / size:9.2f}"
    print(title)
    print(f"compiled for {_target(args)}")
    cross = rows[0]["cross_node_bytes"] is not None
    print(
        f"{'stage':>5} {'offload':>15} {'ZeRO++':>12} {'at rest ' + unit:>11} "
        f"{'peak ' + unit:>9} {'bound ' + unit:>9} {'host ' + unit:>9} "
        f"{'sent ' + unit + '/step':>13}"
        + (f"{'cross-node':>11}" if cross else "")
        + (f"{'overlapped':>11}{'exposed':>9}{'launches':>9}" if args.topology else "")
        + (f"{'host copies':>12}" if is_gpu(args.topology) else "")
        + f"{'GFLOP/step':>11}  fits"
    )
    for r in rows:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        print(
            f"{r['stage']:>5} {r['offload']:>15} {r['zeropp']:>12} "
            f"{gib(r['at_rest_bytes']):>11} {gib(r['peak_bytes'])} "
            f"{gib(r['peak_bound_bytes'])} {gib(r['host_bytes'])} "
            f"{gib(r['comm_sent_bytes']):>13}"
            + (f"{gib(r['cross_node_bytes']):>11}" if cross else "")
            + (
                f"{gib(r['overlapped_sent_bytes']):>11}{gib(r['exposed_sent_bytes'])}"
                f"{sum(r['launches'].values()):>9}"
                if args.topology
                else ""
            )
            + (
                f"{gib(sum(sum(pair) for pair in r['host_copies'].values())):>12}"
                if is_gpu(args.topology)
                else ""
            )
            + f"{r['matmul_flops'] / 1e9:>11.1f}  {fits}"
        )
    print(
        "per device. at rest: state in device memory between steps; peak: compiled arguments "
        "+ temporaries; bound: peak + offloaded state the step streams in (fits uses it); "
        "host: offloaded state in pinned host memory. "
        + (
            "Offload rows stream it to the GPU and back. "
            if is_gpu(args.topology)
            else "Offload rows update on the host. "
        )
        + "sent: "
        "bytes one device sends per step (ring algorithms); cross-node: of which in "
        "collectives whose groups span nodes. GFLOP/step: the compiled program's matmuls per "
        "device, each loop body once per iteration (recomputation included)."
        + (
            " overlapped / exposed: bytes the compiled program itself sends (its collectives "
            "after combining, in the dtypes it chose) while a matmul runs / with nothing beside "
            "them; launches: its collective launches per step."
            if args.topology
            else ""
        )
        + (
            " host copies: bytes copied between the GPU and host memory per step (offload); "
            "the peak includes what they bring in, so bound = peak."
            if is_gpu(args.topology)
            else ""
        )
    )
    if args.device_memory is not None:
        best = cheapest(rows)
        print(
            f"cheapest that fits {args.device_memory / 1e9:g} GB: "
            + (
                f"stage {best['stage']}, offload {best['offload']}, ZeRO++ {best['zeropp']} (no "
                "offload before offload, then fewest cross-node bytes, then fewest bytes sent "
                "per device; ZeRO++ quantizes weights and gradients, MiCS keeps more state per "
                "device)"
                if best
                else "none; add devices, lower the batch or sequence length"
            )
        )


def _target(args) -> str:
    """What `plan` compiled for, with the compiler's version (its figures depend on it)."""
    import importlib.metadata

    import jax

    if is_gpu(args.topology):
        from zerojax.core.mesh import gpu_memory_bytes

        plugin = importlib.metadata.version("jax-cuda12-plugin")
        memory = gpu_memory_bytes(args.topology) / 1e9
        return (
            f"GPUs {args.topology} ({args.devices} GPUs, {memory:.1f} GB each), ahead of time "
            f"by XLA:GPU (jax-cuda12-plugin {plugin}, jax {jax.__version__}): its program "
            + (
                f"with the autotune results of {args.gpu_autotune}"
                if args.gpu_autotune
                else "with default gemm configs (no autotuning)"
            )
            + ", nothing run"
        )
    if args.topology:
        libtpu = importlib.metadata.version("libtpu")
        return (
            f"TPU {args.topology} ({args.devices} chips), ahead of time by libtpu {libtpu} "
            f"(jax {jax.__version__}): the TPU compiler's program, nothing run"
        )
    return (
        f"{args.devices} simulated CPU devices (jax {jax.__version__}): XLA's CPU program, "
        "which neither combines collectives nor overlaps them"
    )


def _device_peak(step, state, per_device: int, devices: int, seq_len: int) -> int:
    """Compiled arguments + temporaries of `step` at `per_device` sequences per device (a
    plain compile: `zero.report` also dumps and reads XLA's live ranges)."""
    import jax
    import jax.numpy as jnp

    batch = jax.ShapeDtypeStruct((per_device * devices, seq_len + 1), jnp.int32)
    memory = step.lower(state, batch).compile().memory_analysis()
    return int(memory.argument_size_in_bytes) + int(memory.temp_size_in_bytes)


def _print_max_batch(rows, args) -> None:
    base = next((r for r in rows if r["stage"] == 0 and r["offload"] == "none"), rows[0])
    print(
        f"largest sequences per device whose compiled step fits {args.device_memory / 1e9:g} GB "
        f"(bound <= device memory; {sum(r['max_batch_compiles'] for r in rows)} compiles):"
    )
    for r in rows:
        ratio = (
            f"{r['max_batch'] / base['max_batch']:.2f}x stage {base['stage']}'s"
            if base["max_batch"]
            else f"stage {base['stage']} fits none"
        )
        print(
            f"  stage {r['stage']}, offload {r['offload']}, ZeRO++ {r['zeropp']}: "
            f"{r['max_batch']}  ({ratio})"
        )


def cheapest(rows):
    """The row that fits with the least host traffic (offload rank), then the fewest bytes sent
    per device (an all-reduce sends twice what a reduce-scatter does), then the lowest peak."""
    rank = {name: i for i, (name, _, _) in enumerate(OFFLOADS)}
    fitting = [r for r in rows if r["fits"]]
    return min(
        fitting,
        key=lambda r: (
            rank[r["offload"]],
            r["cross_node_bytes"] or 0,
            r["comm_sent_bytes"],
            r["peak_bound_bytes"],
        ),
        default=None,
    )


# plan's offload rows, in the order `cheapest` prefers them: (name, first stage, options)
OFFLOADS: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("none", 0, {}),
    ("optimizer", 1, dict(offload_optimizer="cpu", offload_update="host")),
    (
        "optimizer+param",
        3,
        dict(offload_optimizer="cpu", offload_param="cpu", offload_update="host"),
    ),
)


def _zeropp_name(cfg) -> str:
    """'none', or the ZeRO++ techniques / MiCS a config turns on, e.g. 'qwZ+hpZ+qgZ'."""
    return "+".join(name for name, _ in cfg.zeropp_options) or "none"


def _offload_name(cfg) -> str:
    if cfg.offloads_params:
        return "optimizer+param"
    return "optimizer" if cfg.offloads_optimizer else "none"
