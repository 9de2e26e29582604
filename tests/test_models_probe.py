"""Adversarial probes of the models and the conversion against torchvision: constructor options,
inputs torch names clearly, odd image sizes, and tensors laid out in every way torch allows.

Every numeric comparison runs torchvision on the same weights and inputs in the same test.
Tolerances: eval-mode float32 outputs within 1e-4 of torch's largest value (measured ~1e-6);
train-mode within 1e-4 too at these sizes (layer4 sees >= 4 values per channel; measured ~1e-5).
"""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision
from torchvision.models.resnet import BasicBlock as TorchBasicBlock
from torchvision.models.resnet import Bottleneck as TorchBottleneck
from torchvision.models.resnet import ResNet as TorchResNet

import torch_compat
from jaxport import models
from jaxport._errors import ConfigError, ConversionError
from torch_compat._reference import calibrate
from tests.helpers import reference

jax.config.update("jax_default_matmul_precision", "highest")

RTOL = 1e-4


def _nhwc(x: torch.Tensor) -> jnp.ndarray:
    return jnp.asarray(x.permute(0, 2, 3, 1).numpy())


def _close(got, expected, rtol=RTOL):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=rtol * np.abs(expected).max())


def _calibrated(model: torch.nn.Module, seed: int = 0, size: int = 40) -> torch.nn.Module:
    return calibrate(model, seed=seed, image_size=size, calibration_batches=2)


# --- constructor options ----------------------------------------------------------------------


@pytest.mark.parametrize("dilation", [(True, False, False), (False, True, False), (True, True, True)])
def test_every_dilation_pattern_ports_with_arch_none_and_matches_torchvision(dilation):
    """A dilated ResNet-50 has ResNet-50's tensors: detected as resnet50, ported unchanged, and
    equal to torchvision's dilated model once the Flax model is built with the same option, in
    eval and in train mode (outputs and updated running statistics), on a non-square input."""
    torch.manual_seed(0)
    ref = _calibrated(torchvision.models.resnet50(num_classes=3, replace_stride_with_dilation=list(dilation)))
    sd = ref.state_dict()
    assert torch_compat.detect_arch(sd) == "resnet50"
    variables = torch_compat.torch_to_flax(sd)  # arch=None
    model = models.resnet50(num_classes=3, replace_stride_with_dilation=dilation)
    x = torch.randn(2, 3, 36, 28)
    with torch.no_grad():
        expected = ref(x).numpy()
        train_ref = copy.deepcopy(ref).train()
        expected_train = train_ref(x).numpy()
    _close(model.apply(variables, _nhwc(x)), expected)
    got, state = model.apply(variables, _nhwc(x), train=True, mutable=["batch_stats"])
    _close(got, expected_train)
    back = torch_compat.flax_to_torch({"params": variables["params"], **state}, "resnet50")
    for key, value in train_ref.state_dict().items():
        if key.endswith(("running_mean", "running_var")):
            _close(back[key].numpy(), value.numpy())
        elif key.endswith("num_batches_tracked"):
            assert int(back[key]) == int(value), key


def test_a_dilated_port_without_the_option_differs_exactly_as_torchvision_does():
    """What detection cannot see, torchvision's strict load cannot either: both undilated models
    give the same (other) logits, so the port never silently disagrees with torch."""
    torch.manual_seed(0)
    sd = _calibrated(torchvision.models.resnet50(num_classes=3, replace_stride_with_dilation=[False, True, True]),
                     size=32).state_dict()
    plain = torchvision.models.resnet50(num_classes=3)
    plain.load_state_dict(sd, strict=True)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        expected = plain.eval()(x).numpy()
    _close(models.resnet50(num_classes=3).apply(torch_compat.torch_to_flax(sd), _nhwc(x)), expected)
    # cross_check validates the weights themselves (every conv is used without dilation too).
    (report,) = torch_compat.cross_check(sd, modes=("eval",), image_size=32)
    assert report.ok and report.arch == "resnet50", report.table()


def test_norm_layer_is_refused_naming_the_alternatives():
    """torchvision takes `norm_layer`; the port raised the dataclass's TypeError "unexpected keyword
    argument 'norm_layer'"."""
    torchvision.models.resnet18(norm_layer=torch.nn.BatchNorm2d)  # torch takes it
    for make in (lambda **kw: models.resnet18(**kw), lambda **kw: models.build("resnet50", **kw),
                 lambda **kw: models.build_folded("resnet18", **kw)):
        with pytest.raises(ConfigError, match=r"`norm_layer` is not supported: .*BatchNorm2d.*bn_axis_name"):
            make(norm_layer=torch.nn.BatchNorm2d)
    # None is torchvision's default (BatchNorm2d), so it builds the same model
    assert models.resnet18(norm_layer=None, num_classes=4) == models.resnet18(num_classes=4)


def test_frozen_batchnorm_training_as_the_norm_layer_error_advises():
    """What the `norm_layer` refusal advises for FrozenBatchNorm2d, checked: train=False plus
    `optax.set_to_zero()` on the BatchNorm scales and biases is one SGD step of torchvision's
    resnet18(norm_layer=FrozenBatchNorm2d) (float64)."""
    import optax
    from flax import traverse_util

    from jaxport.train import cross_entropy
    from torch_compat import optim

    sd = {k: v.double() for k, v in reference("resnet18").state_dict().items()}
    frozen = torchvision.models.resnet18(norm_layer=torchvision.ops.FrozenBatchNorm2d, num_classes=10).double()
    frozen.load_state_dict({k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")})
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 3, 32, 32)))
    y = torch.tensor([0, 3, 5, 9])
    opt = torch.optim.SGD(frozen.parameters(), lr=0.1, momentum=0.9)
    torch.nn.functional.cross_entropy(frozen(x), y).backward()
    opt.step()
    with jax.enable_x64(True):
        variables = torch_compat.torch_to_flax(sd)
        model = models.resnet18(num_classes=10)
        flat = traverse_util.flatten_dict(variables["params"])
        labels = traverse_util.unflatten_dict({k: "frozen" if "bn" in "".join(k) or "downsample/1" in "/".join(k)
                                               else "train" for k in flat})
        tx = optax.multi_transform({"train": optim.sgd(0.1, momentum=0.9), "frozen": optax.set_to_zero()}, labels)
        images, targets = jnp.asarray(x.numpy().transpose(0, 2, 3, 1)), jnp.asarray(y.numpy())

        def loss(params):
            logits = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, images, train=False)
            return jnp.mean(cross_entropy(logits, targets))

        @jax.jit  # one program: eagerly, each op of the gradient compiled on its own (~30 s in all)
        def step(params):
            return optax.apply_updates(params, tx.update(jax.grad(loss)(params), tx.init(params), params)[0])

        stepped = step(variables["params"])
        want = torch_compat.torch_to_flax({**sd, **{k: v.detach() for k, v in frozen.state_dict().items()}})["params"]
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12), stepped, want)


def test_basic_block_groups_or_width_are_refused_like_torchvision():
    x = jnp.zeros((1, 32, 32, 3))
    for kwargs in ({"groups": 2}, {"width_per_group": 32}):
        with pytest.raises(ValueError, match="BasicBlock only supports groups=1 and base_width=64"):
            TorchResNet(TorchBasicBlock, [1, 1, 1, 1], **kwargs)
        with pytest.raises(ValueError, match="BasicBlock only supports groups=1 and width_per_group=64"):
            models.ResNet(block="basic", layers=(1, 1, 1, 1), **kwargs).init(jax.random.key(0), x)


def test_a_custom_width_state_dict_is_named_never_detected_as_a_named_arch():
    """groups=2, width_per_group=32 on ResNet-50's layers fits no named architecture: detection
    says what it found and an explicit arch names the conv shapes that do not fit."""
    sd = TorchResNet(TorchBottleneck, [3, 4, 6, 3], groups=2, width_per_group=32).state_dict()
    with pytest.raises(ConversionError, match=r"groups=2, width_per_group=32, which is none of torchvision's"):
        torch_compat.torch_to_flax(sd)
    wrong = r"layer1.0.conv2.weight: got \(64, 32, 3, 3\), expected \(64, 64, 3, 3\)"
    with pytest.raises(ConversionError, match=wrong):
        torch_compat.torch_to_flax(sd, "resnet50")


@pytest.mark.parametrize("size", [(1, 1), (7, 7), (33, 33), (17, 50)])
def test_one_class_head_and_odd_image_sizes_match_torchvision(size):
    """num_classes=1 and images of 1 px, odd sides and non-square, in eval mode; in train mode
    where layer4 still sees several values per channel (at 1 or 7 px it sees 2, where torch's
    own float32 differs from its float64 by more than the outputs' scale)."""
    ref = reference("resnet18", 1)
    variables = torch_compat.torch_to_flax(ref.state_dict())
    model = models.resnet18(num_classes=1)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        expected = ref(x).numpy()
    _close(model.apply(variables, _nhwc(x)), expected)
    if min(size) > 32:
        with torch.no_grad():
            expected = copy.deepcopy(ref).train()(x).numpy()
        _close(model.apply(variables, _nhwc(x), train=True, mutable=["batch_stats"])[0], expected)


# --- inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, torch_shape, fix", [
    ((1, 32, 32, 1), (1, 1, 32, 32), r"repeat a grayscale image to 3 channels, jnp.repeat\(x, 3, axis=-1\)"),
    # grayscale in torch's layout
    ((1, 1, 32, 32), (1, 1, 32, 32), r"it looks like torch's NCHW: transpose .*, then repeat a grayscale"),
    ((1, 32, 32, 4), (1, 4, 32, 32), r"pass images with 3 channels"),  # RGBA
])
def test_input_channels_that_do_not_fit_conv1_are_named_as_torch_names_them(shape, torch_shape, fix):
    """torch: "expected input[1, 1, 32, 32] to have 3 channels, but got 1 channels instead"; the
    port raised flax's ScopeParamShapeError about an initializer's shape."""
    ref = torchvision.models.resnet18(num_classes=2).eval()
    with pytest.raises(RuntimeError, match=rf"to have 3 channels, but got {torch_shape[1]} channels"):
        ref(torch.zeros(torch_shape))
    variables = torch_compat.torch_to_flax(ref.state_dict())
    for model in (models.resnet18(num_classes=2), models.build_folded("resnet18", num_classes=2)):
        v = variables if not isinstance(model, models.FoldedResNet) else models.fold_batchnorm(variables, "resnet18")
        with pytest.raises(ConfigError, match=rf"input has {shape[-1]} channels .* conv1 kernel takes 3: {fix}"):
            model.apply(v, jnp.zeros(shape))


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int32, jnp.bool_])
def test_integer_images_are_refused_as_torch_refuses_them(dtype):
    """uint8 pixels (0-255, before ToTensor and Normalize) ran through, promoted to float, giving
    the logits of unnormalised images; torch's conv2d refuses the dtype."""
    ref = torchvision.models.resnet18(num_classes=2).eval()
    with pytest.raises(RuntimeError):
        ref(torch.zeros((1, 3, 32, 32), dtype=torch.uint8))
    variables = torch_compat.torch_to_flax(ref.state_dict())
    x = jnp.zeros((1, 32, 32, 3), dtype)
    for model in (models.resnet18(num_classes=2), models.build_folded("resnet18", num_classes=2)):
        v = variables if not isinstance(model, models.FoldedResNet) else models.fold_batchnorm(variables, "resnet18")
        with pytest.raises(ConfigError, match=rf"input has dtype {jnp.dtype(dtype).name} \(shape \(1, 32, 32, 3\)\); "
                                              r"pass floating-point images preprocessed as for training"):
            model.apply(v, x)


# --- tensors as torch may hold them -----------------------------------------------------------


def _layouts(sd):
    """The same values in every layout torch allows: channels_last, transposed views, slices of
    one shared buffer, every-other-element views, and a 0-stride expand."""
    flat = torch.cat([v.reshape(-1).float() for v in sd.values() if v.is_floating_point()])
    shared, offset = {}, 0
    for k, v in sd.items():
        if v.is_floating_point():
            shared[k] = flat[offset:offset + v.numel()].view(v.shape)
            offset += v.numel()
        else:
            shared[k] = v
    return {
        "channels_last": {k: v.contiguous(memory_format=torch.channels_last) if v.ndim == 4 else v
                          for k, v in sd.items()},
        "transposed views": {k: v.transpose(0, 1).contiguous().transpose(0, 1) if v.ndim in (2, 4) else v
                             for k, v in sd.items()},
        "shared storage": shared,
        "strided views": {k: torch.stack([v, v], -1)[..., 1] if v.is_floating_point() else v for k, v in sd.items()},
        "expanded": {**sd, "bn1.running_mean": sd["bn1.running_mean"][:1].expand(64)},
    }


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])  # resnet50: the big 1x1 and fc copies
def test_every_tensor_layout_ports_bit_exactly_and_round_trips(arch):
    sd = reference(arch).state_dict() if arch == "resnet18" else torchvision.models.resnet50().state_dict()
    for name, laid_out in _layouts(sd).items():
        contiguous = {k: v.contiguous() for k, v in laid_out.items()}
        assert any(not v.is_contiguous() for v in laid_out.values()) or name == "shared storage"
        got = torch_compat.torch_to_flax(laid_out)
        want = torch_compat.torch_to_flax(contiguous)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, err_msg=name), got, want)
        back = torch_compat.flax_to_torch(got, arch)
        for k, v in contiguous.items():
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), (name, k)


def test_a_mixed_dtype_state_dict_keeps_each_dtype_and_computes_like_torch():
    """float16, bfloat16, float32 and float64 tensors in one state_dict: each kept and round-tripped
    bit for bit; the model computes what torchvision computes after its load_state_dict (which
    casts every tensor into its float32 parameters)."""
    sd = reference("resnet18").state_dict()
    cast = {"layer2": torch.float16, "layer3": torch.bfloat16, "fc": torch.float64}
    mixed = {k: v.to(cast.get(k.split(".")[0], v.dtype)) if v.is_floating_point() else v for k, v in sd.items()}
    variables = torch_compat.torch_to_flax(mixed)
    assert variables["params"]["layer2"]["0"]["conv1"]["kernel"].dtype == np.float16
    assert variables["params"]["layer3"]["0"]["conv1"]["kernel"].dtype.name == "bfloat16"
    assert variables["params"]["fc"]["kernel"].dtype == np.float64
    back = torch_compat.flax_to_torch(variables, "resnet18")
    for k, v in mixed.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    ref = torchvision.models.resnet18(num_classes=10)
    ref.load_state_dict(mixed, strict=True)
    x = torch.randn(2, 3, 40, 40)
    with torch.no_grad():
        expected = ref.eval()(x).numpy()
    got = models.resnet18(num_classes=10).apply(variables, _nhwc(x))
    assert got.dtype == jnp.float32  # x64 is off: float64 weights compute in float32
    _close(got, expected)


def test_a_one_element_counter_ports_as_torch_loads_it():
    """torch's load_state_dict copies a (1,)-shaped num_batches_tracked into the 0-d buffer (its
    backward compatibility with torch 0.3's scalars); the port refused it as "wrong shape"."""
    sd = reference("resnet18").state_dict()
    sd = {k: (v.reshape(1) + 7 if k.endswith("num_batches_tracked") else v) for k, v in sd.items()}
    ref = torchvision.models.resnet18(num_classes=10)
    ref.load_state_dict(sd, strict=True)
    variables = torch_compat.torch_to_flax(sd)
    assert variables["batch_stats"]["bn1"]["num_batches_tracked"].shape == ()
    back = torch_compat.flax_to_torch(variables, "resnet18")
    for k, v in ref.state_dict().items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # a counter of more than one element still does not fit
    bad = {**sd, "bn1.num_batches_tracked": torch.tensor([1, 2])}
    with pytest.raises(ConversionError, match=r"bn1.num_batches_tracked: got \(2,\), expected \(\)"):
        torch_compat.torch_to_flax(bad)


# --- cross_check at odd sizes -----------------------------------------------------------------


def test_cross_check_at_one_image_of_33_px_passes_both_modes():
    """Batch 1 at 33 px leaves layer4 2x2 values per channel: torch trains on it, and so does the
    cross-check (32 px, 1x1, is refused up front: tests/test_crosscheck.py)."""
    reports = torch_compat.cross_check(reference("resnet18").state_dict(), batch_size=1, image_size=33)
    assert [r.mode for r in reports] == ["eval", "train"]
    assert all(r.ok for r in reports), "\n".join(r.table() for r in reports)


def test_train_mode_too_small_to_tell_a_broken_port_is_refused_not_passed():
    """At 1 px and batch 2 every BatchNorm sees 2 values per channel and torch's own float32 is
    ~100% off its float64 result, so the tolerance (10x that) passed anything: a port with
    layer4.1.bn2's scale and bias swapped was reported ok in train mode."""
    from tests.test_crosscheck import _swap

    sd = reference("resnet18").state_dict()
    broken = _swap(torch_compat.torch_to_flax(sd), ("params", ("layer4", "1", "bn2"), "scale"),
                   ("params", ("layer4", "1", "bn2"), "bias"))
    for variables in (None, broken):
        with pytest.raises(ConfigError, match=r"train mode cannot be cross-checked at `batch_size` \(=2\) and "
                                              r"`image_size` \(=1\): torch's own float32 result is .* --mode eval"):
            torch_compat.cross_check(sd, variables, modes=("train",), image_size=1)
    # eval mode at 1 px still compares (and fails the broken port)
    (report,) = torch_compat.cross_check(sd, broken, modes=("eval",), image_size=1)
    assert not report.ok
    # batch 2 at 32 px (2 values per channel in layer4 alone) stays checkable
    (report,) = torch_compat.cross_check(sd, modes=("train",), image_size=32)
    assert report.ok and max(r.noise for r in report.rows) < torch_compat._crosscheck.MAX_TRAIN_NOISE
