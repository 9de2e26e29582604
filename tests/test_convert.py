"""torch_to_flax / flax_to_torch against torchvision, for every architecture."""
import copy
import re
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import torchvision

import torch_compat
from jaxport import models
from jaxport._errors import ConversionError
from tests.helpers import ALL_ARCHS, reference

# Per-stage tolerances relative to each stage's scale (max |torch value|), float32.
EVAL_RTOL = 1e-4  # the bar for eval-mode logits, applied to every stage
# Train-mode BN normalises by the std of few values (layer4: 8 per channel at batch 2, 64 px),
# amplifying float32 rounding through depth; torch f32 vs torch f64 alone differ by ~5e-5 on
# ResNet-50 and ~1e-3 on ResNet-152. test_train_mode_is_exact_in_float64 proves the
# semantics exactly; here each stage must be within max(1e-3, 10x torch's own f32 error).
TRAIN_RTOL = 1e-3


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_port_matches_torchvision_per_stage(arch, mode):
    ref = reference(arch)
    (report,) = torch_compat.cross_check(ref.state_dict(), modes=(mode,), batch_size=2, image_size=64)
    assert report.mode == mode and report.arch == arch
    stages = {r.stage: r for r in report.rows}
    assert list(stages)[:7] == ["stem", "layer1", "layer2", "layer3", "layer4", "pooled", "logits"]
    for row in report.rows:
        assert row.scale > 0, row
        if mode == "eval":
            assert row.max_rel <= EVAL_RTOL, report.table()
        else:
            # within 10x torch's own float32 error (measured here against torch float64), and
            # never looser than torch's own error allows: the noise must be small itself.
            assert row.max_rel <= max(TRAIN_RTOL, 10 * row.noise), report.table()
            assert row.noise < 1e-2, report.table()
    if mode == "train":
        assert {"running_mean", "running_var", "num_batches_tracked"} <= set(stages)
        assert stages["num_batches_tracked"].max_abs == 0


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_round_trip_is_bit_exact_and_loads_strict(arch):
    sd = reference(arch).state_dict()
    assert torch_compat.detect_arch(sd) == arch
    variables = torch_compat.torch_to_flax(sd)
    back = torch_compat.flax_to_torch(variables, arch)
    assert list(back) == list(sd)
    for k, t in sd.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    model = getattr(torchvision.models, arch)(num_classes=10)
    model.load_state_dict(back, strict=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_and_double_checkpoints_keep_their_dtype(dtype):
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in reference("resnet18").state_dict().items()}
    variables = torch_compat.torch_to_flax(sd)
    kernel = variables["params"]["layer1"]["0"]["conv1"]["kernel"]
    expected = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16, torch.float64: np.float64}[dtype]
    assert kernel.dtype == expected
    assert variables["batch_stats"]["bn1"]["var"].dtype == expected
    if dtype != torch.float64:  # jax reads ml_dtypes.bfloat16 natively (float64 needs x64)
        assert jnp.asarray(kernel).dtype == jnp.dtype(expected)
    back = torch_compat.flax_to_torch(variables, "resnet18")
    for k, t in sd.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def test_half_precision_port_computes_like_torch_upcast():
    """A bf16 checkpoint ported and run in float32 equals torch running the upcast weights."""
    sd16 = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in reference("resnet18").state_dict().items()}
    (report,) = torch_compat.cross_check(sd16, modes=("eval",))
    assert report.ok, report.table()


def test_num_classes_taken_from_the_head():
    ref = torchvision.models.resnet34(num_classes=37)
    variables = torch_compat.torch_to_flax(ref.state_dict())
    assert variables["params"]["fc"]["kernel"].shape == (512, 37)
    assert torch_compat.num_classes_of(ref.state_dict()) == 37


def test_missing_num_batches_tracked_defaults_to_zero():
    sd = {k: v for k, v in reference("resnet18").state_dict().items() if not k.endswith("num_batches_tracked")}
    variables = torch_compat.torch_to_flax(sd)
    assert int(variables["batch_stats"]["bn1"]["num_batches_tracked"]) == 0
    back = torch_compat.flax_to_torch(variables, "resnet18")
    assert back["bn1.num_batches_tracked"].dtype == torch.int64


def test_wrong_architecture_names_what_the_weights_look_like():
    sd = reference("resnet18").state_dict()
    with pytest.raises(ConversionError) as e:
        torch_compat.torch_to_flax(sd, "resnet50")
    msg = str(e.value)
    assert "look like resnet18, not resnet50" in msg
    assert "missing" in msg and "wrong shape" in msg  # resnet18's keys are a subset of resnet50's
    assert "layer1.0.conv3.weight" in msg  # a missing key is named
    with pytest.raises(ConversionError, match="look like resnet50, not resnet18.*unexpected"):
        torch_compat.torch_to_flax(reference("resnet50").state_dict(), "resnet18")


def test_every_problem_is_reported_at_once():
    sd = dict(reference("resnet18").state_dict())
    sd.pop("layer2.0.bn1.running_var")
    sd["layer3.1.conv2.weight"] = torch.zeros(256, 256, 1, 1)
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(ConversionError) as e:
        torch_compat.torch_to_flax(sd, "resnet18")
    msg = str(e.value)
    assert "1 missing: layer2.0.bn1.running_var" in msg
    assert "1 unexpected: extra.weight" in msg
    assert "1 wrong shape: layer3.1.conv2.weight: got (256, 256, 1, 1), expected (256, 256, 3, 3)" in msg


@pytest.mark.parametrize("classes", [1000, 10])
def test_a_transposed_classifier_is_named_as_such_both_ways(classes):
    """fc.weight saved (512, 1000): the classes were read from its first axis, so the error claimed
    a 512-class head ("expected (512, 512)"; fc.bias "expected (512,)") and suggested
    --backbone-only, which drops the head. The bias tells the classes."""
    sd = dict(reference("resnet18", num_classes=classes).state_dict())
    sd["fc.weight"] = sd["fc.weight"].T
    assert torch_compat.num_classes_of(sd) == classes
    with pytest.raises(ConversionError) as e:
        torch_compat.torch_to_flax(sd, "resnet18")
    assert str(e.value).endswith(f"1 wrong shape: fc.weight: got (512, {classes}), expected ({classes}, 512). "
                                 "fc.weight is the transpose of what fits (torch's Linear weight is (out, in), Flax's "
                                 "Dense kernel (in, out)): transpose it (`.T`) and convert again"), e.value

    variables = torch_compat.torch_to_flax(reference("resnet18", num_classes=classes).state_dict(), "resnet18")
    variables["params"]["fc"]["kernel"] = variables["params"]["fc"]["kernel"].T
    with pytest.raises(ConversionError, match=rf"params/fc/kernel: got \({classes}, 512\), expected \(512, {classes}\)\. "
                                              r"params/fc/kernel is the transpose of what fits"):
        torch_compat.flax_to_torch(variables, "resnet18")


def test_arrays_instead_of_tensors_are_one_clear_error():
    """e.g. `safetensors.numpy.load_file(...)`: was an AttributeError ('numel') from deep inside."""
    sd = {k: v.numpy() for k, v in reference("resnet18").state_dict().items()}
    for call in (torch_compat.torch_to_flax, lambda s: torch_compat.cross_check(s, modes=("eval",))):
        with pytest.raises(ConversionError, match=r"state_dict\['conv1.weight'\] is numpy.ndarray, not a torch.Tensor "
                                                  r"\(122 such values\).*torch.from_numpy"):
            call(sd)


def test_meta_tensors_are_refused_before_any_copy():
    with torch.device("meta"):
        sd = torchvision.models.resnet18().state_dict()
    variables = torch_compat.torch_to_flax(reference("resnet18", num_classes=1000).state_dict())
    # cross_check with a port given never converts; torchvision's load_state_dict then failed on them
    for call in (torch_compat.torch_to_flax, lambda s: torch_compat.cross_check(s, variables, modes=("eval",))):
        with pytest.raises(ConversionError, match=r"122 tensors of the state_dict \(conv1.weight, bn1.weight, "
                                                  r"bn1.bias, ...\) are meta tensors"):
            call(sd)


def test_detect_arch_errors():
    with pytest.raises(ConversionError, match="does not look like a torchvision ResNet"):
        torch_compat.detect_arch(torchvision.models.vgg11().state_dict())
    from torchvision.models.resnet import BasicBlock, ResNet

    odd = ResNet(BasicBlock, [1, 1, 1, 1]).state_dict()
    with pytest.raises(ConversionError, match=r"layers=\[1, 1, 1, 1\].*none of torchvision's named"):
        torch_compat.detect_arch(odd)


def test_flax_to_torch_strict():
    variables = torch_compat.torch_to_flax(reference("resnet18").state_dict())
    broken = copy.deepcopy(variables)
    del broken["params"]["layer1"]["0"]["bn1"]["scale"]
    broken["params"]["layer1"]["0"]["conv1"]["kernel"] = np.zeros((3, 3, 64, 32), np.float32)
    with pytest.raises(ConversionError) as e:
        torch_compat.flax_to_torch(broken, "resnet18")
    assert "params/layer1/0/bn1/scale" in str(e.value)
    assert "params/layer1/0/conv1/kernel: got (3, 3, 64, 32), expected (3, 3, 64, 64)" in str(e.value)
    with pytest.raises(ConversionError, match="not a known architecture.*; did you mean 'resnet18'\\?$"):
        torch_compat.flax_to_torch(variables, "resnet19")
    # the variables side names what they look like too (`jaxport export --arch` given wrong)
    with pytest.raises(ConversionError, match=r"look like resnet18, not resnet50 \(pass arch='resnet18'"):
        torch_compat.flax_to_torch(variables, "resnet50")
    rx = torch_compat.torch_to_flax(torchvision.models.resnext50_32x4d(num_classes=3).state_dict())
    with pytest.raises(ConversionError, match="look like resnext50_32x4d, not wide_resnet50_2"):
        torch_compat.flax_to_torch(rx, "wide_resnet50_2")


def test_flax_trained_variables_export_to_torchvision():
    """Variables produced by the Flax model itself (jax arrays, int32 counter) export cleanly."""
    model = models.resnet18(num_classes=4)
    # Jitted: run eagerly, init and the two applies compiled op by op for ~15 s.
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    train = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))
    _, updated = train(variables, jnp.ones((2, 32, 32, 3)))
    variables = {"params": variables["params"], **updated}
    sd = torch_compat.flax_to_torch(variables, "resnet18")
    assert sd["bn1.num_batches_tracked"].item() == 1
    tv = torchvision.models.resnet18(num_classes=4)
    tv.load_state_dict(sd, strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = tv.eval()(x).numpy()
    got = jax.jit(model.apply)(variables, jnp.asarray(x.permute(0, 2, 3, 1).numpy()))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flax_to_torch_copies_read_only_and_strided_arrays_bit_for_bit(dtype):
    """`flax_to_torch` copies every array into a new tensor: read-only inputs (a jax array's
    buffer) and kernels stored with other strides go through each of its copies (the blocked
    3x3 transposes, torch's 2-D transposes, plain copies) bit for bit and without a warning."""
    sd = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in reference("resnet18").state_dict().items()}
    variables = torch_compat.torch_to_flax(sd)
    fortran = jax.tree.map(lambda a: np.asfortranarray(a) if a.ndim > 1 else a, variables)
    for given in (jax.tree.map(jnp.asarray, variables), fortran):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            back = torch_compat.flax_to_torch(given, "resnet18")
        for k, t in sd.items():
            assert back[k].dtype == t.dtype and back[k].is_contiguous() and torch.equal(back[k], t), k


def _quantized(t):
    with warnings.catch_warnings():  # torch 2.14 deprecates its quantized dtypes
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(t, 0.1, 0, torch.qint8)


@pytest.mark.parametrize("make, shown, fix", [
    (lambda t: t.to(torch.int64), "torch.int64", "tensor.float()"),
    (lambda t: t.to(torch.complex64), "torch.complex64", "tensor.float()"),
    (lambda t: t.to(torch.float8_e4m3fn), "torch.float8_e4m3fn", "tensor.float()"),
    (_quantized, "torch.qint8", "tensor.dequantize()"),
    (lambda t: t.to_sparse(), "torch.float32 (torch.sparse_coo)", "tensor.to_dense()"),
])
def test_weights_a_resnet_cannot_compute_with_are_refused_by_key(make, shown, fix):
    """Quantized, sparse and float8 tensors failed deep in the copy (an internal error); integer
    and complex weights converted silently and computed nonsense."""
    sd = dict(reference("resnet18").state_dict())
    sd["fc.weight"] = make(sd["fc.weight"])
    for call in (torch_compat.torch_to_flax, lambda s: torch_compat.cross_check(s, modes=("eval",))):
        with pytest.raises(ConversionError) as e:
            call(sd)
        assert f"state_dict['fc.weight'] is {shown}, expected float16, bfloat16, float32 or float64" in str(e.value)
        assert fix in str(e.value)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=str)
def test_a_nested_tensor_is_refused_by_key(layout):
    """A nested tensor has no shape: torch's "Internal error: NestedTensorImpl doesn't support
    sizes" reached the CLI as an internal error."""
    sd = dict(reference("resnet18").state_dict())
    with warnings.catch_warnings():  # torch calls its nested tensors a prototype
        warnings.simplefilter("ignore")
        sd["fc.bias"] = torch.nested.nested_tensor([torch.randn(3), torch.randn(4)], layout=layout)
    for arch in (None, "resnet18"):
        with pytest.raises(ConversionError, match=r"state_dict\['fc.bias'\] is a nested tensor \(torch.nested"):
            torch_compat.torch_to_flax(sd, arch)


def test_a_batch_counter_beyond_int32_is_refused_not_wrapped():
    """It becomes int32 (jax's default integer): 2**31 + 5 came back as -2**31 + 5."""
    sd = dict(reference("resnet18").state_dict())
    sd["bn1.num_batches_tracked"] = torch.tensor(2**31 + 5)
    with pytest.raises(ConversionError, match=r"'bn1.num_batches_tracked'\] is 2147483653, which does not fit int32"):
        torch_compat.torch_to_flax(sd)
    sd["bn1.num_batches_tracked"] = torch.tensor(2**31 - 1)  # the largest that fits comes back exact
    back = torch_compat.flax_to_torch(torch_compat.torch_to_flax(sd), "resnet18")
    assert back["bn1.num_batches_tracked"].item() == 2**31 - 1


@pytest.mark.parametrize("given, fix", [
    ("resnet18.pth", "torch_compat.load_state_dict(path)"),
    (torchvision.models.resnet18(), "model.state_dict()"),
    ([1, 2], "pass a dict of torch tensors"),
    (None, "pass a dict of torch tensors"),
])
def test_something_else_than_a_state_dict_is_named(given, fix):
    """A path, a module or a list was iterated as if it were a dict ('found .*, /, A, ...' or a
    bare TypeError)."""
    for call in (torch_compat.torch_to_flax, torch_compat.detect_arch):
        with pytest.raises(ConversionError, match="`state_dict` is .*not a mapping of names to tensors") as e:
            call(given)
        assert fix in str(e.value)
    with pytest.raises(ConversionError, match="`variables` is builtins.list, not Flax variables"):
        torch_compat.flax_to_torch([1], "resnet18")


def test_flax_variables_of_another_dtype_are_refused_by_key():
    variables = torch_compat.torch_to_flax(reference("resnet18").state_dict())
    variables["params"]["fc"]["kernel"] = variables["params"]["fc"]["kernel"].astype(np.int64)
    with pytest.raises(ConversionError, match="the Flax variable 'params/fc/kernel' is int64, expected float16"):
        torch_compat.flax_to_torch(variables, "resnet18")


# --- regressions from the adversarial probe ------------------------------------------------

def test_extra_keys_beside_a_fitting_head_are_reported_not_cut_with_the_head():
    """Extra keys beside torchvision's `fc` got the --backbone-only hint, which drops `fc` too."""
    ref = torchvision.models.resnet18(num_classes=10)
    sd = dict(ref.state_dict())
    sd.update({f"projector.{k}": v for k, v in torch.nn.Linear(512, 8).state_dict().items()})
    with pytest.raises(ConversionError) as e:
        torch_compat.torch_to_flax(sd)
    msg = str(e.value)
    assert "2 unexpected: projector.weight; projector.bias" in msg
    assert "The backbone and the classifier fc fit" in msg and "remove them from the state_dict" in msg
    assert "startswith(('projector.',))" in msg
    assert "backbone_state_dict" not in msg  # the way out that would lose the classifier
    # The suggested removal is the fix: the result ports the classifier with it.
    kept = {k: v for k, v in sd.items() if not k.startswith(("projector.",))}
    assert torch_compat.torch_to_flax(kept)["params"]["fc"]["kernel"].shape == (512, 10)

    teacher = {**ref.state_dict(), **{f"teacher.{k}": v for k, v in ref.state_dict().items()}}
    with pytest.raises(ConversionError, match=r"another ResNet under 'teacher.'.*--prefix teacher\."):
        torch_compat.torch_to_flax(teacher)

    # No fc, another head beside the backbone: the backbone alone is the way out.
    headless = {k: v for k, v in sd.items() if not k.startswith("fc.")}
    with pytest.raises(ConversionError, match=r"backbone_state_dict \(CLI --backbone-only\)"):
        torch_compat.torch_to_flax(headless)


FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("source", FLOATS, ids=str)
@pytest.mark.parametrize("target", ["float32", np.float16, jnp.bfloat16, torch.float32, "float64"], ids=str)
def test_dtype_casts_every_floating_tensor_like_torch(source, target):
    """`torch_to_flax(sd, dtype=...)` equals torch's own `tensor.to(dtype)`, bit for bit."""
    sd = {k: (v.to(source) if v.is_floating_point() else v) for k, v in reference("resnet18").state_dict().items()}
    want_torch = torch_compat._convert._torch_dtype(target)
    variables = torch_compat.torch_to_flax(sd, dtype=target)
    back = torch_compat.flax_to_torch(variables, "resnet18")
    for k, t in sd.items():
        expected = t.to(want_torch) if t.is_floating_point() else t
        assert back[k].dtype == expected.dtype and torch.equal(back[k], expected), k
    assert variables["params"]["conv1"]["kernel"].dtype == np.dtype(str(want_torch).removeprefix("torch."))
    assert np.asarray(variables["batch_stats"]["bn1"]["num_batches_tracked"]).dtype == np.int32


def test_a_cast_port_cross_checks_against_torchs_cast():
    sd = reference("resnet18").state_dict()
    variables = torch_compat.torch_to_flax(sd, dtype="bfloat16")
    (report,) = torch_compat.cross_check(torch_compat.cast_floating(sd, "bfloat16"), variables,
                                         modes=("eval",))
    assert report.ok, report.table()
    # the float32 original is not what the port holds: bfloat16 rounding is far beyond 1e-4
    (report,) = torch_compat.cross_check(sd, variables, modes=("eval",))
    assert not report.ok


def test_a_bad_dtype_or_a_float16_overflow_is_named():
    sd = dict(reference("resnet18").state_dict())
    for bad in ("int8", "float8", torch.int64):
        with pytest.raises(ConversionError, match=r"`dtype` \(=.*\) must be None \(keep each tensor's dtype\)"):
            torch_compat.torch_to_flax(sd, dtype=bad)
    sd["bn1.running_var"] = sd["bn1.running_var"].clone()
    sd["bn1.running_var"][0] = 1e6
    with pytest.raises(ConversionError, match=r"state_dict\['bn1.running_var'\] holds 1e\+06, beyond float16's range"):
        torch_compat.torch_to_flax(sd, dtype="float16")
    assert torch_compat.torch_to_flax(sd, dtype="bfloat16")["batch_stats"]["bn1"]["var"][0] > 9e5
    wide = {k: (v.double() if v.is_floating_point() else v) for k, v in sd.items()}
    wide["fc.bias"][0] = 1e300  # torch's .to(float32) makes it inf without a word
    with pytest.raises(ConversionError, match=r"'fc.bias'\] holds 1e\+300, beyond float32's range"):
        torch_compat.torch_to_flax(wide, dtype=np.float32)


def test_the_overflow_advice_fits_the_cast():
    """It suggested bfloat16 ("keeps float32's range") when bfloat16 was the target, or when the
    value was float64 beyond float32's range; a Parameter's cast warned about requires_grad."""
    sd = dict(reference("resnet18").state_dict(keep_vars=True))
    sd["fc.bias"] = torch.nn.Parameter(sd["fc.bias"].detach().clone())
    with torch.no_grad():
        sd["fc.bias"][0] = 1e6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConversionError) as e:
            torch_compat.torch_to_flax(sd, dtype="float16")
    assert "holds 1e+06, beyond float16's range" in str(e.value)
    assert "cast to bfloat16 instead (it keeps float32's range), or keep the dtype (float32" in str(e.value)
    wide = {k: (v.detach().double() if v.is_floating_point() else v) for k, v in sd.items()}
    wide["fc.bias"][0] = 1e39
    for target in ("float16", "bfloat16", "float32"):
        with pytest.raises(ConversionError) as e:
            torch_compat.torch_to_flax(wide, dtype=target)
        assert f"holds 1e+39, beyond {target}'s range" in str(e.value)
        assert "bfloat16 instead" not in str(e.value)
        assert str(e.value).endswith("keep the dtype (float64: `dtype=None`, CLI --dtype keep)")


def test_ambiguous_or_odd_dtypes_are_refused_by_name():
    """`dtype="float"` meant float64 (numpy), where torch users read float32; a dict raised numpy's
    ValueError. "double" and "half" mean the same width to both, as torch.double and torch.half."""
    sd = reference("resnet18").state_dict()
    for ambiguous in ("float", float, "Float"):
        with pytest.raises(ConversionError) as e:
            torch_compat.torch_to_flax(sd, dtype=ambiguous)
        assert f"`dtype` (={ambiguous!r}) is ambiguous" in str(e.value)
        assert "'float32'" in str(e.value) and "'float64'" in str(e.value) and "None keeps the dtypes" in str(e.value)
    for odd in ({"names": ["a"]}, "i4,i4", [("a", "f4")], "keep"):
        with pytest.raises(ConversionError) as e:
            torch_compat.torch_to_flax(sd, dtype=odd)
        assert "must be None (keep each tensor's dtype) or a floating dtype" in str(e.value)
        assert "None keeps the dtypes" in str(e.value)
    half = torch_compat.torch_to_flax(sd, dtype="half")
    assert half["params"]["fc"]["kernel"].dtype == np.float16
    double = torch_compat.torch_to_flax(sd, dtype="double")
    assert double["params"]["fc"]["kernel"].dtype == np.float64
    np.testing.assert_array_equal(double["params"]["fc"]["bias"], sd["fc.bias"].double().numpy())


@pytest.mark.parametrize("float8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("target", ["float32", "float16", "bfloat16"])
def test_float8_weights_port_with_an_explicit_dtype(float8, target):
    """`--dtype float32` on a float8 checkpoint was refused with "cast the weights to float32 first"."""
    sd = {k: (v.to(float8) if v.is_floating_point() else v) for k, v in reference("resnet18").state_dict().items()}
    back = torch_compat.flax_to_torch(torch_compat.torch_to_flax(sd, dtype=target), "resnet18")
    for k, t in sd.items():
        expected = t.to(getattr(torch, target)) if t.is_floating_point() else t
        assert back[k].dtype == expected.dtype and torch.equal(back[k], expected), k
    with pytest.raises(ConversionError) as e:
        torch_compat.torch_to_flax(sd)
    assert f"is {float8}, expected float16, bfloat16, float32 or float64" in str(e.value)
    assert "dtype='float32' (CLI --dtype float32)" in str(e.value)


def test_every_group_of_extra_keys_is_named_for_removal():
    """With two nested ResNets, or a ResNet and a projector, only the first group was named."""
    ref = reference("resnet18")
    sd = ref.state_dict()
    proj = {f"proj.{k}": v for k, v in torch.nn.Linear(512, 8).state_dict().items()}
    cases = {
        ("ema.", "teacher."): {**sd, **{f"teacher.{k}": v for k, v in sd.items()},
                               **{f"ema.{k}": v for k, v in sd.items()}},
        ("teacher.", "proj."): {**sd, **{f"teacher.{k}": v for k, v in sd.items()}, **proj},
        ("head.", "proj."): {**sd, **proj, "head.weight": torch.zeros(3)},
    }
    for groups, extra in cases.items():
        with pytest.raises(ConversionError) as e:
            torch_compat.torch_to_flax(extra)
        msg = str(e.value)
        assert f"if not k.startswith({groups!r})" in msg, msg[-400:]
        # The suggested removal is the fix.
        kept = {k: v for k, v in extra.items() if not k.startswith(groups)}
        assert torch_compat.torch_to_flax(kept)["params"]["fc"]["kernel"].shape == (512, 10)
    assert "other ResNets under 'ema.', 'teacher.'" in str(pytest.raises(
        ConversionError, torch_compat.torch_to_flax, cases["ema.", "teacher."]).value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_float_counter_is_not_cast_by_dtype(dtype):
    """A counter saved as float32 is an integer in a float: cast with the weights, 123457 became
    bfloat16's 123392 and float16's inf (refused as an overflow). torch's load_state_dict copies it
    into its int64 buffer as 123457, and so must the port."""
    sd = dict(reference("resnet18").state_dict())
    sd["bn1.num_batches_tracked"] = torch.tensor(123457.0)
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(sd, strict=True)
    want = model.bn1.num_batches_tracked
    assert want.dtype == torch.int64 and want.item() == 123457
    variables = torch_compat.torch_to_flax(sd, dtype=dtype)
    counter = variables["batch_stats"]["bn1"]["num_batches_tracked"]
    assert np.issubdtype(counter.dtype, np.integer) and int(counter) == want.item()
    cast = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    assert variables["batch_stats"]["bn1"]["mean"].dtype == cast  # the weights were cast
    back = torch_compat.flax_to_torch(variables, "resnet18")["bn1.num_batches_tracked"]
    assert back.dtype == torch.int64 and torch.equal(back, want)


def test_variables_without_counters_export_as_torchvision_state_dict():
    """Variables may omit num_batches_tracked (the converter and `jaxport export` accept that):
    the state_dict must still have torchvision's keys in its order, each counter torch's int64 0."""
    variables = torch_compat.torch_to_flax(reference("resnet18").state_dict())
    stack = [variables["batch_stats"]]
    while stack:
        node = stack.pop()
        node.pop("num_batches_tracked", None)
        stack += [v for v in node.values() if isinstance(v, dict)]
    assert "num_batches_tracked" not in str(jax.tree_util.tree_structure(variables))
    sd = torch_compat.flax_to_torch(variables, "resnet18")
    model = torchvision.models.resnet18(num_classes=10)
    assert list(sd) == list(model.state_dict())
    model.load_state_dict(sd, strict=True)
    counters = {k: v for k, v in sd.items() if k.endswith("num_batches_tracked")}
    assert len(counters) == 20
    for k, v in counters.items():
        assert v.dtype == torch.int64 and v.shape == () and v.item() == 0, (k, v)


def test_lazily_negated_tensors_convert_and_arch_can_be_left_to_detection():
    """A tensor with torch's negative bit (`torch._neg_view`, what some graph rewrites leave)
    failed with torch's "Can't call numpy() on Tensor that has negative bit set", and
    `flax_to_torch(variables, None)` said "`arch` (=None) is not a known architecture"."""
    state_dict = reference("resnet18").state_dict()
    lazy = dict(state_dict)
    for key in ("conv1.weight", "layer1.0.conv1.weight", "layer4.0.conv2.weight", "fc.weight", "bn1.running_mean"):
        lazy[key] = torch._neg_view(-state_dict[key])
        assert lazy[key].is_neg()
    want, got = torch_compat.torch_to_flax(state_dict), torch_compat.torch_to_flax(lazy)
    flat_want, flat_got = jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(got)
    assert [p for p, _ in flat_want] == [p for p, _ in flat_got]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(flat_want, flat_got))
    back = torch_compat.flax_to_torch(want)  # the architecture detected from the kernels
    torchvision.models.resnet18(num_classes=len(back["fc.bias"])).load_state_dict(back, strict=True)
    assert all(torch.equal(back[k], v) for k, v in state_dict.items())
    with pytest.raises(ConversionError, match=r"`arch` is None and the variables' kernels look like no torchvision "
                                              r"ResNet; pass arch="):
        torch_compat.flax_to_torch({"params": {"a": np.ones(3)}})


def _huge_page_advised(start: int, nbytes: int) -> bool | None:
    """Whether the middle of `nbytes` bytes from address `start` lies in a mapping advised to use
    transparent huge pages (`hg` among its VmFlags in /proc/self/smaps); None where that cannot
    be read. (numpy advises from the first page boundary on: the first page is not advised.)"""
    address = start + nbytes // 2
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return None


def test_big_tensors_are_copied_into_memory_without_huge_page_advice():
    """numpy advises transparent huge pages for every array of 4 MiB or more; where the kernel's
    THP defrag setting is `madvise` (its default) the first write to such memory can wait while
    the kernel compacts memory. A one-shot port writes only fresh memory: in a new process
    `torch_to_flax` of wide_resnet101_2 took 2.2 s (0.3 s with numpy's advice off) and
    `flax_to_torch` 5.2 s (0.4 s), on a 2-core Xeon VM. Both now copy into torch's allocations.
    The tensors checked are over 32 MiB, so that glibc maps each afresh: a heap region numpy
    advised earlier in this process cannot be reused for them."""
    size = (1024 * 1024 * 9) * 4  # wide_resnet50_2's layer4 3x3 kernels: 36 MiB
    probe = np.empty(size, np.uint8)
    if _huge_page_advised(probe.ctypes.data, probe.nbytes) is not True:
        pytest.skip("numpy's huge-page advice is off here (not Linux, or NUMPY_MADVISE_HUGEPAGE=0)")
    del probe
    with torch.device("meta"):
        shapes = torchvision.models.wide_resnet50_2(num_classes=17_000).state_dict()  # fc: 33 MiB
    generator = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(v.shape, generator=generator) if v.is_floating_point() else torch.zeros((), dtype=v.dtype))
          for k, v in shapes.items()}
    variables = torch_compat.torch_to_flax(sd)
    back = torch_compat.flax_to_torch(variables, "wide_resnet50_2")
    for key, flax in [("layer4.0.conv2.weight", variables["params"]["layer4"]["0"]["conv2"]["kernel"]),
                      ("fc.weight", variables["params"]["fc"]["kernel"])]:
        assert sd[key].nbytes > 32 << 20
        assert _huge_page_advised(flax.ctypes.data, flax.nbytes) is False, f"torch_to_flax: {key}"
        assert _huge_page_advised(back[key].data_ptr(), back[key].nbytes) is False, f"flax_to_torch: {key}"
        assert torch.equal(back[key], sd[key]), key
