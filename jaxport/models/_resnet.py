"""torchvision's ResNet family as one configurable Flax Linen module.

The module reproduces `torchvision.models.resnet` exactly: same layer order, explicit symmetric
padding (never 'SAME', which pads stride-2 layers asymmetrically), max-pool padded with -inf,
the ResNet v1.5 stride placement (on the 3x3 conv of a bottleneck), and parameter paths that
mirror torchvision's module names (`layer1/0/conv1` <-> `layer1.0.conv1`). Inputs are NHWC.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .._args import closest, is_int
from .._errors import ConfigError
from .._vma import vary_like
from ._batchnorm import BatchNorm
from ._grads import (conv1x1, conv1x1_primal, explicitly_sharded, grouped_conv, max_pool, max_pool_primal,
                     on_xla_cpu, small_map, small_map_conv, strided_conv, use_custom_vjps)

Dtype = Any


@dataclasses.dataclass(frozen=True)
class ResNetSpec:
    """One row of the architecture table: what torchvision's constructor is called with."""

    block: str  # "basic" or "bottleneck"
    layers: tuple[int, int, int, int]
    groups: int = 1
    width_per_group: int = 64

    @property
    def expansion(self) -> int:
        return 4 if self.block == "bottleneck" else 1


#: torchvision's named constructors and their arguments (torchvision/models/resnet.py).
ARCHS: dict[str, ResNetSpec] = {
    "resnet18": ResNetSpec("basic", (2, 2, 2, 2)),
    "resnet34": ResNetSpec("basic", (3, 4, 6, 3)),
    "resnet50": ResNetSpec("bottleneck", (3, 4, 6, 3)),
    "resnet101": ResNetSpec("bottleneck", (3, 4, 23, 3)),
    "resnet152": ResNetSpec("bottleneck", (3, 8, 36, 3)),
    "resnext50_32x4d": ResNetSpec("bottleneck", (3, 4, 6, 3), groups=32, width_per_group=4),
    "resnext101_32x8d": ResNetSpec("bottleneck", (3, 4, 23, 3), groups=32, width_per_group=8),
    "resnext101_64x4d": ResNetSpec("bottleneck", (3, 4, 23, 3), groups=64, width_per_group=4),
    "wide_resnet50_2": ResNetSpec("bottleneck", (3, 4, 6, 3), width_per_group=128),
    "wide_resnet101_2": ResNetSpec("bottleneck", (3, 4, 23, 3), width_per_group=128),
}

# torch initialisers, so a freshly built Flax model is distributed like a fresh torchvision one:
# convs use kaiming_normal_(mode="fan_out", nonlinearity="relu"); nn.Linear's default is
# U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias alike.
_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
_linear_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def _linear_bias_init(fan_in: int) -> Callable:
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class _Downsample(nn.Module):
    """torchvision's `downsample = Sequential(conv1x1(stride), BatchNorm2d)`: children `0`, `1`."""

    features: int
    stride: int
    norm: Callable
    conv: Callable

    @nn.compact
    def __call__(self, x, train: bool):
        x = self.conv(self.features, 1, self.stride, name="0")(x)
        return self.norm(name="1")(x, train)


class _ConvLeaf(nn.Module):
    """torch.nn.Conv2d, symmetric padding `dilation * (k - 1) // 2`; kernel at `<name>/kernel`.

    Without a bias, as torchvision's ResNet convs; `use_bias=True` (a `FoldedResNet`, whose convs
    carry their BatchNorm) adds `<name>/bias`.
    """

    features: int
    kernel: int
    stride: int = 1
    groups: int = 1
    dilation: int = 1
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = False
    custom_vjps: bool = True

    @nn.compact
    def __call__(self, x):
        k, pad = self.kernel, self.dilation * (self.kernel - 1) // 2
        in_features = x.shape[-1]
        if in_features % self.groups:
            raise ConfigError(f"conv input channels (={in_features}) not divisible by groups (={self.groups})")
        kernel = self.param(
            "kernel", _conv_init, (k, k, in_features // self.groups, self.features), self.param_dtype
        )
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        # Inside shard_map (check_vma on) the replicated kernel meets the device's shard: marked
        # varying as jax's own rules mark it, or the hand-written VJPs' per-device kernel
        # gradient did not match its type ("the manual axis types do not match").
        kernel = vary_like(kernel, x)
        if explicitly_sharded(x):  # XLA's own convolution, whose sharding rules jax has
            y = _lax_conv(x, kernel, self.stride, pad, self.dilation, self.groups)
        elif k > 1 and on_xla_cpu() and small_map(x.shape, k, self.stride, pad, self.dilation):
            y = small_map_conv(x, kernel, self.stride, pad, self.dilation, self.groups)
        elif k == 1 and self.groups == 1 and on_xla_cpu():
            # A 1x1 conv is a matmul over channels of the strided input. XLA:CPU runs it about
            # 2x faster as a dot than as a convolution, forward and backward (ResNet-50's
            # bottleneck and downsample layers); same products, summed in another order. On
            # XLA:GPU such dots made the compiler abort (`on_xla_cpu`): there, lax.conv below.
            s = self.stride
            y = (conv1x1 if self.custom_vjps else conv1x1_primal)(x[:, ::s, ::s] if s > 1 else x, kernel[0, 0])
        elif k > 1 and self.stride > 1 and self.groups == 1 and self.dilation == 1 and self.custom_vjps:
            y = strided_conv(x, kernel, self.stride, pad)
        elif self.groups > 1 and self.custom_vjps and on_xla_cpu():
            y = grouped_conv(x, kernel, self.stride, pad, self.dilation, self.groups)
        else:
            y = _lax_conv(x, kernel, self.stride, pad, self.dilation, self.groups)
        return y if bias is None else y + bias


def _lax_conv(x, kernel, stride: int, pad: int, dilation: int, groups: int):
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        window_strides=(stride, stride),
        padding=((pad, pad), (pad, pad)),
        rhs_dilation=(dilation, dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups,
    )


class _Block(nn.Module):
    """What torchvision's BasicBlock and Bottleneck are both constructed with."""

    planes: int
    stride: int = 1
    downsample: bool = False
    groups: int = 1
    base_width: int = 64
    dilation: int = 1
    norm: Callable = BatchNorm
    conv: Callable = _ConvLeaf
    zero_init_residual: bool = False


class BasicBlock(_Block):
    """torchvision's BasicBlock: conv3x3(stride) -> bn -> relu -> conv3x3 -> bn, + identity."""

    expansion = 1

    @nn.compact
    def __call__(self, x, train: bool = False):
        if self.groups != 1 or self.base_width != 64:
            raise ConfigError("BasicBlock only supports groups=1 and width_per_group=64 (as torchvision)")
        if self.dilation > 1:
            raise ConfigError("Dilation > 1 not supported in BasicBlock (as torchvision)")
        conv = self.conv
        out = conv(self.planes, 3, self.stride, name="conv1")(x)
        out = nn.relu(self.norm(name="bn1")(out, train))
        out = conv(self.planes, 3, name="conv2")(out)
        out = self.norm(name="bn2", zero_scale=self.zero_init_residual)(out, train)
        if self.downsample:
            x = _Downsample(self.planes, self.stride, self.norm, conv, name="downsample")(x, train)
        return nn.relu(out + x)


class Bottleneck(_Block):
    """torchvision's Bottleneck (ResNet v1.5: the stride sits on the 3x3 conv)."""

    expansion = 4

    @nn.compact
    def __call__(self, x, train: bool = False):
        width = int(self.planes * (self.base_width / 64.0)) * self.groups
        conv = self.conv
        out = conv(width, 1, name="conv1")(x)
        out = nn.relu(self.norm(name="bn1")(out, train))
        out = conv(width, 3, self.stride, self.groups, self.dilation, name="conv2")(out)
        out = nn.relu(self.norm(name="bn2")(out, train))
        out = conv(self.planes * 4, 1, name="conv3")(out)
        out = self.norm(name="bn3", zero_scale=self.zero_init_residual)(out, train)
        if self.downsample:
            x = _Downsample(self.planes * 4, self.stride, self.norm, conv, name="downsample")(x, train)
        return nn.relu(out + x)


class _Stage(nn.Module):
    """torchvision's `layerN` Sequential: blocks named `0`, `1`, ..."""

    blocks: Sequence[dict]
    block_cls: type

    @nn.compact
    def __call__(self, x, train: bool):
        for i, kwargs in enumerate(self.blocks):
            x = self.block_cls(**kwargs, name=str(i))(x, train)
        self.sow("intermediates", "out", x)
        return x


class ResNet(nn.Module):
    """torchvision's `ResNet` in Flax Linen, NHWC.

    `model.apply(variables, x)` equals torchvision's `model.eval()(x_nchw)` for the same weights
    (see `torch_compat.torch_to_flax`); `model.apply(variables, x, train=True,
    mutable=["batch_stats"])` equals `model.train()(x_nchw)`, including the updated running
    statistics (biased batch variance to normalise, unbiased to update `var`, momentum 0.1).

    Per-stage activations are sown into the `intermediates` collection when it is mutable, for
    layer-by-layer cross-checks: `stem`, `layer1/out` .. `layer4/out`, `pooled`.

    Attributes:
      block: "basic" or "bottleneck".
      layers: blocks per stage.
      num_classes: classifier outputs; 0 builds the backbone alone, with no `fc` (torchvision's
        `model.fc = nn.Identity()`, timm's `num_classes=0`): the model then returns the pooled
        features, `(N, 512 * expansion)`. Self-supervised checkpoints (DINO, Barlow Twins, ...)
        are saved this way.
      zero_init_residual: zero the last BatchNorm scale of each block (torchvision's option).
      groups, width_per_group: ResNeXt / wide ResNet options, as torchvision's.
      replace_stride_with_dilation: three bools for layer2..4, as torchvision's.
      dtype: compute dtype (None: promote inputs and parameters, so float64 weights compute in
        float64 when `jax_enable_x64` is on).
      param_dtype: dtype of freshly initialised parameters.
      bn_axis_name: mesh axis over which BatchNorm reduces batch statistics in train mode
        (SyncBatchNorm); None keeps statistics per device, as DDP without SyncBatchNorm.
      custom_vjps: True differentiates the convs, max-pool and train-mode BatchNorm with
        jaxport's hand-written VJPs, which XLA:CPU runs much faster; as with any
        `jax.custom_vjp`, forward-mode AD (`jax.jvp`, `jax.jacfwd`, `jax.hessian`,
        forward-over-reverse Hessian-vector products) then cannot go through the model. False
        uses jax's own rules everywhere, so every transformation works. None (default): True
        when jax's default backend is the CPU at trace time, else False (on XLA:GPU the
        CPU-tuned form made jax 0.11.2 abort while compiling the training step: `on_xla_cpu`;
        True there is untested). The outputs are the same bit for bit either way; only the
        gradients' summation order differs. Off the CPU the 1x1 convs are `lax.conv` whatever
        this says (on the CPU, dots over channels).
    """

    block: str
    layers: Sequence[int]
    num_classes: int = 1000
    zero_init_residual: bool = False
    groups: int = 1
    width_per_group: int = 64
    replace_stride_with_dilation: Sequence[bool] | None = None
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    bn_axis_name: str | None = None
    custom_vjps: bool | None = None
    # Not a field: whether the variables must hold BatchNorm statistics (a FoldedResNet's
    # BatchNorms are folded into its convs).
    _uses_batch_stats: ClassVar[bool] = True

    def __post_init__(self):
        # torchvision takes lists (`replace_stride_with_dilation=[False, True, True]`): a Module
        # holding one cannot be hashed ("Failed to hash Flax Module"), which a jit static
        # argument needs. Kept as tuples; the values are checked where they are used.
        for name in ("layers", "replace_stride_with_dilation"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        super().__post_init__()

    @nn.compact
    def __call__(self, x, train: bool = False):
        if x.ndim != 4:
            raise ConfigError(f"ResNet input must be NHWC with 4 dims, got shape {tuple(x.shape)}")
        if x.shape[1] == 3 and x.shape[-1] != 3:
            # torch's layout: the first thing a port gets wrong, and flax would only report a
            # kernel shape mismatch in conv1.
            raise ConfigError(f"ResNet input must be NHWC (channels last); got shape {tuple(x.shape)}, which looks "
                              "like torch's NCHW: transpose it with x.transpose(0, 2, 3, 1)")
        stem = self.variables.get("params", {}).get("conv1", {}).get("kernel")
        if stem is not None and jnp.ndim(stem) == 4 and stem.shape[2] != x.shape[-1]:
            # flax only said "the given initializer is expected to generate shape (7, 7, 1, 64), but
            # the existing parameter it received has shape (7, 7, 3, 64)"; torch names the channels.
            want = stem.shape[2]
            gray = ("repeat a grayscale image to 3 channels, jnp.repeat(x, 3, axis=-1), as torchvision's "
                    "Grayscale(num_output_channels=3) does")
            if x.shape[1] in (1, want) and x.shape[-1] not in (1, want):
                fix = "it looks like torch's NCHW: transpose it with x.transpose(0, 2, 3, 1)"
                fix += f", then {gray}" if x.shape[1] == 1 and want == 3 else ""
            elif x.shape[-1] == 1 and want == 3:
                fix = gray
            else:
                fix = f"pass images with {want} channels (NHWC)"
            raise ConfigError(f"ResNet input has {x.shape[-1]} channels (shape {tuple(x.shape)}, NHWC) but the "
                              f"variables' conv1 kernel takes {want}: {fix}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            # uint8 pixels ran through (promoted to float): logits of unnormalised 0-255 inputs,
            # where torch's conv2d refuses the dtype.
            raise ConfigError(f"ResNet input has dtype {x.dtype} (shape {tuple(x.shape)}); pass floating-point images "
                              "preprocessed as for training, e.g. torchvision's ToTensor (0-255 to 0-1) then "
                              "Normalize(mean, std)")
        if x.shape[1] == 0 or x.shape[2] == 0:
            raise ConfigError(f"ResNet input has no pixels: shape {tuple(x.shape)} (NHWC); pass images of at least "
                              "1x1 (torch refuses this too)")
        if not is_int(self.num_classes) or self.num_classes < 0:
            raise ConfigError(f"`num_classes` (={self.num_classes!r}) must be an int >= 0 "
                              "(0: no classifier, the model returns the pooled features)")
        layers = tuple(self.layers) if isinstance(self.layers, (tuple, list)) else None
        if layers is None or len(layers) != 4 or not all(is_int(n) and n >= 1 for n in layers):
            # Fewer than 4: zip() stopped at the shortest, so (1, 1) built two stages and an fc over
            # 128 features (torchvision raises IndexError). More than 4, or a count below 1: torchvision
            # builds them anyway, ignoring layers[4:] and making a stage of 0 (or -1) blocks one block
            # (_make_layer always builds the first), so (2, 2, 2, 0) gives blocks (2, 2, 2, 1); init did
            # the same here, and then apply refused those very variables as (2, 2, 2, 1) != (2, 2, 2, 0).
            # No torchvision ResNet has such counts: refuse them before init builds anything.
            raise ConfigError(f"`layers` (={self.layers!r}) must be 4 ints >= 1, the blocks of each of the 4 "
                              "stages, e.g. (2, 2, 2, 2) for resnet18; torchvision's ResNet family always has 4 "
                              "stages of at least one block (torchvision ignores counts after the 4th and "
                              "builds one block for a count below 1)")
        for name in ("groups", "width_per_group"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"`{name}` (={value!r}) must be a positive int (e.g. groups=32, width_per_group=4 "
                                  "for resnext50_32x4d)")
        block_cls = {"basic": BasicBlock, "bottleneck": Bottleneck}.get(self.block)
        if block_cls is None:
            raise ConfigError(f"`block` (={self.block!r}) must be 'basic' or 'bottleneck'")
        dilate = check_dilation(self.replace_stride_with_dilation)
        if not self.is_initializing():
            self._check_variables(layers)
        try:
            return self._forward(x, train, block_cls, dilate)
        except (flax.errors.ScopeParamShapeError, flax.errors.ScopeParamNotFoundError,
                flax.errors.ScopeCollectionNotFound) as e:
            # flax names one parameter and none of the model's arguments (e.g. another width).
            first = str(e).split(" (https://", 1)[0]
            raise ConfigError(f"the variables do not fit this {type(self).__name__} (layers={layers}, block="
                              f"{self.block!r}, groups={self.groups}, width_per_group={self.width_per_group}, "
                              f"num_classes={self.num_classes}): {first}; build the model the variables were made "
                              "for (jaxport.models.build(arch, num_classes=...))") from None

    def _check_variables(self, layers) -> None:
        """The variables' shape of network against the model's, before flax runs: a resnet34's
        variables given to a resnet18 ran silently on part of them (extra parameters are ignored),
        and the other mismatches were flax's errors, naming one path and no argument."""
        collections = self.variables
        if "params" not in collections:
            raise ConfigError(f"the variables hold no 'params' (their top-level keys: {sorted(collections)[:6]}); "
                              "pass the whole dict model.init or torch_compat.torch_to_flax returns, "
                              "{'params': ..., 'batch_stats': ...}")
        params = collections["params"]
        if self._uses_batch_stats and "batch_stats" not in collections:
            raise ConfigError("the variables hold 'params' but no 'batch_stats' (BatchNorm's running mean and var); "
                              "pass {'params': ..., 'batch_stats': ...} as model.init or "
                              "torch_compat.torch_to_flax returns them")
        got = tuple(len(params.get(f"layer{i + 1}", {})) for i in range(4))
        first = params.get("layer1", {}).get("0", {})
        kind = "bottleneck" if "conv3" in first else "basic" if first else None
        if got != layers or (kind is not None and kind != self.block):
            shown = f"{kind} blocks {got}" if kind else f"blocks {got}"
            like = [a for a, spec in ARCHS.items() if spec.layers == got and spec.block == kind]
            hint = f" (like {' / '.join(like)})" if like else ""
            raise ConfigError(f"the variables hold {shown}{hint}, but the model has {self.block} blocks {layers}: "
                              "build the model their architecture names, e.g. jaxport.models.build("
                              f"{like[0] if like else 'arch'!r}, num_classes=...)")
        if self.num_classes and "fc" not in params:
            # flax said only 'Could not find parameter named "kernel" in scope "/fc"'.
            raise ConfigError(f"the variables hold no classifier (fc): they are a backbone, e.g. the port of a "
                              f"checkpoint without fc, but the model was built with num_classes={self.num_classes}: "
                              "build it with num_classes=0, which returns the pooled features (or train a "
                              "classifier on them: jaxport train --init)")
        fc = params.get("fc", {}).get("kernel")
        if fc is not None and self.num_classes and jnp.ndim(fc) == 2 and fc.shape[1] != self.num_classes:
            raise ConfigError(f"the variables' classifier (fc) has {fc.shape[1]} outputs, but the model was built "
                              f"with num_classes={self.num_classes}: build it with num_classes={fc.shape[1]}")

    def _forward(self, x, train: bool, block_cls, dilate):
        norm, conv = self._norm_and_conv()

        x = conv(64, 7, 2, name="conv1")(x)
        x = nn.relu(norm(name="bn1")(x, train))
        # torch's MaxPool2d pads with -inf, so padding never wins the max.
        custom = use_custom_vjps(self.custom_vjps) and not explicitly_sharded(x)
        x = (max_pool if custom else max_pool_primal)(x, 3, 2, 1)
        self.sow("intermediates", "stem", x)

        inplanes, dilation = 64, 1
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), self.layers)):
            stride = 1 if i == 0 else 2
            previous_dilation = dilation
            if i > 0 and dilate[i - 1]:
                dilation *= stride
                stride = 1
            common = dict(groups=self.groups, base_width=self.width_per_group, norm=norm, conv=conv,
                          zero_init_residual=self.zero_init_residual)
            blocks = [dict(planes=planes, stride=stride, dilation=previous_dilation,
                           downsample=stride != 1 or inplanes != planes * block_cls.expansion, **common)]
            inplanes = planes * block_cls.expansion
            blocks += [dict(planes=planes, dilation=dilation, **common) for _ in range(1, n)]
            x = _Stage(blocks, block_cls, name=f"layer{i + 1}")(x, train)

        x = jnp.mean(x, axis=(1, 2))
        self.sow("intermediates", "pooled", x)
        if self.num_classes == 0:  # a backbone: the features are the output
            return x
        return nn.Dense(
            self.num_classes,
            kernel_init=_linear_init,
            bias_init=_linear_bias_init(x.shape[-1]),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="fc",
        )(x)


    def _norm_and_conv(self) -> tuple[Callable, Callable]:
        """The BatchNorm and conv every layer is built from (a `FoldedResNet` swaps them)."""
        custom = use_custom_vjps(self.custom_vjps)
        return (functools.partial(BatchNorm, axis_name=self.bn_axis_name, param_dtype=self.param_dtype,
                                  custom_vjps=custom),
                functools.partial(_ConvLeaf, dtype=self.dtype, param_dtype=self.param_dtype, custom_vjps=custom))


def _constructor(arch: str, cls: type[ResNet] = ResNet) -> Callable[..., ResNet]:
    spec = ARCHS[arch]

    def make(num_classes: int = 1000, **kwargs) -> ResNet:
        if kwargs.pop("norm_layer", None) is not None:  # None is torchvision's default, BatchNorm2d
            # The dataclass said only "unexpected keyword argument 'norm_layer'".
            raise ConfigError("`norm_layer` is not supported: jaxport's ResNets use torchvision's default "
                              "BatchNorm2d (eps 1e-5, momentum 0.1); for SyncBatchNorm pass "
                              "bn_axis_name='data'; for FrozenBatchNorm2d (statistics and affine fixed) fold it "
                              "for inference (jaxport.models.build_folded), or to train the rest use "
                              "jaxport.train.make_train_step(..., batchnorm='frozen') (jaxport train --bn-mode "
                              "frozen), or apply the model with train=False and give the BatchNorm scales and "
                              "biases optax.set_to_zero() in a step of your own")
        fixed = {"groups": spec.groups, "width_per_group": spec.width_per_group}
        for key, value in fixed.items():
            if key in kwargs and kwargs[key] != value:
                raise ConfigError(
                    f"`{key}` (={kwargs[key]}) is fixed to {value} by {arch}; use {cls.__name__}(...) directly")
            kwargs.pop(key, None)
        return cls(block=spec.block, layers=spec.layers, num_classes=num_classes, **fixed, **kwargs)

    make.__name__ = make.__qualname__ = arch
    make.__doc__ = (
        f"torchvision's `{arch}` as a Flax `ResNet` (NHWC). Takes `num_classes` and ResNet's other "
        "attributes (`zero_init_residual`, `replace_stride_with_dilation`, `dtype`, `bn_axis_name`, "
        "`custom_vjps`, ...)."
    )
    return make


def layer4_side(image_size: int, replace_stride_with_dilation: Sequence[bool] | None = None) -> int:
    """Side of layer4's feature map for `image_size` px inputs: the stem conv, the max-pool and
    layer2..4 each halve it, rounding up (32 px -> 1x1, 33 px -> 2x2), except the stages
    `replace_stride_with_dilation` dilates, which keep the side they are given (32 px with
    (False, True, True) -> 4x4, layer2's)."""
    if not is_int(image_size) or image_size < 1:
        raise ConfigError(f"`image_size` (={image_size!r}) must be an int >= 1 (pixels per side)")
    side = (image_size + 2 * 3 - 7) // 2 + 1
    side = (side + 2 - 3) // 2 + 1  # the max-pool
    for dilated in check_dilation(replace_stride_with_dilation):
        side = side if dilated else (side + 2 - 3) // 2 + 1
    return side


def check_dilation(replace_stride_with_dilation: Sequence[bool] | None) -> tuple[bool, bool, bool]:
    """`replace_stride_with_dilation` as three bools, for layer2, layer3 and layer4 (None: none
    dilated): the one check behind `ResNet`, `layer4_side` and `torch_compat.cross_check`.

    torchvision's meaning: True replaces that stage's stride 2 by a dilation of 2 (times the
    dilation of the stages before it), so its map keeps the side of the stage before it. Each
    item is a bool, or 0 or 1; torchvision takes any truthy value, so the string "False" would
    dilate there. As in torchvision, only None means no dilation: an empty tuple is refused.

    Raises:
      ConfigError: anything else, naming the value received.

    Example:
      >>> check_dilation([0, 1, 1])
      (False, True, True)
    """
    value = replace_stride_with_dilation
    if value is None:
        return (False, False, False)
    items = tuple(value) if isinstance(value, (tuple, list, np.ndarray)) else None
    if items is None or len(items) != 3:
        got = f"{len(items)} element(s)" if items is not None else type(value).__name__
    else:
        odd = [v for v in items if not (isinstance(v, (bool, np.bool_)) or (is_int(v) and v in (0, 1)))]
        if not odd:
            return tuple(bool(v) for v in items)
        got = f"the item {odd[0]!r}, not a bool"
    raise ConfigError(f"`replace_stride_with_dilation` (={value!r}) should be None or a 3-element tuple, got {got}: "
                      "three bools, for layer2, layer3 and layer4, each True to replace that stage's stride 2 by "
                      "dilation (torchvision's meaning), e.g. (False, True, True) as torchvision's DeepLabV3 and "
                      "FCN build their backbones")


def build(arch: str, *, cls: type[ResNet] = ResNet, **kwargs) -> ResNet:
    """The Flax ResNet for a torchvision architecture name, e.g. `build("resnet50", num_classes=10)`.

    `cls` builds a ResNet subclass instead (e.g. `FoldedResNet`, see `build_folded`).
    """
    check_arch(arch)
    return _constructor(arch, cls)(**kwargs)


def check_arch(arch: str, error: type[Exception] = ConfigError) -> str:
    """`arch` if it names one of torchvision's ResNets (`ARCHS`), else `error` listing them and the
    name most likely meant: the one check behind `build`, `build_folded`, the converter and the
    torch reference."""
    if arch in ARCHS:
        return arch
    guess = closest(arch, list(ARCHS)) if isinstance(arch, str) else None
    raise error(f"`arch` (={arch!r}) is not a known architecture; expected one of {', '.join(ARCHS)}"
                + (f"; did you mean {guess!r}?" if guess else ""))


resnet18 = _constructor("resnet18")
resnet34 = _constructor("resnet34")
resnet50 = _constructor("resnet50")
resnet101 = _constructor("resnet101")
resnet152 = _constructor("resnet152")
resnext50_32x4d = _constructor("resnext50_32x4d")
resnext101_32x8d = _constructor("resnext101_32x8d")
resnext101_64x4d = _constructor("resnext101_64x4d")
wide_resnet50_2 = _constructor("wide_resnet50_2")
wide_resnet101_2 = _constructor("wide_resnet101_2")
