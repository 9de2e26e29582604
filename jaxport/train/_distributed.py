"""Multi-process set-up: `jax.distributed.initialize`, explicit or detected from the cluster."""
from __future__ import annotations

import os

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


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Start jax's multi-process runtime when asked to or when launched by a cluster.

    With `coordinator`, `num_processes` and `process_id` given, uses them (e.g.
    `--coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0`); under SLURM, Open MPI or
    Kubernetes with more than one task, lets jax detect them; otherwise does nothing (one
    process). Must run before anything touches a device. Returns whether it initialised.

    Raises:
      ConfigError: only some of the three explicit arguments given, or inconsistent ones.
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
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
        return True
    if _in_cluster():
        jax.distributed.initialize()
        return True
    return False
