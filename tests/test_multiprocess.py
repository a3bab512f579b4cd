"""2 processes x 4 devices (jax.distributed, gloo on 127.0.0.1) train exactly like
1 process x 8 devices, every stage, each process feeding only its slice of the batch."""

import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from common import assert_trees_close, batches, subprocess_env, train_zero, zeropp_setup

import zerojax as zj
from zerojax.commands.launch import free_port

STEPS = 4


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mp") / "results.npz")
    port = free_port()
    worker = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
    env = subprocess_env()
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(i), str(port), out, str(STEPS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run did not finish in 600 s")
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return dict(np.load(out))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_processes_match_one_process(two_process_results, stage):
    zero = zj.zero_shard(stage=stage, persistence_threshold=0)
    state, losses = train_zero(zero, optax.sgd(0.05, momentum=0.9), batches(STEPS))
    np.testing.assert_allclose(two_process_results[f"losses_{stage}"], losses, rtol=1e-5, atol=1e-6)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        got = two_process_results[f"param_{stage}_{jax.tree_util.keystr(path)}"]
        assert_trees_close({jax.tree_util.keystr(path): got}, {jax.tree_util.keystr(path): leaf})


def test_zeropp_two_processes_as_nodes_match_one_process(two_process_results):
    # one process per node: qwZ + hpZ + qgZ on (node=2, local=4) across real processes
    init_fn, step_fn, data, options = zeropp_setup(STEPS)
    zero = zj.zero_shard(mesh=zj.make_mesh(local=4), **options)
    state, step, losses = zero.init(init_fn, jax.random.key(0)), zero(step_fn), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(two_process_results["losses_zeropp"], losses, rtol=1e-4)
