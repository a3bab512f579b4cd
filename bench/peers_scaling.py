"""Scaling with the device count N = 1, 2, 4, 8 (a fresh process per N, simulated devices).

    python bench/peers_scaling.py [--budget 40GB]

1. Fixed global batch (64 sequences of 128 tokens, the LM of bench/peers_speed.py, fp32 AdamW,
   zerojax stage 3): compiled per-device peak and median step time of 8 steps after 3 warm-up
   steps. On one CPU machine the N devices share its cores, so step time shows zerojax's
   overhead as N grows, not a speed-up.
2. "How big can I go": the largest example-LM preset whose compiled stage-3 step (bf16, fp32
   master, Adam, scanned + remat, one sequence of the preset's length per device) fits the
   per-device budget, for each N, with and without the optimizer offloaded (peak bound:
   compiled peak + offloaded state the step streams in). Compiled only, nothing allocated;
   a preset whose 14Ψ/N bytes of state alone exceed the budget is skipped without compiling.
Writes bench/results/peers_scaling.json and .png.
"""

import argparse
import pathlib
import sys

from benchlib import markdown_table, run_with_devices, write_results

ROOT = pathlib.Path(__file__).parent.parent
PRESETS = ["7b", "1.3b", "350m", "125m", "small", "tiny"]  # largest first


def worker(n: int, budget: int) -> dict:
    """In a process with n devices: step time and peak (item 1), largest fitting preset (2)."""
    import statistics
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.models.gpt import make_init, train_step
    from zerojax.models.lm import LM, LM_PRESETS, param_count

    sys.path.insert(0, str(ROOT / "bench"))
    from jax_lm import SHAPE, lm_config

    cfg = lm_config()
    zero = zj.zero_shard(stage=3)
    init_fn = make_init(LM(cfg), optax.adamw(1e-3))
    state, step = zero.init(init_fn, jax.random.key(0)), zero(train_step)
    rng, times = np.random.default_rng(0), []
    batch = rng.integers(0, cfg.vocab, (SHAPE["batch"], cfg.seq_len + 1), dtype=np.int32)
    peak = zero.report(step, state, batch).peak_bytes
    for i in range(11):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= 3:
            times.append(time.perf_counter() - t0)
    out = {"n": n, "peak_bytes": peak, "step_s": statistics.median(times), "fits": {}}
    for offload in (False, True):
        options = dict(offload_optimizer="cpu", offload_update="host") if offload else {}
        for preset in PRESETS:
            pcfg = LM_PRESETS[preset].replace(remat=True)
            if 14 * param_count(pcfg) / n > budget:  # its state alone (at rest <= peak bound)
                continue
            z = zj.zero_shard(stage=3, precision="bf16", **options)
            st = z.eval_shape(make_init(LM(pcfg), optax.adamw(1e-4)), jax.random.key(0))
            rep = z.report(
                z(train_step), st, jax.ShapeDtypeStruct((n, pcfg.seq_len + 1), jnp.int32)
            )
            if rep.peak_bound_bytes <= budget:
                out["fits"]["offload" if offload else "none"] = {
                    "preset": preset,
                    "peak_bound_bytes": rep.peak_bound_bytes,
                    "params": sum(x.size for x in jax.tree_util.tree_leaves(st.params)),
                }
                break
    return out


def main():
    sys.path.insert(0, str(ROOT))
    from zerojax.commands.plan import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=parse_bytes, default=parse_bytes("40GB"))
    args = parser.parse_args()
    rows = []
    print(
        f"{'N':>2}{'peak MiB':>10}{'s/step':>8}   largest stage-3 preset within "
        f"{args.budget / 1e9:g} GB: no offload / optimizer offloaded"
    )
    for n in (1, 2, 4, 8):
        r = run_with_devices(n, "peers_scaling", f"worker({n}, {args.budget})")
        rows.append(r)
        fit = lambda k, r=r: (
            (f"{r['fits'][k]['preset']} ({r['fits'][k]['peak_bound_bytes'] / 2**30:.1f} GiB)")
            if k in r["fits"]
            else "none"
        )
        print(
            f"{n:>2}{r['peak_bytes'] / 2**20:10.2f}{r['step_s']:8.3f}   {fit('none')} / "
            f"{fit('offload')}",
            flush=True,
        )

    def draw(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        ns = [r["n"] for r in rows]
        a.plot(ns, [r["peak_bytes"] / 2**20 for r in rows], "o-")
        a.set_xlabel("devices N")
        a.set_ylabel("stage-3 peak MiB per device")
        a.set_xscale("log", base=2)
        for k, label in (("none", "no offload"), ("offload", "optimizer offloaded")):
            b.plot(
                ns,
                [r["fits"][k]["params"] / 1e9 if k in r["fits"] else 0 for r in rows],
                "o-",
                label=label,
            )
        b.set_xlabel("devices N")
        b.set_ylabel(f"largest preset fitting {args.budget / 1e9:g} GB (B params)")
        b.set_xscale("log", base=2)
        b.legend()
        return fig

    body = []
    for r in rows:
        fit = lambda k, r=r: (
            f"{r['fits'][k]['preset']} ({r['fits'][k]['peak_bound_bytes'] / 2**30:.1f} GiB)"
            if k in r["fits"]
            else "none"
        )
        body.append(
            [
                r["n"],
                f"{r['peak_bytes'] / 2**20:,.2f}",
                f"{r['step_s']:.3f}",
                fit("none"),
                fit("offload"),
            ]
        )
    headers = [
        "N",
        "peak per device, MiB",
        "s/step",
        "largest fitting, no offload",
        "largest fitting, optimizer offloaded",
    ]
    write_results(
        "peers_scaling",
        {"budget": args.budget, "rows": rows},
        draw,
        markdown=markdown_table(headers, body),
    )


if __name__ == "__main__":
    sys.exit(main())
