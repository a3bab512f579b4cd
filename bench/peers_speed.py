"""Speed against the peers, in ONE run on this machine: tokens/s of the same LM (4 layers,
d_model 256, 4 heads, SwiGLU 688, vocab 256, untied head, seq 128, global batch 64, fp32 AdamW)
trained by zerojax stages 0 and 3 on 8 simulated devices, by a hand-written `jax.jit` FSDP
(zerojax stage 3 placement with explicit_collectives=False: XLA places the collectives), and
by PyTorch DDP and FSDP2 on 8 gloo processes (`bench/torch_lm.py`).

    pip install torch==2.13.0        # the CPU build; a benchmark tool, never a zerojax dependency
    python bench/peers_speed.py [--rounds 3] [--steps 10]

Contenders alternate, round after round, each a fresh process timing --steps steps after 3
warm-up steps; a contender's figure is the median over rounds of its per-round median step
time, with the spread (min..max of the round medians). Ratios are zerojax / contender in
tokens/s. Writes bench/results/peers_speed.json and .png.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

from benchlib import run_with_devices, write_results

TORCH_LM = str(pathlib.Path(__file__).parent / "torch_lm.py")
SHAPE = dict(layers=4, d_model=256, heads=4, ffn=688, vocab=256, seq=128, batch=64)
JAX = {
    "zerojax stage 0": dict(stage=0),
    "zerojax stage 3": dict(stage=3),
    "jit FSDP": dict(stage=3, explicit_collectives=False),
}
TORCH = {"PyTorch DDP": "ddp", "PyTorch FSDP2": "fsdp2"}


def jax_worker(options: dict, steps: int) -> dict:
    """Runs in a fresh process with 8 simulated devices: median step seconds of zerojax."""
    import time

    import jax
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.models.gpt import lm_units, make_init, train_step
    from zerojax.models.lm import LM, LMConfig

    cfg = LMConfig(
        vocab=SHAPE["vocab"],
        d_model=SHAPE["d_model"],
        n_layers=SHAPE["layers"],
        n_heads=SHAPE["heads"],
        d_ff=SHAPE["ffn"],
        seq_len=SHAPE["seq"],
        tie_embeddings=False,
    )
    zero = zj.zero_shard(units=lm_units(cfg), **options)
    state = zero.init(make_init(LM(cfg), optax.adamw(1e-3)), jax.random.key(0))
    step = zero(train_step)
    rng = np.random.default_rng(0)
    times = []
    for i in range(3 + steps):
        batch = rng.integers(0, cfg.vocab, (SHAPE["batch"], cfg.seq_len + 1), dtype=np.int32)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return {
        "step_s_median": statistics.median(times),
        "params": sum(x.size for x in jax.tree_util.tree_leaves(state.params)),
    }


def run_jax(options: dict, steps: int) -> dict:
    return run_with_devices(8, "peers_speed", f"jax_worker({options!r}, {steps})", timeout=900)


def run_torch(mode: str, steps: int) -> dict:
    args = [
        sys.executable,  # torchrun of this interpreter, on PATH or not
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "8",
        TORCH_LM,
        "--mode",
        mode,
        "--layers",
        str(SHAPE["layers"]),
        "--d-model",
        str(SHAPE["d_model"]),
        "--heads",
        str(SHAPE["heads"]),
        "--ffn",
        str(SHAPE["ffn"]),
        "--vocab",
        str(SHAPE["vocab"]),
        "--seq",
        str(SHAPE["seq"]),
        "--batch-per-rank",
        str(SHAPE["batch"] // 8),
        "--steps",
        str(steps),
        "--warmup",
        "3",
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:  # (torchrun may abort at gloo shutdown after printing: that is fine)
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-3000:])
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    medians = {name: [] for name in [*JAX, *TORCH]}
    params = {}
    for r in range(args.rounds):
        for name in medians:
            res = (
                run_jax(JAX[name], args.steps)
                if name in JAX
                else run_torch(TORCH[name], args.steps)
            )
            medians[name].append(res["step_s_median"])
            params[name] = res["params"]
            print(f"round {r + 1}: {name:<18} {res['step_s_median']:.3f} s/step", flush=True)
    tokens = SHAPE["batch"] * SHAPE["seq"]
    rows = {}
    for name, times in medians.items():
        med = statistics.median(times)
        rows[name] = {
            "step_s": med,
            "step_s_min": min(times),
            "step_s_max": max(times),
            "tokens_per_s": tokens / med,
            "params": params[name],
            "rounds": times,
        }
    ours = rows["zerojax stage 3"]
    print(
        f"\nsame LM ({params['zerojax stage 3']:,} params), global batch {SHAPE['batch']} x "
        f"{SHAPE['seq']}, fp32 AdamW, 8 devices / processes on this machine"
    )
    print(
        f"{'contender':<18}{'s/step':>9}{'spread':>17}{'tokens/s':>10}{'zerojax stage 3 / it':>22}"
    )
    for name, row in rows.items():
        row["stage3_ratio"] = ours["tokens_per_s"] / row["tokens_per_s"]
        # spread of the ratio from the extremes of both contenders' round medians
        row["stage3_ratio_range"] = (
            min(row["rounds"]) / max(ours["rounds"]),
            max(row["rounds"]) / min(ours["rounds"]),
        )
        print(
            f"{name:<18}{row['step_s']:9.3f}{row['step_s_min']:8.3f}..{row['step_s_max']:<7.3f}"
            f"{row['tokens_per_s']:10.0f}{row['stage3_ratio']:14.2f} "
            f"({row['stage3_ratio_range'][0]:.2f}..{row['stage3_ratio_range'][1]:.2f})"
        )
    s3_s0 = ours["step_s"] / rows["zerojax stage 0"]["step_s"]
    print(f"zerojax stage 3 / stage 0 step time: {s3_s0:.2f} (target <= 1.3)")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(rows)
        ax.barh(
            names,
            [rows[n]["tokens_per_s"] for n in names],
            xerr=[
                [rows[n]["tokens_per_s"] - tokens / rows[n]["step_s_max"] for n in names],
                [tokens / rows[n]["step_s_min"] - rows[n]["tokens_per_s"] for n in names],
            ],
        )
        ax.set_xlabel("tokens/s (median of round medians; bars: spread)")
        ax.set_title("same LM, 8 devices/processes, one CPU machine")
        return fig

    write_results(
        "peers_speed", {"shape": SHAPE, "rows": rows, "stage3_over_stage0_step_time": s3_s0}, draw
    )


if __name__ == "__main__":
    sys.exit(main())
