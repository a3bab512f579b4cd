"""ZeRO on the 'data' axis composed with the tensor-parallel layout a Linen model declares
(`nn.with_logical_partitioning` + logical rules) on a ('data', 'model') mesh: zerojax's own
collectives run manual over the data axes only (`comm.hierarchy.manual_over_data`), the
model axis stays XLA's, so reduce-scatter (stages 1-3), units, 16-bit precision, ZeRO++,
MiCS, activation offload and local accumulation all work there."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, train_step
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.inspect.hlo import replica_groups

VOCAB, D, FF, SEQ = 64, 32, 128, 8
RULES = (("vocab", "model"), ("mlp", "model"), ("embed", None))
part = lambda names: nn.with_logical_partitioning(nn.initializers.normal(0.05), names)


class MLPBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.Dense(FF, kernel_init=part(("embed", "mlp")))(h)
        return x + nn.Dense(D, kernel_init=part(("mlp", "embed")))(nn.gelu(h))


class TPModel(nn.Module):
    """Megatron-style: MLP hidden dim and vocabulary split over 'model'."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, embedding_init=part(("vocab", "embed")))(tokens)
        for _ in range(2):
            x = MLPBlock()(x)
        return nn.Dense(VOCAB, kernel_init=part(("embed", "vocab")))(x)


def init_fn(key):
    model = TPModel()
    params = model.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
    return train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adamw(1e-2, eps=1e-5)
    )


def data(n=6, rows=16):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        t = rng.integers(0, VOCAB, (rows, SEQ + 1), dtype=np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def mesh_2d(data=4, model=2):
    return jax.make_mesh(
        (data, model), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


# The golden table: every parameter's spec holds both the model's 'model' axis and ZeRO's
# 'data' axis (stage 3, 4 x 2 mesh): 'data' goes on the dimension the model left free.
GOLDEN_STAGE3 = {
    "params/Embed_0/embedding": P("model", "data"),  # (64, 32): vocab on model
    "params/MLPBlock_0/Dense_0/kernel": P("data", "model"),  # (32, 128): mlp on model
    "params/MLPBlock_0/Dense_1/kernel": P("model", "data"),  # (128, 32)
    "params/MLPBlock_1/Dense_0/kernel": P("data", "model"),
    "params/MLPBlock_1/Dense_1/kernel": P("model", "data"),
    "params/Dense_0/kernel": P("data", "model"),  # (32, 64): head, vocab on model
    "params/MLPBlock_0/Dense_0/bias": P(),  # (128,) below threshold 1024
    "params/MLPBlock_0/LayerNorm_0/scale": P(),
}


def test_parameter_specs_hold_both_axes_golden_table():
    zero = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES)
    state = zero.init(init_fn, jax.random.key(0))
    specs = {p.path: p.spec for p in zero.plan(state)}
    for path, spec in GOLDEN_STAGE3.items():
        assert specs[path] == spec, path
        leaf = state.params
        for key in path.split("/")[1:]:
            leaf = leaf[key]
        assert leaf.sharding.spec == spec, path
    mu = {p.path: p.spec for p in zero.plan(state) if "/mu/" in p.path}
    assert mu["opt_state/0/mu/MLPBlock_0/Dense_0/kernel"] == P("data", "model")
    # a (32, 128) kernel on 4 x 2 devices: each holds 8 x 64
    assert state.params["MLPBlock_0"]["Dense_0"]["kernel"].addressable_shards[0].data.shape == (
        8,
        64,
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tensor_parallel_plus_zero_matches_one_device(stage):
    single = jax.device_put(nn.meta.unbox(init_fn(jax.random.key(0))), jax.devices()[0])
    step = jax.jit(train_step)
    ref = []
    for batch in data():
        single, m = step(single, batch)
        ref.append(float(m["loss"]))
    zero = zj.zero_shard(stage=stage, mesh=mesh_2d(), logical_rules=RULES)
    state, got, zstep = train(zero)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.params, single.params)  # per-leaf relative L2, see common.py
    kernel = state.params["MLPBlock_0"]["Dense_0"]["kernel"]
    assert "model" in str(kernel.sharding.spec)  # the model's TP layout at every stage
    assert ("data" in str(kernel.sharding.spec)) == (stage == 3)
    # zerojax's own collectives, over the data axis only ('model' is left to XLA)
    assert zstep.units == (("MLPBlock_0", "MLPBlock_1") if stage >= 1 else ())
    groups = reduce_scatter_groups(zstep.lower(state, data(1)[0]).compile().as_text())
    assert (groups == {DATA_GROUPS}) if stage >= 1 else not groups, groups


def test_unit_buffers_are_refused_where_they_would_undo_tensor_parallelism():
    """Packing a unit's leaves into one buffer gathers the 'model'-split weights whole over
    'model', and the model's activation all-reduces over 'model' vanish (measured: 10 weight
    all-gathers over 'model', none of the 8 all-reduces): refused on a mesh with tensor axes.
    The default moves each leaf alone and keeps the model's own all-reduces."""
    zero = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES)
    state = zero.init(init_fn, jax.random.key(0))
    hlo = zero(train_step).lower(state, data(1)[0]).compile().as_text()
    model_reductions = [
        line
        for line in re.findall(r"^.*\sall-reduce(?:-start)?\(.*$", hlo, re.M)
        if replica_groups(line, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    ]
    assert len(model_reductions) >= 4, "the model's tensor-parallel all-reduces are gone"
    with pytest.raises(zj.ZeroError, match=r"unit_buffers=True on a mesh with tensor-parallel"):
        zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES, unit_buffers=True)


# the 'data' axis of the (4, 2) mesh: devices [[0, 1], [2, 3], [4, 5], [6, 7]]
DATA_GROUPS = ((0, 2, 4, 6), (1, 3, 5, 7))


def reduce_scatter_groups(hlo: str) -> set:
    """The device groups of every reduce-scatter, however XLA prints them (explicit lists,
    iota or mesh axes: jax 0.10 and 0.12 differ)."""
    lines = re.findall(r"^.*\sreduce-scatter(?:-start)?\(.*$", hlo, re.M)
    return {tuple(map(tuple, replica_groups(line, 8))) for line in lines}


def train(zero, steps=6, build=None):
    """(state, losses, step) after `steps` steps of the parity step, warnings as errors (no
    fallback to XLA's placement)."""
    state, zstep, losses = zero.init(build or init_fn, jax.random.key(0)), zero(train_step), []
    with warnings.catch_warnings():
        warnings.simplefilter("error", zj.ZeroWarning)
        for batch in data(steps):
            state, m = zstep(state, batch)
            losses.append(float(m["loss"]))
    assert zstep.used_explicit_collectives
    return state, np.array(losses), zstep


def three_axis_mesh():
    """Two 'nodes' of 2 devices for ZeRO++ / MiCS, each device pair a tensor-parallel group."""
    shape, names = (2, 2, 2), ("node", "local", "model")
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * 3)


@pytest.mark.parametrize(
    "options",
    [
        dict(stage=3, precision="bf16"),
        dict(stage=3, offload_activations=True),
        dict(stage=3, quantized_weights=True, quantized_gradients=True, hpz_partition_size=2),
        dict(stage=3, mics_shard_size=2),
    ],
    ids=["bf16", "offload-activations", "zeropp", "mics"],
)
def test_zero_options_compose_with_tensor_parallelism(options):
    """On the same mesh shape as the model's ('data' or ('node', 'local') x 'model') each
    option trains close to fp32 without TP: exact options within 1e-5, 16-bit and quantized
    ones within their own error."""
    hierarchical = "hpz_partition_size" in options or "mics_shard_size" in options
    mesh = three_axis_mesh() if hierarchical else mesh_2d()
    _, want, _ = train(zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=RULES), steps=3)
    _, got, _ = train(zj.zero_shard(mesh=mesh, logical_rules=RULES, **options), steps=3)
    exact = not (options.get("precision") or options.get("quantized_weights"))
    np.testing.assert_allclose(got, want, rtol=1e-5 if exact else 2e-2)


def test_local_accumulation_composes_with_tensor_parallelism():
    """DDP's no_sync on a ('data', 'model') mesh: the step runs per 'data' device, the model
    axis stays XLA's; it accumulates to the same update as accumulate='reduced'."""
    results = {}
    for accumulate in ("local", "reduced"):
        zero = zj.zero_shard(
            stage=2,
            mesh=mesh_2d(),
            logical_rules=RULES,
            gradient_accumulation_steps=2,
            accumulate=accumulate,
        )
        results[accumulate] = train(zero, steps=4)
    (local, local_losses, _), (reduced, reduced_losses, _) = results.values()
    np.testing.assert_allclose(local_losses, reduced_losses, rtol=1e-5)
    assert_trees_close(local.params, reduced.params)


def test_unmapped_logical_name_and_zero_axis_conflicts_are_clear():
    zero = zj.zero_shard(stage=3, mesh=mesh_2d(), logical_rules=(("vocab", "model"),))
    with pytest.raises(zj.ZeroError, match="logical_rules: 'embed'.*logical_rules="):
        zero.init(init_fn, jax.random.key(0))
    zero = zj.zero_shard(
        stage=3,
        mesh=mesh_2d(),
        logical_rules=(("vocab", "data"), ("mlp", "model"), ("embed", None)),
    )
    with pytest.raises(zj.ZeroError, match="the axis ZeRO shards over"):
        zero.init(init_fn, jax.random.key(0))


def test_logical_rules_without_annotations_warn():
    from common import initial_state

    zero = zj.zero_shard(stage=3, logical_rules=RULES)
    with pytest.warns(UserWarning, match="logical_rules has nothing to map"):
        zero.shard(initial_state(optax.sgd(0.1)))
