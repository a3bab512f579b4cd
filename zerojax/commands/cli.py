"""The `zerojax` command.

    zerojax plan --preset 7b --devices 8 --device-memory 80GB
    zerojax checkpoint info DIR
    zerojax checkpoint verify DIR [--step N]
    zerojax checkpoint export DIR --dtype bf16 --out model.safetensors
    zerojax config explain ds_config.json
    zerojax launch -n 2 --devices-per-process 4 -- python examples/pretrain_lm.py

`plan` lives in `zerojax.commands.plan`; the other commands are small and live here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from zerojax.commands.plan import plan, plan_parser


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
    from zerojax.core.errors import ZeroError
    from zerojax.io.export import export, info, verify

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
    from zerojax.core.config import ZeroConfig
    from zerojax.core.config_files import read_config
    from zerojax.core.deepspeed_json import explain
    from zerojax.core.errors import ZeroError

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
    from zerojax.commands.launch import launch as run

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
