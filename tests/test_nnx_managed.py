"""zerojax's managed update for NNX objects, with Flax's own step unchanged: gradient
accumulation and clipping match single-device nnx.jit training with the same optax chain (fp32),
16-bit parameters over fp32 master weights follow fp32 training, and what is not available for
NNX yet fails with the option to use instead."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.common import assert_trees_close, rounded_state
from tests.test_nnx_units import Transformer, data, train_step

ADAMW = lambda: optax.adamw(1e-3, eps=1e-5)


def make(tx):
    def build():
        model = Transformer(2, nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return build


def halves(batch):
    return [batch[: len(batch) // 2], batch[len(batch) // 2 :]]


@pytest.mark.parametrize("stage", [3, 2])  # stage 2: accumulate='auto' is 'reduced' for NNX
def test_nnx_accumulation_and_clipping_match_single_device(stage):
    batches = data(3)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(optax.chain(optax.clip_by_global_norm(0.05), ADAMW()))()
        single = nnx.jit(train_step)
        want = [float(single(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(stage=stage, gradient_accumulation_steps=2, gradient_clipping=0.05)
    model, optimizer = zero.init(make(ADAMW()))
    step = zero(train_step)
    got = []
    for b in batches:  # two micro-batches of half the batch: their mean is the batch's gradient
        got.append(np.mean([float(step(model, optimizer, m)) for m in halves(b)]))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)))
    assert int(optimizer.step[...]) == 3  # optimizer steps, not micro-batches
    moments = lambda opt: jax.tree_util.tree_leaves(nnx.as_pure(opt.opt_state))
    assert_trees_close(moments(optimizer), moments(ref_opt))  # the clip's state holds nothing
    assert step.used_explicit_collectives


@pytest.mark.parametrize("precision, stage", [("bf16", 3), ("fp16", 2)])
def test_nnx_16_bit_params_follow_fp32_master_weights(precision, stage):
    batches = data(8)
    zero32 = zj.zero_shard(stage=stage)
    model32, opt32 = zero32.init(make(ADAMW()))
    want = [float(zero32(train_step)(model32, opt32, b)) for b in batches]
    zero = zj.zero_shard(stage=stage, precision=precision)
    model, optimizer = zero.init(make(ADAMW()))
    step = zero(train_step)
    got = [float(step(model, optimizer, b)) for b in batches]
    assert step.used_explicit_collectives
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]
    kernel = model.blocks[0].up.kernel[...]
    master = optimizer.zerojax.get_value().master["blocks"][0]["up"]["kernel"]
    assert kernel.dtype == dtype and master.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(master.astype(dtype)))
    # 16-bit compute, fp32 update: the losses stay within 16-bit rounding of fp32 training's
    np.testing.assert_allclose(got, want, rtol=2e-2)
    assert got[-1] < got[0] - 0.1, got


def test_nnx_local_accumulation_is_refused_with_the_alternative():
    zero = zj.zero_shard(stage=2, gradient_accumulation_steps=2, accumulate="local")
    with pytest.raises(zj.ZeroError, match="use accumulate='reduced'"):
        zero.init(make(ADAMW()))


def test_nnx_update_on_the_host_matches_single_device():
    batches = data(2)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(ADAMW())()
        want = [float(nnx.jit(train_step)(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(stage=3, offload_optimizer="cpu", offload_update="host")
    model, optimizer = zero.init(make(ADAMW()))
    step = zero(train_step)
    got = [float(step(model, optimizer, b)) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)))
    mu = jax.tree_util.tree_leaves(nnx.as_pure(optimizer.opt_state))[1]
    assert mu.sharding.memory_kind == "pinned_host"  # the optimizer state rests on the host
    lowered = step.lower(model, optimizer, batches[0]).as_text()
    assert '_xla_compute_type = "host"' in lowered  # the optax step runs on the host CPU


def test_a_managed_nnx_checkpoint_restores_into_fp32_from_its_master_weights(tmp_path):
    zero = zj.zero_shard(stage=3, precision="bf16")
    model, optimizer = zero.init(make(ADAMW()))
    zero(train_step)(model, optimizer, data(1)[0])
    master = optimizer.zerojax.get_value().master
    with zj.CheckpointManager(tmp_path / "ckpt", zero, async_save=False) as mgr:
        mgr.save(1, (model, optimizer))
        again, _ = mgr.restore(zero.eval_shape(make(ADAMW())))  # the same config
    assert_trees_close(again[1].zerojax.get_value().master, master)
    fp32 = zj.zero_shard(stage=2)  # no master weights: the params are the master's fp32 values
    with zj.CheckpointManager(tmp_path / "ckpt", fp32) as mgr:
        (model32, optimizer32), _ = mgr.restore(fp32.eval_shape(make(ADAMW())))
    got = nnx.to_pure_dict(nnx.state(model32, nnx.Param))
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(master), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(optimizer32.step[...]) == 1


def test_nnx_16_bit_params_are_gathered_in_16_bits():
    # stage 2 keeps the parameters whole: the updated ones are cast from the split master and
    # all-gathered, in 16 bits when laid out like the master first (half of fp32's bytes)
    gathered = {}
    for precision in ("fp32", "bf16"):
        zero = zj.zero_shard(stage=2, precision=precision, persistence_threshold=0)
        model, optimizer = zero.eval_shape(make(ADAMW()))
        batch = jax.ShapeDtypeStruct((8, 17), jnp.int32)
        rep = zero.report(zero(train_step), model, optimizer, batch)
        gathered[precision] = rep.bytes_of("all-gather")
    assert gathered["bf16"] == gathered["fp32"] // 2, gathered


def test_nnx_with_zeropp_unit_buffers_and_bf16_trains_close_to_one_device():
    batches = data(3)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(ADAMW())()
        want = [float(nnx.jit(train_step)(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(
        stage=3,
        mesh=zj.make_mesh(local=4),
        precision="bf16",
        quantized_weights=True,  # qwZ: int8 weight gathers
        quantized_gradients=True,  # qgZ: int4 gradient reduce-scatters
        hpz_partition_size=4,  # hpZ: backward gathers inside the node
        unit_buffers=True,
    )
    model, optimizer = zero.init(make(ADAMW()))
    step = zero(train_step)
    got = [float(step(model, optimizer, b)) for b in batches]
    assert step.used_explicit_collectives
    np.testing.assert_allclose(got, want, rtol=2e-3)  # int8 / int4 / bf16 rounding


def test_nnx_bf16_optimizer_state_is_the_fp32_update_on_rounded_moments():
    batches = data(3)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(rounded_state(ADAMW()))()
        for b in batches:
            nnx.jit(train_step)(ref_model, ref_opt, b)
    zero = zj.zero_shard(stage=3, optimizer_state_dtype="bf16")
    model, optimizer = zero.init(make(ADAMW()))
    step = zero(train_step)
    for b in batches:
        step(model, optimizer, b)
    moments = [x for x in jax.tree_util.tree_leaves(nnx.as_pure(optimizer.opt_state)) if x.ndim]
    assert {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)))
