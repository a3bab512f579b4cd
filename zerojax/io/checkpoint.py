"""Sharded checkpoints on orbax: async saves, restore onto any mesh, stage, precision, offload.

A checkpoint holds the state's *training truth*, not its layout: `params` (the fp32 master
weights when zerojax keeps them, else the parameters), `opt_state` (the user's optax state),
`other` (every other array field: step, RNG keys, user counters) and `zero` (the fp16 loss
scaler's counters). Each array is written by the processes that hold its shards (orbax), and
restoring reads it straight into the shardings and memory kinds the CURRENT `zero` gives the
target state, so a checkpoint from 8 devices at stage 3 with bf16 and offload restores onto 1
device at stage 0 in fp32, with no conversion step. Orbax writes each step into a temporary
directory and renames it when complete, so a crash never leaves a partial step that restore
would read; a directory copied or pruned by other tools can still hold one, which restoring
the latest step skips with a warning (`zerojax.io.checkpoint_health`).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zerojax.core.errors import ZeroError, warn
from zerojax.core.rules import OPT_STATE, PARAMS, category_of, key_name
from zerojax.engine.state import boundary
from zerojax.io.checkpoint_health import (
    UnreadableStep,
    agreed,
    complete_steps,
    missing_files,
    move_aside,
    saved_leaves,
    saved_step,
)
from zerojax.update.managed import ZeroOptState, initial_scaler, present, zero_opt_state

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
        complete = complete_steps(self._mgr)  # this process's view: no collective here
        blocking = [s for s in self._mgr.all_steps() if s >= int(step) and s not in complete]
        if blocking:  # orbax saves only steps newer than every step directory
            warn(
                f"zerojax: checkpoint step {step} is not saved: {self.directory} holds step "
                f"directories {blocking} at or after it that do not restore, and orbax saves "
                "only newer steps. ckpt.cleanup() moves them aside (nothing is deleted)."
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

    def restore(
        self, target: Any, step: int | None = None, *, partial: bool = False
    ) -> tuple[Any, dict]:
        """(state, extra) from checkpoint `step`, or from the latest step that restores: a
        newer step that is incomplete or does not read is skipped with one warning (nothing
        is deleted). `target` is a state or an abstract one (`jax.eval_shape(init_fn, key)`
        or `zero.eval_shape(...)`); the result is laid out by this manager's `zero`, whatever
        the checkpoint was saved with. A target whose model changed is a ZeroError naming the
        missing, unexpected and reshaped leaves; `partial=True` (a concrete target) restores
        the leaves that match and keeps the target's values for the others."""
        if step is not None:
            return self._restore(target, int(step), partial)
        skipped, steps = [], self.all_steps()
        for candidate in reversed(steps):
            try:  # a ZeroError other than UnreadableStep: the target does not match
                out = self._restore(target, candidate, partial)
            except UnreadableStep as e:
                skipped.append((candidate, f"step {candidate}: {str(e).split(': ', 1)[-1]}"))
                continue
            skipped += [
                (s, f"step {s}: incomplete, no {', '.join(missing_files(self.directory, s))}")
                for s in self._mgr.all_steps()
                if s > candidate and s not in steps
            ]
            if skipped:
                warn(
                    f"zerojax: restored checkpoint step {candidate} from {self.directory}, "
                    "skipping newer steps that do not restore: "
                    + "; ".join(text for _, text in sorted(skipped, reverse=True))
                    + f". Nothing was deleted; `zerojax checkpoint verify {self.directory}` "
                    "checks every step."
                )
            return out
        if not steps:
            raise ZeroError(
                f"no complete checkpoint in {self.directory} (step directories there: "
                f"{list(self._mgr.all_steps())})."
            )
        raise ZeroError(
            f"no checkpoint in {self.directory} restores (complete steps: {steps}"
            + "".join(f"; {text}" for _, text in skipped)
            + f"). `zerojax checkpoint verify {self.directory}` says what is wrong."
        )

    def _restore(self, target, step: int, partial: bool) -> tuple[Any, dict]:
        step, saved = saved_step(self._mgr, step)
        abstract, user = self.zero.holding(target)  # NNX: rebuilds objects like `target`
        shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
        wanted = _canonical_paths(abstract)
        kept = _mismatch(self.directory, step, saved, wanted, partial)
        request, restore_args = [], []
        for (keys, leaf), sharding in zip(
            wanted, jax.tree_util.tree_leaves(shardings), strict=True
        ):
            meta = None if keys is None else _lookup(saved, keys)
            if keys is None or meta is None or keys in kept:
                continue  # derived, a fresh scaler, or (partial) the target's own value
            shape = _stored_shape(leaf)
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
        try:
            out = self._mgr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=nest(request), restore_args=nest(restore_args), partial_restore=True
                    ),
                    extra=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:  # noqa: BLE001 - an array file missing or cut short
            raise UnreadableStep(
                f"checkpoint step {step} in {self.directory} does not read "
                f"({type(e).__name__}: {str(e)[:200]})."
            ) from None
        own = None
        if kept:  # the target's values for what the checkpoint cannot give
            if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(target)):
                raise ZeroError(
                    "restore(target, partial=True) keeps the target's values for "
                    f"{', '.join('/'.join(k) for k in sorted(kept)[:5])}: pass a concrete "
                    "state (e.g. zero.init(...)), not an abstract one."
                )
            own = [
                (keys, leaf)
                for keys, leaf in _canonical_paths(self.zero.shard(target))
                if keys in kept
            ]
        restored = out["state"]
        for keys, leaf in own or []:
            node = restored
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = jax.random.key_data(leaf) if _is_key(leaf) else leaf
        return (
            user.rebuild(
                _assemble(abstract, shardings, wanted, restored, self.zero.placement.update)
            ),
            dict(out["extra"] or {}),
        )

    def latest_step(self) -> int | None:
        """The newest complete step (on every process), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The complete steps, oldest first: those holding the files orbax writes last, on
        every process (a directory copied or pruned by hand may hold a partial step)."""
        return agreed(complete_steps(self._mgr))

    def cleanup(self) -> list[str]:
        """Move every step directory that does not restore (incomplete, or unreadable
        metadata) into `DIR/skipped/`, where orbax no longer sees it, so new saves at those
        step numbers proceed; nothing is deleted. Returns the moved paths."""
        self._mgr.wait_until_finished()
        moved = move_aside(self._mgr, self.all_steps())
        self._mgr.reload()
        return moved

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


def _mismatch(directory, step: int, saved: dict, wanted: list, partial: bool) -> set:
    """The keys (partial=True) the target keeps its own values for: those the checkpoint
    lacks or holds in another shape. Without `partial`, any missing, unexpected or reshaped
    leaf is a ZeroError listing them."""
    want = {keys: leaf for keys, leaf in wanted if keys is not None}
    missing, reshaped = [], []
    for keys, leaf in want.items():
        meta = _lookup(saved, keys)
        shape = _stored_shape(leaf)
        if meta is None and keys[0] != "zero":  # a fresh loss scaler is fine
            missing.append(keys)
        elif meta is not None and tuple(meta.shape) != shape:
            reshaped.append((keys, tuple(meta.shape), shape))
    unexpected = [k for k, _ in saved_leaves(saved) if k not in want and k[0] != "zero"]
    if not (missing or reshaped or unexpected):
        return set()
    if partial:  # unexpected leaves are simply not read
        return set(missing) | {k for k, *_ in reshaped}
    name = lambda keys: "/".join(keys)
    few = lambda items: (
        ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")
    )
    parts = [
        f"{len(missing)} missing from the checkpoint ({few([name(k) for k in missing])})"
        if missing
        else "",
        f"{len(unexpected)} in the checkpoint, not the target "
        f"({few([name(k) for k in unexpected])})"
        if unexpected
        else "",
        f"{len(reshaped)} reshaped ({few([f'{name(k)} {a} -> {b}' for k, a, b in reshaped])})"
        if reshaped
        else "",
    ]
    raise ZeroError(
        f"checkpoint step {step} in {directory} does not match the target state (a changed "
        f"model?): {'; '.join(p for p in parts if p)}. restore(target, partial=True) with a "
        "concrete target restores the leaves that match and keeps the target's values for "
        "the others (e.g. a new head for fine-tuning)."
    )


def _stored_shape(leaf) -> tuple:
    """The shape a checkpoint stores `leaf` in (a typed PRNG key as its key data)."""
    return tuple(leaf.shape) + ((_key_size(leaf),) if _is_key(leaf) else ())


def _key_size(leaf) -> int:
    """Trailing size of a typed PRNG key's data (2 for threefry)."""
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), leaf.dtype)).shape[-1]


def _assemble(abstract, shardings, wanted, restored, policy):
    """The target state from restored canonical arrays, each leaf in its dtype, sharding and
    memory kind. Leaves a checkpoint does not store are derived: 16-bit params from the master
    weights, zero micro counter and accumulation buffers, and (from a checkpoint without them)
    fresh loss-scaler counters."""
    scaler = initial_scaler(policy)
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
    """`value` as `leaf`'s dtype in `sharding` (its memory kind included). A cast runs as one
    compiled program from wherever `value` lives to `sharding`: a `device_put` of a pinned-host
    array to device memory is refused by jax 0.12.1's CPU client (an offloaded master weight
    restored into its 16-bit parameter)."""
    if _is_key(leaf):
        value = jax.random.wrap_key_data(value, impl=leaf.dtype._impl)
    elif np.dtype(value.dtype) != np.dtype(leaf.dtype):
        return jax.jit(lambda v: v.astype(leaf.dtype), out_shardings=sharding)(value)
    return jax.device_put(value, sharding)
