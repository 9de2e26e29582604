"""The ops on arrays sharded over 8 simulated CPU devices (tests/conftest.py) give the
unsharded (torch-exact) results, whether the batch axis or the ranked/reduced axis is split,
and `logsumexp(..., axis_name=)` reduces across a mesh axis inside `jax.shard_map`.
"""
import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxport._errors import ConfigError
from jaxport.ops import hard_negative_mask, logsumexp, rank, topk_mask
from tests.test_ops_data import tricky, to_torch, torch_rank

SPLITS = {"rows": P("d", None), "ranked_axis": P(None, "d")}


@pytest.fixture(scope="module")
def mesh():
    # The CPU devices by name: on a GPU host jax.devices() is the GPU alone.
    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets JAX_NUM_CPU_DEVICES=8)")
    return jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=cpus[:8])


@pytest.mark.parametrize("method", ["auto", "xla"])
@pytest.mark.parametrize("split", SPLITS)
def test_rank_and_topk_sharded_equal_unsharded_and_torch(mesh, split, method):
    x = tricky((16, 96), "float32", seed=7)
    k = np.random.default_rng(7).integers(-2, 100, 16).astype(np.int32)
    xs = jax.device_put(x, NamedSharding(mesh, SPLITS[split]))
    ks = jax.device_put(k, NamedSharding(mesh, P("d") if split == "rows" else P()))
    ranks = jax.jit(lambda x: rank(x, -1, True, method=method))(xs)
    mask = jax.jit(lambda x, k: topk_mask(x, k, -1, True, method=method))(xs, ks)
    want = torch_rank(to_torch(x, "float32"), -1, True)
    np.testing.assert_array_equal(np.asarray(ranks), want)
    np.testing.assert_array_equal(np.asarray(mask), want < k[:, None])
    np.testing.assert_array_equal(np.asarray(rank(x, -1, True, method=method)), np.asarray(ranks))


@pytest.mark.parametrize("split", SPLITS)
def test_hard_negative_and_logsumexp_sharded_equal_unsharded(mesh, split):
    rng = np.random.default_rng(8)
    loss = rng.random((16, 96)).astype(np.float32)
    positive = rng.random((16, 96)) < 0.1
    sharding = NamedSharding(mesh, SPLITS[split])
    ls, ps = jax.device_put(loss, sharding), jax.device_put(positive, sharding)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(hard_negative_mask)(ls, ps)), np.asarray(hard_negative_mask(loss, positive))
    )
    want = torch.logsumexp(torch.from_numpy(loss), 1).numpy()
    np.testing.assert_allclose(np.asarray(jax.jit(lambda x: logsumexp(x, axis=1))(ls)), want, rtol=1e-6)
    # Large enough for the one-pass path (small inputs take the shifted one).
    big = (rng.standard_normal((64, 1024)) * 3).astype(np.float32)
    want = torch.logsumexp(torch.from_numpy(big), 1).numpy()
    got = jax.jit(lambda x: logsumexp(x, axis=1))(jax.device_put(big, sharding))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_rank_inside_shard_map_per_device_rows(mesh):
    x = tricky((16, 50), "float32", seed=9)
    rows = P("d", None)
    f = jax.jit(jax.shard_map(lambda v: rank(v, -1, False), mesh=mesh, in_specs=rows, out_specs=rows))
    np.testing.assert_array_equal(np.asarray(f(x)), torch_rank(to_torch(x, "float32"), -1, False))


@pytest.mark.parametrize("with_b_where", [False, True])
def test_logsumexp_axis_name_reduces_across_the_mesh(mesh, with_b_where):
    rng = np.random.default_rng(10)
    x = (rng.standard_normal((4, 64)) * 5).astype(np.float32)
    x[1] = -np.inf  # an all -inf row across every shard
    x[2, 3] = np.inf
    b = rng.choice(np.array([-1.0, 0.5, 2.0], np.float32), size=x.shape) if with_b_where else np.ones_like(x)
    where = rng.random(x.shape) < 0.8 if with_b_where else np.ones(x.shape, bool)

    def local(x, b, where):  # classes split over 'd': one call reduces shard and mesh
        return logsumexp(x, axis=-1, b=b, where=where, axis_name="d", return_sign=True)

    spec = P(None, "d")
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(P(), P())))
    out, sign = f(x, b, where)
    want, want_sign = logsumexp(x, axis=-1, b=b, where=where, return_sign=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sign), np.asarray(want_sign))
    if not with_b_where:
        np.testing.assert_allclose(np.asarray(out), torch.logsumexp(torch.from_numpy(x), 1).numpy(), rtol=1e-6)


def test_logsumexp_axis_name_may_be_a_list_as_axis_may(mesh):
    """A list of mesh axis names was a bare "TypeError: unhashable type: 'list'" from lax.pmax."""
    x = np.random.default_rng(12).standard_normal((4, 16)).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda v: logsumexp(v, axis=1, axis_name=["d"]), mesh=mesh, in_specs=P(None, "d"),
                              out_specs=P()))
    np.testing.assert_allclose(np.asarray(f(x)), torch.logsumexp(torch.from_numpy(x), 1).numpy(), rtol=1e-6)
    with pytest.raises(ConfigError, match=r"`axis_name` \(=\('d',\)\) names no mesh axis here"):
        logsumexp(x, axis=1, axis_name=["d"])  # outside shard_map


def test_logsumexp_axis_name_gradient_is_softmax(mesh):
    x = np.random.default_rng(11).standard_normal((3, 32)).astype(np.float32)
    x[0] = -np.inf
    f = jax.shard_map(lambda v: logsumexp(v, axis=-1, axis_name="d"), mesh=mesh, in_specs=P(None, "d"), out_specs=P())
    g = jax.jit(jax.grad(lambda v: f(v).sum()))(x)
    want = jax.nn.softmax(x[1:], axis=-1)
    np.testing.assert_allclose(np.asarray(g[1:]), np.asarray(want), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(g[0]), 0.0)  # all -inf: zero, not NaN


def test_logsumexp_axis_name_not_in_the_mesh_names_the_mesh_axes(mesh):
    # Inside shard_map a wrong name was jax's bare `AssertionError('')` from its internals.
    f = jax.shard_map(lambda v: logsumexp(v, axis=-1, axis_name="model"), mesh=mesh, in_specs=P(None, "d"),
                      out_specs=P())
    with pytest.raises(ConfigError, match=r"`axis_name` \(='model'\) names no mesh axis here.*mesh has axes \('d',\)"):
        f(np.zeros((2, 16), np.float32))


@pytest.mark.parametrize("split", SPLITS)
def test_explicit_mesh_the_default_of_make_mesh_since_jax_0_9(mesh, split):
    # On an Explicit mesh jax refuses a sort or reduction along a sharded dimension at trace
    # time ("Arguments to sort must be unsharded over the sorting dimension"); the ops gather the
    # ranked axis themselves and hand back x's own sharding.
    explicit = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=mesh.devices.ravel())
    x = tricky((16, 96), "float32", seed=10)
    k = np.random.default_rng(10).integers(-2, 100, 16).astype(np.int32)
    sharding = NamedSharding(explicit, SPLITS[split])
    xs = jax.device_put(x, sharding)
    want = torch_rank(to_torch(x, "float32"), -1, True)
    for method in ("auto", "xla"):
        ranks = jax.jit(lambda v: rank(v, -1, True, method=method))(xs)
        np.testing.assert_array_equal(np.asarray(ranks), want)
        assert ranks.sharding.spec == sharding.spec
        mask = jax.jit(lambda v: topk_mask(v, k, -1, True, method=method))(xs)
        np.testing.assert_array_equal(np.asarray(mask), want < k[:, None])
        assert mask.sharding.spec == sharding.spec
    loss = np.abs(x) + 0.5
    positive = np.random.default_rng(11).random((16, 96)) < 0.1
    hn = jax.jit(hard_negative_mask)(jax.device_put(loss, sharding), jax.device_put(positive, sharding))
    np.testing.assert_array_equal(np.asarray(hn), np.asarray(hard_negative_mask(loss, positive)))


@pytest.mark.parametrize("split", SPLITS)
def test_logsumexp_eager_under_set_mesh_on_an_explicit_mesh_equals_torch(mesh, split):
    # Eager (outside jit) under `jax.set_mesh`, an input of 32768 elements (the one-pass path's
    # threshold on XLA:CPU) raised a TypeError: lax.cond's branches captured its arrays from
    # outside, and one branch's zeros came out unsharded.
    explicit = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=mesh.devices.ravel())
    x = np.random.default_rng(12).standard_normal((8, 4096)).astype(np.float32) * 3
    with jax.set_mesh(explicit):
        out = logsumexp(jax.device_put(x, NamedSharding(explicit, SPLITS[split])), 1)
    np.testing.assert_allclose(np.asarray(out), torch.logsumexp(torch.from_numpy(x), 1).numpy(), rtol=1e-6)


@pytest.mark.parametrize("method", ["auto", "xla"])
def test_per_row_k_split_over_rows_of_a_replicated_x_on_an_explicit_mesh(mesh, method):
    # The bisection's threshold was built from x alone (replicated) and compared with k (split
    # over rows): "select 'which' must be scalar or have the same sharding as cases", under
    # jit, and eager with method="xla".
    explicit = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=mesh.devices.ravel())
    x = tricky((16, 96), "float32", seed=13)
    k = np.random.default_rng(13).integers(-2, 100, 16).astype(np.int32)
    xs = jax.device_put(x, NamedSharding(explicit, P()))
    ks = jax.device_put(k, NamedSharding(explicit, P("d")))
    want = torch_rank(to_torch(x, "float32"), -1, True) < k[:, None]
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v, c: topk_mask(v, c, method=method))(xs, ks)), want)
    np.testing.assert_array_equal(np.asarray(topk_mask(xs, ks, method=method)), want)


@pytest.mark.parametrize("method", ["auto", "xla"])
def test_per_row_k_split_over_another_mesh_axis_than_the_rows(mesh, method):
    # Rows over mesh axis 'a', k over 'b' (Explicit): eager on CPU worked, and the same call
    # under jit raised jax's bare "ShardingTypeError: incompatible shardings for broadcasting".
    # k now follows the rows where jax can reshard it (eager, or under `jax.set_mesh`), and is
    # named with the fix where it cannot (jit outside a mesh context).
    grid = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=mesh.devices.ravel())
    x = tricky((8, 40), "float32", seed=14)
    k = np.random.default_rng(14).integers(-2, 45, 8).astype(np.int32)
    xs = jax.device_put(x, NamedSharding(grid, P("a", None)))
    ks = jax.device_put(k, NamedSharding(grid, P("b")))
    want = torch_rank(to_torch(x, "float32"), -1, True) < k[:, None]
    jitted = jax.jit(lambda v, c: topk_mask(v, c, method=method))
    np.testing.assert_array_equal(np.asarray(topk_mask(xs, ks, method=method)), want)
    with jax.set_mesh(grid):
        out = jitted(xs, ks)
    np.testing.assert_array_equal(np.asarray(out), want)
    assert out.sharding.spec == P("a", None)
    with pytest.raises(ConfigError, match=r"`k` is sharded as P\('b'\) and x's slices as P\('a'\) over Explicit "
                                          r"mesh axes.*jax.set_mesh"):
        jitted(xs, ks)


@pytest.mark.parametrize("method", ["auto", "xla"])
def test_an_empty_ranked_axis_keeps_an_explicit_split(method):
    """Rows split over an Explicit mesh, nothing to rank in each: `rank` returned unsharded
    zeros, and `topk_mask` / `hard_negative_mask` failed under jit without `jax.set_mesh`
    ("Length of device assignment 1 is not equal to the size of the mesh 8")."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (JAX_NUM_CPU_DEVICES)")
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:8])
    x = jax.device_put(np.zeros((8, 0), np.float32), NamedSharding(mesh, P("d", None)))
    want = torch.argsort(torch.argsort(torch.zeros(8, 0), dim=-1), dim=-1).numpy()
    for name, op in (("rank", lambda v: rank(v, method=method)),
                     ("topk_mask", lambda v: topk_mask(v, 1, method=method)),
                     ("hard_negative_mask", lambda v: hard_negative_mask(v, v > 0, method=method))):
        out = jax.jit(op)(x)
        # (np.asarray of an empty array split 8 ways fails in jax 0.10 itself: shape and type only.)
        assert out.shape == want.shape and out.sharding.spec == P("d", None), (name, out.sharding)
        assert out.dtype == (np.int32 if name == "rank" else np.bool_), (name, out.dtype)
