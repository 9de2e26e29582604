"""Dilated ResNets (torchvision's `replace_stride_with_dilation`, as DeepLabV3 and FCN build their
backbones) are cross-checked dilated on both sides: `cross_check(...,
replace_stride_with_dilation=...)`, `jaxport verify --dilation` and `jaxport port --verify
--dilation`, which default to the dilated check for a segmentation model's backbone.

Regression: `verify` of a DeepLabV3 backbone PASSed comparing two undilated models, so the model
the user runs (dilated) was never checked. Every comparison here is against torchvision's own
dilated model in the same test (the segmentation model's `backbone` itself where it can be).
Inputs are 40 px: layer4 of a (False, True, True) model is then 5x5 with 3x3 kernels dilated by
4, whose outer taps reach the output (at 32 px, 4x4, they would not). Tolerances are
cross_check's own: 1e-4 of each stage's scale in eval mode, train mode's noise-based bound.
"""
import re

import jax
import numpy as np
import pytest
import torch
import torchvision

import torch_compat
from jaxport import models
from jaxport._cli import build_parser, main
from jaxport._errors import ConfigError
from torch_compat import _crosscheck
from torch_compat._convert import segmentation_dilation
from torch_compat._reference import calibrate
from tests.helpers import reference

SEG = (False, True, True)  # what torchvision's segmentation models build their ResNet with
SIZE = 40


@pytest.fixture(scope="module")
def deeplab(tmp_path_factory):
    """A torchvision DeepLabV3-ResNet50 with a calibrated backbone, saved as its state_dict."""
    torch.manual_seed(0)
    seg = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=2,
                                                             aux_loss=True)
    calibrate(seg.backbone, image_size=SIZE, calibration_batches=2)
    seg.eval()
    path = tmp_path_factory.mktemp("seg") / "deeplab.pth"
    torch.save(seg.state_dict(), path)
    return path, seg


def _inputs(batch_size=2, image_size=SIZE, seed=0):
    """cross_check's own inputs (its seeded generator), to run torchvision on them here too."""
    return torch.randn(batch_size, 3, image_size, image_size, generator=torch.Generator().manual_seed(seed))


def _row(report, stage):
    return next(r for r in report.rows if r.stage == stage)


def test_a_segmentation_backbone_is_checked_dilated_against_torchvisions_own_model(deeplab):
    path, seg = deeplab
    sd = torch_compat.load_state_dict(path, prefix="backbone")
    assert segmentation_dilation(sd) == SEG
    reports = torch_compat.cross_check(sd, replace_stride_with_dilation=SEG, image_size=SIZE)
    assert [r.mode for r in reports] == ["eval", "train"]
    assert all(r.ok for r in reports), "\n".join(r.table() for r in reports)
    # The reference cross_check ran is the segmentation model's own backbone: the same maps
    # (layer3 and layer4 keep layer2's 5x5) and the same values on the same inputs.
    with torch.no_grad():
        out = seg.backbone(_inputs())["out"].permute(0, 2, 3, 1).numpy()
    eval_report = reports[0]
    assert _row(eval_report, "layer4").shape == out.shape == (2, 5, 5, 2048)
    assert _row(eval_report, "layer2").shape == (2, 5, 5, 512)
    assert _row(eval_report, "layer4").scale == pytest.approx(np.abs(out).max(), rel=1e-6)
    assert _row(eval_report, "pooled").scale == pytest.approx(np.abs(out.mean((1, 2))).max(), rel=1e-6)
    assert all(r.replace_stride_with_dilation == SEG for r in reports)
    table = eval_report.table()
    assert "replace_stride_with_dilation=(False, True, True): layer3, layer4 dilated" in table.splitlines()[0]
    assert re.search(r"^  layer4 5x5 +\d", table, re.M) and re.search(r"^  stem 10x10 +\d", table, re.M), table
    # Without the argument the check compares undilated models, which is not this one.
    (plain,) = torch_compat.cross_check(sd, modes=("eval",), image_size=SIZE)
    assert plain.ok and _row(plain, "layer4").shape == (2, 2, 2, 2048), plain.table()
    assert "dilat" not in plain.table() and "2x2" not in plain.table()


@pytest.mark.parametrize("dilation", [(False, False, True), (True, True, True), [0, 1, 1]])
def test_every_dilation_pattern_is_checked_with_the_logits(dilation):
    """A classifier built dilated (torchvision's option on its own): logits compared too."""
    want = models.check_dilation(dilation)
    ref = torch_compat.reference_model("resnet50", num_classes=3, image_size=SIZE, calibration_batches=2,
                                       replace_stride_with_dilation=dilation)
    (report,) = torch_compat.cross_check(ref.state_dict(), modes=("eval",), image_size=SIZE,
                                         replace_stride_with_dilation=dilation)
    assert report.ok and report.replace_stride_with_dilation == want, report.table()
    with torch.no_grad():
        logits = ref(_inputs()).numpy()
    assert _row(report, "logits").scale == pytest.approx(np.abs(logits).max(), rel=1e-6)
    side = models.layer4_side(SIZE, dilation)
    assert _row(report, "layer4").shape == (2, side, side, 2048)


@pytest.mark.parametrize("undilated", ["flax", "torch"])
def test_a_pairing_dilated_on_one_side_only_fails(deeplab, monkeypatch, undilated):
    """Each side really is built with the argument: drop it on one side and the check fails."""
    sd = torch_compat.load_state_dict(deeplab[0], prefix="backbone")
    if undilated == "flax":
        build = models.build
        monkeypatch.setattr(models, "build", lambda arch, **kw: build(arch, **{**kw, "replace_stride_with_dilation": None}))
    else:
        make = _crosscheck._torchvision
        monkeypatch.setattr(_crosscheck, "_torchvision",
                            lambda arch, n, dilate, *rest: make(arch, n, (False,) * 3, *rest))
    shapes = ["(2, 3, 3, 1024)", "(2, 5, 5, 1024)"]
    if undilated == "torch":
        shapes.reverse()
    with pytest.raises(AssertionError, match=re.escape(f"stage layer3: jax shape {shapes[0]} != torch shape {shapes[1]}")):
        torch_compat.cross_check(sd, modes=("eval",), image_size=SIZE, replace_stride_with_dilation=SEG)


def test_a_corrupted_weight_fails_the_dilated_check(deeplab):
    """A change to an outer tap of a layer4 kernel dilated by 4 fails the check at 40 px (5x5 maps,
    where that tap reaches the output), and passes it at 32 px (4x4 maps, where it cannot): the
    case `jaxport verify` warns of, and the reason the default image size is 64."""
    sd = torch_compat.load_state_dict(deeplab[0], prefix="backbone")
    variables = torch_compat.torch_to_flax(sd)
    kernel = np.array(variables["params"]["layer4"]["2"]["conv2"]["kernel"])  # HWIO, dilation 4
    kernel[0, 0] += 0.05 * np.abs(kernel).max()
    variables["params"]["layer4"]["2"]["conv2"]["kernel"] = kernel
    (report,) = torch_compat.cross_check(sd, variables, modes=("eval",), image_size=SIZE,
                                         replace_stride_with_dilation=SEG)
    assert not report.ok and [r.stage for r in report.rows if not r.ok] == ["layer4", "pooled"], report.table()
    (blind,) = torch_compat.cross_check(sd, variables, modes=("eval",), image_size=32,
                                        replace_stride_with_dilation=SEG)
    assert blind.ok, blind.table()
    assert models.layer4_side(32, SEG) == 4 and models.layer4_side(SIZE, SEG) == 5


@pytest.mark.parametrize("value, got", [
    ((True,), "got 1 element(s)"),
    ((), "got 0 element(s)"),
    ((False, True, True, True), "got 4 element(s)"),
    ("FTT", "got str"),
    (("False", True, True), "got the item 'False', not a bool"),  # torchvision would dilate layer2
    ((2, 0, 0), "got the item 2, not a bool"),
])
def test_a_bad_dilation_is_refused_naming_the_argument_the_value_and_the_fix(value, got):
    message = re.escape(f"`replace_stride_with_dilation` (={value!r}) should be None or a 3-element tuple, {got}: "
                        "three bools, for layer2, layer3 and layer4") + ".*e.g. \\(False, True, True\\)"
    with pytest.raises(ConfigError, match=message):
        torch_compat.cross_check(reference("resnet18").state_dict(), replace_stride_with_dilation=value)
    with pytest.raises(ConfigError, match=message):  # the model's own check, the same one
        models.resnet50(replace_stride_with_dilation=value).init(jax.random.key(0), np.zeros((1, 32, 32, 3)))


def test_dilating_basic_blocks_is_refused_as_torchvision_refuses_it():
    with pytest.raises(NotImplementedError, match="Dilation > 1 not supported in BasicBlock"):
        torchvision.models.resnet18(replace_stride_with_dilation=[False, False, True])
    with pytest.raises(ConfigError, match=re.escape("`replace_stride_with_dilation` (=(False, False, True)) dilates "
                                                    "resnet18, whose BasicBlocks torchvision cannot dilate")):
        torch_compat.cross_check(reference("resnet18").state_dict(), replace_stride_with_dilation=(False, False, True))
    # None and no dilation at all are the same check
    (report,) = torch_compat.cross_check(reference("resnet18").state_dict(), modes=("eval",), image_size=SIZE,
                                         replace_stride_with_dilation=(False, False, False))
    assert report.ok and report.replace_stride_with_dilation == (False, False, False), report.table()


@pytest.mark.parametrize("dilation", [None, (True, False, False), (False, True, True), (True, True, True)])
@pytest.mark.parametrize("image_size", [1, 31, 32, 33, 40, 64])
def test_layer4_side_is_torchvisions(dilation, image_size):
    """The side the train-mode refusal and verify's note on unreachable taps are computed from."""
    model = torchvision.models.resnet50(replace_stride_with_dilation=dilation and list(dilation)).eval()
    model.fc = torch.nn.Identity()
    seen = []
    model.layer4.register_forward_hook(lambda _m, _i, o: seen.append(o.shape[-1]))
    with torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size))
    assert models.layer4_side(image_size, dilation) == seen[0]


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("F,T,T", SEG), ("false,true,true", SEG), ("0,1,1", SEG), ("False, TRUE ,1", SEG), ("t,t,t", (True,) * 3),
    ("f,f,f", (False,) * 3), ("auto", "auto"), ("none", "none"), ("None", "none"),
])
@pytest.mark.parametrize("command", [["verify", "x.pth"], ["port", "--verify"]])
def test_dilation_flag_takes_booleans_auto_or_none(command, text, value):
    assert build_parser().parse_args([*command, "--dilation", text]).dilation == value
    assert build_parser().parse_args(command).dilation is None  # auto


@pytest.mark.parametrize("text, got", [
    ("F,T", "got 2 values"), ("F,T,T,T", "got 4 values"), ("", "got 1 value;"), ("F,T,X", "got 'x', not a boolean"),
    ("yes,no,no", "got 'yes', not a boolean"), ("FTT", "got 1 value;"),
])
@pytest.mark.parametrize("command", [["verify", "x.pth"], ["port", "--verify"]])
def test_a_bad_dilation_flag_is_a_one_line_usage_error(capsys, command, text, got):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--dilation", text])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "", captured
    assert captured.err.count("\n") == 1 and "usage:" not in captured.err, captured.err
    assert captured.err.startswith(f"jaxport: error: `--dilation` (={text!r}): expected three booleans for "
                                   "layer2,layer3,layer4 (true/false, t/f or 1/0: torchvision's "
                                   "replace_stride_with_dilation), auto or none; "), captured.err
    assert got in captured.err and "e.g. --dilation F,T,T" in captured.err, captured.err


def test_verify_checks_a_segmentation_backbone_dilated_unless_told_otherwise(deeplab, capsys):
    path = str(deeplab[0])
    common = ["verify", path, "--prefix", "backbone", "--mode", "eval", "--image-size", str(SIZE)]
    assert main(common) == 0
    out = capsys.readouterr().out
    assert "(CLI --dilation F,T,T, which verify and port --verify use by default for such a checkpoint)" in out
    assert ("note: cross-checking them dilated, replace_stride_with_dilation=(False, True, True) on both sides "
            "(--dilation auto; --dilation none checks them undilated)") in out
    assert "resnet50 eval mode (replace_stride_with_dilation=(False, True, True): layer3, layer4 dilated" in out
    assert re.search(r"^  layer4 5x5 ", out, re.M) and out.rstrip().endswith("verify: PASS"), out
    assert "never reach the output" not in out  # 5x5 maps: every tap of the dilated kernels is seen
    # --dilation F,T,T says the same explicitly; none checks the undilated model; F,F,T another.
    assert main(common + ["--dilation", "F,T,T"]) == 0
    out = capsys.readouterr().out
    assert "cross-checking them dilated" not in out and "(replace_stride_with_dilation=(False, True, True)" in out
    assert main(common + ["--dilation", "none"]) == 0
    out = capsys.readouterr().out
    assert "resnet50 eval mode: error relative" in out and "mode (replace_stride_with_dilation" not in out, out
    assert re.search(r"^  layer4 +\d", out, re.M), out
    assert main(common + ["--dilation", "0,0,1"]) == 0
    assert "(replace_stride_with_dilation=(False, False, True): layer4 dilated" in capsys.readouterr().out
    # At 32 px layer4 is 4x4 with kernels dilated by 4: the note names the blind taps.
    assert main(common[:-1] + ["32"]) == 0
    assert ("note: at --image-size 32 layer4's maps are 4x4 and its 3x3 kernels dilated by 4, so the outer taps "
            "of its 3x3 kernels never reach the output") in capsys.readouterr().out


def test_backbone_only_keeps_the_dilation_of_the_segmentation_model(deeplab, capsys):
    """The dilation is detected on the selected weights before --backbone-only copies them
    without the segmentation head that shows it."""
    assert main(["verify", str(deeplab[0]), "--prefix", "backbone", "--backbone-only", "--mode", "eval",
                 "--image-size", str(SIZE)]) == 0
    out = capsys.readouterr().out
    assert "note: cross-checking them dilated, replace_stride_with_dilation=(False, True, True)" in out, out
    assert "resnet50 eval mode (replace_stride_with_dilation=(False, True, True)" in out, out


def test_a_basic_block_backbone_beside_a_conv_head_is_checked_undilated(tmp_path, capsys):
    """torchvision builds no BasicBlock backbone dilated (only ResNet-50/101 segmentation
    models): a ResNet-18 backbone beside a conv head gets neither the note nor the dilation."""
    sd = reference("resnet18").state_dict()
    path = tmp_path / "seg18.pth"
    torch.save({**{f"backbone.{k}": v for k, v in sd.items() if not k.startswith("fc.")},
                "classifier.0.weight": torch.zeros(2, 512, 3, 3)}, path)
    assert segmentation_dilation(torch_compat.load_state_dict(path, prefix="backbone")) is None
    assert main(["verify", str(path), "--prefix", "backbone", "--mode", "eval", "--image-size", str(SIZE)]) == 0
    out = capsys.readouterr().out
    assert "note: the weights" not in out and "dilat" not in out and "verify: PASS" in out, out


def test_train_mode_is_refused_by_the_dilated_layer4_side_only():
    """At 32 px and batch 1 an undilated layer4 is 1x1, one value per channel (torch refuses
    train mode there); dilated (False, True, True) it is 4x4, and the check runs."""
    sd = torch_compat.reference_model("resnet50", num_classes=3, image_size=32, calibration_batches=1,
                                      replace_stride_with_dilation=SEG).state_dict()
    with pytest.raises(ConfigError, match="one value per channel, which torch refuses"):
        torch_compat.cross_check(sd, modes=("train",), batch_size=1, image_size=32)
    (report,) = torch_compat.cross_check(sd, modes=("train",), batch_size=1, image_size=32,
                                         replace_stride_with_dilation=SEG)
    assert report.ok, report.table()


def test_port_verify_checks_dilated_and_dilation_without_verify_is_refused(deeplab, tmp_path, capsys):
    path, out = str(deeplab[0]), tmp_path / "dl.safetensors"
    assert main(["port", path, "--prefix", "backbone", "--out", str(out), "--dilation", "F,T,T"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("jaxport: error: `--dilation` (=F,T,T) changes only the --verify cross-check (dilation "
                            "leaves the weights as they are, so the port is the same): add --verify, or leave it out "
                            "and build the model with jaxport.models.<arch>(replace_stride_with_dilation=...)\n")
    assert captured.out == "" and not out.exists()
    # Without --verify: the note names the flag, and the next command checks them dilated by default.
    assert main(["port", path, "--prefix", "backbone", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--dilation F,T,T" in printed and "cross-checking them dilated" not in printed
    assert f"next: jaxport verify {path} {out} --prefix backbone" in printed
    assert main(["port", path, "--prefix", "backbone", "--out", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "note: cross-checking them dilated, replace_stride_with_dilation=(False, True, True)" in printed
    assert printed.count("(replace_stride_with_dilation=(False, True, True): layer3, layer4 dilated") == 2, printed
    assert re.search(r"^  layer4 8x8 ", printed, re.M) and "verify: PASS" in printed, printed  # 64 px


def test_dilating_a_basic_block_checkpoint_is_one_line(tmp_path, capsys):
    path = tmp_path / "r18.pth"
    torch.save(reference("resnet18").state_dict(), path)
    assert main(["verify", str(path), "--dilation", "F,T,T"]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith("jaxport: error: `replace_stride_with_dilation` (=(False, True, True)) dilates "
                                   "resnet18, whose BasicBlocks torchvision cannot dilate")
    assert captured.err.rstrip().endswith("(CLI --dilation none)")
    # A classifier's checkpoint is no segmentation backbone: auto checks it undilated.
    assert main(["verify", str(path), "--mode", "eval", "--image-size", str(SIZE)]) == 0
    printed = capsys.readouterr().out
    assert "dilat" not in printed and "verify: PASS" in printed, printed
