"""Calling the host kernels from traced code: a zero-copy buffer callback plus the type plumbing."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from .._vma import vary_like

try:  # jax >= 0.7: the callback sees XLA's own CPU buffers, no copy in either direction.
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - older jax
    _buffer_callback = None


# One callback object per kernel: jax keys its compiled computations on the callback, so a new
# closure per call compiled every eager `rank` / `topk_mask` again and kept each executable
# (~1.4 MB a call, never freed, not even by jax.clear_caches()).
@functools.cache
def _fill(fn: Callable[..., np.ndarray]):
    def callback(ctx, out, *args) -> None:
        del ctx
        fn(*(np.asarray(a) for a in args), out=np.asarray(out))

    return callback


@functools.cache
def _allocate(fn: Callable[..., np.ndarray]):
    def callback(*args) -> np.ndarray:
        return fn(*args, out=None)

    return callback


def host_call(fn: Callable[..., np.ndarray], out: jax.ShapeDtypeStruct, *args: jax.Array) -> jax.Array:
    """`fn(*args, out=...)` on the host; under `vmap` it gets the batch as leading axes.

    `fn` takes numpy arrays and an `out=` keyword: an array it must fill completely, or None
    to allocate and return its result. On the CPU backend the callback gets views of XLA's own
    buffers (`buffer_callback`): `pure_callback` copies every argument and result, which
    cost more than the kernels themselves at large shapes (~50 ms for a 128 MiB argument).

    Inside `jax.shard_map` a callback's result is typed as replicated over the manual mesh
    axes; it is computed from this device's shard, so it varies like the inputs do.
    """
    if _buffer_callback is not None and jax.default_backend() == "cpu":
        result = _buffer_callback(_fill(fn), out, vmap_method="broadcast_all")(*args)
    else:
        result = jax.pure_callback(_allocate(fn), out, *args, vmap_method="broadcast_all")
    return vary_like(result, *args)
