"""The parity GPT of common.py written in Flax NNX, its NNX train step, and plain single-device
NNX training (the reference an NNX run under every stage must match)."""

import jax
import jax.numpy as jnp
import optax
from common import CFG
from flax import nnx


class Block(nnx.Module):
    def __init__(self, cfg, rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            cfg.n_heads, cfg.d_model, use_bias=False, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], bool))
        x = x + self.attn(h, h, mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg=CFG, rngs=None):
        rngs = rngs or nnx.Rngs(0)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)) * 0.02)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_objects(tx, seed=0):
    model = GPT(rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def nnx_train_step(model, optimizer, batch):
    """The unchanged single-device NNX step, as Flax's docs write it."""

    def loss_fn(model):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


def train_single_device_nnx(tx, data):
    with jax.default_device(jax.devices()[0]):
        model, optimizer = make_objects(tx)
        step = nnx.jit(nnx_train_step)
        losses = [float(step(model, optimizer, batch)["loss"]) for batch in data]
    return model, optimizer, losses
