"""Arrays sharded over Explicit mesh axes: gather the ranked axis first, as jax requires.

Since jax 0.9 `jax.make_mesh` defaults to Explicit axis types. There a sort, a cumulative sum
or a reduction along a sharded dimension is refused at trace time (`ShardingTypeError:
Arguments to sort must be unsharded over the sorting dimension`); on Auto meshes XLA's
partitioner gathers the axis itself. Ranking and selecting need the whole slice either way, so
the ops gather the ranked axis explicitly and give the result `x`'s own sharding back.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_reshard = getattr(jax.sharding, "reshard", None)  # jax >= 0.6


def gather_axis(x: jax.Array, axis: int) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """`x` with `axis` not sharded over Explicit mesh axes, and a function that gives an array of
    `x`'s shape `x`'s sharding back (the CPU kernels' callbacks type their result as
    replicated). Identity on Auto meshes and unsharded arrays."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if _reshard is None or spec is None or all(s is None for s in spec):
        return x, lambda y: y
    restore = lambda y: _reshard(y, sharding)  # noqa: E731
    if axis >= len(spec) or spec[axis] is None:
        return x, restore
    gathered = P(*(None if i == axis else s for i, s in enumerate(spec)))
    return _reshard(x, NamedSharding(sharding.mesh, gathered)), restore
