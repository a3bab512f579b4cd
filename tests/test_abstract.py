"""Lowering and reporting from `zero.eval_shape`: the same figures as a live state, and a
Llama-2-7B-shaped model planned on this machine without allocating it."""

import jax
import jax.numpy as jnp
import optax

import zerojax as zj
from zerojax.models.gpt import GPT, PRESETS, make_init, train_step
from zerojax.models.lm import LM, LM_PRESETS


def test_abstract_report_equals_the_live_one():
    cfg = PRESETS["test"]
    init_fn = make_init(GPT(cfg), optax.adamw(1e-3))
    zero = zj.zero_shard(stage=3, precision="bf16", gradient_accumulation_steps=2)
    batch = jnp.zeros((8, cfg.seq_len + 1), jnp.int32)
    step = zero(train_step)
    live = zero.report(step, zero.init(init_fn, jax.random.key(0)), batch)
    abstract = zero.report(
        step,
        zero.eval_shape(init_fn, jax.random.key(0)),
        jax.ShapeDtypeStruct(batch.shape, batch.dtype),
    )
    assert abstract.resident == live.resident
    assert (abstract.argument_bytes, abstract.temp_bytes) == (live.argument_bytes, live.temp_bytes)
    assert abstract.comm_table() == live.comm_table()


def test_a_7b_model_is_planned_without_allocating_it():
    cfg = LM_PRESETS["7b"].replace(remat=True, seq_len=512)
    zero = zj.zero_shard(stage=3, precision="bf16")
    state = zero.eval_shape(make_init(LM(cfg), optax.adamw(1e-4)), jax.random.key(0))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    assert psi == 6_738_415_616
    rep = zero.report(
        zero(train_step), state, jax.ShapeDtypeStruct((8, cfg.seq_len + 1), jnp.int32)
    )
    # bf16 params 2Ψ + fp32 master 4Ψ + Adam 8Ψ, all sharded over N = 8: 14Ψ/N per device
    assert abs(sum(rep.resident.values()) - 14 * psi / 8) < 1e-3 * 14 * psi / 8
    assert rep.bytes_of("all-gather") >= 2 * psi * 0.99  # bf16 weights gathered
