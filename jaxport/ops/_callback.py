"""Calling the host kernels from traced code: `jax.pure_callback` plus the type plumbing."""
from __future__ import annotations

import jax
from jax import lax


def _varying(x) -> frozenset:
    """The manual mesh axes `x` varies over inside `shard_map` (empty outside it)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax < 0.9
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def host_call(fn, out: jax.ShapeDtypeStruct, *args: jax.Array) -> jax.Array:
    """`fn(*args)` on the host; under `vmap` it gets the batch as leading axes.

    Inside `jax.shard_map` a callback's result is typed as replicated over the manual mesh
    axes; it is computed from this device's shard, so it varies like the inputs do.
    """
    result = jax.pure_callback(fn, out, *args, vmap_method="broadcast_all")
    vma = frozenset().union(*(_varying(a) for a in args)) - _varying(result)
    return lax.pcast(result, tuple(sorted(vma)), to="varying") if vma else result
