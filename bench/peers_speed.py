"""Speed against the peers, in ONE run on this machine: the same LM (4 layers, d_model 256, 4
heads, SwiGLU 688, vocab 256, untied head, seq 128, global batch 64, fp32 AdamW) trained by
zerojax stages 0-3 (8 devices in one process, and 8 processes x 1 device through `zerojax
launch`; stage 3 also with `unit_buffers=True`, one collective per unit each way), PyTorch
DDP, FSDP2 (ZeRO-3-like and ZeRO-2-like) and DeepSpeed ZeRO-1/2/3 (8 gloo processes,
bench/torch_lm.py), and each framework's one-device time at the same global batch
(a plain `jax.jit` step; one PyTorch process; one DeepSpeed process), all with the
benchmark-only installs of bench/torch_lm.py's docstring:

    python bench/peers_speed.py [--rounds 3] [--steps 6] [--only REGEX]

Contenders alternate, round after round, each a fresh process timing --steps steps after 2
warm-up steps; a contender's figure is the median over rounds of its per-round median step
time, with the spread (min..max of the round medians). Scaling efficiency = the framework's
one-device step time / its 8-device step time (the same global batch, so 8 would be perfect on
8 free devices; this machine has 2 cores). Collectives per step: zerojax's counted in its
compiled HLO (bytes one device sends); the peers' from the ZeRO paper's formula (Psi fp32
parameters, ring factor 7/8). Writes bench/results/peers_speed.json, .md and .png; with
`--only`, a quicker look: only the contenders the regex matches, beside the one-device
baselines and the rows the targets compare (zerojax stage 3 and the peers' ZeRO-3), printed and
not written.
"""

import argparse
import os
import pathlib
import re
import statistics
import sys

from benchlib import markdown_table, run_json, write_results
from jax_lm import SHAPE

BENCH = pathlib.Path(__file__).parent
PY = sys.executable
ZEROJAX = str(pathlib.Path(PY).parent / "zerojax")  # the launcher installed beside it
EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
DS = {"DS_ACCELERATOR": "cpu"}
TARGETS = (  # the rows `targets` compares
    "zerojax stage 3, 1 x 8",
    "zerojax stage 3, 8 x 1",
    "PyTorch FSDP2 (ZeRO-3-like)",
    "DeepSpeed ZeRO-3",
)


def torchrun(procs: int, *args) -> list:
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)]
    return [*launcher, str(BENCH / "torch_lm.py"), *args]


def contenders() -> dict:
    """name -> (family, command, environment, role); role is 'one device' or '8 devices'."""
    jax_lm = [PY, str(BENCH / "jax_lm.py")]
    out = {"JAX, one device (jax.jit)": ("zerojax", [*jax_lm, "--plain-jit"], {}, "one device")}
    whole = ["--batch-per-rank", str(SHAPE["batch"]), "--threads", str(os.cpu_count())]
    out["PyTorch, one process"] = (
        "PyTorch",
        [PY, str(BENCH / "torch_lm.py"), "--mode", "single", *whole],
        {},
        "one device",
    )
    ds_one = torchrun(1, "--mode", "deepspeed", "--zero-stage", "0", *whole)
    out["DeepSpeed, one process"] = ("DeepSpeed", ds_one, DS, "one device")
    for stage in range(4):
        args = ["--stage", str(stage)]
        out[f"zerojax stage {stage}, 1 x 8"] = ("zerojax", [*jax_lm, *args], EIGHT, "8 devices")
        launched = [ZEROJAX, "launch", "-n", "8", "--", *jax_lm, *args]
        out[f"zerojax stage {stage}, 8 x 1"] = ("zerojax", launched, {}, "8 devices")
    buffers = ["--stage", "3", "--unit-buffers"]  # one collective per unit each way
    out["zerojax stage 3 unit_buffers, 1 x 8"] = (
        "zerojax",
        [*jax_lm, *buffers],
        EIGHT,
        "8 devices",
    )
    launched = [ZEROJAX, "launch", "-n", "8", "--", *jax_lm, *buffers]
    out["zerojax stage 3 unit_buffers, 8 x 1"] = ("zerojax", launched, {}, "8 devices")
    for mode, name in (
        ("ddp", "DDP"),
        ("fsdp2", "FSDP2 (ZeRO-3-like)"),
        ("fsdp2-zero2", "FSDP2 (ZeRO-2-like)"),
    ):
        out[f"PyTorch {name}"] = ("PyTorch", torchrun(8, "--mode", mode), {}, "8 devices")
    for stage in (1, 2, 3):
        cmd = torchrun(8, "--mode", "deepspeed", "--zero-stage", str(stage))
        out[f"DeepSpeed ZeRO-{stage}"] = ("DeepSpeed", cmd, DS, "8 devices")
    return out


def formula_traffic(name: str, params: int) -> str:
    """The peers' bytes one device sends per step (ZeRO paper: 2 x 4 Psi x 7/8 for DDP and
    ZeRO-1/2, 3 x for ZeRO-3), in MiB."""
    copies = 3 if ("ZeRO-3" in name) else 2
    return f"{copies * 4 * params * 7 / 8 / 2**20:.1f} (formula)"


def hlo_traffic(collectives: dict) -> str:
    counts = ", ".join(f"{row['count']} {kind}" for kind, row in sorted(collectives.items()))
    total = sum(row["sent_bytes"] for row in collectives.values())
    return f"{total / 2**20:.1f} ({counts})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", help="regex: run only these contenders (see above)")
    args = parser.parse_args()
    table = {
        name: c
        for name, c in contenders().items()
        if not args.only or c[3] == "one device" or name in TARGETS or re.search(args.only, name)
    }
    rounds = {name: [] for name in table}
    results = {}
    for r in range(args.rounds):
        for name, (_, cmd, env, _) in table.items():
            extra = ["--steps", str(args.steps), "--warmup", "2"]
            if r == 0 and name.startswith("zerojax") and "1 x 8" in name:
                extra.append("--collectives")  # counted once: the program is the same each round
            res = run_json([*cmd, *extra], env)
            results.setdefault(name, {}).update(res)
            rounds[name].append(res["step_s_median"])
            print(f"round {r + 1}: {name:<28} {res['step_s_median']:.3f} s/step", flush=True)
    tokens = SHAPE["batch"] * SHAPE["seq"]
    base = {
        family: statistics.median(rounds[name])
        for name, (family, _, _, role) in table.items()
        if role == "one device"
    }
    rows = {}
    for name, (family, _, _, role) in table.items():
        med = statistics.median(rounds[name])
        rows[name] = {
            "family": family,
            "role": role,
            "step_s": med,
            "step_s_min": min(rounds[name]),
            "step_s_max": max(rounds[name]),
            "rounds": rounds[name],
            "tokens_per_s": tokens / med,
            "scaling_efficiency": base[family] / med,
            "params": results[name]["params"],
        }
        if "collectives" in results[name]:
            rows[name]["collectives"] = results[name]["collectives"]
    for name in rows:  # one program in both layouts
        if name.endswith("8 x 1"):
            rows[name]["collectives"] = rows.get(name.replace("8 x 1", "1 x 8"), {}).get(
                "collectives"
            )
    verdict = targets(rows)
    md = render(rows, verdict, args)
    print("\n" + md)
    if args.only:
        print("--only: bench/results/peers_speed.* left as they were", flush=True)
        return
    write_results(
        "peers_speed",
        {"shape": SHAPE, "rows": rows, "targets": verdict},
        draw=chart(rows, tokens),
        markdown=md,
    )


def targets(rows: dict) -> dict:
    """Issue targets: zerojax stage 3 (its faster layout) against the best peer ZeRO-3."""
    ours = max(
        (rows[f"zerojax stage 3, {lay}"] for lay in ("1 x 8", "8 x 1")),
        key=lambda r: r["tokens_per_s"],
    )
    peers = {
        n: r for n, r in rows.items() if n in ("PyTorch FSDP2 (ZeRO-3-like)", "DeepSpeed ZeRO-3")
    }
    best_eff = max(peers, key=lambda n: peers[n]["scaling_efficiency"])
    best_tps = max(peers, key=lambda n: peers[n]["tokens_per_s"])
    eff = ours["scaling_efficiency"] / peers[best_eff]["scaling_efficiency"]
    tps = ours["tokens_per_s"] / peers[best_tps]["tokens_per_s"]
    return {
        "scaling_efficiency_ratio": eff,
        "scaling_efficiency_peer": best_eff,
        "scaling_efficiency_met": eff >= 1.3,
        "tokens_per_s_ratio": tps,
        "tokens_per_s_peer": best_tps,
        "tokens_per_s_met": tps >= 1.0,
    }


def render(rows: dict, verdict: dict, args) -> str:
    zj3 = max(("1 x 8", "8 x 1"), key=lambda lay: rows[f"zerojax stage 3, {lay}"]["tokens_per_s"])
    ours = rows[f"zerojax stage 3, {zj3}"]
    body = []
    for name, row in rows.items():
        traffic = (
            "–"
            if row["role"] == "one device"
            else (
                hlo_traffic(row["collectives"])
                if row.get("collectives")
                else formula_traffic(name, row["params"])
            )
        )
        body.append(
            [
                name,
                f"{row['step_s']:.3f}",
                f"{row['step_s_min']:.3f}–{row['step_s_max']:.3f}",
                f"{row['tokens_per_s']:,.0f}",
                "1 (baseline)"
                if row["role"] == "one device"
                else f"{row['scaling_efficiency']:.2f}",
                f"{ours['tokens_per_s'] / row['tokens_per_s']:.2f}",
                traffic,
            ]
        )
    headers = [
        "contender",
        "s/step",
        "spread",
        "tokens/s",
        "scaling efficiency",
        f"zerojax stage 3 ({zj3}) / it",
        "sent per step, MiB (collectives)",
    ]
    v = verdict
    lines = [
        markdown_table(headers, body),
        f"{args.rounds} rounds x {args.steps} steps. Targets, zerojax stage 3 ({zj3}) against the "
        f"best peer ZeRO-3: scaling efficiency {v['scaling_efficiency_ratio']:.2f}x "
        f"{v['scaling_efficiency_peer']}'s (target >= 1.3: "
        f"{'met' if v['scaling_efficiency_met'] else 'missed'}); tokens/s "
        f"{v['tokens_per_s_ratio']:.2f}x {v['tokens_per_s_peer']}'s (target >= 1.0: "
        f"{'met' if v['tokens_per_s_met'] else 'missed'}).",
    ]
    return "\n".join(lines) + "\n"


def chart(rows: dict, tokens: int):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 5))
        names = list(rows)
        ax.barh(
            names,
            [rows[n]["tokens_per_s"] for n in names],
            xerr=[
                [rows[n]["tokens_per_s"] - tokens / rows[n]["step_s_max"] for n in names],
                [tokens / rows[n]["step_s_min"] - rows[n]["tokens_per_s"] for n in names],
            ],
        )
        ax.invert_yaxis()
        ax.set_xlabel("tokens/s (median of round medians; bars: spread)")
        ax.set_title("same LM and global batch, one CPU machine (2 cores)")
        return fig

    return draw


if __name__ == "__main__":
    sys.exit(main())
