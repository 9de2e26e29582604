"""Manual mesh axes a value varies over inside `jax.shard_map` (with jax's `check_vma` on).

Inside `shard_map`, jax types each value with the manual axes it varies over. Values computed
from the local shard of a split input vary; parameters passed in replicated do not. jax's own
rules mark a replicated operand as varying where it meets a varying one (`pcast`), and the
transpose of that mark sums the gradient over the devices. A hand-written VJP or host callback
must do the same, or its types do not match the primal's.
"""
from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside `shard_map` (empty outside it, or with
    `check_vma=False`)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax < 0.9
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def vary_like(a, *like):
    """`a`, marked as varying over every manual axis the arrays `like` vary over (a no-op
    outside `shard_map`): a replicated parameter meeting a split batch, as jax's own rules mark
    it. Its gradient is then summed over those axes, as jax's autodiff sums it."""
    missing = frozenset().union(*(varying_axes(x) for x in like)) - varying_axes(a)
    return lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a
