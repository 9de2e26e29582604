"""The host's CPUs: how many this process may use, and the one thread pool that uses them.

Host-side numpy/torch work (the ops' CPU kernels, the checkpoint converter's copies) runs on a
single process-wide pool: the work releases the GIL, and one pool keeps the thread count at the
CPU count however many of these run at once. Tasks on it must never wait on other tasks on it.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (what a container or `taskset` allows), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)  # created on first use (thread-safe), then shared
def host_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool for GIL-releasing host work, one thread per usable CPU."""
    return concurrent.futures.ThreadPoolExecutor(usable_cpus(), thread_name_prefix="jaxport-host")
