"""Which checkpoint steps can be restored: complete, readable, and the same on every process.

Orbax writes a step into a temporary directory and renames it when done, so on a local file
system a killed save leaves no partial step. Directories get copied, pruned and synced by other
tools, though: a step directory can lack the files orbax writes last (`_CHECKPOINT_METADATA` and
the state's `_METADATA`), or hold a truncated array file. `complete_steps` counts only steps
with both files; `step_problems` also reads every saved array (for `zerojax checkpoint
verify`); `agreed` keeps the steps every process of a multi-process run sees as complete, so
all restore the same one; `saved_step` reads one step's metadata or says what is wrong with it;
`move_aside` puts the steps that do not restore into `DIR/skipped/` (nothing is deleted).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from zerojax.core.errors import ZeroError

# the files orbax writes when a step is finished: the step's and its state item's metadata
FINISHED = ("_CHECKPOINT_METADATA", os.path.join("state", "_METADATA"))


class UnreadableStep(ZeroError):
    """A checkpoint step that is incomplete or does not read (restoring the latest step skips
    it; restoring it by number reports it)."""


def missing_files(directory: str, step: int) -> list[str]:
    """The files that mark step `step` in `directory` finished and are not there."""
    return [f for f in FINISHED if not os.path.isfile(os.path.join(directory, str(step), f))]


def complete_steps(mgr) -> list[int]:
    """The steps of orbax manager `mgr` whose directories hold the files orbax writes last."""
    return [s for s in mgr.all_steps() if not missing_files(mgr.directory, s)]


def agreed(steps: list[int]) -> list[int]:
    """`steps` (complete in this process's view) less any step another process does not see
    as complete: every process then chooses among the same steps."""
    if jax.process_count() == 1:
        return sorted(steps)
    from jax.experimental import multihost_utils

    counts = multihost_utils.process_allgather(np.array([len(steps)], np.int64))
    padded = np.full(int(np.max(counts)), -1, np.int64)
    padded[: len(steps)] = sorted(steps)
    views = multihost_utils.process_allgather(padded)  # one row per process
    common = set(views[0].tolist())
    for row in views[1:]:
        common &= set(row.tolist())
    return sorted(s for s in common if s >= 0)


def step_problems(directory: str, mgr, step: int, read_leaf) -> list[str]:
    """What is wrong with checkpoint `step`: missing finishing files, unreadable metadata, or
    array files that do not read back as their saved shape and dtype (`read_leaf(keys, meta)`
    reads one array to the host). Empty: the step restores."""
    missing = missing_files(directory, step)
    if missing:
        return [f"incomplete: no {', '.join(missing)} (a save or copy cut short?)"]
    try:
        meta = mgr.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a problem to report
        return [f"its metadata does not read: {type(e).__name__}: {str(e)[:200]}"]
    problems = []
    for keys, leaf in saved_leaves(getattr(meta, "tree", meta)):
        try:
            value = read_leaf(keys, leaf)
        except Exception as e:  # noqa: BLE001 - a truncated or missing array file
            problems.append(f"{'/'.join(keys)} does not read: {type(e).__name__}: {str(e)[:160]}")
            continue
        if value.size != int(np.prod(leaf.shape)) or value.dtype != np.dtype(leaf.dtype):
            problems.append(
                f"{'/'.join(keys)} reads as {value.shape} {value.dtype}, saved as "
                f"{tuple(leaf.shape)} {np.dtype(leaf.dtype)}"
            )
    return problems


def saved_leaves(tree, prefix=()):
    """[(key tuple, metadata)] of a nested metadata dict, in sorted key order."""
    out = []
    for k in sorted(tree):
        if isinstance(tree[k], dict):
            out += saved_leaves(tree[k], prefix + (k,))
        else:
            out.append((prefix + (k,), tree[k]))
    return out


def saved_step(mgr, step: int | None) -> tuple[int, dict]:
    """(step, nested dict of per-leaf metadata: shape, dtype, sharding) of complete checkpoint
    `step` (the latest complete one when None), or a ZeroError saying what is wrong."""
    steps = complete_steps(mgr)
    step = (steps[-1] if steps else None) if step is None else int(step)
    if step is not None and step in mgr.all_steps() and step not in steps:
        raise UnreadableStep(
            f"checkpoint step {step} in {mgr.directory} is incomplete: it has no "
            f"{', '.join(missing_files(str(mgr.directory), step))} (a save or copy cut short?). "
            f"Complete steps: {steps}."
        )
    if step is None or step not in steps:
        raise ZeroError(
            f"no complete checkpoint {'' if step is None else step} in "
            f"{mgr.directory} (complete steps there: {steps})."
        )
    try:
        meta = mgr.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 - unreadable metadata
        raise UnreadableStep(
            f"checkpoint step {step} in {mgr.directory}: its metadata does not read "
            f"({type(e).__name__}: {str(e)[:200]})."
        ) from None
    return step, getattr(meta, "tree", meta)


def move_aside(mgr, good: list[int]) -> list[str]:
    """Move every step directory of `mgr` not in `good` (the complete steps), or whose metadata
    does not read, into `DIR/skipped/` (process 0 moves, every process waits for it)."""
    bad = [s for s in mgr.all_steps() if s not in good]
    for s in good:
        try:
            mgr.item_metadata(s)
        except Exception:  # noqa: BLE001 - unreadable metadata: it would not restore
            bad.append(s)
    moved = []
    if jax.process_index() == 0:
        aside = os.path.join(str(mgr.directory), "skipped")
        os.makedirs(aside, exist_ok=True)
        for s in sorted(bad):
            target = os.path.join(aside, str(s))
            while os.path.exists(target):
                target += "+"
            os.rename(os.path.join(str(mgr.directory), str(s)), target)
            moved.append(target)
    if jax.process_count() > 1:  # the others look at the directory after the moves
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("zerojax checkpoint cleanup")
    return moved
