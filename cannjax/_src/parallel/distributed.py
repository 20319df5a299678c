"""Joining a multi-process JAX job (``jax.distributed``) with bounded waits.

:func:`initialize` validates the coordinator address and ids, probes the coordinator
from every process but 0 (so an unreachable one fails with ``TimeoutError`` after
``init_timeout_s``, not a hang), selects gloo collectives on CPU and starts
``jax.distributed`` with the given timeouts. Afterwards ``jax.devices()`` lists every
process's devices and the data-parallel step spans them all.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Any

import jax
import numpy as np

_FN = "cannjax.parallel"


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    local_device_count: int | None = None,
    init_timeout_s: int = 60,
    heartbeat_timeout_s: int = 10,
    cpu_collectives: str | None = "gloo",
) -> None:
    """Joins this process to a multi-process JAX job (``jax.distributed``), with timeouts.

    Call it first, before any other JAX call. Process 0 runs the coordinator at
    ``coordinator_address``; the others connect to it. Afterwards ``jax.devices()`` lists
    every process's devices and :func:`cannjax.parallel.data_parallel` steps span them all.

    Failure behaviour (all bounded):

    * a coordinator that cannot be reached: processes other than 0 probe the address first
      and raise ``TimeoutError`` after ``init_timeout_s``; process 0 waiting for peers that
      never come is aborted by JAX after ``init_timeout_s`` (``DEADLINE_EXCEEDED``);
    * a process that dies later: the coordination service misses its heartbeats and
      terminates every other process after about ``heartbeat_timeout_s`` with "Terminating
      process because the JAX distributed service detected fatal errors ... another task
      died" (a process abort, exit status != 0, even when blocked in a collective).

    Args:
      coordinator_address: ``"host:port"`` of process 0 (``127.0.0.1:port`` on one host).
      num_processes: the number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_count: on CPU, the number of devices this process exposes
        (``jax_num_cpu_devices``); None leaves the setting alone.
      init_timeout_s: seconds to wait for every process to connect.
      heartbeat_timeout_s: seconds without heartbeats after which a process counts as dead.
      cpu_collectives: ``jax_cpu_collectives_implementation`` (``"gloo"``, ``"mpi"``) or
        None to leave it alone.

    Raises:
      ValueError: a malformed address or out-of-range ids/timeouts.
      TimeoutError: the coordinator did not accept a connection within ``init_timeout_s``.
      RuntimeError: JAX was already used in this process (initialize must come first).

    Example:
      >>> import cannjax
      >>> cannjax.parallel.initialize("127.0.0.1:notaport", 2, 1)
      Traceback (most recent call last):
      ...
      ValueError: cannjax.parallel.initialize: coordinator_address must be 'host:port' ...
    """
    fn = f"{_FN}.initialize"
    host, port = _parse_address(fn, coordinator_address)
    for name, v, lo in (("num_processes", num_processes, 1), ("init_timeout_s", init_timeout_s, 1),
                        ("heartbeat_timeout_s", heartbeat_timeout_s, 1)):  # fmt: skip
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{fn}: {name} must be an int >= {lo}, got {v!r}")
    if not isinstance(process_id, (int, np.integer)) or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{fn}: process_id must be an int in [0, {num_processes}), got {process_id!r}"
        )
    if local_device_count is not None and (
        not isinstance(local_device_count, int) or local_device_count < 1
    ):
        raise ValueError(
            f"{fn}: local_device_count must be an int >= 1, got {local_device_count!r}"
        )
    if process_id != 0:
        _wait_for_coordinator(fn, host, port, init_timeout_s)
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes=int(num_processes),
            process_id=int(process_id),
            initialization_timeout=int(init_timeout_s),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
            shutdown_timeout_seconds=int(max(heartbeat_timeout_s, 5)),
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"{fn}: jax.distributed could not start ({e}); call "
            "cannjax.parallel.initialize before any other JAX computation, once per process"
        ) from e


def _parse_address(fn: str, address: Any) -> tuple[str, int]:
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d{1,5})", address) if isinstance(address, str) else None
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(
            f"{fn}: coordinator_address must be 'host:port' with a port in 1..65535 "
            f"(e.g. '127.0.0.1:12345'), got {address!r}"
        )
    return m.group(1), int(m.group(2))


def _wait_for_coordinator(fn: str, host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(1.0, left)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(left, 0)))
    raise TimeoutError(
        f"{fn}: the coordinator at {host}:{port} did not accept a connection within "
        f"{timeout_s} s (last error: {last}); start process 0 first, check the address and "
        "port, or raise init_timeout_s"
    )
