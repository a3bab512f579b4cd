"""Compiling for NVIDIA GPUs with no GPU present (the CUDA plugin, ahead of time): `zero.report` on
a mesh of `zj.gpu_devices('h100:8')` and `zerojax plan --topology h100:8` give XLA:GPU's own
program, asserted against the ZeRO formulas (Ψ = parameters, N = 8, fp32 params and Adam: 4
bytes param + 8 optimizer per parameter at rest; offloaded: 8Ψ/N optimizer state, 4Ψ/N
parameters in host memory) and against an independent count of the compiled module's
collectives. The tests that compile need the `gpu-compile` extra (`pip install
'zerojax[gpu-compile]'`, which CI's accelerator lane installs); the errors without it run
everywhere."""

import importlib.util
import json
import math
import re
import subprocess
import sys

import jax
import optax
import pytest
from common import make_init, subprocess_env, train_step
from test_report import CFG, N, block_params

import zerojax as zj
from zerojax.core.mesh import has_gpu_compiler
from zerojax.models import GPT

needs_plugin = pytest.mark.skipif(
    not has_gpu_compiler(),
    reason="the CUDA plugin is not installed (pip install 'zerojax[gpu-compile]'; CI's "
    "accelerator lane has it)",
)


def test_without_the_plugin_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(zj.ZeroError, match=r"pip install 'zerojax\[gpu-compile\]'"):
        zj.gpu_devices("h100:8")


def test_a_bad_gpu_target_is_named():
    with pytest.raises(zj.ZeroError, match="'h100:0'.*e.g. 'h100:8' or 'h100:2x8'.*b200"):
        zj.gpu_devices("h100:0")
    with pytest.raises(zj.ZeroError, match="'t4:8' is not a GPU target"):
        zj.gpu_devices("t4:8")


@needs_plugin
def test_outside_the_cpu_platform_the_error_says_jax_platforms():
    was = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cuda,cpu")  # read by the check only: backends are up
    try:
        with pytest.raises(zj.ZeroError, match="needs JAX_PLATFORMS=cpu"):
            zj.gpu_devices("h100:8")
    finally:
        jax.config.update("jax_platforms", was)


def _report(stage, **options):
    zero = zj.zero_shard(stage=stage, mesh=zj.make_mesh(zj.gpu_devices("h100:8")), **options)
    state = zero.eval_shape(make_init(optax.adam(1e-3), GPT(CFG), CFG), jax.random.key(0))
    psi = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    tokens = jax.ShapeDtypeStruct((N, CFG.seq_len), "int32")  # one sequence per GPU
    step = zero(train_step)
    return zero, step, state, {"inputs": tokens, "targets": tokens}, psi


def _independent_count(hlo: str) -> list[tuple[str, int]]:
    """(kind, bytes) of each collective launch of a loop-free XLA:GPU module, read another way
    than `schedule` does: each start or synchronous collective is a launch, and its bytes are
    the result of its `-done` (outputs only; a reduce-scatter's buffer is N times its output)."""
    assert " while(" not in hlo  # every instruction runs once
    kinds = "all-gather|reduce-scatter|all-reduce"
    results = {}
    found = []
    for line in hlo.splitlines():
        m = re.match(rf"\s*(?:ROOT )?%(\S+) = (.*) ({kinds})(-start|-done)?\(%([\w.\-]+)", line)
        if not m:
            continue
        name, result, kind, phase, operand = m.groups()
        if phase == "-start":
            results[name] = kind
            continue
        arrays = re.findall(r"f32\[([\d,]*)\]", result)
        nbytes = sum(4 * math.prod(int(d) for d in dims.split(",") if d) for dims in arrays)
        found.append((kind, nbytes * (N if kind == "reduce-scatter" else 1)))
    return found


@needs_plugin
@pytest.mark.parametrize("stage", [0, 3])
def test_report_for_8_h100s_follows_the_formulas_and_an_independent_count(stage):
    from zerojax.inspect.schedule import launches

    zero, step, state, batch, psi = _report(stage)
    rep = zero.report(step, state, batch)
    total = sum(rep.resident.values())
    formula = 12 * psi / (N if stage == 3 else 1)  # fp32 params + Adam's two moments
    assert abs(total - formula) <= 0.02 * formula + rep.kept_replicated, (total, psi)
    assert rep.peak is not None and rep.peak_bytes > total  # XLA:GPU's live ranges were read
    compiled = step.lower(state, batch).compile().as_text()
    # launches and their bytes as the compiled program runs them, counted independently
    assert sorted(launches(rep.scheduled)) == sorted(_independent_count(compiled))
    if stage == 0:  # one fp32 model of gradients all-reduced, in one combined launch
        assert rep.launches == {"all-reduce": 1}
        assert launches(rep.scheduled)[0][1] == pytest.approx(4 * psi, rel=0.01)
        return
    blocks = block_params(state.params)
    gathered = sum(b for kind, b in launches(rep.scheduled) if kind == "all-gather")
    scattered = sum(b for kind, b in launches(rep.scheduled) if kind == "reduce-scatter")
    # blocks gathered in forward and backward, the rest once; every gradient scattered: the
    # same elements as the partitioned module (XLA:GPU keeps the fp32 the step sends)
    assert gathered == pytest.approx(4 * (psi + blocks), rel=0.01) == rep.bytes_of("all-gather")
    assert scattered == pytest.approx(4 * psi, rel=0.01) == rep.bytes_of("reduce-scatter")
    # the combiners turn zerojax's leaf-by-leaf collectives into at most 3 launches per layer
    # (gather forward, gather backward, scatter), the embeddings and head counted as a layer
    assert sum(rep.launches.values()) <= 3 * (CFG.n_layers + 1), rep.launches
    hidden, exposed = rep.overlap
    assert hidden == sum(s.collective.sent_bytes for s in rep.scheduled if s.overlapped)
    ring = {"all-reduce": 2 * 7 / 8}  # bytes one GPU sends per buffer byte; others 7/8
    sent = sum(b * ring.get(kind, 7 / 8) for kind, b in launches(rep.scheduled))
    assert hidden + exposed == pytest.approx(sent)


@needs_plugin
@pytest.mark.parametrize(
    "stage,options,on_host",
    [
        (2, dict(offload_optimizer="cpu"), {"optimizer state": 8}),
        (
            3,
            dict(offload_optimizer="cpu", offload_param="cpu"),
            {"optimizer state": 8, "params": 4},
        ),
    ],
)
def test_offload_compiled_for_h100s_keeps_its_host_memory_and_copies(stage, options, on_host):
    # compile-only GPUs drop memory kinds: the step is lowered on 8 CPU devices and compiled for
    # the GPUs (zerojax.inspect.cross_compile); without that, everything stays on the GPU
    zero, step, state, batch, psi = _report(stage, **options)
    rep = zero.report(step, state, batch)
    for category, per_param in on_host.items():  # bytes per parameter, over N
        assert rep.host_resident[category] == pytest.approx(per_param * psi / N, rel=0.02)
    host = sum(rep.host_resident.values())
    assert rep.host_argument_bytes == host  # XLA:GPU's own memory stats: arguments on the host
    # every offloaded byte comes to the GPU and goes back once per step, as async copies
    copied_in, copied_out = (sum(rep.host_copies[k]) for k in ("host-to-device", "device-to-host"))
    assert copied_in == pytest.approx(host, rel=0.01) and copied_out == pytest.approx(
        host, rel=0.05
    )
    assert rep.peak_bound_bytes == rep.peak_bytes  # the GPU program's temporaries hold them
    plain = _report(stage)
    assert (
        sum(rep.resident.values()) < sum(plain[0].report(*plain[1:4]).resident.values()) - host / 2
    )


@needs_plugin
def test_an_offload_step_never_compiles_for_h100s_without_its_host_memory():
    zero, step, state, batch, _ = _report(3, offload_optimizer="cpu", offload_param="cpu")
    with pytest.raises(zj.ZeroError, match="offload nothing.*zero.report"):
        step.lower(state, batch)  # lowered for the GPUs themselves: no memory kinds
    zero, step, state, batch, _ = _report(2, offload_optimizer="cpu", offload_update="host")
    with pytest.raises(zj.ZeroError, match="offload_update='host' is not compiled"):
        zero.report(step, state, batch)


@needs_plugin
@pytest.mark.parametrize("topology", ["h100:8", "h100:2x8"])
def test_plan_for_h100_nodes_prints_every_stage(topology):
    out = subprocess.run(
        [sys.executable, "-m", "zerojax.commands.cli", "plan", "--preset", "tiny"]
        + ["--no-offload", "--topology", topology, "--json"],
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    gpus = 16 if topology == "h100:2x8" else 8
    zeropp = ["none"] * 4 + (["qwZ+hpZ+qgZ", "MiCS"] if gpus == 16 else [])
    assert [(r["stage"], r["zeropp"], r["target"]) for r in rows] == [
        (s, z, f"gpu {topology}")
        for s, z in zip([0, 1, 2, 3, 3, 3][: len(zeropp)], zeropp, strict=True)
    ]
    psi = rows[0]["params"]
    # bf16 params + fp32 master + Adam: 14Ψ at stage 0, 14Ψ/N at stage 3 (small leaves whole)
    assert rows[0]["at_rest_bytes"] == pytest.approx(14 * psi, rel=1e-3)
    assert rows[3]["at_rest_bytes"] == pytest.approx(14 * psi / gpus, rel=0.03)
    assert all(r["fits"] for r in rows)  # against an H100's 84.9 GB
    assert rows[3]["overlapped_sent_bytes"] > 0  # XLA:GPU overlaps stage 3's gathers
    if gpus == 16:  # two nodes: cross-node bytes counted; hpZ keeps its gathers in the node
        assert rows[4]["cross_node_bytes"] < rows[3]["cross_node_bytes"]


def _plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerojax.commands.cli", "plan", "--preset", "tiny", *argv],
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_gpu_autotune_results_need_a_gpu_target_and_a_file(tmp_path):
    out = _plan("--gpu-autotune", str(tmp_path / "results.textproto"))
    assert out.returncode == 2
    assert "--gpu-autotune needs a GPU --topology" in out.stderr
    if has_gpu_compiler():
        out = _plan("--topology", "h100:8", "--gpu-autotune", str(tmp_path / "missing.txtpb"))
        assert out.returncode == 2 and "missing.txtpb': no such file" in out.stderr


@needs_plugin
def test_plan_compiles_with_autotune_results_from_a_gpu(tmp_path):
    # XLA reads the file (an empty set of results here: a real one comes from bench/gpu.sh)
    results = tmp_path / "autotune.textproto"
    results.write_text("version: 3\n")
    out = _plan(
        "--topology", "h100:8", "--stage", "3", "--no-offload", "--gpu-autotune", str(results)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"with the autotune results of {results}" in out.stdout
    results.write_text("version: 999\n")  # XLA reads it: a file it cannot use is named
    out = _plan(
        "--topology", "h100:8", "--stage", "3", "--no-offload", "--gpu-autotune", str(results)
    )
    assert out.returncode == 2
    assert "XLA cannot use it: INVALID_ARGUMENT: Version mismatch" in out.stderr
    assert "Traceback" not in out.stderr
