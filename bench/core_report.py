"""Per-device memory and per-step communication of ZeRO stages 0-3, beside the ZeRO formulas.

    python bench/core_report.py                        # preset 3m, 8 devices, seq 8
    python bench/core_report.py --seq-len 128          # activation-heavy: peak set by activations

Every figure is read from the compiled executable (memory_analysis, optimized HLO) or summed
from the live shards on device 0; the formulas (fp32 params, Adam: Ψ params, N devices) stand
beside them. Writes bench/results/core_report.json.
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
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import GPT, PRESETS  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402

AT_REST = {
    0: lambda p, n: 12 * p,
    1: lambda p, n: 4 * p + 8 * p / n,
    2: lambda p, n: 4 * p + 8 * p / n,
    3: lambda p, n: 12 * p / n,
}
COMM = {0: "AR 4Ψ", 1: "RS 4Ψ + AG 4Ψ", 2: "RS 4Ψ + AG 4Ψ", 3: "AG 4Ψ + RS 4Ψ"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="3m", choices=sorted(PRESETS))
    p.add_argument("--seq-len", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "core_report.json")
    )
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    model = GPT(cfg)
    batch = np.random.default_rng(0).integers(
        0, cfg.vocab, (args.batch_size, args.seq_len + 1), dtype=np.int32
    )
    init_fn = make_init(model, optax.adam(1e-3))

    rows = []
    for stage in range(4):
        zero = zj.zero_shard(stage=stage, units=())  # the GPT as measured: no units
        state = zero.init(init_fn, jax.random.key(0))
        rep = zero.report(zero(train_step), state, batch)
        psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        n = zero.axis_size
        resident = sum(rep.resident.values())
        rows.append(
            {
                "stage": stage,
                "devices": n,
                "psi": psi,
                "resident_bytes": resident,
                "formula_bytes": AT_REST[stage](psi, n),
                "kept_replicated_bytes": rep.kept_replicated,
                "argument_bytes": rep.argument_bytes,
                "temp_bytes": rep.temp_bytes,
                "peak_bytes": rep.peak_bytes,
                **{
                    f"{k}_bytes": rep.bytes_of(k)
                    for k in ("all-reduce", "reduce-scatter", "all-gather")
                },
                "comm_formula": COMM[stage],
            }
        )
    mib = lambda b: f"{b / 2**20:8.2f}"
    print(
        f"preset {args.preset}, Ψ = {rows[0]['psi']:,} params, N = {rows[0]['devices']}, "
        f"batch {args.batch_size} x seq {args.seq_len}, fp32 + Adam; MiB per device"
    )
    print(
        f"{'stage':>5} {'at rest':>8} {'formula':>8} {'ratio':>6} {'args':>8} {'temp':>8} "
        f"{'peak':>8} {'AR':>8} {'RS':>8} {'AG':>8}  comm formula (4Ψ = "
        f"{mib(4 * rows[0]['psi']).strip()})"
    )
    for r in rows:
        print(
            f"{r['stage']:>5} {mib(r['resident_bytes'])} {mib(r['formula_bytes'])} "
            f"{r['resident_bytes'] / r['formula_bytes']:6.3f} {mib(r['argument_bytes'])} "
            f"{mib(r['temp_bytes'])} {mib(r['peak_bytes'])} {mib(r['all-reduce_bytes'])} "
            f"{mib(r['reduce-scatter_bytes'])} {mib(r['all-gather_bytes'])}  {r['comm_formula']}"
        )
    saving = rows[0]["peak_bytes"] - rows[2]["peak_bytes"]
    saved_formula = (rows[0]["devices"] - 1) / rows[0]["devices"] * 12 * rows[0]["psi"]
    print(
        f"stages 1-2 peak below stage 0 by {mib(saving).strip()} MiB "
        f"((N-1)/N·12Ψ of state = {mib(saved_formula).strip()} MiB); stage 1 = stage 2 "
        "(both reduce-scatter the gradients, the full gradient is never held)"
    )
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        kept = {k: v for k, v in vars(args).items() if k != "out"}  # no path of this machine
        json.dump({"args": kept, "jax": jax.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
