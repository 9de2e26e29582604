"""Which lowering the ResNets get: CPU-tuned on XLA:CPU, plain everywhere else.

On XLA:CPU the 1x1 convs are dots over channels and the convs, max-pool and train-mode
BatchNorm have hand-written VJPs (benchmarks/README.md, sections 2 and 4). On XLA:GPU (jax
0.11.2, an H200) both made Triton's GEMM fusion abort the compile, so off the CPU every conv is
`lax.conv` with jax's own rules. The backend is read at trace time from `jax.default_backend()`;
these tests patch it to trace the GPU's program on the CPU. Its numbers against torch are in
test_train_parity.py (`test_three_steps_float64_as_lowered_off_the_cpu`).
"""
import collections

import jax
import jax.extend
import jax.numpy as jnp
import pytest

from jaxport import models


def _primitives(arch, train):
    model = models.build(arch, num_classes=7)
    x = jnp.zeros((2, 32, 32, 3))
    variables = model.init(jax.random.key(0), x)

    def loss(params):
        out = model.apply({**variables, "params": params}, x, train=train, mutable=["batch_stats"] if train else False)
        return jnp.sum((out[0] if train else out) ** 2)

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(variables["params"])
    counts = collections.Counter()

    def walk(jpr):
        for eqn in jpr.eqns:
            counts[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return counts


@pytest.mark.parametrize("arch,convs", [("resnet18", 20), ("resnet50", 53)])
@pytest.mark.parametrize("train", [False, True])
def test_off_the_cpu_every_conv_is_lax_conv_and_no_custom_vjp(monkeypatch, arch, convs, train):
    # Both programs are traced with the backend patched, so the test means the same on a GPU host.
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    cpu = _primitives(arch, train)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu = _primitives(arch, train)
    # The fc layer's forward dot and its two transposes are the only dots left.
    assert gpu["dot_general"] == 3, gpu
    assert not any(name.startswith("custom_vjp") for name in gpu), gpu  # (relu is a custom_jvp)
    # Forward and backward: each conv once forward, and its input and kernel gradients (the
    # stem's input gradient is not needed).
    assert gpu["conv_general_dilated"] == 3 * convs - 1, gpu
    # The CPU's program is the tuned one (the counts that would catch the tuning switched off).
    assert cpu["dot_general"] > 3 and any(name.startswith("custom_vjp") for name in cpu), cpu
