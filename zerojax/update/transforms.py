"""The pieces of the managed optimizer step, each one small decision composed by
`managed.managed_update` in optax's manner: the mean over micro-batches, the global norm and
its finite check, clipping (optax's own), the optimizer state kept in `optimizer_state_dtype`
(a wrapped `GradientTransformation`), a non-finite step skipped (as `optax.apply_if_finite`)
and DeepSpeed's dynamic loss scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zerojax.core.policy import UpdatePolicy, working_dtype


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def in_working_dtype(tree, chosen, which=_floating):
    """`tree`'s leaves that `which` picks (floating ones) in `working_dtype(leaf, chosen)`: a
    16-bit `chosen` casts them, fp32 widens 16-bit leaves and keeps float64 ones."""
    cast = lambda x: x.astype(working_dtype(jnp.result_type(x), chosen)) if which(x) else x
    return jax.tree_util.tree_map(cast, tree)


def zeros_like(tree):
    return jax.tree_util.tree_map(jnp.zeros_like, tree)


def _moment(x) -> bool:
    """A leaf `optimizer_state_dtype` applies to: floating and not a scalar (hyperparameters,
    counts and loss-scale values stay as they are)."""
    return _floating(x) and jnp.ndim(x) > 0


def store_optimizer_state(inner, policy: UpdatePolicy, like=None):
    """The user's optimizer state as it is kept between steps (`optimizer_state_dtype`); with
    `like`, each leaf back in the dtype of `like`'s (the stored state the update started from)."""
    if like is not None:
        return jax.tree_util.tree_map(lambda x, old: x.astype(old.dtype), inner, like)
    return in_working_dtype(inner, policy.state_dtype, _moment)


def micro_batch_mean(accum, grads, k: int, has_accum: bool):
    """The mean gradient of the k micro-batches: the 'reduced' buffer `accum` (if kept) plus
    the last micro-batch's `grads`, over k."""
    if has_accum:
        grads = jax.tree_util.tree_map(lambda a, g: a.astype(g.dtype) + g, accum, grads)
    if k > 1:
        grads = jax.tree_util.tree_map(lambda g: g / k, grads)
    return grads


def norm_and_finite(grads, policy: UpdatePolicy):
    """(the global norm of `grads`, whether it is finite; always true without a check)."""
    norm = optax.tree.norm(grads)
    return norm, jnp.isfinite(norm) if policy.checks_finite else jnp.asarray(True)


def clipped(grads, policy: UpdatePolicy):
    """`grads` clipped to `gradient_clipping` by global norm (optax's), or as they are."""
    if policy.clipping <= 0:
        return grads
    return optax.clip_by_global_norm(policy.clipping).update(grads, optax.EmptyState())[0]


def state_kept_in_its_dtype(tx, policy: UpdatePolicy) -> optax.GradientTransformation:
    """`tx` whose state rests in `optimizer_state_dtype` between steps and is used in fp32."""
    if not policy.keeps_low_precision_state:
        return tx

    def update(grads, stored, params=None):
        inner = in_working_dtype(stored, jnp.float32, _moment)
        updates, inner = tx.update(grads, inner, params)
        return updates, store_optimizer_state(inner, policy, stored)

    return optax.GradientTransformation(tx.init, update)


def applied(tx):
    """`update(master, inner, grads)`: (new master, new inner state, `tx`'s updates)."""

    def update(master, inner, grads):
        updates, inner = tx.update(grads, inner, master)
        return optax.apply_updates(master, updates), inner, updates

    return update


def skipped_unless_finite(update, finite, policy: UpdatePolicy):
    """`update(master, inner)`, or under the finite check one that changes nothing on a
    non-finite step (as `optax.apply_if_finite`)."""
    if not policy.checks_finite:
        return update
    keep = lambda master, inner: (master, inner, zeros_like(master))
    return lambda master, inner: jax.lax.cond(finite, update, keep, master, inner)


def zero_where_nonfinite(updates, finite, policy: UpdatePolicy):
    """The updates, zero on a non-finite step under the finite check."""
    if not policy.checks_finite:
        return updates
    return jax.tree_util.tree_map(lambda u: jnp.where(finite, u, 0), updates)


def next_loss_scale(opt, finite, policy: UpdatePolicy):
    """DeepSpeed's DynamicLossScaler: an overflow skips the step and, once `hysteresis`
    overflows have been seen, halves the scale (not below min_loss_scale); every
    `loss_scale_window` clean steps double it and restore the hysteresis. `opt`: the
    ZeroOptState; returns (scale, good steps, hysteresis, overflowed at the minimum scale)."""
    if not policy.scales_loss_dynamically:
        return opt.scale, opt.good_steps, opt.hysteresis, jnp.asarray(False)
    overflow = ~finite
    drop = overflow & (opt.hysteresis <= 1)
    good = jnp.where(overflow, 0, opt.good_steps + 1)
    grow = finite & (good % policy.loss_scale_window == 0)
    scale = jnp.where(drop, jnp.maximum(opt.scale / 2, policy.min_loss_scale), opt.scale)
    scale = jnp.where(grow, scale * 2, scale)
    hyst = jnp.where(overflow & ~drop, opt.hysteresis - 1, opt.hysteresis)
    hyst = jnp.where(grow, policy.hysteresis, hyst)
    at_min = drop & (opt.scale <= policy.min_loss_scale)
    return scale, good, hyst, at_min
