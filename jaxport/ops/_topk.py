"""`topk_mask` and SSD's `hard_negative_mask`: select the k smallest/largest without sorting."""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._errors import ConfigError
from . import _host
from ._callback import host_call
from ._checks import check_flag, check_method, normalize_axis, to_array
from ._keys import order_key
from ._sharding import gather_axis, match_batch


def topk_mask(x: jax.Array, k, axis: int = -1, largest: bool = True, *, method: str = "auto") -> jax.Array:
    """Marks the k largest (or smallest) elements of each slice along `axis`.

    Semantics, exactly torch's double-sort idiom::

        topk_mask(x, k, axis, largest) == (x.sort(dim=axis, descending=largest, stable=True)
                                           .indices.argsort(dim=axis) < k)

    i.e. ``rank(x, axis, descending=largest) < k``: ties are taken in index order, -0.0 equals
    +0.0 and NaN counts as larger than every number. `k` may differ per slice; it is clamped
    to ``[0, n]`` (negative k selects nothing, k > n selects everything).

    No sort is needed: each slice's k-th key is found by selection on an order-preserving
    integer view of `x` (numpy's introselect on the CPU backend; elsewhere an XLA bisection of
    32 fused compare-and-count passes), and ties at that key are resolved by index
    with a cumulative count. Both paths return identical results. Works under `jit`, `vmap`
    and on sharded inputs (a sharded `axis` is gathered first; inside `jax.shard_map` each device
    selects within its own shard).

    Args:
      x: floating, integer or bool array.
      k: an int, or an integer array (jax, numpy, a list, or anything numpy converts, such as
        a torch tensor) with one k per slice, broadcastable to ``x.shape`` without `axis` (for
        a 2-D `x` and ``axis=-1``: shape ``(rows,)``, not torch's ``(rows, 1)``).
      axis: the axis along which to select.
      largest: select the largest elements; False selects the smallest.
      method: "auto" (the host kernel on the CPU backend, the XLA bisection elsewhere) or "xla"
        (the bisection everywhere). `jax.export` cannot serialize the host kernel's callback:
        export with ``method="xla"``.

    Returns:
      bool array of `x`'s shape; each slice has ``clip(k, 0, n)`` True entries.

    Raises:
      ConfigError: `axis` is out of range, `k` is not an integer or does not broadcast,
        `largest` is not a bool known when tracing, `method` is unknown, `x` is complex or
        not numbers, or `x` is 64-bit with jax's 64-bit mode off and narrowing it would change a
        value.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxport.ops import topk_mask
      >>> x = jnp.array([[1.0, 5.0, 5.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
      >>> topk_mask(x, jnp.array([2, 1]))
      Array([[False,  True,  True, False],
             [ True, False, False, False]], dtype=bool)
    """
    x = to_array(x, "x", exact=True)
    axis = normalize_axis(axis, x.ndim)
    largest = check_flag(largest, "largest")
    method = check_method(method)
    if x.ndim == 0:
        x = x[None]
        return topk_mask(x, k, 0, largest, method=method)[0]
    batch_shape = x.shape[:axis] + x.shape[axis + 1 :]
    kk = _per_slice_k(k, batch_shape, x.shape[axis], axis)
    if x.shape[axis] == 0:
        return x.astype(bool)  # nothing to select: as `rank`, before any resharding
    x, restore = gather_axis(x, axis)
    key = jnp.moveaxis(order_key(x, descending=largest), axis, -1)
    return restore(jnp.moveaxis(select_keys(key, kk, method), -1, axis))


def hard_negative_mask(
    loss: jax.Array, positive: jax.Array, neg_pos_ratio: int = 3, axis: int = -1, *, method: str = "auto"
) -> jax.Array:
    """SSD hard-negative mining: the highest-loss non-positive entries, ratio per positive.

    Per slice along `axis`, selects the ``k = min(neg_pos_ratio * num_positive,
    num_non_positive)`` largest losses among the non-positive entries; positives are never
    selected. Ties are taken in index order and NaN counts as the largest loss. Whenever k fits
    (``neg_pos_ratio * num_positive <= num_non_positive``) and no non-positive loss is -inf
    (cross-entropy never is), this equals torchvision's SSD mining
    (``torchvision/models/detection/ssd.py``, ``compute_loss``; it marks positives with -inf
    and so could pick a positive over a -inf negative). torchvision sorts without
    ``stable=True``, so among tied losses its choice is unspecified; here it is index order,
    as with ``stable=True``::

        negative_loss = cls_loss.clone(); negative_loss[foreground] = -inf
        _, idx = negative_loss.sort(1, descending=True)
        background = idx.sort(1)[1] < neg_pos_ratio * foreground.sum(1, keepdim=True)

    Args:
      loss: floating per-anchor losses, e.g. shape ``(batch, anchors)``.
      positive: bool mask of matched (foreground) anchors, broadcastable to `loss` (an integer
        mask counts nonzero entries as positive).
      neg_pos_ratio: non-negative int, negatives kept per positive (SSD uses 3).
      axis: the anchor axis.
      method: "auto" or "xla", as in `topk_mask` (``method="xla"`` for `jax.export`).

    Returns:
      bool array of `loss`'s shape marking the mined negatives.

    Raises:
      ConfigError: `loss` is not floating, `positive` is not a bool or integer mask that
        broadcasts to it (or holds int64 labels that jax would wrap with 64-bit mode off),
        `neg_pos_ratio` is not a non-negative int known when tracing, `axis` is out of range,
        `method` is unknown, or `loss` is 64-bit with jax's 64-bit mode off and narrowing it
        would change a value.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxport.ops import hard_negative_mask
      >>> loss = jnp.array([[0.1, 2.0, 0.5, 0.9, 3.0]])
      >>> positive = jnp.array([[False, False, False, False, True]])
      >>> hard_negative_mask(loss, positive, neg_pos_ratio=2)
      Array([[False,  True, False,  True, False]], dtype=bool)
    """
    loss = to_array(loss, "loss", exact=True)
    method = check_method(method)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ConfigError(f"`loss` has dtype {loss.dtype}; pass floating losses, e.g. loss.astype(jnp.float32)")
    if loss.ndim == 0:
        raise ConfigError("`loss` is a scalar; pass per-anchor losses with at least one axis")
    axis = normalize_axis(axis, loss.ndim)
    if positive is None:
        raise ConfigError("`positive` is None; pass the bool mask of matched (foreground) anchors")
    positive = to_array(positive, "positive")
    if not (positive.dtype == bool or jnp.issubdtype(positive.dtype, jnp.integer)):
        raise ConfigError(f"`positive` has dtype {positive.dtype}; pass a bool mask of matched anchors, "
                          f"e.g. labels > 0")
    try:
        positive = jnp.broadcast_to(positive.astype(bool), loss.shape)
    except ValueError:
        raise ConfigError(
            f"`positive` has shape {positive.shape}, which does not broadcast to `loss`'s shape "
            f"{loss.shape}; pass one bool per loss entry"
        ) from None
    if isinstance(neg_pos_ratio, jax.Array) and neg_pos_ratio.shape == () and jnp.issubdtype(
            neg_pos_ratio.dtype, jnp.integer):
        try:
            neg_pos_ratio = int(neg_pos_ratio)
        except jax.errors.ConcretizationTypeError:
            raise ConfigError("`neg_pos_ratio` is traced; it must be an int known when tracing (it sets how "
                              "many entries each slice keeps): under jit pass it as a static argument "
                              "(static_argnames=('neg_pos_ratio',))") from None
    try:
        ratio = -1 if isinstance(neg_pos_ratio, (bool, np.bool_)) else operator.index(neg_pos_ratio)
    except TypeError:
        ratio = -1
    if ratio < 0:
        raise ConfigError(f"`neg_pos_ratio` (={neg_pos_ratio!r}) must be a non-negative int, e.g. 3")
    n = loss.shape[axis]
    num_pos = jnp.sum(positive, axis=axis, dtype=jnp.int32)
    # k = min(ratio * num_pos, n - num_pos) without int32 overflow: a ratio above n already
    # takes every non-positive once there is one positive, and ratio * num_pos > rest exactly
    # when num_pos > rest // ratio.
    ratio = min(ratio, max(n, 1))
    rest = n - num_pos
    if ratio == 0:
        k = jnp.zeros_like(num_pos)
    else:
        k = jnp.where(num_pos > rest // ratio, rest, ratio * num_pos)
    if n == 0:
        return loss.astype(bool)  # nothing to select: as `rank`, before any resharding
    loss, restore = gather_axis(loss, axis)
    positive, _ = gather_axis(positive, axis)
    key = order_key(loss, descending=True)
    # Positives get a key above every float's key, so they rank after all non-positives.
    key = jnp.where(positive, jnp.array(np.iinfo(key.dtype).max, key.dtype), key)
    key = jnp.moveaxis(key, axis, -1)
    return restore(jnp.moveaxis(select_keys(key, k, method), -1, axis))


def _per_slice_k(k, batch_shape: tuple[int, ...], n: int, axis: int) -> jax.Array:
    if isinstance(k, (list, tuple)) or (  # one k per slice, written out, or another library's array
            not isinstance(k, (jax.Array, np.ndarray, np.generic)) and hasattr(k, "__array__")):
        try:
            k = np.asarray(k)
        except (TypeError, ValueError, RuntimeError):
            pass  # ragged, or not convertible: refused below
    if isinstance(k, (bool, np.bool_)) or not (
        isinstance(k, (int, np.integer)) or jnp.issubdtype(getattr(k, "dtype", object), jnp.integer)
    ):
        raise ConfigError(
            f"`k` (={k!r}) must be an int or an integer array with one k per slice; "
            f"convert it, e.g. jnp.asarray(k, jnp.int32)"
        )
    if isinstance(k, (int, np.integer)):
        k = min(max(int(k), 0), n)
        return jnp.full(batch_shape, k, jnp.int32)
    if isinstance(k, np.ndarray) and (k.dtype.itemsize > 4 or k.dtype == np.uint32):
        # Clamp before jax sees it: without x64 jax casts int64 / uint64 / uint32 to int32,
        # wrapping 2**32 + 1 to 1.
        k = np.clip(k, 0, n).astype(np.int32)
    k = jnp.asarray(k)
    if k.dtype.itemsize < 4:
        # Clamp in int32: in k's own (u)int8 / (u)int16 dtype a row length of 300 wraps to 44.
        k = k.astype(jnp.int32)
    try:
        k = jnp.broadcast_to(k, batch_shape)
    except ValueError:
        # torch's `rank < k` takes k with the ranked axis kept (keepdim=True), e.g. (rows, 1).
        kept = ""
        if k.ndim == len(batch_shape) + 1 and k.shape[axis] == 1:
            try:
                np.broadcast_shapes(k.shape[:axis] + k.shape[axis + 1:], batch_shape)
                kept = (f"; this k keeps `axis` (={axis}), as torch's `rank < k` needs: drop it, "
                        f"jnp.squeeze(k, {axis})")
            except ValueError:
                pass
        raise ConfigError(
            f"`k` has shape {k.shape}, which does not broadcast to {batch_shape} (the shape of x "
            f"without `axis`); pass one k per slice{kept}"
        ) from None
    return jnp.clip(k, 0, n).astype(jnp.int32)


def select_keys(key: jax.Array, k: jax.Array, method: str = "auto") -> jax.Array:
    """mask = stable ascending rank of `key` along the last axis < k (k in [0, n], batch-shaped);
    n >= 1 (the callers return an empty axis's mask before resharding)."""
    k = match_batch(k, key)
    if method == "xla":
        return _select_xla(key, k)
    if method == "host":
        return _select_host(key, k)
    return lax.platform_dependent(key, k, cpu=_select_host, default=_select_xla)


def _select_host(key: jax.Array, k: jax.Array) -> jax.Array:
    return host_call(_host.topk_rows, jax.ShapeDtypeStruct(key.shape, jnp.bool_), key, k)


def _select_xla(key: jax.Array, k: jax.Array) -> jax.Array:
    bits = key.dtype.itemsize * 8
    sign = np.array(1 << (bits - 1), key.dtype)
    sdt = jnp.int64 if bits == 64 else jnp.int32
    # Compare as signed integers (the key with its top bit flipped keeps its order): XLA:CPU
    # vectorises signed compares, unsigned ones run ~10x slower. Counts are summed in float32
    # (exact below 2^24, and faster than an int32 sum on CPU).
    skey = lax.bitcast_convert_type(key ^ sign, sdt)
    cdt = jnp.float32 if key.shape[-1] < (1 << 24) else jnp.int32
    kc = k.astype(cdt)

    # t ends as the k-th smallest key: the largest t with count(key < t) < k, built bit by bit
    # from the top (a bisection over the key range, one compare-and-count pass per bit; the
    # loop is unrolled, which on CPU avoids a per-iteration cost as large as a pass).
    # Sharded as the batch of `key` is (a replicated t broke `jnp.where` under `jax.set_mesh`
    # with Explicit axes: "select `which` must be scalar or have the same sharding as cases").
    # And as `k` is: a per-row k split over the rows of a replicated key failed the same way.
    t = jnp.zeros_like(key[..., 0]) | jnp.zeros_like(k, dtype=key.dtype)
    for bit in range(bits - 1, -1, -1):
        c = t | np.array(1 << bit, key.dtype)
        below = jnp.sum((skey < lax.bitcast_convert_type(c ^ sign, sdt)[..., None]).astype(cdt), axis=-1)
        t = jnp.where(below < kc, c, t)
    st = lax.bitcast_convert_type(t ^ sign, sdt)[..., None]
    less = skey < st
    equal = skey == st
    need = k - jnp.sum(less, axis=-1, dtype=jnp.int32)
    # Ties at the threshold: the first `need` of them in index order, as a stable sort takes them.
    first = jnp.cumsum(equal, axis=-1, dtype=jnp.int32) <= need[..., None]
    return less | (equal & first)
