"""How many CPUs this process may run on: the one count every host-side thread pool sizes by."""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (what a container or `taskset` allows), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
