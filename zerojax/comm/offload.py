"""Host offload through JAX memory kinds, inside the compiled step.

Offloaded leaves rest in `pinned_host` memory (their storage sharding says so, see
`rules._memory_kind`). The step moves them to the device where it starts (`to_device`) and its
final sharding constraint writes the new values back to the host, so XLA schedules both copies
(asynchronously on GPU). With `offload_update='host'` the optimizer update itself runs on the
host (`compute_on('device_host')`), and only the gradients travel there. Activation offload is
a remat policy around the model: matmul outputs saved for backward go to pinned host memory.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from zerojax.core.rules import DEVICE, HOST


def _kind(x) -> str:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host and HOST or DEVICE


def _put(x, sharding, kind: str):
    """`x` with `sharding` in memory `kind`; a copy between memories only when needed (inside
    jit, a sharding constraint cannot change the memory an array lives in; device_put can)."""
    sharding = sharding.with_memory_kind(kind)
    if _kind(x) != kind:
        x = jax.device_put(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def to_device(state, shardings, keep=None):
    """Offloaded leaves of `state` brought to device memory for the step; `keep` (a predicate on
    leaf paths) names leaves that stay on the host (the host update's optimizer state)."""

    def move(path, x, s):
        if s.memory_kind != HOST or (keep is not None and keep(path)):
            return x
        return _put(x, s, DEVICE)

    return jax.tree_util.tree_map_with_path(move, state, shardings)


def to_storage(state, shardings):
    """`state` placed as it rests between steps: each leaf in its storage sharding and memory."""
    return jax.tree_util.tree_map(
        lambda x, s: _put(x, s, s.memory_kind or DEVICE), state, shardings
    )


def _on_host(f):
    """`f` computed by the host CPU. jax >= 0.12 asks where its outputs live (host: the new
    state rests there, the master and updates are moved back explicitly); jax 0.10 takes the
    compute type alone."""
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")(f)


def optimizer_on_host(update, master, inner, grads, finite, *, shardings):
    """`update(master, inner, grads)` (the user's optax step: new master, new state, updates)
    run by the host CPU on the offloaded master weights and optimizer state; gradients and the
    `finite` flag travel to the host (gradients split like the master), and where `finite` is
    False the old master and state stay.
    `shardings` = (master, inner, grads, finite) storage shardings.
    Only the optax step runs there: JAX (0.10) types memory spaces, and arrays an op creates
    inside a host computation (zeros, constants) are typed device, so general code such as the
    gradient norm fails there; the norm, clipping and loss scaling stay on the device."""
    args = jax.tree_util.tree_map(
        lambda x, s: _put(x, s, HOST), (master, inner, grads, finite), shardings
    )

    @_on_host
    @jax.jit
    def run(master, inner, grads, finite):
        new_master, new_inner, updates = update(master, inner, grads)
        kept = jax.tree_util.tree_map(
            lambda n, o: jnp.where(finite, n, o), (new_master, new_inner), (master, inner)
        )
        return (*kept, updates)  # the updates are masked on the device (optim._optimizer_step)

    new_master, new_inner, updates = run(*args)
    # the new master and the updates come back to the device, where the user's update code
    # reads them (and the master follows what it returns, managed.settle); the state stays
    device = lambda tree: jax.tree_util.tree_map(
        lambda x, s: _put(x, s, DEVICE), tree, shardings[0]
    )
    return device(new_master), new_inner, device(updates)


def activation_policy():
    """Remat policy: matmul outputs without batch dims (x @ W) are saved to pinned host memory,
    everything else is recomputed in backward."""
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims(DEVICE, HOST)
