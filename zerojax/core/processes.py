"""Multi-process start-up: `initialize()` joins this process to JAX's multi-controller runtime
(`jax.distributed`) when it is part of one, from `zerojax launch`'s variables, explicit
arguments or JAX's cluster detection; `zj.initialize` is this function."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from zerojax.core.errors import ZeroError

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
