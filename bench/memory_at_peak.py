"""Memory at the peak, measured on the example LM as `zerojax plan` compiles it (bf16 with fp32
master weights, Adam, scanned + remat layers, one sequence per device, N = 8):

1. stages 1-2 reduce each unit's gradient in its backward: the peak against the same stage
   with no units (every gradient reduced after backward), and the bytes each stage sends;
2. what is alive at the stage-3 peak, by category (`Report.peak`), against the ZeRO formulas
   for the state: bf16 parameter shards 2Ψ/N, fp32 master weights 4Ψ/N, Adam moments 8Ψ/N.

    python bench/memory_at_peak.py                  # 125m and 7b (about 2 minutes)
    python bench/memory_at_peak.py --preset 125m --json

Compiles only (abstract state), with the planning flags of `zerojax plan` (zerojax.core.xla_flags).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from benchlib import markdown_table, write_results  # noqa: E402

N = 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from zerojax.core import xla_flags  # noqa: E402

xla_flags.apply_planning_flags()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import lm_units, make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

HELD = ("parameters", "master weights", "optimizer state")
FORMULA = {"parameters": 2, "master weights": 4, "optimizer state": 8}  # bytes per Ψ/N


def measure(preset: str) -> dict:
    cfg = LM_PRESETS[preset].replace(scan_layers=True, remat=True)
    init_fn = make_init(LM(cfg), optax.adamw(1e-4))
    batch = jax.ShapeDtypeStruct((N, cfg.seq_len + 1), jnp.int32)
    rows, out = {}, {"preset": preset, "devices": N}
    for label, options in (
        ("stage 1", dict(stage=1)),
        ("stage 2", dict(stage=2)),
        ("stage 2, reduced after backward", dict(stage=2, units=())),
        ("stage 3", dict(stage=3)),
    ):
        options.setdefault("units", lm_units(cfg))
        zero = zj.zero_shard(precision="bf16", **options)
        state = zero.eval_shape(init_fn, jax.random.key(0))
        rep = zero.report(zero(train_step), state, batch)
        out["psi"] = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        rows[label] = {"peak_bytes": rep.peak_bytes, "sent_bytes": int(rep.sent_bytes)}
        if options["stage"] == 3:
            cats = rep.peak.by_category()
            reused = lambda cat, peak=rep.peak: sum(
                b.bytes for b in peak.buffers if b.reuses == cat
            )
            out["stage3_peak"] = {
                "by_category": cats,
                "held": {cat: cats.get(cat, 0) + reused(cat) for cat in HELD},
                "resident": rep.resident,
                "live_bytes": rep.peak.live_bytes,
                "compiled_bytes": rep.peak_bytes,
                "at": rep.peak.at,
                "text": rep.peak.format(top=8),
            }
    out["rows"] = rows
    return out


def show(result: dict) -> None:
    gib = lambda b: f"{b / 2**30:8.3f}"
    psi, n = result["psi"], result["devices"]
    print(f"\npreset {result['preset']}: Ψ = {psi:,}, N = {n} (GiB per device)")
    print(f"  {'':<34}{'peak':>8}{'sent/step':>11}")
    for label, row in result["rows"].items():
        print(f"  {label:<34}{gib(row['peak_bytes'])}{gib(row['sent_bytes']):>11}")
    rows = result["rows"]
    saved = rows["stage 2, reduced after backward"]["peak_bytes"] - rows["stage 2"]["peak_bytes"]
    print(
        f"  per-unit reduction saves {gib(saved).strip()} GiB at stage 2; half of (N-1)/N * 4Ψ "
        f"= {gib(0.5 * (n - 1) / n * 4 * psi).strip()} GiB"
    )
    peak = result["stage3_peak"]
    print("  stage 3, state held at the peak against its formula:")
    for cat in HELD:
        formula = FORMULA[cat] * psi / n
        print(f"    {cat:<18}{gib(peak['held'][cat])}  formula {gib(formula)}")
    print("  " + peak["text"].replace("\n", "\n  ").rstrip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", action="append", help="default: 125m and 7b")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    results = [measure(preset) for preset in args.preset or ["125m", "7b"]]
    if args.json:  # for tests/test_peak.py: printed only, no files written
        print(json.dumps(results))
        return 0
    for result in results:
        show(result)
    write_results("memory_at_peak", results, markdown=table(results))
    return 0


def table(results: list) -> str:
    """BENCHMARKS.md's table: GiB per device at the peak, and what stages 1-2 send."""
    gib = lambda b: f"{b / 2**30:.3f}"
    body = []
    for r in results:
        rows = r["rows"]
        body.append(
            [
                f"{r['preset']} (Ψ = {r['psi'] / 1e6:,.1f}M)"
                if r["psi"] < 1e9
                else f"{r['preset']} (Ψ = {r['psi'] / 1e9:.2f}B)",
                gib(rows["stage 1"]["peak_bytes"]),
                gib(rows["stage 2"]["peak_bytes"]),
                gib(rows["stage 2, reduced after backward"]["peak_bytes"]),
                gib(rows["stage 3"]["peak_bytes"]),
                f"{gib(rows['stage 1']['sent_bytes'])}, {gib(rows['stage 2']['sent_bytes'])}",
            ]
        )
    headers = [
        "preset",
        "stage 1 peak",
        "stage 2 peak",
        "stage 2, gradients reduced after backward",
        "stage 3 peak",
        "sent/step stages 1, 2",
    ]
    return markdown_table(headers, body)


if __name__ == "__main__":
    sys.exit(main())
