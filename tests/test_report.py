"""The compiled report: at-rest bytes per stage, collective kinds and sizes, and stage 2's
gradient-memory saving, each asserted against its ZeRO formula (Ψ = parameter count,
N = 8 devices, fp32 params and Adam: 4 bytes param + 4 grad + 8 optimizer per parameter)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from common import batches, make_init, train_step

import zerojax as zj
from zerojax.inspect.hlo import matmul_flops, parse_collectives
from zerojax.models import GPT, GPTConfig

# Model state dominates activations here (seq 8, one sequence per device), as in the regime
# ZeRO is for; with long sequences activations set the peak and hide gradient buffers.
CFG = GPTConfig(vocab=256, d_model=256, n_layers=2, n_heads=8, seq_len=8)
N = 8
REPORTS = {}


def report(stage):
    if stage not in REPORTS:
        zero = zj.zero_shard(stage=stage)
        # the abstract state (as test_abstract.py shows, its report is the live one's)
        state = zero.eval_shape(make_init(optax.adam(1e-3), GPT(CFG), CFG), jax.random.key(0))
        psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
        batch = batches(1, batch_size=N, cfg=CFG)[0]
        REPORTS[stage] = (zero.report(zero(train_step), state, batch), psi)
    return REPORTS[stage]


@pytest.mark.parametrize(
    "stage,formula",
    [
        (0, lambda psi: 12 * psi),  # everything replicated
        (1, lambda psi: 4 * psi + 8 * psi / N),  # optimizer state sharded
        (2, lambda psi: 4 * psi + 8 * psi / N),  # gradients do not persist between steps
        (3, lambda psi: 12 * psi / N),  # everything sharded
    ],
)
def test_at_rest_bytes_match_zero_formulas(stage, formula):
    rep, psi = report(stage)
    total = sum(rep.resident.values())
    assert abs(total - formula(psi)) <= 0.02 * formula(psi) + rep.kept_replicated, (total, psi)
    assert rep.kept_replicated < 0.02 * total  # only leaves < 1024 elements stay whole


def test_stage_0_all_reduces_the_gradients():
    rep, psi = report(0)
    assert rep.bytes_of("reduce-scatter") == 0
    assert rep.bytes_of("all-reduce") == pytest.approx(4 * psi, rel=0.01)  # one model, fp32


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_reduce_scatter_the_gradients(stage):
    rep, psi = report(stage)
    assert rep.bytes_of("reduce-scatter") == pytest.approx(4 * psi, rel=0.01)
    # what is still all-reduced: the small leaves kept replicated, plus the loss
    assert rep.bytes_of("all-reduce") < 0.01 * 4 * psi
    # ZeRO's 2 x model bytes: the reduce-scatter, then the all-gather of the new parameters
    assert rep.sent_bytes == pytest.approx(2 * (N - 1) / N * 4 * psi, rel=0.05)


def block_params(params) -> int:
    """Parameters of the GPT's blocks (its stage-3 units), gathered twice per step."""
    return sum(
        x.size
        for k, v in params.items()
        if k.startswith("block_")
        for x in jax.tree_util.tree_leaves(v)
    )


def test_stage_3_gathers_parameters_and_reduce_scatters_gradients():
    rep, psi = report(3)
    state = jax.eval_shape(make_init(optax.adam(1e-3), GPT(CFG), CFG), jax.random.key(0))
    blocks = block_params(state.params)
    # the blocks are units (units="auto"): gathered in forward and again in backward; the
    # embedding and head once. fp32: 4 bytes x (Ψ + Ψ_blocks)
    assert rep.bytes_of("all-gather") == pytest.approx(4 * (psi + blocks), rel=0.01)
    assert rep.bytes_of("reduce-scatter") == pytest.approx(4 * psi, rel=0.01)
    assert rep.bytes_of("all-reduce") < 0.01 * 4 * psi
    rep0, _ = report(0)
    assert rep.argument_bytes < rep0.argument_bytes / 6  # ≈ 12Ψ/N against 12Ψ
    # XLA's CPU compiler schedules every collective synchronously: nothing is overlapped
    hidden, exposed = rep.overlap
    assert hidden == 0 and exposed == pytest.approx(
        sum(s.collective.sent_bytes for s in rep.scheduled)
    )
    assert exposed > 0


def test_report_prints_a_table():
    text = str(report(2)[0])
    for word in (
        "params",
        "optimizer state",
        "temporaries",
        "peak",
        "reduce-scatter",
        "f32",
        "alive at the peak",
        "largest 5 buffers",
    ):
        assert word in text


HLO = """
  %all-reduce.1 = f32[64,256]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %rs = bf16[8,32]{1,0} reduce-scatter(%dot.1), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}
  %ags = (bf16[4,16]{1,0}, bf16[16,16]{1,0}) all-gather-start(%x), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = bf16[16,16]{1,0} all-gather-done(%ags)
  %a2a = s8[8,128]{1,0} all-to-all(%q), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %cp = f32[10]{0} collective-permute(%y), channel_id=5, source_target_pairs={{0,1},{1,0}}
"""


def test_hlo_parser_counts_each_collective_once_with_its_full_buffer():
    got = {
        (c.kind, c.dtype): (c.buffer_bytes, c.group_size, c.sent_bytes)
        for c in parse_collectives(HLO, 8)
    }
    assert got == {
        ("all-reduce", "f32"): (64 * 256 * 4, 8, 2 * 7 / 8 * 64 * 256 * 4),
        ("reduce-scatter", "bf16"): (8 * 32 * 2 * 4, 4, 3 / 4 * 8 * 32 * 2 * 4),
        ("all-gather", "bf16"): (16 * 16 * 2, 4, 3 / 4 * 16 * 16 * 2),
        ("all-to-all", "s8"): (8 * 128, 2, 1 / 2 * 8 * 128),
        ("collective-permute", "f32"): (40, 2, 40),
    }


LOOP_HLO = """
%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %ag = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %c = s32[] constant(6)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %c), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %w = (s32[], f32[8,16]) while(%t), condition=%cond, body=%body
  %ar = f32[4]{0} all-reduce(f32[4]{0} %y), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""


def test_collectives_in_a_loop_count_once_per_iteration():
    # a scanned stack of 6 layers gathers 6 times: 6 x 64*16*4 bytes, plus one all-reduce
    found = parse_collectives(LOOP_HLO, 8)
    assert sorted((c.kind, c.buffer_bytes) for c in found) == [("all-gather", 64 * 16 * 4)] * 6 + [
        ("all-reduce", 16)
    ]


MATMUL_HLO = """
%fused (param_0: f32[8,16], param_1: f32[16,32]) -> f32[8,32] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,32]{1,0} constant({...})
  %f = f32[8,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused
  %k = bf16[3,3,16,4]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %i = bf16[2,10,10,16]{3,2,1,0} get-tuple-element(%p), index=2
  %conv = f32[2,8,8,4]{3,2,1,0:T(8,128)} convolution(%i, %k), window={size=3x3}, dim_labels=b01f_01io->b01f
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %c = s32[]{:T(128)} constant(6)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %c), direction=LT
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[4,8]{1,0} parameter(0)
  %w = (s32[], f32[8,16]) while(%t), condition=%cond, body=%body
  %d = f32[4,4]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""


def test_matmul_flops_count_each_loop_iteration_and_fused_or_convolution_matmuls():
    dot = 2 * 8 * 32 * 16  # 2 x output elements x contracting dimension
    conv = 2 * (2 * 8 * 8 * 4) * (3 * 3 * 16)  # kernel elements per output feature: 3x3x16
    entry = 2 * 4 * 4 * 8
    assert matmul_flops(MATMUL_HLO) == 6 * (dot + conv) + entry


def test_matmul_flops_of_a_scanned_step_count_every_layer():
    def loss(w, x):
        y, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
        return (y**2).sum()

    w, x = jnp.ones((3, 256, 256)), jnp.ones((64, 256))
    compiled = jax.jit(jax.grad(loss)).lower(w, x).compile()
    # 3 layers x (forward, input gradient, weight gradient) x 2 x 64 x 256 x 256
    assert matmul_flops(compiled.as_text()) == 3 * 3 * 2 * 64 * 256 * 256


def test_matmul_flops_per_device_add_up_to_the_plain_steps():
    """Each device computes 1/N of a plain jit step's matmuls at stages 0 and 3 by default;
    with recompute_units=True stage 3 recomputes each unit's forward for its backward, and the
    report shows the extra."""
    init = make_init(optax.adam(1e-3), GPT(CFG), CFG)
    batch = batches(1, batch_size=N, cfg=CFG)[0]
    plain = matmul_flops(
        jax.jit(train_step)
        .lower(jax.eval_shape(init, jax.random.key(0)), batch)
        .compile()
        .as_text()
    )
    zero = zj.zero_shard(stage=3, recompute_units=True)
    again = zero.report(zero(train_step), zero.eval_shape(init, jax.random.key(0)), batch)
    kept = report(3)[0]
    assert report(0)[0].matmul_flops * N == plain
    assert kept.matmul_flops * N == plain
    assert again.matmul_flops * N > 1.1 * plain  # each unit's forward once more
    assert "GFLOP per device per step" in str(kept)


def test_report_on_one_device_has_nothing_to_partition_and_sends_nothing():
    zero = zj.zero_shard(stage=3, mesh=zj.make_mesh(jax.devices()[:1]))
    state = zero.eval_shape(make_init(optax.adam(1e-3), GPT(CFG), CFG), jax.random.key(0))
    rep = zero.report(zero(train_step), state, batches(1, batch_size=2, cfg=CFG)[0])
    assert rep.peak_bytes > 0 and rep.sent_bytes == 0 and rep.cross_node_bytes == 0
