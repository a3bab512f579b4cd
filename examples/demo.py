"""Train a small GPT with each ZeRO stage on 8 simulated CPU devices and print what each costs.

    python examples/demo.py                # stages 0-3, 30 steps each, the 'demo' preset
    python examples/demo.py --stages 3 --steps 100 --precision bf16 --grad-accum 2

The data is embedded on every machine: the bytes of the Python standard library's own source.
Every stage starts from the same initial state and sees the same batches, so the losses agree.
"""

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import optax  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import GPT, PRESETS  # noqa: E402
from zerojax.models.data import random_windows, stdlib_tokens  # noqa: E402
from zerojax.models.gpt import make_init, train_step  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (multiple of 8)")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=0.0, help="global-norm gradient clipping")
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    init_fn = make_init(GPT(cfg), optax.adamw(1e-3))
    tokens = stdlib_tokens()
    data = random_windows(tokens, args.steps, args.batch_size, cfg.seq_len)
    print(
        f"{len(jax.devices())} devices, preset {args.preset}, "
        f"{len(tokens) / 2**20:.1f} MiB of stdlib source as byte tokens"
    )

    for stage in [int(s) for s in args.stages.split(",")]:
        zero = zj.zero_shard(
            stage=stage,
            precision=args.precision,
            gradient_accumulation_steps=args.grad_accum,
            gradient_clipping=args.clip,
        )
        state = zero.init(init_fn, jax.random.key(0))
        step = zero(train_step)
        report = zero.report(step, state, data[0])
        warm = max(1, args.grad_accum)  # after the first optimizer step's compiles
        for i, batch in enumerate(data):
            if i == warm:
                t0 = time.perf_counter()
            state, metrics = step(state, batch)
            if i % 10 == 0 or i == len(data) - 1:
                print(f"stage {stage} step {i:4d} loss {float(metrics['loss']):.4f}", flush=True)
        if len(data) > warm:
            jax.block_until_ready(state)
            print(
                f"stage {stage}: {(len(data) - warm) / (time.perf_counter() - t0):.1f} calls/s "
                "on this machine (simulated devices share its cores)"
            )
        print(report, "\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
