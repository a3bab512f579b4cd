"""The JAX contenders of bench/peers_speed.py and bench/cpu_setup.py: the LM of bench/torch_lm.py
(zerojax's example LM at the same shape) trained with fp32 AdamW by zerojax at a ZeRO stage, by
a plain `jax.jit` step on one device (`--plain-jit`, the one-device baseline), or by XLA's own
placement of stage 3 (`--jit-fsdp`). Run in one process with N simulated devices, or as one of
P processes started by `zerojax launch` (each passes its own rows of the global batch):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/jax_lm.py --stage 3
    zerojax launch -n 8 -- python bench/jax_lm.py --stage 3
    python bench/jax_lm.py --plain-jit

Batches are random tokens, the same every run. Process 0 prints one JSON line: params, median
/ min / max step seconds after --warmup steps, the devices and processes, and with
--collectives the step's collectives counted in its compiled HLO (count and bytes one device
sends, by kind).
"""

import argparse
import json
import statistics
import sys
import time

SHAPE = dict(layers=4, d_model=256, heads=4, ffn=688, vocab=256, seq=128, batch=64)


def lm_config():
    """zerojax's example LM at SHAPE, with an untied head like bench/torch_lm.py's."""
    from zerojax.models.lm import LMConfig

    return LMConfig(
        vocab=SHAPE["vocab"],
        d_model=SHAPE["d_model"],
        n_layers=SHAPE["layers"],
        n_heads=SHAPE["heads"],
        d_ff=SHAPE["ffn"],
        seq_len=SHAPE["seq"],
        tie_embeddings=False,
    )


def collectives(zero, step, state, batch) -> dict:
    """Collectives of the compiled step, by kind: count and bytes one device sends."""
    by_kind: dict = {}
    for c in zero.report(step, state, batch).collectives:
        row = by_kind.setdefault(c.kind, {"count": 0, "sent_bytes": 0.0})
        row["count"] += 1
        row["sent_bytes"] += c.sent_bytes
    return by_kind


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--plain-jit", action="store_true", help="one device, a plain jax.jit step")
    p.add_argument("--jit-fsdp", action="store_true", help="--stage with XLA's placement")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--unit-buffers", action="store_true", help="zerojax's unit_buffers=True")
    p.add_argument("--collectives", action="store_true", help="also count the HLO collectives")
    args = p.parse_args()
    if args.plain_jit and (args.jit_fsdp or args.unit_buffers or args.collectives):
        p.error("--plain-jit is one device without zerojax: it takes no zerojax option")

    from zerojax import initialize

    initialize()  # before jax is used: a process of `zerojax launch` joins its run
    import jax
    import numpy as np
    import optax

    import zerojax as zj
    from zerojax.models.gpt import lm_units, make_init, train_step
    from zerojax.models.lm import LM

    cfg = lm_config()
    init_fn = make_init(LM(cfg), optax.adamw(1e-3))
    zero = None
    if args.plain_jit:
        state, step = jax.jit(init_fn)(jax.random.key(0)), jax.jit(train_step, donate_argnums=0)
    else:
        options = dict(explicit_collectives=False) if args.jit_fsdp else {}
        if args.unit_buffers:
            options["unit_buffers"] = True
        zero = zj.zero_shard(stage=args.stage, units=lm_units(cfg), **options)
        state, step = zero.init(init_fn, jax.random.key(0)), zero(train_step)
    rows = SHAPE["batch"] // jax.process_count()  # this process's rows of the global batch
    first = jax.process_index() * rows
    rng = np.random.default_rng(0)
    times = []
    for i in range(args.warmup + args.steps):
        batch = rng.integers(0, cfg.vocab, (SHAPE["batch"], cfg.seq_len + 1), dtype=np.int32)
        start = time.perf_counter()
        state, metrics = step(state, batch[first : first + rows])
        jax.block_until_ready(metrics["loss"])
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    result = {
        "step_s_median": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "params": sum(x.size for x in jax.tree_util.tree_leaves(state.params)),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "last_loss": float(metrics["loss"]),
    }
    if args.collectives and zero is not None:
        result["collectives"] = collectives(zero, step, state, batch[first : first + rows])
    if jax.process_index() == 0:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
