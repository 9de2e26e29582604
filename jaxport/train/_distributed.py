"""Multi-process set-up: `jax.distributed.initialize`, explicit or detected from the cluster."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Callable

import jax

from .._errors import ConfigError

# Environment variables that mean "launched as one of several processes" for the cluster kinds
# jax.distributed auto-detects (SLURM, Open MPI, Kubernetes/JobSet).
_CLUSTER_ENV = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME")


def _in_cluster() -> bool:
    for var in _CLUSTER_ENV:
        value = os.environ.get(var)
        if value is not None:
            try:
                return int(value) > 1
            except ValueError:
                return True  # a JobSet name
    return False


# jax.distributed.initialize's own default: how long a process waits for the others.
CONNECT_TIMEOUT_S = 300
# jax gives up this much later than jaxport's watchdog, so the watchdog's message comes first.
_JAX_TIMEOUT_MARGIN_S = 30
EXIT_NOT_CONNECTED = 2


def _give_up(coordinator: str, num_processes: int, timeout_s: float) -> None:
    print(f"jaxport: error: the {num_processes} processes did not all connect to the coordinator at {coordinator} "
          f"within {timeout_s:g} s: start every process (--process-id 0 to {num_processes - 1}) with the same "
          "--coordinator and --num-processes", file=sys.stderr, flush=True)
    os._exit(EXIT_NOT_CONNECTED)  # jax's connect blocks the main thread in C++: nothing else can stop it


def _check_port_free(coordinator: str, port: int) -> None:
    """Process 0 serves the coordinator on `port`: a port in use was an internal
    "Failed to start RPC server" from jax. (A race with another program remains possible.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # only a listener blocks it
        try:
            sock.bind(("", port))
        except OSError as e:
            raise ConfigError(f"`--coordinator` (={coordinator!r}): port {port} is in use on this machine, and process "
                              f"0 serves the coordinator there ({e.strerror}); choose a free port, the same for "
                              "every process") from None


def _wait_for_coordinator(coordinator: str, host: str, port: int, timeout_s: float,
                          log: Callable[[str], None]) -> None:
    """Wait until process 0's coordinator accepts connections. Without this, a process whose
    coordinator never comes up (wrong address, process 0 not started, a firewall) hung for five
    minutes and then died in a C++ abort with a stack trace."""
    deadline = time.monotonic() + timeout_s
    waiting = False
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=5):
                return
        except socket.gaierror as e:
            raise ConfigError(f"`--coordinator` (={coordinator!r}): cannot resolve host {host!r} ({e.strerror}); "
                              "pass the address of the machine that runs process 0") from None
        except OSError as e:
            problem = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(f"`--coordinator` (={coordinator!r}) did not answer within {timeout_s:g} s ({problem}): "
                              "start process 0 (--process-id 0) with the same --coordinator, on the machine at that "
                              "address, and check that the port is reachable from here")
        if not waiting:
            log(f"waiting for the coordinator at {coordinator} (process 0) ...")
            waiting = True
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
               log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)) -> bool:
    """Start jax's multi-process runtime when asked to or when launched by a cluster.

    With `coordinator`, `num_processes` and `process_id` given, uses them (e.g.
    `--coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0`); under SLURM, Open MPI or
    Kubernetes with more than one task, lets jax detect them; otherwise does nothing (one
    process). Must run before anything touches a device. Returns whether it initialised.

    Before jax connects, process 0 checks that the coordinator's port is free and the others
    wait (up to `connect_timeout_s`) until it answers, so a wrong address or a process 0 that
    never started is a clear error. If the processes have not all connected after
    `connect_timeout_s`, the process prints one line and exits with status 2 (jax itself would
    abort with a C++ stack trace 30 s later).

    Raises:
      ConfigError: only some of the three explicit arguments given, inconsistent ones, a port
        in use (process 0), or a coordinator that cannot be resolved or did not answer in time.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("`--coordinator`, `--num-processes` and `--process-id` go together; "
                          f"got coordinator={coordinator}, num_processes={num_processes}, process_id={process_id}")
    if all(given):
        if num_processes < 1:
            raise ConfigError(f"`--num-processes` (={num_processes}) must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"`--process-id` (={process_id}) must be in [0, {num_processes})")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"`--coordinator` (={coordinator!r}) must be host:port, e.g. 10.0.0.1:1234: the "
                              "address where process 0 listens, the same for every process")
        if process_id == 0:
            _check_port_free(coordinator, int(port))
            if num_processes > 1:
                log(f"coordinator at {coordinator}: waiting for the {num_processes - 1} other process(es) to join "
                    f"(up to {connect_timeout_s:g} s)")
        else:
            _wait_for_coordinator(coordinator, host, int(port), connect_timeout_s, log)
        # jax's own timeout ends in a C++ abort with a stack trace; a watchdog that fires first
        # ends the process with one line instead. Nothing has been written yet at this point.
        watchdog = threading.Timer(connect_timeout_s, _give_up, (coordinator, num_processes, connect_timeout_s))
        watchdog.daemon = True
        watchdog.start()
        try:
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                       process_id=process_id,
                                       initialization_timeout=int(connect_timeout_s) + _JAX_TIMEOUT_MARGIN_S)
        finally:
            watchdog.cancel()
        return True
    if _in_cluster():
        jax.distributed.initialize()
        return True
    return False
