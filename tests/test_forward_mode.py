"""`custom_vjps=False`: the models without hand-written VJPs, so forward-mode AD goes through them.

The default models differentiate with `jax.custom_vjp` rules (fast reverse mode on XLA:CPU),
which jax cannot push tangents through. Users who need `jax.jvp`, `jax.jacfwd` or
forward-over-reverse Hessian-vector products build the model with `custom_vjps=False`. These
tests pin the contract: the same outputs bit for bit, and derivatives that agree with the
default model's reverse mode (in float64, so the comparison is tight).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport import ConfigError, models


# Each kind of block at a fraction of the depth: compiling ResNet-50's float64 jvp and grad took
# ~40 s a test, and depth adds nothing the comparison checks. Every case keeps the stem, an
# identity and a projection shortcut, stride-2 stages and the head; "resnet18" is the full model.
_SHALLOW = {
    "basic": dict(block="basic", layers=(1, 1, 1, 1)),  # layer1's block: identity; layer2..4: projection
    "bottleneck": dict(block="bottleneck", layers=(2, 1, 1, 1)),  # layer1: projection (64 -> 256), identity
    "grouped": dict(block="bottleneck", layers=(2, 1, 1, 1), groups=32, width_per_group=4),  # ResNeXt's
}


def _build(arch, **kwargs):
    if arch in _SHALLOW:
        return models.ResNet(**_SHALLOW[arch], num_classes=7, **kwargs)
    return models.build(arch, num_classes=7, **kwargs)


@functools.cache
def _setup(arch, dtype=jnp.float64, size=16):
    # Drawn with numpy as the model's initialisers draw (torchvision's): eager jax ops compiled
    # once per parameter shape (~40 shapes), and one jitted init took ~4 s to compile per
    # architecture and size, more of each test than the derivatives it checks.
    fast = _build(arch)
    plain = _build(arch, custom_vjps=False)
    x = np.random.default_rng(0).standard_normal((2, size, size, 3)).astype(dtype)
    rng = np.random.default_rng(1)

    def draw(path, s):
        name, fan_in = path[-1].key, int(np.prod(s.shape[:-1]))
        if name == "kernel" and len(s.shape) == 4:  # kaiming_normal_(mode="fan_out"): HWIO, fan out = H W O
            return rng.normal(0.0, np.sqrt(2.0 / (s.shape[0] * s.shape[1] * s.shape[3])), s.shape)
        if name == "kernel":  # nn.Linear's uniform, 1 / sqrt(fan in) wide
            return rng.uniform(-1.0, 1.0, s.shape) / np.sqrt(fan_in)
        if path[0].key == "params" and path[-2].key == "fc":  # its bias: as wide, about
            return rng.uniform(-0.05, 0.05, s.shape)
        return np.ones(s.shape) if name in ("scale", "var") else np.zeros(s.shape)

    shapes = jax.eval_shape(fast.init, jax.random.PRNGKey(1), x)
    variables = jax.tree_util.tree_map_with_path(
        lambda p, s: draw(p, s).astype(dtype) if np.issubdtype(s.dtype, np.floating) else np.zeros(s.shape, s.dtype),
        shapes)
    # Non-default running statistics, so eval mode is not an identity BatchNorm.
    stats = jax.tree.map(lambda a: np.abs(a) + 0.5 + 0.1 * np.arange(a.size, dtype=a.dtype).reshape(a.shape),
                         variables["batch_stats"])
    return fast, plain, {**variables, "batch_stats": stats}, x


def _random_like(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(p.dtype), tree)


def _jvp(f, primals, tangents):
    """`jax.jvp` under one `jax.jit`: run eagerly, each op of the model compiles on its own."""
    return jax.jit(lambda p, t: jax.jvp(f, p, t))(primals, tangents)


def _vdot(a, b):
    return sum(np.vdot(np.asarray(u), np.asarray(w)) for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                                     strict=True))


def _loss(model, variables, x, train):
    def f(params):
        out = model.apply({**variables, "params": params}, x, train=train, mutable=["batch_stats"] if train else False)
        logits = out[0] if train else out
        return jnp.sum(jnp.sin(logits))
    return f


@pytest.mark.parametrize("arch,dtype", [
    ("resnet18", jnp.float32), ("bottleneck", jnp.float32), ("bottleneck", jnp.float64), ("grouped", jnp.float32)])
@pytest.mark.parametrize("train", [False, True])
def test_outputs_are_identical(x64, arch, train, dtype):
    fast, plain, variables, x = _setup(arch, dtype)
    kwargs = dict(train=train, mutable=["batch_stats"]) if train else {}
    a = jax.jit(lambda v, x_: fast.apply(v, x_, **kwargs))(variables, x)
    b = jax.jit(lambda v, x_: plain.apply(v, x_, **kwargs))(variables, x)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("arch,train", [("bottleneck", False), ("bottleneck", True), ("grouped", True),
                                        ("basic", True)])
def test_jvp_equals_reverse_mode(x64, arch, train):
    fast, plain, variables, x = _setup(arch)
    v = _random_like(variables["params"], 0)
    _, tangent = jax.jit(lambda p, t: jax.jvp(_loss(plain, variables, x, train), (p,), (t,)))(variables["params"], v)
    grads = jax.jit(jax.grad(_loss(fast, variables, x, train)))(variables["params"])
    want = _vdot(grads, v)
    # Off the CPU jax differentiates max-pool's reduce-window in reduced precision ("Using reduced
    # precision for gradient of reduce-window min/max operator", XLA:GPU has no pair reductions):
    # 5e-7 / 9e-7 relative in train mode on an H200.
    np.testing.assert_allclose(float(tangent), float(want), rtol=1e-10 if jax.default_backend() == "cpu" else 5e-6)


def test_forward_over_reverse_hessian_vector_product(x64):
    # The standard HVP (jvp of grad) against reverse-over-reverse through the default model's VJPs.
    # Train mode at 16 px normalises layer4 over 2 values per channel: entries up to ~1e12 sit
    # beside ones near 0, so the tolerance is relative to each leaf's scale.
    fast, plain, variables, x = _setup("basic")
    params = variables["params"]
    v = _random_like(params, 3)
    _, hvp = jax.jit(lambda p: jax.jvp(jax.grad(_loss(plain, variables, x, True)), (p,), (v,)))(params)

    def directional(p):
        g = jax.grad(_loss(fast, variables, x, True))(p)
        return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(v), strict=True))

    want = jax.jit(jax.grad(directional))(params)
    for a, b in zip(jax.tree.leaves(hvp), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-8, atol=1e-10 * np.abs(np.asarray(b)).max())


def test_default_model_refuses_forward_mode(monkeypatch):
    # The documented limit of the default on XLA:CPU: jax's own error, not a wrong answer.
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    fast, _, variables, x = _setup("resnet18", jnp.float32)
    with pytest.raises(TypeError, match="custom_vjp"):
        _jvp(_loss(fast, variables, x, False), (variables["params"],), (variables["params"],))


def test_folded_model_takes_the_switch(x64):
    fast, _, variables, x = _setup("resnet18")
    folded = models.fold_batchnorm(variables, "resnet18")
    model = models.build_folded("resnet18", num_classes=7, custom_vjps=False)
    # Eager: the ops' compilations are shared with the other tests; one jitted float64 jvp of
    # each model compiled for ~10 s.
    _, tangent = jax.jvp(lambda xx: model.apply(folded, xx), (x,), (np.ones_like(x),))
    want = jax.jvp(lambda xx: models.build("resnet18", num_classes=7, custom_vjps=False).apply(variables, xx),
                   (x,), (np.ones_like(x),))[1]
    np.testing.assert_allclose(np.asarray(tangent), np.asarray(want), rtol=1e-9, atol=1e-9)


def test_default_follows_the_backend(monkeypatch):
    # custom_vjps=None (the default) means the hand-written VJPs on XLA:CPU only: on XLA:GPU one
    # of them makes jax 0.11.2 abort while compiling ResNet-50's training step, so there the
    # default is jax's own rules, read from jax.default_backend() when the model is traced.
    fast, plain, variables, x = _setup("resnet18", jnp.float32)
    params, tangents = variables["params"], jax.tree.map(np.ones_like, variables["params"])
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the same test on a GPU host
    with pytest.raises(TypeError, match="custom_vjp"):
        _jvp(_loss(fast, variables, x, True), (params,), (tangents,))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    _, got = _jvp(_loss(fast, variables, x, True), (params,), (tangents,))
    _, want = _jvp(_loss(plain, variables, x, True), (params,), (tangents,))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    folded = models.fold_batchnorm(variables, "resnet18")
    _jvp(lambda xx: models.build_folded("resnet18", num_classes=7).apply(folded, xx), (x,), (np.ones_like(x),))
    # An explicit True still means True, whatever the backend.
    with pytest.raises(TypeError, match="custom_vjp"):
        _jvp(_loss(models.build("resnet18", num_classes=7, custom_vjps=True), variables, x, True),
                (params,), (tangents,))


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_custom_vjps_must_be_a_bool_or_none(value):
    x = jnp.zeros((1, 16, 16, 3))
    message = r"ResNet's `custom_vjps` \(=" + repr(value).replace(".", r"\.") + r"\) must be True"
    with pytest.raises(ConfigError, match=message):
        models.build("resnet18", num_classes=7, custom_vjps=value).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ConfigError, match=r"BatchNorm's `custom_vjps`"):
        models.BatchNorm(custom_vjps=value).init(jax.random.PRNGKey(0), x, train=True)
