"""jaxport.compiler_options: what jaxport compiles its CPU programs with (jaxport/_xla.py)."""
import jax
import numpy as np
import torch
import torch.nn.functional as F

import flax.linen as nn
import optax
import pytest

import jaxport
from jaxport.train import _step, create_state, make_eval_step, make_mesh, make_train_step


def test_compiler_options_only_on_cpu():
    assert jaxport.compiler_options("gpu") == {}
    assert jaxport.compiler_options("tpu") == {}
    opts = jaxport.compiler_options("cpu")
    assert opts is not jaxport.compiler_options("cpu")  # callers may not mutate the shared dict
    # Whatever the options are, a convolution compiled with them still computes torch's result.
    x = np.random.default_rng(2).standard_normal((2, 9, 9, 8)).astype(np.float32)
    w = np.random.default_rng(3).standard_normal((3, 3, 8, 4)).astype(np.float32)
    conv = jax.jit(
        lambda a, b: jax.lax.conv_general_dilated(a, b, (2, 2), ((1, 1), (1, 1)),
                                                  dimension_numbers=("NHWC", "HWIO", "NHWC")),
        compiler_options=opts,
    )
    ref = F.conv2d(torch.tensor(np.moveaxis(x, -1, 1).copy()), torch.tensor(np.ascontiguousarray(w.transpose(3, 2, 0, 1))), stride=2, padding=1)
    np.testing.assert_allclose(np.asarray(conv(x, w)), np.moveaxis(ref.numpy(), 1, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["train", "eval"])
def test_train_and_eval_steps_compile_with_the_options(monkeypatch, which):
    # An option XLA does not know fails the compile: proof the steps hand theirs to XLA.
    monkeypatch.setattr(_step, "compiler_options", lambda platform: {"xla_no_such_option": "1"})

    class Tiny(nn.Module):
        bn_axis_name = None

        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3)(x.reshape(x.shape[0], -1))

    mesh = make_mesh(jax.devices()[:1])
    model, x, y = Tiny(), np.ones((2, 4), np.float32), np.zeros(2, np.int32)
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(Exception, match="xla_no_such_option"):
        if which == "train":
            tx = optax.sgd(0.1)
            state = create_state({"params": variables["params"], "batch_stats": {}}, tx, mesh)
            make_train_step(model, tx, mesh)(state, x, y)
        else:
            make_eval_step(model, mesh)(variables, x, y, np.ones(2, np.float32))
