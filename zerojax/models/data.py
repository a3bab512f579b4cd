"""An embedded default corpus that exists on every machine: the Python standard library's own
source files, as byte tokens (vocabulary 256)."""
from __future__ import annotations

import os

import numpy as np


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


def random_windows(tokens: np.ndarray, steps: int, batch_size: int, seq_len: int,
                   seed: int = 0) -> list[np.ndarray]:
    """`steps` batches of `batch_size` random windows of `seq_len + 1` tokens (int32)."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - seq_len - 1, (steps, batch_size))
    return [tokens[s[:, None] + np.arange(seq_len + 1)].astype(np.int32) for s in starts]
