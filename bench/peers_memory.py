"""Memory per device at N = 8, compiled (exact, nothing allocated), beside the formulas peers use.

    python bench/peers_memory.py [--presets tiny small 125m]

For each example-LM preset (bf16 params, fp32 master, AdamW, scanned layers, one sequence of
the preset's length per device): zerojax stages 0-3, stage 3 with the optimizer offloaded, and
a hand-written `jax.jit` FSDP (zerojax's stage-3 placement with explicit_collectives=False: XLA
inserts every collective; fp32, since zerojax casts to 16 bits in its own hook, so the
baseline is beside zerojax stage 3 in fp32, which keeps its activations as the baseline does,
and, recomputing each unit in backward, `recompute_units=True`). Columns: bytes at rest on the
device, compiled peak (arguments + temporaries), and two formulas for the same Ψ and N:
- the ZeRO paper's model states (K = 12): stage 0 16Ψ, 1 4Ψ + 12Ψ/N, 2 2Ψ + 14Ψ/N,
  3 16Ψ/N (offload: 4Ψ/N on the device, as the paper's ZeRO-Offload keeps fp16 params + grads;
  the fp32 rows: 16Ψ/N = fp32 params 4 + grads 4 + Adam 8);
- DeepSpeed's estimators (`estimate_zero2/3_model_states_mem_needs`, no zero_init buffer
  factor on the GPU side): stage 2 4Ψ + 16Ψ/N; stage 3 4·Lmax + 18Ψ/N, with the optimizer
  offloaded 4·Lmax + 2Ψ/N, Lmax being the largest parameter tensor; stages 0-1: none.
Writes bench/results/peers_memory.json and .png.
"""

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from benchlib import markdown_table, write_results  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import lm_units, make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

N = 8
CONTENDERS = {
    "stage 0": dict(stage=0),
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2),
    "stage 3": dict(stage=3),
    "stage 3 + offload": dict(stage=3, offload_optimizer="cpu", offload_update="host"),
    "stage 3 fp32": dict(stage=3, precision="fp32"),
    "stage 3 fp32 recompute": dict(stage=3, precision="fp32", recompute_units=True),
    "jit FSDP fp32": dict(stage=3, precision="fp32", explicit_collectives=False),
}


def paper(name: str, psi: int) -> float:
    return {
        "stage 0": 16 * psi,
        "stage 1": 4 * psi + 12 * psi / N,
        "stage 2": 2 * psi + 14 * psi / N,
        "stage 3": 16 * psi / N,
        "stage 3 + offload": 4 * psi / N,
        # fp32 params (4) + grads (4) + Adam (8), all sharded
        "stage 3 fp32": 16 * psi / N,
        "stage 3 fp32 recompute": 16 * psi / N,
        "jit FSDP fp32": 16 * psi / N,
    }[name]


def deepspeed(name: str, psi: int, largest: int):
    return {
        "stage 2": 4 * psi + 16 * psi / N,
        "stage 3": 4 * largest + 18 * psi / N,
        "stage 3 + offload": 4 * largest + 2 * psi / N,
    }.get(name)


def measure(preset: str) -> list[dict]:
    cfg = LM_PRESETS[preset]
    init_fn = make_init(LM(cfg), optax.adamw(1e-4))
    batch = jax.ShapeDtypeStruct((N, cfg.seq_len + 1), jnp.int32)
    rows = []
    for name, options in CONTENDERS.items():
        zero = zj.zero_shard(**{"precision": "bf16", "units": lm_units(cfg), **options})
        state = zero.eval_shape(init_fn, jax.random.key(0))
        leaves = jax.tree_util.tree_leaves(state.params)
        psi, largest = sum(x.size for x in leaves), max(x.size for x in leaves)
        rep = zero.report(zero(train_step), state, batch)
        at_rest = sum(rep.resident.values())
        row = {
            "preset": preset,
            "contender": name,
            "params": psi,
            "at_rest": at_rest,
            "peak": rep.peak_bound_bytes,
            "paper": paper(name, psi),
            "deepspeed": deepspeed(name, psi, largest),
        }
        row["at_rest_over_paper"] = at_rest / row["paper"]
        row["at_rest_over_deepspeed"] = at_rest / row["deepspeed"] if row["deepspeed"] else None
        rows.append(row)
        print(
            f"{preset:>6} {name:<18}{at_rest / 2**20:10.2f}{row['peak'] / 2**20:10.2f}"
            f"{row['paper'] / 2**20:10.2f}{row['at_rest_over_paper']:8.3f}"
            + (
                f"{row['deepspeed'] / 2**20:11.2f}{row['at_rest_over_deepspeed']:8.3f}"
                if row["deepspeed"]
                else f"{'-':>11}{'-':>8}"
            ),
            flush=True,
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small", "125m"])
    args = parser.parse_args()
    print(f"MiB per device, N = {N}, bf16 + fp32 master + AdamW, one sequence per device")
    print(
        f"{'preset':>6} {'contender':<18}{'at rest':>10}{'peak':>10}{'paper':>10}{'ratio':>8}"
        f"{'DeepSpeed':>11}{'ratio':>8}"
    )
    rows = [row for preset in args.presets for row in measure(preset)]

    def draw(plt):
        fig, axes = plt.subplots(
            1, len(args.presets), figsize=(4 * len(args.presets), 3.5), squeeze=False
        )
        for ax, preset in zip(axes[0], args.presets, strict=True):
            sub = [r for r in rows if r["preset"] == preset]
            names = [r["contender"] for r in sub]
            ax.barh(names, [r["peak"] / 2**20 for r in sub], label="peak", color="#bbb")
            ax.barh(names, [r["at_rest"] / 2**20 for r in sub], label="at rest", color="#36c")
            ax.set_title(f"{preset} ({sub[0]['params'] / 1e6:.1f}M params), N = {N}")
            ax.set_xlabel("MiB per device")
        axes[0][0].legend()
        return fig

    write_results("peers_memory", rows, draw, markdown=table(rows))


def table(rows: list) -> str:
    """BENCHMARKS.md's table: MiB per device, ratios to the paper's and DeepSpeed's formulas."""
    mib = lambda b: f"{b / 2**20:,.2f}"
    body, seen = [], set()
    for r in rows:
        first = r["preset"] not in seen
        seen.add(r["preset"])
        preset = f"{r['preset']} ({r['params'] / 1e6:.1f}M)" if first else r["preset"]
        ds = r["deepspeed"]
        body.append(
            [
                preset,
                r["contender"],
                mib(r["at_rest"]),
                mib(r["peak"]),
                mib(r["paper"]),
                f"{r['at_rest_over_paper']:.3f}",
                mib(ds) if ds else "–",
                f"{r['at_rest_over_deepspeed']:.3f}" if ds else "–",
            ]
        )
    headers = [
        "preset",
        "contender",
        "at rest",
        "peak",
        "paper",
        "at rest / paper",
        "DeepSpeed",
        "at rest / DeepSpeed",
    ]
    return markdown_table(headers, body)


if __name__ == "__main__":
    sys.exit(main())
