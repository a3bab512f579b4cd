"""NNX models on the explicit path: a GPT-2-style NNX transformer written here the way a user
writes one (no zerojax import in it), its step Flax's own. Its calls run per device with
reduce-scatter at stages 2-3, and stage 3 gathers each block as a unit found from outside.
Slope = (peak(L=8) - peak(L=4)) / 4, the compiled peak's growth per added layer."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zerojax as zj
from tests.common import (
    PARITY_ATOL,
    PARITY_RTOL,
    assert_trees_close,
    loop_collective_sizes,
    run_dtype,
)

# Flax's NNX attention takes its softmax in float32 whatever its parameters' dtype, so a float64
# run of this model still rounds there: its parity tests run in float64 (the `x64` fixture) and
# hold the float32 bound (tests/common.py, "Parity"), far above what is left of the noise
FLOAT32_ISLANDS = dict(rtol=PARITY_RTOL, atol=PARITY_ATOL)


def assert_float64_run_close(got, want):
    """The states of NNX objects `got` and `want` (a float64 run) within the float32 bound."""
    pure = lambda x: nnx.to_pure_dict(nnx.state(x))
    assert_trees_close(pure(got), pure(want), **FLOAT32_ISLANDS)


class Block(nnx.Module):
    def __init__(self, d, heads, rngs, dropout=0.0, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.ln1, self.ln2 = nnx.LayerNorm(d, **kw), nnx.LayerNorm(d, **kw)
        self.attn = nnx.MultiHeadAttention(heads, d, use_bias=False, decode=False, **kw)
        self.up, self.down = nnx.Linear(d, 4 * d, **kw), nnx.Linear(4 * d, d, **kw)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2], bool)))
        h = nnx.gelu(self.up(self.ln2(x)))
        return x + self.down(self.drop(h) if self.drop else h)


class Transformer(nnx.Module):
    """Blocks in an nnx.List, or (scan=True) one stacked Block run by nnx.scan, as Flax's
    docs write a scanned stack."""

    def __init__(
        self, layers, rngs, d=64, heads=4, vocab=128, dropout=0.0, scan=False, param_dtype=None
    ):
        param_dtype = param_dtype or jnp.float32
        block = lambda r: Block(d, heads, r, dropout, param_dtype)
        self.embed = nnx.Embed(vocab, d, rngs=rngs, param_dtype=param_dtype)
        if scan:
            self.blocks = nnx.vmap(block, in_axes=0, out_axes=0)(rngs.split(layers))
        else:
            self.blocks = nnx.List([block(rngs) for _ in range(layers)])
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.ln, self.head = nnx.LayerNorm(d, **kw), nnx.Linear(d, vocab, **kw)
        self.scan = scan

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.scan:
            layer = nnx.scan(lambda x, block: (block(x), None), in_axes=(nnx.Carry, 0))
            x, _ = layer(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln(x))


def make(layers, **kw):
    """A build function of the model and its optimizer, in float64 under the `x64` fixture."""

    def build():
        model = Transformer(layers, nnx.Rngs(0), param_dtype=run_dtype(), **kw)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    return build


def train_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def report(options, layers, seq, scan=False):
    zero = zj.zero_shard(**options)
    model, optimizer = zero.eval_shape(make(layers, scan=scan))
    batch = jax.ShapeDtypeStruct((8, seq + 1), jnp.int32)
    return zero.report(zero(train_step), model, optimizer, batch)


@pytest.mark.parametrize(  # unrolled: about a minute, the scan shows it
    "scan",
    [pytest.param(False, id="unrolled", marks=pytest.mark.slow), pytest.param(True, id="scanned")],
)
def test_nnx_units_bound_the_peak_per_layer(scan):
    contenders = {  # sequence 256: recomputing, each unit keeps only its input
        "stage 0": dict(stage=0),
        "auto": dict(stage=3, recompute_units=True),
        "no units": dict(stage=3, units=()),
    }
    p = {(n, L): report(o, L, 256, scan).peak_bytes for n, o in contenders.items() for L in (4, 8)}
    slope = {n: (p[(n, 8)] - p[(n, 4)]) / 4 for n in contenders}
    print(p, {n: s / slope["stage 0"] for n, s in slope.items()})
    assert slope["auto"] <= 0.15 * slope["stage 0"], slope
    assert slope["no units"] > 1.5 * slope["auto"], slope


def data(n, seq=16):
    return [np.random.default_rng(i).integers(0, 128, (16, seq + 1), np.int32) for i in range(n)]


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("stage, scan", [(2, False), (3, False), (3, True)])
def test_nnx_steps_reduce_scatter_and_match_single_device(stage, scan):
    batches = data(3)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(2, scan=scan)()
        single = nnx.jit(train_step)
        want = [float(single(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)  # every divisible leaf split
    model, optimizer = zero.init(make(2, scan=scan))
    step = zero(train_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "XLA places the collectives" warning
        got = [float(step(model, optimizer, b)) for b in batches]
    assert step.used_explicit_collectives
    np.testing.assert_allclose(got, want, rtol=PARITY_RTOL)
    assert_float64_run_close(model, ref_model)
    assert_float64_run_close(optimizer, ref_opt)
    hlo = step.lower(model, optimizer, batches[0]).compile().as_text()
    assert re.search(r"reduce-scatter(-start)?\(", hlo)
    # gradients are reduce-scattered, never all-reduced whole: what is all-reduced is scalars
    rep = zero.report(step, model, optimizer, batches[0])
    assert rep.bytes_of("all-reduce") <= 64, rep.bytes_of("all-reduce")


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("stage", [3, 2])
def test_an_nnx_stacks_small_leaves_move_once_per_step(stage):
    # persistence_threshold judged per layer in an nnx.scan stack: its LayerNorms' and the
    # down projection's (2, 64) leaves are split at rest (128 elements) but a layer's 64 are
    # below 128, so they are gathered (stage 3) and reduced once per step, not per layer
    batches = data(2)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(2, scan=True)()
        want = [float(nnx.jit(train_step)(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(stage=stage, persistence_threshold=128)
    model, optimizer = zero.init(make(2, scan=True))
    assert zero.layout((model, optimizer)).params["blocks/ln1/scale"].split_dim is not None
    step = zero(train_step)
    got = [float(step(model, optimizer, b)) for b in batches]
    np.testing.assert_allclose(got, want, rtol=PARITY_RTOL)
    assert_float64_run_close(model, ref_model)
    in_loop = loop_collective_sizes(step.lower(model, optimizer, batches[0]).compile().as_text())
    assert min(in_loop, default=128) >= 128, sorted(in_loop)


@pytest.mark.filterwarnings("ignore:zerojax. .* stay replicated")  # the small biases
def test_plan_and_describe_name_each_parameters_unit():
    zero = zj.zero_shard(stage=3)
    model, optimizer = zero.eval_shape(make(2))
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32)
    plans = {p.path: p for p in zero.plan((model, optimizer), step=zero(train_step), batch=batch)}
    assert plans["params/blocks/1/up/kernel"].unit == "blocks/1"
    assert plans["params/head/kernel"].unit is None  # gathered with the step, not as a unit
    assert plans["opt_state/opt_state/0/mu/blocks/1/up/kernel"].unit is None  # parameters only
    table = zero.describe((model, optimizer), step=zero(train_step), batch=batch, show=False)
    assert {r.unit for r in table.rows} == {"", "blocks/0", "blocks/1"}
    assert "unit" in str(table).splitlines()[0]


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize(
    "options",
    [
        dict(mesh="local=4", hpz_partition_size=4),  # hpZ: backward gathers inside the node
        dict(mesh="local=4", mics_shard_size=4),  # MiCS: state split over 4, replicated over 2
        dict(offload_optimizer="cpu", offload_param="cpu"),  # state at rest on the host
        # forward saves activations, backward re-gathers from hpZ's secondary copy
        dict(mesh="local=4", hpz_partition_size=4, recompute_units=False),
    ],
    ids=["hpz", "mics", "offload", "hpz-saved-activations"],
)
def test_nnx_zeropp_and_offload_match_single_device(options):
    batches = data(2)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(2)()
        want = [float(nnx.jit(train_step)(ref_model, ref_opt, b)) for b in batches]
    options = dict(options)
    if options.pop("mesh", None):
        options["mesh"] = zj.make_mesh(local=4)
    zero = zj.zero_shard(stage=3, **options)
    model, optimizer = zero.init(make(2))
    step = zero(train_step)
    got = [float(step(model, optimizer, b)) for b in batches]
    assert step.used_explicit_collectives
    np.testing.assert_allclose(got, want, rtol=PARITY_RTOL)
    assert_float64_run_close(model, ref_model)
    if "offload_param" in options:
        assert model.blocks[0].up.kernel[...].sharding.memory_kind == "pinned_host"


def test_nnx_unit_buffers_move_a_large_leaf_alone(monkeypatch):
    # with unit_buffers, a leaf of ALONE_BYTES or more moves as itself: here each block's up
    # and down kernels (64 KiB in fp32) against a cap of 48 KiB, its attention's four
    # [64, 4, 16] / [4, 16, 64] kernels (16 KiB) as one buffer each way; the embedding and the
    # head (32 KiB each), no unit's, as one more
    import zerojax.comm.flat as flat

    monkeypatch.setattr(flat, "ALONE_BYTES", 48 * 2**10)
    layers, batches = 2, data(2)
    with jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make(layers)()
        want = [float(nnx.jit(train_step)(ref_model, ref_opt, b)) for b in batches]
    zero = zj.zero_shard(stage=3, unit_buffers=True)
    model, optimizer = zero.init(make(layers))
    step = zero(train_step)
    table = zero.report(step, model, optimizer, batches[0]).comm_table()
    count = lambda kind: sum(c for (k, _), (c, *_) in table.items() if k == kind)  # noqa: E731
    # per block 3 gathers in forward and 3 in backward, 3 reduce-scatters; + the rest's one
    assert (count("all-gather"), count("reduce-scatter")) == (6 * layers + 1, 3 * layers + 1)
    got = [float(step(model, optimizer, b)) for b in batches]
    np.testing.assert_allclose(got, want, rtol=PARITY_RTOL)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)))


def test_an_nnx_stack_is_split_past_its_layers():
    # 8 vmapped layers on 8 devices: dim 0 divides, yet each layer is split on its own first
    # dim (its shards end to end); the unstacked blocks of an nnx.List split their dim 0.
    # `nnx.vmap` leaves no trace of the stack in the objects: the layout is provisional until
    # the step's calls (here traced by `lower`) reveal it, never guessed from shapes
    zero = zj.zero_shard(stage=3)
    objects = zero.eval_shape(make(8, scan=True))
    assert zero.layout(objects).stacks is None
    zero(train_step).lower(*objects, jax.ShapeDtypeStruct((8, 17), jnp.int32))
    stacked = zero.layout(objects).params
    assert stacked["blocks/up/kernel"].shape == (8, 64, 256)
    assert stacked["blocks/up/kernel"].split_dim == 1
    assert stacked["blocks/attn/query/kernel"].split_dim == 1  # (8, 64, 4, 16)
    listed = zero.layout(zero.eval_shape(make(2))).params
    assert listed["blocks/0/up/kernel"].split_dim == 0


@pytest.mark.parametrize("stage, scan", [(3, False), (3, True), (1, False)])
def test_no_barrier_holds_an_nnx_units_saved_activations(stage, scan):
    # as tests/test_units.py's Linen case: no jax.checkpoint prevent_cse barrier in a unit
    zero = zj.zero_shard(stage=stage)
    model, optimizer = zero.eval_shape(make(2, scan=scan))
    step = zero(train_step)
    hlo = step.lower(model, optimizer, jax.ShapeDtypeStruct((8, 17), jnp.int32)).as_text()
    assert "optimization_barrier" not in hlo
    assert step.units  # the units ran: the check is not vacuous
