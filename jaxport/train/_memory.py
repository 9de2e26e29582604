"""Batch size from XLA's compiled memory analysis, before anything runs."""
from __future__ import annotations

import bisect
import os
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._errors import JaxportError
from ._step import AXIS


class OutOfMemoryError(JaxportError):
    """The device ran out of memory; the message names a batch size that fits."""


def device_memory_bytes() -> int:
    """Memory one device may use: the allocator's limit on accelerators; on CPU, physical
    memory shared by the local devices (80%, leaving room for the host side)."""
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.8 * total / jax.local_device_count())


def step_bytes(step: Callable, state, mesh, per_device_batch: int, image_size: int, dtype=np.float32) -> int:
    """Peak bytes per device of one compiled training step, from XLA's memory analysis."""
    n = mesh.devices.size * per_device_batch
    sharding = NamedSharding(mesh, P(AXIS))
    x = jax.ShapeDtypeStruct((n, image_size, image_size, 3), dtype, sharding=sharding)
    y = jax.ShapeDtypeStruct((n,), np.int32, sharding=sharding)
    return _peak(step.lower(state, x, y).compile(compiler_options=_probe_options(mesh)).memory_analysis())


def eval_bytes(evaluate: Callable, variables, mesh, per_device_batch: int, image_size: int,
               dtype=np.float32) -> int:
    """Peak bytes per device of one compiled evaluation step (`make_eval_step`'s), from XLA's
    memory analysis: `variables` replicated, a batch of `image_size` px images, labels and mask."""
    n = mesh.devices.size * per_device_batch
    sharding = NamedSharding(mesh, P(AXIS))
    x = jax.ShapeDtypeStruct((n, image_size, image_size, 3), dtype, sharding=sharding)
    y = jax.ShapeDtypeStruct((n,), np.int32, sharding=sharding)
    mask = jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding)
    replicated = NamedSharding(mesh, P())
    v = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=replicated), variables)
    return _peak(evaluate.lower(v, x, y, mask).compile(compiler_options=_probe_options(mesh)).memory_analysis())


def _peak(ma) -> int:
    """A compiled program's bytes per device: its buffers, less the outputs that reuse (alias) an argument's."""
    return int(ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)


def tree_bytes(tree) -> int:
    """Bytes of the arrays of `tree`, as each device holds a replicated copy."""
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def leave_for(limit_bytes: int, what: str, nbytes: int, log: Callable[[str], None] = print) -> int:
    """`limit_bytes` less `nbytes` that `what` keeps on each device outside the training step.

    Raises:
      OutOfMemoryError: `what` alone does not fit.
    """
    if nbytes >= limit_bytes:
        raise OutOfMemoryError(f"{what} needs {nbytes / 2**20:.0f} MiB per device, and {limit_bytes / 2**20:.0f} MiB "
                               "is available: nothing is left for the training step; use a smaller model")
    log(f"--batch-size auto: leaving {nbytes / 2**20:.0f} MiB per device for {what}")
    return limit_bytes - nbytes


def _probe_options(mesh) -> dict | None:
    """XLA:CPU's LLVM code generation without optimisation, for compilations that are only
    asked their memory analysis: buffers are assigned on the optimised HLO before code is
    generated, so the figures are the same (tests/test_train_memory.py checks it), and a
    ResNet-50 step compiles in ~4.5 s instead of ~6.5 s (~3 s instead of ~5 s for ResNet-18).
    `--batch-size auto` compiles 3-5 of them. Elsewhere nothing changes (not measured there)."""
    return {"xla_backend_optimization_level": 0} if mesh.devices.flat[0].platform == "cpu" else None


def largest_batch(step: Callable, state, mesh, image_size: int, limit_bytes: int, max_per_device: int = 256,
                  log: Callable[[str], None] = print, min_per_device: int = 1,
                  also: tuple[str, Callable[[int], int]] | None = None, accum: int = 1) -> int:
    """The largest per-device batch whose step fits in `limit_bytes`.

    `accum`: the step's `accum_steps`. The sizes are then one pass's images per device, the step
    is compiled for `accum` times as many, and the caller's batch is the result times `accum`.

    `also`, `(what, bytes_at)`: another program the batch must fit, run between the steps (the
    evaluation at a larger held-out crop), and its bytes per device at a per-device batch. A
    size then fits when both do, and the message says when `what` decided it.

    The sizes tried are `min_per_device`..15, then multiples of 8, and `max_per_device`. Each
    size is compiled once, only for its memory analysis; `_largest_fitting` picks which (2-7 of
    them on ResNet figures). `min_per_device` is 2 where one image per device is no valid step (per-device
    BatchNorm over 1x1 maps), which then is never compiled.

    Raises:
      OutOfMemoryError: not even `min_per_device` images per device fit.
    """
    lo, hi = min_per_device, max(min_per_device, max_per_device)
    sizes = candidate_sizes(lo, hi)
    known: dict[int, int] = {}

    other: dict[int, int] = {}

    def need(b: int) -> int:  # a compilation takes seconds: each size once
        if b not in known:
            known[b] = step_bytes(step, state, mesh, b * accum, image_size)
            if also is not None:  # the larger of two growing figures grows: the search stays exact
                other[b] = also[1](b)
        return max(known[b], other.get(b, 0))

    def whose(b: int) -> str:  # which program decides at `b`
        return f"; {also[0]} needs more than the training step" if other.get(b, 0) > known[b] else ""

    b = _largest_fitting(need, sizes, limit_bytes)
    if b is None:
        passes = f" in each of --grad-accum-steps {accum} passes" if accum > 1 else ""
        raise OutOfMemoryError(f"a batch of {lo} per device{passes} needs {need(lo) / 2**20:.0f} MiB{whose(lo)}, more "
                               f"than the {limit_bytes / 2**20:.0f} MiB available; use a smaller --image-size or model"
                               + (" (or fewer passes: the step holds all their images)" if accum > 1 else ""))
    # Say when the cap, not memory, chose the size (a GPU with 64 GiB free is not "full" at 256).
    capped = ", the most it picks" if b == hi else ""
    per = f" and pass (x --grad-accum-steps {accum}: {b * accum} per device)" if accum > 1 else ""
    log(f"--batch-size auto: {b} per device{per}{capped} ({need(b) / 2**20:.0f} MiB of {limit_bytes / 2**20:.0f} MiB, "
        f"from XLA's memory analysis{whose(b)})")
    return b


def candidate_sizes(lo: int, hi: int) -> list[int]:
    """The per-device batches `--batch-size auto` considers: `lo`..15, multiples of 8, and `hi`."""
    return [b for b in range(lo, hi + 1) if b < 16 or b % 8 == 0 or b == hi]


def _largest_fitting(need: Callable[[int], int], sizes: list[int], limit: int) -> int | None:
    """The largest of the ascending `sizes` with `need(size) <= limit`, where `need` grows with
    the size; None when the first does not fit. Returns `sizes[i]` only once `sizes[i + 1]` is
    known not to fit (or is the last), so the answer is exact for any growing `need`.

    `need` is expensive (a compilation), so it is asked few sizes: the smallest, the largest,
    then regula falsi between the largest size known to fit and the smallest known not to,
    reading memory as affine in the batch between them. XLA's figure is not affine: it stays
    flat over the small batches, where fixed buffers dominate, then steepens, so the straight
    line through the ends keeps landing short of the answer. The Illinois rule (halve the
    weight of an end kept twice) moves it along, and a bisection step whenever three steps did
    not halve the interval bounds the count by about 3 log2(len(sizes)) + 2. On ResNet-18's
    figures this takes ~6 sizes where stepping down from an affine prediction took 13.
    """
    a, z = 0, len(sizes) - 1
    if need(sizes[a]) > limit:
        return None
    if need(sizes[z]) <= limit:
        return sizes[z]
    fa, fz = need(sizes[a]) - limit, need(sizes[z]) - limit  # <= 0 < fz
    kept, widths = 0, []  # kept: +1 if `a` moved last, -1 if `z` did
    while z - a > 1:
        if len(widths) >= 3 and 2 * (z - a) > widths[-3]:
            j = (a + z) // 2
        else:
            estimate = sizes[a] + -fa * (sizes[z] - sizes[a]) / (fz - fa)
            j = bisect.bisect_right(sizes, estimate) - 1
        j = min(max(j, a + 1), z - 1)
        widths.append(z - a)
        fj = need(sizes[j]) - limit
        if fj <= 0:
            a, fa = j, fj
            if kept == 1:
                fz /= 2
            kept = 1
        else:
            z, fz = j, fj
            if kept == -1:
                fa /= 2
            kept = -1
    return sizes[a]


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is XLA running out of device memory (a RESOURCE_EXHAUSTED runtime error)."""
    if isinstance(err, JaxportError):
        return False
    text = str(err)
    if "No space left on device" in text or "os_error_code=" in text:  # a full disk says RESOURCE_EXHAUSTED too
        return False
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
