"""The `zerojax` command.

    zerojax plan --preset 7b --devices 8 --device-memory 80GB
    zerojax checkpoint info DIR
    zerojax checkpoint verify DIR [--step N]
    zerojax checkpoint export DIR --dtype bf16 --out model.safetensors
    zerojax config explain ds_config.json
    zerojax launch -n 2 --devices-per-process 4 -- python examples/pretrain_lm.py

`plan` compiles the example LM's train step ahead of time for N simulated devices (nothing is
allocated; `zero.eval_shape`) and prints, per ZeRO stage, the per-device bytes at rest and at
the compiled peak and the communication per step, all read from the compiled program.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from typing import Any


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30 (GB is decimal, GiB binary)."""
    from zerojax.config import ZeroError, size_in_bytes

    try:
        return size_in_bytes(text)
    except ZeroError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 80GB or 80GiB") from None


def plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="per-device memory and communication of each ZeRO stage",
        description=__doc__.split("\n\n")[2].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows each default
    )
    p.add_argument("--preset", default="tiny", help="example LM preset (tiny ... 7b)")
    p.add_argument(
        "--devices",
        type=int,
        default=argparse.SUPPRESS,
        help="data-parallel devices N (default: 8; with --topology, its chip count)",
    )
    p.add_argument(
        "--topology",
        help="compile for a TPU slice instead of N simulated CPU devices, e.g. v5e:2x4 (8 "
        "chips); needs libtpu: pip install 'zerojax[tpu]'. Nothing runs: the TPU compiler's "
        "own program is measured",
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


def _plan_devices(args) -> list:
    """The devices `plan` compiles for: a TPU slice's abstract devices (--topology) or N
    simulated CPU devices, with the CPU-only planning flags (`xla_flags.PLANNING`)."""
    if args.topology:
        import zerojax as zj

        # only compiling: skip libtpu's TPU-VM metadata lookups (and their error lines), and
        # let it load beside another process that holds it (e.g. a notebook)
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        devices = zj.tpu_devices(args.topology)
        if getattr(args, "devices", len(devices)) != len(devices):
            raise zj.ZeroError(
                f"--devices {args.devices} does not match --topology {args.topology}, which "
                f"has {len(devices)} chips: leave --devices out."
            )
        args.devices = len(devices)
        return devices
    args.devices = getattr(args, "devices", 8)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zerojax import xla_flags

    xla_flags.apply_planning_flags()
    import jax

    return jax.devices()[: args.devices]


def plan(args) -> int:
    import zerojax as zj

    try:
        devices = _plan_devices(args)
        local = _mesh_local(args)
    except zj.ZeroError as e:
        print(f"zerojax plan: {e}", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp
    import optax

    from zerojax import xla_flags
    from zerojax.budget import largest_fitting
    from zerojax.models.gpt import lm_units, make_init, train_step
    from zerojax.models.lm import LM, LM_PRESETS

    if args.max_batch and (args.device_memory is None or args.memory_budget):
        print(
            "zerojax plan: --max-batch needs --device-memory (and no --memory-budget)",
            file=sys.stderr,
        )
        return 2
    if args.preset not in LM_PRESETS:
        print(
            f"zerojax plan: unknown preset {args.preset!r}; presets: {', '.join(LM_PRESETS)}",
            file=sys.stderr,
        )
        return 2
    overrides = {k: v for k, v in (("n_layers", args.layers), ("seq_len", args.seq_len)) if v}
    cfg = LM_PRESETS[args.preset].replace(
        scan_layers=not args.unrolled, remat=not args.no_remat, **overrides
    )
    init_fn = make_init(LM(cfg), optax.adamw(1e-4))
    batch = jax.ShapeDtypeStruct((args.batch_size * args.devices, cfg.seq_len + 1), jnp.int32)
    stages = [args.stage] if args.stage is not None else range(4)
    configs = (
        [zj.ZeroConfig.from_json(args.config)]
        if args.config
        else [zj.ZeroConfig(stage=s, precision=args.precision) for s in stages]
        + [
            zj.ZeroConfig(stage=s, precision=args.precision, **options)
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
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
    rows, peaks = [], []
    for cfg_z in configs:
        cfg_z = cfg_z.replace(units=lm_units(cfg))  # attention and MLP apart, unless remat
        group = local or max(cfg_z.hpz_partition_size, cfg_z.mics_shard_size, 0) or None
        zero = zj.zero_shard(
            config=cfg_z,
            mesh=zj.make_mesh(devices, local=group if group and group > 1 else None),
        )
        state = zero.eval_shape(init_fn, jax.random.key(0))
        offload, zeropp = _offload_name(cfg_z), _zeropp_name(cfg_z)
        dump = (
            os.path.join(
                args.dump_hlo, f"stage{cfg_z.stage}_{cfg_z.precision}_offload-{offload}_{zeropp}"
            )
            if args.dump_hlo
            else None
        )
        if args.memory_budget and cfg_z.shards_parameters:
            zero = zj.zero_shard(
                config=cfg_z.replace(memory_budget=args.memory_budget), mesh=zero.mesh
            )
        step = zero(train_step)
        rep = zero.report(step, state, batch, dump_to=dump)
        largest = None
        if args.max_batch:  # the bound moves with the compiled arguments + temporaries
            peak_at = functools.partial(
                _device_peak, step, state, devices=args.devices, seq_len=cfg.seq_len
            )
            offset = rep.peak_bound_bytes - peak_at(args.batch_size)
            largest = largest_fitting(peak_at, args.device_memory - offset)
        peaks.append(rep.peak)
        rows.append(
            {
                "stage": cfg_z.stage,
                "offload": offload,
                "zeropp": zeropp,
                "precision": cfg_z.precision,
                "mesh": dict(zero.mesh.shape),
                "target": f"tpu {args.topology}" if args.topology else "cpu",
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
                # a 1-D mesh has no node boundary to count
                "cross_node_bytes": int(rep.cross_node_bytes)
                if "node" in zero.mesh.shape
                else None,
                "fits": None
                if args.device_memory is None
                else rep.peak_bound_bytes <= args.device_memory,
                "max_batch": largest[0] if largest else None,
                "max_batch_compiles": largest[1] if largest else None,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table(rows, args, cfg)
        for name in xla_flags.PLANNING if not args.topology else ():
            print(f"XLA flag {name}: {xla_flags.effective()[name]}")
        if args.max_batch:
            _print_max_batch(rows, args)
        for r in rows:
            if r["budget"]:
                print(f"stage 3, offload {r['offload']}, ZeRO++ {r['zeropp']}: {r['budget']}")
    if args.explain_peak and not args.json:
        for r, peak in zip(rows, peaks, strict=True):
            print(f"\nstage {r['stage']}, offload {r['offload']}, ZeRO++ {r['zeropp']}: ", end="")
            print(peak.format(top=8) if peak else "no live ranges")
    return 0


def _print_table(rows, args, cfg) -> None:
    unit, size = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) >= 2**30 else ("MiB", 2**20)
    gib = lambda b: f"{b / size:9.2f}"
    print(
        f"preset {args.preset}: {rows[0]['params']:,} parameters, {cfg.n_layers} layers "
        f"({'unrolled' if args.unrolled else 'scanned'}, remat {'off' if args.no_remat else 'on'}"
        f"), seq {cfg.seq_len}, {args.batch_size} sequence(s) per device, N = {args.devices}"
    )
    print(f"compiled for {_target(args)}")
    cross = rows[0]["cross_node_bytes"] is not None
    print(
        f"{'stage':>5} {'offload':>15} {'ZeRO++':>12} {'at rest ' + unit:>11} "
        f"{'peak ' + unit:>9} {'bound ' + unit:>9} {'host ' + unit:>9} "
        f"{'sent ' + unit + '/step':>13}" + (f"{'cross-node':>11}" if cross else "") + "  fits"
    )
    for r in rows:
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "no")
        print(
            f"{r['stage']:>5} {r['offload']:>15} {r['zeropp']:>12} "
            f"{gib(r['at_rest_bytes']):>11} {gib(r['peak_bytes'])} "
            f"{gib(r['peak_bound_bytes'])} {gib(r['host_bytes'])} "
            f"{gib(r['comm_sent_bytes']):>13}"
            + (f"{gib(r['cross_node_bytes']):>11}" if cross else "")
            + f"  {fits}"
        )
    print(
        "per device. at rest: state in device memory between steps; peak: compiled arguments "
        "+ temporaries; bound: peak + offloaded state the step streams in (fits uses it); "
        "host: offloaded state in pinned host memory. Offload rows update on the host. sent: "
        "bytes one device sends per step (ring algorithms); cross-node: of which in "
        "collectives whose groups span nodes."
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
    if cfg.offload_param == "cpu":
        return "optimizer+param"
    return "optimizer" if cfg.offload_optimizer == "cpu" else "none"


def checkpoint_parser(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect or export a zerojax checkpoint directory")
    actions = p.add_subparsers(dest="action", required=True)
    i = actions.add_parser("info", help="steps, leaves (shape, dtype, bytes, saved sharding)")
    i.add_argument("directory")
    i.add_argument("--step", type=int, help="default: the latest complete step")
    i.add_argument("--json", action="store_true")
    v = actions.add_parser("verify", help="every step complete and every array readable")
    v.add_argument("directory")
    v.add_argument("--step", type=int, help="default: every step")
    e = actions.add_parser("export", help="consolidated parameters, streamed leaf by leaf")
    e.add_argument("directory")
    e.add_argument("--step", type=int, help="default: the latest complete step")
    e.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    e.add_argument("--out", required=True, help="FILE.safetensors or FILE.msgpack")


def checkpoint(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zerojax.config import ZeroError
    from zerojax.export import export, info, verify

    try:
        if args.action == "verify":
            bad = 0
            for step, problems in verify(args.directory, step=args.step).items():
                print(f"step {step}: " + ("ok" if not problems else "BAD"))
                for problem in problems:
                    print(f"  {problem}")
                bad += bool(problems)
            return 1 if bad else 0
        if args.action == "export":
            done = export(args.directory, args.out, step=args.step, dtype=args.dtype)
            print(
                f"wrote {done['out']}: step {done['step']}, {done['leaves']} parameter "
                f"leaves in {done['dtype']}, {done['bytes']:,} bytes"
            )
            return 0
        summary = info(args.directory, step=args.step)
    except ZeroError as e:
        print(f"zerojax checkpoint: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"{summary['directory']}: steps {summary['steps']}; step {summary['step']}, "
        f"{summary['total_bytes']:,} bytes, extra {summary['extra']}"
    )
    for leaf in summary["leaves"]:
        print(
            f"  {leaf['path']:<60} {str(tuple(leaf['shape'])):>20} {leaf['dtype']:>9} "
            f"{leaf['bytes']:>14,}  saved as {leaf['saved_sharding']}"
        )
    return 0


def config_parser(sub) -> None:
    p = sub.add_parser("config", help="what zerojax does with a DeepSpeed JSON config")
    actions = p.add_subparsers(dest="action", required=True)
    e = actions.add_parser("explain", help="key by key: acts / ignored (why) / error")
    e.add_argument("file", help="a JSON file, or a shipped preset's name (e.g. zero3_offload)")
    e.add_argument("--devices", type=int, help="resolve the batch arithmetic for N devices")


def config(args) -> int:
    from zerojax.config import ZeroConfig, ZeroError
    from zerojax.config_files import read_config
    from zerojax.deepspeed import explain

    try:
        data = read_config(args.file)
        rows, options, unknown = explain(data, ZeroConfig.defaults())
        resolved = ZeroConfig(**options)
        if args.devices:
            resolved = resolved.for_devices(args.devices)
    except (OSError, json.JSONDecodeError, ZeroError) as e:
        print(f"zerojax config: {args.file}: {e}", file=sys.stderr)
        return 2
    width = max([len(r.key) for r in rows] + [10])
    for r in rows:
        print(f"{r.key:<{width}}  {r.kind:<8} {r.what}")
    for line in unknown:
        print(f"{'?':<{width}}  {'error':<8} {line}")
    print(resolved)
    return 2 if unknown else 0


def launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="run a script as P local processes (jax.distributed)")
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument(
        "--devices-per-process", type=int, help="simulated CPU devices per process (XLA_FLAGS)"
    )
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- python script.py ...")


def launch(args) -> int:
    from zerojax.launch import launch as run

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return run(args.num_processes, cmd, args.devices_per_process, args.port)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="zerojax", description="zerojax command line")
    sub = parser.add_subparsers(dest="command", required=True)
    plan_parser(sub)
    checkpoint_parser(sub)
    config_parser(sub)
    launch_parser(sub)
    args = parser.parse_args(argv)
    return {"plan": plan, "checkpoint": checkpoint, "config": config, "launch": launch}[
        args.command
    ](args)


if __name__ == "__main__":
    sys.exit(main())
