"""Does stage 3's compiled peak grow with depth? Peak (arguments + temporaries) per device at
L = 4 and L = 8 layers, for stage 0, zerojax stage 3 (attention and MLP as units, named with
`units=` from outside the model; prefetch 1, the default, and prefetch 0; recomputing each
unit in backward, `recompute_units=True`; and the default units='auto', one unit per block)
and a plain
`jax.jit` FSDP baseline (parameters sharded, XLA inserts the gathers: explicit_collectives
off), scanned and unrolled, with activations negligible (one 8-token sequence per device).

    python bench/stage3_depth.py

Slope = (peak(L=8) - peak(L=4)) / 4, per added layer. Writes bench/results/stage3_depth.json.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

BASE = LM_PRESETS["tiny"].replace(d_model=256, n_heads=8, d_ff=704, seq_len=8)
# the LM's attention and MLP as units, named from outside (the model imports nothing of
# zerojax), as DeepSpeed gathers each submodule; "auto" makes each whole block one unit
UNITS = ("Attention", "MLP")
CONTENDERS = {
    "stage 0": dict(stage=0),
    "stage 3": dict(stage=3, units=UNITS),
    "stage 3 recompute": dict(stage=3, units=UNITS, recompute_units=True),
    "stage 3 prefetch 0": dict(stage=3, prefetch=0, units=UNITS),
    "stage 3 units auto": dict(stage=3),
    "jit FSDP": dict(stage=3, explicit_collectives=False),
}


def peaks(scan: bool) -> dict:
    """{(contender, layers): compiled peak bytes per device}."""
    out = {}
    for layers in (4, 8):
        init_fn = make_init(LM(BASE.replace(n_layers=layers, scan_layers=scan)), optax.adam(1e-3))
        for name, options in CONTENDERS.items():
            zero = zj.zero_shard(**options)
            state = zero.eval_shape(init_fn, jax.random.key(0))
            rep = zero.report(zero(train_step), state, jax.ShapeDtypeStruct((8, 9), jnp.int32))
            out[(name, layers)] = rep.peak_bytes
    return out


def main():
    mib = lambda b: f"{b / 2**20:8.2f}"
    results = {}
    print("peak MiB per device (fp32 + Adam, N = 8, d_model 256); slope = MiB per added layer")
    print(
        f"{'layers':>9} {'contender':>18} {'L=4':>8} {'L=8':>8} {'slope':>8} {'slope/stage0':>12}"
    )
    for scan in (True, False):
        p = peaks(scan)
        slope0 = (p[("stage 0", 8)] - p[("stage 0", 4)]) / 4
        for name in CONTENDERS:
            slope = (p[(name, 8)] - p[(name, 4)]) / 4
            kind = "scanned" if scan else "unrolled"
            results[f"{kind}/{name}"] = {
                "peak_L4": p[(name, 4)],
                "peak_L8": p[(name, 8)],
                "slope": slope,
                "slope_ratio": slope / slope0,
            }
            print(
                f"{kind:>9} {name:>18} {mib(p[(name, 4)])} {mib(p[(name, 8)])} {mib(slope)} "
                f"{slope / slope0:12.3f}"
            )
    out = pathlib.Path(__file__).parent / "results" / "stage3_depth.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
