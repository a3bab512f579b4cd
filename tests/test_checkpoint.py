"""Checkpoints: restore onto any mesh / stage / precision / offload, exact resume after SIGKILL,
a final save on SIGTERM, 2 processes saving for 1 to restore, consolidated export."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import zerojax as zj
from zerojax.commands.launch import free_port
from zerojax.io.checkpoint import canonical_tree
from zerojax.io.export import export, info

sys.path.insert(0, os.path.dirname(__file__))
from checkpoint_worker import ZERO, batch, init_fn, train_step  # noqa: E402
from common import assert_trees_close, slow, subprocess_env  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
ABSTRACT = jax.eval_shape(init_fn, jax.random.key(0))


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def _assert_equal(got, want):
    flat = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(got)[0]:
        np.testing.assert_array_equal(leaf, flat[path], err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint from 8 devices, stage 3, bf16 + offload_optimizer, after 2 steps."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    zero = zj.zero_shard(**ZERO)
    state, step = zero.init(init_fn, jax.random.key(0)), zero(train_step)
    for i in range(2):
        state, _ = step(state, batch(i))
    with zj.CheckpointManager(directory, zero) as ckpt:
        ckpt.save(2, state, extra={"data_position": 2})
    return directory, _host(canonical_tree(state))


# every stage, every device count of 1, 2 and 4 and every precision and offload, not all their
# combinations; the slow lane adds two more
TARGETS = [
    (1, dict(stage=0)),
    (2, dict(stage=3)),
    (4, dict(stage=2)),
    (4, dict(stage=1, offload_optimizer="cpu")),
    (2, dict(stage=2, precision="bf16", offload_optimizer="cpu")),
    (4, dict(stage=3, precision="fp16", offload_optimizer="cpu", offload_param="cpu")),
]
SLOW_TARGETS = [(4, dict(stage=1)), (2, dict(stage=0))]


@pytest.mark.parametrize(
    "devices,options",
    TARGETS + slow(*SLOW_TARGETS),
    ids=[
        f"{n}dev-" + "-".join(f"{k}={v}" for k, v in o.items()) for n, o in TARGETS + SLOW_TARGETS
    ],
)
def test_restores_onto_any_mesh_stage_precision_offload(saved, devices, options):
    directory, truth = saved
    zero = zj.zero_shard(
        mesh=zj.make_mesh(jax.devices()[:devices]), persistence_threshold=0, **options
    )
    state, extra = zj.CheckpointManager(directory, zero).restore(ABSTRACT)
    assert extra == {"data_position": 2} and int(state.step) == 2
    _assert_equal(_host(canonical_tree(state)), truth)  # fp32 master, Adam, RNG: bitwise
    for leaf, want in zip(
        jax.tree_util.tree_leaves(state),
        jax.tree_util.tree_leaves(zero.state_shardings(state)),
        strict=True,
    ):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)  # laid out by THIS zero
        assert leaf.sharding.memory_kind == (want.memory_kind or "device")
    state, metrics = zero(train_step)(state, batch(2))  # and it trains on
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize(
    "options",
    [
        dict(
            precision="bf16", quantized_weights=True, hpz_partition_size=4, quantized_gradients=True
        ),
        dict(mics_shard_size=4),
    ],
    ids=["zeropp", "mics"],
)
def test_restores_onto_a_node_local_mesh(saved, options):
    directory, truth = saved
    zero = zj.zero_shard(stage=3, persistence_threshold=0, **options)  # mesh (node 2, local 4)
    state, _ = zj.CheckpointManager(directory, zero).restore(ABSTRACT)
    _assert_equal(_host(canonical_tree(state)), truth)
    state, metrics = zero(train_step)(state, batch(2))
    assert np.isfinite(float(metrics["loss"]))


def test_fp32_restore_gives_the_same_next_loss_everywhere(saved):
    directory, _ = saved
    losses = {}
    for devices, stage in ((8, 3), (8, 0), (1, 0), (4, 2)):
        zero = zj.zero_shard(stage=stage, mesh=zj.make_mesh(jax.devices()[:devices]))
        state, _ = zj.CheckpointManager(directory, zero).restore(ABSTRACT)
        losses[(devices, stage)] = float(zero(train_step)(state, batch(2))[1]["loss"])
    # the same device count: bitwise; other counts sum the loss in another order (1 ulp-ish)
    assert losses[(8, 3)] == losses[(8, 0)]
    np.testing.assert_allclose(list(losses.values()), losses[(8, 3)], rtol=1e-6)


def test_restore_errors_are_clear(tmp_path, saved):
    zero = zj.zero_shard(stage=1)
    with pytest.raises(zj.ZeroError, match="no complete checkpoint"):
        zj.CheckpointManager(tmp_path / "empty", zero).restore(ABSTRACT)
    other = jax.eval_shape(
        lambda k: init_fn(k).replace(
            params=jax.tree_util.tree_map(lambda x: x[..., :1], init_fn(k).params)
        ),
        jax.random.key(0),
    )
    with pytest.raises(zj.ZeroError, match=r"does not match the target state.*reshaped"):
        zj.CheckpointManager(saved[0], zero).restore(other)
    accum = zj.zero_shard(stage=1, gradient_accumulation_steps=2)
    state = accum.init(init_fn, jax.random.key(0))
    state, _ = accum(train_step)(state, batch(0))
    with pytest.raises(zj.ZeroError, match="middle of gradient accumulation"):
        zj.CheckpointManager(tmp_path / "a", accum).save(1, state)


def _losses(path) -> dict:
    """{step: loss repr}, the last line per step winning (a resumed run redoes steps)."""
    out = {}
    for line in open(path).read().split("\n"):
        if line.count(" ") == 1:
            step, loss = line.split()
            out[int(step)] = loss
    return out


def _worker(*args, **kwargs):
    env = subprocess_env()
    return subprocess.Popen(
        [sys.executable, WORKER, *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def _wait_for(proc, word: str, timeout: float = 300, finished_ok: bool = False):
    """The worker's first output line starting with `word` (None if it finished first and
    `finished_ok`)."""
    deadline, seen = time.time() + timeout, []
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            if finished_ok and proc.wait() == 0:
                return None
            break
        seen.append(line)
        if line.startswith(word):
            return line
    raise AssertionError(f"worker never printed {word!r}:\n" + "".join(seen[-40:]))


@pytest.mark.parametrize("kills", [4, pytest.param(10, marks=pytest.mark.slow)])
def test_sigkill_at_random_moments_then_resume_bitwise(tmp_path, kills):
    steps = 30
    reference = _worker(tmp_path / "ref", tmp_path / "ref.txt", steps)
    assert reference.wait(timeout=600) == 0, reference.stdout.read()[-3000:]
    rng, killed = random.Random(0), 0
    for _ in range(kills):
        proc = _worker(tmp_path / "run", tmp_path / "run.txt", steps)
        if _wait_for(proc, "ready", finished_ok=True) is None:
            continue  # it had finished: nothing left to kill
        time.sleep(rng.uniform(0.0, 0.8))  # then kill mid-step or mid-save
        proc.send_signal(signal.SIGKILL)
        killed += proc.wait() == -signal.SIGKILL
    assert killed >= kills - 2  # (a kill may land after the last step)
    final = _worker(tmp_path / "run", tmp_path / "run.txt", steps)
    assert final.wait(timeout=600) == 0, final.stdout.read()[-3000:]
    assert _losses(tmp_path / "run.txt") == _losses(tmp_path / "ref.txt")  # bitwise
    leftovers = [d for d in os.listdir(tmp_path / "run") if not d.isdigit()]
    assert not [d for d in leftovers if "tmp" in d], leftovers  # partial saves cleaned up
    zero = zj.zero_shard(**ZERO)  # and the final states are bitwise the same
    final = [
        _host(canonical_tree(zj.CheckpointManager(tmp_path / d, zero).restore(ABSTRACT)[0]))
        for d in ("run", "ref")
    ]
    _assert_equal(*final)


def test_sigterm_makes_a_final_save_and_stops(tmp_path):
    proc = _worker(tmp_path / "run", tmp_path / "run.txt", 10_000, "--preempt")
    _wait_for(proc, "step 3")
    proc.send_signal(signal.SIGTERM)
    stopped = int(_wait_for(proc, "preempted at").split()[-1])
    assert proc.wait(timeout=120) == 0
    # the interval (1000) would not have saved it: the SIGTERM did (orbax saves a first step)
    assert zj.CheckpointManager(tmp_path / "run", zj.zero_shard(**ZERO)).latest_step() == stopped


def test_two_processes_save_one_process_restores(tmp_path):
    port, steps = free_port(), 3
    procs = [
        _worker(tmp_path / "mp", tmp_path / f"mp{i}.txt", steps, "--mp", i, port) for i in range(2)
    ]
    for p in procs:
        out = p.communicate(timeout=600)[0]
        assert p.returncode == 0, out[-3000:]
    zero = zj.zero_shard(**ZERO)  # 1 process x 8 devices, trained the same way
    state, step = zero.init(init_fn, jax.random.key(0)), zero(train_step)
    for i in range(steps):
        state, _ = step(state, batch(i))
    restored, extra = zj.CheckpointManager(tmp_path / "mp", zero).restore(ABSTRACT)
    assert extra == {"data_position": steps}
    got, want = _host(canonical_tree(restored)), _host(canonical_tree(state))
    assert_trees_close(got, want)  # 2 x 4 devices vs 1 x 8: per-leaf relative L2


def test_export_and_info(saved, tmp_path):
    directory, truth = saved
    export(directory, str(tmp_path / "p.safetensors"), dtype="fp32")
    export(directory, str(tmp_path / "p.msgpack"), dtype="bf16")
    raw = open(tmp_path / "p.safetensors", "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    flat = {
        ".".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(truth["params"])[0]
    }
    assert set(flat) == set(header) - {"__metadata__"}
    for name, want in flat.items():  # the fp32 master weights, bitwise
        begin, end = header[name]["data_offsets"]
        got = np.frombuffer(raw[8 + n + begin : 8 + n + end], np.float32).reshape(want.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)
    from flax import serialization

    bf16 = serialization.msgpack_restore(open(tmp_path / "p.msgpack", "rb").read())
    for path, leaf in jax.tree_util.tree_flatten_with_path(bf16)[0]:
        want = flat[".".join(str(k.key) for k in path)]
        np.testing.assert_array_equal(leaf, want.astype(leaf.dtype))
    summary = info(directory)
    assert summary["steps"] == [2] and summary["extra"] == {"data_position": 2}
    assert summary["total_bytes"] == sum(leaf["bytes"] for leaf in summary["leaves"])
    out = subprocess.run(
        [sys.executable, "-m", "zerojax.commands.cli", "checkpoint", "info", str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "params/embed/embedding" in out.stdout


def test_export_streams_leaf_by_leaf():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from export_memory import measure

    result = measure()
    # 1 GiB of parameters, 64 MiB largest leaf: above what `checkpoint info` needs (interpreter,
    # jax, orbax: ~200 MiB, more or less by machine) the export holds a few copies of one leaf
    # (about 2 measured), never the model
    assert result["total_bytes"] == 2**30 and result["file_bytes"] > 2**30
    above = result["export_peak_rss_bytes"] - result["baseline_rss_bytes"]
    assert above < 4 * result["largest_leaf_bytes"], above
