"""`topk_mask` == torch's `x.sort(descending=largest, stable=True).indices.argsort() < k` and
`hard_negative_mask` == torchvision's SSD hard-negative mining, exactly (boolean masks).

Both kernels (host introselect on CPU, XLA bisection select elsewhere) are checked.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxport._errors import ConfigError
from jaxport.ops import hard_negative_mask, rank, topk_mask
from tests.test_ops_data import float8_data, tricky, to_torch, torch_rank

DTYPES = ["float32", "float16", "bfloat16", "int32", "uint8"]
SHAPES_AXES = [((4, 37), -1), ((4, 37), 0), ((3, 5, 19), 1)]
K_KINDS = ["per_slice", "zero", "n", "above_n", "negative", "middle"]


def _k(kind: str, batch_shape, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if kind == "per_slice":  # includes negative, 0, n and > n entries
        return rng.integers(-3, n + 4, batch_shape).astype(np.int32)
    return {"zero": 0, "n": n, "above_n": n + 5, "negative": -2, "middle": n // 2}[kind]


def _torch_topk(x, dtype, k, axis, largest):
    r = torch_rank(to_torch(x, dtype), axis, largest)
    k = np.asarray(k)
    return r < (np.expand_dims(k, axis) if k.ndim else k)


@pytest.mark.parametrize("method", ["host", "xla"])
@pytest.mark.parametrize("k_kind", K_KINDS)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", SHAPES_AXES)
def test_topk_mask_matches_torch_rank_below_k(shape, axis, dtype, largest, k_kind, method):
    x = tricky(shape, dtype)
    batch_shape = tuple(s for i, s in enumerate(shape) if i != axis % len(shape))
    k = _k(k_kind, batch_shape, shape[axis])
    want = _torch_topk(x, dtype, k, axis, largest)
    got = topk_mask(jnp.asarray(x), k, axis, largest, method=method)
    assert got.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got), want)


def test_topk_mask_k_broadcasts_over_other_axes():
    x = tricky((3, 4, 29), "float32", seed=4)
    k = np.array([0, 5, 29], np.int32)[:, None]  # one k per leading index, broadcast over axis 1
    want = _torch_topk(x, "float32", np.broadcast_to(k, (3, 4)), -1, True)
    np.testing.assert_array_equal(np.asarray(topk_mask(x, k)), want)


@pytest.mark.parametrize("method", ["auto", "xla"])
def test_topk_mask_jit_and_vmap_equal_eager(method):
    x = tricky((6, 4, 41), "float32", seed=5)
    k = np.random.default_rng(0).integers(-1, 43, (6, 4)).astype(np.int32)
    want = _torch_topk(x, "float32", k, -1, True)
    f = lambda x, k: topk_mask(x, k, -1, True, method=method)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(f(x, k)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, k)), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(x, k)), want)
    # k shared by the batch (unbatched under vmap), x batched.
    shared = jax.vmap(f, in_axes=(0, None))(x, k[0])
    np.testing.assert_array_equal(np.asarray(shared), _torch_topk(x, "float32", np.broadcast_to(k[0], (6, 4)), -1, True))


def test_topk_mask_large_rows_use_threads_and_stay_exact():
    x = tricky((40, 5000), "float32", seed=6)
    k = np.random.default_rng(1).integers(0, 5000, 40).astype(np.int32)
    want = _torch_topk(x, "float32", k, -1, True)
    np.testing.assert_array_equal(np.asarray(jax.jit(topk_mask)(x, k)), want)


def test_topk_mask_errors_name_the_argument():
    x = jnp.zeros((2, 5))
    with pytest.raises(ConfigError, match=r"`k` \(=1.5\) must be an int"):
        topk_mask(x, 1.5)
    with pytest.raises(ConfigError, match=r"`k` has shape \(3,\), which does not broadcast to \(2,\)"):
        topk_mask(x, jnp.ones(3, jnp.int32))
    with pytest.raises(ConfigError, match=r"`axis` \(=-3\)"):
        topk_mask(x, 1, axis=-3)
    # 64-bit mode off: int64 keys 2**40 and 5 wrapped to int32, and k=1 picked 5.
    with pytest.raises(ConfigError, match=r"`x` has dtype int64, but jax's 64-bit mode is off"):
        topk_mask(np.array([2**40, 1, 5], np.int64), 1)


def test_topk_mask_takes_k_as_a_list_as_torch_users_write_it():
    # A list was refused, with a fix (`k.astype`) that a list does not have.
    x = np.random.default_rng(5).standard_normal((3, 9)).astype(np.float32)
    got = topk_mask(x, [1, 0, 4], largest=True)
    want = topk_mask(x, jnp.array([1, 0, 4], jnp.int32), largest=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got).sum(1), [1, 0, 4])
    with pytest.raises(ConfigError, match=r"`k` \(=\[1, 0\.5\]\) must be an int|`k` \(=array\(\[1\. , 0\.5\]\)\) must be"):
        topk_mask(x, [1, 0.5])


def torchvision_ssd_mining(cls_loss, foreground, ratio: int, stable: bool = False) -> torch.Tensor:
    """torchvision/models/detection/ssd.py `SSDHead.compute_loss`, the mining lines written out.

    torchvision sorts without `stable=True`, so it breaks ties in an unspecified order;
    `stable=True` gives the tie order `hard_negative_mask` promises (index order).
    """
    num_foreground = foreground.sum(1, keepdim=True)
    num_negative = ratio * num_foreground
    negative_loss = cls_loss.clone()
    negative_loss[foreground] = -float("inf")
    values, idx = negative_loss.sort(dim=1, descending=True, stable=stable)
    return idx.sort(1)[1] < num_negative


def _ssd_case(seed: int, ratio: int, dtype: str, ties: bool):
    rng = np.random.default_rng(seed)
    rows, anchors = 6, 300
    if ties:
        loss = tricky((rows, anchors), dtype, seed=seed)
        # SSD's losses are finite and >= 0; ties, +inf and NaN must not break the equality. A
        # loss of -inf would tie with torchvision's -inf for positives (which then win by index).
        loss = np.where(np.isneginf(np.asarray(loss, np.float32)), 7.0, loss).astype(loss.dtype)
    else:  # cross-entropy-like losses: distinct, >= 0
        loss = rng.permutation(rows * anchors).reshape(rows, anchors).astype(np.float32) / 97.0
    num_pos = rng.integers(0, anchors // (ratio + 1) + 1, rows)  # k always fits
    positive = np.zeros((rows, anchors), bool)
    for i, p in enumerate(num_pos):
        positive[i, rng.choice(anchors, p, replace=False)] = True
    return loss, positive


@pytest.mark.parametrize("ratio", [0, 1, 3])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_hard_negative_mask_matches_torchvision_ssd(seed, ties, ratio):
    dtype = "bfloat16" if ties and seed else "float32"
    loss, positive = _ssd_case(seed, ratio, dtype, ties)
    # With ties only the stable variant of torchvision's code defines a unique answer.
    want = torchvision_ssd_mining(to_torch(loss, dtype), torch.from_numpy(positive), ratio, stable=ties).numpy()
    got = hard_negative_mask(loss, positive, ratio)
    np.testing.assert_array_equal(np.asarray(got), want)
    jitted = jax.jit(hard_negative_mask, static_argnums=2)(loss, positive, ratio)
    np.testing.assert_array_equal(np.asarray(jitted), want)
    per_image = jax.vmap(lambda l, p: hard_negative_mask(l, p, ratio, axis=0))(loss, positive)
    np.testing.assert_array_equal(np.asarray(per_image), want)


def test_hard_negative_mask_never_selects_positives_when_k_does_not_fit():
    loss = jnp.array([[5.0, 4.0, -jnp.inf, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    positive = jnp.array([[True, True, True, False, False], [False, True, False, False, False]])
    got = hard_negative_mask(loss, positive, neg_pos_ratio=3, axis=1)
    # Row 0: k = min(9, 2) = 2, the two non-positives; row 1: k = min(3, 4) = 3, ties by index.
    np.testing.assert_array_equal(np.asarray(got), [[0, 0, 0, 1, 1], [1, 0, 1, 1, 0]])
    # The anchor axis may come first.
    np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss.T, positive.T, 3, axis=0)), np.asarray(got).T)


def test_hard_negative_mask_errors_name_the_argument():
    with pytest.raises(ConfigError, match=r"`neg_pos_ratio` \(=-1\) must be a non-negative int"):
        hard_negative_mask(jnp.zeros((2, 4)), jnp.zeros((2, 4), bool), -1)
    with pytest.raises(ConfigError, match=r"`positive` has shape \(3,\)"):
        hard_negative_mask(jnp.zeros((2, 4)), jnp.zeros(3, bool))
    with pytest.raises(ConfigError, match="`loss` has dtype int32"):
        hard_negative_mask(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), bool))
    # Under jit the ratio 3 arrived traced, and the message said it "must be a non-negative int".
    with pytest.raises(ConfigError, match=r"`neg_pos_ratio` is traced.*static_argnames=\('neg_pos_ratio',\)"):
        jax.jit(hard_negative_mask)(jnp.zeros((2, 4)), jnp.zeros((2, 4), bool), 3)
    with pytest.raises(ConfigError, match=r"`loss` has dtype float64, but jax's 64-bit mode is off"):
        hard_negative_mask(np.array([[1 + 1e-12, 1.0, 0.0]]), np.array([[False, False, True]]))


@pytest.mark.parametrize("method", ["auto", "xla"])
def test_masked_loss_is_differentiable_through_the_mask(method):
    # The SSD use: gradients flow to the selected losses; the mask itself is constant.
    loss = jnp.array([[3.0, 1.0, 2.0, 5.0], [0.5, 4.0, 4.0, 1.0]])
    f = lambda x: jnp.sum(jnp.where(topk_mask(x, 2, -1, True, method=method), x, 0.0))  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(f))(loss)), [[1, 0, 0, 1], [0, 1, 1, 0]])
    g = jax.grad(lambda x: jnp.sum(jnp.where(hard_negative_mask(x, x > 4.5, 1), x, 0.0)))(loss)
    np.testing.assert_array_equal(np.asarray(g), [[1, 0, 0, 0], [0, 0, 0, 0]])


def test_hard_negative_mask_with_a_huge_ratio_takes_every_negative():
    """ratio * num_positive overflowed int32: 2**30 * 2 selected nothing, 2**31 raised."""
    loss = jnp.array([[0.1, 2.0, 0.5, 3.0, 0.2]])
    positive = jnp.array([[True, True, False, False, False]])
    for ratio in (2, 2**30, 2**31, 10**20):
        np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss, positive, ratio)), [[0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss, positive, 1)), [[0, 0, 1, 1, 0]])
    with pytest.raises(ConfigError, match=r"`neg_pos_ratio` \(=True\) must be a non-negative int"):
        hard_negative_mask(loss, positive, True)


@pytest.mark.parametrize("method", ["host", "xla"])
def test_wide_integer_k_arrays_are_clamped_before_jax_narrows_them(method):
    """Without x64 jax casts an int64 / uint64 k array to int32: 2**32 + 1 became 1."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)), jnp.float32)
    for k in (np.array([2**32 + 1, 2**31, 3], np.int64), np.array([2**32, 2**63, 3], np.uint64),
              np.array([2**31, 2**32 - 1, 3], np.uint32)):
        got = topk_mask(x, k, -1, True, method=method)
        np.testing.assert_array_equal(np.asarray(got).sum(axis=-1), [4, 4, 3])


@pytest.mark.parametrize("method", ["host", "xla"])
@pytest.mark.parametrize("kdtype", ["int8", "uint8", "int16", "uint16"])
def test_narrow_integer_k_arrays_are_clamped_in_int32(method, kdtype):
    """Clamping in k's own dtype wrapped the row length: n = 300 became 44 in uint8."""
    n = 300 if kdtype in ("uint8", "int8") else 70000
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, n)), jnp.float32)
    k = np.array([100, 50] if kdtype != "uint16" else [65535, 4000], kdtype)
    for kk in (k, jnp.asarray(k)):
        got = jax.jit(lambda v, kk: topk_mask(v, kk, method=method))(x, kk)
        want = _torch_topk(np.array(x), "float32", k.astype(np.int64), -1, True)  # a writable copy for torch
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(got).sum(-1), k.astype(np.int64))


def test_method_xla_makes_the_ops_exportable():
    # jax.export cannot serialize the CPU host kernels' callbacks; method="xla" is the way.
    from jax import export

    x = tricky((4, 37), "float32", seed=3)
    k = np.array([0, 5, 37, 40], np.int32)
    positive = x > 1.0
    loss = np.abs(np.nan_to_num(x, posinf=9.0, neginf=0.0))

    def f(v, kk, pos, ls):
        return (rank(v, method="xla"), topk_mask(v, kk, method="xla"),
                hard_negative_mask(ls, pos, method="xla"))

    # (Exported.serialize() would need the optional flatbuffers package; export itself already
    # serializes the module, which is where the host callbacks fail.)
    restored = export.export(jax.jit(f), platforms=("cpu",))(x, k, positive, loss)
    for got, want in zip(restored.call(x, k, positive, loss), f(x, k, positive, loss), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(restored.call(x, k, positive, loss)[0]),
                                  torch_rank(to_torch(x, "float32"), -1, False))


def test_argument_kinds_are_checked():
    x = jnp.zeros((2, 4))
    cases = [
        (lambda: topk_mask(x, 1, largest=None), r"`largest` \(=None\) must be True or False"),
        (lambda: rank(x, descending="no"), r"`descending` \(='no'\) must be True or False"),
        (lambda: rank(x, axis=True), r"`axis` \(=True\) must be an int"),
        (lambda: rank(np.array(["b", "a"])), r"`x` must be an array of numbers or bools, got ndarray of dtype <U1"),
        (lambda: topk_mask(np.array([1, None]), 1), r"`x` must be an array of numbers or bools"),
        (lambda: hard_negative_mask(x, None), r"`positive` is None"),
        (lambda: hard_negative_mask(x, jnp.ones((2, 4)) * 0.5), r"`positive` has dtype float32"),
        (lambda: rank(x, method="numpy"), r"`method` \(='numpy'\) must be one of 'auto', 'xla', 'host'"),
        (lambda: jax.jit(rank, static_argnums=1)(x, -1, True), r"`descending` is traced.*static_argnames"),
        (lambda: jax.jit(topk_mask, static_argnums=(1, 2))(x, 1, -1, False), r"`largest` is traced"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError, match=message):
            call()
    # An integer mask counts nonzero entries as positive, as torch's labels > 0 would.
    loss = jnp.array([[0.1, 2.0, 0.5, 3.0]])
    np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss, jnp.array([[0, 0, 0, 7]]), 1)),
                                  np.asarray(hard_negative_mask(loss, jnp.array([[False, False, False, True]]), 1)))


@pytest.mark.parametrize("method", ["host", "xla"])
@pytest.mark.parametrize("k_kind", ["per_slice", "middle", "one_zero"])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_topk_mask_matches_torch_on_the_float32_values(dtype, largest, k_kind, method):
    """float8 keys widen to float32: -0.0 and +0.0 tie (the earlier one is taken first, as in
    torch's stable sort of the widened values), and so does every NaN. "one_zero" cuts inside
    the zeros, after the first: +0.0 before -0.0 in rows 0 and 2, the other way in rows 1 and 3,
    so a key that orders -0.0 below +0.0 takes the wrong one in either direction."""
    x = float8_data((4, 37), dtype)
    x[:, :2] = np.array([[0.0, -0.0], [-0.0, 0.0]] * 2, np.float32).astype(x.dtype)
    values = x.astype(np.float32)
    if k_kind == "one_zero":  # everything ahead of the zeros, and one zero
        ahead = (values > 0) | np.isnan(values) if largest else values < 0
        k = (ahead.sum(-1) + 1).astype(np.int32)
    else:
        k = _k(k_kind, (4,), 37)
    want = _torch_topk(values, "float32", k, -1, largest)
    got = topk_mask(jnp.asarray(x), k, -1, largest, method=method)
    np.testing.assert_array_equal(np.asarray(got), want)
