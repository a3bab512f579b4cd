"""A small Flax transformer, its unchanged train step, plain single-device training, and the
parity check every stage is held to (float64 exact, or the float32 bound: "Parity" below)."""

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


def run_dtype():
    """The dtype test models are built in: float64 under the `x64` fixture, else float32."""
    return np.float64 if jax.config.jax_enable_x64 else np.float32


def run_rtol() -> float:
    """The relative bound for losses compared in this run's dtype (see "Parity" below)."""
    return EXACT_RTOL if jax.config.jax_enable_x64 else PARITY_RTOL


def in_run_dtype(state):
    """`state` in float64 under the `x64` fixture (the exactness checks' dtype), else as it is:
    how the common model's helpers below start every run."""
    return in_float64(state) if jax.config.jax_enable_x64 else state


def make_init(tx, model=MODEL, cfg=CFG):
    def init_fn(key):
        params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
        params = in_run_dtype(params)
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init_fn


_INITIAL_PARAMS: dict = {}
_init_params = jax.jit(
    lambda key: MODEL.init(key, jnp.zeros((1, CFG.seq_len), jnp.int32))["params"]
)


def initial_state(tx, key=0):
    """What `make_init(tx)(jax.random.key(key))` creates (float64 under the `x64` fixture), from
    MODEL's parameters computed once per process and kept on the host (numpy: no step can
    donate them). Tests that do not test `zero.init` start from it with `zero.shard` (one
    cheap placement) instead of compiling an init program per configuration; test_parity's
    stage sweep checks `zero.init` itself."""
    cached = (key, jax.config.jax_enable_x64)  # some initializers draw float64 under x64
    if cached not in _INITIAL_PARAMS:
        params = _init_params(jax.random.key(key))
        _INITIAL_PARAMS[cached] = jax.tree_util.tree_map(np.asarray, params)
    params = in_run_dtype(_INITIAL_PARAMS[cached])
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


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


def train(step, state, data):
    """(the state after `step` on each batch of `data`, the losses)."""
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def train_single_device(tx, data, key=0, start=None):
    """Plain optax training on one device from `start` (default `initial_state(tx, key)`):
    the reference every stage must match."""
    one = jax.devices()[0]
    state = jax.device_put(initial_state(tx, key) if start is None else start, one)
    step = jax.jit(train_step)
    return train(lambda s, batch: step(s, jax.device_put(batch, one)), state, data)


def train_zero(zero, tx, data, key=0):
    """`zero` training from `initial_state(tx, key)` placed by `zero.shard`."""
    return train(zero(train_step), zero.shard(initial_state(tx, key)), data)


# Parity (CONTRIBUTING.md, "What the parity tests assert"): per leaf, in L2 norm,
# ||got - want|| <= rtol * ||want|| + atol * sqrt(size), the bound chosen by `want`'s dtype.
# - float64: "exact up to reduction order". Data parallelism sums a gradient in another order
#   than one device does; Adam (dividing by sqrt(v) + eps) can turn that rounding into
#   lr-sized differences where a gradient is ~0, and how much a CPU makes depends on its
#   kernels (fp32: ~1e-6 of a leaf's norm on the CPUs first tried, 2.7e-5 on a Xeon with
#   AMX). In float64 the same noise is ~1e-15 (2e-15..6e-15 measured after 2 Adam steps, a
#   plain jax.jit data-parallel step and zerojax against one device), and a broken reduction
#   (a device's gradient dropped, a missing 1/N) moves whole leaves by 1e-2 and more:
#   EXACT_RTOL = 1e-10 sits five orders of magnitude from each. Run a test in float64 with the
#   `x64` fixture and `in_float64(state)`.
# - float32: for what fp32 runs test (16-bit compute, fp32 master weights, quantization) and
#   for published code that computes in float32 in places itself: within 1e-5 of the leaf's
#   norm or an RMS difference of 1e-6 (the second for leaves that start at zero). Tests in
#   float32 under Adam use eps=1e-5: it keeps reduction-order noise in gradients that are ~0
#   (attention projections early in training) from becoming lr-sized steps; with eps=1e-8 any
#   data-parallel run, stage 0 included, drifts ~3e-6 from one device after 10 steps.
EXACT_RTOL, EXACT_ATOL = 1e-10, 1e-13
PARITY_RTOL, PARITY_ATOL = 1e-5, 1e-6


def _floating(x) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(np.dtype(x.dtype), np.floating)


def in_float64(tree):
    """`tree` with every floating array leaf in float64 (a state, a batch); the rest as it
    is. Needs jax_enable_x64 (the `x64` fixture): without it JAX would keep float32."""
    assert jax.config.jax_enable_x64, "in_float64 needs the x64 fixture (jax_enable_x64)"
    return jax.tree_util.tree_map(lambda x: x.astype(np.float64) if _floating(x) else x, tree)


def data_parallel_jit(fn, state_argnum=0, batch_argnum=1):
    """`fn` as a plain jax.jit data-parallel step over all devices: the state replicated, the
    batch split by rows, XLA's own all-reduce. It differs from one device only in reduction
    order: what data parallelism may differ by, measured."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    jitted = jax.jit(fn)

    def step(*args):
        args = list(args)
        args[state_argnum] = jax.device_put(args[state_argnum], replicated)
        args[batch_argnum] = jax.device_put(args[batch_argnum], rows)
        return jitted(*args)

    return step


def relative_l2(got, want) -> float:
    """||got - want|| / ||want|| in float64 (0 when both are zero)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff, norm = np.linalg.norm(got - want), np.linalg.norm(want)
    return float(diff / norm) if norm else float(diff)


def leaf_bound(want, rtol=None, atol=None) -> float:
    """The L2 distance a leaf may be from `want`: by `want`'s dtype (float64 exact, others the
    float32 bound) unless `rtol`/`atol` are given."""
    exact = want.dtype == np.float64
    rtol = rtol if rtol is not None else EXACT_RTOL if exact else PARITY_RTOL
    atol = atol if atol is not None else EXACT_ATOL if exact else PARITY_ATOL
    return float(rtol * np.linalg.norm(want.astype(np.float64)) + atol * np.sqrt(want.size))


def _log_margin(name, dtype, diff, bound):
    """With ZEROJAX_PARITY_LOG=FILE, one line per leaf checked: the test, the leaf, its dtype
    and difference/bound (how close this CPU's noise comes to the bound: CONTRIBUTING.md)."""
    if path := os.environ.get("ZEROJAX_PARITY_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
        ratio = diff / bound if bound else float(diff > 0)
        with open(path, "a") as log:
            log.write(f"{ratio:.3g}\t{dtype}\t{test}\t{name}\n")


def assert_trees_close(got, want, rtol=None, atol=None):
    """Every floating leaf of `got` within `leaf_bound` of `want`'s, integer leaves (step
    counts) equal; the trees must have the same leaves, and a float64 `want` a float64 `got`
    (a float64 run narrowed on the way is a bug, not noise)."""
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    for (path, a), b in zip(got_leaves, want_leaves, strict=True):
        a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if not np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=name)
            continue
        assert b.dtype != np.float64 or a.dtype == np.float64, f"{name}: {a.dtype}, not float64"
        diff = np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))
        bound = leaf_bound(b, rtol, atol)
        _log_margin(name, b.dtype, diff, bound)
        assert diff <= bound, (
            f"{name}: L2 difference {diff:.3g} > {bound:.3g} (relative L2 difference "
            f"{relative_l2(a, b):.3g}, RMS {diff / np.sqrt(max(a.size, 1)):.3g}, {b.dtype})"
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
