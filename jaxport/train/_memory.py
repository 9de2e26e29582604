"""Batch size from XLA's compiled memory analysis, before anything runs."""
from __future__ import annotations

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
    ma = step.lower(state, x, y).compile(compiler_options=_probe_options(mesh)).memory_analysis()
    return int(ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)


def _probe_options(mesh) -> dict | None:
    """XLA:CPU's LLVM code generation without optimisation, for compilations that are only
    asked their memory analysis: buffers are assigned on the optimised HLO before code is
    generated, so the figures are the same (tests/test_train_memory.py checks it), and a
    ResNet-50 step compiles in ~4.5 s instead of ~6.5 s (~3 s instead of ~5 s for ResNet-18).
    `--batch-size auto` compiles 3-5 of them. Elsewhere nothing changes (not measured there)."""
    return {"xla_backend_optimization_level": 0} if mesh.devices.flat[0].platform == "cpu" else None


def largest_batch(step: Callable, state, mesh, image_size: int, limit_bytes: int, max_per_device: int = 256,
                  log: Callable[[str], None] = print, min_per_device: int = 1) -> int:
    """The largest per-device batch whose step fits in `limit_bytes`.

    Predicts from two compilations (batch `min_per_device` and one more: memory is affine in
    the batch), then confirms the prediction by compiling it, stepping down until XLA's
    analysis fits. `min_per_device` is 2 where one image per device is no valid step (per-device
    BatchNorm over 1x1 maps), which then is never compiled.

    Raises:
      OutOfMemoryError: not even `min_per_device` images per device fit.
    """
    known: dict[int, int] = {}

    def need(b: int) -> int:  # each size is compiled once (a compilation takes seconds)
        if b not in known:
            known[b] = step_bytes(step, state, mesh, b, image_size)
        return known[b]

    lo = min_per_device
    m1 = need(lo)
    if m1 > limit_bytes:
        raise OutOfMemoryError(f"a batch of {lo} per device needs {m1 / 2**20:.0f} MiB, more than the "
                               f"{limit_bytes / 2**20:.0f} MiB available; use a smaller --image-size or model")
    if max_per_device <= lo:
        b = lo
    else:
        per_example = max(need(lo + 1) - m1, 1)
        b = int(min(max_per_device, lo + (limit_bytes - m1) // per_example))
        b = b // 8 * 8 if b >= 16 else b
    while b > lo and need(b) > limit_bytes:  # the prediction was optimistic: step down
        b = max(lo, int(b * limit_bytes / need(b)) // 8 * 8 if b > 16 else b - 1)
    while b < max_per_device:  # memory is not exactly affine: confirm the next size does not fit
        up = min(max_per_device, b + 1 if b < 16 else b + 8)
        if need(up) > limit_bytes:
            break
        b = up
    # Say when the cap, not memory, chose the size (a GPU with 64 GiB free is not "full" at 256).
    capped = ", the most it picks" if b == max_per_device else ""
    log(f"--batch-size auto: {b} per device{capped} ({need(b) / 2**20:.0f} MiB of {limit_bytes / 2**20:.0f} MiB, "
        "from XLA's memory analysis)")
    return b


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is XLA running out of device memory (a RESOURCE_EXHAUSTED runtime error)."""
    if isinstance(err, JaxportError):
        return False
    text = str(err)
    if "No space left on device" in text or "os_error_code=" in text:  # a full disk says RESOURCE_EXHAUSTED too
        return False
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text
