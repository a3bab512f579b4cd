"""Communication per step by collective, from the HLO after SPMD partitioning, on a
(node = 2, local = 4) mesh: zerojax stages 0-3 and the ZeRO++ variants, total and cross-node,
with the formula beside each.

    python bench/peers_comm.py [--preset small]

Example LM preset, bf16 + fp32 master + Adam, gradients reduced in bf16 (DeepSpeed's default in
bf16), one sequence per device. Bytes one device sends per step under ring algorithms
(all-reduce 2(g-1)/g of the buffer, all-gather / reduce-scatter / all-to-all (g-1)/g), in units
of M = 2Ψ bytes (one bf16 model copy). Formulas (ZeRO and ZeRO++ papers, ring factor 7/8 for
g = 8): stages 0-2 2M (gradient all-reduce, or reduce-scatter + parameter all-gather), stage 3
3M (gather, re-gather, reduce-scatter), ZeRO++ 0.75M across nodes. zerojax's stage 1 all-reduces
the gradient and then all-gathers the updated bf16 parameters (2M + M). Writes
bench/results/peers_comm.json and .png.
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

RING = 7 / 8
ZEROPP = dict(quantized_weights=True, hpz_partition_size=4, quantized_gradients=True)
VARIANTS = {  # name: (options, formula for all bytes in M, formula across nodes in M)
    "stage 0": (dict(stage=0), 2 * RING, 2 * RING),
    "stage 1": (dict(stage=1), 2 * RING, 2 * RING),  # reduce-scatter + all-gather, as stage 2
    "stage 2": (dict(stage=2), 2 * RING, 2 * RING),
    "stage 3": (dict(stage=3), 3 * RING, 3 * RING),
    "stage 3 qwZ": (dict(stage=3, quantized_weights=True), None, None),
    "stage 3 hpZ": (dict(stage=3, hpz_partition_size=4), None, None),
    "stage 3 qgZ": (dict(stage=3, quantized_gradients=True), None, None),
    "stage 3 ZeRO++ (all three)": (dict(stage=3, **ZEROPP), None, 0.75),
    "stage 3 MiCS (4)": (dict(stage=3, mics_shard_size=4), None, None),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    cfg = LM_PRESETS[args.preset]
    init_fn = make_init(LM(cfg), optax.adam(1e-3))
    rows = {}
    for name, (options, formula, formula_cross) in VARIANTS.items():
        zero = zj.zero_shard(
            precision="bf16",
            grad_reduce_dtype="bf16",
            mesh=zj.make_mesh(local=4),
            units=lm_units(cfg),
            **options,
        )
        state = zero.eval_shape(init_fn, jax.random.key(0))
        psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        m = 2 * psi
        rep = zero.report(
            zero(train_step), state, jax.ShapeDtypeStruct((8, cfg.seq_len + 1), jnp.int32)
        )
        by = {
            f"{kind} {dtype}": {"count": c, "sent_M": sent / m, "cross_node_M": cross / m}
            for (kind, dtype), (c, _, sent, cross) in sorted(rep.comm_table().items())
        }
        rows[name] = {
            "sent_M": rep.sent_bytes / m,
            "cross_node_M": rep.cross_node_bytes / m,
            "formula_M": formula,
            "formula_cross_node_M": formula_cross,
            "by_collective": by,
            "M_bytes": m,
        }
        f = lambda x: f"{x:.2f}" if x is not None else "-"
        print(
            f"{name:<28}{rows[name]['sent_M']:8.2f} ({f(formula):>4})"
            f"{rows[name]['cross_node_M']:9.2f}"
            f" ({f(formula_cross):>4})   "
            + ", ".join(f"{k} {v['sent_M']:.2f}" for k, v in by.items() if v["sent_M"] >= 0.01),
            flush=True,
        )

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(rows)
        ax.barh(names, [rows[n]["sent_M"] for n in names], color="#bbb", label="all")
        ax.barh(names, [rows[n]["cross_node_M"] for n in names], color="#c33", label="across nodes")
        ax.invert_yaxis()
        ax.set_xlabel("bytes sent per device per step, in M = one bf16 model copy")
        ax.set_title(f"'{args.preset}' on (node 2, local 4)")
        ax.legend()
        return fig

    write_results("peers_comm", {"preset": args.preset, "rows": rows}, draw, markdown=table(rows))


def table(rows: dict) -> str:
    """BENCHMARKS.md's table: bytes one device sends per step in M = 2Ψ, formulas beside."""
    f = lambda x: f" ({x:.2f})" if x is not None else ""
    body = [
        [
            name,
            f"{r['sent_M']:.2f}{f(r['formula_M'])}",
            f"{r['cross_node_M']:.2f}{f(r['formula_cross_node_M'])}",
            ", ".join(
                f"{k} {v['sent_M']:.2f}"
                for k, v in r["by_collective"].items()
                if v["sent_M"] >= 0.01
            ),
        ]
        for name, r in rows.items()
    ]
    headers = ["variant", "sent (formula)", "cross-node (formula)", "by collective"]
    return markdown_table(headers, body)


if __name__ == "__main__":
    sys.exit(main())
