"""Collectives per step of the example LM's stage-3 step, and what one buffer per unit costs.

For the `tiny` preset (scanned layers, attention and MLP as units, as the other benchmarks name
them from outside the model) and for one unit per block (`units="auto"`): all-gathers and
reduce-scatters per step, counted in the compiled HLO with a scanned loop's body counted once
per iteration, per unit run (units per step = layers x units per block), and the compiled peak
per device with the bytes alive at it (the rest of the peak is gaps in XLA's packing of
temporaries); leaf by leaf (the default) and with `unit_buffers=True`. What is not per unit is the
parameters no unit holds (embedding, final norm), gathered once at the start of the step.

    python bench/unit_collectives.py          # writes bench/results/unit_collectives.json
"""

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
from zerojax.models.gpt import make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

CFG = LM_PRESETS["tiny"]
UNITS = {"attention + MLP": (("Attention", "MLP"), 2), "block (auto)": ("auto", 1)}


def count(rep, kind: str) -> int:
    return sum(c for (k, _), (c, *_) in rep.comm_table().items() if k == kind)


def main():
    init_fn = make_init(LM(CFG), optax.adamw(1e-3))
    batch = jax.ShapeDtypeStruct((8, CFG.seq_len + 1), jnp.int32)
    results = {}
    print(f"example LM 'tiny' ({CFG.n_layers} layers, scanned={CFG.scan_layers}), stage 3, N = 8")
    print(
        f"{'units':>16} {'unit_buffers':>12} {'units/step':>10} {'all-gather':>10} "
        f"{'reduce-scatter':>14} {'AG/unit':>8} {'RS/unit':>8} {'peak MiB':>9} {'live MiB':>9}"
    )
    for name, (units, per_block) in UNITS.items():
        for buffers in (False, True):
            zero = zj.zero_shard(stage=3, units=units, unit_buffers=buffers)
            state = zero.eval_shape(init_fn, jax.random.key(0))
            rep = zero.report(zero(train_step), state, batch)
            runs = CFG.n_layers * per_block
            ag, rs = count(rep, "all-gather"), count(rep, "reduce-scatter")
            results[f"{name}/unit_buffers={buffers}"] = {
                "units_per_step": runs,
                "all_gathers": ag,
                "reduce_scatters": rs,
                "peak_bytes": rep.peak_bytes,
                "live_bytes": rep.peak.live_bytes,  # alive at the peak (the peak explainer)
            }
            print(
                f"{name:>16} {buffers!s:>12} {runs:>10} {ag:>10} {rs:>14} {ag / runs:>8.2f} "
                f"{rs / runs:>8.2f} {rep.peak_bytes / 2**20:>9.2f} "
                f"{rep.peak.live_bytes / 2**20:>9.2f}"
            )
    body = []
    for key, r in results.items():
        name, buffers = key.split("/unit_buffers=")
        runs, ag, rs = r["units_per_step"], r["all_gathers"], r["reduce_scatters"]
        body.append(
            [
                name,
                buffers,
                runs,
                ag,
                rs,
                f"{ag / runs:.1f} AG, {rs / runs:.1f} RS",
                f"{r['peak_bytes'] / 2**20:.2f}",
                f"{r['live_bytes'] / 2**20:.2f}",
            ]
        )
    headers = [
        "units",
        "unit_buffers",
        "units/step",
        "all-gathers",
        "reduce-scatters",
        "per unit",
        "peak MiB",
        "alive at the peak MiB",
    ]
    write_results("unit_collectives", results, markdown=markdown_table(headers, body))


if __name__ == "__main__":
    sys.exit(main())
