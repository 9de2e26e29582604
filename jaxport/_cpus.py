"""The host's CPUs: how many this process may use, and the one thread pool that uses them.

Host-side numpy/torch work (the ops' CPU kernels, the checkpoint converter's copies) runs on a
single process-wide pool: the work releases the GIL, and one pool keeps the thread count at the
CPU count however many of these run at once. Tasks on it never wait on other tasks on it: work
asked for from one of its own threads runs inline (`on_host_pool`), or two such tasks would each
hold a thread waiting for the other's.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from typing import Iterable

_local = threading.local()


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (what a container or `taskset` allows), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _mark_pool_thread() -> None:
    _local.on_pool = True


@functools.lru_cache(maxsize=None)  # created on first use (thread-safe), then shared
def host_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool for GIL-releasing host work, one thread per usable CPU."""
    return concurrent.futures.ThreadPoolExecutor(usable_cpus(), thread_name_prefix="jaxport-host",
                                                 initializer=_mark_pool_thread)


# A forked child inherits the cached executor but none of its threads, while the executor still
# counts the parent's idle workers: `submit` then starts no thread and the work never runs (a
# `multiprocessing` worker converting a checkpoint hung forever). The child gets its own pool.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=host_pool.cache_clear)


def on_host_pool() -> bool:
    """Whether the calling thread is one of `host_pool`'s (its work must then run inline)."""
    return getattr(_local, "on_pool", False)


def finish(futures: Iterable[concurrent.futures.Future]) -> None:
    """Waits for every future; raises the first failure only once none is still running.

    Returning early would let tasks go on writing into memory the caller frees as soon as it
    returns: the ops' kernels write into XLA's output buffer, and a Ctrl-C that left while they
    ran made them write into freed memory (a segfault). So on any exception, KeyboardInterrupt
    included, tasks not yet started are cancelled and the running ones are waited for (one
    chunk's time, milliseconds); a further interrupt during that wait is absorbed.
    """
    futures = list(futures)
    try:
        for f in futures:
            f.result()
    except BaseException:
        for f in futures:
            f.cancel()
        running = [f for f in futures if not f.cancelled()]  # a cancelled one never starts
        while True:
            try:
                concurrent.futures.wait(running)
                break
            except KeyboardInterrupt:
                continue
        raise
