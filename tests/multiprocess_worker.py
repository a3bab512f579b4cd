"""One process of a real multi-controller run (gloo collectives on 127.0.0.1), launched by
test_multiprocess.py: trains every stage for a few steps, each process passing only its own
slice of the global batch, and (process 0) writes losses and final parameters to an .npz."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from common import batches, make_init, train_step, zeropp_setup  # noqa: E402

import zerojax as zj  # noqa: E402


def main(process_id: int, port: int, out: str, steps: int):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    results = {}
    for stage in range(4):
        zero = zj.zero_shard(stage=stage, persistence_threshold=0)
        state = zero.init(make_init(optax.sgd(0.05, momentum=0.9)), jax.random.key(0))
        step = zero(train_step)
        losses = []
        for batch in batches(steps):
            half = len(batch["inputs"]) // 2  # this process's rows of the global batch
            local = {k: v[process_id * half : (process_id + 1) * half] for k, v in batch.items()}
            state, metrics = step(state, local)
            losses.append(float(metrics["loss"]))
        results[f"losses_{stage}"] = np.array(losses)
        params = multihost_utils.process_allgather(state.params, tiled=True)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            results[f"param_{stage}_{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    results.update(train_zeropp(process_id, steps))
    if process_id == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


def train_zeropp(process_id, steps):
    init_fn, step_fn, data, options = zeropp_setup(steps)
    zero = zj.zero_shard(mesh=zj.make_mesh(local=jax.local_device_count()), **options)
    state, step, losses = zero.init(init_fn, jax.random.key(0)), zero(step_fn), []
    for batch in data:
        state, metrics = step(state, batch[process_id * 8 : (process_id + 1) * 8])
        losses.append(float(metrics["loss"]))
    return {"losses_zeropp": np.array(losses)}


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
