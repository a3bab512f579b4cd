"""Flax NNX models and optimizers, and plain-pytree states, under every stage: the same numbers
as plain single-device training (float32), with the state really sharded."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from common import assert_trees_close, batches, make_init, placed_as, train_single_device
from flax import nnx, struct
from jax.sharding import PartitionSpec as P
from nnx_model import make_objects, nnx_train_step, train_single_device_nnx

import zerojax as zj

DATA = batches(6)
ADAMW = lambda: optax.adamw(1e-3, eps=1e-5, weight_decay=0.01)
REF = {}


def reference():
    if not REF:
        REF["nnx"] = train_single_device_nnx(ADAMW(), DATA)
    return REF["nnx"]


def arrays(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nnx_stage_matches_single_device(stage):
    ref_model, ref_opt, ref_losses = reference()
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    model, optimizer = zero.init(lambda: make_objects(ADAMW()))
    step = zero(nnx_train_step)
    losses = [float(step(model, optimizer, batch)["loss"]) for batch in DATA]
    assert step.used_explicit_collectives  # the per-device hook ran the model
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert_trees_close(arrays(nnx.state(model, nnx.Param)), arrays(nnx.state(ref_model, nnx.Param)))
    assert_trees_close(arrays(nnx.state(optimizer)), arrays(nnx.state(ref_opt)))
    kernel = model.blocks[0].up.kernel[...]  # (64, 256)
    assert placed_as(kernel, *(("data",) if stage == 3 else ()))
    mu = optimizer.opt_state[0].mu["blocks"][0]["up"]["kernel"][...]
    assert placed_as(mu, *(("data",) if stage >= 1 else ()))
    assert int(optimizer.step[...]) == len(DATA)


def test_nnx_sharding_metadata_composes_with_zero_on_a_2d_mesh():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(
                32, 128, rngs=rngs, kernel_init=nnx.with_partitioning(init, (None, "mlp"))
            )
            self.down = nnx.Linear(
                128, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", None))
            )

        def __call__(self, x):
            return self.down(nnx.relu(self.up(x)))

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    zero = zj.zero_shard(
        stage=3, mesh=mesh, persistence_threshold=0, logical_rules=(("mlp", "model"),)
    )

    def make():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    model, optimizer = zero.init(make)
    assert model.up.kernel[...].sharding.spec == P("data", "model")  # (32, 128)
    assert model.down.kernel[...].sharding.spec == P("model", "data")  # (128, 32)

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: ((m(batch["x"]) - batch["y"]) ** 2).mean())(
            model
        )
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(8, 32)).astype(np.float32),
        "y": rng.normal(size=(8, 32)).astype(np.float32),
    }
    with nnx.use_eager_sharding(False), jax.default_device(jax.devices()[0]):
        ref_model, ref_opt = make()
        ref = [float(nnx.jit(step)(ref_model, ref_opt, batch)) for _ in range(3)]
    got = [float(zero(step)(model, optimizer, batch)) for _ in range(3)]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_nnx_objects_built_elsewhere_are_placed_by_shard_or_refused():
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer = make_objects(ADAMW())
    step = zero(nnx_train_step)
    with pytest.raises(zj.ZeroError, match="not placed as this zero_shard expects"):
        step(model, optimizer, DATA[0])
    model, optimizer = zero.shard((model, optimizer))
    assert placed_as(model.blocks[0].up.kernel[...], "data")
    assert np.isfinite(float(step(model, optimizer, DATA[0])["loss"]))
    zero.describe((model, optimizer), tolerance=0.01, show=False)


def metrics_step(model, optimizer, metrics, batch):
    """Flax's NNX examples' step: the metrics object updated in the step."""

    def loss_fn(model):
        logits = model(batch["inputs"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return loss, logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    metrics.update(loss=loss, logits=logits, labels=batch["targets"])
    optimizer.update(model, grads)


def test_nnx_metrics_made_outside_zero_init_are_placed_as_nnx_jit_takes_them():
    """A metrics object made beside the model, as Flax's NNX examples make theirs (not through
    `zero.init`): zero places its replicated leaves, as `nnx.jit` takes it; its values after 2
    steps are `nnx.jit`'s (it was refused with 'not placed as this zero_shard expects')."""
    new_metrics = lambda: nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )
    want = new_metrics()
    model, optimizer = make_objects(ADAMW())
    jitted = nnx.jit(metrics_step)
    for batch in DATA[:2]:
        jitted(model, optimizer, want, batch)
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer = zero.init(lambda: make_objects(ADAMW()))
    got, step = new_metrics(), zero(metrics_step)
    for batch in DATA[:2]:
        step(model, optimizer, got, batch)
    got, want = got.compute(), want.compute()
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], atol=1e-6)


# ---- plain pytrees ----------------------------------------------------------------------------
TX = optax.sgd(0.05, momentum=0.9)


def plain_init(key):
    state = make_init(TX)(key)
    return state.params, TX.init(state.params)


def plain_step(state, batch):
    """A step on a `(params, opt_state)` pair, no TrainState."""
    from common import MODEL

    params, opt_state = state

    def loss_fn(params):
        logits = MODEL.apply({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}


@struct.dataclass
class MyState:
    params: dict
    opt_state: optax.OptState
    steps: int


def dataclass_step(state, batch):
    (params, opt_state), metrics = plain_step((state.params, state.opt_state), batch)
    return dataclasses.replace(
        state, params=params, opt_state=opt_state, steps=state.steps + 1
    ), metrics


@pytest.mark.filterwarnings("ignore:zerojax. .* does not call state.apply_fn")
@pytest.mark.parametrize("kind,stage", [("tuple", 3), ("dataclass", 1)])
def test_plain_pytree_states_match_single_device(kind, stage):
    ref_state, ref_losses = train_single_device(TX, DATA)
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    if kind == "tuple":
        state, step = zero.init(plain_init, jax.random.key(0)), zero(plain_step)
    else:
        state = zero.init(lambda k: MyState(*plain_init(k), steps=0), jax.random.key(0))
        step = zero(dataclass_step)
    losses = []
    for batch in DATA:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    params = state[0] if kind == "tuple" else state.params
    assert_trees_close(params, ref_state.params)
    kernel = params["block_0"]["Dense_0"]["kernel"]
    assert placed_as(kernel, *(("data",) if stage == 3 else ()))


def test_nnx_checkpoint_restores_into_another_layout(tmp_path):
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer = zero.init(lambda: make_objects(ADAMW()))
    step = zero(nnx_train_step)
    for batch in DATA[:2]:
        step(model, optimizer, batch)
    with zj.CheckpointManager(tmp_path / "ckpt", zero, async_save=False) as mgr:
        mgr.save(2, (model, optimizer))
    other = zj.zero_shard(stage=1, mesh=zj.make_mesh(jax.devices()[:2]))
    with zj.CheckpointManager(tmp_path / "ckpt", other) as mgr:
        (model2, optimizer2), _ = mgr.restore(nnx.eval_shape(lambda: make_objects(ADAMW())))
    assert model2.blocks[0].up.kernel[...].sharding.spec == P()  # stage 1: whole
    assert placed_as(optimizer2.opt_state[0].mu["blocks"][0]["up"]["kernel"][...], "data")
    for got, want in zip(
        arrays(nnx.state((model2, optimizer2))), arrays(nnx.state((model, optimizer))), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    loss = step(model, optimizer, DATA[2])["loss"]
    np.testing.assert_allclose(
        other(nnx_train_step)(model2, optimizer2, DATA[2])["loss"], loss, rtol=1e-5
    )


@pytest.mark.filterwarnings("ignore:zerojax. .* does not call state.apply_fn")
def test_tuple_state_checkpoint_roundtrip(tmp_path):
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    state = zero.init(plain_init, jax.random.key(0))
    state, _ = zero(plain_step)(state, DATA[0])
    with zj.CheckpointManager(tmp_path / "ckpt", zero, async_save=False) as mgr:
        mgr.save(1, state)
        restored, _ = mgr.restore(jax.eval_shape(plain_init, jax.random.key(0)))
    for got, want in zip(arrays(restored), arrays(state), strict=True):
        np.testing.assert_array_equal(got, want)
    from zerojax.io.export import info

    assert any(leaf["path"].startswith("params/") for leaf in info(tmp_path / "ckpt")["leaves"])


def test_nnx_report_counts_the_sharded_state():
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    model, optimizer = zero.init(lambda: make_objects(ADAMW()))
    report = zero.report(zero(nnx_train_step), model, optimizer, DATA[0])
    total = sum(x.size * 4 for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
    # every parameter is split 8 ways but the head's (203,) bias, which no 8 divides
    assert report.resident["params"] == (total - 203 * 4) // 8 + 203 * 4
