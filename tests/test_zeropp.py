"""ZeRO++ (qwZ, hpZ, qgZ) and MiCS on a (node=2, local=4) mesh of 8 simulated devices:
quantization error bounds, exact parity where nothing is quantized, the collectives each option
changes (read from the partitioned HLO), and the options' errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, slow
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.comm.quant import dequantize, quantize, quantized_all_gather, quantized_reduce_scatter
from zerojax.inspect.hlo import parse_collectives
from zerojax.models.gpt import make_init, train_step
from zerojax.models.lm import LM, LM_PRESETS, param_count

CFG = LM_PRESETS["tiny"].replace(vocab=203, d_model=64, n_heads=4, d_ff=176, n_layers=2, seq_len=16)
AXES = ("node", "local")
LEVELS = (("node", 2), ("local", 4))


def mesh():
    return zj.make_mesh(local=4)


def rel_err(got, want):
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


# ---- quantization -------------------------------------------------------------------------
def test_int4_codes_pack_two_per_byte_and_unpack_exactly():
    x = jnp.arange(-7, 8, dtype=jnp.float32).repeat(4)[:60].reshape(6, 10)  # 60 = 1.875 blocks
    codes, scale = quantize(x, 4, 32)
    assert codes.dtype == jnp.uint8 and codes.shape == (2, 16)
    np.testing.assert_array_equal(dequantize(codes, scale, 4, x.shape), x)  # on the grid


def trained_kernels():
    """Kernels of the tiny LM after 30 Adam steps on random tokens (not just initial noise)."""
    init_fn = make_init(LM(CFG), optax.adam(3e-3))
    state, step = init_fn(jax.random.key(0)), jax.jit(train_step)
    rng = np.random.default_rng(0)
    for _ in range(30):
        state, _ = step(state, rng.integers(0, CFG.vocab, (8, CFG.seq_len + 1), dtype=np.int32))
    return [x for x in jax.tree_util.tree_leaves(state.params) if x.size >= 1024]


def test_int8_weight_round_trip_error_is_below_one_percent():
    errors = {
        "normal": rel_err(
            dequantize(
                *quantize(w := jax.random.normal(jax.random.key(0), (512, 384)), 8, 256), 8, w.shape
            ),
            w,
        )
    }
    errors["trained"] = max(
        rel_err(dequantize(*quantize(k, 8, 256), 8, k.shape), k) for k in trained_kernels()
    )
    print("int8 block 256 relative L2 error:", errors)
    assert errors["normal"] < 1e-2 and errors["trained"] < 1e-2


def test_quantized_all_gather_rebuilds_the_weight_from_int8_shards():
    w = jax.random.normal(jax.random.key(0), (64, 96))
    gather = jax.shard_map(
        lambda s: quantized_all_gather(s, AXES, 1, 256, jnp.float32)[None],
        mesh=mesh(),
        in_specs=P(None, AXES),
        out_specs=P(AXES),
    )
    copies = gather(w)  # one full copy per device
    assert copies.shape == (8, 64, 96)
    assert rel_err(copies[5], w) < 1e-2
    np.testing.assert_array_equal(copies[0], copies[7])  # every device the same weight


@pytest.mark.parametrize("bits,bound", [(8, 1e-2), (4, 0.15)])
def test_quantized_reduce_scatter_is_close_to_the_exact_one(bits, bound):
    grads = jax.random.normal(jax.random.key(1), (8, 64, 96))  # one gradient per device
    exact = jax.shard_map(
        lambda g: jax.lax.psum_scatter(g[0], AXES, scatter_dimension=1, tiled=True),
        mesh=mesh(),
        in_specs=P(AXES),
        out_specs=P(None, AXES),
    )(grads)
    np.testing.assert_allclose(exact, grads.sum(0), rtol=1e-5, atol=1e-5)
    got = jax.shard_map(
        lambda g: quantized_reduce_scatter(g[0], 1, LEVELS, bits, 32),
        mesh=mesh(),
        in_specs=P(AXES),
        out_specs=P(None, AXES),
    )(grads)
    err = rel_err(got, exact)
    print(f"int{bits} block 32, two levels: relative L2 error {err:.4f}")
    assert err < bound


# ---- training -----------------------------------------------------------------------------
def train(data, init_fn, **options):
    zero = zj.zero_shard(stage=3, persistence_threshold=0, **options)
    state, step, losses = zero.init(init_fn, jax.random.key(0)), zero(train_step), []
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return state, losses


def lm_setup(scan, steps=4):
    cfg = CFG.replace(scan_layers=scan)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, cfg.vocab, (16, cfg.seq_len + 1), dtype=np.int32) for _ in range(steps)]
    return data, make_init(LM(cfg), optax.sgd(0.05, momentum=0.9))


def single_device(data, init_fn):
    state, step, losses = (
        jax.device_put(init_fn(jax.random.key(0)), jax.devices()[0]),
        jax.jit(train_step),
        [],
    )
    for batch in data:
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return state, losses


HPZ, MICS = dict(hpz_partition_size=4), dict(mics_shard_size=4)


BUFFERS = dict(unit_buffers=True)  # a unit's (and the rest's) leaves as one buffer per dtype


# each option scanned and unrolled between them; the slow lane runs the other two pairs; with
# unit_buffers, the buffers are gathered inside the node (MiCS) or re-gathered from hpZ's copy
@pytest.mark.parametrize(
    "options,scan",
    [
        (HPZ, True),
        (MICS, False),
        ({**MICS, **BUFFERS}, True),
        *slow((HPZ, False), (MICS, True), ({**HPZ, **BUFFERS}, False)),
    ],
    ids=[
        "hpZ-scanned",
        "MiCS-unrolled",
        "MiCS-buffers-scanned",
        "hpZ-unrolled",
        "MiCS-scanned",
        "hpZ-buffers-unrolled",
    ],
)
def test_unquantized_options_train_exactly_like_one_device(options, scan):
    data, init_fn = lm_setup(scan)
    ref, ref_losses = single_device(data, init_fn)
    state, losses = train(data, init_fn, **options)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.params, ref.params)


INT4 = dict(quantized_gradients=True)  # int4 gradients: ~14% error per reduction
QUANTIZED = {  # options, per-step relative tolerance on the loss against one device
    "qwZ": (dict(quantized_weights=True), 1e-2),
    "qgZ-int8": (dict(quantized_gradients=True, quantized_gradients_bits=8), 1e-2),
    "qgZ-int4": (INT4, 3e-2),
    "all": (dict(quantized_weights=True, hpz_partition_size=4, **INT4), 3e-2),
    "MiCS+qwZ+qgZ": (dict(quantized_weights=True, mics_shard_size=4, **INT4), 3e-2),
}


@pytest.mark.parametrize(
    "name",
    [
        # int4 gradients and qwZ alone are in "all" and "MiCS+qwZ+qgZ" too
        pytest.param(name, marks=pytest.mark.slow) if name in ("qgZ-int4", "qwZ") else name
        for name in QUANTIZED
    ],
)
def test_quantized_options_train_close_to_one_device(name):  # ("all" has int4 gradients)
    options, rtol = QUANTIZED[name]
    # learnable data (counting sequences from random starts) and Adam: the loss falls fast
    rng = np.random.default_rng(0)
    data = [
        (rng.integers(0, CFG.vocab, (16, 1)) + np.arange(CFG.seq_len + 1)) % CFG.vocab
        for _ in range(8)
    ]
    init_fn = make_init(LM(CFG), optax.adam(1e-2))
    _, ref_losses = single_device(data, init_fn)
    _, losses = train(data, init_fn, mesh=mesh(), **options)
    print(name, "losses", np.round(losses, 4), "one device", np.round(ref_losses, 4))
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    assert losses[-1] == pytest.approx(ref_losses[-1], rel=1e-2)  # and ends where it should
    assert losses[-1] < losses[0] - 1.0  # having learned


# ---- what each option changes in the program -----------------------------------------------
def collectives(**options):
    cfg = LM_PRESETS["tiny"].replace(n_layers=2)
    zero = zj.zero_shard(stage=3, precision="bf16", mesh=mesh(), **options)
    state = zero.eval_shape(make_init(LM(cfg), optax.adam(1e-3)), jax.random.key(0))
    return zero.report(
        zero(train_step), state, jax.ShapeDtypeStruct((8, cfg.seq_len + 1), jnp.int32)
    ).collectives


def test_each_option_changes_the_collectives_it_should():
    base, qwz, hpz, qgz = (
        collectives(),
        collectives(quantized_weights=True),
        collectives(hpz_partition_size=4),
        collectives(quantized_gradients=True),
    )
    kinds = lambda cs: {(c.kind, c.dtype, c.cross_node) for c in cs}
    big_gathers = lambda cs, cross: [
        c for c in cs if c.kind == "all-gather" and c.dtype == "bf16" and c.cross_node == cross
    ]
    # qwZ: the 16-bit weight gathers became int8 ones
    assert not big_gathers(qwz, True) and ("all-gather", "s8", True) in kinds(qwz)
    # hpZ: each layer's backward gather moved inside the node; forward gathers stay global
    assert (
        len(big_gathers(hpz, False))
        == len(big_gathers(base, True)) - len(big_gathers(hpz, True))
        > 0
    )
    assert all(c.group_size == 4 for c in big_gathers(hpz, False))
    # qgZ: no more reduce-scatters, int4 codes (two per uint8) in all-to-alls in both levels
    assert any(c.kind == "reduce-scatter" for c in base)
    assert not any(c.kind == "reduce-scatter" for c in qgz)
    assert {("all-to-all", "u8", False), ("all-to-all", "u8", True)} <= kinds(qgz)


def test_cross_node_bytes_of_all_three_are_under_a_quarter_of_zero3():
    # the example LM 'small' preset on (node=2, local=4), bf16 with bf16 gradient reduction
    # (bench/zeropp_report.py prints the full table). M = 2Ψ bytes, one 16-bit model copy.
    cfg = LM_PRESETS["small"]
    init_fn = make_init(LM(cfg), optax.adam(1e-3))
    cross = {}
    for name, options in (
        ("zero3", {}),
        ("zeropp", dict(quantized_weights=True, hpz_partition_size=4, quantized_gradients=True)),
    ):
        zero = zj.zero_shard(
            stage=3, precision="bf16", grad_reduce_dtype="bf16", mesh=mesh(), **options
        )
        state = zero.eval_shape(init_fn, jax.random.key(0))
        cross[name] = zero.report(
            zero(train_step), state, jax.ShapeDtypeStruct((8, cfg.seq_len + 1), jnp.int32)
        ).cross_node_bytes
    m = 2 * param_count(cfg)
    # ZeRO-3: forward gather + backward gather + reduce-scatter, each (g-1)/g = 7/8 of M
    assert cross["zero3"] == pytest.approx(3 * 7 / 8 * m, rel=0.02)
    print(
        f"cross-node bytes: ZeRO-3 {cross['zero3'] / m:.3f} M, all three "
        f"{cross['zeropp'] / m:.3f} M, ratio {cross['zeropp'] / cross['zero3']:.3f}"
    )
    assert cross["zeropp"] <= 0.25 * cross["zero3"]


def test_iota_replica_groups_are_read_with_their_transpose():
    line = (
        "%ag = f32[8]{0} all-gather(f32[2]{0} %p), channel_id=1, "
        "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}"
    )
    (c,) = parse_collectives(line, 8, local=4)
    assert c.group_size == 4 and c.cross_node  # groups {0,2,4,6}, {1,3,5,7}
    (c,) = parse_collectives(line.replace("[4,2]T(1,0)", "[8]"), 8, local=4)
    assert c.group_size == 4 and not c.cross_node  # groups {0,1,2,3}, {4,5,6,7}


# ---- options and their errors --------------------------------------------------------------
def test_deepspeed_keys_set_the_options():
    cfg = zj.ZeroConfig.from_json(
        {
            "zero_optimization": {
                "stage": 3,
                "zero_quantized_weights": True,
                "zero_hpz_partition_size": 4,
                "zero_quantized_gradients": True,
            }
        }
    )
    assert (cfg.quantized_weights, cfg.hpz_partition_size, cfg.quantized_gradients) == (
        True,
        4,
        True,
    )
    zero = zj.zero_shard(config=cfg)  # no mesh given: zerojax builds (node=2, local=4)
    assert dict(zero.mesh.shape) == {"node": 2, "local": 4}
    mics = zj.zero_shard(config={"zero_optimization": {"stage": 3, "mics_shard_size": 4}})
    assert (mics.comm.shard_axis, mics.comm.data_axis, mics.shard_size) == ("local", AXES, 4)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(stage=2, quantized_weights=True), "need stage 3"),
        (dict(stage=3, hpz_partition_size=4, mics_shard_size=4), "use one"),
        (dict(stage=3, quantized_gradients=True, quantized_gradients_bits=2), "must be one of"),
        (dict(stage=3, quantized_gradients=True, explicit_collectives=False), "explicit_coll"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(zj.ZeroError, match=message):
        zj.ZeroConfig(**options)


def test_hpz_without_units_says_it_has_nothing_to_do():
    from common import batches
    from common import make_init as gpt_init
    from common import train_step as gpt_step

    zero = zj.zero_shard(stage=3, hpz_partition_size=4, units=())  # no stage-3 units
    state = zero.init(gpt_init(optax.sgd(0.1)), jax.random.key(0))
    with pytest.warns(UserWarning, match="hpz_partition_size has nothing to do"):
        zero(gpt_step)(state, batches(1)[0])


def test_meshes_that_do_not_fit_the_options_are_refused():
    with pytest.raises(zj.ZeroError, match="need a \\('node', 'local'\\) mesh"):
        zj.zero_shard(stage=3, hpz_partition_size=4, mesh=zj.make_mesh())
    with pytest.raises(zj.ZeroError, match="must equal the mesh's 'local' axis size"):
        zj.zero_shard(stage=3, hpz_partition_size=2, mesh=mesh())
    with pytest.raises(zj.ZeroError, match="must divide the 8 devices"):
        zj.make_mesh(local=3)
