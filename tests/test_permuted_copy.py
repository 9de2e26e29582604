"""The fast layout changes of torch_to_flax and flax_to_torch equal numpy's transpose bit for bit.

`_permuted_copy(t, perm)` replaced `np.ascontiguousarray(t.numpy().transpose(perm))` to make
porting 2-3x faster (benchmarks/bench_port.py), and `_unpermuted_copy(a, perm)` the copy of
`a.transpose(argsort(perm))` in flax_to_torch; these tests hold them to those equations.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

import torch_compat
from torch_compat._convert import _permuted_copy, _to_numpy, _unpermuted_copy

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [
    ((64, 3, 7, 7), (2, 3, 1, 0)),  # stem
    ((256, 64, 1, 1), (2, 3, 1, 0)),  # 1x1 bottleneck conv
    ((128, 4, 3, 3), (2, 3, 1, 0)),  # grouped 3x3 (ResNeXt)
    ((3, 5, 3, 3), (2, 3, 1, 0)),  # under torch's blocked-transpose size threshold
    ((0, 3, 3, 3), (2, 3, 1, 0)),  # empty
    ((10, 2048), (1, 0)),  # fc
    ((1000, 512), (1, 0)),  # fc big enough for torch's blocked 2-D transpose
    ((512, 256, 1, 1), (2, 3, 1, 0)),  # 1x1 conv big enough for torch's blocked 2-D transpose
    ((70, 33, 3, 3), (2, 3, 1, 0)),  # rows not a multiple of the numpy copy's block
    ((7, 5), (1, 0)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,perm", SHAPES, ids=str)
def test_permuted_copy_equals_numpy_transpose(shape, perm, dtype):
    t = (torch.randn(shape, dtype=torch.float64) * 100).to(dtype)
    expected = np.ascontiguousarray(_to_numpy(t).transpose(perm))
    got = _permuted_copy(t, perm)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert got.flags.c_contiguous and got.flags.writeable
    assert got.tobytes() == expected.tobytes()



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,perm", SHAPES, ids=str)
def test_unpermuted_copy_equals_numpy_transpose_back(shape, perm, dtype):
    """The Flax-layout array (read-only, as a jax array's buffer) back to torch's layout."""
    t = (torch.randn(shape, dtype=torch.float64) * 100).to(dtype)
    flax = np.ascontiguousarray(_to_numpy(t).transpose(perm))
    flax.flags.writeable = False
    got = _unpermuted_copy(flax, perm)
    assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous()
    assert _to_numpy(got).tobytes() == _to_numpy(t.contiguous()).tobytes()


def test_permuted_copy_of_non_contiguous_tensor():
    t = torch.randn(64, 32, 3, 3)[:, ::2]
    np.testing.assert_array_equal(_permuted_copy(t, (2, 3, 1, 0)), t.numpy().transpose(2, 3, 1, 0))


def test_permuted_copy_does_not_alias_the_source():
    t = torch.randn(64, 16, 3, 3)
    got = _permuted_copy(t, (2, 3, 1, 0))
    t.zero_()
    assert np.abs(got).sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_to_flax_kernels_are_transposed_torch_weights(dtype):
    sd = {k: v.to(dtype) if v.is_floating_point() else v
          for k, v in torch_compat.reference_model("resnext50_32x4d", num_classes=10).state_dict().items()}
    variables = torch_compat.torch_to_flax(sd)
    for e in torch_compat.table("resnext50_32x4d", 10):
        node = variables[e.collection]
        for name in e.flax_path:
            node = node[name]
        if e.perm is not None:
            expected = _to_numpy(sd[e.torch_key]).transpose(e.perm)
            assert node.dtype == (ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float32)
            assert node.tobytes() == np.ascontiguousarray(expected).tobytes(), e.torch_key
