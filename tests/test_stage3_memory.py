"""Stage 3 with the example LM's attention and MLP as units (named from outside the model):
the compiled peak barely grows with depth.
Formula beside each assertion: slope = (peak(L=8) - peak(L=4)) / 4 per added layer."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "bench"))
from stage3_depth import peaks  # noqa: E402


@pytest.mark.parametrize(
    "scan",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # unrolled: 78 s; the scan shows it
    ids=["scanned", "unrolled"],
)
def test_stage_3_peak_does_not_grow_with_depth(scan):
    p = peaks(scan)
    slope = lambda name: (p[(name, 8)] - p[(name, 4)]) / 4
    # per added layer, stage 3 grows by at most a quarter of what stage 0 grows by
    assert slope("stage 3") <= 0.25 * slope("stage 0")
    # at 8 layers its peak is at most 0.3 of stage 0's
    assert p[("stage 3", 8)] <= 0.3 * p[("stage 0", 8)]
    # it grows no faster than XLA's own FSDP, on the same layout (both keep each layer's
    # activations and its shards: 1,848,704 vs 1,845,120 bytes per layer scanned)
    assert slope("stage 3") <= 1.01 * slope("jit FSDP")
    assert slope("stage 3 recompute") <= slope("stage 3")
    attention, mlp = _module_bytes()
    if scan:
        # a scanned body's two gathers both read only their stored shard, so the body may
        # hold attention's and the MLP's weights at once: at 8 layers within that of XLA's
        assert p[("stage 3", 8)] < p[("jit FSDP", 8)] + attention + mlp
    else:
        assert p[("stage 3", 8)] < p[("jit FSDP", 8)]
    assert slope("stage 3 prefetch 0") <= 0.25 * slope("stage 0")
    if not scan:
        # prefetch 1 (default) keeps the next module's gathered weights alive early, prefetch 0
        # does not: the peaks differ by at least the smaller module's fp32 weights (attention)
        # and at most two of the larger (the MLP, with its gradient in backward)
        assert attention <= p[("stage 3", 4)] - p[("stage 3 prefetch 0", 4)] <= 2 * mlp


def _module_bytes() -> tuple:
    """fp32 bytes of one layer's attention (q, k, v, o) and SwiGLU MLP (gate, up, down)."""
    from stage3_depth import BASE

    d, f = BASE.d_model, BASE.d_ff
    return 4 * 4 * d * d, 4 * 3 * d * f


def test_stage_3_gathers_each_layer_twice_and_reduce_scatters_once():
    import jax
    import jax.numpy as jnp
    import optax
    from stage3_depth import BASE

    import zerojax as zj
    from zerojax.models.gpt import make_init, train_step
    from zerojax.models.lm import LM

    zero = zj.zero_shard(stage=3)
    state = zero.eval_shape(make_init(LM(BASE), optax.adam(1e-3)), jax.random.key(0))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    rep = zero.report(zero(train_step), state, jax.ShapeDtypeStruct((8, 9), jnp.int32))
    # DeepSpeed's 3M: each module gathered in forward and again in backward (the embedding,
    # outside the layers, once), every gradient reduce-scattered once; fp32, M = 4Ψ bytes
    assert 1.8 * 4 * psi < rep.bytes_of("all-gather") <= 2 * 4 * psi
    assert 0.98 * 4 * psi < rep.bytes_of("reduce-scatter") <= 4 * psi
