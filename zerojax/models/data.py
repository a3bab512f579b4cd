"""Byte-level token data for the example LM: an embedded default that exists on every machine
(the Python standard library's own source files), the user's text files, or pre-tokenized
uint16 token files, with a fixed held-out split and deterministic batches by step.
"""

from __future__ import annotations

import glob
import os

import numpy as np

HELD_OUT = 0.05  # the last 5% of the tokens: never trained on


def stdlib_tokens(limit_bytes: int = 4 << 20) -> np.ndarray:
    """uint8 tokens from the running interpreter's standard-library `.py` files (sorted by name,
    at most about `limit_bytes`)."""
    root = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and size < limit_bytes:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            size += len(chunks[-1])
    return np.frombuffer(b"".join(chunks), np.uint8)


def random_windows(
    tokens: np.ndarray, steps: int, batch_size: int, seq_len: int, seed: int = 0
) -> list[np.ndarray]:
    """`steps` batches of `batch_size` random windows of `seq_len + 1` tokens (int32)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len - 1, (steps, batch_size))
    return [tokens[s[:, None] + np.arange(seq_len + 1)].astype(np.int32) for s in starts]


def load_tokens(spec: str | None) -> tuple[np.ndarray, str]:
    """(tokens, description): the embedded default when `spec` is None; `.bin`/`.npy` files of
    uint16 tokens (memory-mapped, never read whole); otherwise text files or globs as bytes."""
    if spec is None:
        return stdlib_tokens(), "Python standard library source (embedded default), bytes"
    paths = sorted(p for pattern in spec.split(",") for p in glob.glob(os.path.expanduser(pattern)))
    if not paths:
        raise FileNotFoundError(f"--data {spec!r} matches no file.")
    if all(p.endswith((".bin", ".npy")) for p in paths):
        if len(paths) > 1:
            raise ValueError("give one pre-tokenized uint16 file (concatenate them first).")
        mm = (
            np.load(paths[0], mmap_mode="r")
            if paths[0].endswith(".npy")
            else np.memmap(paths[0], np.uint16, mode="r")
        )
        return mm, f"{paths[0]} (uint16 tokens, memory-mapped)"
    data = b"".join(open(p, "rb").read() for p in paths)
    return np.frombuffer(data, np.uint8), f"{len(paths)} text file(s), bytes"


class Batches:
    """Deterministic batches: batch `position` holds `global_batch` random windows drawn from
    the training split by a generator seeded with (seed, position), so a run resumed at any
    position sees exactly what an uninterrupted one saw. `rows` selects this process's slice
    of the global batch; only those windows are read."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int = 0):
        split = int(len(tokens) * (1 - HELD_OUT))
        if split < 2 * (seq_len + 1):
            raise ValueError(f"{len(tokens)} tokens are too few for seq_len {seq_len}.")
        self.train, self.held_out = tokens[:split], tokens[split:]
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed

    def _windows(self, tokens, rng, n, rows):
        starts = rng.integers(0, len(tokens) - self.seq_len - 1, n)[rows]
        return np.stack([np.asarray(tokens[s : s + self.seq_len + 1]) for s in starts]).astype(
            np.int32
        )

    def train_batch(self, position: int, rows=slice(None)) -> np.ndarray:
        rng = np.random.default_rng((self.seed, position))
        return self._windows(self.train, rng, self.global_batch, rows)

    def eval_batches(self, count: int, rows=slice(None)) -> list[np.ndarray]:
        """The same `count` held-out batches every time (fixed seed)."""
        rng = np.random.default_rng((self.seed, 1 << 40))  # apart from any position
        return [self._windows(self.held_out, rng, self.global_batch, rows) for _ in range(count)]
