"""`cross_entropy(..., label_smoothing=ls)` against torch's `F.cross_entropy(..., label_smoothing=ls)`:
per-example values and gradients, out-of-range labels, and the range torch takes. (The train
step with it is tested against torch in test_train_dataparallel.py.)

Tolerances: float64 1e-12 relative (one log-softmax of rounding apart); float32 1e-6.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxport._errors import ConfigError
from jaxport.models import build
from jaxport.train import cross_entropy, make_mesh, make_train_step
from torch_compat import optim

N, CLASSES = 6, 5
TOL = {np.float64: 1e-12, np.float32: 1e-6}


def _inputs(dtype):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((N, CLASSES)) * 4).astype(dtype)
    logits[0, 2] += 60  # a confident row: the stabilised log-softmax must not overflow
    labels = rng.integers(0, CLASSES, N)
    weights = rng.standard_normal(N).astype(dtype)  # a cotangent that tells the rows' gradients apart
    return logits, labels, weights


def _torch(logits, labels, weights, ls):
    t = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(labels), reduction="none", label_smoothing=ls)
    (loss * torch.tensor(weights)).sum().backward()
    return loss.detach().numpy(), t.grad.numpy()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("ls", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("jit", [False, True])
def test_values_and_gradients_equal_torch(x64, dtype, ls, jit):
    logits, labels, weights = _inputs(dtype)
    want, want_grad = _torch(logits, labels, weights, ls)
    f = (jax.jit(cross_entropy, static_argnums=2) if jit else cross_entropy)
    got = f(jnp.asarray(logits), jnp.asarray(labels), ls)
    assert got.dtype == dtype
    grad = jax.grad(lambda z: jnp.sum(f(z, jnp.asarray(labels), ls) * weights))(jnp.asarray(logits))
    np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    np.testing.assert_allclose(grad, want_grad, rtol=TOL[dtype], atol=TOL[dtype])


def test_smoothing_changes_the_loss(x64):
    """The equation's two terms differ on these rows: a smoothing ignored would fail above too."""
    logits, labels, _ = _inputs(np.float64)
    plain = cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
    smooth = cross_entropy(jnp.asarray(logits), jnp.asarray(labels), 0.1)
    assert np.min(np.abs(np.asarray(smooth - plain))) > 1e-3


@pytest.mark.parametrize("bad", [-1, CLASSES, -100])
def test_labels_outside_the_classes_still_make_the_loss_nan(x64, bad):
    """As without smoothing: torch raises IndexError (skips -100), a jitted step cannot raise.
    That example adds nothing to the gradient, the others are torch's."""
    logits, labels, weights = _inputs(np.float64)
    labels[1] = bad
    got = np.asarray(cross_entropy(jnp.asarray(logits), jnp.asarray(labels), 0.1))
    keep = np.arange(N) != 1
    want, want_grad = _torch(logits[keep], labels[keep], weights[keep], 0.1)
    assert np.isnan(got[1])
    np.testing.assert_allclose(got[keep], want, rtol=1e-12)
    grad = jax.grad(lambda z: jnp.sum(jnp.where(keep, cross_entropy(z, jnp.asarray(labels), 0.1), 0) * weights))(
        jnp.asarray(logits))
    np.testing.assert_array_equal(grad[1], 0)
    np.testing.assert_allclose(grad[keep], want_grad, rtol=1e-12, atol=1e-12)


def test_a_minus_inf_logit_with_smoothing_is_inf_as_in_torch(x64):
    logits, labels, weights = _inputs(np.float64)
    logits[0, (labels[0] + 1) % CLASSES] = -np.inf
    want, _ = _torch(logits, labels, weights, 0.1)
    got = np.asarray(cross_entropy(jnp.asarray(logits), jnp.asarray(labels), 0.1))
    assert np.isposinf(want[0]) and np.isposinf(got[0])
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-12)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), float("inf"), "0.1", True, None])
def test_label_smoothing_outside_torchs_range_is_refused(bad):
    logits, labels = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 1.0]]), torch.tensor([0, 1])
    if isinstance(bad, float) and bad > 1:  # torch's own refusal
        with pytest.raises(RuntimeError, match="label_smoothing must be between 0.0 and 1.0"):
            torch.nn.functional.cross_entropy(logits, labels, label_smoothing=bad)
    elif isinstance(bad, float):  # torch 2.x smooths only if `ls > 0`: these silently train unsmoothed
        plain = torch.nn.functional.cross_entropy(logits, labels)
        assert torch.nn.functional.cross_entropy(logits, labels, label_smoothing=bad) == plain
    message = (rf"^`label_smoothing` \(={bad!r}\) must be a number from 0 to 1, as torch's CrossEntropyLoss takes: "
               r"the weight of the uniform target, e\.g\. 0\.1; 0 for plain cross-entropy$")
    with pytest.raises(ConfigError, match=message):
        cross_entropy(jnp.zeros((2, 3)), jnp.array([0, 1]), bad)
    mesh = make_mesh(jax.devices("cpu")[:2])
    with pytest.raises(ConfigError, match=message):
        make_train_step(build("resnet18", num_classes=3), optim.sgd(0.1), mesh, label_smoothing=bad)
