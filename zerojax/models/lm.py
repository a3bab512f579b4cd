"""A decoder-only language model as people build them today, in Flax linen: RMSNorm, rotary
position embeddings, SwiGLU MLP, causal multi-head attention, tied or untied embeddings.
Layers are scanned (`nn.scan`, one stacked parameter per weight) or unrolled, and optionally
rematerialised. It knows nothing of ZeRO: zerojax wraps its unchanged train step.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 352  # SwiGLU hidden width (Llama: about 8/3 d_model, rounded)
    seq_len: int = 128
    tie_embeddings: bool = True
    scan_layers: bool = True
    remat: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def replace(self, **kw) -> LMConfig:
        return dataclasses.replace(self, **kw)


# Shapes only; `7b` is Llama-2-7B's (vocab 32000, untied). Byte-level presets use vocab 256.
LM_PRESETS = {
    "tiny": LMConfig(),
    "small": LMConfig(d_model=256, n_layers=6, n_heads=8, d_ff=704, seq_len=256),
    "125m": LMConfig(vocab=50304, d_model=768, n_layers=12, n_heads=12, d_ff=2048, seq_len=1024),
    "350m": LMConfig(vocab=50304, d_model=1024, n_layers=24, n_heads=16, d_ff=2816, seq_len=1024),
    "1.3b": LMConfig(vocab=50304, d_model=2048, n_layers=24, n_heads=16, d_ff=5504, seq_len=2048),
    "7b": LMConfig(
        vocab=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        d_ff=11008,
        seq_len=4096,
        tie_embeddings=False,
    ),
}


def rotary(x, theta: float):
    """Rotary position embedding on (batch, seq, heads, head_dim), half-split convention."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)


class Attention(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dense = lambda name: nn.DenseGeneral((cfg.n_heads, cfg.head_dim), use_bias=False, name=name)
        q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(q.dtype)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, name="out")(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, h):
        cfg = self.cfg
        gate = nn.Dense(cfg.d_ff, use_bias=False, name="gate")(h)
        up = nn.Dense(cfg.d_ff, use_bias=False, name="up")(h)
        return nn.Dense(cfg.d_model, use_bias=False, name="down")(nn.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x, _=None):
        cfg = self.cfg
        x = x + Attention(cfg, name="Attention_0")(nn.RMSNorm(epsilon=cfg.norm_eps)(x))
        x = x + MLP(cfg, name="MLP_0")(nn.RMSNorm(epsilon=cfg.norm_eps)(x))
        return (x, None) if cfg.scan_layers else x


class LM(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        embed = nn.Embed(
            cfg.vocab, cfg.d_model, embedding_init=nn.initializers.normal(0.02), name="embed"
        )
        x = embed(tokens)
        block = nn.remat(Block, prevent_cse=not cfg.scan_layers) if cfg.remat else Block
        if cfg.scan_layers:
            stack = nn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.n_layers
            )
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.n_layers):
                x = block(cfg, name=f"layer_{i}")(x)
        x = nn.RMSNorm(epsilon=cfg.norm_eps, name="final_norm")(x)
        if cfg.tie_embeddings:
            return embed.attend(x)
        return nn.Dense(cfg.vocab, use_bias=False, name="lm_head")(x)


def param_count(cfg: LMConfig) -> int:
    """Parameters of `cfg`, from shapes only (nothing is allocated)."""
    shapes = jax.eval_shape(
        LM(cfg).init, jax.random.key(0), jnp.zeros((1, min(cfg.seq_len, 8)), jnp.int32)
    )
    return sum(x.size for x in jax.tree_util.tree_leaves(shapes))
