"""`zerojax.inspect.audit` reads what a compiled step spends beside its math: on a module written
here, which all-gathers come from storage, what is counted once per loop iteration and what is
re-laid out next to a collective; on an LM compiled for 8 devices, that only the recomputation
asked for adds matmuls, and the false dependencies `prefetch` decides; on a user's scanned MLP,
that a stack split past its layers is gathered without transposes; on flax's attention, that
only heads that do not divide the devices re-lay a kernel out around its collectives."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import zerojax as zj
from tests.test_schedule import VARIADIC
from zerojax.inspect.audit import audit
from zerojax.inspect.hlo import matmul_flops
from zerojax.models.gpt import make_init, train_step
from zerojax.models.lm import LM, LMConfig

GROUP = "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"
GROUP_ACROSS = GROUP.replace("dimensions={0}", "dimensions={1}")
# A two-iteration loop over a stacked weight `w` (invariant) carrying an activation `x`: one
# gather of this layer's slice of `w` (from storage), one of that slice plus `x` (it waits for
# the activation) whose result a matmul reads transposed, one of the slice along its second
# dim, copied back to row-major; in the entry, a gather of a matmul's result.
MODULE = f"""HloModule audited

%body (p: (s32[], f32[4,8], f32[2,4,8])) -> (s32[], f32[4,8], f32[2,4,8]) {{
  %p = (s32[], f32[4,8], f32[2,4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{{1,0}} get-tuple-element(%p), index=1
  %w = f32[2,4,8]{{2,1,0}} get-tuple-element(%p), index=2
  %zero = s32[] constant(0)
  %slice = f32[1,4,8]{{2,1,0}} dynamic-slice(%w, %i, %zero, %zero), dynamic_slice_sizes={{1,4,8}}
  %shard = f32[4,8]{{1,0}} bitcast(%slice)
  %stored = f32[32,8]{{1,0}} all-gather(%shard), {GROUP}
  %anchored = f32[4,8]{{1,0}} add(%shard, %x)
  %waiting = f32[32,8]{{1,0}} all-gather(%anchored), {GROUP}
  %t = f32[8,32]{{1,0}} transpose(%waiting), dimensions={{1,0}}
  %y = f32[4,32]{{1,0}} dot(%x, %t), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %y2 = f32[4,8]{{1,0}} slice(%y), slice={{[0:4], [0:8]}}
  %wide = f32[4,64]{{0,1}} all-gather(%shard), {GROUP_ACROSS}
  %rows = f32[4,64]{{1,0}} copy(%wide)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[4,8], f32[2,4,8]) tuple(%next, %y2, %w)
}}

%cond (c: (s32[], f32[4,8], f32[2,4,8])) -> pred[] {{
  %c = (s32[], f32[4,8], f32[2,4,8]) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(2)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}}

ENTRY %main (a: f32[4,8], b: f32[2,4,8]) -> f32[32,8] {{
  %a = f32[4,8]{{1,0}} parameter(0)
  %b = f32[2,4,8]{{2,1,0}} parameter(1)
  %c0 = s32[] constant(0)
  %init = (s32[], f32[4,8], f32[2,4,8]) tuple(%c0, %a, %b)
  %loop = (s32[], f32[4,8], f32[2,4,8]) while(%init), condition=%cond, body=%body
  %h = f32[4,8]{{1,0}} get-tuple-element(%loop), index=1
  %sq = f32[4,4]{{1,0}} dot(%h, %h), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
  %sq8 = f32[4,8]{{1,0}} pad(%sq, %c0), padding=0_0x0_4
  ROOT %computed = f32[32,8]{{1,0}} all-gather(%sq8), {GROUP}
}}
"""


def test_an_audit_reads_dependencies_loops_and_relayouts():
    found = audit(MODULE, 8)
    # the loop runs twice: its three gathers count twice, the entry's once
    assert found.collectives == {"all-gather": 7}
    assert found.gathered_bytes == 7 * 32 * 8 * 4
    assert found.small_in_loops == 6  # 1 KiB each, inside the loop
    # the slices of the invariant stack (its index a counter) come from storage; the one
    # plus the carried activation and the matmul's result do not
    assert sorted(found.gathers_not_from_storage) == ["computed", "waiting"]
    # `wide` lays its shards out by its second dim: copying it back is the gather's cost;
    # `waiting` gathers blocks of rows: its transpose is the matmul's (a plain step's too)
    assert found.relayout_bytes == 2 * 4 * 64 * 4
    assert found.matmul_transpose_bytes == 2 * 8 * 32 * 4


CFG = LMConfig(vocab=64, d_model=64, n_layers=2, n_heads=2, d_ff=128, seq_len=16)


@pytest.fixture(scope="module")
def lm():
    init_fn = make_init(LM(CFG), optax.adamw(1e-3))
    batch = jax.ShapeDtypeStruct((16, CFG.seq_len + 1), jnp.int32)
    plain = jax.jit(train_step).lower(jax.eval_shape(init_fn, jax.random.key(0)), batch)
    return init_fn, batch, matmul_flops(plain.compile().as_text())


def _compiled(init_fn, batch, **options):
    zero = zj.zero_shard(**options)
    lowered = zero(train_step).lower(zero.eval_shape(init_fn, jax.random.key(0)), batch)
    return lowered.compile().as_text()


@pytest.mark.parametrize(
    "options, ratio",
    [(dict(stage=s), (0.99, 1.01)) for s in range(4)]
    + [(dict(stage=s, recompute_units=True), (1.1, 1.5)) for s in (1, 3)],
)
def test_only_recomputation_asked_for_adds_matmul_flops(lm, options, ratio):
    # 8 devices' FLOPs against one device running the whole batch with a plain jax.jit step:
    # with default options every stage computes the plain step's matmuls, no more
    init_fn, batch, plain = lm
    text = _compiled(init_fn, batch, **options)
    assert ratio[0] <= matmul_flops(text) * 8 / plain <= ratio[1]


def test_a_scanned_bodys_gathers_read_only_their_stored_shards(lm):
    init_fn, batch, _ = lm
    units = dict(stage=3, units=("Attention", "MLP"))
    free = audit(_compiled(init_fn, batch, **units), 8)
    waiting = audit(_compiled(init_fn, batch, prefetch=0, **units), 8)
    # per direction the scanned body gathers attention's 4 split weights (q, k, v, out) and
    # the MLP's 3 (gate, up, down). By default (prefetch=1) none waits for a computed value:
    # each is free to run while the body's other unit computes. prefetch=0: each unit's
    # gathers wait for its input (forward) or cotangent (backward), all 14
    assert free.gathers_not_from_storage == ()
    assert free.collectives["all-gather"] == waiting.collectives["all-gather"]
    assert len(waiting.gathers_not_from_storage) == 2 * (4 + 3)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(256)(nn.LayerNorm()(x))
        return x + nn.Dense(64)(nn.gelu(h)), None


class ScannedMLP(nn.Module):
    """A user's residual MLP, its blocks stacked by `nn.scan`."""

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        x, _ = blocks()(nn.Dense(64)(x), None)
        return nn.Dense(8)(x)


def _mlp_step(state, batch):
    x, y = batch
    loss = lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)  # noqa: E731
    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value


def _mlp_init(key):
    model = ScannedMLP()
    params = model.init(key, jnp.zeros((1, 32)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


@pytest.mark.parametrize("rules, most", [((), 0.01), (((r"ScanBlock.*kernel", 2),), None)])
def test_a_stacks_weights_are_gathered_without_a_transpose(rules, most):
    # split past the layers on each layer's first dim, a gather lays the shards end to end:
    # under 1% of the gathered bytes are re-laid out (a small bias gathered once per step,
    # split past its layers). Split on their last dim (a rule), the kernels are transposed
    # on both sides of every gather and reduce-scatter
    batch = (
        jax.ShapeDtypeStruct((16, 32), jnp.float32),
        jax.ShapeDtypeStruct((16, 8), jnp.float32),
    )
    zero = zj.zero_shard(stage=3, rules=rules)
    state = zero.eval_shape(_mlp_init, jax.random.key(0))
    found = audit(zero(_mlp_step).lower(state, batch).compile().as_text(), 8)
    share = found.relayout_bytes / found.gathered_bytes
    assert share < most if most else share > 0.5, share


class SelfAttention(nn.Module):
    """A user's attention layer: flax's multi-head attention, kernels `[64, heads, 64 / heads]`
    (query, key, value) and `[heads, 64 / heads, 64]` (out)."""

    heads: int

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=64)(x)
        return nn.Dense(8)(x.mean(1))


@pytest.mark.parametrize("heads", [8, 4])
def test_attention_is_re_laid_out_only_where_its_heads_do_not_divide(heads):
    # with 8 heads over 8 devices every kernel is split on its first dim: nothing is re-laid
    # out for a collective (what is transposed beside one is for a matmul, counted apart);
    # with 4 the out kernel is split on head_dim, and the plan says each gather re-lays it out
    def init(key):
        model = SelfAttention(heads)
        params = model.init(key, jnp.zeros((1, 8, 64)))["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-3)
        )

    batch = (
        jax.ShapeDtypeStruct((16, 8, 64), jnp.float32),
        jax.ShapeDtypeStruct((16, 8), jnp.float32),
    )
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    state = zero.eval_shape(init, jax.random.key(0))
    found = audit(zero(_mlp_step).lower(state, batch).compile().as_text(), 8)
    reason = zero.layout(state).params["MultiHeadDotProductAttention_0/out/kernel"].reason
    assert found.matmul_transpose_bytes > 0
    if heads == 8:
        assert found.relayout_bytes == 0
        assert reason == "sharded dim 0"
    else:
        assert found.relayout_bytes >= 2 * 64 * 64 * 4  # its gather and its reduce-scatter
        assert "re-laid out around each collective: dim 0 (4) does not divide by 8" in reason


def test_a_collective_moving_two_arrays_counts_once():
    # an all-reduce of two arrays (XLA's combiners make them) is one launch, its bytes summed
    found = audit(VARIADIC, 8)
    assert found.collectives == {"all-reduce": 1}
    assert found.collective_bytes == {"all-reduce": 256 + 32}
