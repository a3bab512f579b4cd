"""How stage 3's compiled peak grows with depth on published model code (the conformance
lane's models, tests/published.py): Flax's lm1b example (Linen), Flax's NNX gemma example,
Gemma 3 and Gemma 4 from the `gemma` package, and Hugging Face's Flax GPT-2 and Llama through
run_clm_flax.py's step (tests/test_conformance_hf.py). Per device at N = 8, fp32 + AdamW, one
128-token sequence per device, d_model 64: the peak (arguments + temporaries) at L and 2L
layers for stage 0, stage 3 with the defaults (each unit keeps its activations) and stage 3
with `recompute_units=True` (each unit keeps only its input). Every leaf is split at stage 3
(`persistence_threshold=0`).

    python bench/published_slopes.py

Slope = (peak(2L) - peak(L)) / L, per added layer; the ratio is to stage 0's slope. Prints a
markdown table (docs/units.md holds it); about four minutes on 2 cores.
"""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import zerojax as zj  # noqa: E402

SEQ, D = 128, 64
CONTENDERS = {
    "stage 0": dict(stage=0),
    "stage 3": dict(stage=3, persistence_threshold=0),
    "stage 3, recompute_units=True": dict(stage=3, persistence_threshold=0, recompute_units=True),
}


def lm1b_peak(layers: int, options: dict) -> int:
    from test_conformance import LM1B_RULES, lm1b_peak_setup

    init_fn, step, args = lm1b_peak_setup(layers, SEQ, D)
    zero = zj.zero_shard(logical_rules=LM1B_RULES, **options)
    state = zero.eval_shape(init_fn, jax.random.key(0))
    return zero.report(zero(step, static_argnums=(2, 3, 4)), state, *args).peak_bytes


def flax_gemma_peak(layers: int, options: dict) -> int:
    from test_conformance import gemma, gemma_build

    zero = zj.zero_shard(**options)
    model, optimizer, rngs, metrics = zero.eval_shape(
        functools.partial(gemma_build, 0.0, layers=layers, embed=D)
    )
    rows = jax.ShapeDtypeStruct((8, SEQ), jnp.int32)
    batch = {"inputs": rows, "targets": rows, "inputs_position": rows}
    batch["inputs_segmentation"] = rows
    step = zero(gemma().train.nnx_train_step)
    return zero.report(step, model, optimizer, rngs, batch, metrics, 0.0, 0).peak_bytes


def gemma_peak(version: str, layers: int, options: dict) -> int:
    from test_conformance_gemma import gemma_peak

    return gemma_peak(version, layers, options)


def hf_peak(name: str, layers: int, options: dict) -> int:
    from test_conformance_hf import hf_peak

    return hf_peak(name, layers, **options)


MODELS = {  # name: (peak function, L)
    "Flax examples/lm1b (Linen)": (lm1b_peak, 2),
    "Flax examples/gemma (NNX)": (flax_gemma_peak, 4),
    "gemma 4.0.1, Gemma 3 (Linen, nn.jit)": (functools.partial(gemma_peak, "gemma 3"), 4),
    "gemma 4.0.1, Gemma 4 (Linen, nn.jit)": (functools.partial(gemma_peak, "gemma 4"), 4),
    **{
        f"transformers 4.57, {cls}": (functools.partial(hf_peak, name), 4)
        for name, cls in (
            ("gpt2", "FlaxGPT2LMHeadModel"),
            ("llama", "FlaxLlamaForCausalLM"),
            ("mistral", "FlaxMistralForCausalLM"),
            ("gemma", "FlaxGemmaForCausalLM"),
            ("gpt_neo", "FlaxGPTNeoForCausalLM"),
            ("bloom", "FlaxBloomForCausalLM"),
        )
    },
}


def main():
    print("| model | contender | peak L | peak 2L | slope (MiB/layer) | / stage 0 |")
    print("|---|---|---|---|---|---|")
    for model, (peak, L) in MODELS.items():
        base = None
        for name, options in CONTENDERS.items():
            small, large = (peak(n, options) / 2**20 for n in (L, 2 * L))
            slope = (large - small) / L
            base = slope if base is None else base
            print(
                f"| {model} (L = {L}) | {name} | {small:.2f} | {large:.2f} | {slope:.3f} "
                f"| {slope / base:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
