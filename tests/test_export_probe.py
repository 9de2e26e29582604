"""`jaxport export` end to end against torchvision: what the other export tests leave out.

A training workdir is written here through the checkpoint module itself (no training: seconds),
with BatchNorm statistics and counters that differ from a fresh model's, so an export that
dropped or reset them would change the logits. Every comparison is with torchvision in the same
test. Tolerance: float32 eval logits within 1e-5 of their scale (max |logit|); observed ~1e-6.
"""
import os

import jax
import numpy as np
import pytest
import safetensors.torch
import torch
import torchvision

import jaxport
from jaxport._cli import main
from jaxport._io import flatten
from jaxport.models import build
from jaxport.train import _checkpoint, load_workdir

RTOL = 1e-5
IMAGE = 32


def _trained_like(arch: str, num_classes: int) -> dict:
    """Flax variables of a torchvision model whose running statistics and `num_batches_tracked`
    are as after training (a fresh Flax init compiles for seconds; the port is instant)."""
    from torch_compat import backbone_state_dict, torch_to_flax

    model = getattr(torchvision.models, arch)(num_classes=max(num_classes, 1))
    state_dict = model.state_dict()
    for k, v in state_dict.items():
        if k.endswith("running_mean"):
            v.normal_(0, 0.1)
        elif k.endswith("running_var"):
            v.uniform_(0.5, 2.0)
        elif k.endswith("num_batches_tracked"):
            v.fill_(7)
    return torch_to_flax(state_dict if num_classes else backbone_state_dict(state_dict), arch)


def _workdir(path, variables: dict, arch: str, step: int = 5, **settings) -> str:
    """A `jaxport train` workdir whose latest checkpoint holds `variables`."""
    mngr = _checkpoint.manager(str(path))
    try:
        state = {"step": np.asarray(step, np.int32), **variables}
        meta = {"arch": arch, "num_classes": 10, "settings": {"dtype": "float32", **settings}}
        _checkpoint.save(mngr, step, state, meta)
    finally:
        mngr.close()
    return str(path)


def _torch_model(arch: str, state_dict, num_classes: int) -> torch.nn.Module:
    model = getattr(torchvision.models, arch)(num_classes=max(num_classes, 1))
    if not num_classes:
        model.fc = torch.nn.Identity()
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def _assert_same_logits(arch: str, variables: dict, model: torch.nn.Module, num_classes: int) -> None:
    x = np.random.RandomState(1).randn(2, IMAGE, IMAGE, 3).astype(np.float32)
    ours = np.asarray(jax.jit(build(arch, num_classes=num_classes).apply)(variables, x))
    with torch.no_grad():
        theirs = model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=RTOL * np.abs(theirs).max())


def _read(path):
    return safetensors.torch.load_file(str(path)) if str(path).endswith(".safetensors") \
        else torch.load(path, weights_only=True)


@pytest.mark.parametrize("ext", ["pt", "pth", "safetensors"])
def test_workdir_export_runs_in_torchvision_with_its_running_stats(tmp_path, ext):
    variables = _trained_like("resnet18", 10)
    workdir = _workdir(tmp_path / "run", variables, "resnet18")
    out = tmp_path / f"model.{ext}"
    assert main(["export", workdir, "--out", str(out)]) == 0
    state_dict = _read(out)
    # Every tensor as torchvision holds it: dtype, shape (a 0-d int64 counter) and values.
    reference = torchvision.models.resnet18(num_classes=10).state_dict()
    assert state_dict.keys() == reference.keys()  # (safetensors lists its keys sorted, not in torch's order)
    for k, v in reference.items():
        assert state_dict[k].dtype == v.dtype and state_dict[k].shape == v.shape, k
    assert all(int(v) == 7 for k, v in state_dict.items() if k.endswith("num_batches_tracked"))
    _assert_same_logits("resnet18", variables, _torch_model("resnet18", state_dict, 10), 10)


def test_workdir_export_says_which_step_it_read(tmp_path, capsys):
    """A workdir keeps several steps; the export named none, so a user could not tell whether the
    weights written were the run's last ones."""
    old, new = _trained_like("resnet18", 10), _trained_like("resnet18", 10)
    workdir = _workdir(tmp_path / "run", old, "resnet18", step=5)
    mngr = _checkpoint.manager(workdir)
    try:
        _checkpoint.save(mngr, 9, {"step": np.asarray(9, np.int32), **new},
                         {"arch": "resnet18", "num_classes": 10, "settings": {"dtype": "float32"}})
    finally:
        mngr.close()
    capsys.readouterr()
    assert main(["export", workdir, "--out", str(tmp_path / "m.pt")]) == 0
    printed = capsys.readouterr().out
    assert f"read: step 9, the latest checkpoint in {tmp_path / 'run' / 'checkpoints'}\n" in printed
    _assert_same_logits("resnet18", new, _torch_model("resnet18", _read(tmp_path / "m.pt"), 10), 10)


def test_bfloat16_run_exports_its_float32_master_weights(tmp_path):
    """`--dtype bfloat16` is the compute dtype: checkpoints hold float32 weights, and so does the
    export, as torchvision's models are; a bfloat16 export would silently round them."""
    variables = _trained_like("resnet18", 10)
    workdir = _workdir(tmp_path / "run", variables, "resnet18", dtype="bfloat16")
    assert main(["export", workdir, "--out", str(tmp_path / "m.pt")]) == 0
    state_dict = torch.load(tmp_path / "m.pt", weights_only=True)
    assert {v.dtype for v in state_dict.values()} == {torch.float32, torch.int64}
    ours = flatten(load_workdir(workdir)[0])
    assert {a.dtype.name for a in ours.values()} == {"float32", "int32"}
    _assert_same_logits("resnet18", variables, _torch_model("resnet18", state_dict, 10), 10)


def test_export_port_verify_round_trip_is_exact(tmp_path, capsys):
    variables = _trained_like("resnet18", 10)
    workdir = _workdir(tmp_path / "run", variables, "resnet18")
    pt, port = tmp_path / "m.pt", tmp_path / "m.safetensors"
    assert main(["export", workdir, "--out", str(pt)]) == 0
    assert main(["port", str(pt), "--out", str(port)]) == 0
    assert main(["verify", str(pt), str(port), "--mode", "eval", "--image-size", str(IMAGE)]) == 0
    assert "verify: PASS" in capsys.readouterr().out
    back, ckpt = flatten(jaxport.load_variables(port)), flatten(load_workdir(workdir)[0])
    assert back.keys() == ckpt.keys()
    for k in ckpt:
        assert back[k].dtype == ckpt[k].dtype and np.array_equal(back[k], ckpt[k]), k
    # ... and the port exports to the same torch file, tensor for tensor.
    assert main(["export", str(port), "--out", str(tmp_path / "again.pth")]) == 0
    first, again = torch.load(pt, weights_only=True), torch.load(tmp_path / "again.pth", weights_only=True)
    assert list(first) == list(again)
    assert all(first[k].dtype == again[k].dtype and torch.equal(first[k], again[k]) for k in first)


def test_workdir_killed_before_its_first_checkpoint_is_one_clear_error(tmp_path, capsys):
    """Orbax's unfinished temporary step (a run killed mid-save) is no checkpoint to export."""
    (tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "holds no finished checkpoint" in err, err
    assert not (tmp_path / "m.pt").exists()
    # With a finished step beside it, that step is read and the temporary one ignored. (The
    # writer of step 2 removed it, as a training run removes what a kill left: made again.)
    variables = _trained_like("resnet18", 10)
    _workdir(tmp_path / "run", variables, "resnet18", step=2)
    (tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "m.pt")]) == 0
    state_dict = torch.load(tmp_path / "m.pt", weights_only=True)
    _assert_same_logits("resnet18", variables, _torch_model("resnet18", state_dict, 10), 10)
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "4.orbax-checkpoint-tmp-1")  # left as it was


@pytest.mark.parametrize("arch, num_classes", [("resnet50", 10), ("resnext50_32x4d", 0), ("wide_resnet50_2", 10)])
def test_bottleneck_archs_convert_to_torchvision(arch, num_classes):
    """The library conversion behind export, for the bottleneck, grouped and wide blocks, and for
    a backbone (loaded into torchvision's model with `fc = nn.Identity()`)."""
    from torch_compat import flax_to_torch

    variables = _trained_like(arch, num_classes)
    state_dict = flax_to_torch(variables, arch)
    assert state_dict["bn1.num_batches_tracked"].shape == () and int(state_dict["bn1.num_batches_tracked"]) == 7
    _assert_same_logits(arch, variables, _torch_model(arch, state_dict, num_classes), num_classes)
