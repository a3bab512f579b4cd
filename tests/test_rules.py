"""Sharding rules: a table of expected specs, and optimizer state following its parameter for
any optax transformation (matched by path and shape, never by optimizer type)."""

import jax
import numpy as np
import optax
import pytest
from common import assert_trees_close, batches, make_init, slow, train_single_device, train_zero
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.core.rules import split_spec

D = "data"


@pytest.mark.parametrize(
    "shape,n,threshold,spec,why",
    [
        ((64, 256), 8, 0, P(None, D), "largest divisible dim"),
        ((256, 64), 8, 0, P(D, None), "largest divisible dim"),
        ((64, 64), 8, 0, P(D, None), "tie: first dim"),
        ((203, 64), 8, 0, P(None, D), "vocab 203 does not divide: the other dim"),
        ((203,), 8, 0, P(), "nothing divides: replicated"),
        ((203, 7), 8, 0, P(), "nothing divides: replicated"),
        ((64,), 8, 1024, P(), "below the persistence threshold"),
        ((1024,), 8, 1024, P(D), "at the threshold: sharded"),
        ((), 8, 0, P(), "scalar"),
        ((64, 256), 1, 0, P(), "one device"),
        ((4, 6, 10), 2, 0, P(None, None, D), "3-D"),
    ],
)
def test_default_rule_table(shape, n, threshold, spec, why):
    cfg = zj.ZeroConfig(stage=3, persistence_threshold=threshold)
    assert split_spec(shape, D, n, cfg)[0] == spec, why


def test_user_rules_by_path_regex():
    cfg = zj.ZeroConfig(
        stage=3, persistence_threshold=0, rules=((r"Embed_0/embedding", None), (r"head/kernel$", 0))
    )
    assert split_spec((203, 64), D, 8, cfg, "Embed_0/embedding")[0] == P()
    assert split_spec((64, 208), D, 8, cfg, "head/kernel")[0] == P(D, None)
    with pytest.raises(zj.ZeroError, match="head/kernel.*does not divide"):
        split_spec((63, 208), D, 8, cfg, "head/kernel")


def _abstract_state(tx):
    return jax.eval_shape(make_init(tx), jax.random.key(0))


# Adam eps=1e-5 for the reason given in test_parity.py.
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
            assert plan.spec == split_spec(plan.shape, D, 8, zero.config)[0], plan
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
