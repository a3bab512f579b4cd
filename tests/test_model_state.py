"""Models that write state (BatchNorm statistics, sown activations) on the explicit path, with
default options. The documented semantics (`zerojax.comm.device_values`): each device normalises
with its own batch, as under DDP; the running statistics come back as the mean of the
devices' updates; a sown per-example value comes back whole. The reference below computes
exactly that on one device, with `jax.vmap` over the 8 device slices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zerojax as zj
from tests.common import assert_trees_close

DEVICES = 8


class CNN(nn.Module):
    """Conv -> BatchNorm -> ReLU twice, the way Flax's examples write an image classifier."""

    @nn.compact
    def __call__(self, x, train: bool):
        for features in (16, 32):  # Conv_1 (4608 weights) is split; smaller leaves stay whole
            x = nn.Conv(features, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(10)(x.mean((1, 2)))


class State(train_state.TrainState):
    batch_stats: dict


def init(key):
    variables = CNN().init(key, jnp.zeros((1, 8, 8, 3)), train=False)
    return State.create(
        apply_fn=CNN().apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.sgd(0.1, momentum=0.9),
    )


def step(state, batch, apply=None):
    """Flax's BatchNorm recipe: `mutable=['batch_stats']`, the new statistics into the state."""
    apply = apply or state.apply_fn
    x, y = batch

    def loss_fn(params):
        variables = {"params": params, "batch_stats": state.batch_stats}
        logits, updates = apply(variables, x, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return new, loss


def reference_step(state, batch):
    """The semantics on one device: the model on each device's slice (`vmap`), the loss and
    gradient their mean, the new statistics the mean of each slice's update."""
    x, y = batch
    slices = lambda a: a.reshape(DEVICES, -1, *a.shape[1:])

    def loss_fn(params):
        def one(x, y):
            variables = {"params": params, "batch_stats": state.batch_stats}
            logits, updates = state.apply_fn(variables, x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

        losses, updates = jax.vmap(one)(slices(x), slices(y))
        return losses.mean(), jax.tree_util.tree_map(lambda u: u.mean(0), updates)

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return new, loss


def images(steps):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 8, 8, 3)).astype(np.float32), rng.integers(0, 10, 16))
        for _ in range(steps)
    ]


@pytest.mark.parametrize("stage", [2, 3])
def test_batch_norm_cnn_trains_with_default_options(stage):
    data = images(10)
    want = jax.device_put(init(jax.random.key(0)), jax.devices()[0])
    ref = jax.jit(reference_step)
    want_losses = []
    for batch in data:
        want, loss = ref(want, batch)
        want_losses.append(float(loss))
    zero = zj.zero_shard(stage=stage)
    got, zstep, losses = zero.init(init, jax.random.key(0)), zero(step), []
    for batch in data:
        got, loss = zstep(got, batch)
        losses.append(float(loss))
    assert zstep.used_explicit_collectives
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got.batch_stats, want.batch_stats, rtol=1e-5, atol=0)
    assert_trees_close(got.params, want.params)
    hlo = zstep.lower(got, data[0]).compile().as_text()
    assert "reduce-scatter" in hlo  # the gradients, not all-reduced whole


def test_a_closure_called_model_writes_its_statistics_the_same_way():
    data = images(3)
    zero = zj.zero_shard(stage=2)
    by_state, by_closure = zero.init(init, jax.random.key(0)), zero.init(init, jax.random.key(0))
    closure = zero(lambda state, batch: step(state, batch, apply=CNN().apply))
    state_step = zero(step)
    for batch in data:
        by_state, _ = state_step(by_state, batch)
        by_closure, _ = closure(by_closure, batch)
    assert closure.used_explicit_collectives
    assert_trees_close(by_closure.batch_stats, by_state.batch_stats, rtol=1e-6, atol=0)


def test_local_accumulation_combines_the_statistics_too():
    """The step runs per device (DDP's no_sync); the first micro-batch's statistics come from
    the initial parameters in both, so they compare exactly."""
    batch = images(1)[0]
    zero = zj.zero_shard(stage=2, gradient_accumulation_steps=2, accumulate="local")
    got, _ = zero(step)(zero.init(init, jax.random.key(0)), batch)
    start = jax.device_put(init(jax.random.key(0)), jax.devices()[0])
    want, _ = jax.jit(reference_step)(start, batch)
    assert_trees_close(got.batch_stats, want.batch_stats, rtol=1e-5, atol=0)


class Sowing(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(16)(x))
        self.sow("intermediates", "hidden", h)
        self.sow("intermediates", "norm", jnp.sum(h**2))  # not per-example: averaged
        return nn.Dense(1)(h)[:, 0]


def test_sown_activations_come_back_for_the_whole_batch():
    model = Sowing()
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    want, sown = model.apply({"params": params}, x, mutable=["intermediates"])
    zero = zj.zero_shard(stage=3)
    state = zero.shard(
        train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0))
    )

    def probe(state, x):
        out, sown = state.apply_fn({"params": state.params}, x, mutable=["intermediates"])
        return state, (out, sown["intermediates"])

    zstep = zero(probe)
    state, (out, got) = zstep(state, x)
    assert zstep.used_explicit_collectives
    np.testing.assert_allclose(out, want, rtol=1e-5)
    np.testing.assert_allclose(got["hidden"][0], sown["intermediates"]["hidden"][0], rtol=1e-5)
    per_device = [float(np.sum(np.asarray(h) ** 2)) for h in np.split(got["hidden"][0], 8)]
    np.testing.assert_allclose(got["norm"][0], np.mean(per_device), rtol=1e-5)

    def capture(state, x):  # Flax's capture_intermediates: every module's output, sown
        return state, state.apply_fn({"params": state.params}, x, capture_intermediates=True)

    _, (_, captured) = zero(capture)(state, x)
    want = model.apply({"params": params}, x, capture_intermediates=True)[1]
    dense = lambda tree: tree["intermediates"]["Dense_0"]["__call__"][0]
    np.testing.assert_allclose(dense(captured), dense(want), rtol=1e-5)


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.bn, self.linear = (
            nnx.BatchNorm(4, momentum=0.9, rngs=rngs),
            nnx.Linear(4, 1, rngs=rngs),
        )

    def __call__(self, x):
        return self.linear(self.bn(x))[:, 0]


@pytest.mark.parametrize("stage", [2, 3])
def test_nnx_batch_norm_statistics_are_the_mean_of_the_devices(stage):
    x = np.random.default_rng(0).normal(2.0, 3.0, size=(16, 4)).astype(np.float32)

    def build():
        model = NNXNet(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    zero = zj.zero_shard(stage=stage)
    model, optimizer = zero.init(build)
    zstep = zero(train_step)
    zstep(model, optimizer, x)
    assert zstep.used_explicit_collectives
    # BatchNorm's first layer sees x itself: its update is exact arithmetic on the slices
    slices = x.reshape(DEVICES, -1, 4)
    mean = 0.1 * slices.mean(1).mean(0)  # 0.9 * 0 + 0.1 * each device's batch mean, averaged
    var = 0.9 * 1.0 + 0.1 * slices.var(1).mean(0)
    np.testing.assert_allclose(model.bn.mean[...], mean, rtol=1e-5)
    np.testing.assert_allclose(model.bn.var[...], var, rtol=1e-5)
