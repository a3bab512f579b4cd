"""The example's data: the embedded default, text globs, uint16 token files (memory-mapped),
a fixed held-out split, and batches that depend only on (seed, position) and the rows asked."""

import numpy as np
import pytest

from zerojax.models.data import HELD_OUT, Batches, load_tokens


def test_sources(tmp_path):
    tokens, what = load_tokens(None)
    assert tokens.dtype == np.uint8 and len(tokens) > 1 << 20 and "standard library" in what
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b.txt").write_bytes(b"world")
    text, _ = load_tokens(str(tmp_path / "*.txt"))
    assert bytes(text) == b"hello world"
    ids = np.arange(1000, dtype=np.uint16) * 60
    ids.tofile(tmp_path / "ids.bin")
    mapped, what = load_tokens(str(tmp_path / "ids.bin"))
    assert isinstance(mapped, np.memmap) and np.array_equal(mapped, ids) and "uint16" in what
    with pytest.raises(FileNotFoundError, match="matches no file"):
        load_tokens(str(tmp_path / "nothing*.txt"))


def test_batches_are_deterministic_split_and_sliced():
    tokens = np.arange(10_000, dtype=np.uint16)
    data = Batches(tokens, seq_len=16, global_batch=8, seed=3)
    assert len(data.held_out) == int(round(len(tokens) * HELD_OUT))
    full = data.train_batch(5)
    assert full.shape == (8, 17) and full.dtype == np.int32
    assert np.array_equal(full, Batches(tokens, 16, 8, seed=3).train_batch(5))  # by position
    assert np.array_equal(data.train_batch(5, slice(4, 8)), full[4:])  # a process's rows
    assert full.max() < len(data.train)  # never the held-out tokens
    assert np.all(np.diff(full, axis=1) == 1)  # contiguous windows
    evals = data.eval_batches(2)
    assert all(b.min() >= len(data.train) for b in evals)
    assert np.array_equal(evals[0], data.eval_batches(2)[0])
