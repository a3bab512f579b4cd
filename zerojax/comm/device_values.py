"""Values that differ per device inside zerojax's per-device model, and how they become one.

- Randomness: each device draws its own stream, the user's key folded with the device's
  position along the data axes (`fold_keys`), as DDP ranks seed their own dropout. Masks are
  therefore independent across devices and the same at every stage (the batch is split the
  same way at stages 0-3), but not the masks one device would draw for the whole batch.
- Model state a call writes (`combine_state`): a variable the model was given (BatchNorm's
  running statistics, an RNG counter) comes back as one value, the mean over devices for
  floating point (like SyncBatchNorm's running averages; the normalisation itself uses each
  device's own batch, as under DDP), device 0's otherwise, the input key for RNG keys (only
  the per-device copies were folded); a new variable with the per-device batch first (a sown
  activation) comes back whole, its per-device parts concatenated in batch order.
- Metrics a per-device step returns (`device_mean`): floating ones averaged, others device 0's.
Everything here runs inside `shard_map` without varying-axes checking (the model's per-device
body, `jax.jit`'s semantics for user code), on one device's values: every collective here is
one whose transpose is right under that `shard_map`'s rule (a replicated output's cotangent
arrives divided by the device count): `psum`/`pmean` and the plain `all_gather`, never an
"invarying" one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zerojax.core.errors import ZeroError


def is_key(x) -> bool:
    """Whether `x` is a typed JAX PRNG key array (`jax.random.key`)."""
    return jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def fold_keys(tree, axis, raw: bool = False):
    """Each key leaf of `tree` folded with this device's index along `axis` (typed keys; with
    `raw`, every leaf is a key, old-style uint32 ones included: Linen's `rngs=`)."""
    index = jax.lax.axis_index(axis)

    def fold(k):
        if raw:
            return jax.random.fold_in(k, index)
        if not is_key(k):
            return k
        folded = jax.vmap(jax.random.fold_in, (0, None))(k.reshape(-1), index)  # stacked keys
        return folded.reshape(k.shape)

    return jax.tree_util.tree_map(fold, tree)


def from_device_0(x, axis):
    """Device 0's value of `x` on every device."""
    if is_key(x):
        data = from_device_0(jax.random.key_data(x), axis)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.lax.all_gather(x, axis)[0]


def device_mean(tree, axis):
    """Floating leaves averaged over devices, the others device 0's."""
    if tree is None:
        return None
    return jax.tree_util.tree_map(
        lambda x: jax.lax.pmean(x, axis) if _is_float(x) else from_device_0(x, axis), tree
    )


def combine_state(new, given: dict, axis, local_rows: set):
    """The state a model call wrote (`new`, a pytree), one value for all devices by the rules
    of the module docstring. `given`: {key path: the value the call received, keys unfolded}."""

    def one(path, x):
        if is_key(x):
            if path not in given:
                raise ZeroError(
                    f"zerojax: the model created the RNG key {jax.tree_util.keystr(path)} "
                    "while running per device; create RNG streams outside the step."
                )
            return given[path]
        per_example = path not in given and jnp.ndim(x) >= 1 and jnp.shape(x)[0] in local_rows
        if per_example:
            return jax.lax.all_gather(x, axis, tiled=True)
        return device_mean(x, axis)

    return jax.tree_util.tree_map_with_path(one, new)
