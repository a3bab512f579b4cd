"""A small Flax transformer, its unchanged train step, and plain single-device training."""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

from zerojax.models import GPT, GPTConfig

CFG = GPTConfig(vocab=203, d_model=64, n_layers=2, n_heads=4, seq_len=16)
MODEL = GPT(CFG)


def subprocess_env(**extra) -> dict:
    """The environment of a process a test launches: this one's (the compilation cache
    included), without its device count and platform, which the process sets itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(
        f for f in flags if not f.startswith("--xla_force_host_platform_device_count")
    )
    return {**env, **extra}


def slow(*cases):
    """Parametrize cases for the slow lane only (`pytest -m slow`): more of a matrix whose
    feature the default run already covers with another case, kept out of it for time."""
    return [
        pytest.param(*c if isinstance(c, tuple) else (c,), marks=pytest.mark.slow) for c in cases
    ]


def make_init(tx, model=MODEL, cfg=CFG):
    def init_fn(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init_fn


_INITIAL_PARAMS: dict = {}
_init_params = jax.jit(
    lambda key: MODEL.init(key, jnp.zeros((1, CFG.seq_len), jnp.int32))["params"]
)


def initial_state(tx, key=0):
    """What `make_init(tx)(jax.random.key(key))` creates, from MODEL's parameters computed once
    per process and kept on the host (numpy: no step can donate them). Tests that do not test
    `zero.init` start from it with `zero.shard` (one cheap placement) instead of compiling an
    init program per configuration; test_parity's stage sweep checks `zero.init` itself."""
    if key not in _INITIAL_PARAMS:
        params = _init_params(jax.random.key(key))
        _INITIAL_PARAMS[key] = jax.tree_util.tree_map(np.asarray, params)
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=_INITIAL_PARAMS[key], tx=tx)


_HOST_STATES: dict = {}


def host_state(init_fn, key=0):
    """`init_fn(jax.random.key(key))` (a fixed, module-level init function) computed once per
    process on one device and kept on the host: `zero.shard(host_state(INIT))` starts a test
    from it without compiling an init program per configuration."""
    if (init_fn, key) not in _HOST_STATES:
        state = jax.jit(init_fn)(jax.random.key(key))
        _HOST_STATES[init_fn, key] = jax.tree_util.tree_map(np.asarray, state)
    return _HOST_STATES[init_fn, key]


def train_step(state, batch):
    """The unchanged single-device Flax step of DESIGN.md section 1."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def batches(n_steps, batch_size=16, cfg=CFG, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        tokens = rng.integers(0, cfg.vocab, (batch_size, cfg.seq_len + 1), dtype=np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def train_single_device(tx, data, key=0):
    """Plain optax training on one device: the reference every stage must match."""
    state = jax.device_put(initial_state(tx, key), jax.devices()[0])
    step = jax.jit(train_step)
    losses = []
    for batch in data:
        state, metrics = step(state, jax.device_put(batch, jax.devices()[0]))
        losses.append(float(metrics["loss"]))
    return state, losses


def train_zero(zero, tx, data, key=0, via_init=False):
    """`zero` training from `initial_state(tx, key)` placed by `zero.shard`, or with
    via_init=True created by `zero.init` (sharded from the start)."""
    if via_init:
        state = zero.init(make_init(tx), jax.random.key(key))
    else:
        state = zero.shard(initial_state(tx, key))
    step = zero(train_step)
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


# Parity tolerance, per leaf, in L2 norm: ||got - want|| <= PARITY_RTOL * ||want|| +
# PARITY_ATOL * sqrt(size), i.e. within 1e-5 of the leaf's norm or within an RMS difference
# of 1e-6 (the second bound is for leaves that start at zero, such as biases, whose norm after
# a few steps is only a few lr-sized updates). Why norms and not element by element: float32
# sums taken in another order (another device count, another CPU's vector width) move each
# gradient element by ~1e-7 relative, and Adam divides by sqrt(v) + eps, so an element whose
# gradient is ~0 can turn that into an update that differs by ~1e-5 relative on its own (one
# element of 2048 was 3.2e-6 off after 6 steps on an AMD machine), while a whole leaf stays
# within ~1e-6 of its norm on every CPU we tried. A broken reduction (a device's gradient
# dropped, a missing 1/N under SGD) moves whole leaves by 1e-2 and more: tests/test_parity.py
# checks that such mutations fail these assertions.
PARITY_RTOL, PARITY_ATOL = 1e-5, 1e-6


def relative_l2(got, want) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are zero)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff, norm = np.linalg.norm(got - want), np.linalg.norm(want)
    return float(diff / norm) if norm else float(diff)


def assert_trees_close(got, want, rtol=PARITY_RTOL, atol=PARITY_ATOL):
    """Every floating leaf of `got` within the L2 bound of PARITY_RTOL (`rtol` of `want`'s
    norm, or an RMS difference of `atol`), integer leaves (step counts) equal; the trees must
    have the same leaves."""
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    for (path, a), b in zip(got_leaves, want_leaves, strict=True):
        a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if not np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=name)
            continue
        diff = np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))
        bound = rtol * np.linalg.norm(b.astype(np.float64)) + atol * np.sqrt(a.size)
        assert diff <= bound, (
            f"{name}: L2 difference {diff:.3g} > {bound:.3g} (relative L2 difference "
            f"{relative_l2(a, b):.3g}, RMS {diff / np.sqrt(max(a.size, 1)):.3g})"
        )


def zeropp_setup(steps):
    """The tiny LM (its blocks as units) with qwZ + hpZ + qgZ on a (node, local) mesh: one
    node per process here, (2, 4) simulated in one process by the test."""
    from zerojax.models.gpt import make_init as lm_init
    from zerojax.models.gpt import train_step as lm_step
    from zerojax.models.lm import LM, LM_PRESETS

    cfg = LM_PRESETS["tiny"].replace(n_layers=2, seq_len=16)
    rng = np.random.default_rng(0)
    data = [
        (rng.integers(0, cfg.vocab, (16, 1)) + np.arange(cfg.seq_len + 1)) % cfg.vocab
        for _ in range(steps)
    ]
    options = dict(
        stage=3,
        quantized_weights=True,
        hpz_partition_size=4,
        quantized_gradients=True,
        persistence_threshold=0,
    )
    return lm_init(LM(cfg), optax.adam(1e-2)), lm_step, data, options


def rounded_state(tx, dtype=jnp.bfloat16):
    """The reference of optimizer_state_dtype='bf16': `tx` with its non-scalar floating state
    rounded to `dtype` after init and after every update, and used in fp32."""
    moment = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0
    cast = lambda tree, d: jax.tree_util.tree_map(lambda x: x.astype(d) if moment(x) else x, tree)

    def update(grads, state, params=None):
        updates, state = tx.update(grads, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(lambda p: cast(tx.init(p), dtype), update)


def loop_collective_sizes(compiled_text: str, devices: int = 8) -> list[int]:
    """The whole size (elements) of each all-gather and reduce-scatter inside a loop body of a
    compiled module (a reduce-scatter's output is one of `devices` parts)."""
    from zerojax.inspect import hlo

    computations, runs = hlo.runs(compiled_text)
    pattern = r"= \w+\[([\d,]*)\]\S* (?:all-gather|(reduce-scatter))\("
    return [
        math.prod(int(d) for d in m.group(1).split(",") if d) * (devices if m.group(2) else 1)
        for comp, times in runs.items()
        if times > 1
        for line in computations[comp]
        if (m := re.search(pattern, line))
    ]


def placed_as(x, *spec) -> bool:
    """Whether array `x` is laid out as PartitionSpec(*spec) on its mesh (trailing Nones or
    not: jax prints a spec either way, depending on how the array was placed)."""
    wanted = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return x.sharding.is_equivalent_to(wanted, x.ndim)
