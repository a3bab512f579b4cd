"""A small decoder-only transformer (pre-norm, causal attention, GELU MLP) in Flax linen.

Layers are unrolled (one module per block) so each layer's parameters are separate leaves.
It knows nothing of sharding: zerojax wraps its unchanged train step.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 203  # deliberately not a multiple of 8: exercises the replicate policy
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


PRESETS = {
    "test": GPTConfig(),
    "demo": GPTConfig(vocab=256, d_model=128, n_layers=4, n_heads=4, seq_len=64),
    "3m": GPTConfig(vocab=256, d_model=256, n_layers=4, n_heads=8, seq_len=128),
}


class Block(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], bool))
        x = x + nn.MultiHeadDotProductAttention(num_heads=cfg.n_heads, use_bias=False)(
            h, h, mask=mask
        )
        h = nn.LayerNorm()(x)
        h = nn.Dense(cfg.d_ff)(h)
        return x + nn.Dense(cfg.d_model)(nn.gelu(h))


class GPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab, cfg.d_model)(tokens)
        x = (
            x
            + self.param("pos", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))[
                : tokens.shape[1]
            ]
        )
        for i in range(cfg.n_layers):
            x = Block(cfg, name=f"block_{i}")(x)
        return nn.Dense(cfg.vocab, name="head")(nn.LayerNorm()(x))


def lm_units(cfg):
    """How the benchmarks and `zerojax plan` name the example LM's stage-3 units, from outside
    the model: attention and MLP apart (as DeepSpeed gathers each submodule), or with remat the
    whole rematerialised block (`units="auto"` takes it: remat makes it a lifted body)."""
    return "auto" if cfg.remat else ("Attention", "MLP")


def make_init(model, tx):
    """`init_fn(key) -> TrainState` for `model` (a GPT or LM: any module with `cfg.seq_len`)
    and the optax transformation `tx`."""
    from flax.training import train_state

    def init_fn(key):
        tokens = jnp.zeros((1, model.cfg.seq_len), jnp.int32)
        return train_state.TrainState.create(
            apply_fn=model.apply, params=model.init(key, tokens)["params"], tx=tx
        )

    return init_fn


def train_step(state, batch):
    """The plain single-device next-token step on a (batch, seq_len + 1) token array."""
    import jax
    import optax

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}
