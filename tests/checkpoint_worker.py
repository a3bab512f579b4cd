"""A training run that checkpoints every step and resumes from the latest complete checkpoint,
launched by test_checkpoint.py (killed with SIGKILL, sent SIGTERM, or run as 2 processes).

    python checkpoint_worker.py CKPT_DIR LOSSES_FILE STEPS [--preempt] [--mp ID PORT]
                                [--restore-only]

Appends "step loss" lines to LOSSES_FILE (a resumed run repeats the steps after its
checkpoint; the last line per step counts) and prints "ready" after the first step it runs.
With --restore-only it prints which step it restored and stops.
"""

import os
import sys

MULTIPROCESS = "--mp" in sys.argv
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={4 if MULTIPROCESS else 8}"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models.lm import LM, LM_PRESETS  # noqa: E402

CFG = LM_PRESETS["tiny"].replace(n_layers=2, d_model=64, n_heads=4, d_ff=128, seq_len=16)
ZERO = dict(stage=3, precision="bf16", offload_optimizer="cpu", persistence_threshold=0)


class RngState(train_state.TrainState):
    rng: jax.Array


def init_fn(key):
    model = LM(CFG)
    params = model.init(key, jnp.zeros((1, CFG.seq_len), jnp.int32))["params"]
    return RngState.create(
        apply_fn=model.apply, params=params, tx=optax.adamw(1e-3), rng=jax.random.key(7)
    )


def train_step(state, tokens):
    """An LM step that also draws from the state's RNG (noise on the logits), so an RNG that
    did not restore exactly would change the losses."""
    rng, noise_key = jax.random.split(state.rng)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens[:, :-1])
        logits = logits + 0.01 * jax.random.normal(noise_key, logits.shape)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads).replace(rng=rng), {"loss": loss}


def batch(position: int):
    return np.random.default_rng(position).integers(
        0, CFG.vocab, (16, CFG.seq_len + 1), dtype=np.int32
    )


def main():
    ckpt_dir, losses_file, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    process = 0
    if MULTIPROCESS:
        i = sys.argv.index("--mp")
        process, port = int(sys.argv[i + 1]), int(sys.argv[i + 2])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
    zero = zj.zero_shard(**ZERO)
    if "--restore-only" in sys.argv:  # which step every process restores, then stop
        ckpt = zj.CheckpointManager(ckpt_dir, zero)
        chosen = ckpt.latest_step()
        state, _ = ckpt.restore(jax.eval_shape(init_fn, jax.random.key(0)))
        print(f"restored {chosen} step-counter {int(state.step)}", flush=True)
        ckpt.close()
        jax.distributed.shutdown() if MULTIPROCESS else None
        return
    ckpt = zj.CheckpointManager(
        ckpt_dir,
        zero,
        save_on_preemption="--preempt" in sys.argv,
        save_interval_steps=1000 if "--preempt" in sys.argv else 1,
    )
    state, position = zero.init(init_fn, jax.random.key(0)), 0
    if ckpt.latest_step() is not None:
        state, extra = ckpt.restore(jax.eval_shape(init_fn, jax.random.key(0)))
        position = extra["data_position"]
    step, first = zero(train_step), True
    with open(losses_file, "a") as log:
        while position < steps:
            tokens = batch(position)
            if MULTIPROCESS:  # each process feeds its half of the batch
                tokens = tokens[process * 8 : (process + 1) * 8]
            state, metrics = step(state, tokens)
            position += 1
            log.write(f"{position} {float(metrics['loss'])!r}\n")
            log.flush()
            ckpt.save(position, state, extra={"data_position": position})
            print("ready" if first else f"step {position}", flush=True)
            first = False
            if ckpt.preempted:
                print(f"preempted at {position}", flush=True)
                break
    ckpt.close()
    if MULTIPROCESS:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
