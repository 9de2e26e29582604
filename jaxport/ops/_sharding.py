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

from .._errors import ConfigError

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


def match_batch(k: jax.Array, key: jax.Array) -> jax.Array:
    """The per-slice `k` resharded as `key`'s slices are, where their Explicit shardings conflict.

    Combining them (`t | k` in the selection) was jax's bare "ShardingTypeError: incompatible
    shardings for broadcasting: ('a',), ('b',)" for rows split over mesh axis 'a' and k over 'b',
    and only under `jit`: eager calls on CPU traced the host kernel alone. Compatible shardings
    (one side replicated along a dimension) are left as they are."""
    batch = getattr(jax.typeof(key[..., 0]), "sharding", None)
    ks, bs = getattr(getattr(jax.typeof(k), "sharding", None), "spec", None), getattr(batch, "spec", None)
    if _reshard is None or ks is None or bs is None:
        return k
    ks, bs = tuple(ks) + (None,) * (k.ndim - len(ks)), tuple(bs) + (None,) * (k.ndim - len(bs))
    merged = [a if a is not None else b for a, b in zip(bs, ks)]
    used = [n for m in merged if m is not None for n in (m if isinstance(m, tuple) else (m,))]
    if all(a is None or b is None or a == b for a, b in zip(bs, ks)) and len(used) == len(set(used)):
        return k
    try:  # a concrete array (eager) carries its device mesh; a traced one only an abstract one
        mesh = key.sharding.mesh
    except AttributeError:
        mesh = batch.mesh
        if not jax.sharding.get_abstract_mesh().axis_names:  # jax reshards under jit only inside a mesh context
            raise ConfigError(f"`k` is sharded as {_spec(ks)} and x's slices as {_spec(bs)} over Explicit mesh axes, "
                              f"which jax cannot combine here; reshard k as x's slices first (jax.sharding.reshard(k, "
                              f"NamedSharding(mesh, {_spec(bs)}))), or call inside `with jax.set_mesh(mesh):`") from None
    return _reshard(k, NamedSharding(mesh, P(*bs)))


def _spec(spec: tuple) -> str:
    """A PartitionSpec as written in code, `P('a', None)` (its repr changed between jax versions)."""
    return f"P({', '.join(map(repr, spec))})"
