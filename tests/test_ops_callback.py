"""The host-kernel plumbing behind `rank` / `topk_mask` on CPU.

On the CPU backend the kernels write straight into XLA's output buffer (`buffer_callback`);
older jax or other backends fall back to `jax.pure_callback`. Both must give torch's answer,
and a kernel handed an `out` buffer must overwrite every element of it (XLA's buffers are not
zeroed).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport.ops import _callback, _host, rank, topk_mask
from jaxport.ops._keys import order_key

from tests.test_ops_data import to_torch, torch_rank, tricky


@pytest.mark.parametrize("shape", [(7, 300), (3, 20000), (2, 3, 50)])
def test_host_kernels_overwrite_every_element_of_out(shape):
    x = tricky(shape, "float32", seed=4)
    key = np.asarray(order_key(jnp.asarray(x), descending=True))
    k = np.random.default_rng(0).integers(0, shape[-1] + 1, shape[:-1])
    want_rank = torch_rank(to_torch(x, "float32"), -1, True)

    out = np.full(shape, -7, np.int32)
    assert _host.rank_rows(key, out=out) is out
    np.testing.assert_array_equal(out, want_rank)

    for poison in (True, False):
        mask = np.full(shape, poison)
        assert _host.topk_rows(key, k, out=mask) is mask
        np.testing.assert_array_equal(mask, want_rank < k[..., None])


def test_host_kernels_refuse_an_out_of_the_wrong_shape():
    key = np.zeros((3, 5), np.uint32)
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        _host.rank_rows(key, out=np.empty((5, 3), np.int32))


@pytest.mark.parametrize("kernel", ["rank_rows", "topk_rows"])
def test_host_kernels_refuse_an_out_they_could_only_write_a_copy_of(kernel):
    # A (2, 3, 4) array with its first two axes swapped in memory cannot be seen as (6, 4)
    # rows without a copy, and results written into a copy would be lost.
    key = np.arange(24, dtype=np.uint32).reshape(2, 3, 4)
    dtype = np.int32 if kernel == "rank_rows" else np.bool_
    out = np.zeros((3, 2, 4), dtype).transpose(1, 0, 2)
    args = (key,) if kernel == "rank_rows" else (key, np.ones((2, 3), np.int64))
    with pytest.raises(ValueError, match="C-contiguous"):
        getattr(_host, kernel)(*args, out=out)
    assert not out.any()


@pytest.mark.parametrize("bridge", ["buffer_callback", "pure_callback"])
def test_both_callback_bridges_match_torch_under_jit_and_vmap(bridge, monkeypatch):
    if bridge == "pure_callback":
        monkeypatch.setattr(_callback, "_buffer_callback", None)
    elif _callback._buffer_callback is None:
        pytest.skip("this jax has no jax.experimental.buffer_callback")
    x = tricky((4, 6, 40), "float32", seed=5)
    k = np.arange(4 * 6).reshape(4, 6) % 41
    want = torch_rank(to_torch(x, "float32"), -1, True)

    got_rank = jax.jit(lambda v: rank(v, descending=True))(x)
    np.testing.assert_array_equal(np.asarray(got_rank), want)
    got_mask = jax.vmap(jax.jit(topk_mask))(jnp.asarray(x), jnp.asarray(k))
    np.testing.assert_array_equal(np.asarray(got_mask), want < k[..., None])


def test_topk_mask_long_rows_split_across_threads_stay_exact(monkeypatch):
    # Whether rows are split across the host kernel's thread pool depends on how fast numpy
    # partitions on this CPU: split them whatever it is. (Before, (6, 20000) was under
    # _MIN_WORK_PER_THREAD per thread, and this test never split anything.)
    monkeypatch.setattr(_host, "_MIN_TOPK_ROW_US_FOR_THREADS", 0.0)
    monkeypatch.setattr(_host, "_MIN_WORK_PER_THREAD", 1)
    monkeypatch.setattr(_host, "usable_cpus", lambda: 2)  # split on a 1-core machine too
    blocks = []
    parallel_rows = _host._parallel_rows
    monkeypatch.setattr(_host, "_parallel_rows", lambda fn, *a: parallel_rows(
        lambda lo, hi: (blocks.append((lo, hi)), fn(lo, hi)), *a))
    x = tricky((6, 20000), "float32", seed=6)
    k = np.array([0, 1, 5000, 19999, 20000, 123])
    want = torch_rank(to_torch(x, "float32"), -1, True) < k[:, None]
    np.testing.assert_array_equal(np.asarray(jax.jit(topk_mask)(x, jnp.asarray(k))), want)
    assert len(blocks) > 1, blocks


@pytest.mark.parametrize("bridge", ["buffer_callback", "pure_callback"])
def test_eager_calls_compile_once_per_shape(bridge, monkeypatch):
    """Each eager `rank` / `topk_mask` made a new callback closure, which jax keys its compiled
    computations on: every call compiled again (~50 ms) and kept the executable (~1.4 MB a call,
    which `jax.clear_caches()` did not give back)."""
    if bridge == "pure_callback":
        monkeypatch.setattr(_callback, "_buffer_callback", None)
    elif _callback._buffer_callback is None:
        pytest.skip("this jax has no jax.experimental.buffer_callback")
    compiles = []

    def count(event, _duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    x = jnp.asarray(tricky((4, 8), "float32", seed=6))
    want = torch_rank(to_torch(np.array(x), "float32"), -1, True)  # topk_mask keeps the largest
    calls = {"rank": lambda: rank(x, method="host"), "topk_mask": lambda: topk_mask(x, 3, method="host")}
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for name, call in calls.items():
            first = jax.block_until_ready(call())  # compiles what it needs
            before = len(compiles)
            for _ in range(5):
                again = jax.block_until_ready(call())
                np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
            assert len(compiles) == before, f"{name}: {len(compiles) - before} compiles in 5 calls of one shape"
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    np.testing.assert_array_equal(np.asarray(first), want < 3)
