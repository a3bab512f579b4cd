"""Host offload, measured: where the state rests, what the device peak does, and the step time.

    python bench/offload_report.py            # about 2 minutes on 2 CPU cores

1. At rest (stage 3, bf16 + fp32 master + Adam, the example LM 'small' preset, N = 8, compiled
   abstractly): device and host bytes per device with each offload option, beside the
   formulas 2Ψ/N (bf16 shard) and 12Ψ/N (master 4 + Adam 8).
2. offload_param: device peak (device arguments + temporaries) at L = 4 and 8 layers, slope per
   added layer against stage 3 without offload (the set-up of bench/stage3_depth.py).
3. offload_activations: how many arrays the traced step keeps in host memory, with and
   without (on CPU the compiled program keeps both memories in one, so it cannot show them).
4. Step time on 8 simulated devices (the 'tiny' LM, fp32 Adam): offload vs no offload, update
   on device vs on host, as ratios of medians from one interleaved run.
Writes bench/results/offload_report.json.
"""

import json
import os
import pathlib
import re
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.gpt import lm_units, make_init, train_step  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from stage3_depth import BASE  # noqa: E402

N = 8
OPTIONS = {
    "none": {},
    "offload_optimizer": dict(offload_optimizer="cpu"),
    "offload_optimizer+param": dict(offload_optimizer="cpu", offload_param="cpu"),
}


def report(model_cfg, batch_rows=N, **options):
    zero = zj.zero_shard(units=lm_units(model_cfg), **options)
    state = zero.eval_shape(make_init(LM(model_cfg), optax.adam(1e-3)), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((batch_rows, model_cfg.seq_len + 1), jnp.int32)
    return zero.report(zero(train_step), state, batch), state


def at_rest() -> dict:
    out = {}
    for name, options in OPTIONS.items():
        rep, state = report(LM_PRESETS["small"], stage=3, precision="bf16", **options)
        psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        out[name] = {
            "psi": psi,
            "device": sum(rep.resident.values()),
            "host": sum(rep.host_resident.values()),
            "device_params": rep.resident.get("params", 0),
        }
    return out


def param_slope() -> dict:
    out = {}
    for name, options in (
        ("stage 3", {}),
        ("stage 3 + offload_param", OPTIONS["offload_optimizer+param"]),
    ):
        peaks = {
            L: report(BASE.replace(n_layers=L), stage=3, **options)[0].peak_bytes for L in (4, 8)
        }
        out[name] = {"peak_L4": peaks[4], "peak_L8": peaks[8], "slope": (peaks[8] - peaks[4]) / 4}
    return out


def activations() -> dict:
    """Arrays typed `<host>` in the traced step (the saved activations the policy offloads);
    a CPU compile keeps both memories in one, so only the traced program can show them."""
    cfg = LM_PRESETS["tiny"].replace(remat=False)
    out = {}
    for stage in (2, 3):
        for on in (False, True):
            zero = zj.zero_shard(stage=stage, offload_activations=on, units=lm_units(cfg))
            state = zero.eval_shape(make_init(LM(cfg), optax.adam(1e-3)), jax.random.key(0))
            batch = jax.ShapeDtypeStruct((4 * N, cfg.seq_len + 1), jnp.int32)
            jaxpr = str(zero(train_step).trace(state, batch).jaxpr)
            out[f"stage {stage}, offload_activations={on}"] = len(re.findall(r"<host>\[", jaxpr))
    return out


def step_times(steps: int = 12) -> dict:
    cfg = LM_PRESETS["tiny"]
    init_fn = make_init(LM(cfg), optax.adam(1e-3))
    batch = np.random.default_rng(0).integers(0, cfg.vocab, (4 * N, cfg.seq_len + 1), np.int32)
    runs = {
        "no offload": dict(stage=3),
        "offload_optimizer (update on device)": dict(stage=3, offload_optimizer="cpu"),
        "offload_optimizer (update on host)": dict(
            stage=3, offload_optimizer="cpu", offload_update="host"
        ),
        "offload_optimizer+param": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
    }
    states, steps_fn, times = {}, {}, {k: [] for k in runs}
    for name, options in runs.items():
        zero = zj.zero_shard(units=lm_units(cfg), **options)
        states[name], steps_fn[name] = zero.init(init_fn, jax.random.key(0)), zero(train_step)
        states[name], _ = steps_fn[name](states[name], batch)  # compile
    for _ in range(steps):  # interleaved: drift hits every run alike
        for name in runs:
            t = time.perf_counter()
            states[name], m = steps_fn[name](states[name], batch)
            jax.block_until_ready(m["loss"])
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["no offload"])
    return {name: statistics.median(t) / base for name, t in times.items()}


def main():
    mib = lambda b: f"{b / 2**20:9.2f}"
    results = {"at_rest": at_rest()}
    print("1. at rest per device, stage 3 bf16 + Adam, LM 'small', N = 8 (MiB)")
    print(f"{'':>26} {'device':>9} {'host':>9}   formulas: 2Ψ/N and 12Ψ/N")
    for name, r in results["at_rest"].items():
        print(
            f"{name:>26} {mib(r['device'])} {mib(r['host'])}   "
            f"{mib(2 * r['psi'] / N)} {mib(12 * r['psi'] / N)}"
        )
    results["param_slope"] = param_slope()
    print("2. device peak (MiB) and slope per added layer, d_model 256, fp32 + Adam")
    for name, r in results["param_slope"].items():
        print(f"{name:>26} L=4 {mib(r['peak_L4'])} L=8 {mib(r['peak_L8'])} slope {mib(r['slope'])}")
    results["activations_host_arrays"] = activations()
    print("3. arrays typed <host> in the traced step (saved activations offloaded), LM 'tiny'")
    for name, count in results["activations_host_arrays"].items():
        print(f"{name:>38} {count:5d}")
    results["step_time_ratio"] = step_times()
    print("4. step time / no offload (median of 12 interleaved steps, LM 'tiny', 8 devices)")
    for name, r in results["step_time_ratio"].items():
        print(f"{name:>40} {r:6.2f}")
    out = pathlib.Path(__file__).parent / "results" / "offload_report.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
