"""Edges of `jaxport.ops` the per-op suites leave out, each against torch or scipy in the test.

Integer extremes of every width, half-precision extremes, 64-bit inputs (with and without
jax's 64-bit mode), empty and one-element axes, every kind of `k`, per-row `k` under `vmap`
and `jit`, `hard_negative_mask` rows with no or only positives, `logsumexp`'s `b`, `where`,
`return_sign` and `keepdims` together, gradients at 1e30, and 2-D meshes (Auto and Explicit,
eager and jitted) whose shards hold one or an odd number of entries. The masks and ranks are
exact (tolerance zero); logsumexp tolerances are float32 rounding (1e-6 relative, 1e-5 where
scipy's float64 result is compared with float32) and 1e-13 in float64.
"""
import contextlib
import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import scipy.special
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxport._errors import ConfigError
from jaxport.ops import _logsumexp, hard_negative_mask, logsumexp, rank, topk_mask
from tests.test_ops_data import torch_rank

METHODS = ["host", "xla"]


def _scipy_lse(a, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return scipy.special.logsumexp(np.asarray(a, np.float64), **kwargs)


def _torch_ssd_mining(loss, positive, ratio):
    """torchvision's SSD mining with a stable sort (ties in index order), then positives dropped:
    where k does not fit, torchvision picks -inf-marked positives, which `hard_negative_mask`
    never selects."""
    fg = torch.from_numpy(np.array(positive, bool))
    negative_loss = torch.from_numpy(np.asarray(loss, np.float32)).clone()
    negative_loss[fg] = -float("inf")
    idx = negative_loss.sort(dim=1, descending=True, stable=True).indices
    return (idx.sort(dim=1).indices < ratio * fg.sum(1, keepdim=True)).numpy() & ~fg.numpy()


@pytest.fixture(params=["one_pass", "shifted"])
def lse_path(request, monkeypatch):
    """Both logsumexp paths (see tests/test_ops_logsumexp.py), whatever the size."""
    monkeypatch.setattr(_logsumexp, "_ONE_PASS_MIN_SIZE", 0 if request.param == "one_pass" else 1 << 62)
    monkeypatch.setattr(_logsumexp, "_ONE_PASS_BACKENDS", frozenset({jax.default_backend()}))
    return request.param


# --- rank / topk_mask: dtypes at their extremes -------------------------------------------------

def _extremes(dtype: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    info = np.iinfo(dtype)
    pool = np.array([info.min, info.min + 1, info.max - 1, info.max, 0, 1, info.max // 2, info.max // 2 + 1], dtype)
    return rng.choice(pool, size=shape)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "uint8", "uint16", "uint32", "bool"])
def test_integer_extremes_rank_and_select_as_torch(dtype, descending, method):
    x = _extremes(dtype, (3, 41))
    # torch sorts few unsigned types: int64 holds every value, in the same order.
    reference = torch.from_numpy(x if dtype in ("int8", "int16", "int32", "uint8", "bool") else x.astype(np.int64))
    want = torch_rank(reference, -1, descending)
    np.testing.assert_array_equal(np.asarray(rank(x, -1, descending, method=method)), want)
    k = np.array([0, 7, 41])
    np.testing.assert_array_equal(np.asarray(topk_mask(x, k, -1, descending, method=method)), want < k[:, None])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_extremes_rank_and_select_as_torch(dtype, descending, method):
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    fi = ml_dtypes.finfo(np_dtype)
    pool = np.array([0.0, -0.0, fi.smallest_subnormal, -fi.smallest_subnormal, fi.smallest_normal,
                     -fi.smallest_normal, fi.max, -fi.max, np.inf, -np.inf, np.nan, -np.nan], np.float32)
    x = np.random.default_rng(1).choice(pool, (4, 33))
    want = torch_rank(torch.from_numpy(x).to(getattr(torch, dtype)), -1, descending)
    xj = jnp.asarray(x, np_dtype)
    np.testing.assert_array_equal(np.asarray(rank(xj, -1, descending, method=method)), want)
    np.testing.assert_array_equal(np.asarray(topk_mask(xj, 9, -1, descending, method=method)), want < 9)


@pytest.mark.parametrize("method", METHODS)
def test_all_nan_rows_and_one_element_axes(method):
    x = np.full((3, 5), np.nan, np.float32)
    x[1, 2], x[2, 0] = -np.nan, 0.0  # NaN of either sign ties with NaN
    xt = torch.from_numpy(x)
    for descending in (False, True):
        want = torch_rank(xt, -1, descending)
        np.testing.assert_array_equal(np.asarray(rank(x, -1, descending, method=method)), want)
        np.testing.assert_array_equal(np.asarray(topk_mask(x, 2, -1, descending, method=method)), want < 2)
    one = np.array([[3.0], [np.nan]], np.float32)
    np.testing.assert_array_equal(np.asarray(rank(one, 1, method=method)), torch_rank(torch.from_numpy(one), 1, False))
    np.testing.assert_array_equal(np.asarray(topk_mask(one, np.array([0, 1]), 1, method=method)), [[False], [True]])


@pytest.mark.parametrize("method", METHODS)
def test_smallest_k_puts_nan_last_and_zeros_tied_for_every_k(method):
    x = np.array([[1.0, np.nan, -0.0, 0.0, -np.inf, np.inf, 1.0, -1e-45]], np.float32)
    want = torch_rank(torch.from_numpy(x), -1, False)
    for k in range(x.shape[1] + 1):
        np.testing.assert_array_equal(np.asarray(topk_mask(x, k, largest=False, method=method)), want < k)


# --- 64-bit inputs -----------------------------------------------------------------------------

# The XLA select on 64-bit keys compiles 64 bisection passes per dtype: one direction there.
@pytest.mark.parametrize("method,descending", [("host", False), ("host", True), ("xla", True)])
def test_64bit_extremes_with_x64_rank_and_select_as_torch(x64, descending, method):
    rng = np.random.default_rng(2)
    i64 = np.iinfo(np.int64)
    ints = rng.choice(np.array([i64.min, i64.min + 1, -2**40, -1, 0, 1, 2**40, i64.max - 1, i64.max]), (3, 19))
    floats = rng.choice(np.array([1.0, 1 + 2**-52, -0.0, 0.0, 5e-324, -5e-324, 1e-310, 1e308, -np.inf, np.inf, np.nan]),
                        (3, 19))
    uints = rng.choice(np.array([0, 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1], np.uint64), (3, 19))
    k = np.array([0, 6, 19])
    # torch has no uint64 sort: flipping the top bit maps uint64 onto int64 in the same order.
    for x, reference in [(ints, torch.from_numpy(ints)), (floats, torch.from_numpy(floats)),
                         (uints, torch.from_numpy((uints ^ np.uint64(2**63)).view(np.int64)))]:
        want = torch_rank(reference, -1, descending)
        np.testing.assert_array_equal(np.asarray(rank(x, -1, descending, method=method)), want)
        got = jax.jit(lambda v, kk: topk_mask(v, kk, -1, descending, method=method))(x, k)
        np.testing.assert_array_equal(np.asarray(got), want < k[:, None])


def test_64bit_logsumexp_with_x64_matches_scipy_and_torch(x64, lse_path):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 50)) * 300
    b = rng.standard_normal((4, 50))
    got = logsumexp(a, 1)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), _scipy_lse(a, axis=1), rtol=1e-13)
    for g, w in zip(logsumexp(a, 1, b=b, return_sign=True), _scipy_lse(a, axis=1, b=b, return_sign=True), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-12)
    grad = jax.grad(lambda v: logsumexp(v, 1).sum())(a)
    np.testing.assert_allclose(np.asarray(grad), torch.softmax(torch.from_numpy(a), 1).numpy(), rtol=1e-10, atol=1e-300)
    ints = np.array([2**40, 3, -2**40])
    np.testing.assert_allclose(np.asarray(logsumexp(ints)), torch.logsumexp(torch.from_numpy(ints).double(), 0).item(),
                               rtol=1e-15)


def test_int64_inputs_jax_would_wrap_are_refused_by_logsumexp_and_hard_negative_mask():
    """With 64-bit mode off, jax wraps int64 to int32 without a word: logsumexp of
    [2**40, 5, -2**40] came out 5.01 where torch gives 1.0995e12, a `b` of 2**40 counted as 0,
    and a `positive` label of 2**32 wrapped to 0, i.e. not positive."""
    assert not jax.config.jax_enable_x64
    big = np.array([2**40, 5, -2**40])
    assert torch.logsumexp(torch.from_numpy(big), 0).item() > 1e12  # the reference value
    message = r"`{}` has dtype int64, but jax's 64-bit mode is off, so jax would wrap it to int32.*jax_enable_x64"
    with pytest.raises(ConfigError, match=message.format("a")):
        logsumexp(big)
    with pytest.raises(ConfigError, match=message.format("a")):
        logsumexp(torch.from_numpy(big))
    with pytest.raises(ConfigError, match=message.format("b")):
        logsumexp(np.zeros(3, np.float32), b=big)
    loss = np.array([[0.3, 2.0, 1.0, 0.5]], np.float32)
    with pytest.raises(ConfigError, match=message.format("positive")):
        hard_negative_mask(loss, np.array([[2**32, 0, 0, 0]]), 1)
    # int64 that 32 bits hold (numpy's default integers) is still taken, as torch takes it.
    small = np.array([[3, 0, -2], [1, 1, 1]])
    want = torch.logsumexp(torch.from_numpy(small).float(), 1).numpy()
    np.testing.assert_allclose(np.asarray(logsumexp(small, 1)), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss, np.array([[7, 0, 0, 0]]), 1)),
                                  _torch_ssd_mining(loss, np.array([[True, False, False, False]]), 1))


# --- empty axes --------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["auto", "xla"])
@pytest.mark.parametrize("shape,axis", [((0, 5), -1), ((5, 0), -1), ((0, 5), 0), ((0,), 0), ((2, 0, 3), 1),
                                        ((2, 0, 3), -1)])
def test_empty_axes_eager_and_jitted(shape, axis, method):
    x = np.zeros(shape, np.float32)
    want = torch_rank(torch.from_numpy(x), axis, False)
    for wrap in (lambda f: f, jax.jit):
        np.testing.assert_array_equal(np.asarray(wrap(lambda v: rank(v, axis, method=method))(x)), want)
        np.testing.assert_array_equal(np.asarray(wrap(lambda v: topk_mask(v, 1, axis, method=method))(x)), want < 1)
        got = wrap(lambda v: hard_negative_mask(v, v > 0, 3, axis, method=method))(x)
        assert got.shape == shape and not np.asarray(got).any()
    np.testing.assert_array_equal(np.asarray(logsumexp(x, axis)), torch.logsumexp(torch.from_numpy(x), axis).numpy())


# --- k -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_every_integer_kind_of_k(method):
    x = np.random.default_rng(4).standard_normal((3, 6)).astype(np.float32)
    want = torch_rank(torch.from_numpy(x), -1, True)
    per_row = np.array([1, 0, 6])
    scalars = [np.array(2), jnp.array(2), np.int64(2), np.uint8(2), torch.tensor(2)]
    for k in scalars:
        np.testing.assert_array_equal(np.asarray(topk_mask(x, k, method=method)), want < 2)
    # A torch tensor of k's (as a port holds them) raised numpy's "Cannot interpret 'torch.int64'
    # as a data type", naming neither `k` nor the fix.
    for k in [per_row, jnp.asarray(per_row), per_row.tolist(), torch.from_numpy(per_row), np.array(per_row, np.uint16)]:
        np.testing.assert_array_equal(np.asarray(topk_mask(x, k, method=method)), want < per_row[:, None])
    for k, clamped in [(np.uint64(2**64 - 1), 6), (10**30, 6), (-10**30, 0), (torch.tensor([2**40, -2**40, 3]), None)]:
        got = np.asarray(topk_mask(x, k, method=method)).sum(-1)
        np.testing.assert_array_equal(got, [6, 0, 3] if clamped is None else [clamped] * 3)


def test_non_integer_k_is_refused_naming_k():
    x = jnp.zeros((3, 6))
    for k in [True, np.True_, 2.0, np.float32(2), np.array(2.0), jnp.array([1.0, 2.0, 3.0]),
              np.array([True, False, True]), torch.tensor([1.0, 2.0, 3.0]), None, "2"]:
        with pytest.raises(ConfigError, match=r"`k` \(=.*\) must be an int or an integer array.*"
                                              r"jnp.asarray\(k, jnp.int32\)"):
            topk_mask(x, k)


def test_k_with_torch_keepdim_shape_is_refused_with_the_fix():
    """torch's `rank < k` needs k of shape (rows, 1); here k is one per slice, (rows,)."""
    x = jnp.zeros((3, 6))
    with pytest.raises(ConfigError, match=r"`k` has shape \(3, 1\), which does not broadcast to \(3,\).*"
                                          r"keeps `axis` \(=1\).*jnp.squeeze\(k, 1\)"):
        topk_mask(x, np.ones((3, 1), np.int32))
    with pytest.raises(ConfigError, match=r"`k` has shape \(1, 6\), which does not broadcast to \(6,\)"
                                          r".*squeeze\(k, 0\)"):
        topk_mask(x, np.ones((1, 6), np.int32), axis=0)
    with pytest.raises(ConfigError, match=r"`k` has shape \(2,\), which does not broadcast to \(3,\)"
                                          r"[^;]*; pass one k per slice$"):
        topk_mask(x, np.ones(2, np.int32))


@pytest.mark.parametrize("method", ["auto", "xla"])
def test_traced_per_row_k_under_vmap_and_jit_compiles_once(method):
    x = np.random.default_rng(5).standard_normal((4, 9)).astype(np.float32)
    want = torch_rank(torch.from_numpy(x), -1, True)
    ks = np.array([-1, 0, 4, 9, 12], np.int32)
    expected = np.stack([want < k for k in ks])
    f = lambda k: topk_mask(x, k, method=method)  # noqa: E731 - x closed over, only k batched
    np.testing.assert_array_equal(np.asarray(jax.vmap(f)(ks)), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(f))(ks)), expected)
    chex.clear_trace_counter()  # the lambda below is one code location across the parameters
    once = jax.jit(chex.assert_max_traces(lambda v, k: topk_mask(v, k, method=method), n=1))
    for k in ks:  # a new k value is new data, not a new program
        np.testing.assert_array_equal(np.asarray(once(x, k)), want < k)
    # One k per column of a (4, 9) x ranked along axis 0, the slices under vmap.
    cols = np.arange(9) % 5
    got = jax.vmap(lambda v, k: topk_mask(v, k, 0, method=method), in_axes=(1, 0), out_axes=1)(x, cols)
    np.testing.assert_array_equal(np.asarray(got), torch_rank(torch.from_numpy(x), 0, True) < cols)


# --- hard_negative_mask ------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("ratio", [0, 1, 3])
def test_hard_negative_mask_rows_with_no_or_only_positives(ratio, method):
    rng = np.random.default_rng(6)
    loss = rng.random((5, 8)).astype(np.float32)
    loss[3, 2], loss[4, 5] = np.nan, np.inf
    positive = np.zeros((5, 8), bool)
    positive[1] = True  # only positives: nothing to mine
    positive[2, :3] = True  # k = 3 * ratio does not fit the 5 negatives when ratio > 1
    positive[3, 1] = positive[4, 0] = True
    want = _torch_ssd_mining(loss, positive, ratio)
    assert not want[0].any() and not want[1].any()
    for mask in (positive, positive.astype(np.int8), positive.astype(np.uint8) * 200):
        np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss, mask, ratio, method=method)), want)
    # One row of positives broadcast over the batch.
    row = np.array([True] + [False] * 7)
    np.testing.assert_array_equal(np.asarray(hard_negative_mask(loss, row, ratio, method=method)),
                                  _torch_ssd_mining(loss, np.broadcast_to(row, loss.shape), ratio))


def test_hard_negative_mask_on_a_middle_axis():
    rng = np.random.default_rng(7)
    loss = rng.random((2, 7, 3)).astype(np.float32)
    positive = rng.random((2, 7, 3)) > 0.7
    as_rows = lambda a: np.asarray(a).transpose(0, 2, 1).reshape(6, 7)  # noqa: E731
    got = hard_negative_mask(loss, positive, 2, axis=1)
    np.testing.assert_array_equal(as_rows(got), _torch_ssd_mining(as_rows(loss), as_rows(positive), 2))


# --- logsumexp ---------------------------------------------------------------------------------

INF, NAN = np.inf, np.nan
ROWS = np.array([[1.0, 2.0, 3.0], [-INF, -INF, -INF], [INF, 1.0, 2.0], [NAN, 1.0, 2.0], [0.0, 0.0, 0.0], [5, 5, 5]],
                np.float32)


@pytest.mark.parametrize("return_sign", [False, True])
@pytest.mark.parametrize("axis", [1, None, (0, 1), (-1, 0)])
def test_logsumexp_b_with_zeros_and_negatives_matches_scipy(lse_path, axis, return_sign):
    b = np.array([[1, -1, 0], [1, 2, 3], [-1, 1, 1], [1, 1, 1], [1, -1, 0], [1, -2, 1]], np.float32)
    got = logsumexp(ROWS, axis, b=b, return_sign=return_sign)
    want = _scipy_lse(ROWS, axis=axis, b=b, return_sign=return_sign)
    for g, w in zip(got, want, strict=True) if return_sign else [(got, want)]:
        np.testing.assert_allclose(np.asarray(g), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)


def test_logsumexp_b_zero_at_inf_is_left_out_as_jax_does(lse_path):
    """Documented difference: scipy gives NaN when a b == 0 entry holds inf or NaN and the rest
    sums to 0 (yet leaves the entry out otherwise); jaxport and jax.nn.logsumexp leave it out."""
    a = np.array([[INF, 1.0, 2.0], [NAN, -INF, 0.0], [INF, 1.0, 2.0]], np.float32)
    b = np.array([[0, 0, 0], [0, 1, 0], [0, 1, 1]], np.float32)
    got, sign = logsumexp(a, 1, b=b, return_sign=True)
    want, want_sign = jax.nn.logsumexp(a, 1, b=b, return_sign=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sign), np.asarray(want_sign))
    np.testing.assert_array_equal(np.asarray(got)[:2], [-INF, -INF])
    assert np.isnan(_scipy_lse(a[:2], axis=1, b=b[:2])).all()
    np.testing.assert_allclose(np.asarray(got)[2], _scipy_lse(a[2], b=b[2]), rtol=1e-6)


def test_logsumexp_where_drops_masked_nan_and_inf_b(lse_path):
    """A masked-out entry whose b was NaN or +-inf gave NaN (exp(-inf) * b), value and gradient."""
    a = np.array([[1.0, 2.0, 3.0]] * 3, np.float32)
    b = np.array([[1.0, 0.5, NAN], [2.0, 1.0, INF], [1.0, 3.0, -INF]], np.float32)
    where = np.array([True, True, False])
    got, sign = logsumexp(a, 1, b=b, where=where, return_sign=True)
    want, want_sign = _scipy_lse(a[:, :2], axis=1, b=b[:, :2], return_sign=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sign), want_sign)
    ga, gb = jax.grad(lambda x, y: logsumexp(x, 1, b=y, where=where).sum(), argnums=(0, 1))(a, b)
    # d/da = softmax(a + log b) over the kept entries; d/db = exp(a) / sum(b exp(a)) there.
    kept = torch.from_numpy(a[:, :2]).double() + torch.from_numpy(b[:, :2]).double().log()
    soft = torch.softmax(kept, 1).numpy()
    np.testing.assert_allclose(np.asarray(ga), np.pad(soft, ((0, 0), (0, 1))), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gb), np.pad(soft / b[:, :2], ((0, 0), (0, 1))), rtol=1e-6)


def test_logsumexp_all_masked_and_keepdims(lse_path):
    got, sign = logsumexp(ROWS, 1, b=np.ones(3), where=np.zeros(ROWS.shape, bool), return_sign=True)
    np.testing.assert_array_equal(np.asarray(got), np.full(6, -INF))
    np.testing.assert_array_equal(np.asarray(sign), np.zeros(6))
    for axis in (None, 1, (0, 1), ()):
        got = logsumexp(ROWS, axis, keepdims=True)
        np.testing.assert_allclose(np.asarray(got), _scipy_lse(ROWS, axis=axis, keepdims=True), rtol=1e-6)
        got, sign = logsumexp(ROWS, axis, keepdims=True, return_sign=True)
        want, want_sign = _scipy_lse(ROWS, axis=axis, keepdims=True, return_sign=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(sign), want_sign)
    # A 0-d array keeps no axis, as in torch (scipy returns shape (1,)).
    assert logsumexp(np.float32(3.0), keepdims=True).shape == torch.logsumexp(torch.tensor(3.0), 0, keepdim=True).shape
    with pytest.raises(ConfigError, match="`a` has complex dtype complex64"):
        logsumexp(np.ones(3, np.complex64))


def test_logsumexp_integer_and_bool_inputs_as_torch(lse_path):
    for dtype in ("int8", "int16", "int32", "uint8", "bool"):
        x = _extremes(dtype, (3, 5), seed=8) if dtype != "bool" else np.eye(3, 5, dtype=bool)
        got = logsumexp(x, 1)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), torch.logsumexp(torch.from_numpy(x).float(), 1).numpy(), rtol=1e-6)


def test_logsumexp_gradients_at_inf_nan_and_1e30(lse_path):
    """The value and the gradient at +-inf and NaN are torch's. At two tied 1e30 entries the
    gradient is the softmax, (0.5, 0.5): torch's exp(a - out) gives (1, 1) there, as out rounds
    to 1e30 (documented; the reference is torch's softmax in float64)."""
    x = np.array([[-INF, 0.0, 1.0], [INF, 0.0, 1.0], [NAN, 0.0, 1.0], [-INF, -INF, 1.0], [INF, INF, 0.0]], np.float32)
    t = torch.from_numpy(x).requires_grad_()
    torch.logsumexp(t, 1).sum().backward()
    grad = jax.grad(lambda v: logsumexp(v, 1).sum())(x)
    np.testing.assert_allclose(np.asarray(grad), t.grad.numpy(), rtol=1e-6)
    tangent = jax.jvp(lambda v: logsumexp(v, 1), (x,), (np.ones_like(x),))[1]
    np.testing.assert_allclose(np.asarray(tangent), t.grad.numpy().sum(1), rtol=1e-6)
    big = np.array([[1e30, 1e30, 0.0], [-1e30, -1e30, -1e30]], np.float32)
    grad = jax.grad(lambda v: logsumexp(v, 1).sum())(big)
    np.testing.assert_allclose(np.asarray(grad), torch.softmax(torch.from_numpy(big).double(), 1).numpy(), rtol=1e-6)
    tb = torch.from_numpy(big).requires_grad_()
    torch.logsumexp(tb, 1).sum().backward()
    assert tb.grad[0, :2].tolist() == [1.0, 1.0]  # torch's own gradient, which sums to 2


# --- meshes ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpus():
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets JAX_NUM_CPU_DEVICES=8)")
    return devices[:8]


# (shape, spec, axis): one row or column per device, odd shard sizes, the ranked axis split
# (jax refuses to place shapes that do not divide the mesh: IndivisibleError). Explicit meshes
# run with and without `jax.set_mesh` around the calls.
EXPLICIT = [((8, 5), P(("a", "b"), None), -1), ((4, 6), P("a", "b"), -1), ((4, 6), P("a", "b"), 0),
            ((2, 3, 8), P("b", None, "a"), 1)]
MESH_CASES = ([("Explicit", *case, context) for case in EXPLICIT for context in ("", "set_mesh")]
              + [("Auto", (4, 6), P("a", "b"), 0, ""), ("Auto", (2, 3, 8), P("b", None, "a"), 1, "")])


@pytest.mark.parametrize("axis_type,shape,spec,axis,context", MESH_CASES)
def test_ops_on_a_2d_mesh_eager_and_jitted(cpus, axis_type, shape, spec, axis, context):
    """Eager `rank(method="xla")` (the default off the CPU) on an Explicit mesh raised jax's
    "Resource axis: a of P('a', 'b', None) is not found in mesh: ()" from put_along_axis; and
    inside `jax.set_mesh` (how jax asks Explicit meshes to be used) `rank` failed under jit with
    "Arguments to sort must have equal shardings" and `topk_mask` / `hard_negative_mask` with
    "select `which` must be scalar or have the same sharding as cases": replicated iota / zeros
    built next to the sharded keys."""
    kind = getattr(jax.sharding.AxisType, axis_type)
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(kind, kind), devices=cpus)
    with jax.set_mesh(mesh) if context else contextlib.nullcontext():
        _check_ops_on_mesh(mesh, axis_type, shape, spec, axis)


def _check_ops_on_mesh(mesh, axis_type, shape, spec, axis):
    pool = np.array([0.0, -0.0, 1.0, NAN, -INF, 2.0, 1e-45], np.float32)
    x = np.random.default_rng(9).choice(pool, shape)
    sharding = NamedSharding(mesh, spec)
    xs = jax.device_put(x, sharding)
    want = torch_rank(torch.from_numpy(x), axis, True)
    batch = tuple(s for i, s in enumerate(shape) if i != axis % len(shape))
    k = (np.arange(int(np.prod(batch))).reshape(batch) % (shape[axis] + 2)).astype(np.int32)
    loss, positive = np.abs(np.nan_to_num(x)), x > 1
    for method in ("auto", "xla"):
        for wrap in (lambda f: f, jax.jit):
            ranks = wrap(lambda v: rank(v, axis, True, method=method))(xs)
            np.testing.assert_array_equal(np.asarray(ranks), want)
            if axis_type == "Explicit":
                assert ranks.sharding.spec == sharding.spec
            mask = wrap(lambda v: topk_mask(v, k, axis, True, method=method))(xs)
            np.testing.assert_array_equal(np.asarray(mask), want < np.expand_dims(k, axis))
            mined = wrap(lambda v, p: hard_negative_mask(v, p, 1, axis, method=method))(
                jax.device_put(loss, sharding), jax.device_put(positive, sharding))
            np.testing.assert_array_equal(np.asarray(mined), np.asarray(hard_negative_mask(loss, positive, 1, axis)))
    got = logsumexp(xs, axis, b=np.ones(shape, np.float32))
    np.testing.assert_allclose(np.asarray(got), torch.logsumexp(torch.from_numpy(x), axis).numpy(), rtol=1e-6)
