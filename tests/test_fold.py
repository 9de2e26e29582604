"""fold_batchnorm / FoldedResNet against torchvision in eval mode and torch's own conv-BN fusion."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from torch.nn.utils.fusion import fuse_conv_bn_eval

import torch_compat
from jaxport import models
from jaxport._errors import ConfigError
from tests.helpers import reference

ARCHS = ("resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2")
# Logits against torchvision: relative to the logits' scale, as the port's own parity tests.
LOGIT_RTOL = 1e-4
# Folded against unfolded Flax: both float32, differing only in where the products round. At
# 48 px, wide_resnet50_2's rounding alone puts unfolded Flax 6e-6 (of the logits' scale) from
# torch and folded 1.2e-5 from unfolded; 3e-5 leaves a margin and stays 3x under LOGIT_RTOL.
FOLD_RTOL = 3e-5


def _ported(arch):
    return torch_compat.torch_to_flax(reference(arch).state_dict())


def _image(size=48, batch=2, seed=0):
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return x, jnp.asarray(x.permute(0, 2, 3, 1).numpy())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("arch", ARCHS)
def test_folded_logits_equal_torchvision_eval(arch, jit):
    ref = reference(arch)
    variables = _ported(arch)
    folded = models.fold_batchnorm(variables, arch)
    x, xj = _image()
    with torch.no_grad():
        expected = ref(x).numpy()
    apply = models.build_folded(arch, num_classes=10).apply
    got = np.asarray((jax.jit(apply) if jit else apply)(folded, xj))
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=LOGIT_RTOL * scale)
    unfolded = np.asarray(models.build(arch, num_classes=10).apply(variables, xj))
    np.testing.assert_allclose(got, unfolded, rtol=0, atol=FOLD_RTOL * scale)


@pytest.mark.parametrize("arch", ARCHS)
def test_folded_weights_are_torch_fuse_conv_bn_eval(arch):
    ref = reference(arch)
    folded = models.fold_batchnorm(_ported(arch), arch)["params"]
    modules = dict(ref.named_modules())
    n = 0
    for name, module in modules.items():
        if not isinstance(module, torch.nn.BatchNorm2d):
            continue
        conv_name = name[:-1] + "0" if name.endswith("downsample.1") else name.replace(".bn", ".conv").replace("bn1", "conv1")
        fused = fuse_conv_bn_eval(modules[conv_name], module)
        node = folded
        for part in conv_name.split("."):
            node = node[part]
        # torch fuses in float32, jaxport in float64 rounded once: equal to float32 rounding.
        w = fused.weight.detach().numpy().transpose(2, 3, 1, 0)
        np.testing.assert_allclose(node["kernel"], w, rtol=1e-6, atol=1e-7 * np.abs(w).max())
        b = fused.bias.detach().numpy()
        np.testing.assert_allclose(node["bias"], b, rtol=1e-6, atol=1e-7 * np.abs(b).max())
        n += 1
    assert n == sum(isinstance(m, torch.nn.BatchNorm2d) for m in ref.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_folded_variables_fit_folded_model_exactly(arch):
    folded = models.fold_batchnorm(_ported(arch), arch)
    shapes = jax.eval_shape(lambda: models.build_folded(arch, num_classes=10).init(
        jax.random.key(0), jnp.zeros((1, 32, 32, 3))))
    assert set(shapes) == {"params"}
    assert jax.tree.structure(shapes) == jax.tree.structure(folded)
    assert jax.tree.map(lambda a: a.shape, shapes) == jax.tree.map(lambda a: a.shape, folded)
    assert not any("bn" in "/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(folded)[0])


def test_fold_keeps_dtype():
    variables = jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a,
                             _ported("resnet18"))
    folded = models.fold_batchnorm(variables, "resnet18")
    assert {a.dtype for a in jax.tree.leaves(folded)} == {np.dtype(ml_dtypes.bfloat16)}


def test_fold_accepts_jax_arrays_and_does_not_touch_its_input():
    variables = jax.tree.map(jnp.asarray, _ported("resnet18"))
    before = jax.tree.map(np.array, variables)
    folded = models.fold_batchnorm(variables, "resnet18")
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(folded))
    jax.tree.map(np.testing.assert_array_equal, variables, before)


def test_fold_rejects_wrong_arch_listing_every_path():
    with pytest.raises(ConfigError, match=r"do not fit resnet34.*missing: params/layer1/2/conv1/kernel"):
        models.fold_batchnorm(_ported("resnet18"), "resnet34")
    with pytest.raises(ConfigError, match=r"unexpected: params/layer1/0/conv3/kernel"):
        models.fold_batchnorm(_ported("resnet50"), "resnet18")


def test_fold_rejects_unknown_arch_and_missing_collections():
    with pytest.raises(ConfigError, match=r"`arch` \(='resnet5'\) is not a known architecture"):
        models.fold_batchnorm(_ported("resnet18"), "resnet5")
    with pytest.raises(ConfigError, match=r"must hold 'params' and 'batch_stats'.*\['params'\]"):
        models.fold_batchnorm({"params": _ported("resnet18")["params"]}, "resnet18")


@pytest.mark.parametrize("epsilon", [-1.0, "1e-5", float("nan"), None])
def test_fold_checks_epsilon(epsilon):
    """A negative eps folded NaN kernels behind one numpy RuntimeWarning; a string was a raw
    numpy UFuncTypeError."""
    with pytest.raises(ConfigError, match=r"`epsilon` \(=.*\) must be a finite number >= 0 \(the BatchNorm's eps"):
        models.fold_batchnorm(_ported("resnet18"), "resnet18", epsilon=epsilon)
    assert models.fold_batchnorm(_ported("resnet18"), "resnet18", epsilon=0)["params"]  # torch allows eps=0


def test_folded_model_refuses_train_mode():
    folded = models.fold_batchnorm(_ported("resnet18"), "resnet18")
    with pytest.raises(ConfigError, match="inference-only"):
        models.build_folded("resnet18", num_classes=10).apply(folded, jnp.zeros((1, 32, 32, 3)), train=True)


def test_build_folded_rejects_unknown_arch_and_fixed_options():
    with pytest.raises(ConfigError, match="not a known architecture"):
        models.build_folded("resnet5")
    with pytest.raises(ConfigError, match=r"`groups` \(=8\) is fixed to 32 by resnext50_32x4d; use FoldedResNet"):
        models.build_folded("resnext50_32x4d", groups=8)


def test_folded_float32_weights_are_float64_rounded_once():
    """`fold_batchnorm` computes in float64 and rounds once: bit for bit the float64 fold of the
    float32 inputs cast to float32 (computed here with torch), not torch's float32 fusion, which
    rounds at each step and differs in the last bit."""
    ref = reference("resnet18")
    folded = models.fold_batchnorm(_ported("resnet18"), "resnet18")["params"]
    modules = dict(ref.named_modules())
    n = 0
    for name, bn in modules.items():
        if not isinstance(bn, torch.nn.BatchNorm2d):
            continue
        conv_name = name[:-1] + "0" if name.endswith("downsample.1") else name.replace("bn", "conv")
        s = bn.weight.detach().double() / torch.sqrt(bn.running_var.double() + bn.eps)
        w = (modules[conv_name].weight.detach().double() * s[:, None, None, None]).float()
        b = (bn.bias.detach().double() - bn.running_mean.double() * s).float()
        node = folded
        for part in conv_name.split("."):
            node = node[part]
        assert node["kernel"].dtype == node["bias"].dtype == np.float32
        np.testing.assert_array_equal(node["kernel"].view(np.uint32), w.permute(2, 3, 1, 0).numpy().view(np.uint32))
        np.testing.assert_array_equal(node["bias"].view(np.uint32), b.numpy().view(np.uint32))
        n += 1
    assert n == 20
