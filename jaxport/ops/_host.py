"""Host (numpy) kernels behind `rank` and `topk_mask` on the CPU backend.

XLA:CPU's sort is about 15x slower than numpy's vectorised sort, so on CPU the kernels run on
the host (`_callback.host_call`), writing straight into XLA's output buffer. They take the same
order keys as the XLA path (`_keys.order_key`) and return identical results; `tests/test_ops_*`
check both paths against torch. Rows are split across a small thread pool when that pays: numpy
releases the GIL while it sorts and partitions.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from .._cpus import finish, host_pool, on_host_pool, usable_cpus

_MIN_WORK_PER_THREAD = 1 << 16  # elements; below this the thread hand-off costs more than it saves
# Threads pay off only when each numpy call holds the GIL-free part long enough: `topk_rows`
# makes one partition call per row. How long that is depends on the CPU more than on the row:
# numpy's SIMD introselect ran at ~0.6 ns per key on an Intel Xeon (AVX-512), where two threads
# spent rows of 8732 keys (~5 us each) handing the GIL back and forth (0.54 ms against 0.38 ms
# at (32, 8732)), but its scalar one ran at ~7.5 ns per key on an AMD EPYC, where two threads
# took (32, 8732) from 1.8-2.2 ms to 1.1-1.5 ms and (256, 8732) from 14.5 to 8-10 ms. So rows
# are split over threads when one row's partition is predicted to take this long:
_MIN_TOPK_ROW_US_FOR_THREADS = 10.0  # (on that Xeon: rows of >= ~16k keys, as measured there)


def _parallel_rows(fn, rows: int, n: int, threads: int | None = None) -> None:
    """Calls fn(lo, hi) over contiguous row blocks, in parallel when the work is large enough."""
    threads = usable_cpus() if threads is None else threads
    chunks = min(threads, rows, max(1, rows * n // _MIN_WORK_PER_THREAD))
    if chunks <= 1 or on_host_pool():
        fn(0, rows)
        return
    bounds = np.linspace(0, rows, chunks + 1).astype(int)
    # `finish`: the chunks write into `fn`'s output (XLA's buffer, inside a callback), so this
    # must not return, even on Ctrl-C, while one still runs.
    finish(host_pool().submit(fn, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]))


def _rows_view(out: np.ndarray | None, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(out, out as (rows, n)): a new array if `out` is None, else a view that writes into it."""
    if out is None:
        out = np.empty(shape, dtype)
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out has {out.shape} {out.dtype}, expected {shape} {np.dtype(dtype)}")
    if out.size == 0:
        return out, out
    rows = out.reshape(-1, shape[-1])
    # reshape copies an array it cannot view (e.g. a strided `out`), and writes into a copy
    # would never reach `out`. (Assigning `.shape`, which raised instead, is deprecated in
    # numpy 2.5.)
    if not np.may_share_memory(rows, out):
        raise ValueError(f"out (shape {out.shape}, strides {out.strides}) cannot be viewed as rows; "
                         "pass a C-contiguous array")
    return out, rows


def rank_rows(key: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Stable rank along the last axis of unsigned keys (any leading shape) -> int32.

    Writes into `out` (int32, `key`'s shape) when given, else into a new array.
    """
    key = np.asarray(key)
    n = key.shape[-1]
    k2 = key.reshape(-1, n)
    out, rows = _rows_view(out, key.shape, np.int32)
    if n == 0 or k2.shape[0] == 0:
        return out
    iota = np.arange(n, dtype=np.int32)

    def work(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            row = k2[i]
            if row.dtype == np.uint32:
                # LSD radix sort in two stable 16-bit passes (numpy radix-sorts 16-bit keys),
                # one row at a time so every pass stays in cache.
                p1 = np.argsort((row & 0xFFFF).astype(np.uint16), kind="stable")
                p2 = np.argsort((row >> 16).astype(np.uint16)[p1], kind="stable")
                perm = p1[p2]
            else:
                perm = np.argsort(row, kind="stable")
            rows[i, perm] = iota  # the inverse permutation: rank[perm[j]] = j

    _parallel_rows(work, k2.shape[0], n)
    return out


def topk_rows(key: np.ndarray, k: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """mask[i, j] = rank of key[i, j] among row i (stable, ascending) < k[i]; k in [0, n].

    Writes into `out` (bool, `key`'s shape) when given, else into a new array.
    """
    key = np.asarray(key)
    n = key.shape[-1]
    k2 = key.reshape(-1, n)
    kk = np.broadcast_to(np.asarray(k), key.shape[:-1]).reshape(-1)
    out, rows = _rows_view(out, key.shape, np.bool_)
    if n == 0 or k2.shape[0] == 0:
        return out

    def work(lo: int, hi: int) -> None:
        block, kb = k2[lo:hi], np.clip(kk[lo:hi], 0, n)
        # Each row's k-th smallest key, by in-place introselect on one copy of the block.
        scratch = block.copy()
        t = np.empty(hi - lo, k2.dtype)
        for i, ki in enumerate(kb.tolist()):
            if 0 < ki:
                scratch[i].partition(ki - 1)
                t[i] = scratch[i, ki - 1]
        o = rows[lo:hi]
        np.less_equal(block, t[:, None], out=o)
        o[kb == 0] = False
        # Rows with more keys equal to the threshold than needed keep the first ones in index
        # order, as a stable sort would (rare with continuous data).
        for i in np.flatnonzero(np.count_nonzero(o, axis=1) != kb).tolist():
            row, ti = block[i], t[i]
            np.less(row, ti, out=o[i])
            need = int(kb[i]) - int(np.count_nonzero(o[i]))
            o[i, np.flatnonzero(row == ti)[:need]] = True

    threaded = n * _partition_ns_per_key() >= _MIN_TOPK_ROW_US_FOR_THREADS * 1e3
    _parallel_rows(work, k2.shape[0], n, None if threaded else 1)
    return out


@functools.cache
def _partition_ns_per_key() -> float:
    """numpy's introselect speed on this machine (ns per uint32 key), timed once (~0.1-1 ms).

    Only the choice of threads depends on it, never a result: rows are independent."""
    row = np.random.default_rng(0).integers(0, 2**32, 8192, dtype=np.uint64).astype(np.uint32)
    best = float("inf")
    for _ in range(3):
        scratch = row.copy()
        start = time.perf_counter()
        scratch.partition(1024)
        best = min(best, time.perf_counter() - start)
    return best * 1e9 / row.size
