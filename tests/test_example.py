"""examples/pretrain_lm.py end to end, in fresh processes: it learns, logs, survives SIGKILL
(the same command resumes and continues bitwise), and 2 launched processes match 1."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from common import subprocess_env

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = str(ROOT / "examples" / "pretrain_lm.py")


def _env():
    return subprocess_env()


def _run(*args, timeout=600):
    out = subprocess.run(
        [sys.executable, SCRIPT, "--no-progress", *map(str, args)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _metrics(log_dir) -> list[dict]:
    """The records of metrics.jsonl (a line cut short by SIGKILL is skipped)."""
    out = []
    for line in open(pathlib.Path(log_dir) / "metrics.jsonl"):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _losses(log_dir) -> dict:
    """{step: loss}, the last record per step winning (a resumed run repeats steps)."""
    return {r["step"]: r["loss"] for r in _metrics(log_dir) if "loss" in r}


def test_killed_run_resumes_with_the_same_command(tmp_path):
    common = [
        "--steps",
        16,
        "--eval-every",
        8,
        "--save-every",
        4,
        "--batch-size",
        16,
        "--seq-len",
        64,
        "--sample-len",
        16,
    ]
    ref = tmp_path / "ref"
    out = _run(*common, "--log-dir", ref)
    assert "eval loss" in out and "sample:" in out and "per device: state at rest" in out
    records = _metrics(ref)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 17))
    assert [r["step"] for r in records if "eval_loss" in r] == [8, 16]
    assert (ref / "loss.png").stat().st_size > 0
    assert any(p.name.startswith("events.out.tfevents") for p in ref.iterdir())

    run = tmp_path / "run"
    args = [
        sys.executable,
        SCRIPT,
        "--no-progress",
        *map(str, common),
        "--log-dir",
        run,
        "--ckpt-dir",
        tmp_path / "ckpt",
    ]
    log = tmp_path / "killed.log"
    proc = subprocess.Popen(args, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline and not (
        (run / "metrics.jsonl").exists() and max(_losses(run), default=0) >= 9
    ):
        assert proc.poll() is None, "the run to kill stopped first:\n" + log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = _run(*common, "--log-dir", run, "--ckpt-dir", tmp_path / "ckpt")
    resumed = re.search(r"resumed from .* at step (\d+)", out)
    assert resumed and int(resumed.group(1)) in (4, 8, 12), out[-2000:]  # not from 0
    assert _losses(run) == _losses(ref)  # the curve continues, bitwise


def test_two_launched_processes_match_one(tmp_path):
    common = [
        "--steps",
        4,
        "--eval-every",
        0,
        "--batch-size",
        16,
        "--seq-len",
        64,
        "--sample-len",
        0,
    ]
    _run(*common, "--log-dir", tmp_path / "one")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.commands.cli",
            "launch",
            "-n",
            "2",
            "--devices-per-process",
            "4",
            "--",
            sys.executable,
            SCRIPT,
            "--no-progress",
            *map(str, common),
            "--log-dir",
            tmp_path / "two",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "[0] " in out.stdout and "in 2 process(es)" in out.stdout
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    np.testing.assert_allclose([two[s] for s in one], list(one.values()), rtol=1e-4)


def test_launch_stops_everything_when_one_process_fails():
    code = (
        "import os, sys, time\n"
        "if os.environ['ZEROJAX_PROCESS_ID'] == '1': sys.exit(3)\n"
        "time.sleep(60)"
    )
    t = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerojax.commands.cli",
            "launch",
            "-n",
            "2",
            "--",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 3 and "process 1 exited with code 3" in out.stderr
    assert time.time() - t < 30  # the sleeping process was stopped


@pytest.mark.slow
def test_tiny_learns_in_300_steps(tmp_path):
    """The README's figure: eval loss from ~5.5 nats/byte to below 2.5 in 300 steps."""
    out = _run("--log-dir", tmp_path, timeout=1800)
    evals = [r["eval_loss"] for r in _metrics(tmp_path) if "eval_loss" in r]
    assert evals[-1] < 2.5, out[-2000:]


@pytest.mark.slow
def test_zeropp_converges_like_zero3(tmp_path):
    """ZeRO++ (qwZ + hpZ + qgZ int4) ends 300 steps within 2% of plain ZeRO-3's train loss."""
    final = {}
    for config in ("zero3_bf16", "zero3_zeropp"):
        _run(
            "--config",
            ROOT / "configs" / f"{config}.json",
            "--log-dir",
            tmp_path / config,
            timeout=1800,
        )
        losses = list(_losses(tmp_path / config).values())
        final[config] = sum(losses[-10:]) / 10
    assert final["zero3_zeropp"] == pytest.approx(final["zero3_bf16"], rel=0.02), final


def test_a_config_with_an_optimizer_block_trains_with_it(tmp_path):
    """accelerate_zero2's AdamW + WarmupDecayLR, its "auto" values from the flags (lr 3e-3,
    warmup 1 -> DeepSpeed's minimum of 2, 5 steps): the logged rate is DeepSpeed's."""
    out = _run("--config", "accelerate_zero2", "--steps", 5, "--warmup", 1, "--log-dir", tmp_path)
    assert "optimizer the config's optimizer and scheduler blocks" in out
    rates = [r["lr"] for r in _metrics(tmp_path) if "lr" in r]
    # update k uses iteration i = k - 1: 0 as built, log(i + 1) / log(2) for i < 2, then the
    # decay (5 - i) / (5 - 2)
    want = [0.0, 0.0, 3e-3, 3e-3 * (5 - 2) / 3, 3e-3 * (5 - 3) / 3]
    assert rates == pytest.approx(want, abs=1e-9)


@pytest.mark.slow  # 44 s; test_checkpoint_health.py checks the same skip in one process and two
def test_resume_skips_bad_newer_steps_with_one_warning(tmp_path):
    """A stray 7/, a truncated step 5 and a step 6 without its metadata beside the run's good
    step 3: the same command resumes from step 3, saying once what it skipped."""
    from test_checkpoint_health import BREAKS

    ckpt = tmp_path / "ckpt"
    _run("--steps", 3, "--save-every", 1, "--ckpt-dir", ckpt, "--log-dir", tmp_path / "a")
    for make in BREAKS.values():
        make(str(ckpt))
    out = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--no-progress",
            "--steps",
            "4",
            "--save-every",
            "1",
            "--ckpt-dir",
            str(ckpt),
            "--log-dir",
            str(tmp_path / "b"),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"resumed from {ckpt} at step 3" in out.stdout
    assert out.stderr.count("ZeroWarning: zerojax: restored checkpoint step 3") == 1
    assert "moved aside" in out.stdout and (ckpt / "4").is_dir()  # saving goes on
    assert sorted(os.listdir(ckpt / "skipped")) == ["5", "6", "7"]
