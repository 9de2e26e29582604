"""Inference ResNets with every BatchNorm folded into the conv before it.

In eval mode a BatchNorm is a per-channel affine map, so `bn(conv(x, W))` equals
`conv(x, W * s) + (bias - mean * s)` with `s = scale / sqrt(var + eps)`: the same network
without its BatchNorm layers, each conv carrying a bias. `fold_batchnorm` computes those
weights once (in float64, rounded once to the parameters' dtype); `FoldedResNet` is the network
that uses them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, ClassVar, Iterator, Mapping

import flax.linen as nn
import numpy as np

from .._args import finite
from .._errors import ConfigError
from ._grads import use_custom_vjps
from ._resnet import ARCHS, ResNet, _ConvLeaf, build, check_arch


class _NoNorm(nn.Module):
    """Stands where a BatchNorm was: the identity, with no variables (its conv carries it)."""

    zero_scale: bool = False

    def __call__(self, x, train: bool = False):
        if train:
            raise ConfigError(
                "a FoldedResNet is inference-only (its BatchNorms are folded into the convs), "
                "got train=True; train the ResNet from `build(arch)` and fold afterwards"
            )
        return x


class FoldedResNet(ResNet):
    """`ResNet` for inference, with each BatchNorm folded into its conv (conv with bias, no BN).

    `FoldedResNet(...).apply(fold_batchnorm(variables, arch), x)` equals
    `ResNet(...).apply(variables, x)` (torchvision's `model.eval()(x)`) up to float32 rounding.
    Its variables are `params` only: each conv has `kernel` and `bias`, `fc` is unchanged, and
    the BatchNorm paths (`bn1`, `downsample/1`, ...) are gone. `train=True` raises ConfigError.
    Build one with `build_folded(arch)`; the attributes are `ResNet`'s (`bn_axis_name` unused).
    """

    _uses_batch_stats: ClassVar[bool] = False

    def _norm_and_conv(self) -> tuple[Callable, Callable]:
        return _NoNorm, functools.partial(_ConvLeaf, dtype=self.dtype, param_dtype=self.param_dtype, use_bias=True,
                                          custom_vjps=use_custom_vjps(self.custom_vjps))


def build_folded(arch: str, **kwargs) -> FoldedResNet:
    """The `FoldedResNet` for a torchvision architecture name, e.g. `build_folded("resnet50")`.

    Takes `num_classes` and `ResNet`'s other attributes (`dtype`, `replace_stride_with_dilation`, ...).
    """
    return build(arch, cls=FoldedResNet, **kwargs)


def _pairs(arch: str) -> Iterator[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(conv path, BatchNorm path) of every conv of `arch`, as torchvision builds them."""
    spec = ARCHS[arch]
    yield ("conv1",), ("bn1",)
    inplanes, exp = 64, spec.expansion
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), spec.layers)):
        for b in range(n):
            block = (f"layer{i + 1}", str(b))
            for j in range(1, 4 if spec.block == "bottleneck" else 3):
                yield (*block, f"conv{j}"), (*block, f"bn{j}")
            if b == 0 and (i > 0 or inplanes != planes * exp):
                yield (*block, "downsample", "0"), (*block, "downsample", "1")
        inplanes = planes * exp


def _get(tree: Mapping[str, Any], path: tuple[str, ...], missing: list[str], prefix: str) -> Any:
    node = tree
    for name in path:
        if not isinstance(node, Mapping) or name not in node:
            missing.append("/".join((prefix, *path)))
            return None
        node = node[name]
    return node


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _leaves(v, (*prefix, k))
        else:
            yield (*prefix, k)


def fold_batchnorm(variables: Mapping[str, Any], arch: str, *, epsilon: float = 1e-5) -> dict:
    """`FoldedResNet` variables: each eval-mode BatchNorm folded into the conv before it.

    For a conv with kernel `W` (HWIO) followed by a BatchNorm with `scale`, `bias`, `mean`, `var`:
    `s = scale / sqrt(var + epsilon)`, kernel `W * s` (per output channel) and bias
    `bias - mean * s`; this is `torch.nn.utils.fusion.fuse_conv_bn_eval(conv, bn)` for a conv
    without bias, with OIHW -> HWIO. It is computed in float64 and rounded once to the dtype of
    the kernel (resp. the BatchNorm bias), so a float32 folded model differs from the unfolded
    one only by float32 rounding in the forward pass. `fc` is copied (a backbone, `num_classes=0`,
    has none).

    Args:
      variables: `{"params": ..., "batch_stats": ...}` of a `ResNet` of `arch` (numpy or jax
        arrays), e.g. from `torch_compat.torch_to_flax` or `jaxport.load_variables`.
      arch: the torchvision architecture name (its table of conv/BatchNorm pairs).
      epsilon: the BatchNorm's eps (torch's default 1e-5, as `BatchNorm`).

    Returns:
      `{"params": ...}` of numpy arrays for `build_folded(arch, num_classes=...)`.

    Raises:
      ConfigError: unknown `arch`, an `epsilon` that is not a finite number >= 0, or variables
        that do not fit it (every missing and unexpected path is listed).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxport import models
      >>> x = jnp.ones((1, 32, 32, 3))
      >>> variables = models.resnet18(num_classes=10).init(jax.random.key(0), x)
      >>> folded = models.fold_batchnorm(variables, "resnet18")
      >>> logits = models.build_folded("resnet18", num_classes=10).apply(folded, x)
      >>> bool(jnp.allclose(logits, models.resnet18(num_classes=10).apply(variables, x), atol=1e-5))
      True
    """
    check_arch(arch)
    # A negative eps made NaN kernels behind one numpy warning; a string, a raw UFuncTypeError.
    finite("epsilon", epsilon, minimum=0, hint=" (the BatchNorm's eps: torch's default is 1e-5)")
    if not isinstance(variables, Mapping) or "params" not in variables or "batch_stats" not in variables:
        found = list(variables) if isinstance(variables, Mapping) else type(variables).__name__
        raise ConfigError(f"`variables` must hold 'params' and 'batch_stats' of a ResNet, got {found}")
    params, stats = variables["params"], variables["batch_stats"]
    out: dict[str, Any] = {}
    missing: list[str] = []
    has_fc = isinstance(params, Mapping) and "fc" in params
    used = {("fc", "kernel"), ("fc", "bias")} if has_fc else set()
    for conv, bn in _pairs(arch):
        kernel = _get(params, (*conv, "kernel"), missing, "params")
        scale = _get(params, (*bn, "scale"), missing, "params")
        bias = _get(params, (*bn, "bias"), missing, "params")
        mean = _get(stats, (*bn, "mean"), missing, "batch_stats")
        var = _get(stats, (*bn, "var"), missing, "batch_stats")
        used |= {(*conv, "kernel"), (*bn, "scale"), (*bn, "bias")}
        if any(a is None for a in (kernel, scale, bias, mean, var)):
            continue
        kernel, bias = np.asarray(kernel), np.asarray(bias)
        s = np.asarray(scale, np.float64) / np.sqrt(np.asarray(var, np.float64) + epsilon)
        node = out
        for name in conv:
            node = node.setdefault(name, {})
        node["kernel"] = (kernel.astype(np.float64) * s).astype(kernel.dtype)
        node["bias"] = (bias.astype(np.float64) - np.asarray(mean, np.float64) * s).astype(bias.dtype)
    fc = {k: _get(params, ("fc", k), missing, "params") for k in ("kernel", "bias")} if has_fc else {}
    unexpected = ["params/" + "/".join(p) for p in _leaves(params) if p not in used]
    if missing or unexpected:
        parts = [f"the variables do not fit {arch}"]
        for label, items in (("missing", missing), ("unexpected", unexpected)):
            if items:
                parts.append(f"{len(items)} {label}: " + "; ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
        raise ConfigError(". ".join(parts))
    if fc:
        out["fc"] = {k: np.asarray(v) for k, v in fc.items()}
    return {"params": out}
