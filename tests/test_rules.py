"""Sharding rules: a table of expected specs, a scanned stack where Flax or the step says it is
(never where shapes suggest), and optimizer state following its parameter for any optax
transformation (matched by path and shape, never by optimizer type)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import assert_trees_close, batches, make_init, slow, train_single_device, train_zero
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.core.rules import split_spec

D = "data"


@pytest.mark.parametrize(
    "shape,n,threshold,spec,why",
    [
        ((64, 256), 8, 0, P(D, None), "first divisible dim: shards lie end to end"),
        ((256, 64), 8, 0, P(D, None), "first divisible dim"),
        ((64, 64), 8, 0, P(D, None), "square: first dim"),
        ((203, 64), 8, 0, P(None, D), "vocab 203 does not divide: the other dim"),
        ((203,), 8, 0, P(), "nothing divides: replicated"),
        ((203, 7), 8, 0, P(), "nothing divides: replicated"),
        ((64,), 8, 1024, P(), "below the persistence threshold"),
        ((1024,), 8, 1024, P(D), "at the threshold: sharded"),
        ((), 8, 0, P(), "scalar"),
        ((64, 256), 1, 0, P(), "one device"),
        ((4, 6, 10), 2, 0, P(D, None, None), "3-D"),
        ((3, 6, 10), 2, 0, P(None, D, None), "3-D, dim 0 does not divide"),
    ],
)
def test_default_rule_table(shape, n, threshold, spec, why):
    cfg = zj.ZeroConfig(stage=3, persistence_threshold=threshold)
    assert split_spec(shape, n, cfg)[0] == spec, why


def test_a_stack_is_split_past_its_layers_and_a_layer_on_its_first_dim():
    # each layer's shard is then a block of rows: a gather lays them end to end (no transpose)
    cfg = zj.ZeroConfig(stage=3, persistence_threshold=0)
    assert split_spec((8, 64, 256), 8, cfg, stacked=True) == (
        P(None, D, None),
        "sharded dim 1 (dim 0: a stack's layers)",
    )
    assert split_spec((8, 3, 5), 8, cfg, stacked=True)[0] == P(D, None, None)  # only dim 0
    assert split_spec((8, 64, 256), 8, cfg)[0] == P(D, None, None)


def test_user_rules_by_path_regex():
    cfg = zj.ZeroConfig(
        stage=3, persistence_threshold=0, rules=((r"Embed_0/embedding", None), (r"head/kernel$", 0))
    )
    assert split_spec((203, 64), 8, cfg, "Embed_0/embedding")[0] == P()
    assert split_spec((64, 208), 8, cfg, "head/kernel")[0] == P(D, None)
    with pytest.raises(zj.ZeroError, match="head/kernel.*does not divide"):
        split_spec((63, 208), 8, cfg, "head/kernel")


def _abstract_state(tx):
    return jax.eval_shape(make_init(tx), jax.random.key(0))


# Adam eps=1e-5 for the reason given in tests/common.py, "Parity".
OPTIMIZERS = {
    "adamw": optax.adamw(1e-3, eps=1e-5),
    "sgd_momentum": optax.sgd(0.1, momentum=0.9),
    "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=32),
    "chain_clip_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-5)),
    "masked": optax.masked(
        optax.adam(1e-3, eps=1e-5), lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)
    ),
    "multi_transform": optax.multi_transform(
        {"a": optax.adam(1e-3, eps=1e-5), "s": optax.sgd(0.1, momentum=0.9)},
        lambda p: jax.tree_util.tree_map_with_path(
            lambda path, x: "a" if "block" in jax.tree_util.keystr(path) else "s", p
        ),
    ),
    "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, eps=1e-5),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_follows_its_parameter(name):
    zero = zj.zero_shard(stage=1, persistence_threshold=0)
    abstract = _abstract_state(OPTIMIZERS[name])
    stage3 = [
        p
        for p in zj.zero_shard(stage=3, persistence_threshold=0).plan(abstract)
        if p.category == "params"
    ]
    param_spec = {p.path[len("params/") :]: p.spec for p in stage3}
    params_shape = {p.path[len("params/") :]: p.shape for p in stage3}
    followed = 0
    for plan in zero.plan(abstract):
        if plan.category != "opt_state":
            continue
        owner = [k for k in param_spec if plan.path.endswith("/" + k)]
        if owner and plan.shape == params_shape[owner[0]]:
            assert plan.spec == param_spec[owner[0]], plan  # a moment: its parameter's spec
            followed += 1
        elif plan.shape == ():
            assert plan.spec == P(), plan  # counts, hyperparameters
        else:  # factored moments: own shape
            assert plan.spec == split_spec(plan.shape, 8, zero.config)[0], plan
    assert followed > 0 or name == "adafactor"


@pytest.mark.parametrize(
    "name",
    ["adafactor", "masked", "multi_transform", *slow("chain_clip_adam", "inject_hyperparams")],
)
def test_any_optimizer_trains_like_one_device_at_stage_3(name):
    data = batches(3)
    ref_state, ref_losses = train_single_device(OPTIMIZERS[name], data)
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    state, losses = train_zero(zero, OPTIMIZERS[name], data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(state.params, ref_state.params)


def test_stage_placement_by_category():
    abstract = _abstract_state(optax.adam(1e-3, eps=1e-5))
    for stage, params_sharded, opt_sharded in [
        (0, False, False),
        (1, False, True),
        (2, False, True),
        (3, True, True),
    ]:
        plans = zj.zero_shard(stage=stage, persistence_threshold=0).plan(abstract)
        kernel = [p for p in plans if p.path == "params/block_0/Dense_0/kernel"][0]
        mu = [p for p in plans if p.path.endswith("mu/block_0/Dense_0/kernel")][0]
        assert (kernel.spec != P()) == params_sharded, stage
        assert (mu.spec != P()) == opt_sharded, stage
        step = [p for p in plans if p.path == "step"][0]
        assert step.spec == P() and step.category == "other"


def test_a_rule_that_matches_no_leaf_is_named():
    zero = zj.zero_shard(stage=3, rules=((r"Dense_9/kernel", 0), (r"head/kernel$", None)))
    with pytest.warns(zj.ZeroWarning) as said:
        zero.eval_shape(make_init(optax.adam(1e-3)), jax.random.key(0))
    assert len(said) == 1, [str(w.message) for w in said]
    assert "rule 'Dense_9/kernel' matches no leaf" in str(said[0].message)


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(64, use_bias=False)(nn.tanh(x)), None


class _SingleKernelStack(nn.Module):
    """8 scanned layers of one bias-free kernel each, (8, 64, 64): nothing in its shapes says
    that dim 0 counts layers, so the first-dim rule splits it there."""

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(
            _Residual, variable_axes={"params": 0}, split_rngs={"params": True}, length=8
        )
        return blocks()(x, None)[0].sum(-1)


def _stack_init(key):
    model = _SingleKernelStack()
    params = model.init(key, jnp.zeros((1, 64)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def _stack_step(state, x):
    loss = lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2)  # noqa: E731
    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value


STACKED = "Scan_Residual_0/Dense_0/kernel"


def _stack_run(zero, state):
    data = [jax.random.normal(jax.random.key(i), (16, 64)) for i in range(3)]
    want = _stack_init(jax.random.key(0))
    for x in data:
        want, _ = jax.jit(_stack_step)(want, x)
    step = zero(_stack_step)
    for x in data:
        state, _ = step(state, x)
    assert_trees_close(state.params, want.params)
    return state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_state_placed_before_anything_says_where_its_stacks_are_moves_once_at_the_first_step(
    stage,
):
    """Placed by `zero.shard` (built elsewhere: Flax said nothing), the layout is provisional,
    with no stacks: the first step's calls reveal the `nn.scan` stack, the layout is decided
    from them (split past the layers) and the state moves there once; no shape is read."""
    zero = zj.zero_shard(stage=stage)
    state = zero.shard(_stack_init(jax.random.key(0)))
    assert zero.layout(state).stacks is None
    assert "layout: provisional" in str(zero.describe(state, show=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", zj.ZeroWarning)  # no "split along its layers"
        state = _stack_run(zero, state)
    assert zero.layout(state).stacks == {STACKED}
    assert not zero.describe(state, show=False).provisional
    wanted = P(None, "data") if stage == 3 else P()
    assert state.params["Scan_Residual_0"]["Dense_0"]["kernel"].sharding.spec == wanted


def test_a_rule_that_splits_a_stack_on_its_layers_is_gathered_whole_and_says_so():
    zero = zj.zero_shard(stage=3, rules=((STACKED, 0),))
    with pytest.warns(zj.ZeroWarning, match="split along its stack's layer dimension 0"):
        _stack_run(zero, zero.init(_stack_init, jax.random.key(0)))


class _Attention(nn.Module):
    """An unrolled grouped-query attention's bias-free kernels (as Llama's), d = 32, 4 query
    heads and 2 key/value heads of 8: every kernel's leading size is d and some lack d
    elsewhere, which the shapes read as a stack of 32 layers."""

    @nn.compact
    def __call__(self, x):
        dense = lambda width, name: nn.Dense(width, use_bias=False, name=name)  # noqa: E731
        q, k, v = dense(32, "q")(x), dense(16, "k")(x), dense(16, "v")(x)
        return dense(32, "o")(q * jnp.tile(k * v, 2))


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = _Attention(name="attn")(x)
        return _SingleKernelStack(name="stack")(jnp.concatenate([x, x], -1))


def test_a_stack_is_what_flax_stacks_never_what_shapes_suggest():
    """The layout reads the stacks from Flax: through `zero.init` and `zero.eval_shape`, the
    dims an `nn.scan` body sees while `init` runs (`zerojax.flax.stacks`); for a state placed
    by `zero.shard`, the dims the first step's calls see. An unrolled GQA attention, whose
    kernels all lead with d = 32 (a "stack of 32 layers" by shapes), is no stack."""
    model = _Model()

    def init(key):
        params = model.init(key, jnp.zeros((1, 32)))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def step(state, x):
        loss = lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2)  # noqa: E731
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    key, x = jax.random.key(0), jnp.ones((16, 32))
    ways = {
        "zero.init": lambda zero: zero.init(init, key),
        "zero.eval_shape": lambda zero: zero.eval_shape(init, key),
        "zero.shard, then a step": lambda zero: zero(step)(zero.shard(init(key)), x),
    }
    for way, make in ways.items():
        zero = zj.zero_shard(stage=3, persistence_threshold=0)
        plans = zero.layout(make(zero)).plans
        reasons = {plan.path: plan.reason for plan in plans}
        assert "a stack's layers" not in reasons["params/attn/k/kernel"], (way, reasons)
        assert reasons["params/attn/k/kernel"].startswith("sharded dim 0"), (way, reasons)
        stack = reasons["params/stack/Scan_Residual_0/Dense_0/kernel"]
        assert stack == "sharded dim 1 (dim 0: a stack's layers)", (way, stack)
