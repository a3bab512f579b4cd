"""Train a small GPT with each ZeRO stage on 8 simulated CPU devices and print what each costs.

    python examples/demo.py                # stages 0-3, 30 steps each, the 'demo' preset
    python examples/demo.py --stages 3 --steps 100

The data is embedded on every machine: the bytes of the Python standard library's own source.
Every stage starts from the same initial state and sees the same batches, so the losses agree.
"""
import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import GPT, PRESETS  # noqa: E402


def stdlib_bytes(limit=4 << 20) -> np.ndarray:
    """Byte tokens from the running interpreter's standard library sources (sorted, capped)."""
    root = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and size < limit:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
    return np.frombuffer(b"".join(chunks), np.uint8)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (multiple of 8)")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    args = p.parse_args(argv)
    cfg = PRESETS[args.preset]
    model = GPT(cfg)
    tokens = stdlib_bytes()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, (args.steps, args.batch_size))
    data = [tokens[s[:, None] + np.arange(cfg.seq_len + 1)].astype(np.int32) for s in starts]
    print(f"{len(jax.devices())} devices, preset {args.preset}, "
          f"{len(tokens) / 2**20:.1f} MiB of stdlib source as byte tokens")

    def init_fn(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adamw(1e-3))

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    for stage in [int(s) for s in args.stages.split(",")]:
        zero = zj.zero_shard(stage=stage)
        state = zero.init(init_fn, jax.random.key(0))
        step = zero(train_step)
        report = zero.report(step, state, data[0])
        for i, batch in enumerate(data):
            if i == 1:
                t0 = time.perf_counter()       # after the first step's compile
            state, metrics = step(state, batch)
            if i % 10 == 0 or i == len(data) - 1:
                print(f"stage {stage} step {i:4d} loss {float(metrics['loss']):.4f}", flush=True)
        if len(data) > 1:
            jax.block_until_ready(state)
            print(f"stage {stage}: {(len(data) - 1) / (time.perf_counter() - t0):.1f} steps/s "
                  "on this machine (simulated devices share its cores)")
        print(report, "\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
