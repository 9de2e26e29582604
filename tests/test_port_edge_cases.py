"""Checkpoints saved in less common ways, and the CLI's answers to them."""
import collections
import functools
import os
import re
import warnings

import numpy as np
import pytest
import torch
import torchvision

import torch_compat
from jaxport._cli import main
from jaxport._errors import CheckpointError, ConversionError
from torch_compat import load_state_dict


@functools.lru_cache(maxsize=1)
def _resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _assert_same_weights(got, want):
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("checkpoint, ema", [
    # A settings dict under another candidate key holds no weights: it is no rival to the real ones.
    (lambda sd: {"state_dict": sd, "model": {"arch": "resnet18", "num_classes": 10}, "epoch": 3}, False),
    (lambda sd: {"model_ema": sd, "ema": {"decay": 0.9999, "enabled": True}}, True),
], ids=["config_under_model", "config_under_ema"])
def test_a_settings_dict_under_a_candidate_key_is_not_ambiguous(tmp_path, checkpoint, ema):
    """`{"state_dict": sd, "model": {"arch": ...}}` was refused as 'several candidate state dicts'
    although only one of them holds tensors; torch users load checkpoint["state_dict"]."""
    sd = _resnet18().state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save(checkpoint(sd), path)
    _assert_same_weights(load_state_dict(path, ema=ema), sd)


def test_two_candidate_state_dicts_are_still_ambiguous(tmp_path):
    sd = _resnet18().state_dict()
    torch.save({"state_dict": sd, "model": sd}, tmp_path / "two.pt")
    with pytest.raises(CheckpointError, match="several candidate state dicts"):
        load_state_dict(tmp_path / "two.pt")


def test_a_prefix_that_selects_an_averaged_model_gives_its_weights(tmp_path, capsys):
    """A LightningModule with `self.model_ema = AveragedModel(self.model)`: its state_dict holds
    `model_ema.module.*` and `model_ema.n_averaged`. --prefix model_ema. kept `n_averaged` and the
    `module.` prefix (the error then suggested --prefix module., which selects nothing)."""
    model = _resnet18()
    averaged = torch.optim.swa_utils.AveragedModel(model)
    lightning = collections.OrderedDict(
        [(f"model.{k}", v) for k, v in model.state_dict().items()]
        + [(f"model_ema.{k}", v) for k, v in averaged.state_dict().items()])
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": lightning, "epoch": 1, "hyper_parameters": {"lr": 0.1}}, path)
    want = averaged.module.state_dict()
    _assert_same_weights(load_state_dict(path, prefix="model_ema."), want)
    _assert_same_weights(load_state_dict(path, prefix="model_ema.module."), want)
    _assert_same_weights(load_state_dict(path, prefix="model."), model.state_dict())
    out = tmp_path / "ema.safetensors"
    assert main(["port", str(path), "--prefix", "model_ema.", "--out", str(out)]) == 0
    assert out.exists()
    capsys.readouterr()


def test_port_of_the_current_directory_says_it_is_a_directory(tmp_path, monkeypatch, capsys):
    """`jaxport port .` answered '`--out` (=variables.safetensors) is part of the checkpoint being
    read' (an --out the user never gave, taking `.` for a training workdir)."""
    monkeypatch.chdir(tmp_path)
    torch.save(_resnet18().state_dict(), "r18.pt")
    for checkpoint in (".", "./"):
        assert main(["port", checkpoint]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "is a directory (it contains r18.pt); pass the path of a checkpoint file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r18.pt"]  # nothing written


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_checkpoint_cast_whole_ports_its_counters_as_torch_loads_them(tmp_path, dtype, capsys):
    """`{k: v.half() for k, v in sd.items()}` casts the num_batches_tracked counters too. torchvision
    loads that (strict=True copies them into its int64 buffers); jaxport refused it as 'expected an
    integer counter'. The counters port as the integers torch loads, and are never cast by --dtype."""
    counted = {k: v.clone() for k, v in _resnet18().state_dict().items()}
    for i, (k, v) in enumerate(counted.items()):
        if k.endswith("num_batches_tracked"):
            v.fill_(1000 + i)  # 1005 is no bfloat16: torch loads the rounded 1004, and so must the port
    sd = {k: v.to(dtype) for k, v in counted.items()}
    torch_model = torchvision.models.resnet18(num_classes=10)
    torch_model.load_state_dict(sd, strict=True)
    back = torch_compat.flax_to_torch(torch_compat.torch_to_flax(sd), "resnet18")
    _assert_same_weights(back, {k: v.to(dtype) if v.is_floating_point() else v
                                for k, v in torch_model.state_dict().items()})
    cast = torch_compat.torch_to_flax(sd, dtype="float32")
    assert cast["batch_stats"]["layer1"]["0"]["bn1"]["num_batches_tracked"].dtype == np.int32
    path = tmp_path / "whole_cast.pt"
    torch.save(sd, path)
    assert main(["verify", str(path), "--mode", "eval", "--image-size", "32"]) == 0
    capsys.readouterr()


def test_a_fractional_or_non_finite_counter_is_still_refused():
    sd = dict(_resnet18().state_dict())
    for bad in (2.5, float("nan"), float("inf")):
        sd["bn1.num_batches_tracked"] = torch.tensor(bad)
        with pytest.raises(ConversionError, match=r"'bn1.num_batches_tracked'\] is torch.float32, expected an "
                                                  r"integer counter"):
            torch_compat.torch_to_flax(sd)


def test_a_checkpoint_cast_whole_to_float8_ports_with_a_dtype():
    """Casting every tensor to float8 casts the counters as well; they have no numpy form, so they
    are read as the integers torch's load_state_dict copies (an internal error otherwise)."""
    sd = {k: v.to(torch.float8_e4m3fn) for k, v in _resnet18().state_dict().items()}
    sd["bn1.num_batches_tracked"] = torch.tensor(7.0).to(torch.float8_e4m3fn)
    variables = torch_compat.torch_to_flax(sd, dtype="float32")
    assert variables["batch_stats"]["bn1"]["num_batches_tracked"] == 7
    assert variables["params"]["conv1"]["kernel"].dtype == np.float32


def test_a_checkpoint_from_a_pipe_is_named_as_a_pipe(tmp_path, capsys):
    """`jaxport port <(zcat model.pt.gz)` or `cat model.pt | jaxport port /dev/stdin`: torch.load
    cannot seek in a pipe, and the error said the checkpoint was 'truncated or corrupt; re-download
    or re-save it'."""
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    torch.save({"w": torch.ones(2)}, tmp_path / "small.pt")  # well inside a pipe's buffer
    writer = os.open(fifo, os.O_RDWR)  # holds the pipe open, so neither side blocks
    try:
        os.write(writer, (tmp_path / "small.pt").read_bytes())
        with pytest.raises(CheckpointError, match="is a pipe, not a file: .* write it to a file first"):
            load_state_dict(fifo)
        assert main(["port", str(fifo), "--out", str(tmp_path / "out.safetensors")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"checkpoint '{fifo}' is a pipe, not a file" in err, err
        assert not (tmp_path / "out.safetensors").exists()
    finally:
        os.close(writer)


@pytest.fixture(scope="module")
def _exported_program(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "r18.pt2"
    torch.export.save(torch.export.export(_resnet18().eval(), (torch.randn(1, 3, 32, 32),)), path)
    return path


def test_a_torch_export_archive_is_named_with_the_way_to_its_weights(_exported_program, tmp_path, capsys):
    """A `torch.export.save` file (.pt2) was 'a zip archive holding r18/data/weights/weight_0 ...;
    extract the checkpoint from it (unzip ...)', which gives no checkpoint. The advice given runs."""
    with pytest.raises(CheckpointError, match=r"is a torch.export program archive \(torch.export.save, .pt2\)"):
        load_state_dict(_exported_program)
    assert main(["port", str(_exported_program), "--out", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"torch.export.load({str(_exported_program)!r}).module().state_dict()" in err, err
    torch.save(torch.export.load(_exported_program).module().state_dict(), tmp_path / "model.pt")
    _assert_same_weights(load_state_dict(tmp_path / "model.pt"), _resnet18().state_dict())


def test_a_distributed_checkpoint_directory_is_named_with_the_way_to_one_file(tmp_path, capsys):
    """`torch.distributed.checkpoint.save` (FSDP2's usual format) writes a directory of shards; the
    error said only 'is a directory; pass the path of a checkpoint file', and there is none. The
    conversion it names gives a file that ports."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    sd = _resnet18().state_dict()
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming the intent" (one process)
        warnings.simplefilter("ignore")
        dcp.save({"model": sd}, checkpoint_id=tmp_path / "step100")
    with pytest.raises(CheckpointError, match=r"is a torch.distributed.checkpoint \(DCP\) directory of shards"):
        load_state_dict(tmp_path / "step100")
    assert main(["port", str(tmp_path / "step100"), "--out", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dcp_to_torch_save(" in err, err
    dcp_to_torch_save(tmp_path / "step100", tmp_path / "model.pt")
    _assert_same_weights(load_state_dict(tmp_path / "model.pt"), sd)


def test_a_file_of_a_distributed_checkpoint_names_its_directory_and_the_way_to_one_file(tmp_path, capsys):
    """Regression: a DCP shard (`__0_0.distcp`, a series of torch.save zips) given to `jaxport port`
    was "truncated or corrupt: reading the zip archive failed ...; re-download or re-save it";
    the directory it belongs to is what converts to one file, as for the directory itself."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming the intent" (one process)
        warnings.simplefilter("ignore")
        dcp.save({"model": _resnet18().state_dict()}, checkpoint_id=tmp_path / "step100")
    shard, metadata = tmp_path / "step100" / "__0_0.distcp", tmp_path / "step100" / ".metadata"
    assert shard.is_file() and metadata.is_file()
    way = f"dcp_to_torch_save({str(tmp_path / 'step100')!r}, 'model.pt') and pass that file"
    for path, what in ((shard, "a shard"), (metadata, "the metadata file")):
        with pytest.raises(CheckpointError, match=re.escape(f"is {what} of a torch.distributed.checkpoint (DCP) "
                                                            f"directory, '{tmp_path / 'step100'}'")):
            load_state_dict(path)
        assert main(["port", str(path), "--out", str(tmp_path / "out.safetensors")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and way in err and "corrupt" not in err, err
    alone = tmp_path / "copied.distcp"  # a shard copied without its directory
    alone.write_bytes(shard.read_bytes())
    with pytest.raises(CheckpointError, match=r"its .metadata file, which the conversion needs, is not beside it"):
        load_state_dict(alone)


def test_a_segmentation_models_backbone_ports_with_a_note_on_its_dilation(tmp_path, capsys):
    """Regression: DeepLabV3's `--prefix backbone` ported as a plain resnet50 with no word that
    torchvision builds that backbone with replace_stride_with_dilation=[False, True, True] (the
    weights cannot show it), and `verify` PASSed comparing two undilated models. The model the
    note names computes torchvision's features."""
    import jax
    import jax.numpy as jnp

    from jaxport import models

    torch.manual_seed(0)
    seg = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=2,
                                                             aux_loss=True).eval()
    path, out = tmp_path / "deeplab.pth", tmp_path / "dl.safetensors"
    torch.save(seg.state_dict(), path)
    note = ("note: the weights are ported exactly, but they are a torchvision segmentation model's backbone "
            "(classifier.* beside backbone.*: DeepLabV3 / FCN), which torchvision builds dilated: run them with "
            "jaxport.models.resnet50(num_classes=0, replace_stride_with_dilation=(False, True, True))")
    assert main(["port", str(path), "--prefix", "backbone", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count(note) == 1
    assert main(["verify", str(path), str(out), "--prefix", "backbone", "--mode", "eval", "--image-size", "32"]) == 0
    assert capsys.readouterr().out.count(note) == 1
    # Saved by torchvision's reference scripts, {"model": ..., "epoch": ...}: the hint for
    # `--prefix model` is `model.backbone.`, and that selection is the same segmentation backbone.
    ref = tmp_path / "ref.pth"
    torch.save({"model": seg.state_dict(), "epoch": 3}, ref)
    assert main(["port", str(ref), "--prefix", "model.backbone.", "--out", str(out), "--force"]) == 0
    assert capsys.readouterr().out.count(note) == 1
    # A backbone beside other modules (a detector's FPN) is no segmentation model: no note; nor
    # is a classifier's `self.backbone = resnet50(); self.classifier = nn.Linear(...)` (a 2-D head).
    det, clf = tmp_path / "det.pth", tmp_path / "clf.pth"
    torch.save({**{f"backbone.{k}": v for k, v in seg.backbone.state_dict().items()},
                "rpn.head.conv.0.0.weight": torch.zeros(4, 4, 3, 3)}, det)
    torch.save({**{f"backbone.{k}": v for k, v in seg.backbone.state_dict().items()},
                "classifier.weight": torch.zeros(7, 2048), "classifier.bias": torch.zeros(7)}, clf)
    for other in (det, clf):
        assert main(["port", str(other), "--prefix", "backbone", "--out", str(tmp_path / "o.safetensors"),
                     "--force"]) == 0
        assert "note:" not in capsys.readouterr().out, other.name

    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        want = seg.backbone(x)["out"].mean((2, 3)).numpy()
    variables = torch_compat.torch_to_flax(load_state_dict(path, prefix="backbone"))
    with jax.default_matmul_precision("highest"):
        got = models.resnet50(num_classes=0, replace_stride_with_dilation=(False, True, True)).apply(
            variables, jnp.asarray(x.permute(0, 2, 3, 1).numpy()))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("layout, prefix", [
    ("dino", "teacher.backbone."),  # DINO: {"teacher": {"backbone.*": ...}, "student": ..., "epoch": ...}
    ("dino", "teacher.backbone"),
    ("under_model", "teacher."),  # {"model": {"teacher": state_dict}}
    ("module", "ema_model"),  # a pickled module's weights under its own name (trusted files only)
])
def test_a_prefix_may_name_nested_dicts(tmp_path, layout, prefix):
    """`--prefix` only selected keys of one flat state dict: a DINO checkpoint, whose teacher and
    student are dicts beside each other, had 'no recognisable state dict'."""
    model = _resnet18()
    sd = model.state_dict()
    path = tmp_path / "ckpt.pth"
    if layout == "dino":
        torch.save({"teacher": {"backbone." + k: v for k, v in sd.items()},
                    "student": {"backbone." + k: torch.zeros_like(v) for k, v in sd.items()}, "epoch": 3}, path)
    elif layout == "under_model":
        torch.save({"model": {"teacher": sd, "student": {k: torch.zeros_like(v) for k, v in sd.items()}}}, path)
    else:
        torch.save({"ema_model": model, "epoch": 3}, path)
    _assert_same_weights(load_state_dict(path, prefix=prefix, trusted=layout == "module"), sd)
    if layout != "module":
        with pytest.raises(CheckpointError) as e:  # the student is not guessed
            load_state_dict(path)
        assert "(CLI --prefix teacher.)" in str(e.value)
        out = tmp_path / "v.safetensors"
        assert main(["port", str(path), "--prefix", prefix, "--out", str(out)]) == 0
        assert main(["verify", str(path), str(out), "--prefix", prefix]) == 0


@pytest.mark.parametrize("broken", ["mean<->var", "counter"])
def test_port_verify_exits_1_when_the_cross_check_fails(tmp_path, monkeypatch, capsys, broken):
    """`jaxport port --verify` is a gate in scripts: a port beyond tolerance must exit 1 (a
    mismatch), not 0 after printing the failing table. The conversion is broken here by swapping
    one BatchNorm's running mean and variance (both modes fail), or by a wrong batch counter,
    which only train mode's num_batches_tracked row sees (one failing mode is a failure)."""
    from tests.helpers import reference

    convert = torch_compat.torch_to_flax

    def broken_port(*args, **kwargs):
        variables = convert(*args, **kwargs)
        bn = variables["batch_stats"]["layer2"]["0"]["bn1"]
        if broken == "mean<->var":
            bn["mean"], bn["var"] = bn["var"], bn["mean"]
        else:
            bn["num_batches_tracked"] = bn["num_batches_tracked"] + 5
        return variables

    monkeypatch.setattr(torch_compat, "torch_to_flax", broken_port)
    torch.save(reference("resnet18").state_dict(), tmp_path / "r18.pt")
    code = main(["port", str(tmp_path / "r18.pt"), "--out", str(tmp_path / "r18.safetensors"), "--verify"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "verify: FAIL" in out and "PASS" not in out and "  NO" in out, out
