"""A small Flax transformer, its unchanged train step, and plain single-device training."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from zerojax.models import GPT, GPTConfig

CFG = GPTConfig(vocab=203, d_model=64, n_layers=2, n_heads=4, seq_len=16)
MODEL = GPT(CFG)


def make_init(tx, model=MODEL, cfg=CFG):
    def init_fn(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return init_fn


def train_step(state, batch):
    """The unchanged single-device Flax step of DESIGN.md section 1."""
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batches(n_steps, batch_size=16, cfg=CFG, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        tokens = rng.integers(0, cfg.vocab, (batch_size, cfg.seq_len + 1), dtype=np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def train_single_device(tx, data, key=0):
    """Plain optax training on one device: the reference every stage must match."""
    state = jax.device_put(make_init(tx)(jax.random.key(key)), jax.devices()[0])
    step = jax.jit(train_step)
    losses = []
    for batch in data:
        state, metrics = step(state, jax.device_put(batch, jax.devices()[0]))
        losses.append(float(metrics["loss"]))
    return state, losses


def train_zero(zero, tx, data, key=0):
    state = zero.init(make_init(tx), jax.random.key(key))
    step = zero(train_step)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_params_close(got, want, rtol=1e-5, atol=1e-6):
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]:
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(flat_want[path]), rtol=rtol,
                                   atol=atol, err_msg=jax.tree_util.keystr(path))


def zeropp_setup(steps):
    """The tiny LM (gather_on_use layers) with qwZ + hpZ + qgZ on a (node, local) mesh: one
    node per process here, (2, 4) simulated in one process by the test."""
    from zerojax.models.gpt import make_init as lm_init, train_step as lm_step
    from zerojax.models.lm import LM, LM_PRESETS
    cfg = LM_PRESETS["tiny"].replace(n_layers=2, seq_len=16)
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, cfg.vocab, (16, 1)) + np.arange(cfg.seq_len + 1)) % cfg.vocab
            for _ in range(steps)]
    options = dict(stage=3, quantized_weights=True, hpz_partition_size=4,
                   quantized_gradients=True, persistence_threshold=0)
    return lm_init(LM(cfg), optax.adam(1e-2)), lm_step, data, options
