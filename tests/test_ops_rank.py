"""`jaxport.ops.rank` == torch's `x.sort(stable=True).indices.argsort()`, exactly.

Both kernels (host numpy radix sort, used on CPU; XLA stable sort, used elsewhere) are checked
against torch on the same inputs. Ranks are integers: the tolerance is zero.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport._errors import ConfigError
from jaxport.ops import rank

from tests.test_ops_data import float8_data, tricky, to_torch, torch_rank

DTYPES = ["float32", "float16", "bfloat16", "int32", "int8", "uint8", "bool"]
SHAPES_AXES = [((13,), 0), ((4, 37), -1), ((4, 37), 0), ((3, 5, 19), 1), ((3, 5, 19), -1)]


@pytest.mark.parametrize("method", ["host", "xla"])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", SHAPES_AXES)
def test_rank_matches_torch_double_sort(shape, axis, dtype, descending, method):
    x = tricky(shape, dtype)
    want = torch_rank(to_torch(x, dtype), axis, descending)
    got = rank(jnp.asarray(x), axis, descending, method=method)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("descending", [False, True])
def test_rank_public_jit_equals_eager_and_torch(descending):
    x = tricky((6, 300), "float32", seed=1)
    want = torch_rank(to_torch(x, "float32"), -1, descending)
    eager = rank(x, descending=descending)
    jitted = jax.jit(rank, static_argnames=("axis", "descending"))(x, descending=descending)
    np.testing.assert_array_equal(np.asarray(eager), want)
    np.testing.assert_array_equal(np.asarray(jitted), want)


@pytest.mark.parametrize("method", ["auto", "host", "xla"])
def test_rank_vmap_equals_loop(method):
    x = tricky((5, 4, 23), "float32", seed=2)
    f = lambda v: rank(v, 0, True, method=method)  # noqa: E731
    batched = jax.vmap(f, in_axes=1, out_axes=1)(x)
    want = torch_rank(to_torch(x, "float32"), 0, True)
    np.testing.assert_array_equal(np.asarray(batched), want)
    # vmap of jit, and nested vmap.
    nested = jax.vmap(jax.vmap(jax.jit(f), in_axes=1, out_axes=1), in_axes=1, out_axes=1)(x[:, :, None, :])
    np.testing.assert_array_equal(np.asarray(nested)[:, :, 0], want)


def test_rank_large_rows_use_threads_and_stay_exact():
    # Enough work per call for the host kernel to split rows across threads.
    x = tricky((40, 4000), "float32", seed=3)
    want = torch_rank(to_torch(x, "float32"), -1, False)
    np.testing.assert_array_equal(np.asarray(jax.jit(rank)(x)), want)


def test_rank_compiles_once_per_shape():
    f = jax.jit(chex.assert_max_traces(rank, n=1))
    for seed in range(3):
        f(tricky((3, 50), "float32", seed=seed))


def test_rank_edge_shapes():
    assert rank(jnp.zeros((3, 0))).shape == (3, 0)
    assert int(rank(jnp.float32(2.0))) == 0
    np.testing.assert_array_equal(np.asarray(rank(jnp.zeros((2, 1)), axis=1)), [[0], [0]])


def test_rank_errors_name_the_argument():
    with pytest.raises(ConfigError, match=r"`axis` \(=2\) is out of range .* \[-2, 1\]"):
        rank(jnp.zeros((2, 3)), axis=2)
    # A 0-d or empty complex x returned zeros; only a non-empty one was refused.
    for shape in [(3,), (), (2, 0)]:
        with pytest.raises(ConfigError, match="`x` has dtype complex64, which has no total order"):
            rank(jnp.zeros(shape, jnp.complex64))


@pytest.mark.parametrize("case", ["int64", "float64", "torch_int64", "python_ints"])
def test_64bit_inputs_jax_would_narrow_are_refused(case):
    """With jax's 64-bit mode off (the default), jnp.asarray wraps int64 to int32 and rounds
    float64 to float32 without a word: rank([2**40, 1, -2**40, 5]) came out [0, 2, 1, 3] where
    torch gives [3, 1, 0, 2], and float64 values 1e-12 apart became ties."""
    import torch

    x = {"int64": np.array([2**40, 1, -2**40, 5], np.int64),
         "float64": np.array([1 + 1e-12, 1.0, 1e-50, 0.0]),
         "torch_int64": torch.tensor([2**40, 1]),
         "python_ints": [2**40, 1]}[case]
    assert not jax.config.jax_enable_x64
    reference = torch.as_tensor(x)
    want = torch_rank(reference, -1, False)
    narrowed = np.asarray(reference.numpy().astype(np.float32 if reference.is_floating_point() else np.int32))
    assert not np.array_equal(torch_rank(torch.from_numpy(narrowed), -1, False), want)  # what was returned
    kind = "round it to float32" if reference.is_floating_point() else "wrap it to int32"
    with pytest.raises(ConfigError, match=rf"`x` has dtype (float|int)64, but jax's 64-bit mode is off, so jax would "
                                          rf"{kind}, where \d+ of its \d+ values would change.*jax_enable_x64"):
        rank(x)


@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_64bit_inputs_that_narrow_exactly_are_ranked_as_torch(dtype):
    """Only a narrowing that changes a value is refused: numpy's default int64 / float64
    arrays of representable values (e.g. np.arange, small integers as floats) still rank."""
    import torch

    x = np.random.default_rng(3).integers(-50, 50, (4, 40)).astype(dtype)
    x[0, :5] = [-0.0, 0.0, 3, 3, -50] if dtype == "float64" else [0, 0, 3, 3, -50]
    np.testing.assert_array_equal(np.asarray(rank(x)), torch_rank(torch.from_numpy(x), -1, False))


@pytest.mark.parametrize("method", ["host", "xla"])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_rank_matches_torch_on_the_float32_values(dtype, descending, method):
    """float8 is widened to float32 for its keys: -0.0 and +0.0 must tie (ranked by position, as
    torch's stable sort of the widened values does), and every NaN too."""
    import torch

    x = float8_data((4, 37), dtype)
    want = torch_rank(torch.from_numpy(x.astype(np.float32)), -1, descending)
    got = rank(jnp.asarray(x), -1, descending, method=method)
    np.testing.assert_array_equal(np.asarray(got), want)
