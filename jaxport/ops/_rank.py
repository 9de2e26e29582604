"""`rank`: each element's position in torch's stable sort order, without a second sort."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import _host
from ._callback import host_call
from ._checks import check_flag, check_method, normalize_axis, to_array
from ._keys import key_dtype, order_key
from ._sharding import gather_axis


def rank(x: jax.Array, axis: int = -1, descending: bool = False, *, method: str = "auto") -> jax.Array:
    """Each element's position in the stable sorted order of its slice along `axis`.

    Semantics, exactly torch's double sort::

        rank(x, axis, descending) == x.sort(dim=axis, descending=descending, stable=True)
                                      .indices.argsort(dim=axis)

    Ties keep index order, -0.0 equals +0.0, and NaN sorts as larger than every number (so it
    comes last ascending and first descending), as in torch. float16 and bfloat16 are ranked
    exactly (they widen to float32 without loss).

    One sort of an order-preserving integer key gives the permutation; scattering ``arange``
    into it gives the ranks (no second sort). On the CPU backend the sort runs in numpy on XLA's
    own buffers (XLA:CPU's sort is far slower); elsewhere it is XLA's stable sort. Both
    paths return identical results. Works under `jit`, `vmap` and on sharded inputs (a sharded
    `axis` is gathered first; inside `jax.shard_map` each device ranks its own shard).

    Args:
      x: floating, integer or bool array.
      axis: the axis to rank along.
      descending: rank from the largest (rank 0) instead of the smallest.
      method: "auto" (the host sort on the CPU backend, XLA's sort elsewhere) or "xla" (XLA's
        sort everywhere). `jax.export` cannot serialize the host sort's callback: export with
        ``method="xla"``. ("host" forces the host sort, through `jax.pure_callback` off the CPU.)

    Returns:
      int32 array of `x`'s shape; each slice along `axis` is a permutation of ``0..n-1``.

    Raises:
      ConfigError: `axis` is out of range, `descending` is not a bool known when tracing,
        `method` is unknown, `x` is complex or not numbers, or `x` is 64-bit (numpy, torch,
        Python ints) with jax's 64-bit mode off and narrowing it would change a value.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxport.ops import rank
      >>> rank(jnp.array([3.0, -0.0, jnp.nan, 0.0, 1.0]))
      Array([3, 0, 4, 1, 2], dtype=int32)
      >>> rank(jnp.array([3.0, -0.0, jnp.nan, 0.0, 1.0]), descending=True)
      Array([1, 3, 0, 4, 2], dtype=int32)
    """
    x = to_array(x, "x", exact=True)
    axis = normalize_axis(axis, x.ndim)
    descending = check_flag(descending, "descending")
    method = check_method(method)
    key_dtype(x.dtype)  # a complex x is refused whatever its shape (a 0-d or empty one returned zeros)
    if x.ndim == 0:
        return jnp.zeros((), jnp.int32)
    if x.shape[axis] == 0:
        # Nothing to rank: an empty array, cast from `x` to keep its sharding. Zeros made afresh
        # came out unsharded, or failed under jit on an Explicit mesh without `jax.set_mesh`
        # ("Length of device assignment 1 is not equal to the size of the mesh"): jit drops an
        # argument nothing uses, and with it the devices.
        return x.astype(jnp.int32)
    x, restore = gather_axis(x, axis)
    key = jnp.moveaxis(order_key(x, descending), axis, -1)
    return restore(jnp.moveaxis(rank_keys(key, method), -1, axis))


def rank_keys(key: jax.Array, method: str = "auto") -> jax.Array:
    """Stable ascending rank of unsigned keys along the last axis."""
    if method == "xla":
        return _rank_xla(key)
    if method == "host":
        return _rank_host(key)
    return lax.platform_dependent(key, cpu=_rank_host, default=_rank_xla)


def _rank_xla(key: jax.Array) -> jax.Array:
    nd = key.ndim
    # Built from `key` so that it is sharded as `key` is: under `jax.set_mesh` with Explicit axes
    # a replicated iota failed ("Arguments to sort must have equal shardings").
    iota = jnp.zeros_like(key, jnp.int32) + lax.iota(jnp.int32, key.shape[-1])
    _, perm = lax.sort((key, iota), dimension=nd - 1, is_stable=True, num_keys=1)
    # The inverse permutation by scatter, rank[..., perm[..., j]] = j, with the leading axes as
    # batch dimensions. (`jnp.put_along_axis` built the same scatter from explicit row indices,
    # which outside `jit` failed on arrays sharded over an Explicit mesh: "Resource axis: d of
    # P('d', None) is not found in mesh: ()".)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(nd - 1,), scatter_dims_to_operand_dims=(nd - 1,),
        operand_batching_dims=tuple(range(nd - 1)), scatter_indices_batching_dims=tuple(range(nd - 1)))
    return lax.scatter(jnp.zeros_like(iota), perm[..., None], iota, dnums, indices_are_sorted=False,
                       unique_indices=True, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _rank_host(key: jax.Array) -> jax.Array:
    return host_call(_host.rank_rows, jax.ShapeDtypeStruct(key.shape, jnp.int32), key)
