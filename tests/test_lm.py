"""The example LM (RMSNorm, rotary, SwiGLU; scanned or unrolled; remat): its presets, its
scanned and unrolled forms agreeing, and training under zerojax like on one device."""

import functools

import jax
import numpy as np
import optax
import pytest
from common import assert_trees_close, host_state, slow

import zerojax as zj
from zerojax.models.gpt import make_init, train_step
from zerojax.models.lm import LM, LM_PRESETS, param_count

CFG = LM_PRESETS["tiny"].replace(vocab=203, d_model=64, n_heads=4, d_ff=176, n_layers=2, seq_len=16)


def test_presets_have_the_sizes_people_know():
    assert param_count(LM_PRESETS["7b"]) == 6_738_415_616  # Llama-2-7B, exactly
    assert 0.1e9 < param_count(LM_PRESETS["125m"]) < 0.15e9
    assert 1.2e9 < param_count(LM_PRESETS["1.3b"]) < 1.4e9


def test_scanned_unrolled_and_remat_compute_the_same_function():
    tokens = jax.random.randint(jax.random.key(1), (2, CFG.seq_len), 0, CFG.vocab)
    scanned = LM(CFG.replace(scan_layers=True))
    params = scanned.init(jax.random.key(0), tokens)["params"]
    unrolled_params = {k: v for k, v in params.items() if k != "layers"}
    for i in range(CFG.n_layers):  # layer i of the unrolled stack = slice i of the scanned one
        layer = jax.tree_util.tree_map(lambda x, i=i: x[i], params["layers"])
        unrolled_params[f"layer_{i}"] = layer
    want = scanned.apply({"params": params}, tokens)
    for cfg, p in (
        (CFG.replace(scan_layers=False), unrolled_params),
        (CFG.replace(scan_layers=True, remat=True), params),
        (CFG.replace(scan_layers=False, remat=True), unrolled_params),
    ):
        np.testing.assert_allclose(LM(cfg).apply({"params": p}, tokens), want, rtol=1e-5, atol=1e-5)


@functools.cache
def _sgd_init(scan, remat):
    return make_init(LM(CFG.replace(scan_layers=scan, remat=remat)), optax.sgd(0.05, momentum=0.9))


@pytest.mark.parametrize(
    "stage,scan,remat,prefetch",
    [
        (0, True, False, 1),
        (2, False, True, 1),
        (3, True, True, 1),
        (3, False, False, 1),
        (3, False, False, 0),
        *slow((3, True, False, 1), (3, False, True, 1)),
    ],
)
def test_lm_trains_like_one_device(stage, scan, remat, prefetch):
    cfg = CFG.replace(scan_layers=scan, remat=remat)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab, (16, cfg.seq_len + 1), dtype=np.int32) for _ in range(4)]
    init_fn = _sgd_init(scan, remat)
    ref = jax.device_put(host_state(init_fn), jax.devices()[0])
    ref_step, ref_losses = jax.jit(train_step), []
    for batch in data:
        ref, m = ref_step(ref, batch)
        ref_losses.append(float(m["loss"]))
    zero = zj.zero_shard(stage=stage, persistence_threshold=0, prefetch=prefetch)
    state, step, losses = zero.shard(host_state(init_fn)), zero(train_step), []
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.params, ref.params)


@pytest.mark.parametrize("precision,scan", [("fp16", True), ("bf16", False)])
def test_lm_stage_3_in_16_bits_trains_like_stage_0(precision, scan):
    # stage-3 units take the fp16 loss scale as a custom-VJP residual (their backward
    # runs in another trace than their forward): a regression test for that
    cfg = CFG.replace(scan_layers=scan)
    rng = np.random.default_rng(1)
    data = [rng.integers(0, cfg.vocab, (16, cfg.seq_len + 1), dtype=np.int32) for _ in range(4)]
    init_fn = make_init(LM(cfg), optax.adam(1e-3))
    losses = {}
    for stage in (0, 3):
        zero = zj.zero_shard(stage=stage, precision=precision, persistence_threshold=0)
        state, step, losses[stage] = zero.init(init_fn, jax.random.key(0)), zero(train_step), []
        for batch in data:
            state, m = step(state, batch)
            losses[stage].append(float(m["loss"]))
    # 16-bit compute: the same numbers up to the rounding of differently ordered sums
    np.testing.assert_allclose(losses[3], losses[0], rtol=2e-3)
