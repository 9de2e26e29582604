"""Order-preserving unsigned integer keys: the one place that defines torch's sort order.

`order_key(x)` maps every element to an unsigned integer whose natural order is torch's sort
order of `x`: -0.0 and +0.0 map to the same key, every NaN maps to one key above +inf, and
integers keep their order. Both the XLA and the host (numpy) paths of `rank` and `topk_mask`
sort or select on these keys, so they agree bit for bit.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import ConfigError


def key_dtype(dtype) -> np.dtype:
    """The unsigned key dtype for an input dtype (uint32, or uint64 for 64-bit inputs)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.uint64) if dtype.itemsize == 8 else np.dtype(np.uint32)
    raise ConfigError(
        f"`x` has dtype {dtype}, which has no total order; use a floating, integer or bool array"
    )


def order_key(x: jnp.ndarray, descending: bool = False) -> jnp.ndarray:
    """Unsigned keys whose ascending order is torch's (stable) sort order of `x`.

    Args:
      x: floating, integer or bool array.
      descending: if True, the keys order `x` from largest to smallest; NaN still comes first
        among the largest, as in torch's `sort(descending=True)`.

    Returns:
      uint32 keys (uint64 for 64-bit inputs), same shape as `x`.
    """
    kdt = key_dtype(x.dtype)
    bits = kdt.itemsize * 8
    sign = np.array(1 << (bits - 1), kdt)
    if jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype).itemsize == 1:
        # float8 formats (some without inf or -0.0): widened exactly to float32; a float32
        # subnormal cannot come out of them, so the compares below are safe.
        x = x.astype(jnp.float32)
        x = jnp.where(x == 0, jnp.zeros((), jnp.float32), x)
        x = jnp.where(jnp.isnan(x), jnp.full((), jnp.nan, jnp.float32), x)
        u = lax.bitcast_convert_type(x, kdt)
        key = jnp.where((u & sign) != 0, ~u, u | sign)
    elif jnp.issubdtype(x.dtype, jnp.floating):
        # Only bit operations: XLA:CPU flushes subnormals to zero in float compares and
        # conversions, so `x == 0` would merge every subnormal with 0.0 (torch orders them).
        width = np.dtype(x.dtype).itemsize * 8
        udt = {16: np.uint16, 32: np.uint32, 64: np.uint64}[width]
        u = lax.bitcast_convert_type(x, udt)
        top = np.array(1 << (width - 1), udt)
        magnitude = u & ~top
        inf = lax.bitcast_convert_type(jnp.array(np.inf, x.dtype), udt)
        # -0.0 -> +0.0 and every NaN -> one canonical NaN (+, above +inf), so equal values get
        # equal keys.
        u = jnp.where(magnitude == 0, jnp.zeros((), udt), u)
        u = jnp.where(magnitude > inf, inf + np.array(1, udt), u)
        # Negative floats: flip all bits (larger magnitude -> smaller key); positive: flip sign.
        key = jnp.where((u & top) != 0, ~u, u | top)
        if width < bits:  # 16-bit floats: the same order, in the wider key
            key = key.astype(kdt)
    elif x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        key = x.astype(kdt)
    else:
        sdt = jnp.int64 if bits == 64 else jnp.int32
        key = lax.bitcast_convert_type(x.astype(sdt), kdt) ^ sign
    return ~key if descending else key
