"""Smoke check of an installed zerojax wheel, run from a directory outside the checkout: the
package imports from site-packages, its command runs, the presets ship with it, and a 2-step
stage-3 run on 8 simulated devices trains."""

import os
import subprocess

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import zerojax as zj  # noqa: E402
from zerojax.models import GPT, GPTConfig  # noqa: E402


def run(*args):
    out = subprocess.run(["zerojax", *args], capture_output=True, text=True)
    assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-2000:])
    return out.stdout


def main():
    assert "site-packages" in zj.__file__, zj.__file__
    assert "usage" in run("--help")
    assert "offload_optimizer='cpu'" in run("config", "explain", "zero3_offload")
    cfg = GPTConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=8)
    model = GPT(cfg)

    def init_fn(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-2)
        )

    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    zero = zj.zero_shard(config="zero3")
    state, step = zero.init(init_fn, jax.random.key(0)), zero(train_step)
    batch = jax.random.randint(jax.random.key(1), (16, cfg.seq_len + 1), 0, cfg.vocab)
    losses = []
    for _ in range(2):
        state, loss = step(state, batch)
        losses.append(float(loss))
    assert jax.device_count() == 8 and losses[1] < losses[0], losses
    print(
        f"wheel smoke: zerojax {zj.__version__} from {os.path.dirname(zj.__file__)}, "
        f"stage 3 on 8 devices, losses {losses[0]:.4f} -> {losses[1]:.4f}"
    )


if __name__ == "__main__":
    main()
