"""Stage-3 units chosen from outside the model: a Linen transformer written here, the way a user
writes one, importing nothing from zerojax, gathered block by block through `units=` (or
'auto'). Slope = (peak(L=8) - peak(L=4)) / 4, the compiled peak's growth per added layer."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax as zj
from tests.common import (
    assert_trees_close,
    in_run_dtype,
    loop_collective_sizes,
    run_rtol,
    slow,
)


class Block(nn.Module):
    """GPT-2 style: pre-norm causal self-attention and a GELU MLP, residuals around both."""

    d: int
    heads: int
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], bool))
        # no attention biases: the key bias's true gradient is exactly 0 (softmax ignores a
        # shift), so Adam would turn float rounding noise into full-size updates there
        attention = nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False)
        x = x + attention(h, h, mask=mask)
        h = nn.Dense(4 * self.d)(nn.LayerNorm()(x))
        h = nn.Dropout(self.dropout, deterministic=not self.dropout)(h)
        return x + nn.Dense(self.d)(nn.gelu(h)), None


class Transformer(nn.Module):
    layers: int
    scan: bool
    d: int = 64
    heads: int = 4
    vocab: int = 128
    dropout: float = 0.0

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        if self.scan:
            stack = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=self.layers,
            )
            x, _ = stack(self.d, self.heads, self.dropout, name="blocks")(x, None)
        else:
            for i in range(self.layers):
                x, _ = Block(self.d, self.heads, self.dropout, name=f"block_{i}")(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def init_fn(model, seq):
    def init(key):
        params = model.init(key, jnp.zeros((1, seq), jnp.int32))["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)
        )

    return init


def step(state, batch, apply=None):
    """Next-token loss and one optimizer step; `apply` (default `state.apply_fn`) runs the model."""
    apply = apply or state.apply_fn

    def loss_fn(params):
        logits = apply({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def peak(options, layers, scan, seq=128):
    zero = zj.zero_shard(**options)
    state = zero.eval_shape(init_fn(Transformer(layers, scan), seq), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((8, seq + 1), jnp.int32)
    return zero.report(zero(step), state, batch).peak_bytes


@pytest.mark.parametrize(  # unrolled: 60-125 s, the scan shows it
    "scan",
    [pytest.param(True, id="scanned"), pytest.param(False, id="unrolled", marks=pytest.mark.slow)],
)
def test_units_from_outside_bound_the_peak_per_layer(scan):
    contenders = {
        "stage 0": dict(stage=0),
        "units Block": dict(stage=3, units="Block", recompute_units=True),
        "units auto": dict(stage=3, recompute_units=True),
        "no units": dict(stage=3, units=()),
    }
    p = {(name, L): peak(o, L, scan) for name, o in contenders.items() for L in (4, 8)}
    slope = {name: (p[(name, 8)] - p[(name, 4)]) / 4 for name in contenders}
    # sequence 128: activations matter; recomputing, each unit keeps only its input
    assert slope["units Block"] <= 0.15 * slope["stage 0"], slope
    assert slope["units auto"] <= 0.15 * slope["stage 0"], slope
    # the units are what bounds it: without them stage 3 keeps every gathered layer
    assert slope["no units"] > 1.5 * slope["units Block"], slope


@pytest.mark.parametrize("stage", [2, 1])
def test_stages_1_2_reduce_each_units_gradient_as_backward_leaves_it(stage):
    """8 scanned layers, sequence 64 (activations of the order of the gradient, 4Ψ): reducing
    after backward holds every layer's full gradient at once; per unit, only this device's
    slice of each, so the peak drops by at least half of (N-1)/N * 4Ψ. (Unrolled, XLA
    already schedules each reduce-scatter as soon as its gradient exists: equal peaks.)"""
    n, seq = 8, 64
    state = jax.eval_shape(init_fn(Transformer(8, True), seq), jax.random.key(0))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    per_unit = peak(dict(stage=stage), 8, True, seq)
    at_the_end = peak(dict(stage=stage, units=()), 8, True, seq)
    assert at_the_end - per_unit >= 0.5 * (n - 1) / n * 4 * psi, (at_the_end, per_unit, psi)


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize(
    "scan, units, buffers",
    [(True, "Block", False), (False, "auto", False), (True, "Block", True)]
    + slow(
        (False, "Block", False),
        (True, "auto", False),
        (True, r"block_\d+|blocks", False),
        (False, r"block_\d+", False),
        (False, "auto", True),
    ),
)
def test_units_from_outside_match_single_device_training(scan, units, buffers):
    model, seq = Transformer(2, scan), 16
    data = [
        np.random.default_rng(i).integers(0, 128, (16, seq + 1), dtype=np.int32) for i in range(3)
    ]
    state = jax.device_put(init_fn(model, seq)(jax.random.key(0)), jax.devices()[0])
    zero = zj.zero_shard(stage=3, units=units, unit_buffers=buffers)
    got, want, _ = train_both(zero, step, state, data)
    assert_trees_close(got.params, want.params)
    assert_trees_close(got.opt_state, want.opt_state)


def train_both(zero, fn, state, data):
    """(zerojax's state, one device's state, the zerojax step) after training `fn` on `data`
    both ways from `state` (in float64 under the `x64` fixture); the losses agree at every
    step, and zerojax used its own collectives without falling back (no warning)."""
    state = in_run_dtype(state)
    got, got_step, want, single = zero.shard(state), zero(fn), state, jax.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "XLA places the collectives" warning
        for batch in data:
            want, want_loss = single(want, batch)
            got, got_loss = got_step(got, batch)
            np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=run_rtol())
    assert got_step.used_explicit_collectives
    return got, want, got_step


def test_named_units_of_a_model_with_dropout():
    state0 = init_fn(Transformer(2, False, dropout=0.1), 16)(jax.random.key(0))
    batch = np.zeros((8, 17), np.int32)

    def dropout_step(state, batch, key):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch[:, :-1], rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    # named explicitly, units take the model's RNG streams (tests/test_randomness.py: the
    # same masks as without units)
    zero = zj.zero_shard(stage=3, units="Block")
    step = zero(dropout_step)
    with warnings.catch_warnings():
        warnings.simplefilter("error", zj.ZeroWarning)
        new = step(zero.shard(state0), batch, jax.random.key(1))
    assert int(new.step) == 1 and step.units == ("block_0", "block_1")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(stage=3, units="Block("), "units regex 'Block\\(' does not compile"),
        (dict(stage=3, units=3), "units must be 'auto', a regex or a tuple of regexes"),
    ],
)
def test_bad_units_name_the_option(options, message):
    with pytest.raises(zj.ZeroError, match=message):
        zj.zero_shard(**options)


def test_units_at_lower_stages_are_accepted_like_prefetch():
    # one config swept over stages (zerojax plan does) must not fail on a stage-3 option
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zj.ZeroConfig(stage=1).units == "auto"
        assert zj.ZeroConfig(stage=2, units=("Attention", "MLP")).units == ("Attention", "MLP")


def test_gather_on_use_marks_a_unit_from_inside_the_model():
    class Marked(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = zj.flax.gather_on_use(Block)(64, 4, name="block_0")(x)[0]
            return nn.Dense(128)(Block(64, 4, name="plain")(x)[0])

    class Model(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            return Marked()(nn.Embed(128, 64)(tokens))

    state = init_fn(Model(), 16)(jax.random.key(0))
    leaves = jax.tree_util.tree_leaves(state.params["Marked_0"]["block_0"])
    block = sum(x.size for x in leaves if x.size >= 1024)  # smaller ones stay replicated
    gathered = {}
    with pytest.warns(zj.ZeroWarning, match=r"units \['plain'\] match no module .* Marked_0/plain"):
        zero = zj.zero_shard(stage=3, units="plain")
        zero(step).trace(zero.shard(state), np.zeros((8, 17), np.int32))
    for units in ((), ".*/plain"):
        zero = zj.zero_shard(stage=3, units=units)
        rep = zero.report(zero(step), zero.shard(state), np.zeros((8, 17), np.int32))
        gathered[units] = rep.bytes_of("all-gather")
    # fp32: a unit's 4-byte split weights are gathered twice (forward, backward), others once; the
    # marked block is a unit either way, and naming `plain` (by path) adds the same again
    assert gathered[()] >= 2 * 4 * block
    assert gathered[".*/plain"] - gathered[()] == 4 * block


def test_plan_names_each_parameters_unit():
    zero = zj.zero_shard(stage=3, units="Block")
    state = zero.eval_shape(init_fn(Transformer(2, False), 16), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32)
    plans = {p.path: p.unit for p in zero.plan(state, step=zero(step), batch=batch)}
    assert plans["params/block_1/Dense_0/kernel"] == "block_1"
    assert plans["params/Embed_0/embedding"] is None
    assert all(p.unit is None for p in zero.plan(state))  # without the step: not known


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_unit_buffers_take_two_gathers_and_one_reduce_scatter_per_unit(scan):
    layers, batch = 3, jax.ShapeDtypeStruct((8, 17), jnp.int32)
    counts = {}
    for buffers in (False, True):
        zero = zj.zero_shard(stage=3, units="Block", unit_buffers=buffers)
        state = zero.eval_shape(init_fn(Transformer(layers, scan), 16), jax.random.key(0))
        table = zero.report(zero(step), state, batch).comm_table()
        counts[buffers] = [
            sum(c for (k, _), (c, *_) in table.items() if k == kind)
            for kind in ("all-gather", "reduce-scatter")
        ]
    # the split parameters no unit holds (embedding, head) are gathered once per step as one
    # buffer and reduced as one; a scanned stack's loop body is counted once per iteration
    plans = zero.plan(state, step=zero(step), batch=batch)
    rest = sum(p.category == "params" and p.split_dim is not None and not p.unit for p in plans)
    assert rest >= 2  # so that one buffer for them is fewer collectives than one per leaf
    assert counts[True][0] == 2 * layers + 1, counts  # forward, and again in backward
    assert counts[True][1] == layers + 1, counts
    assert counts[False][0] > counts[True][0], counts  # leaf by leaf: one per leaf


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
def test_a_large_leaf_moves_alone_with_unit_buffers(monkeypatch):
    # a leaf of ALONE_BYTES or more is gathered and reduced as itself, not copied into its
    # unit's buffer: here each block's two MLP kernels (64 KiB in fp32) against a cap of 48 KiB
    # move alone, its 16 KiB attention kernels as one buffer each way
    import zerojax.comm.flat as flat

    monkeypatch.setattr(flat, "ALONE_BYTES", 48 * 2**10)
    layers, batch = 2, jax.ShapeDtypeStruct((8, 17), jnp.int32)
    zero = zj.zero_shard(stage=3, units="Block", unit_buffers=True)
    state = zero.eval_shape(init_fn(Transformer(layers, False), 16), jax.random.key(0))
    table = zero.report(zero(step), state, batch).comm_table()
    count = lambda kind: sum(c for (k, _), (c, *_) in table.items() if k == kind)  # noqa: E731
    # per block 3 gathers in forward and 3 in backward, 3 reduce-scatters; + the rest's one
    assert (count("all-gather"), count("reduce-scatter")) == (6 * layers + 1, 3 * layers + 1)
    data = [np.random.default_rng(i).integers(0, 128, (16, 17), dtype=np.int32) for i in range(2)]
    state = jax.device_put(init_fn(Transformer(layers, False), 16)(jax.random.key(0)))
    got, want, _ = train_both(zero, step, state, data)
    assert_trees_close(got.params, want.params)


def closure_step(model):
    """A step that applies a module captured in a closure, never touching state.apply_fn."""
    return lambda state, batch: step(state, batch, apply=model.apply)


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_closure_called_model_gets_the_explicit_collectives(stage):
    model, seq = Transformer(2, stage == 3), 16
    state0 = init_fn(model, seq)(jax.random.key(0))
    state0 = state0.replace(apply_fn=None)  # nothing for zerojax to hook there
    data = [
        np.random.default_rng(i).integers(0, 128, (16, seq + 1), dtype=np.int32) for i in range(2)
    ]
    got, want, got_step = train_both(zj.zero_shard(stage=stage), closure_step(model), state0, data)
    assert_trees_close(got.params, want.params)
    hlo = got_step.lower(got, data[0]).as_text()
    # stages 2-3 reduce-scatter the gradients, as a state.apply_fn step does
    assert ("reduce_scatter" in hlo) == (stage >= 2), stage


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("stage, scan", [(3, True), (2, False)] + slow((3, False), (2, True)))
def test_saved_activations_instead_of_recomputation_match_single_device(stage, scan):
    # recompute_units=False: forward keeps autodiff's residuals less the weights, backward
    # re-gathers the weights and uses them (tests/test_units.py's Transformer, GELU, attention)
    model, seq = Transformer(2, scan), 16
    data = [
        np.random.default_rng(i).integers(0, 128, (16, seq + 1), dtype=np.int32) for i in range(3)
    ]
    state = jax.device_put(init_fn(model, seq)(jax.random.key(0)), jax.devices()[0])
    zero = zj.zero_shard(stage=stage, recompute_units=False)
    got, want, _ = train_both(zero, step, state, data)
    assert_trees_close(got.params, want.params)


def test_saved_activations_never_include_the_weights():
    from zerojax.flax.unit_calls import _forward_saving_activations

    def apply(module):
        return lambda p, extra, a: (module.apply({"params": p}, a), {})

    params = nn.Dense(8).init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    x = jnp.ones((2, 8))

    def saved(module, params):  # traced, as inside a step
        got = {}

        def forward(p, a):
            out, (_, slots, kept) = _forward_saving_activations(apply(module), p, None, a)
            got.update(slots=slots, kept=[(k.shape, k.dtype) for k in kept])
            return out

        jax.jit(forward)(params, x)
        return got["slots"], got["kept"]

    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    # the kernel is used where it was (a slot), never kept; the input is kept. A module that
    # casts its weights (`dtype=`) keeps no bf16 copy of them: backward casts them again
    for dtype in (None, jnp.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            slots, kept = saved(nn.Dense(8, dtype=dtype), params)
        assert paths.index("['kernel']") in slots, dtype
        assert kept == [((2, 8), jnp.float32)], dtype


def test_a_unit_keeps_its_matmul_outputs_and_redoes_elementwise_work():
    from zerojax.flax.unit_calls import _forward_saving_activations

    class Block(nn.Module):  # as a user writes one: gelu, dropout, a norm
        @nn.compact
        def __call__(self, x):
            h = nn.Dropout(0.1, deterministic=False)(nn.gelu(nn.Dense(16)(x)))
            return nn.Dense(8)(nn.LayerNorm()(h))

    x = jnp.ones((2, 8))
    params = Block().init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    kept = []

    def forward(p, a, key):
        def apply(p, extra, a):
            return Block().apply({"params": p}, a, rngs={"dropout": extra}), {}

        out, (_, _, saved) = _forward_saving_activations(apply, p, key, a)
        kept.extend((v.shape, str(v.dtype)) for v in saved)
        return out

    jax.jit(forward)(params["params"], x, jax.random.key(2))
    # the input, the first matmul's output, LayerNorm's two sums and the dropout key; gelu's
    # intermediates, the dropout mask and the normalized values are redone in backward
    assert sorted(kept) == sorted(
        [((2, 8), "float32"), ((2, 16), "float32"), ((2,), "float32"), ((2,), "float32")]
        + [((), "key<fry>")]
    )


@pytest.mark.parametrize("stage, scan", [(3, True), (3, False), (1, False), (1, True)])
def test_no_barrier_holds_a_units_saved_activations(stage, scan):
    # jax.checkpoint's prevent_cse barrier, around what a unit's backward redoes (elementwise
    # work, re-layouts and casts), made libtpu hold every saved activation at one point: the
    # bench LM's stage-3 peak on v5e-8 was 2x its peak without it (BENCHMARKS.md 1d)
    zero = zj.zero_shard(stage=stage)
    state = zero.eval_shape(init_fn(Transformer(2, scan), 16), jax.random.key(0))
    batch = jax.ShapeDtypeStruct((16, 17), jnp.int32)
    step_fn = zero(step)
    assert "optimization_barrier" not in step_fn.lower(state, batch).as_text()
    assert step_fn.units  # the units ran: the check is not vacuous


def test_a_step_reports_the_variant_it_last_ran():
    """Each compiled variant keeps what its own trace found: a step that applies the model for
    one batch structure only reports that variant's units again once it runs it again, though
    the other variant was traced after it."""
    zero = zj.zero_shard(stage=3, units="Block")
    state = zero.shard(init_fn(Transformer(2, False), 16)(jax.random.key(0)))

    def step_fn(state, batch):
        def loss_fn(params):
            if "tokens" in batch:
                return state.apply_fn({"params": params}, batch["tokens"]).mean()
            squares = sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(params))
            return squares * batch["weight"].mean()

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    step = zero(step_fn)
    assert step.units is None and step.used_explicit_collectives is None  # nothing traced yet
    tokens = {"tokens": np.zeros((8, 16), np.int32)}
    state = step(state, tokens)
    assert step.units == ("block_0", "block_1") and step.used_explicit_collectives
    with pytest.warns(zj.ZeroWarning, match="does not call state.apply_fn"):
        state = step(state, {"weight": np.ones((8,), np.float32)})
    assert step.units == () and step.used_explicit_collectives is False
    state = step(state, tokens)  # compiled already: not traced again
    assert step.units == ("block_0", "block_1") and step.used_explicit_collectives


@pytest.mark.usefixtures("x64")  # exact: float64 (tests/common.py, "Parity")
@pytest.mark.parametrize("stage", [3, 2] + slow(1))
def test_a_stacks_small_leaves_are_gathered_once_per_step(stage):
    """persistence_threshold judged per layer in a scanned stack: its LayerNorms and its
    64-wide biases, split at rest, are gathered (stage 3) and reduced once per step rather
    than once per layer; the loop moves only the kernels, and training matches one device."""
    model, seq = Transformer(4, True), 16
    data = [
        np.random.default_rng(i).integers(0, 128, (16, seq + 1), dtype=np.int32) for i in range(2)
    ]
    state = jax.device_put(init_fn(model, seq)(jax.random.key(0)), jax.devices()[0])
    zero = zj.zero_shard(stage=stage, units="Block", persistence_threshold=128)
    assert zero.layout(state).params["blocks/LayerNorm_0/scale"].split_dim is not None
    got, want, zstep = train_both(zero, step, state, data)
    assert_trees_close(got.params, want.params)
    assert_trees_close(got.opt_state, want.opt_state)
    in_loop = loop_collective_sizes(zstep.lower(got, data[0]).compile().as_text())
    assert in_loop and min(in_loop) >= 128, sorted(in_loop)


@pytest.mark.parametrize(
    "options, traces",
    [
        (dict(stage=3), 2),  # once to find the units, once forward; backward reuses forward's
        (dict(stage=2), 2),
        (dict(stage=3, recompute_units=True), 3),  # backward runs the unit again
        (dict(stage=0), 1),  # no units to find
    ],
)
def test_a_units_python_runs_once_to_find_it_and_once_to_trace_it(options, traces):
    # compile time grows with how often the model's Python runs; a unit's backward is traced
    # from its forward's jaxpr, not by running the module again (unless it recomputes)
    calls = []

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            calls.append(self.name)
            return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(4 * x.shape[-1])(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = Layer(name=f"layer_{i}")(x)
            return x

    def init(key):
        params = Model().init(key, jnp.zeros((1, 32)))["params"]
        return train_state.TrainState.create(
            apply_fn=Model().apply, params=params, tx=optax.sgd(0.1)
        )

    def mse_step(state, batch):
        loss = lambda p: jnp.mean(state.apply_fn({"params": p}, batch) ** 2)  # noqa: E731
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    zero = zj.zero_shard(**options)
    state = zero.eval_shape(init, jax.random.key(0))
    calls.clear()
    zero(mse_step).lower(state, jax.ShapeDtypeStruct((16, 32), jnp.float32))
    assert sorted(calls) == sorted([f"layer_{i}" for i in range(3)] * traces), calls
