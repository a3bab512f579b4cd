"""`zerojax launch -n P -- python script.py ...`: P local processes wired through
`jax.distributed` (a multi-controller run, like P nodes), output forwarded with a rank prefix.

The launcher exports ZEROJAX_COORDINATOR / ZEROJAX_NUM_PROCESSES / ZEROJAX_PROCESS_ID; the
script calls `initialize()`, which reads them (or, without them, the explicit arguments, or
JAX's own cluster detection for SLURM / Open MPI / Kubernetes). On CPU, collectives go
through gloo and `--devices-per-process D` simulates D devices in each process. When any
process fails, the launch stops the others and exits with that process's code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

ENV_COORDINATOR, ENV_NUM, ENV_ID = (
    "ZEROJAX_COORDINATOR",
    "ZEROJAX_NUM_PROCESSES",
    "ZEROJAX_PROCESS_ID",
)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cluster: bool = False,
    init_timeout: int | None = None,
    heartbeat_timeout: int | None = None,
) -> bool:
    """Start JAX's multi-controller runtime if this process is part of one: from
    `zerojax launch`'s variables, the explicit arguments, or (cluster=True) JAX's cluster
    auto-detection. Returns whether it started. Must run before anything else uses JAX.

    Nothing hangs: a peer that stops sending heartbeats for `heartbeat_timeout` seconds
    (default 20, env ZEROJAX_HEARTBEAT_TIMEOUT) ends every other process with JAX's message
    naming the lost task; a coordinator that cannot be reached within `init_timeout` seconds
    (default 60, env ZEROJAX_INIT_TIMEOUT) is a ZeroError saying so."""
    import jax

    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if coordinator is None and not cluster:
        return False
    init_timeout = int(init_timeout or os.environ.get("ZEROJAX_INIT_TIMEOUT") or 60)
    heartbeat_timeout = int(heartbeat_timeout or os.environ.get("ZEROJAX_HEARTBEAT_TIMEOUT") or 20)
    if os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts: dict[str, Any] = dict(
        initialization_timeout=init_timeout, heartbeat_timeout_seconds=heartbeat_timeout
    )
    if coordinator is None:
        jax.distributed.initialize(**timeouts)  # SLURM, Open MPI, Kubernetes...
        return True
    process_id = int(process_id if process_id is not None else os.environ[ENV_ID])
    if process_id != 0:
        _wait_for_coordinator(coordinator, init_timeout)
    jax.distributed.initialize(
        coordinator,
        num_processes=int(num_processes or os.environ[ENV_NUM]),
        process_id=process_id,
        **timeouts,
    )
    return True


def _wait_for_coordinator(address: str, timeout: int):
    """Return once `address` accepts connections; a ZeroError after `timeout` seconds (JAX
    itself would abort the process with a stack trace)."""
    from zerojax.core.config import ZeroError

    host, _, port = address.rpartition(":")
    deadline = time.time() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            if time.time() > deadline:
                raise ZeroError(
                    f"could not reach the coordinator {address} within {timeout} s: "
                    "is process 0 running, and is the address right? "
                    "(ZEROJAX_INIT_TIMEOUT sets the wait)"
                ) from None
            time.sleep(0.5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward(proc, rank: int):
    for line in proc.stdout:
        sys.stdout.write(f"[{rank}] {line}")
        sys.stdout.flush()


def launch(
    num_processes: int,
    command: list[str],
    devices_per_process: int | None = None,
    port: int | None = None,
) -> int:
    """Run `command` as `num_processes` processes; the exit code of the first that fails, or 0."""
    if not command:
        print(
            "zerojax launch: no command given (zerojax launch -n 2 -- python train.py)",
            file=sys.stderr,
        )
        return 2
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs = []
    for rank in range(num_processes):
        env = {**os.environ, ENV_COORDINATOR: coordinator, ENV_NUM: str(num_processes)}
        env.update({ENV_ID: str(rank), "PYTHONUNBUFFERED": "1"})
        if devices_per_process:
            flags = [
                f
                for f in env.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")
            ]
            env["XLA_FLAGS"] = " ".join(
                flags + [f"--xla_force_host_platform_device_count={devices_per_process}"]
            )
            env.setdefault("JAX_PLATFORMS", "cpu")
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
            )
        )
    threads = [
        threading.Thread(target=_forward, args=(p, r), daemon=True) for r, p in enumerate(procs)
    ]
    for t in threads:
        t.start()
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        failed = [(-1, 130)]
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in threads:
        t.join(timeout=5)
    if not failed:
        return 0
    rank, code = failed[0]
    if rank >= 0:
        print(
            f"zerojax launch: process {rank} exited with code {code}; stopped the others.",
            file=sys.stderr,
        )
    return code
