"""`logsumexp`: the max-shift trick with well-defined edges, optionally across a mesh axis."""
from __future__ import annotations

import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import ConfigError
from ._checks import check_flag, normalize_axes, to_array


def logsumexp(
    a: jax.Array,
    axis=None,
    *,
    b: jax.Array | None = None,
    where: jax.Array | None = None,
    keepdims: bool = False,
    return_sign: bool = False,
    axis_name=None,
):
    r"""``log(sum(b * exp(a)))`` over `axis`, stable, exact, and defined at every edge.

    Semantics::

        logsumexp(a, axis)              == torch.logsumexp(a, dim=axis)
        logsumexp(a, axis, b=b,
                  return_sign=s)        == scipy.special.logsumexp(a, axis, b=b, return_sign=s)

    computed as ``m + log(sum(b * exp(a - m)))`` with ``m = stop_gradient(max(a))`` (0 where the
    max is not finite). On XLA:CPU, without `b` and `axis_name`, from 32768 elements up, a single pass
    ``log(sum(exp(a)))`` is used whenever its sum is provably exact (finite and far above the
    underflow range; typical logits), which skips the max pass; anything else takes the
    shifted path. Both give the same result to float rounding.

    Edges: a slice that is all -inf, or entirely masked out by `where`, gives -inf with a zero
    (finite) gradient, where torch and ``jax.nn.logsumexp`` give a NaN gradient; a +inf entry
    gives +inf; NaN propagates; inputs of 1e30 do not overflow, and their gradient is the
    softmax (torch's, ``exp(a - out)``, gives 1 to each of two tied 1e30 entries: ``out``
    rounds to 1e30); an empty axis gives -inf. With `b` and ``return_sign=False`` a negative
    sum gives NaN, as in scipy. float16 and bfloat16 are accumulated in float32 and rounded
    once at the end.

    With `axis_name` (inside ``jax.shard_map``) the reduction also spans that mesh axis: each
    device reduces its shard, then one ``pmax`` and one ``psum`` combine them, so a logsumexp
    over a class axis split across devices is a single call. (Its gradient is the unsharded
    one under `shard_map`'s default ``check_vma=True``; with ``check_vma=False`` jax cannot tell
    replicated from per-device values and scales it by the axis size, as for any psum.)

    Args:
      a: the array (integers are promoted to the default float type).
      axis: an int, a tuple of ints, or None for all axes.
      b: optional scale factors broadcastable to `a`; may be negative (see `return_sign`).
        Entries with ``b == 0`` are left out, as in ``jax.nn.logsumexp`` (so they get no
        gradient either); scipy leaves them out too, except that it gives NaN when such an
        entry's `a` is inf or NaN and the rest of the slice sums to 0. Entries masked out by
        `where` are left out whatever their `b` (NaN or inf included).
      where: optional bool mask broadcastable to `a`; only True entries are summed.
      keepdims: keep the reduced axes with size 1.
      return_sign: also return the sign of the sum (``+1``, ``-1`` or 0) and give
        ``log(abs(sum))`` instead of NaN for negative sums.
      axis_name: a mesh axis name (or tuple of names) to reduce across as well.

    Returns:
      The result in `a`'s (floating) dtype; a pair ``(result, sign)`` if `return_sign`.

    Raises:
      ConfigError: `axis` is out of range or repeats, `a` or `b` is complex or not numbers, or
        holds 64-bit integers that jax's default 32-bit mode would wrap, or float64 that it
        would round to inf (or, in `b`, from nonzero to 0), or is a torch tensor that requires
        grad, `where` is not bool,
        `b` / `where` do not broadcast to `a`, `keepdims` / `return_sign` are not bools known
        when tracing, or `axis_name` is not a name (an int), or names no axis of the
        ``jax.shard_map`` it is used in (or is used outside one).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxport.ops import logsumexp
      >>> logsumexp(jnp.array([[0.0, jnp.log(3.0)], [1e30, 1e30]]), axis=1)
      Array([1.3862944e+00, 1.0000000e+30], dtype=float32)
      >>> jax.grad(lambda x: logsumexp(x))(jnp.full(3, -jnp.inf, jnp.float32))
      Array([0., 0., 0.], dtype=float32)
    """
    a = to_array(a, "a", overflow=True)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        raise ConfigError(f"`a` has complex dtype {a.dtype}; logsumexp here takes real arrays")
    keepdims = check_flag(keepdims, "keepdims")
    return_sign = check_flag(return_sign, "return_sign")
    if isinstance(axis_name, list):  # as `axis` takes one; jax's collectives take only a tuple
        axis_name = tuple(axis_name)  # (a list was a bare "TypeError: unhashable type: 'list'")
    if axis_name is not None:
        _check_axis_name(axis_name)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        a = a.astype(jnp.result_type(float))
    out_dtype = a.dtype
    # Half precision accumulates in float32 (as torch's CPU and GPU kernels do).
    work = jnp.float32 if np.dtype(out_dtype).itemsize < 4 else out_dtype
    a = a.astype(work)
    dims = normalize_axes(axis, a.ndim)
    if b is not None:
        b = to_array(b, "b", overflow=True, flush=True)
        if jnp.issubdtype(b.dtype, jnp.complexfloating):
            # Casting would drop the imaginary part: scipy gives a complex result here.
            raise ConfigError(f"`b` has complex dtype {b.dtype}; logsumexp here takes real scale factors")
        b = _broadcast(b.astype(work), a.shape, "b")
    if where is not None:
        where = to_array(where, "where")
        if where.dtype != bool:
            raise ConfigError(f"`where` has dtype {where.dtype}; pass a bool mask, e.g. where=mask > 0")
        where = _broadcast(where, a.shape, "where")
    if b is not None:
        if where is not None:
            # A masked-out b of NaN or inf would still reach the sum as exp(-inf) * b = NaN.
            b = jnp.where(where, b, jnp.zeros((), work))
        # As in jax.nn.logsumexp, entries with b == 0 are ignored, even where `a` is inf or NaN.
        where = b != 0 if where is None else where & (b != 0)
    if where is not None:
        # Masked entries become -inf (not summed with `where=`), so their gradient is exactly 0
        # even when the masked value is inf or NaN.
        a = jnp.where(where, a, -jnp.inf)

    if (
        b is None
        and axis_name is None
        and a.size >= _ONE_PASS_MIN_SIZE
        and jax.default_backend() in _ONE_PASS_BACKENDS
    ):
        out = _lse_one_pass(a, dims)
        out = out if keepdims else jnp.squeeze(out, dims)
        sign = jnp.where(jnp.isnan(out), jnp.nan, jnp.where(out == -jnp.inf, 0.0, 1.0)).astype(work)
        return (out.astype(out_dtype), sign.astype(out_dtype)) if return_sign else out.astype(out_dtype)
    s, m = _shifted_sum(a, b, dims, axis_name)
    sign = jnp.sign(s)
    out = _log_or_neg_inf(jnp.abs(s)) + m
    if not keepdims:
        out = jnp.squeeze(out, dims)
        sign = jnp.squeeze(sign, dims)
    if return_sign:
        return out.astype(out_dtype), sign.astype(out_dtype)
    if b is not None:
        out = jnp.where(sign < 0, jnp.nan, out)
    return out.astype(out_dtype)


# Below this many elements the one-pass path's exactness check (a second reduction and a
# conditional) costs more than the max pass it saves: measured on XLA:CPU, (4, 64) took 58 us
# against 7 us for the shifted sum (which XLA runs inline in the caller, as "cheap"), and
# (32, 256) 55 us against 38 us; from (32, 1024) up the one pass is as fast or faster.
_ONE_PASS_MIN_SIZE = 32768
# The one pass is XLA:CPU tuning. On XLA:GPU (jax 0.11.2, an H200) its exactness check is a
# `lax.cond`, whose predicate the GPU runtime reads back on the host: it ran at 0.82-0.88x
# `jax.nn.logsumexp` there (benchmarks/README.md), while the max-shifted sum is what
# `jax.nn.logsumexp` itself runs.
_ONE_PASS_BACKENDS = frozenset({"cpu"})


# Jitted: called eagerly, its `lax.cond` got new branch functions on each call, and jax compiled
# it again every time (~50-80 ms) and kept each executable (~1.7 MB a call, never freed).
@functools.partial(jax.jit, static_argnums=1)
def _one_pass_sum(a: jax.Array, dims: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(s, m) with log(s) + m = logsumexp(a) over `dims` (kept): m = 0 and s = sum(exp(a)) in
    one pass over `a` whenever that is exact, else the max-shifted two-pass sum.

    Without the shift, sum(exp(a)) is right to float rounding whenever it neither overflows
    nor is small enough for flushed terms to matter (each term lost to underflow is < tiny, and
    n of them stay below 2^-4 ulp of the sum). Otherwise (inf, NaN, all -inf, |a| ~ 1e30...)
    the max-shifted sum runs instead.
    """
    n = int(np.prod([a.shape[d] for d in dims], dtype=np.int64))
    info = jnp.finfo(a.dtype)
    floor = float(info.tiny) * 16.0 / float(info.eps) * max(n, 1)
    s_fast = jnp.sum(jnp.exp(a), axis=dims, keepdims=True)
    exact = jnp.all((s_fast < jnp.inf) & (s_fast > floor))
    # The branches take their arrays as operands: captured from outside, outside jit under
    # `jax.set_mesh` with Explicit axes, the first branch's zeros came out unsharded and cond
    # refused the branches' differing output types.
    return lax.cond(exact, lambda s, _: (s, jnp.zeros_like(s)), lambda _, x: _shifted_sum(x, None, dims, None),
                    s_fast, a)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _lse_one_pass(a: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """log(sum(exp(a))) over `dims` (kept), in one pass over `a` whenever that is exact."""
    s, m = _one_pass_sum(a, dims)
    return _log_or_neg_inf(s) + m


@_lse_one_pass.defjvp
def _lse_one_pass_jvp(dims, primals, tangents):
    (a,), (t,) = primals, tangents
    s, m = _one_pass_sum(a, dims)
    out = _log_or_neg_inf(s) + m
    # d out = sum(softmax(a) * da), softmax = exp(a - m) / s from the sum itself. (exp(a - out)
    # was off by up to 0.4% at |out| ~ 1e5, where rounding `out` moves every exponent by up to
    # ulp(out) / 2; the shifted path's autodiff has always computed it this way.) An all -inf
    # slice has s = 0 and softmax 0 (not NaN); a +inf slice has s = +inf (softmax NaN at the inf,
    # 0 elsewhere, as torch and the shifted path); NaN stays NaN.
    safe = jnp.where(s == 0, jnp.ones((), s.dtype), s)
    return out, jnp.sum(jnp.exp(a - m) * t, axis=dims, keepdims=True) / safe


def _log_or_neg_inf(s: jax.Array) -> jax.Array:
    """log(s) for s >= 0; log(0) = -inf with a zero gradient (log of 1 there, so d/ds is finite)."""
    empty = s == 0
    return jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, jnp.ones((), s.dtype), s)))


def _shifted_sum(a, b, dims, axis_name):
    """(sum(b * exp(a - m)), m) with m the max over `dims` (and the mesh axis), 0 if not finite."""
    # The shift is a constant for differentiation (the result does not depend on it).
    m = lax.stop_gradient(jnp.max(a, axis=dims, keepdims=True, initial=-jnp.inf))
    if axis_name is not None:
        try:
            m = lax.pmax(m, axis_name)
        except (NameError, AssertionError):  # outside shard_map / a name the mesh lacks (jax's own assert)
            here = jax.sharding.get_abstract_mesh().axis_names
            where = (f"this shard_map's mesh has axes {here}" if here else
                     "outside it (as here), leave axis_name=None")
            raise ConfigError(
                f"`axis_name` (={axis_name!r}) names no mesh axis here: it reduces across devices only "
                f"inside jax.shard_map over a mesh with that axis; {where}"
            ) from None
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros((), a.dtype))
    e = jnp.exp(a - m)
    if b is not None:
        e = e * b
    s = jnp.sum(e, axis=dims, keepdims=True)
    if axis_name is not None:
        s = lax.psum(s, axis_name)
    return s, m


def _check_axis_name(axis_name) -> None:
    """Mesh axis names are strings (any hashable but an int): `lax.psum` and `lax.pmax` read an
    int as a positional array axis, so `axis_name=1` reduced over array axis 1 instead."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or any(isinstance(n, (int, np.integer)) or not isinstance(n, Hashable) for n in names):
        raise ConfigError(f"`axis_name` (={axis_name!r}) must be a mesh axis name, e.g. 'model', or a tuple of "
                          "names (ints would be array axes: pass those as `axis`)")


def _broadcast(v: jax.Array, shape: tuple[int, ...], name: str) -> jax.Array:
    try:
        return jnp.broadcast_to(v, shape)
    except ValueError:
        raise ConfigError(
            f"`{name}` has shape {v.shape}, which does not broadcast to `a`'s shape {shape}; "
            f"pass an array of that shape or one that broadcasts to it"
        ) from None
