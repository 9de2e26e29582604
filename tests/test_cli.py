"""The jaxport command line: the main job, round trips, and one-line errors with no traceback."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

import jaxport
import torch_compat
from torch_compat import _default
from jaxport._cli import _source_id, main
from tests.helpers import reference

REPO = Path(__file__).resolve().parents[1]


def _run(*args, cwd=None, env=None):
    """The CLI in a fresh interpreter, as a user runs it."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "jaxport", *args], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=600)


def _assert_one_line_error(proc_or_err, *fragments):
    err = proc_or_err if isinstance(proc_or_err, str) else proc_or_err.stderr
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("jaxport: error")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def resnet18_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "r18.pth"
    torch.save({"model": reference("resnet18").state_dict(), "epoch": 3}, path)
    return path


def test_port_with_no_arguments_ports_the_embedded_default(tmp_path):
    """The README's main job: offline, no arguments, a DataParallel checkpoint saved on cuda:0."""
    proc = _run("port", "--verify", cwd=tmp_path, env={"JAXPORT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "architecture: resnet50 (detected), 1000 classes" in proc.stdout
    assert "verify: PASS" in proc.stdout
    for stage in ("stem", "layer4", "logits", "running_var"):
        assert stage in proc.stdout
    ckpt = tmp_path / "cache" / _default.FILENAME
    assert b"cuda:0" in ckpt.read_bytes()  # really tagged as saved from the GPU
    raw = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert all(k.startswith("module.") for k in raw["state_dict"])
    # The written variables equal the checkpoint's weights, bit for bit, and run like torch.
    out = tmp_path / "resnet50_dataparallel_cuda.safetensors"
    variables = jaxport.load_variables(out)
    sd = {k.removeprefix("module."): v for k, v in raw["state_dict"].items()}
    back = torch_compat.flax_to_torch(variables, "resnet50")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert jaxport.read_metadata(out)["arch"] == "resnet50"


def test_port_verify_export_round_trip(tmp_path, resnet18_checkpoint):
    out = tmp_path / "r18.safetensors"
    assert main(["port", str(resnet18_checkpoint), "--out", str(out)]) == 0
    assert main(["verify", str(resnet18_checkpoint), str(out), "--mode", "eval"]) == 0
    pt = tmp_path / "back.pt"
    assert main(["export", str(out), "--out", str(pt)]) == 0
    back = torch.load(pt, weights_only=True)
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(back, strict=True)
    for k, v in reference("resnet18").state_dict().items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    # Reproducible: torch named the archive's folder after the random temporary file it wrote.
    again = tmp_path / "again" / "other.pt"
    assert main(["export", str(out), "--out", str(again)]) == 0
    assert again.read_bytes() == pt.read_bytes()


def _header(path: Path) -> bytes:
    """A safetensors file's JSON header: its first 8 bytes give the length."""
    data = path.read_bytes()
    return data[8:8 + int.from_bytes(data[:8], "little")]


def test_a_port_records_no_directory_and_still_knows_its_checkpoint(tmp_path, resnet18_checkpoint, monkeypatch,
                                                                   capsys):
    """A port recorded the checkpoint's absolute path, putting the user's directory names (often
    their login) into every file they publish. A digest of it recognises a re-port as well; a
    same-named checkpoint of another directory is still refused, and said as such. Ports written
    with the path are still recognised."""
    private = tmp_path / "home_alice_secret"
    private.mkdir()
    ckpt = private / "r18.pth"
    shutil.copy(resnet18_checkpoint, ckpt)
    monkeypatch.chdir(tmp_path)
    assert main(["port", str(ckpt)]) == 0
    header = _header(Path("r18.safetensors"))
    assert b"alice" not in header and b"r18.pth" in header
    assert main(["port", str(ckpt)]) == 0  # a re-port replaces its own
    other = tmp_path / "elsewhere"
    other.mkdir()
    shutil.copy(resnet18_checkpoint, other / "r18.pth")
    assert main(["port", str(other / "r18.pth")]) == 2
    assert ("the default output 'r18.safetensors' already exists and holds the port of another 'r18.pth' (another "
            "directory's, or a file since moved); nothing was overwritten") in capsys.readouterr().err
    # Other spellings of the same checkpoint's path are the same checkpoint: a re-port.
    (tmp_path / "link").symlink_to(private)
    for spelling in (os.path.relpath(ckpt), str(tmp_path / "link" / "r18.pth")):
        assert main(["port", spelling]) == 0, capsys.readouterr().err
    # Ports written before recorded the path, or (earlier still) the name alone: recognised by them.
    variables = torch_compat.torch_to_flax(reference("resnet18").state_dict())
    jaxport.save_variables("r18.safetensors", variables, arch="resnet18",
                           metadata={"source": "r18.pth", "source_path": str(other / "r18.pth")})
    assert main(["port", str(ckpt)]) == 2  # another directory's, by its recorded path
    assert jaxport.read_metadata("r18.safetensors")["source_path"] == str(other / "r18.pth")
    assert main(["port", str(other / "r18.pth")]) == 0
    jaxport.save_variables("r18.safetensors", variables, arch="resnet18", metadata={"source": "r18.pth"})
    assert main(["port", str(ckpt)]) == 0
    capsys.readouterr()
    # A model hub's safetensors file (torch keys, format "pt") is no port: never replaced.
    import safetensors.torch

    safetensors.torch.save_file({"w": torch.zeros(2)}, "r18.safetensors", metadata={"format": "pt"})
    assert main(["port", str(ckpt)]) == 2
    assert "the default output 'r18.safetensors' already exists and is not a jaxport variables file" in \
        capsys.readouterr().err


def test_a_checkpoint_under_a_path_that_is_not_utf8_ports(tmp_path, resnet18_checkpoint, monkeypatch):
    """A Latin-1 directory name: torch's memory-mapped reader takes paths as UTF-8, and the
    failure was reported as a corrupt checkpoint; then the header could not hold the path, and
    a strict UTF-8 stdout could not print it. (In this process, with stdout a strict UTF-8
    stream as `PYTHONIOENCODING=utf-8:strict` makes it: no interpreter start needs paying.)"""
    import io

    folder = tmp_path / os.fsdecode(b"caf\xe9")
    folder.mkdir()
    ckpt = folder / "r18.pth"
    shutil.copy(resnet18_checkpoint, ckpt)
    monkeypatch.chdir(tmp_path)

    def run(args):
        stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
        with monkeypatch.context() as m:
            m.setattr(sys, "stdout", stdout)
            code = main(args)
        return code, stdout.buffer.getvalue()

    for _ in range(2):  # the second run replaces its own port: it knows the source it recorded
        code, out = run(["port", str(ckpt)])
        assert code == 0, out
    # The printed next step names the directory with its own bytes: it runs as shown.
    assert b"next: jaxport verify '" + os.fsencode(ckpt) + b"' r18.safetensors" in out, out
    port = tmp_path / "r18.safetensors"
    # The port knows its checkpoint again (above) by a digest: no directory name is in the file.
    assert jaxport.read_metadata(port)["source"] == "r18.pth" and b"caf" not in _header(port)
    code, out = run(["verify", str(ckpt), str(port), "--mode", "eval"])
    assert code == 0 and b"verify: PASS" in out, out


def test_a_write_past_the_file_size_limit_is_one_clear_error(tmp_path, resnet18_checkpoint, monkeypatch, capsys):
    """A full disk, a quota or a file-size limit hit inside safetensors' or torch's writer: an
    "internal error (SafetensorError: ... os error 27)" or a RuntimeError "unexpected pos 704 vs
    598", which named neither the cause nor the file. Each is now the OSError, and nothing is
    left behind. (In this process, under a lowered soft limit restored after each command:
    Python ignores SIGXFSZ, so a write past the limit is EFBIG, as in a fresh interpreter.)"""
    import resource
    import signal

    assert signal.getsignal(signal.SIGXFSZ) is signal.SIG_IGN  # else the limit kills the process

    port = tmp_path / "ported.safetensors"
    assert main(["port", str(resnet18_checkpoint), "--out", str(port)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("JAXPORT_CACHE", str(out / "cache"))
    capsys.readouterr()
    for args, target in ((["port", str(resnet18_checkpoint), "--out", str(out / "a.safetensors")], "a.safetensors"),
                         (["export", str(port), "--out", str(out / "b.pt")], "b.pt"),
                         (["export", str(port), "--out", str(out / "c.safetensors")], "c.safetensors"),
                         (["port", "--out", str(out / "d.safetensors")], "resnet50_dataparallel_cuda.pth.tar")):
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, hard))  # 4 MB: the resnet18 files are ~45 MB
        try:
            code = main(args)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        err = capsys.readouterr().err
        assert code != 0, (args, err)
        _assert_one_line_error(err, "File too large", target)
    assert [p.name for p in out.rglob("*") if p.is_file()] == []


def test_the_embedded_default_checkpoint_is_the_same_file_in_every_cache(tmp_path):
    """The README's main job starts from it: its bytes must not depend on the cache, nor on the
    random temporary name it was written under (torch named the archive's folder after it)."""
    a = _default.default_checkpoint(tmp_path / "a" / _default.FILENAME)
    b = _default.default_checkpoint(tmp_path / "b" / "elsewhere.pth.tar")
    assert a.read_bytes() == b.read_bytes()


def test_verify_fails_with_exit_1_on_a_broken_port(tmp_path, resnet18_checkpoint, capsys):
    variables = torch_compat.torch_to_flax(reference("resnet18").state_dict())
    bn = variables["batch_stats"]["layer1"]["1"]["bn2"]
    bn["mean"], bn["var"] = bn["var"], bn["mean"]
    bad = jaxport.save_variables(tmp_path / "bad.safetensors", variables, arch="resnet18")
    assert main(["verify", str(resnet18_checkpoint), str(bad), "--mode", "eval"]) == 1
    out = capsys.readouterr().out
    assert "verify: FAIL" in out and "NO" in out


def test_a_checkpoint_holding_nan_or_inf_is_said_by_port_and_verify(tmp_path, capsys):
    """A diverged run's checkpoint ported silently, and verify failed it "beyond tolerance" with a
    relative error of inf, as if the port were wrong. Both now name the tensors, and verify says
    the port is an exact copy while no output check can pass."""
    sd = {k: v.clone() for k, v in reference("resnet18").state_dict().items()}  # (the reference is shared)
    sd["layer2.0.conv1.weight"][0, 0, 0, :2] = torch.tensor([float("nan"), float("inf")])
    sd["bn1.running_var"][3] = float("nan")
    ckpt = tmp_path / "diverged.pth"
    torch.save(sd, ckpt)
    out_file = tmp_path / "diverged.safetensors"
    assert main(["port", str(ckpt), "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert ("warning: the checkpoint's 2 tensor(s) hold NaN or inf values (bn1.running_var: 1 NaN, 0 inf; "
            "layer2.0.conv1.weight: 1 NaN, 1 inf); they are copied as they are") in out, out
    assert main(["verify", str(ckpt), str(out_file), "--mode", "eval"]) == 1
    out = capsys.readouterr().out
    assert "note: the checkpoint's 2 tensor(s) hold NaN or inf values" in out, out
    assert ("verify: FAIL: the checkpoint holds NaN or inf values, which no output check can pass (every tensor "
            "is an exact copy of the checkpoint's own port)") in out, out
    # Many such tensors: the first three named, then "...".
    for key in ("fc.bias", "layer1.0.bn1.running_mean"):
        sd[key][0] = float("inf")
    torch.save(sd, ckpt)
    assert main(["port", str(ckpt), "--out", str(out_file), "--force"]) == 0
    assert ("4 tensor(s) hold NaN or inf values (bn1.running_var: 1 NaN, 0 inf; layer1.0.bn1.running_mean: 0 NaN, "
            "1 inf; layer2.0.conv1.weight: 1 NaN, 1 inf; ...)") in capsys.readouterr().out


def test_verify_compares_the_port_tensor_by_tensor(tmp_path, resnet18_checkpoint, capsys):
    """1e-5 on every logit bias stays within the cross-check's tolerance, and verify said PASS;
    the port must be the checkpoint's exact copy, so any changed tensor now fails it."""
    variables = torch_compat.torch_to_flax(reference("resnet18").state_dict())
    variables["params"]["fc"]["bias"] = variables["params"]["fc"]["bias"] + np.float32(1e-5)
    near = jaxport.save_variables(tmp_path / "near.safetensors", variables, arch="resnet18")
    assert main(["verify", str(resnet18_checkpoint), str(near), "--mode", "eval"]) == 1
    out = capsys.readouterr().out
    assert " NO" not in out  # the cross-check alone passes it
    assert ("weights: 1 tensor(s) of '" in out and "params/fc/bias: 10 of 10 values differ (max |difference| 1e-05"
            in out and "verify: FAIL: the variables are not the checkpoint's port" in out), out

    # Labelled resnet34 by mistake: the shapes (resnet18) decide, not the label.
    good = jaxport.save_variables(tmp_path / "good.safetensors",
                                  torch_compat.torch_to_flax(reference("resnet18").state_dict()), arch="resnet34")
    assert main(["verify", str(resnet18_checkpoint), str(good), "--mode", "eval", "--image-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "verify: PASS" in out
    assert "note: at --image-size 16 layer4's maps are 1x1, so the outer taps of its 3x3 kernels" in out


def test_verify_shows_eval_before_refusing_train_mode_at_tiny_inputs(tmp_path, resnet18_checkpoint, capsys):
    """At 1 px torch's own float32 train mode is as far off its float64 as the values are large,
    so cross_check refuses train mode there; --mode both still shows the eval table first."""
    good = jaxport.save_variables(tmp_path / "good.safetensors",
                                  torch_compat.torch_to_flax(reference("resnet18").state_dict()), arch="resnet18")
    code = main(["verify", str(resnet18_checkpoint), str(good), "--mode", "both", "--image-size", "1",
                 "--batch-size", "2"])
    captured = capsys.readouterr()
    assert code != 0
    assert "eval" in captured.out and "logits" in captured.out, captured.out
    assert "train mode cannot be cross-checked at `batch_size` (=2) and `image_size` (=1)" in captured.err, captured.err
    assert "Traceback" not in captured.err


def test_export_needs_an_arch_when_the_file_has_none(tmp_path, capsys):
    path = jaxport.save_variables(tmp_path / "v.safetensors",
                                  torch_compat.torch_to_flax(reference("resnet18").state_dict()))
    assert main(["export", str(path), "--out", str(tmp_path / "x.pt")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "does not record its architecture", "--arch")
    assert main(["export", str(path), "--arch", "resnet18", "--out", str(tmp_path / "x.pt")]) == 0
    # A recorded name jaxport does not know named no file and did not suggest --arch.
    other = jaxport.save_variables(tmp_path / "o.safetensors", jaxport.load_variables(path), arch="vgg16")
    assert main(["export", str(other), "--out", str(tmp_path / "y.pt")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "'", "o.safetensors' records the architecture 'vgg16', which "
                           "jaxport does not know", "pass --arch")
    assert main(["export", str(other), "--arch", "resnet18", "--out", str(tmp_path / "y.pt")]) == 0


def test_errors_are_one_line_without_traceback(tmp_path, resnet18_checkpoint, capsys):
    assert main(["port", str(tmp_path / "nope.pt")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "nope.pt")

    assert main(["port", str(resnet18_checkpoint), "--arch", "resnet50", "--out", str(tmp_path / "x.safetensors")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "look like resnet18, not resnet50")
    assert not (tmp_path / "x.safetensors").exists()

    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert main(["verify", str(tmp_path / "notes.txt")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "notes.txt")

    with pytest.raises(SystemExit) as e:
        main(["verify", str(resnet18_checkpoint), "--batch-size", "0"])
    assert e.value.code == 2


def test_port_never_overwrites_its_checkpoint_or_a_foreign_file(tmp_path, monkeypatch, capsys):
    """Nothing is lost: a torch .safetensors checkpoint is not replaced by its port (the default
    name moves aside), `--out` naming the input is refused, and so is a default output that
    exists but is not an earlier port."""
    monkeypatch.chdir(tmp_path)
    import safetensors.torch

    sd = reference("resnet18").state_dict()
    safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, "r18.safetensors")
    original = Path("r18.safetensors").read_bytes()
    assert main(["port", "r18.safetensors"]) == 0
    assert Path("r18.safetensors").read_bytes() == original
    assert jaxport.read_metadata("r18.flax.safetensors")["arch"] == "resnet18"
    assert main(["port", "r18.safetensors"]) == 0  # an earlier port may be replaced
    capsys.readouterr()

    assert main(["port", "r18.safetensors", "--out", str(tmp_path / "r18.safetensors")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "`--out`", "is part of the checkpoint being read")
    assert Path("r18.safetensors").read_bytes() == original
    # Through a directory that does not exist yet: every check asked about the literal path
    # (missing), then the writer made `nodir` and replaced the checkpoint, with status 0.
    for out in ["nodir/../r18.safetensors", str(tmp_path / "nodir" / ".." / "r18.safetensors")]:
        assert main(["port", "r18.safetensors", "--out", out]) == 2
        _assert_one_line_error(capsys.readouterr().err, "`--out` (=", "r18.safetensors) is part of the checkpoint")
        assert Path("r18.safetensors").read_bytes() == original and not Path("nodir").exists()

    torch.save(sd, "model.pth")
    Path("model.safetensors").write_bytes(b"someone else's file")
    assert main(["port", "model.pth"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "'model.safetensors' already exists", "--out")
    assert Path("model.safetensors").read_bytes() == b"someone else's file"
    assert main(["port", "model.pth", "--out", "nodir/../model.safetensors"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "`--out` (=model.safetensors) already exists", "--force")
    assert Path("model.safetensors").read_bytes() == b"someone else's file"

    assert main(["port", "model.pth", "--out", str(tmp_path)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "is a directory")


@pytest.mark.parametrize("made", ["a foreign file", "a port of another checkpoint", "a port of this checkpoint"])
@pytest.mark.parametrize("named", [False, True], ids=["default output", "--out"])
def test_a_port_never_replaces_a_file_written_while_it_ran(tmp_path, resnet18_checkpoint, monkeypatch, capsys,
                                                           made, named):
    """The checks that `out` is free ran before loading and converting; the write then replaced
    whatever was there by then: two `jaxport port` started together both exited 0 and the last
    one silently replaced the other's port, which one after the other is refused. A file that
    appears meanwhile now gets the same decision as one that was there first."""
    monkeypatch.chdir(tmp_path)
    out = Path("out.safetensors" if named else "r18.safetensors")
    source = resnet18_checkpoint if made == "a port of this checkpoint" else tmp_path / "other.pth"
    real = torch_compat.torch_to_flax

    def meanwhile(*args, **kwargs):  # another process writes `out` while this one converts
        if made == "a foreign file":
            out.write_bytes(b"someone else's file")
        else:
            jaxport.save_variables(out, {"params": {"x": np.zeros(2, np.float32)}}, arch="resnet34",
                                   metadata={"source": source.name, "source_id": _source_id(source)})
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_compat, "torch_to_flax", meanwhile)
    code = main(["port", str(resnet18_checkpoint), *(["--out", str(out)] if named else [])])
    err = capsys.readouterr().err
    # One after the other: --out replaces any earlier port, the default name only this checkpoint's.
    replaced = made == "a port of this checkpoint" or (named and made != "a foreign file")
    if replaced:
        assert code == 0, err
        assert jaxport.read_metadata(out)["arch"] == "resnet18"
    else:
        assert code == 2
        if named:
            _assert_one_line_error(err, f"`--out` (={out}) already exists and is not an earlier port", "--force")
        else:
            _assert_one_line_error(err, f"the default output '{out}' already exists", "--force")
        if made == "a foreign file":
            assert out.read_bytes() == b"someone else's file"
        else:
            assert jaxport.read_metadata(out)["arch"] == "resnet34"
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary left


def test_an_export_never_replaces_a_file_written_while_it_ran(tmp_path, monkeypatch, capsys):
    """Without --force `export` refuses an existing --out, but checked before converting; a file
    written there meanwhile (two exports to one name started together) was replaced with status 0."""
    variables = jaxport.save_variables(tmp_path / "v.safetensors",
                                       torch_compat.torch_to_flax(reference("resnet18").state_dict()), arch="resnet18")
    out = tmp_path / "r18.pt"
    real = torch_compat.flax_to_torch

    def meanwhile(*args, **kwargs):
        out.write_bytes(b"someone else's file")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_compat, "flax_to_torch", meanwhile)
    assert main(["export", str(variables), "--out", str(out)]) == 2
    _assert_one_line_error(capsys.readouterr().err, f"`--out` (={out}) already exists", "--force")
    assert out.read_bytes() == b"someone else's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r18.pt", "v.safetensors"]  # no temporary left
    assert main(["export", str(variables), "--out", str(out), "--force"]) == 0
    assert torch.load(out, weights_only=True).keys() == reference("resnet18").state_dict().keys()


def test_export_writes_safetensors_by_name_and_never_over_its_input(tmp_path, capsys):
    variables = jaxport.save_variables(tmp_path / "v.safetensors",
                                       torch_compat.torch_to_flax(reference("resnet18").state_dict()), arch="resnet18")
    before = variables.read_bytes()
    assert main(["export", str(variables), "--out", str(variables)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "is part of the variables file being read")
    assert main(["export", str(variables), "--out", str(tmp_path / "nodir" / ".." / "v.safetensors")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "is part of the variables file being read")
    assert variables.read_bytes() == before and not (tmp_path / "nodir").exists()

    import safetensors.torch

    assert main(["export", str(variables), "--out", str(tmp_path / "t.safetensors")]) == 0
    assert main(["export", str(variables), "--out", str(tmp_path / "t.pt")]) == 0
    assert "safetensors.torch.load_file(path)" in capsys.readouterr().out
    from_st = safetensors.torch.load_file(tmp_path / "t.safetensors")  # a real safetensors file: no pickle
    from_pt = torch.load(tmp_path / "t.pt", weights_only=True)
    assert from_st.keys() == from_pt.keys()
    assert all(from_st[k].dtype == v.dtype and torch.equal(from_st[k], v) for k, v in from_pt.items())
    torchvision.models.resnet18(num_classes=10).load_state_dict(from_st, strict=True)
    # Any case: `T.SAFETENSORS` was written as a torch pickle under a safetensors name.
    assert main(["export", str(variables), "--out", str(tmp_path / "T.SAFETENSORS")]) == 0
    assert safetensors.torch.load_file(tmp_path / "T.SAFETENSORS").keys() == from_pt.keys()


def test_verify_refuses_a_port_of_another_architecture_in_one_line(tmp_path, resnet18_checkpoint, capsys):
    """A checkpoint and a variables file of different architectures: one error naming both,
    not torchvision's load_state_dict traceback (an internal error before)."""
    r34 = jaxport.save_variables(tmp_path / "r34.safetensors",
                                 torch_compat.torch_to_flax(reference("resnet34").state_dict()), arch="resnet34")
    assert main(["verify", str(resnet18_checkpoint), str(r34)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "holds resnet34 variables", "is a resnet18 checkpoint")
    assert main(["verify", str(resnet18_checkpoint), str(r34), "--arch", "resnet18"]) == 2
    _assert_one_line_error(capsys.readouterr().err, f"'{r34}' holds resnet34 variables but --arch is resnet18")
    with pytest.raises(jaxport.ConversionError, match="look like resnet18, not resnet34"):
        torch_compat.cross_check(reference("resnet18").state_dict(), jaxport.load_variables(r34), arch="resnet34")
    for bad in ("nan", "-1", "0"):
        with pytest.raises(SystemExit) as e:
            main(["verify", str(resnet18_checkpoint), "--rtol", bad])
        assert e.value.code == 2
        assert "expected a finite number > 0" in capsys.readouterr().err


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {_Payload.marker}",))


def test_a_reader_that_stops_early_does_not_stop_the_port(tmp_path, resnet18_checkpoint):
    """`jaxport port ... | head -1`: the pipe closes before the output is written; the port must
    still be saved (it was an internal BrokenPipeError before anything was written)."""
    out = tmp_path / "piped.safetensors"
    proc = subprocess.Popen([sys.executable, "-m", "jaxport", "port", str(resnet18_checkpoint), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=600) == 0, err
    assert "error" not in err and "Traceback" not in err, err
    variables = jaxport.load_variables(out)
    want = reference("resnet18").state_dict()["conv1.weight"].permute(2, 3, 1, 0).numpy()
    np.testing.assert_array_equal(np.asarray(variables["params"]["conv1"]["kernel"]), want)


def test_a_reader_of_both_streams_that_stops_early_does_not_stop_training(tmp_path):
    """`jaxport train ... 2>&1 | head -1`: the first epoch's line, on stderr, raised
    BrokenPipeError after that epoch's checkpoint; the run ended with status 1 and no final
    weights file."""
    work = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-m", "jaxport", "train", "--workdir", str(work), "--image-size", "16",
                             "--batch-size", "256", "--epochs", "1", "--checkpoint-every", "1000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().startswith("training resnet18")
    proc.stdout.close()  # as `head -1` does
    assert proc.wait(timeout=600) == 0
    from jaxport._io import read_metadata

    (row,) = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert read_metadata(work / "variables.safetensors")["step"] == str(row["step"])  # the epoch's end


@pytest.mark.parametrize("name, shown", [("my run", "'my run"), ("-run", "./-run")])
def test_the_suggested_next_command_runs_as_printed(tmp_path, resnet18_checkpoint, capsys, monkeypatch, name, shown):
    """The `next:` line is copied into a shell: paths with spaces must come out quoted, and one
    starting with '-' as './-run' (quoted, it would still be read as an option)."""
    import shlex

    monkeypatch.chdir(tmp_path)
    shutil.copy(resnet18_checkpoint, tmp_path / f"{name}.pth")
    assert main(["port", "--", f"{name}.pth"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("next: ")]
    close = "'" if shown.startswith("'") else ""
    assert line == f"next: jaxport verify {shown}.pth{close} {shown}.safetensors{close}"
    command = shlex.split(line.removeprefix("next: "))
    assert command[0] == "jaxport" and main(command[1:] + ["--mode", "eval"]) == 0


def test_hostile_pickle_is_refused_and_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    _Payload.marker = marker
    evil = tmp_path / "evil.pth"
    torch.save({"state_dict": reference("resnet18").state_dict(), "hook": _Payload()}, evil)
    code = main(["port", str(evil), "--out", str(tmp_path / "evil.safetensors")])  # (in this process: its
    assert code == 2  # status and error line are main's; a payload that ran would touch the marker here as there)
    _assert_one_line_error(capsys.readouterr().err, "evil.pth", "system", "--trusted")
    assert not marker.exists()
    assert not (tmp_path / "evil.safetensors").exists()


def test_env_reports_versions_and_devices(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for name in ("python", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "torchvision",
                 "numpy", "pillow", "jax devices"):
        assert f"\n{name} " in "\n" + out, name


def test_env_warns_about_torchvision_built_for_another_torch(monkeypatch, capsys):
    import importlib.metadata as md

    real_version = md.version
    monkeypatch.setattr(md, "version", lambda d: "2.13.0" if d == "torch" else real_version(d))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "was built for torch" in out
    # A fix that works without a jaxport checkout (its constraints.txt): what pip installed from
    # the registry has none.
    assert "pip install 'torch" in out and "constraints.txt" not in out


def test_console_script_is_installed():
    """`make test` installs the package; the `jaxport` entry point must be on the venv's PATH."""
    script = shutil.which("jaxport", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("jaxport is not installed in this interpreter (run through `make test`)")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("jaxport ")


@pytest.mark.parametrize("command", [[], ["port"], ["verify"], ["export"], ["env"], ["train"]])
def test_help_is_clean(command, capsys):
    # argparse %-formats only argument help, so a description's "%%" would reach the user as is.
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxport") and "%%" not in out and "%(" not in out, out


@pytest.mark.parametrize("command", ["port", "verify", "export", "env", "train"])
def test_every_option_says_what_it_does(command):
    """`jaxport verify --help` listed checkpoint, --mode, --batch-size and --image-size bare:
    no description, no defaults, though the README relies on them."""
    from jaxport._cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert sub.description, command
    bare = [a.dest for a in sub._actions if not a.help and a.dest != "help"]
    assert not bare, f"{command}: {bare} have no help"
    for action in sub._actions:
        if action.default not in (None, False, "auto", "keep") and action.option_strings and action.type is not None:
            assert "default" in action.help, f"{command} {action.option_strings[0]}: {action.help}"


def test_port_and_export_never_replace_a_file_they_did_not_write(tmp_path, monkeypatch, capsys):
    """Nothing is lost: `a.epoch10.pth` and `a.epoch20.pth` both defaulted to `a.safetensors`
    (the second silently replaced the first's port), and an explicit `--out` replaced any file."""
    monkeypatch.chdir(tmp_path)
    sd = reference("resnet18").state_dict()
    for epoch in (10, 20):
        torch.save(sd, f"a.epoch{epoch}.pth")
        assert main(["port", f"a.epoch{epoch}.pth"]) == 0
        assert jaxport.read_metadata(f"a.epoch{epoch}.safetensors")["source"] == f"a.epoch{epoch}.pth"
    Path("elsewhere").mkdir()
    torch.save(sd, "elsewhere/a.epoch10.pth")  # the same name, another checkpoint
    before = Path("a.epoch10.safetensors").read_bytes()
    assert main(["port", "elsewhere/a.epoch10.pth"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "holds the port of", "--force")
    assert Path("a.epoch10.safetensors").read_bytes() == before
    assert main(["port", "a.epoch10.pth"]) == 0  # its own earlier port is replaced (a re-run)
    assert main(["port", "elsewhere/a.epoch10.pth", "--force"]) == 0

    torch.save(sd, "precious.pt")
    precious = Path("precious.pt").read_bytes()
    assert main(["port", "a.epoch20.pth", "--out", "precious.pt"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "`--out` (=precious.pt) already exists", "--force")
    assert main(["export", "a.epoch20.safetensors", "--out", "precious.pt"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "`--out` (=precious.pt) already exists", "--force")
    assert Path("precious.pt").read_bytes() == precious
    assert main(["port", "a.epoch20.pth", "--out", "a.epoch10.safetensors"]) == 0  # a port over a port
    assert main(["export", "a.epoch20.safetensors", "--out", "precious.pt", "--force"]) == 0
    assert torch.equal(torch.load("precious.pt", weights_only=True)["fc.weight"], sd["fc.weight"])

    torch.save(sd, "model_best.pth.tar")
    assert main(["port", "model_best.pth.tar"]) == 0
    assert jaxport.read_metadata("model_best.safetensors")["source"] == "model_best.pth.tar"

    Path("afile").write_text("")
    assert main(["port", "a.epoch20.pth", "--out", "afile/x.safetensors"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "'afile' is a file, not a directory")


def test_files_of_the_other_kind_are_named(tmp_path, resnet18_checkpoint, capsys):
    """A torch checkpoint given as variables, a port given as a checkpoint, and a torch file
    named .safetensors (torch.load read it as safetensors: 'truncated or corrupt')."""
    # Paths with a space: each hint is a command to run as printed (they were unquoted).
    checkpoint = tmp_path / "my checkpoint.pth"
    shutil.copy(resnet18_checkpoint, checkpoint)
    port = tmp_path / "my port.safetensors"
    assert main(["port", str(checkpoint), "--out", str(port)]) == 0
    capsys.readouterr()
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "x.pt")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "is a torch checkpoint (torch.save), not a Flax variables file",
                           f"`jaxport port '{checkpoint}'`")
    assert main(["port", str(port), "--out", str(tmp_path / "again.safetensors")]) == 2
    _assert_one_line_error(capsys.readouterr().err, "is already a jaxport variables file",
                           f"`jaxport export '{port}' --out model.pt`")
    misnamed = tmp_path / "misnamed.safetensors"
    shutil.copy(resnet18_checkpoint, misnamed)
    assert main(["port", str(misnamed), "--out", str(tmp_path / "m.safetensors")]) == 0


def test_port_never_replaces_trained_or_saved_variables(tmp_path, monkeypatch, capsys):
    """`jaxport train`'s variables and `jaxport.save_variables` files record no source; port read
    that as 'an earlier port' and replaced them without --force, by --out and by default name."""
    monkeypatch.chdir(tmp_path)
    sd = reference("resnet18").state_dict()
    variables = torch_compat.torch_to_flax(sd)
    for name in ("variables.safetensors", "trained.safetensors"):
        jaxport.save_variables(name, variables, arch="resnet18")
    kept = {name: Path(name).read_bytes() for name in ("variables.safetensors", "trained.safetensors")}
    torch.save(sd, "variables.pt")
    assert main(["port", "variables.pt"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "were not ported from a checkpoint", "--force")
    assert main(["port", "variables.pt", "--out", "trained.safetensors"]) == 2
    _assert_one_line_error(capsys.readouterr().err, "is not an earlier port of a checkpoint", "--force")
    assert {name: Path(name).read_bytes() for name in kept} == kept
    assert main(["port", "variables.pt", "--out", "trained.safetensors", "--force"]) == 0


# --- regressions from the adversarial probe ------------------------------------------------

def _unwritable_dir(tmp_path):
    """A directory that refuses new files here: a read-only one, or /sys when running as root."""
    import tempfile

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    for candidate in (read_only, Path("/sys")):
        try:
            with tempfile.TemporaryFile(dir=candidate):
                pass
        except OSError:
            return candidate
    pytest.skip("no directory refuses writes here (root, and /sys is writable)")


def test_an_unwritable_out_is_refused_before_any_work(tmp_path, resnet18_checkpoint, capsys):
    """It failed after the conversion, naming a hidden temporary file."""
    locked = _unwritable_dir(tmp_path)
    port = tmp_path / "r18.safetensors"
    assert main(["port", str(resnet18_checkpoint), "--out", str(port)]) == 0
    capsys.readouterr()
    for out in (locked / "x.safetensors", locked / "missing" / "dir" / "x.safetensors"):
        # The checkpoint does not exist: only a check made before loading names --out.
        for argv in (["port", str(tmp_path / "nope.pth"), "--out", str(out)], ["export", str(port), "--out", str(out)]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            _assert_one_line_error(err, f"`--out` (={out}) cannot be written", "choose another output path")
            assert ".tmp" not in err and "nope.pth" not in err
    # A library write names the path asked for, not its temporary file.
    with pytest.raises(OSError) as e:
        jaxport.save_variables(locked / "v.safetensors", {"params": {"w": np.zeros(2, np.float32)}})
    assert str(locked / "v.safetensors") in str(e.value) and ".tmp" not in str(e.value)


def test_port_dtype_casts_like_torch_and_verifies(tmp_path, resnet18_checkpoint, capsys):
    sd = torch.load(resnet18_checkpoint, weights_only=True)["model"]
    for dtype in ("bfloat16", "float16"):
        out = tmp_path / f"r18_{dtype}.safetensors"
        assert main(["port", str(resnet18_checkpoint), "--out", str(out), "--dtype", dtype, "--verify"]) == 0
        printed = capsys.readouterr().out
        assert f"torch.float32 cast to {dtype} (--dtype)" in printed and "verify: PASS" in printed
        back = torch_compat.flax_to_torch(jaxport.load_variables(out), "resnet18")
        for k, t in sd.items():
            expected = t.to(getattr(torch, dtype)) if t.is_floating_point() else t
            assert back[k].dtype == expected.dtype and torch.equal(back[k], expected), k
        # `jaxport verify` checks the port against the checkpoint cast as the port was
        assert main(["verify", str(resnet18_checkpoint), str(out), "--mode", "eval"]) == 0
        assert f"checking it against the checkpoint cast to {dtype}" in capsys.readouterr().out
    up = tmp_path / "half.pth"
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in sd.items()}, up)
    assert main(["port", str(up), "--out", str(tmp_path / "up.safetensors"), "--dtype", "float32"]) == 0
    assert jaxport.load_variables(tmp_path / "up.safetensors")["params"]["fc"]["kernel"].dtype == np.float32

    # A float16 port checked against a checkpoint with a value beyond float16's range was exit 2
    # with the converter's advice for `port`, "(CLI --dtype)", a flag verify does not have. No
    # float16 port of that checkpoint exists, so this one is not its port: a mismatch, status 1.
    big = tmp_path / "big.pth"
    torch.save({**sd, "fc.bias": sd["fc.bias"].clone().index_fill_(0, torch.tensor([0]), 1e5)}, big)
    assert main(["verify", str(big), str(tmp_path / "r18_float16.safetensors"), "--mode", "eval"]) == 1
    printed = capsys.readouterr().out
    assert ("weights: state_dict['fc.bias'] holds 100000, beyond float16's range (max 65504): no float16 port of the "
            "checkpoint exists, so '" in printed and "verify: FAIL: the variables are not the checkpoint's port"
            in printed), printed
    # A float8 checkpoint converts only with a cast; verify pointed at the same missing flag.
    f8 = tmp_path / "f8.pth"
    torch.save({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in sd.items()}, f8)
    assert main(["verify", str(f8)]) == 2
    _assert_one_line_error(capsys.readouterr().err, "holds float8_e4m3fn weights, which jax and numpy cannot compute "
                           f"with; port it with a cast first (jaxport port {f8} --dtype float32), then check that "
                           f"port: jaxport verify {f8} PORT")
    assert main(["port", str(f8), "--out", str(tmp_path / "f8.safetensors"), "--dtype", "float32"]) == 0
    assert main(["verify", str(f8), str(tmp_path / "f8.safetensors"), "--mode", "eval"]) == 0  # as it says


def test_port_loads_metadata_saved_beside_the_weights(tmp_path, capsys):
    """`torch.save({**model.state_dict(), "epoch": 3, "arch": "resnet18"})` was refused."""
    sd = reference("resnet18").state_dict()
    path = tmp_path / "meta.pth"
    torch.save({**sd, "epoch": 3, "arch": "resnet18"}, path)
    out = tmp_path / "meta.safetensors"
    assert main(["port", str(path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "jaxport: warning:" in captured.err and "'epoch' (int), 'arch' (str)" in captured.err
    back = torch_compat.flax_to_torch(jaxport.load_variables(out), "resnet18")
    assert all(torch.equal(back[k], v) for k, v in sd.items())


def test_out_is_never_a_device_fifo_or_socket_even_with_force(tmp_path, resnet18_checkpoint, capsys):
    """`--force` replaced a FIFO or a device node (`mknod fakenull c 1 3`) with a file."""
    import socket

    port = tmp_path / "r18.safetensors"
    assert main(["port", str(resnet18_checkpoint), "--out", str(port)]) == 0
    capsys.readouterr()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    specials = [(fifo, "a FIFO"), (sock_path, "a socket"), (Path("/dev/null"), "a character device")]
    link = tmp_path / "link"
    link.symlink_to(fifo)
    specials.append((link, "a FIFO"))
    try:
        for out, kind in specials:
            for argv in (["port", str(resnet18_checkpoint)], ["export", str(port)]):
                for force in ([], ["--force"]):
                    assert main([*argv, "--out", str(out), *force]) == 2
                    _assert_one_line_error(capsys.readouterr().err, f"`--out` (={out}) exists and is {kind}",
                                           "not a regular file", "choose another output path")
            assert not out.is_file()
    finally:
        sock.close()
    assert fifo.exists() and not fifo.is_file()
    # A symlink to a regular file is still replaced with --force.
    target = tmp_path / "target.safetensors"
    target.write_bytes(b"")
    (tmp_path / "to_file").symlink_to(target)
    assert main(["port", str(resnet18_checkpoint), "--out", str(tmp_path / "to_file"), "--force"]) == 0


def test_an_out_ending_in_a_separator_is_refused(tmp_path, resnet18_checkpoint, capsys):
    """`--out newdir/` wrote a file named `newdir`."""
    port = tmp_path / "r18.safetensors"
    assert main(["port", str(resnet18_checkpoint), "--out", str(port)]) == 0
    capsys.readouterr()
    out = str(tmp_path / "newdir") + "/"
    for argv in (["port", str(resnet18_checkpoint)], ["export", str(port)]):
        assert main([*argv, "--out", out]) == 2
        _assert_one_line_error(capsys.readouterr().err, f"`--out` (={out}) ends in a path separator",
                               f"e.g. {tmp_path / 'newdir' / 'model.safetensors'}")
        assert not (tmp_path / "newdir").exists()


def test_port_refuses_a_checkpoint_damaged_inside_a_tensor(tmp_path, resnet18_checkpoint, capsys):
    """The CLI checks the zip's CRCs (torch.load does not): 64 zeroed bytes in a weight were
    ported, and `verify` passed, since both sides read the same damaged weights."""
    import struct
    import zipfile

    data = bytearray(resnet18_checkpoint.read_bytes())
    with zipfile.ZipFile(resnet18_checkpoint) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len + 1000
    data[at:at + 64] = bytes(64)
    bad = tmp_path / "bad.pth"
    bad.write_bytes(bytes(data))
    out = tmp_path / "bad.safetensors"
    assert main(["port", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxport: error: checkpoint '{bad}' is corrupt: 1 of its") and info.filename in err, err
    assert not out.exists()
