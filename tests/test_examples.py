"""The examples run and report agreement (each exits non-zero when torch and JAX disagree)."""
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torchvision

import jaxport
import torch_compat
from tests.helpers import serving

REPO = Path(__file__).resolve().parents[1]


def _run_example(name, tmp_path, *args):
    (tmp_path / "tmp").mkdir(exist_ok=True)  # the scripts' temporary directories, checked below
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXPORT_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=900)


def _run_example_here(name, tmp_path, monkeypatch, capsys, *args):
    """`_run_example` in this process (an interpreter start and jax's and torch's imports are
    most of a run that stops at its flags): the script as `__main__`, its exit status as the
    interpreter makes it (a string passed to sys.exit is printed to stderr, status 1).
    Returns what `subprocess.run` would: its returncode, stdout and stderr."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setenv("JAXPORT_CACHE", str(tmp_path / "cache"))
        m.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # as TMPDIR does
        m.chdir(tmp_path)
        m.setattr(sys, "argv", [str(REPO / "examples" / name), *args])
        m.setattr(sys, "path", list(sys.path))  # a script puts the repository first
        try:
            runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(sys.argv, code, out, err)


def test_port_resnet_example(tmp_path):
    proc = _run_example("port_resnet.py", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same prediction: True" in proc.stdout


def test_port_resnet_example_takes_torchvision_weights_by_name(tmp_path, monkeypatch, capsys):
    """The real use: torchvision's pretrained weights, named as torchvision names them, downloaded
    once (served here over loopback, at the URL torchvision would use), then a real prediction."""
    served = tmp_path / "served"
    served.mkdir()
    torch.save(torch_compat.reference_model("resnet18", num_classes=1000, image_size=64).state_dict(),
               served / "resnet18.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    with serving(served) as url:
        monkeypatch.setattr(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.value, "url", f"{url}/resnet18.pth")
        proc = _run_example_here("port_resnet.py", tmp_path, monkeypatch, capsys, "ResNet18_Weights.IMAGENET1K_V1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hub = tmp_path / "torch_home" / "hub" / "checkpoints" / "resnet18.pth"
    assert f"downloading ResNet18_Weights.IMAGENET1K_V1 ({url}/resnet18.pth) to {hub}" in proc.stdout, proc.stdout
    assert f"{hub}: resnet18, 1000 classes" in proc.stdout and "same prediction: True" in proc.stdout, proc.stdout
    # the class names come from the port's own header, as a program without torchvision reads them
    assert "class names: the port's metadata (ResNet18_Weights.IMAGENET1K_V1)" in proc.stdout, proc.stdout
    header = jaxport.read_metadata(tmp_path / "ported.safetensors")
    assert json.loads(header["categories"]) == torchvision.models.ResNet18_Weights.IMAGENET1K_V1.meta["categories"]


def test_port_resnet_example_takes_the_prefix_its_errors_name(tmp_path, monkeypatch, capsys):
    """A ResNet inside a bigger model (MoCo's `encoder_q.`): the loading error says to select it
    with --prefix, which the example did not have."""
    model = torchvision.models.resnet18(num_classes=3)
    torch.save({"state_dict": {**{f"module.encoder_q.{k}": v for k, v in model.state_dict().items()},
                               "module.queue": torch.zeros(8, 4)}}, tmp_path / "moco.pth")
    proc = _run_example_here("port_resnet.py", tmp_path, monkeypatch, capsys, "moco.pth", "--prefix", "encoder_q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resnet18, 3 classes" in proc.stdout and "same prediction: True" in proc.stdout, proc.stdout


def test_port_resnet_example_takes_the_backbone_only_flag_its_errors_name(tmp_path, monkeypatch, capsys):
    """MoCo v2's encoder has an MLP head (fc.0, fc.2): the conversion error says to keep the
    backbone with --backbone-only, which the example did not have."""
    model = torchvision.models.resnet18()
    model.fc = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    torch.save({"state_dict": {f"module.encoder_q.{k}": v for k, v in model.state_dict().items()}},
               tmp_path / "moco.pth")
    proc = _run_example_here("port_resnet.py", tmp_path, monkeypatch, capsys, "moco.pth", "--prefix", "encoder_q")
    assert proc.returncode == 1 and "--backbone-only" in proc.stderr, proc.stdout + proc.stderr
    proc = _run_example_here("port_resnet.py", tmp_path, monkeypatch, capsys, "moco.pth", "--prefix", "encoder_q",
                             "--backbone-only")
    assert "is a resnet18 backbone without a classifier (ported to ported.safetensors)" in proc.stderr, proc.stderr
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    from torch_compat._crosscheck import port_differences

    backbone = torch_compat.backbone_state_dict(model.state_dict())
    assert port_differences(backbone, jaxport.load_variables(tmp_path / "ported.safetensors"),
                                         "resnet18") == []


def test_examples_report_bad_input_in_one_line(tmp_path, monkeypatch, capsys):
    torch_whole = tmp_path / "whole.pt"
    torch.save(torchvision.models.resnet18(), torch_whole)  # a pickled module: refused, never run
    for name, args, fragment in [
        ("port_resnet.py", [str(tmp_path / "nope.pth")], "does not exist"),
        ("port_resnet.py", [str(tmp_path / "my_weights.pth")], "does not exist"),  # a path, not a weights name
        ("port_resnet.py", [str(torch_whole)], "outside the weights-only allowed set"),
        ("finetune_ported_resnet.py", ["--checkpoint", str(tmp_path / "nope.pth")], "--checkpoint"),
    ]:
        proc = _run_example_here(name, tmp_path, monkeypatch, capsys, *args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert fragment in proc.stderr.strip().splitlines()[-1], proc.stderr
        assert not list((tmp_path / "tmp").iterdir())  # a missing --checkpoint left an empty temporary directory


def test_examples_refuse_before_writing_and_never_replace_a_users_file(tmp_path, monkeypatch, capsys):
    """Found by a probe: port_resnet.py replaced any existing --out (its default name included)
    with safetensors; an unwritable --out was a traceback; finetune_ported_resnet.py checked its
    flags only after writing a 47 MB torch checkpoint into a new temporary directory (and a
    missing --checkpoint, in the test above, left that directory behind)."""
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "r18.pth")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    for name, args, line in [
        ("port_resnet.py", ["r18.pth", "--out", "notes.txt"],
         "port_resnet.py: error: --out (=notes.txt) already exists and is not an earlier port; nothing was written: "
         "name another file, or pass --force to replace it"),
        ("port_resnet.py", ["r18.pth", "--out", "notes.txt/r18.safetensors"],
         "port_resnet.py: error: notes.txt/r18.safetensors: 'notes.txt' is a file, not a directory"),
        ("finetune_ported_resnet.py", ["--epochs", "0"], "finetune_ported_resnet.py: error: `--epochs` (=0) must be >= 1"),
    ]:
        proc = _run_example_here(name, tmp_path, monkeypatch, capsys, *args)
        assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == line, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert notes.read_text() == "my notes" and not list((tmp_path / "tmp").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "r18.pth", "tmp"]
