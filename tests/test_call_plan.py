"""A model call's plan from shapes alone (`zerojax.core.call_plan`): for a Linen model with a
scanned stack and an NNX model, each written here, the plan says how every leaf enters the
per-device model, which argument is the batch and which units take part, without tracing any
step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import zerojax as zj
from zerojax.core.call_plan import OTHER, UNIT, WHOLE, ApplyHookError, FoundUnits, plan_call
from zerojax.core.rules import PARAMS


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(128, name="up")(nn.LayerNorm()(x))
        return x + nn.Dense(32, name="down")(nn.gelu(h)), None


class Stacked(nn.Module):
    """Embedding, a scanned stack of three layers, batch norm and a head."""

    @nn.compact
    def __call__(self, tokens, train: bool = True):
        x = nn.Embed(64, 32)(tokens)
        scan = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan(name="layers")(x, None)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(64, name="head")(x)


def linen_state():
    model = Stacked()

    def init(key):
        variables = model.init(key, jnp.zeros((1, 8), jnp.int32))
        return train_state.TrainState.create(
            apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-3)
        ), variables["batch_stats"]

    return jax.eval_shape(init, jax.random.key(0))  # shapes only: nothing runs


# what the units' abstract trace records: each leaf below the unit and the ndim its call sees
LAYER_LEAVES = (("LayerNorm_0/bias", 1), ("LayerNorm_0/scale", 1), ("down/bias", 1))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_linen_call_is_planned_from_shapes(stage):
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    state, stats = linen_state()
    layout = zero.layout(state)
    variables = {"params": state.params, "batch_stats": stats}
    tokens, rows = jax.ShapeDtypeStruct((16, 8), jnp.int32), {16}
    units = FoundUnits({"layers": LAYER_LEAVES})
    plan = plan_call(layout, zero.placement.unit, variables, [tokens, np.zeros(3)], rows, units)

    by_path = {leaf.path: leaf for leaf in plan.leaves}
    assert plan.units == ("layers",) and plan.layers == {"layers": (3,)}
    assert plan.in_place == (stage < 3)  # stages 1-2 reduce the unit's gradient in place
    assert plan.batch_args == (True, False)  # the tokens, not the other array
    up, head = by_path["layers/up/kernel"], by_path["head/kernel"]
    assert up.role == UNIT and head.role == WHOLE and up.stored_ndim == 3
    for leaf in (up, head):  # the layout's specs, read not decided
        plan_of = layout.params[leaf.path]
        assert (leaf.store, leaf.grad, leaf.split_dim) == (
            plan_of.spec,
            plan_of.grad_spec,
            plan_of.split_dim,
        )
    stats_leaves = [leaf for leaf in plan.leaves if leaf.role == OTHER]
    assert len(stats_leaves) == 2 and all("batch_stats" in leaf.path for leaf in stats_leaves)
    assert plan.split_dims["layers/up/kernel"] == up.split_dim
    assert len(plan.where(UNIT)) + len(plan.where(WHOLE)) == len(jax.tree.leaves(state.params))


def test_the_compute_dtype_and_no_units_at_stage_0():
    zero = zj.zero_shard(stage=0, precision="bf16")
    state, stats = linen_state()
    variables = {"params": zero.eval_shape(lambda k: state, None).params}
    tokens = jax.ShapeDtypeStruct((16, 8), jnp.int32)
    plan = plan_call(zero.layout(state), zero.placement.unit, variables, [tokens], {16})
    assert plan.units == () and not plan.in_place
    assert {leaf.role for leaf in plan.leaves} == {WHOLE}
    assert {leaf.compute_dtype for leaf in plan.leaves} == {jnp.dtype(jnp.bfloat16)}
    assert all(leaf.store == P() for leaf in plan.leaves)  # stage 0 stores them whole


def test_a_call_without_the_batch_is_refused_naming_the_batch():
    zero = zj.zero_shard(stage=3)
    state, _ = linen_state()
    odd = jax.ShapeDtypeStruct((5, 8), jnp.int32)
    with pytest.raises(ApplyHookError, match=r"leading dimension \[16\]"):
        plan_call(zero.layout(state), zero.placement.unit, {"params": state.params}, [odd], {16})


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 128, rngs=rngs)
        self.down = nnx.Linear(128, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return x + self.down(self.drop(nnx.relu(self.up(x))))


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(16, 32, rngs=rngs)
        self.blocks = nnx.List([Mlp(rngs) for _ in range(2)])
        self.norm = nnx.BatchNorm(32, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def test_an_nnx_call_is_planned_from_shapes():
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer = nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))(Net(nnx.Rngs(0)))
    )
    layout = zero.layout((model, optimizer))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    variables = {PARAMS: nnx.to_pure_dict(params), "nnx_state": rest}  # as the NNX hook does
    unit = (("down/bias", 1), ("down/kernel", 2), ("up/bias", 1), ("up/kernel", 2))
    units = {"blocks/0": unit, "blocks/1": unit}
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    found = FoundUnits(units, stacks_indexable=False)
    plan = plan_call(layout, zero.placement.unit, variables, [x], {8}, found)

    roles = {leaf.path: leaf.role for leaf in plan.leaves if leaf.role != OTHER}
    assert roles["blocks/1/up/kernel"] == UNIT and roles["inp/kernel"] == WHOLE
    assert plan.layers == {"blocks/0": (), "blocks/1": ()}  # unrolled: no stacked layers
    kernel = next(leaf for leaf in plan.leaves if leaf.path == "blocks/0/up/kernel")
    assert kernel.store == layout.params["blocks/0/up/kernel"].spec != P()
    others = [leaf.path for leaf in plan.leaves if leaf.role == OTHER]
    assert any("mean" in p for p in others) and any("count" in p for p in others)


def test_a_stacks_small_leaves_enter_whole():
    # persistence_threshold judged per layer: LayerNorm's (3, 32) leaves are split at rest
    # (96 elements) but a layer's 32 are below 64, so the step gathers them once, whole,
    # instead of per layer (stage 3) and reduces their gradient once (stages 1-3); the dense
    # kernels stay the unit's
    state, _ = linen_state()
    tokens = jax.ShapeDtypeStruct((16, 8), jnp.int32)
    for stage in (1, 2, 3):
        zero = zj.zero_shard(stage=stage, persistence_threshold=64)
        layout = zero.layout(state)
        assert layout.params["layers/LayerNorm_0/scale"].split_dim is not None
        variables, found = {"params": state.params}, FoundUnits({"layers": LAYER_LEAVES})
        plan = plan_call(layout, zero.placement.unit, variables, [tokens], {16}, found)
        by_path = {leaf.path: leaf for leaf in plan.leaves}
        assert by_path["layers/LayerNorm_0/scale"].role == WHOLE
        assert by_path["layers/up/kernel"].role == UNIT
        assert plan.split_dims["layers/LayerNorm_0/scale"] is None
