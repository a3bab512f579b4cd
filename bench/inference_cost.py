"""What each way of decoding from a stage-3 state costs (docs/inference.md), compiled for the
example LM on N = 8 simulated devices: greedy decoding of a batch of 8 prompts to the full
window, as one `jax.jit` program (a `fori_loop` over positions, no KV cache):

- gather once: `jax.device_put(state.params, NamedSharding(mesh, P()))` (one all-gather of
  the parameters), then decode on the whole copy every device holds;
- `jax.jit` on the shards: decode on the stage-3 parameters as they rest; XLA's partitioner
  places the gathers.

Per device: the parameters held at rest, the compiled peak of the decode program, and the
all-gather bytes it sends (loop iterations counted), per decode call and per generated token.

    python bench/inference_cost.py                 # presets tiny and 125m (under a minute)
    python bench/inference_cost.py --preset 125m --json
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.inspect.hlo import parse_collectives  # noqa: E402
from zerojax.models.gpt import make_init  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

PROMPT, BATCH = 8, 8  # tokens given, prompts decoded at once
MiB = 2**20


def decoder(model, seq_len: int):
    """Greedy decoding to the window's end, one jitted program (docs/inference.md's recipe)."""

    @jax.jit
    def greedy(params, prompt):
        def next_token(position, tokens):
            logits = model.apply({"params": params}, tokens)[:, position - 1]
            return tokens.at[:, position].set(jnp.argmax(logits, axis=-1).astype(tokens.dtype))

        return jax.lax.fori_loop(PROMPT, seq_len, next_token, prompt)

    return greedy


def measure(preset: str) -> dict:
    cfg = LM_PRESETS[preset]
    model = LM(cfg)
    zero = zj.zero_shard(stage=3)
    state = zero.eval_shape(make_init(model, optax.adamw(1e-4)), jax.random.key(0))
    params = state.params
    psi_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    whole = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(zero.mesh, P())),
        params,
    )
    prompt = jax.ShapeDtypeStruct(
        (BATCH, cfg.seq_len), jnp.int32, sharding=NamedSharding(zero.mesh, P())
    )
    tokens = cfg.seq_len - PROMPT
    greedy = decoder(model, cfg.seq_len)
    out = {"preset": preset, "parameters_mib": psi_bytes / MiB, "tokens": tokens, "ways": {}}
    for way, args in (("gather once", whole), ("jax.jit on the shards", params)):
        compiled = greedy.lower(args, prompt).compile()
        sent = sum(
            c.buffer_bytes
            for c in parse_collectives(compiled.as_text(), N)
            if c.kind == "all-gather"
        )
        mem = compiled.memory_analysis()
        held = sum(
            x.size * x.dtype.itemsize / (1 if way == "gather once" else N)
            for x in jax.tree.leaves(params)
        )
        out["ways"][way] = {
            "held_mib": held / MiB,
            "peak_mib": (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / MiB,
            "gathered_per_call_mib": sent / MiB,
            "gathered_per_token_mib": sent / tokens / MiB,
        }
    out["ways"]["gather once"]["gathered_once_mib"] = psi_bytes * (N - 1) / N / MiB
    return out


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        for way, m in r["ways"].items():
            rows.append(
                [
                    f"{r['preset']} (Ψ = {r['parameters_mib']:.1f} MiB)",
                    way,
                    f"{m['held_mib']:.2f}",
                    f"{m['peak_mib']:.2f}",
                    f"{m.get('gathered_once_mib', 0):.2f}",
                    f"{m['gathered_per_call_mib']:.2f} ({r['tokens']} tokens)",
                    f"{m['gathered_per_token_mib']:.3f}",
                ]
            )
    return markdown_table(
        [
            "preset",
            "way",
            "parameters held (MiB/device)",
            "decode peak (MiB/device)",
            "gathered once (MiB)",
            "all-gather per decode call (MiB)",
            "per token (MiB)",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", nargs="+", default=["tiny", "125m"], choices=LM_PRESETS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    results = [measure(p) for p in args.preset]
    if args.json:
        print(json.dumps(results, indent=1))
    print(table(results))
    write_results("inference_cost", results, markdown=table(results))


if __name__ == "__main__":
    main()
