"""torch_compat._load / _cuda_tag: every format x wrapper x dtype loads to the original tensors;
hostile, broken and unrecognisable files give one CheckpointError and never run code.

Equality is exact (`torch.equal`, dtype and key order checked): loading must not change a bit.
"""
import argparse
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tarfile
import warnings
import zipfile

import pytest
import safetensors.torch
import torch
import torchvision
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from jaxport._errors import CheckpointError, ConfigError
from torch_compat._cuda_tag import saving_as_cuda
from torch_compat._load import load_state_dict, weights_only_is_safe

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4, 2)
    )
    net[1].running_mean.uniform_()  # buffers that differ from their defaults
    return net.to(dtype)


def save(obj, path, fmt):
    if fmt == "zip":
        torch.save(obj, path)
    elif fmt == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    else:
        safetensors.torch.save_file(obj, path)
    return path


def assert_same(loaded, expected):
    assert type(loaded) is dict
    assert list(loaded) == list(expected)
    for key, want in expected.items():
        got = loaded[key]
        assert type(got) is torch.Tensor and got.device.type == "cpu", key
        assert got.dtype == want.dtype, key
        assert torch.equal(got, want), key


def one_line_error(excinfo, path):
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message
    assert os.fspath(path) in message
    return message


# --- formats x wrappers x dtypes --------------------------------------------------------------

def _prefixed(sd, prefix):
    return {prefix + k: v for k, v in sd.items()}


def _lightning(sd):
    return {
        "epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
        "state_dict": _prefixed(sd, "model."), "loops": {"fit_loop": {"epoch_progress": {}}},
        "callbacks": {}, "optimizer_states": [], "lr_schedulers": [],
        "hyper_parameters": {"lr": 0.1},
    }


def _torchvision_reference(sd, with_ema=False):
    """What torchvision's references/classification/train.py writes (args: argparse.Namespace)."""
    net = tiny_net(next(iter(sd.values())).dtype)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 3, 3).to(dtype=next(iter(sd.values())).dtype)).float().sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30)
    checkpoint = {
        "model": sd, "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict(),
        "epoch": 7,
        "args": argparse.Namespace(model="resnet50", lr=0.5, epochs=600, model_ema=with_ema,
                                   weight_decay=2e-5, data_path="/data", amp=True, resume=""),
    }
    return checkpoint


ALL_FORMATS = ("zip", "legacy", "safetensors")
# name -> (wrap the state dict into a checkpoint, formats it can be saved in)
WRAPPERS = {
    "plain": (lambda sd: sd, ALL_FORMATS),
    "module": (lambda sd: _prefixed(sd, "module."), ALL_FORMATS),
    "orig_mod": (lambda sd: _prefixed(sd, "_orig_mod."), ALL_FORMATS),
    "module_orig_mod": (lambda sd: _prefixed(sd, "module._orig_mod."), ALL_FORMATS),
    "orig_mod_module": (lambda sd: _prefixed(sd, "_orig_mod.module."), ALL_FORMATS),
    "lightning_keys": (lambda sd: _prefixed(sd, "model."), ("safetensors",)),
    "lightning": (_lightning, ("zip", "legacy")),
    "lightning_compiled": (lambda sd: {"state_dict": _prefixed(sd, "model._orig_mod.")}, ("zip",)),
    "torchvision_reference": (_torchvision_reference, ("zip", "legacy")),
    "model_state_dict": (
        lambda sd: {"model_state_dict": sd, "epoch": 2, "loss": 0.3}, ("zip", "legacy")
    ),
    "ddp_in_reference": (lambda sd: {"model": _prefixed(sd, "module."), "epoch": 1}, ("zip",)),
}
CASES = [
    pytest.param(fmt, wrapper, dtype, id=f"{fmt}-{wrapper}-{str(dtype)[6:]}")
    for wrapper, (_, fmts) in WRAPPERS.items() for fmt in fmts for dtype in DTYPES
]


@pytest.mark.parametrize("fmt,wrapper,dtype", CASES)
def test_formats_wrappers_dtypes(tmp_path, fmt, wrapper, dtype):
    sd = tiny_net(dtype).state_dict()  # an OrderedDict carrying torch's `_metadata`
    assert hasattr(sd, "_metadata")
    obj = WRAPPERS[wrapper][0](sd if fmt != "safetensors" else dict(sd))
    path = save(obj, tmp_path / "ckpt.bin", fmt)  # extension says nothing: magic bytes decide
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings on a current torch
        loaded = load_state_dict(path)
    if fmt == "safetensors":  # data order: safetensors sorts tensors on save
        assert sorted(loaded) == sorted(sd)
        loaded = {k: loaded[k] for k in sd}
    assert_same(loaded, sd)


def test_argparse_namespace_is_allowed_only_during_the_load(tmp_path):
    sd = tiny_net().state_dict()
    path = save(_torchvision_reference(sd), tmp_path / "checkpoint.pth", "zip")
    assert_same(load_state_dict(path), sd)
    assert argparse.Namespace not in torch.serialization.get_safe_globals()
    with pytest.raises(pickle.UnpicklingError, match="argparse.Namespace"):
        torch.load(path, weights_only=True)  # not allow-listed globally


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("ema_key", ["model_ema", "ema", "state_dict_ema", "model_ema_state_dict", "ema_state_dict"])
def test_ema_is_taken_only_when_asked(tmp_path, fmt, ema_key):
    net = tiny_net()
    ema_model = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema_model.update_parameters(tiny_net(seed=1))  # EMA weights now differ from the model's
    ema_sd = ema_model.state_dict()
    assert list(ema_sd)[0] == "n_averaged"
    assert all(k.startswith("module.") for k in list(ema_sd)[1:])
    checkpoint = _torchvision_reference(net.state_dict(), with_ema=True)
    checkpoint[ema_key] = ema_sd
    path = save(checkpoint, tmp_path / "ema.pth", fmt)

    assert_same(load_state_dict(path), net.state_dict())
    assert_same(load_state_dict(path, ema=True), ema_model.module.state_dict())
    assert not torch.equal(ema_model.module[0].weight, net[0].weight)


def test_bare_averaged_model_state_dict(tmp_path):
    ema_model = AveragedModel(tiny_net())
    path = save(ema_model.state_dict(), tmp_path / "ema_only.pt", "zip")
    assert_same(load_state_dict(path), ema_model.module.state_dict())


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_ema_takes_an_averaged_model_under_a_model_key(tmp_path, fmt):
    """`{"model": AveragedModel(m).state_dict()}` was refused with --ema ("no EMA weights"), though
    a bare AveragedModel state dict loads with it."""
    ema_model = AveragedModel(tiny_net(), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema_model.update_parameters(tiny_net(seed=1))
    for key in ("model", "state_dict"):
        path = save({key: ema_model.state_dict(), "epoch": 3}, tmp_path / f"{key}.pth", fmt)
        assert_same(load_state_dict(path, ema=True), ema_model.module.state_dict())
        assert_same(load_state_dict(path), ema_model.module.state_dict())  # n_averaged is left out either way


def test_ema_missing_is_an_error_listing_keys(tmp_path):
    path = save({"model": tiny_net().state_dict(), "epoch": 3}, tmp_path / "no_ema.pt", "zip")
    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(path, ema=True)
    message = one_line_error(excinfo, path)
    assert "['model', 'epoch']" in message and "model_ema" in message

    flat = save(dict(tiny_net().state_dict()), tmp_path / "flat.safetensors", "safetensors")
    with pytest.raises(CheckpointError, match="no EMA weights: found a plain state dict"):
        load_state_dict(flat, ema=True)


def test_ema_and_a_prefix_that_select_different_copies_are_named(tmp_path):
    """torchvision's reference scripts save `{"model": ..., "model_ema": AveragedModel}`. With
    prefix="model" and ema=True the EMA copy has no `model.` keys and checkpoint['model'] no EMA
    copy; the error said the file had "no EMA weights" at all."""
    net = tiny_net()
    ema = torch.optim.swa_utils.AveragedModel(net)
    path = save({"model": net.state_dict(), "model_ema": ema.state_dict(), "epoch": 3}, tmp_path / "ref.pth", "zip")
    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(path, prefix="model", ema=True)
    message = one_line_error(excinfo, path)
    assert ("`prefix` (='model', CLI --prefix) leads to checkpoint['model'], which holds no EMA weights of its own, "
            "and the checkpoint's EMA weights have no keys under it: the two select different copies here; pass "
            "--ema alone for the EMA weights, or --prefix model alone for checkpoint['model']") in message, message
    assert load_state_dict(path, ema=True).keys() == load_state_dict(path, prefix="model").keys()  # as it says
    # Without any EMA copy, the error still says exactly that.
    plain = save({"model": net.state_dict(), "epoch": 3}, tmp_path / "plain.pth", "zip")
    with pytest.raises(CheckpointError, match=r"has no EMA weights: found top-level keys \['model', 'epoch'\]"):
        load_state_dict(plain, prefix="model", ema=True)


def test_ema_only_checkpoint_needs_ema_flag(tmp_path):
    path = save({"model_ema": tiny_net().state_dict(), "epoch": 3}, tmp_path / "e.pt", "zip")
    with pytest.raises(CheckpointError, match="pass ema=True"):
        load_state_dict(path)


def test_prefix_stripped_only_when_every_key_has_it(tmp_path):
    sd = {"module.conv.weight": torch.ones(2), "head.weight": torch.zeros(2),
          "_orig_mod.x": torch.ones(1)}
    assert_same(load_state_dict(save(sd, tmp_path / "mixed.pt", "zip")), sd)
    nested = {"module.model.conv.weight": torch.ones(2), "module.model.fc.bias": torch.zeros(2)}
    loaded = load_state_dict(save(nested, tmp_path / "nested.pt", "zip"))
    assert list(loaded) == ["conv.weight", "fc.bias"]


def test_resnet18_state_dict_and_mmap(tmp_path):
    sd = torchvision.models.resnet18().state_dict()
    path = save(sd, tmp_path / "resnet18.pth", "zip")
    assert_same(load_state_dict(path), sd)
    assert_same(load_state_dict(path, mmap=True), sd)
    legacy = save(sd, tmp_path / "resnet18_legacy.pth", "legacy")
    assert_same(load_state_dict(legacy, mmap=True), sd)  # mmap is ignored for legacy files


# --- trusted loads and hostile pickles -------------------------------------------------------

class Payload:
    """Unpickling this runs `os.system`: creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


class EvalPayload(Payload):
    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.mark.parametrize(
    "fmt,payload,named",
    [
        ("zip", Payload, "posix.system (os.system)"),
        ("legacy", Payload, "posix.system (os.system)"),
        ("zip", EvalPayload, "builtins.eval"),
        ("protocol4", Payload, "FRAME"),
    ],
)
def test_hostile_pickle_is_refused_and_never_runs(tmp_path, fmt, payload, named):
    marker = tmp_path / "payload_ran"
    sd = tiny_net().state_dict()
    checkpoint = {"model": sd, "extra": payload(marker)}
    path = tmp_path / "hostile.pth"
    if fmt == "protocol4":
        torch.save(checkpoint, path, pickle_protocol=4)
    else:
        save(checkpoint, path, fmt)

    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(path)
    message = one_line_error(excinfo, path)
    assert named in message
    assert "nothing from the file was run" in message and "trusted=True" in message
    assert excinfo.value.__cause__ is not None
    assert not marker.exists()

    # on purpose, in tmp_path: trusted=True really unpickles
    assert_same(load_state_dict(path, trusted=True), sd)
    assert marker.exists()


def test_trusted_whole_module(tmp_path):
    net = tiny_net(torch.bfloat16)
    path = tmp_path / "whole_model.pt"
    torch.save(net, path)
    with pytest.raises(CheckpointError, match="torch.nn.modules.container.Sequential"):
        load_state_dict(path)
    assert_same(load_state_dict(path, trusted=True), net.state_dict())
    with warnings.catch_warnings():
        # torch.jit is deprecated: FutureWarning in torch 2.14, DeprecationWarning in 2.11.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_same(load_state_dict(_torchscript(tmp_path / "ts.pt"), trusted=True),
                    tiny_net().state_dict())
    torch.save({"model": nn.DataParallel(net), "epoch": 1}, path)  # a module inside a dict
    assert_same(load_state_dict(path, trusted=True), net.state_dict())


def test_parameters_become_plain_tensors(tmp_path):
    w = nn.Parameter(torch.randn(3))
    loaded = load_state_dict(save({"w": w}, tmp_path / "p.pt", "zip"))
    assert type(loaded["w"]) is torch.Tensor and not loaded["w"].requires_grad
    assert torch.equal(loaded["w"], w.detach())


# --- torch version policy ------------------------------------------------------------------

def test_weights_only_is_safe_on_installed_torch():
    safe, message = weights_only_is_safe()
    assert safe and torch.__version__ in message


def test_a_namespace_turned_into_a_numpy_dtype_is_refused(tmp_path):
    """argparse.Namespace is allowed, and a pickle may set its `__class__`: here to numpy.dtype
    (jaxport's stand-in), skipping the stand-in's checks and carrying another Namespace as its
    dtype. numpy happened to refuse it ("truncated or corrupt ... re-download"); the stand-in
    now refuses it by name."""
    def text(value):  # BINUNICODE
        return b"X" + struct.pack("<I", len(value)) + value.encode()

    namespace = b"cargparse\nNamespace\n)\x81"
    inner = namespace + b"}(" + text("itemsize") + b"K\x08" + text("dtype") + text("f8") + b"ub"
    fake = namespace + b"N}(" + text("__class__") + b"cnumpy\ndtype\n" + text("dtype") + inner + b"u\x86b"
    data = b"c_codecs\nencode\n(" + text("\x10" * 8) + text("latin1") + b"tR"
    scalar = b"cnumpy.core.multiarray\nscalar\n(" + fake + data + b"tR"
    save({"w": ONE}, tmp_path / "m.pt", "zip")
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        members = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(tmp_path / "m.pt", "w") as z:
        for name, content in members.items():
            z.writestr(name, b"\x80\x02}" + text("meta") + scalar + b"s." if name.endswith("data.pkl") else content)
    with pytest.raises(CheckpointError, match=r"holds a numpy value whose dtype is Namespace\(itemsize=8, dtype='f8'\), "
                                              r"not a pickled numpy dtype.*nothing from the file was run"):
        load_state_dict(tmp_path / "m.pt")


def test_old_torch_refuses_untrusted_pickles(tmp_path, monkeypatch):
    sd = tiny_net().state_dict()
    pt = save(sd, tmp_path / "a.pt", "zip")
    st = save(dict(sd), tmp_path / "a.safetensors", "safetensors")
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    safe, message = weights_only_is_safe()
    assert not safe and "2.5.1" in message and "2.10" in message
    with pytest.raises(CheckpointError, match=r"refusing to load checkpoint .*2\.5\.1"):
        load_state_dict(pt)
    assert_same(load_state_dict(pt, trusted=True), sd)
    loaded = load_state_dict(st)  # no pickle involved
    assert_same({k: loaded[k] for k in sd}, sd)


def test_torch_2_6_to_2_9_warns(tmp_path, monkeypatch):
    sd = tiny_net().state_dict()
    pt = save(sd, tmp_path / "a.pt", "zip")
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    assert weights_only_is_safe()[0] is False
    with pytest.warns(UserWarning, match=r"torch 2\.8\.0 .*torch>=2\.10"):
        assert_same(load_state_dict(pt), sd)


# --- broken and unrecognisable files -------------------------------------------------------

def _write(path, data):
    path.write_bytes(data)
    return path


def _safetensors_bytes(header, data=b"", claimed_len=None):
    """A safetensors file written by hand; `claimed_len` lets the length field lie."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if claimed_len is None else claimed_len) + raw + data


def _w(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"w": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


def _zip_with_text(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "not weights")
    return path


def _torchscript(path):
    with warnings.catch_warnings():
        # torch.jit is deprecated (see test_trusted_whole_module), but such files exist.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(tiny_net()), path)
    return path


def _truncated(tmp_path, fmt):
    sd = torchvision.models.resnet18().state_dict() if fmt == "zip" else tiny_net().state_dict()
    full = save(dict(sd), tmp_path / f"full.{fmt}", fmt).read_bytes()
    return _write(tmp_path / "half.pt", full[: len(full) // 2])


def _run_dir(d):
    (d / "run1").mkdir()
    (d / "run1" / "last.ckpt").touch()
    return d / "run1"


def _symlinks(d, *links):
    for name, target in links:
        os.symlink(target, d / name)
    return d / links[0][0]


def _zip_member_added(path):
    save({"w": ONE}, path, "zip")
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("notes.txt", "trained on 8 GPUs")
    return path


ONE = torch.ones(1)
# case -> (make the file in a tmp dir, regex the one-line message must match)
BROKEN = {
    "missing": (lambda d: d / "nope.pt", "does not exist"),
    "directory": (_run_dir, r"is a directory \(it contains last.ckpt\)"),
    # os.path.exists said "does not exist" for both
    "symlink_loop": (lambda d: _symlinks(d, ("loop1", "loop2"), ("loop2", "loop1")),
                     "cannot be reached: a symbolic link loop"),
    "dangling_symlink": (lambda d: _symlinks(d, ("model.pt", "gone.pt")),
                         "is a symbolic link to 'gone.pt', which does not exist"),
    # It was "not a torch.save checkpoint (no data.pkl record)", though it has one.
    "zip_member_added": (lambda d: _zip_member_added(d / "x.pt"),
                         r"is a torch.save zip archive with a member outside its folder \(\['notes.txt'\]\)"),
    "empty": (lambda d: _write(d / "empty.pt", b""), r"is empty \(0 bytes\)"),
    "text": (lambda d: _write(d / "notes.pt", b"epoch 3 loss 0.12\n"), "a text file"),
    "png": (lambda d: _write(d / "img.pth", b"\x89PNG\r\n\x1a\n" + bytes(64)), "a PNG image"),
    "html": (lambda d: _write(d / "dl.pth", b"<!DOCTYPE html><html>Not Found"), "HTML page"),
    "lfs_pointer": (
        lambda d: _write(d / "w.pth", b"version https://git-lfs.github.com/spec/v1\n"),
        "git lfs pull",
    ),
    "truncated_zip": (
        lambda d: _truncated(d, "zip"),
        "truncated or corrupt: the zip archive has no central directory",
    ),
    "truncated_legacy": (lambda d: _truncated(d, "legacy"), "truncated or corrupt"),
    "truncated_safetensors": (lambda d: _truncated(d, "safetensors"), "truncated or corrupt"),
    "empty_zip": (
        lambda d: zipfile.ZipFile(d / "x.zip", "w").close() or d / "x.zip",
        "not a PyTorch or safetensors checkpoint: it looks like an empty zip archive",
    ),
    "non_torch_zip": (
        lambda d: _zip_with_text(d / "x.pt"), r"is a zip archive holding \['readme.txt'\], not a checkpoint"
    ),
    "plain_pickle": (
        lambda d: _write(d / "p.pkl", pickle.dumps({"a": 1}, protocol=2)),
        "not a torch.save checkpoint",
    ),
    "safetensors_header_lies": (
        lambda d: _write(d / "lie.safetensors", _safetensors_bytes(_w(), bytes(4), 10**6)),
        "header claims 1000000 bytes but only 65 bytes follow",
    ),
    "safetensors_bad_json": (
        lambda d: _write(d / "j.safetensors", _safetensors_bytes(b"{not json}")),
        "not valid JSON",
    ),
    "safetensors_offsets_past_end": (
        lambda d: _write(d / "o.safetensors", _safetensors_bytes(_w(shape=[4], offsets=[0, 16]),
                                                                 bytes(8))),
        r"tensor 'w' claims bytes 0\.\.16 but the data section has 8 bytes",
    ),
    # safetensors refuses non-string metadata: it was "truncated or corrupt ... re-download it".
    "safetensors_number_metadata": (
        lambda d: _write(d / "m.safetensors", _safetensors_bytes({"__metadata__": {"epoch": 3}, **_w()}, bytes(4))),
        r"its header's __metadata__ maps \['epoch'\] to non-strings \(e.g. 3\).*only string values.*metadata=",
    ),
    "safetensors_bad_dtype": (
        lambda d: _write(d / "t.safetensors", _safetensors_bytes(_w(dtype="F99"), bytes(4))),
        "truncated or corrupt",
    ),
    "top_level_list": (lambda d: save([ONE], d / "list.pt", "zip"), "holds a list at the top"),
    "top_level_tensor": (lambda d: save(ONE, d / "t.pt", "zip"), "holds a Tensor at the top"),
    "no_state_dict": (
        lambda d: save({"epoch": 3, "optimizer": {"state": {}}}, d / "o.pt", "zip"),
        r"found top-level keys \['epoch', 'optimizer'\], looked for .*'model_state_dict'",
    ),
    # Metadata beside the weights is ignored (test_metadata_beside_the_weights_is_ignored_with_a_note);
    # tensors inside another value are not metadata: which weights are meant is unclear.
    "non_tensor_value": (
        lambda d: save({"conv.weight": ONE, "optimizer": {"state": {0: {"momentum_buffer": ONE}}}}, d / "v.pt", "zip"),
        "maps 'optimizer' to a dict holding tensors, not a tensor",
    ),
    # An int counter was taken for metadata, dropped, and ported as 0 (torch refuses the file).
    "int_counter": (
        lambda d: save({"bn.weight": ONE, "bn.num_batches_tracked": 5}, d / "c.pt", "zip"),
        "maps 'bn.num_batches_tracked' to an int, not a tensor",
    ),
    "bare_names_beside_metadata": (
        lambda d: save({"w": ONE, "epoch": 3}, d / "b.pt", "zip"), "maps 'epoch' to an int, not a tensor",
    ),
    "non_tensor_in_model": (
        lambda d: save({"model": {"w": ONE, "arch": "r50"}}, d / "m.pt", "zip"),
        r"checkpoint\['model'\] maps 'arch' to a str",
    ),
    "empty_state_dict": (lambda d: save({"state_dict": {}}, d / "e.pt", "zip"), "is empty"),
    "ambiguous": (
        lambda d: save({"state_dict": {"a": ONE}, "model": {"b": ONE}}, d / "a.pt", "zip"),
        "ambiguous",
    ),
    "torchscript": (lambda d: _torchscript(d / "ts.pt"), "TorchScript archive"),
    # A model built under torch.device("meta") (accelerate's init_empty_weights) and saved as
    # is: shapes, no data. It reached users as an internal NotImplementedError.
    "meta_tensors": (
        lambda d: save({"w": torch.empty(2, 3, device="meta"), "b": ONE}, d / "meta.pt", "zip"),
        r"1 of its 2 tensors \(\['w'\]\) are meta tensors, which have a shape but no data",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_files_give_one_clear_error(tmp_path, case):
    make, expected = BROKEN[case]
    path = make(tmp_path)
    with pytest.raises(CheckpointError, match=expected) as excinfo:
        load_state_dict(path)
    one_line_error(excinfo, path)


_SHARED_LIST = """
import sys, time, torch, warnings
from torch_compat import load_state_dict
history = 0
for _ in range(8):  # one list referenced 16 times per level: 16**8 paths through 9 lists
    history = [history] * 16
torch.save({"conv1.weight": torch.ones(1), "history": history}, sys.argv[1])
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    print(sorted(load_state_dict(sys.argv[1])), [str(w.message) for w in seen])
"""


def test_a_list_shared_many_times_is_walked_once(tmp_path):
    """A 2 KB pickle that references one list 16 times at each of 8 levels: the check of what
    is metadata followed every path (about 4e9) and hung `jaxport port` for hours, after
    torch.load had read the file in 0.02 s. (A subprocess, so the old hang fails the test.)"""
    proc = subprocess.run([sys.executable, "-c", _SHARED_LIST, str(tmp_path / "bomb.pt")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("['conv1.weight'] [\"checkpoint") and "ignored 1 metadata entry" in proc.stdout


def test_a_slash_in_one_key_is_not_taken_for_a_jaxport_file(tmp_path):
    """Any key with a `/` made a safetensors state dict "already a jaxport variables file"; a
    port's keys all have one."""
    sd = {"conv.weight": torch.ones(2), "odd/name": torch.zeros(1)}
    safetensors.torch.save_file(sd, tmp_path / "m.safetensors")
    assert list(load_state_dict(tmp_path / "m.safetensors")) == ["conv.weight", "odd/name"]


# --- checkpoints saved "from the GPU" ------------------------------------------------------

@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_saving_as_cuda_tags_and_loads_on_cpu(tmp_path, fmt):
    sd = {"module." + k: v for k, v in tiny_net(torch.bfloat16).state_dict().items()}
    path = tmp_path / "gpu.pth"
    with saving_as_cuda():
        save(sd, path, fmt)
    if fmt == "zip":
        with zipfile.ZipFile(path) as z:
            pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    else:
        pickled = path.read_bytes()
    assert b"cuda:0" in pickled and b"cpu" not in pickled
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)  # what a naive load does on a CPU-only machine
    expected = {k[len("module."):]: v for k, v in sd.items()}
    assert_same(load_state_dict(path), expected)
    assert_same(load_state_dict(path, mmap=True), expected)

    save(sd, path, fmt)  # outside the context: ordinary CPU tags again
    data = zipfile.ZipFile(path).read("gpu/data.pkl") if fmt == "zip" else path.read_bytes()
    assert b"cuda" not in data and b"cpu" in data


def test_saving_as_cuda_nests_registers_once_and_validates():
    registry = torch.serialization._package_registry
    with saving_as_cuda("cuda:1"):
        with saving_as_cuda("cuda:0"):
            pass
    with saving_as_cuda():
        pass
    assert sum(getattr(tagger, "__module__", "") == "torch_compat._cuda_tag"
               for _, tagger, _ in registry) == 1
    with pytest.raises(ConfigError, match="'cpu'"):
        with saving_as_cuda("cpu"):
            pass


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_a_torch_file_named_safetensors_loads_by_its_content(tmp_path, fmt):
    """torch.load hands any path named *.safetensors to safetensors; the first bytes decide here."""
    sd = tiny_net().state_dict()
    path = save(sd, tmp_path / "weights.safetensors", fmt)
    assert_same(load_state_dict(path), sd)
    assert_same(load_state_dict(path, mmap=True), sd)


class _DefinedInAScript(nn.Module):  # pickled under a module name the loader cannot import
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


# Python 3.11's repr of pytest's __main__ module goes through a deprecated importlib hook.
@pytest.mark.filterwarnings("ignore:BuiltinImporter.module_repr:DeprecationWarning")
def test_a_trusted_load_of_a_class_that_cannot_be_imported_says_so(tmp_path):
    """It was reported as 'truncated or corrupt; re-download it'."""
    import sys

    net, main_module = _DefinedInAScript(), sys.modules["__main__"]
    _DefinedInAScript.__module__ = "__main__"  # as if saved from `python train.py`
    main_module._DefinedInAScript = _DefinedInAScript
    try:
        path = tmp_path / "whole.pt"
        torch.save(net, path)
    finally:
        _DefinedInAScript.__module__ = __name__
        del main_module._DefinedInAScript
    with pytest.raises(CheckpointError) as e:
        load_state_dict(path, trusted=True)
    one_line_error(e, path)
    # (pytest's own __main__ module is named `pytest.__main__`; a script's is `__main__`)
    assert re.search(r"class `\S*__main__\._DefinedInAScript` cannot be imported here", str(e.value)), str(e.value)
    assert "re-download" not in str(e.value)


def test_a_jaxport_variables_file_is_named_as_such(tmp_path):
    import jaxport
    import torch_compat

    path = jaxport.save_variables(tmp_path / "port.safetensors", torch_compat.torch_to_flax(
        torchvision.models.resnet18().state_dict()), arch="resnet18")
    with pytest.raises(CheckpointError, match="is already a jaxport variables file.*jaxport export") as e:
        load_state_dict(path)
    one_line_error(e, path)


def test_a_path_that_is_not_a_path_is_named():
    with pytest.raises(CheckpointError, match="`path` is builtins.NoneType; expected the path of a checkpoint file"):
        load_state_dict(None)


# --- regressions from the adversarial probe ------------------------------------------------

def test_a_tar_archive_is_named_for_what_it_holds(tmp_path):
    """`tar cf x.pth r18.pth` was called torch's pre-0.4 format; --trusted then said 'truncated'."""
    inner = save(tiny_net().state_dict(), tmp_path / "r18.pth", "zip")
    archive = tmp_path / "x.pth"
    with tarfile.open(archive, "w") as tar:
        tar.add(inner, arcname="r18.pth")
    for trusted in (False, True):
        with pytest.raises(CheckpointError) as e:
            load_state_dict(archive, trusted=trusted)
        message = one_line_error(e, archive)
        assert "is a tar archive holding ['r18.pth'], not a checkpoint; extract the checkpoint" in message
        assert "pre-0.4" not in message and "trusted" not in message and "truncated" not in message

    legacy = tmp_path / "legacy.tar"  # the members torch < 0.4 wrote: still named as that format
    with tarfile.open(legacy, "w") as tar:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            tar.add(inner, arcname=name)
    with pytest.raises(CheckpointError, match="pre-0.4 .tar format"):
        load_state_dict(legacy)


def _pickled(path, obj, protocol, how):
    if how == "pickle.dump":
        with open(path, "wb") as f:
            pickle.dump(obj, f, protocol=protocol)
    else:
        torch.save(obj, path, pickle_protocol=protocol, _use_new_zipfile_serialization=how == "zip")
    return path


@pytest.mark.parametrize("protocol", [0, 1])
@pytest.mark.parametrize("how", ["pickle.dump", "legacy", "zip"])
def test_protocol_0_and_1_pickles_are_named_accurately(tmp_path, protocol, how):
    """They were 'not a PyTorch checkpoint' (legacy) or 'protocol 4+' (zip). torch's weights-only
    unpickler reads protocol 2+ only, and torch.load cannot read protocol 0 back at all."""
    sd = tiny_net().state_dict()
    path = _pickled(tmp_path / "old.pt", sd, protocol, how)
    with pytest.raises(CheckpointError) as e:
        load_state_dict(path)
    message = one_line_error(e, path)
    assert "nothing from the file was run" in message and "4+" not in message
    if how == "pickle.dump":
        assert f"is a pickle file (protocol {protocol}) but not a torch.save checkpoint" in message
        assert "trusted" not in message
    else:
        assert f"torch.save(..., pickle_protocol={protocol})" in message
        assert ("trusted=True" in message) == (protocol == 1)
    if how != "pickle.dump" and protocol == 1:
        assert_same(load_state_dict(path, trusted=True), sd)
    elif how != "pickle.dump":
        with pytest.raises(CheckpointError, match="cannot read back, trusted or not"):
            load_state_dict(path, trusted=True)


@pytest.mark.parametrize("protocol", [0, 1])
@pytest.mark.parametrize("how", ["pickle.dump", "legacy"])
def test_hostile_protocol_0_and_1_pickles_never_run(tmp_path, protocol, how):
    marker = tmp_path / "payload_ran"
    path = _pickled(tmp_path / "hostile.pt", {"model": tiny_net().state_dict(), "x": Payload(marker)}, protocol, how)
    with pytest.raises(CheckpointError, match="nothing from the file was run"):
        load_state_dict(path)
    assert not marker.exists()


def test_ema_takes_a_bare_averaged_model_state_dict(tmp_path):
    """`--ema` on `AveragedModel(model).state_dict()` said the file had no EMA weights."""
    net = tiny_net()
    ema_model = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema_model.update_parameters(tiny_net(seed=1))
    assert not torch.equal(ema_model.module[0].weight, net[0].weight)
    path = save(ema_model.state_dict(), tmp_path / "averaged.pt", "zip")
    for ema in (True, False):  # the file is the averaged weights either way
        assert_same(load_state_dict(path, ema=ema), ema_model.module.state_dict())
    # under a state-dict key, too (n_averaged was kept and blocked removing `module.`)
    path = save({"model": ema_model.state_dict(), "epoch": 1}, tmp_path / "wrapped.pt", "zip")
    assert_same(load_state_dict(path), ema_model.module.state_dict())


def test_a_trusted_torchscript_archive_loads_without_warnings(tmp_path):
    """torch.jit.load's deprecation warning reached the user raw."""
    path = _torchscript(tmp_path / "ts.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(load_state_dict(path, trusted=True), tiny_net().state_dict())
    with pytest.raises(CheckpointError, match="is a TorchScript archive"):
        load_state_dict(path)  # never run without trusted=True


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_metadata_beside_the_weights_is_ignored_with_a_note(tmp_path, fmt):
    """`torch.save({**model.state_dict(), "epoch": 3, "arch": "resnet18"}, path)` was refused."""
    sd = torchvision.models.resnet18().state_dict()
    extras = {"epoch": 3, "arch": "resnet18", "best_acc1": 71.5, "args": {"lr": 0.1, "milestones": [30, 60]}}
    path = save({**sd, **extras}, tmp_path / "with_meta.pth", fmt)
    with pytest.warns(UserWarning, match=r"ignored 4 metadata entries of the top-level dict beside its weights: "
                                         r"'epoch' \(int\), 'arch' \(str\), 'best_acc1' \(float\), 'args' \(dict\)"):
        loaded = load_state_dict(path)
    assert_same(loaded, sd)
    path = save({"model": {**sd, "arch": "resnet18"}}, tmp_path / "nested.pth", fmt)
    with pytest.warns(UserWarning, match=r"1 metadata entry of checkpoint\['model'\]"):
        assert_same(load_state_dict(path), sd)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_zero_d_tensors_under_bare_names_are_metadata(tmp_path, fmt):
    """`{**sd, "epoch": 3, "best_acc1": torch.tensor(71.2)}` and `{**AveragedModel(m).state_dict(),
    "epoch": 3}` (its `n_averaged`) were refused, blaming 'epoch'."""
    model = torchvision.models.resnet18()
    sd = model.state_dict()
    path = save({**sd, "epoch": 3, "best_acc1": torch.tensor(71.2)}, tmp_path / "acc.pth", fmt)
    with pytest.warns(UserWarning, match=r"ignored 2 metadata entries .*'epoch' \(int\), 'best_acc1' \(0-d tensor\)"):
        assert_same(load_state_dict(path), sd)
    averaged = torch.optim.swa_utils.AveragedModel(model)
    path = save({**averaged.state_dict(), "epoch": 3}, tmp_path / "avg.pth", fmt)
    with pytest.warns(UserWarning, match=r"'n_averaged' \(0-d tensor\), 'epoch' \(int\)"):
        assert_same(load_state_dict(path), averaged.module.state_dict())
    # What blocks is named: the list holding tensors, not the 'epoch' beside it.
    path = save({**sd, "epoch": 3, "hist": [torch.tensor(1.0)]}, tmp_path / "hist.pth", fmt)
    with pytest.raises(CheckpointError, match=r"maps 'hist' to a list holding tensors, not a tensor"):
        load_state_dict(path)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_pickle_dump_file_is_named_without_the_trusted_hint(tmp_path, protocol):
    """`pickle.dump(sd, f, protocol>=2)` suggested trusted=True, which then failed with "no torch
    magic number": torch.load cannot read such a file at all. Nothing is unpickled to tell."""
    marker = tmp_path / "payload_ran"
    path = tmp_path / "dumped.pkl"
    path.write_bytes(pickle.dumps({"model": tiny_net().state_dict(), "extra": Payload(marker)}, protocol=protocol))
    for trusted in (False, True):
        with pytest.raises(CheckpointError) as excinfo:
            load_state_dict(path, trusted=trusted)
        message = one_line_error(excinfo, path)
        assert f"is a pickle file (protocol {protocol}) but not a torch.save checkpoint (no torch magic number" in message
        assert "nothing from the file was run" in message and "trusted" not in message
        assert not marker.exists()
    # torch.save's own legacy stream, whatever its protocol, still loads
    sd = tiny_net().state_dict()
    legacy = tmp_path / "legacy.pth"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False, pickle_protocol=3)
    assert_same(load_state_dict(legacy), sd)


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_zip_archive_holding_a_checkpoint_is_named(tmp_path, compression):
    """A .zip holding `model/r18.pth` was called "truncated or corrupt" or "no data.pkl record"."""
    sd = tiny_net().state_dict()
    inner = save(sd, tmp_path / "r18.pth", "zip")
    path = tmp_path / "ck.zip"
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.write(inner, "model/r18.pth")
    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(path)
    message = one_line_error(excinfo, path)
    assert "is a zip archive holding ['model/r18.pth'], not a checkpoint; extract the checkpoint from it" in message
    assert "truncated" not in message
    assert_same(load_state_dict(inner), sd)  # a torch.save zip (`r18/data.pkl`, `r18/version`, ...) loads


# --- zip checksums, compressed records, pickle protocol 3, cut-short legacy files ---------------

def _zeroed_inside_a_record(src, dst):
    """`src` with 64 bytes inside its largest tensor record set to zero, as a bad copy leaves it."""
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = max(z.infolist(), key=lambda i: i.compress_size)
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + name_len + extra_len + info.compress_size // 2
    data[at:at + 64] = bytes(64)
    dst.write_bytes(bytes(data))
    return dst, info.filename


def _recompressed(src, dst):
    """`src`'s records deflated, as `zip -r` of an extracted checkpoint writes them."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as out:
        for info in z.infolist():
            out.writestr(info.filename, z.read(info))
    return dst


@pytest.mark.parametrize("compressed", [False, True])
def test_a_zip_damaged_inside_a_tensor_is_refused_with_check_crc(tmp_path, compressed):
    """torch.load checks no CRC: 64 zeroed bytes inside a weight loaded, ported and cross-checked
    as if they were the saved weights."""
    sd = torchvision.models.resnet18(num_classes=10).state_dict()
    good = save(sd, tmp_path / "good.pth", "zip")
    if compressed:
        good = _recompressed(good, tmp_path / "deflated.pth")
    bad, record = _zeroed_inside_a_record(good, tmp_path / "bad.pth")
    assert_same(load_state_dict(good, check_crc=True), sd)
    for mmap in (False, True):
        with pytest.raises(CheckpointError) as excinfo:
            load_state_dict(bad, mmap=mmap, check_crc=True)
        message = one_line_error(excinfo, bad)
        records = len(zipfile.ZipFile(bad).infolist())
        assert f"is corrupt: 1 of its {records} zip records (['{record}'])" in message, message
        assert "re-download or re-save it" in message
    if not compressed:  # what torch.load gives without the check: other weights, no error
        loaded = load_state_dict(bad)
        assert any(not torch.equal(loaded[k], sd[k]) for k in sd)


def test_a_zip_with_compressed_records_loads_memory_mapped_too(tmp_path):
    """mmap=True (the CLI's) failed on it: 'truncated or corrupt ... storage that is not
    resizable; re-download it', for a file torch.load reads."""
    sd = torchvision.models.resnet18(num_classes=10).state_dict()
    deflated = _recompressed(save(sd, tmp_path / "r18.pth", "zip"), tmp_path / "deflated.pth")
    assert_same(dict(torch.load(deflated, weights_only=True)), sd)
    for mmap in (False, True):
        assert_same(load_state_dict(deflated, mmap=mmap), sd)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_pickle_protocol_3_is_named_as_such(tmp_path, fmt):
    """Protocol 3 pickles bytes (numpy numbers) with SHORT_BINBYTES, which the weights-only loader
    does not read: the error said 'the file may be corrupt or use pickle protocol 4+'."""
    import numpy as np

    sd = tiny_net().state_dict()
    path = tmp_path / f"p3_{fmt}.pth"
    torch.save({"model": sd, "best_acc1": np.float32(71.5)}, path, pickle_protocol=3,
               _use_new_zipfile_serialization=fmt == "zip")
    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(path)
    message = one_line_error(excinfo, path)
    assert "SHORT_BINBYTES (pickle protocol 3 or later, e.g. torch.save(..., pickle_protocol=3)" in message
    assert "corrupt" not in message and "4+" not in message and "nothing from the file was run" in message
    torch.save(sd, path, pickle_protocol=3, _use_new_zipfile_serialization=fmt == "zip")
    assert_same(load_state_dict(path), sd)  # no bytes in it: protocol 3 is protocol 2


@pytest.mark.parametrize("size", [2, 3, 5, 8, 11, 13])
def test_a_legacy_file_cut_inside_its_magic_number_is_called_truncated(tmp_path, size):
    """Cut to under 14 bytes it was 'a pickle file ... not a torch.save checkpoint (e.g. written by
    pickle.dump)'."""
    full = save(tiny_net().state_dict(), tmp_path / "full.pth", "legacy").read_bytes()
    cut = _write(tmp_path / "cut.pth", full[:size])
    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(cut)
    assert "truncated or corrupt" in one_line_error(excinfo, cut)


def test_an_unwritable_cache_for_the_default_checkpoint_names_the_way_out(tmp_path, monkeypatch):
    """It said only "No such file or directory: '.../resnet50_dataparallel_cuda.pth.tar'"."""
    from torch_compat import _default, _reference

    built = []
    # The ~2 s build came before the write was tried, so the error waited for it. (`_default`
    # imports `reference_model` as it builds: torchvision is not imported before.)
    monkeypatch.setattr(_reference, "reference_model", lambda arch, seed: built.append(arch) or nn.Linear(2, 2))
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("JAXPORT_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(CheckpointError, match=r"cannot write the embedded default checkpoint to '.*file/cache/resnet50"
                                              r".*set JAXPORT_CACHE \(or XDG_CACHE_HOME\) to a writable directory"):
        _default.default_checkpoint()
    with pytest.raises(CheckpointError, match=r"cannot write the embedded default checkpoint to '.*x.pth' \([^)]*\)$"):
        _default.default_checkpoint(tmp_path / "file" / "x.pth")
    assert built == []


@pytest.mark.parametrize("sep", [".", "::"])
def test_a_users_flax_file_is_named_as_such(tmp_path, sep):
    """`flatten_dict(variables, sep=".")` saved with safetensors.flax: `jaxport port` took it for a
    state dict and said it "does not look like a torchvision ResNet"."""
    import flax.traverse_util
    import jax.numpy as jnp
    import safetensors.flax

    variables = {
        "params": {"conv1": {"kernel": jnp.ones((3, 3, 3, 4))}}, "batch_stats": {"bn1": {"mean": jnp.zeros(4)}}}
    path = tmp_path / "mine.safetensors"
    safetensors.flax.save_file(flax.traverse_util.flatten_dict(variables, sep=sep), str(path))
    with pytest.raises(CheckpointError, match=r"is already a file of Flax variables \(keys such as "
                                              rf"'batch_stats{re.escape(sep)}bn1{re.escape(sep)}mean'\).*jaxport export"
                       ) as e:
        load_state_dict(path)
    one_line_error(e, path)
