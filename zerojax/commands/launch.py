"""`zerojax launch -n P -- python script.py ...`: P local processes wired through
`jax.distributed` (a multi-controller run, like P nodes), output forwarded with a rank prefix.

The launcher exports ZEROJAX_COORDINATOR / ZEROJAX_NUM_PROCESSES / ZEROJAX_PROCESS_ID; the
script calls `zj.initialize()` (`zerojax.core.processes`), which reads them (or, without
them, the explicit arguments, or JAX's own cluster detection for SLURM / Open MPI /
Kubernetes). On CPU, collectives go
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

from zerojax.core.processes import ENV_COORDINATOR, ENV_ID, ENV_NUM, initialize

__all__ = ["free_port", "initialize", "launch"]  # initialize: as the docs of 0.1 called it


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
