"""Sharded checkpoints on orbax: async saves, restore onto any mesh, stage, precision, offload.

A checkpoint holds the state's *training truth*, not its layout: `params` (the fp32 master
weights when zerojax keeps them, else the parameters), `opt_state` (the user's optax state),
`other` (every other array field: step, RNG keys, user counters) and `zero` (the fp16 loss
scaler's counters). Each array is written by the processes that hold its shards (orbax), and
restoring reads it straight into the shardings and memory kinds the CURRENT `zero` gives the
target state, so a checkpoint from 8 devices at stage 3 with bf16 and offload restores onto 1
device at stage 0 in fp32, with no conversion step. Orbax writes each step into a temporary
directory and renames it when complete, so a crash never leaves a partial step that restore
would read.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.config import ZeroError
from zerojax.optim import ZeroOptState, initial_scaler, present, zero_opt_state
from zerojax.rules import DEVICE, OPT_STATE, PARAMS, category_of, key_name
from zerojax.state import boundary

# ZeroOptState fields a checkpoint keeps under "zero": the loss scaler's counters (the others
# are derived or empty at an optimizer-step boundary: master -> params, inner -> opt_state,
# micro, accum and per_device zeros)
SCALER_FIELDS = ZeroOptState._fields[ZeroOptState._fields.index("scale") :]


def _canonical_paths(state) -> list:
    """[(canonical key tuple or None, leaf)] for every leaf of `state` (None: not saved)."""
    out = []
    zero_opt = zero_opt_state(state)
    has_master = zero_opt is not None and present(zero_opt.master)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = tuple(key_name(k) for k in path)
        head = category_of(path)  # a tuple state's (params, opt_state) are stored by name
        field = _zero_field(path) if head == OPT_STATE and zero_opt is not None else None
        if head == PARAMS:
            out.append((None if has_master else (PARAMS, *names[1:]), leaf))  # master: truth
        elif field is not None:
            at, rest = field, names[field + 1 :]
            if names[at] == "master":
                out.append(((PARAMS, *rest), leaf))
            elif names[at] == "inner":
                out.append(((OPT_STATE, *rest), leaf))
            elif names[at] in SCALER_FIELDS:
                out.append((("zero", names[at]), leaf))
            else:  # micro, accum, per_device: step-boundary 0
                out.append((None, leaf))
        elif head == OPT_STATE:
            out.append(((OPT_STATE, *names[1:]), leaf))
        else:
            out.append((("other", *names), leaf))
    return out


def _zero_field(path) -> int | None:
    """The position in `path` of the ZeroOptState field it passes through (a TrainState's
    `opt_state.master`, an NNX optimizer's `zerojax` variable's `.master`), or None."""
    for i, key in enumerate(path[1:], start=1):
        if isinstance(key, jax.tree_util.GetAttrKey) and key.name in ZeroOptState._fields:
            return i
    return None


def nest(pairs) -> dict:
    """A nested dict from (key tuple, value) pairs."""
    tree: dict = {}
    for keys, value in pairs:
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return tree


def _lookup(tree, keys):
    for k in keys:
        if not isinstance(tree, dict) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def canonical_tree(state) -> dict:
    """The nested dict of arrays a checkpoint stores for `state` (typed RNG keys as key data)."""
    zero_opt = zero_opt_state(state)
    micro = 0 if zero_opt is None else int(jax.device_get(zero_opt.micro))
    if micro:
        raise ZeroError(
            f"cannot checkpoint in the middle of gradient accumulation (micro-step "
            f"{micro}): save after an optimizer step."
        )
    return nest(
        (keys, jax.random.key_data(x) if _is_key(x) else x)
        for keys, x in _canonical_paths(state)
        if keys is not None
    )


class CheckpointManager:
    """Sharded, async checkpoints of a zerojax train state (see the module docstring).

    ckpt = zj.CheckpointManager("ckpt", zero, save_interval_steps=100)
    state, extra = ckpt.restore(state)            # if ckpt.latest_step() is not None
    ckpt.save(step, state, extra={"data_position": pos})
    ckpt.close()
    """

    def __init__(
        self,
        directory,
        zero,
        *,
        save_interval_steps: int = 1,
        max_to_keep: int | None = None,
        async_save: bool = True,
        save_on_preemption: bool = False,
    ):
        self.directory, self.zero = os.path.abspath(os.fspath(directory)), zero
        self._mgr = orbax_manager(
            self.directory,
            ocp.CheckpointManagerOptions(
                save_interval_steps=save_interval_steps,
                max_to_keep=max_to_keep,
                create=True,
                cleanup_tmp_directories=True,
                enable_async_checkpointing=async_save,
            ),
        )
        self._sigterm = False
        self._unsaved: tuple[int, Any] | None = None  # a step save() offered but skipped
        self._handlers: tuple | None = None  # (ours, the SIGTERM handler before ours)
        if save_on_preemption:
            previous = signal.getsignal(signal.SIGTERM)

            def on_sigterm(signum, frame):
                self._sigterm = True  # save() and `preempted` then save and wait
                if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, on_sigterm)
            self._handlers = (on_sigterm, previous)

    def save(self, step: int, state, extra: dict | None = None, *, force: bool = False) -> bool:
        """Start saving `state` (and JSON-able `extra`) as `step` if the interval says so, or
        `force`, or after SIGTERM with save_on_preemption (then it also waits for the write).
        Returns whether a save started. Only the device-to-host copy blocks the caller."""
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(canonical_tree(boundary(state).tree)),
            extra=ocp.args.JsonSave(dict(extra or {})),
        )
        saved = self._mgr.save(int(step), force=force or self._sigterm, args=args)
        self._unsaved = None if saved else (int(step), args)
        self._finish_preemption()
        return saved

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with save_on_preemption). Reading it then also makes sure
        the step last offered to save() is on disk, even if the signal came just after that
        save() decided not to save: check it right after save(), then stop."""
        self._finish_preemption()
        return self._sigterm

    def _finish_preemption(self):
        """After SIGTERM: save the last offered step if it was not saved, and wait for it."""
        if not self._sigterm:
            return
        if self._unsaved is not None:
            step, args = self._unsaved
            self._unsaved = None
            if step not in self._mgr.all_steps():
                self._mgr.save(step, force=True, args=args)
        self._mgr.wait_until_finished()

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, extra) from checkpoint `step` (the latest when None). `target` is a state or
        an abstract one (`jax.eval_shape(init_fn, key)` or `zero.eval_shape(...)`); the result
        is laid out by this manager's `zero`, whatever the checkpoint was saved with."""
        step, saved = saved_step(self._mgr, step)
        abstract, user = self.zero.holding(target)  # NNX: rebuilds objects like `target`
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
        wanted = _canonical_paths(abstract)
        request, restore_args = [], []
        for (keys, leaf), sharding in zip(
            wanted, jax.tree_util.tree_leaves(shardings), strict=True
        ):
            meta = None if keys is None else _lookup(saved, keys)
            if keys is None or (meta is None and keys[0] == "zero"):
                continue  # derived, or a fresh scaler is fine
            shape = tuple(leaf.shape) + ((_key_size(leaf),) if _is_key(leaf) else ())
            if meta is None:
                raise ZeroError(
                    f"checkpoint step {step} in {self.directory} has no "
                    f"{'/'.join(keys)}, which the target state needs."
                )
            if tuple(meta.shape) != shape:
                raise ZeroError(
                    f"checkpoint leaf {'/'.join(keys)} has shape "
                    f"{tuple(meta.shape)}, the target {shape}: a different model?"
                )
            request.append((keys, jax.ShapeDtypeStruct(shape, meta.dtype)))
            restore_args.append(
                (
                    keys,
                    ocp.ArrayRestoreArgs(
                        sharding=sharding
                        if not _is_key(leaf)
                        else jax.sharding.NamedSharding(
                            sharding.mesh, jax.sharding.PartitionSpec()
                        ),
                        dtype=meta.dtype,
                    ),
                )
            )
        out = self._mgr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=nest(request), restore_args=nest(restore_args), partial_restore=True
                ),
                extra=ocp.args.JsonRestore(),
            ),
        )
        return (
            user.rebuild(_assemble(abstract, shardings, wanted, out["state"], self.zero.config)),
            dict(out["extra"] or {}),
        )

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for the saves in flight, close orbax's manager and give SIGTERM back to the
        handler it had before this manager (unless someone replaced ours since)."""
        self._mgr.wait_until_finished()
        self._mgr.close()
        if self._handlers is not None:
            ours, previous = self._handlers
            if signal.getsignal(signal.SIGTERM) is ours:
                signal.signal(signal.SIGTERM, previous)
            self._handlers = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def orbax_manager(directory: str, options) -> ocp.CheckpointManager:
    """An orbax manager for zerojax's two items: the canonical `state` tree and JSON `extra`."""
    return ocp.CheckpointManager(
        directory,
        options=options,
        item_handlers={
            "state": ocp.PyTreeCheckpointHandler(),
            "extra": ocp.JsonCheckpointHandler(),
        },
    )


def saved_step(mgr, step: int | None) -> tuple[int, dict]:
    """(step, nested dict of per-leaf metadata: shape, dtype, sharding) of complete checkpoint
    `step` (the latest when None), or a ZeroError listing the steps there."""
    steps = list(mgr.all_steps())
    step = mgr.latest_step() if step is None else int(step)
    if step is None or step not in steps:
        raise ZeroError(
            f"no complete checkpoint {'' if step is None else step} in "
            f"{mgr.directory} (steps there: {steps})."
        )
    meta = mgr.item_metadata(step)["state"]
    return step, getattr(meta, "tree", meta)


def _key_size(leaf) -> int:
    """Trailing size of a typed PRNG key's data (2 for threefry)."""
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), leaf.dtype)).shape[-1]


def _assemble(abstract, shardings, wanted, restored, cfg):
    """The target state from restored canonical arrays, each leaf in its dtype, sharding and
    memory kind. Leaves a checkpoint does not store are derived: 16-bit params from the master
    weights, zero micro counter and accumulation buffers, and (from a checkpoint without them)
    fresh loss-scaler counters."""
    scaler = initial_scaler(cfg)
    leaves = []
    for (path, leaf), (keys, _), sharding in zip(
        jax.tree_util.tree_flatten_with_path(abstract)[0],
        wanted,
        jax.tree_util.tree_leaves(shardings),
        strict=True,
    ):
        names = tuple(key_name(k) for k in path)
        if keys is None:
            value = (
                _lookup(restored, (PARAMS, *names[1:]))
                if category_of(path) == PARAMS
                else np.zeros(leaf.shape, leaf.dtype)
            )
        else:
            value = _lookup(restored, keys)
            if value is None:
                value = scaler[keys[1]]
        leaves.append(_place(value, leaf, sharding))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract), leaves)


def _place(value, leaf, sharding):
    """`value` as `leaf`'s dtype in `sharding` (its memory kind included)."""
    if _is_key(leaf):
        value = jax.random.wrap_key_data(value, impl=leaf.dtype._impl)
    elif np.dtype(value.dtype) != np.dtype(leaf.dtype):
        value = jax.device_put(value, sharding.with_memory_kind(DEVICE)).astype(leaf.dtype)
    return jax.device_put(value, sharding)
