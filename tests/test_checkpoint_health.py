"""Checkpoint directories as people leave them: a stray step directory, a truncated array file
or a step without its metadata beside a good step is skipped with one warning, `zerojax
checkpoint verify` names each bad step, a changed model is named leaf by leaf (or restored in
part), and every process of a multi-process run restores the same step."""

import os
import shutil
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

import zerojax as zj
from zerojax.commands.launch import free_port
from zerojax.io.checkpoint import canonical_tree

sys.path.insert(0, os.path.dirname(__file__))
from checkpoint_worker import ZERO, batch, init_fn, train_step  # noqa: E402
from common import subprocess_env  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
ABSTRACT = jax.eval_shape(init_fn, jax.random.key(0))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Steps 2 and 3 of the worker's run, saved from 8 devices; and the state at step 3."""
    directory = tmp_path_factory.mktemp("health") / "run"
    zero = zj.zero_shard(**ZERO)
    state, step = zero.init(init_fn, jax.random.key(0)), zero(train_step)
    with zj.CheckpointManager(directory, zero, async_save=False) as ckpt:
        for i in range(3):
            state, _ = step(state, batch(i))
            if i >= 1:
                ckpt.save(i + 1, state, extra={"data_position": i + 1}, force=True)
    return directory, jax.device_get(canonical_tree(state))


def _copy(good, tmp_path) -> str:
    target = tmp_path / "run"
    shutil.copytree(good[0], target)
    return str(target)


def _stray(d):  # a directory that looks like a step: rsync of a new step cut short
    os.makedirs(os.path.join(d, "7"))
    open(os.path.join(d, "7", "stray.txt"), "w").write("x")


def _truncated(d):  # step 5 whose array files were cut short by a full disk
    shutil.copytree(os.path.join(d, "3"), os.path.join(d, "5"))
    for root, _, files in os.walk(os.path.join(d, "5", "state")):
        for f in files:
            if os.sep + "d" + os.sep in os.path.join(root, f) + os.sep and "d" in root.split(
                os.sep
            ):
                open(os.path.join(root, f), "r+b").truncate(10)


def _no_metadata(d):  # step 6 copied without the file orbax writes last
    shutil.copytree(os.path.join(d, "3"), os.path.join(d, "6"))
    os.remove(os.path.join(d, "6", "_CHECKPOINT_METADATA"))


BREAKS = {"stray 7/": _stray, "truncated 5": _truncated, "no metadata 6": _no_metadata}


@pytest.mark.parametrize("name", BREAKS)
def test_a_bad_newer_step_is_skipped_with_one_warning(good, tmp_path, name):
    d = _copy(good, tmp_path)
    BREAKS[name](d)
    ckpt = zj.CheckpointManager(d, zj.zero_shard(**ZERO))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, extra = ckpt.restore(ABSTRACT)
    said = [str(w.message) for w in caught if issubclass(w.category, zj.ZeroWarning)]
    assert extra == {"data_position": 3} and len(said) == 1
    assert "restored checkpoint step 3" in said[0] and name.split()[-1].strip("/") in said[0]
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, jax.device_get(canonical_tree(state)), good[1]
    )
    bad = int(name.split()[-1].strip("/"))
    with pytest.raises(
        zj.ZeroError, match=f"checkpoint step {bad} in .* (incomplete|does not read)"
    ):
        ckpt.restore(ABSTRACT, step=bad)
    assert os.path.isdir(os.path.join(d, str(bad)))  # nothing deleted
    ckpt.close()


def test_verify_names_each_bad_step_and_fails(good, tmp_path):
    d = _copy(good, tmp_path)
    for make in BREAKS.values():
        make(d)
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "zerojax.commands.cli", "checkpoint", "verify", d, *a],
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
    )
    out = run()
    assert out.returncode == 1, out.stderr[-2000:]
    lines = out.stdout
    assert "step 2: ok" in lines and "step 3: ok" in lines
    assert "step 5: BAD" in lines and "step 6: BAD" in lines and "step 7: BAD" in lines
    assert "no _CHECKPOINT_METADATA" in lines and "does not read" in lines
    assert run("--step", "3").returncode == 0


def test_a_renamed_parameter_is_named_and_the_rest_restores_bitwise(good, tmp_path):
    zero = zj.zero_shard(**ZERO)

    def renamed(key):  # the model's final norm renamed: a new head for fine-tuning
        state = init_fn(key)
        params = dict(state.params)
        params["head_norm"] = params.pop("final_norm")
        return state.replace(params=params, opt_state=state.tx.init(params))

    ckpt = zj.CheckpointManager(good[0], zero)
    with pytest.raises(
        zj.ZeroError,
        match="missing from the checkpoint .*params/head_norm/scale.*"
        "in the checkpoint, not the target .*params/final_norm/scale.*partial=True",
    ):
        ckpt.restore(jax.eval_shape(renamed, jax.random.key(0)))
    fresh = zero.init(renamed, jax.random.key(1))
    state, _ = ckpt.restore(fresh, step=3, partial=True)
    got, want = jax.device_get(canonical_tree(state)), good[1]
    np.testing.assert_array_equal(
        got["params"]["head_norm"]["scale"],
        jax.device_get(canonical_tree(fresh))["params"]["head_norm"]["scale"],
    )
    np.testing.assert_array_equal(
        got["params"]["embed"]["embedding"], want["params"]["embed"]["embedding"]
    )
    ckpt.close()


def test_two_processes_restore_the_same_step_when_their_views_differ(good, tmp_path):
    """Process 1's directory also holds a step 9 that process 0's does not: both restore 3."""
    views = [tmp_path / "p0", tmp_path / "p1"]
    for view in views:
        shutil.copytree(good[0], view)
    shutil.copytree(views[1] / "3", views[1] / "9")
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                str(views[i]),
                os.devnull,
                "0",
                "--mp",
                str(i),
                str(port),
                "--restore-only",
            ],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "restored 3 step-counter 3" in out, out[-2000:]
