"""Compiling for a TPU slice with no TPU present (libtpu, ahead of time): `zero.report` on a mesh
of `zj.tpu_devices('v5e:2x4')` and `zerojax plan --topology` give the TPU compiler's per-device
bytes, asserted against the ZeRO formulas (Ψ = parameters, N = 8, fp32 params and Adam: 4 bytes
param + 8 optimizer per parameter at rest). The tests that compile need the `tpu` extra
(`pip install 'zerojax[tpu]'`, which CI's newest lane installs); the error without it runs
everywhere."""

import importlib.util
import json
import subprocess
import sys

import jax
import optax
import pytest
from common import make_init, subprocess_env, train_step
from test_report import CFG, N, block_params, report  # the same model and formulas

import zerojax as zj
from zerojax.models import GPT

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install 'zerojax[tpu]'; CI's newest lane has it)",
)


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(zj.ZeroError, match=r"pip install 'zerojax\[tpu\]'"):
        zj.tpu_devices("v5e:2x4")


@needs_libtpu
def test_a_bad_topology_name_is_named():
    with pytest.raises(zj.ZeroError, match="'v5e:3x3'.*e.g. 'v5e:2x4'"):
        zj.tpu_devices("v5e:3x3")


@needs_libtpu
@pytest.mark.parametrize(
    "stage,formula",
    [
        (0, lambda psi: 12 * psi),  # everything replicated
        (3, lambda psi: 12 * psi / N),  # everything sharded
    ],
)
def test_report_for_a_tpu_slice_follows_the_formulas(stage, formula):
    zero = zj.zero_shard(stage=stage, mesh=zj.make_mesh(zj.tpu_devices("v5e:2x4")))
    state = zero.eval_shape(make_init(optax.adam(1e-3), GPT(CFG), CFG), jax.random.key(0))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    tokens = jax.ShapeDtypeStruct((N, CFG.seq_len), "int32")  # one sequence per chip
    batch = {"inputs": tokens, "targets": tokens}
    rep = zero.report(zero(train_step), state, batch)
    total = sum(rep.resident.values())
    assert abs(total - formula(psi)) <= 0.02 * formula(psi) + rep.kept_replicated, (total, psi)
    assert rep.peak_bytes > total and rep.peak is not None  # TPU live ranges were read
    # the partitioned module's matmuls: the same FLOPs per chip as per CPU device (test_report)
    assert rep.matmul_flops == report(stage)[0].matmul_flops > 0
    if stage == 0:  # one fp32 model of gradients, all-reduced
        assert rep.bytes_of("all-reduce") == pytest.approx(4 * psi, rel=0.01)
        return
    blocks = block_params(state.params)
    # read from the TPU partitioner's module, the same bytes as on CPU
    # (test_report): blocks gathered in forward and backward, the rest once; fp32
    assert rep.bytes_of("all-gather") == pytest.approx(4 * (psi + blocks), rel=0.01)
    assert rep.bytes_of("reduce-scatter") == pytest.approx(4 * psi, rel=0.01)
    # the scheduled program (after the TPU's combiners) gathers the same elements, in bf16:
    # at default matmul precision the TPU compiler converts the fp32 weights before gathering
    # them (half the partitioned module's bytes); its async gathers run beside matmuls
    gathered = [s.collective for s in rep.scheduled if s.collective.kind == "all-gather"]
    size = {"bf16": 2, "f32": 4}
    assert sum(c.buffer_bytes / size[c.dtype] for c in gathered) == rep.bytes_of("all-gather") / 4
    assert sum(c.buffer_bytes for c in gathered) < rep.bytes_of("all-gather")
    hidden, exposed = rep.overlap
    assert 0 < hidden < hidden + exposed
    assert hidden == sum(s.collective.sent_bytes for s in rep.scheduled if s.overlapped)


@needs_libtpu
def test_plan_for_a_tpu_topology_prints_every_stage():
    run = lambda *args: subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.commands.cli",
            "plan",
            "--preset",
            "tiny",
            "--no-offload",
            *args,
        ],
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run("--topology", "v5e:2x4", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [(r["stage"], r["target"]) for r in rows] == [(s, "tpu v5e:2x4") for s in range(4)]
    psi = rows[0]["params"]
    # bf16 params + fp32 master + Adam: 14Ψ at stage 0, 14Ψ/N at stage 3 (small leaves whole)
    assert rows[0]["at_rest_bytes"] == pytest.approx(14 * psi, rel=1e-3)
    assert rows[3]["at_rest_bytes"] == pytest.approx(14 * psi / N, rel=0.03)
    assert all(r["comm_sent_bytes"] > 0 for r in rows)
    assert rows[3]["overlapped_sent_bytes"] > 0  # the TPU schedule overlaps stage 3's gathers
    wrong = run("--topology", "v5e:2x4", "--devices", "4")
    assert wrong.returncode == 2 and "has 8 chips: leave --devices out" in wrong.stderr


@needs_libtpu
def test_a_heads_kernels_gradient_is_reduce_scattered_not_all_reduced():
    # a user's attention with q/k/v kernels `[d, heads, head_dim]` (nn.DenseGeneral), split on
    # `d`: libtpu lays their gradients out `d` minor and, reduce-scattered in that shape, ran
    # each as an all-reduce and a slice (twice the bytes, the whole gradient alive); zerojax's
    # reduce-scatter moves the `[d, heads * head_dim]` view, which libtpu scatters as rows
    import flax.linen as nn
    import jax.numpy as jnp
    from flax.training import train_state

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            heads = lambda name: nn.DenseGeneral((12, 64), name=name)(x)  # noqa: E731
            q, k, v = heads("q"), heads("k"), heads("v")
            weights = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / 8.0, axis=-1)
            out = jnp.einsum("bhts,bshd->bthd", weights, v)
            return x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out")(out)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Attention()(x)
            return x

    x = jnp.zeros((N, 128, 768))  # 12 heads of 64, as the 125m preset's
    zero = zj.zero_shard(stage=3, mesh=zj.make_mesh(zj.tpu_devices("v5e:2x4")))
    state = zero.eval_shape(
        lambda key: train_state.TrainState.create(
            apply_fn=Model().apply,
            params=Model().init(key, x[:1])["params"],
            tx=optax.adam(1e-3),
        ),
        jax.random.key(0),
    )

    def step(state, batch):
        loss = lambda p: jnp.mean(state.apply_fn({"params": p}, batch) ** 2)  # noqa: E731
        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rep = zero.report(zero(step), state, jax.ShapeDtypeStruct(x.shape, x.dtype))
    kernel = 4 * 768 * 12 * 64  # one q/k/v/out kernel's fp32 gradient, bytes
    reduced = [(s.collective.kind, s.collective.buffer_bytes) for s in rep.scheduled]
    # the 4 kernels of each of the 2 layers, reduce-scattered; only the small biases all-reduced
    assert reduced.count(("reduce-scatter", kernel)) == 8, reduced
    assert not [b for kind, b in reduced if kind == "all-reduce" and b >= kernel / N], reduced


@needs_libtpu
def test_libtpu_runs_a_gradient_all_reduce_issued_in_backward_synchronously():
    # why stage 0 all-reduces its gradients after the whole backward instead of each layer's as
    # backward leaves it (DDP's buckets): libtpu (0.0.52, v5e) runs every all-reduce
    # synchronously, so a bucket issued in backward hides nothing behind the layers' backward
    # matmuls, even kept apart from the others (a chained dependency: libtpu otherwise combines
    # them into one at the end). Once this fails, buckets would overlap there: build them.
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from zerojax.inspect.schedule import overlap_bytes, scheduled_collectives

    mesh = Mesh(np.array(zj.tpu_devices("v5e:2x4")), ("data",))
    issued = []
    dense = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    per_device = lambda w: jax.lax.pcast(w, ("data",), to="varying")  # noqa: E731

    @jax.custom_vjp
    def layer(w, x):
        return dense(per_device(w), x)

    def forward(w, x):
        return jax.vjp(dense, per_device(w), x)

    def backward(vjp, ct):
        dw, dx = vjp(ct)
        if issued:  # the next layer's backward waits for the one before's all-reduce
            dx = dx + 0 * issued[-1].reshape(-1)[0]
        issued.append(jax.lax.psum(dw, "data"))
        return issued[-1], dx

    layer.defvjp(forward, backward)

    def grads(ws, x):
        def loss(ws):
            out = x
            for w in ws:
                out = layer(w, out)
            return jnp.mean(out**2)

        return jax.grad(loss)(ws)

    step = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=replicated)] * 8
    x = jax.ShapeDtypeStruct((8 * 512, 1024), jnp.float32, sharding=rows)
    scheduled = scheduled_collectives(step.lower(ws, x).compile().as_text(), 8)
    assert {s.collective.kind for s in scheduled} == {"all-reduce"}
    assert sum(s.first for s in scheduled) > 1  # kept apart, not combined into one at the end
    hidden, exposed = overlap_bytes(scheduled)
    assert hidden == 0 and exposed == 8 * 4 * 2**20 * 7 / 4, (hidden, exposed)  # 8 x 4 MiB, ring
