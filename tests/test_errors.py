"""A new user's mistakes fail at once, with a `ZeroError` that says what to change (or, where
zerojax can make them work, work); the ones it cannot fail on warn once, naming the cause."""

import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import MODEL, batches, initial_state, make_init, subprocess_env, train_step
from flax import nnx

import zerojax as zj


@pytest.fixture(scope="module")
def zero_and_state():
    zero = zj.zero_shard(stage=3)
    return zero, zero.shard(initial_state(optax.adam(1e-3)))


class Net(nnx.Module):  # an NNX model as a user writes one
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def nnx_objects():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def nnx_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: ((m(batch["x"]) - batch["y"]) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


NNX_BATCH = {"x": np.ones((8, 16), np.float32), "y": np.zeros((8, 16), np.float32)}


def _mistakes():
    """(name, mistake(zero, fresh_state, step), what the ZeroError must say, or None: it
    works). Each mistake is one a new user makes in the first hour with a sharded step."""
    batch = batches(1)[0]
    mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    init = make_init(optax.adam(1e-3))

    def donated(zero, fresh, step):
        state = fresh()
        step(state, batch)
        return step(state, batch)  # the old state again: its buffers were donated

    def grad_through(zero, fresh, step):
        state = fresh()
        return jax.grad(lambda p: step(state.replace(params=p), batch)[1]["loss"])(state.params)

    return [
        (
            "a TrainState.create state",
            lambda z, f, s: s(initial_state(optax.adam(1e-3)), batch),
            r"state leaf \.step is a int.*zero\.init\(init_fn, key\)",
        ),
        (
            "the step inside jax.jit",
            lambda z, f, s: jax.jit(s)(f(), batch),
            "inside another JAX transformation.*Call it directly",
        ),
        (
            "the step inside jax.vmap",
            lambda z, f, s: jax.vmap(lambda b: s(f(), b))({k: v[None] for k, v in batch.items()}),
            "inside another JAX transformation.*Call it directly",
        ),
        ("the step inside jax.grad", grad_through, "Call it directly"),
        (
            "an abstract state",
            lambda z, f, s: s(z.eval_shape(init, jax.random.key(0)), batch),
            r"abstract.*zero\.init\(init_fn, key\).*step\.lower\(state, batch\)",
        ),
        (
            "a donated state used again",
            donated,
            r"donated to an earlier call.*state, metrics = step\(state, batch\)",
        ),
        (
            "state and batch swapped",
            lambda z, f, s: s(batch, f()),
            r"first argument is a dict with keys \['inputs', 'targets'\].*step\(state, batch",
        ),
        ("no batch", lambda z, f, s: s(f()), r"called as step\(state, batch, \*extra\)"),
        (
            "a batch that does not divide",
            lambda z, f, s: s(f(), batches(1, batch_size=12)[0]),
            r"inputs has 12 rows.*multiple of 8",
        ),
        (
            "batch leaves of different rows",
            lambda z, f, s: s(f(), {"inputs": batch["inputs"], "targets": batch["targets"][:8]}),
            "the same number of rows",
        ),
        (
            "a batch already on one device",
            lambda z, f, s: s(f(), jax.device_put(batch, jax.devices()[0])),
            None,
        ),
        (
            "a batch placed on another mesh",
            lambda z, f, s: s(f(), zj.zero_shard(stage=3, mesh=mesh4).place_batch(batch)),
            None,
        ),
        (
            "a state placed by a zero on another mesh",
            lambda z, f, s: s(zj.zero_shard(stage=3, mesh=mesh4).shard(f()), batch),
            r"mesh \{'data': 4\}.*another zero_shard.*zero\.shard\(state\)",
        ),
        (
            "a state placed by a zero of another stage",
            lambda z, f, s: s(zj.zero_shard(stage=1).shard(initial_state(optax.adam(1e-3))), batch),
            r"not placed as this zero_shard expects.*zero\.shard\(state\)",
        ),
        (
            "a state not placed at all",
            lambda z, f, s: s(
                jax.device_put(initial_state(optax.adam(1e-3)), jax.devices()[0]), batch
            ),
            r"zero\.shard\(state\)",
        ),
        (
            "a bf16 state given to an fp32 zero",
            lambda z, f, s: s(zj.zero_shard(stage=3, precision="bf16").shard(f()), batch),
            "manages the update.*Decorate the step with the zero that made the state",
        ),
        (
            "a step that returns only metrics",
            lambda z, f, s: z(lambda st, b: {"loss": 0.0})(f(), batch),
            "must return the new state",
        ),
        (
            "a TrainState step given NNX objects",
            lambda z, f, s: s(*z.shard(nnx_objects()), NNX_BATCH),
            r"train_step\(state, batch\) cannot take this call's 3 arguments.*an NNX step",
        ),
        (
            "an NNX step given a TrainState",
            lambda z, f, s: z(nnx_step)(f(), batch),
            r"nnx_step\(model, optimizer, batch\) cannot take .*TrainState, dict",
        ),
        (
            "a TrainState step given an NNX model",
            lambda z, f, s: s(z.shard(nnx_objects())[0], NNX_BATCH),
            r"reads `\.params` of an NNX Net.*step\(model, optimizer, batch\)",
        ),
        (
            "zero.init given a state",
            lambda z, f, s: z.init(initial_state(optax.adam(1e-3))),
            r"not a TrainState: to place an existing state use zero\.shard\(state\)",
        ),
        (
            "zero.init without the key",
            lambda z, f, s: z.init(init),
            r"missing a required argument: 'key'.*zero\.init\(init_fn, jax\.random\.key\(0\)\)",
        ),
        (
            "a misspelled option",
            lambda z, f, s: zj.zero_shard(stag=3),
            r"unknown zerojax option 'stag' \(did you mean 'stage'\?\)",
        ),
        (
            "a DeepSpeed key in the wrong section",
            lambda z, f, s: zj.zero_shard(
                config={"zero_optimization": {"stage": 3, "pipeline": 1}}
            ),
            r"zero_optimization\.pipeline' \(it belongs in zero_optimization\.offload_optimizer",
        ),
        (
            "a misspelled nested DeepSpeed key",
            lambda z, f, s: zj.zero_shard(
                config={"zero_optimization": {"offload_optimizer": {"devic": "cpu"}}}
            ),
            r"offload_optimizer\.devic' \(did you mean 'device'\?\).*strict=False",
        ),
        (
            "a config file that does not exist",
            lambda z, f, s: zj.zero_shard(config="ds_confg.json"),
            r"does not exist and is not a zerojax preset; presets: accelerate_zero2",
        ),
        (
            "stage as a string",
            lambda z, f, s: zj.zero_shard(stage="3"),
            "stage must be 0, 1, 2 or 3",
        ),
    ]


MISTAKES = _mistakes()


@pytest.mark.parametrize("mistake,fix", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_a_new_users_mistake_says_what_to_do(zero_and_state, mistake, fix):
    zero, _ = zero_and_state
    fresh = lambda: zero.shard(initial_state(optax.adam(1e-3)))
    step = zero(train_step)
    if fix is None:  # zerojax makes it work
        new_state, metrics = mistake(zero, fresh, step)
        assert np.isfinite(float(metrics["loss"]))
        return
    with pytest.raises(zj.ZeroError, match=fix):  # not AttributeError, TypeError, a tracer error
        mistake(zero, fresh, step)


def test_strict_false_on_zero_shard_proceeds_with_a_warning():
    config = {"zero_optimization": {"stage": 2, "pipeline": 1}}
    with pytest.warns(zj.ZeroWarning, match="WITHOUT these keys.*zero_optimization.pipeline"):
        zero = zj.zero_shard(config=config, strict=False)
    assert zero.config.stage == 2


def test_state_without_params():
    zero = zj.zero_shard(stage=2)
    with pytest.raises(zj.ZeroError, match="no `params`"):
        zero.init(lambda key: {"weights": jnp.zeros((8, 8)), "opt_state": ()}, jax.random.key(0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage": 5}, "stage must be 0, 1, 2 or 3"),
        ({"stag": 3}, "unknown zerojax option 'stag' \\(did you mean 'stage'\\?\\)"),
        ({"persistence_threshold": -1}, "persistence_threshold must be"),
        ({"rules": [("(", 0)]}, "does not compile"),
        ({"axis": "model", "mesh": "default"}, "mesh has axes \\('data',\\)"),
    ],
)
def test_bad_options(kwargs, match):
    if kwargs.get("mesh") == "default":
        kwargs = {**kwargs, "mesh": zj.make_mesh()}
    with pytest.raises(zj.ZeroError, match=match):
        zj.zero_shard(**kwargs)


class MeanOfModel(nn.Module):
    """A model whose own output is a scalar: the mean over the batch of the common GPT's."""

    @nn.compact
    def __call__(self, tokens):
        return MODEL.clone(parent=self, name="gpt")(tokens).mean()


def test_model_output_that_is_not_per_example(zero_and_state):
    zero, state = zero_and_state

    def step(state, batch):
        def loss_fn(params):  # reduces inside apply_fn: the output is a scalar
            return state.apply_fn({"params": params}, batch["inputs"]).mean()

        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    # a lambda reducing around the model is fine: the model's own call is caught, per example
    wrapped_apply = state.apply_fn
    around = state.replace(apply_fn=lambda v, x: wrapped_apply(v, x).mean())
    assert zj.zero_shard(stage=3)(step)(zero.shard(around), batches(1)[0]) is not None
    # a model whose own output is not per example cannot run per device
    inside = state.replace(apply_fn=MeanOfModel().apply, params={"gpt": state.params})
    with pytest.raises(zj.ZeroError, match="explicit_collectives=False"):
        zj.zero_shard(stage=3)(step)(zero.shard(inside), batches(1)[0])


def test_a_good_state_is_left_usable_after_a_failed_call(zero_and_state):
    zero, state = zero_and_state
    with pytest.raises(zj.ZeroError):
        zero(train_step)(state, batches(1, batch_size=12)[0])
    new_state, metrics = zero(train_step)(state, batches(1)[0])  # nothing was donated
    assert np.isfinite(float(metrics["loss"]))


def test_managed_update_needs_a_managed_state():
    zero = zj.zero_shard(stage=2, precision="bf16")
    plain = zj.zero_shard(stage=2).shard(initial_state(optax.adam(1e-3)))
    with pytest.raises(zj.ZeroError, match="zero.init\\(...\\) or zero.shard\\(...\\)"):
        zero(train_step)(plain, batches(1)[0])
    managed = zero.shard(plain)  # shard() adds master weights and buffers
    state, metrics = zero(train_step)(managed, batches(1)[0])
    assert np.isfinite(float(metrics["loss"])) and "loss_scale" in metrics


def test_apply_gradients_twice_in_a_managed_step():
    zero = zj.zero_shard(stage=1, gradient_clipping=1.0)
    state = zero.shard(initial_state(optax.adam(1e-3)))

    def twice(state, batch):
        new, metrics = train_step(state, batch)
        return train_step(new, batch)

    with pytest.raises(zj.ZeroError, match="exactly once"):
        zero(twice)(state, batches(1)[0])


def test_bf16_needs_the_apply_fn_hook():
    zero = zj.zero_shard(stage=2, precision="bf16", explicit_collectives=False)
    state = zero.shard(initial_state(optax.adam(1e-3)))
    with pytest.raises(zj.ZeroError, match="explicit_collectives=True"):
        zero(train_step)(state, batches(1)[0])


# ---- ZeRO that cannot do its job says so, once per cause --------------------------------------


def _zero_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, zj.ZeroWarning)]


def test_a_persistence_threshold_that_keeps_everything_whole_warns_once_at_init():
    """DeepSpeed's default 1e5 on a small model: every leaf is under it, so stage 3 splits
    nothing. The user's value is kept, and zerojax says what it does, once."""
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5}}
    zero = zj.zero_shard(config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = zero.init(make_init(optax.adam(1e-3)), jax.random.key(0))
        said_at_init = _zero_warnings(caught)
        for batch in batches(2):
            state, _ = zero(train_step)(state, batch)
        zero.describe(state, show=False)
    assert zero.config.persistence_threshold == 100_000  # kept
    assert len(said_at_init) == 1 and _zero_warnings(caught) == said_at_init
    message = said_at_init[0]
    assert "persistence_threshold=100,000 (DeepSpeed's stage3_param_persistence_threshold)" in (
        message
    )
    assert "100.00% of the bytes stage 3 splits" in message and "lower it" in message
    assert caught[0].filename == __file__  # points at the user's zero.init line
    with warnings.catch_warnings():  # what `-W error::zerojax.ZeroWarning` does
        warnings.simplefilter("error", zj.ZeroWarning)
        with pytest.raises(zj.ZeroWarning, match="stage3_param_persistence_threshold"):
            zj.zero_shard(config=config).init(make_init(optax.adam(1e-3)), jax.random.key(0))


def test_a_mesh_of_one_device_warns_once_at_init():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    zero = zj.zero_shard(stage=2, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = zero.init(make_init(optax.adam(1e-3)), jax.random.key(0))
        state, _ = zero(train_step)(state, batches(1)[0])
    (message,) = _zero_warnings(caught)
    assert "stage 2 on one device splits nothing" in message
    assert "JAX sees 8 devices but this zero splits over one: pass a mesh" in message


def test_zerojax_warnings_can_be_made_fatal_from_the_command_line():
    """`python -W error::zerojax.ZeroWarning`: a run with one device (XLA_FLAGS forgotten)
    stops at zero.init, and the message says how to get simulated devices."""
    script = (
        "import jax, optax, zerojax as zj, numpy as np\n"
        "params = {'w': np.ones((64, 64), np.float32)}\n"
        "zero = zj.zero_shard(stage=3)\n"
        "zero.init(lambda: {'params': params, 'opt_state': optax.adam(1e-3).init(params)})\n"
    )
    run = lambda *flags, **env: subprocess.run(
        [sys.executable, *flags, "-c", script],
        env=subprocess_env(JAX_PLATFORMS="cpu", **env),
        capture_output=True,
        text=True,
    )
    for fatal in (
        run("-W", "error::zerojax.ZeroWarning"),
        run(PYTHONWARNINGS="error::zerojax.ZeroWarning"),
    ):
        assert fatal.returncode != 0
        assert "ZeroWarning: zerojax: stage 3 on one device splits nothing" in fatal.stderr
        assert "XLA_FLAGS=--xla_force_host_platform_device_count=N" in fatal.stderr
    warned = run()  # without -W: a warning only
    assert warned.returncode == 0 and "splits nothing" in warned.stderr


def test_a_leaf_that_divides_nothing_is_named_once():
    """A GPT-2 vocabulary (50257 = 29 x 1733) on 8 devices: one warning however many times
    the zero plans, places and steps the state."""
    params = {"embed": jnp.ones((50257, 12)), "w": jnp.ones((64, 64))}
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = zero.init(lambda: {"params": params, "opt_state": optax.adam(1e-3).init(params)})
        zero.shard(state)
        zero.plan(state)
        zero.describe(state, show=False)
    (message,) = _zero_warnings(caught)
    assert message.startswith("zerojax: 3 leaves stay whole on every device because no dimension")
    assert "params/embed (50257, 12)" in message and "Pad them to a multiple of 8" in message


def test_a_step_xla_places_names_its_stage_once():
    """A step that never calls a model (a plain function of the parameters) runs on XLA's
    placement: at stage 3 the warning says what that costs at stage 3, once."""
    zero = zj.zero_shard(stage=3, persistence_threshold=0)
    params = {"w": jnp.ones((64, 64))}
    state = zero.init(lambda: {"params": params, "opt_state": optax.sgd(0.1).init(params)})

    def step(state, batch):
        grads = jax.grad(lambda p: ((batch @ p["w"]) ** 2).mean())(state["params"])
        updates, opt = optax.sgd(0.1).update(grads, state["opt_state"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            state = zero(step)(state, jnp.ones((8, 64)))
    (message,) = _zero_warnings(caught)
    assert "does not call state.apply_fn" in message and "stage 3 then gathers" in message
