"""Mixed precision and gradient accumulation, measured: state bytes, collective bytes and dtypes,
communication per optimizer step against k, and the bf16-vs-fp32 loss curve.

    python bench/precision_report.py              # all three tables (about 2 minutes)
    python bench/precision_report.py --skip-curve

Bytes are per device on 8 simulated devices, read from live shards and from the HLO module
after SPMD partitioning (the dtype each collective sends). Formulas (Ψ params, N devices,
Adam): fp32 at rest 12Ψ / 4Ψ+8Ψ/N / 12Ψ/N; bf16 with fp32 master 14Ψ / 2Ψ+12Ψ/N / 14Ψ/N.
Writes bench/results/precision_report.json.
"""

import argparse
import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import GPT, PRESETS  # noqa: E402
from zerojax.models.data import random_windows, stdlib_tokens  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402

AT_REST = {
    ("fp32", 0): (12, 0),
    ("fp32", 1): (4, 8),
    ("fp32", 2): (4, 8),
    ("fp32", 3): (0, 12),
    ("bf16", 0): (14, 0),
    ("bf16", 1): (2, 12),
    ("bf16", 2): (2, 12),
    ("bf16", 3): (0, 14),
}


def setup(preset):
    cfg = PRESETS[preset]
    return cfg, make_init(GPT(cfg), optax.adamw(1e-3)), train_step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--skip-curve", action="store_true")
    p.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "precision_report.json")
    )
    args = p.parse_args(argv)
    cfg, init_fn, train_step = setup(args.preset)
    windows = random_windows(stdlib_tokens(), 201, 16, cfg.seq_len)
    mib = lambda b: f"{b / 2**20:8.3f}"
    out = {"preset": args.preset, "jax": jax.__version__}

    print(f"1. state and collectives, preset {args.preset}, one step, MiB per device")
    print(
        f"{'precision':>9} {'stage':>5} {'at rest':>8} {'formula':>8} {'gather':>14} "
        f"{'grad reduce':>18}"
    )
    rows = []
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            zero = zj.zero_shard(stage=stage, precision=precision, units=())
            state = zero.init(init_fn, jax.random.key(0))
            rep = zero.report(zero(train_step), state, windows[0])
            psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
            a, b = AT_REST[(precision, stage)]
            formula = a * psi + b * psi / zero.axis_size
            big = [c for c in rep.collectives if c.buffer_bytes >= 4096]
            gather = [c for c in big if c.kind == "all-gather"]
            reduce = [c for c in big if c.kind in ("all-reduce", "reduce-scatter")]
            gtxt = (
                f"{mib(sum(c.buffer_bytes for c in gather))} {gather[0].dtype}" if gather else "-"
            )
            rtxt = (
                (
                    f"{reduce[0].kind[:10]} {mib(sum(c.buffer_bytes for c in reduce))} "
                    f"{reduce[0].dtype}"
                )
                if reduce
                else "-"
            )
            rows.append(
                {
                    "precision": precision,
                    "stage": stage,
                    "psi": psi,
                    "resident_bytes": sum(rep.resident.values()),
                    "formula_bytes": formula,
                    "gather": gtxt,
                    "reduce": rtxt,
                }
            )
            print(
                f"{precision:>9} {stage:>5} {mib(rows[-1]['resident_bytes'])} {mib(formula)} "
                f"{gtxt:>14} {rtxt:>18}"
            )
    out["state"] = rows

    print("\n2. communication per optimizer step (MiB) against accumulation steps k (fp32)")
    print(f"{'stage':>5} {'mode':>8} " + " ".join(f"{'k=' + str(k):>9}" for k in (1, 2, 4, 8)))
    accum = []
    for stage, mode in ((0, "local"), (1, "local"), (2, "local"), (2, "reduced"), (3, "reduced")):
        sent = []
        for k in (1, 2, 4, 8):
            zero = zj.zero_shard(
                stage=stage,
                gradient_accumulation_steps=k,
                accumulate=mode,
                gradient_clipping=1e9,
                units=(),
            )  # same managed path for k = 1
            state = zero.init(init_fn, jax.random.key(0))
            rep = zero.report(zero(train_step), state, windows[0][:8])
            sent.append(sum(c.buffer_bytes for c in rep.collectives))
        accum.append({"stage": stage, "mode": mode, "bytes": sent})
        print(f"{stage:>5} {mode:>8} " + " ".join(f"{mib(b):>9}" for b in sent))
    out["accumulation"] = accum

    if not args.skip_curve:
        print("\n3. loss, stage 3, batch 16, stdlib bytes: fp32 against bf16 (fp32 master)")
        curves = {}
        for precision in ("fp32", "bf16"):
            zero = zj.zero_shard(stage=3, precision=precision, units=())
            state = zero.init(init_fn, jax.random.key(0))
            step = zero(train_step)
            curves[precision] = []
            for w in windows:
                state, m = step(state, w)
                curves[precision].append(float(m["loss"]))
        print(f"{'step':>5} {'fp32':>8} {'bf16':>8} {'rel diff':>9}")
        for i in (0, 50, 100, 150, 200):
            f, b = curves["fp32"][i], curves["bf16"][i]
            print(f"{i:>5} {f:8.4f} {b:8.4f} {abs(b - f) / f:9.4%}")
        out["curves"] = curves
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
