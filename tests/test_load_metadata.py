"""torch_compat._load: numpy values saved beside the weights (``"epoch": np.int64(3)``) load without
trusted=True, the weights unchanged; numpy values that hold Python objects, and pickles that
misuse the numpy names, are refused and never run code.

Equality is exact (`torch.equal`, dtype and key order checked): loading must not change a bit.
"""
import argparse
import os
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

import jaxport
import torch_compat
from jaxport._errors import CheckpointError
from torch_compat import _load
from torch_compat._load import load_state_dict

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not _load._named_globals_supported(),
    reason="this torch's safe_globals takes no (object, name) pairs, so numpy values stay refused")


@pytest.fixture(scope="module")
def sd():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):  # running stats that differ from their defaults
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return model.state_dict()


def assert_same(loaded, expected):
    assert type(loaded) is dict
    assert list(loaded) == list(expected)
    for key, want in expected.items():
        got = loaded[key]
        assert type(got) is torch.Tensor and got.dtype == want.dtype, key
        assert torch.equal(got, want), key


def save(obj, path, fmt):
    torch.save(obj, path, _use_new_zipfile_serialization=fmt == "zip")
    return path


# What training scripts save beside the weights (torchvision references, timm, research repos).
METADATA = {
    "scalars": {
        "epoch": np.int64(3), "best_acc1": np.float64(76.1), "loss": np.float32(0.25), "is_best": np.bool_(True),
        "step": np.int32(-7), "bits": np.uint8(255), "half": np.float16(0.5), "phase": np.complex64(1 - 2j),
    },
    "arrays": {
        "lr_history": np.array([0.1, 0.01]),
        "confusion": np.arange(12, dtype=np.int32).reshape(3, 4),
        "fortran": np.asfortranarray(np.arange(6.0, dtype=np.float32).reshape(2, 3)),
        "big_endian": np.arange(4, dtype=">i4"),
        "mask": np.array([True, False]),
        "zero_d": np.array(2.5),
        "empty": np.zeros((0, 3), dtype=np.int64),
    },
    "nested": {
        "history": [{"epoch": np.int64(e), "acc": np.float32(e / 10), "lr": np.array([0.1 / (e + 1)])}
                    for e in range(3)],
        "best": (np.int64(2), {"top5": np.float64(93.2)}),
        "args": argparse.Namespace(lr=np.float64(0.1), milestones=np.array([30, 60])),
    },
}
# Where the weights sit: timm / Lightning, torchvision's reference scripts.
WRAPPERS = {"state_dict": lambda sd, meta: {"state_dict": sd, **meta},
            "model": lambda sd, meta: {"model": sd, **meta}}


def assert_equal_values(got, want):
    """Same structure, types and values (arrays: shape and values; numpy turns big-endian native)."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype.newbyteorder("=")
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got == want
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_equal_values(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_equal_values(got[k], want[k])
    elif isinstance(want, argparse.Namespace):
        assert_equal_values(vars(got), vars(want))
    else:
        assert got == want


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("meta", METADATA)
def test_numpy_metadata_loads_without_trusted(tmp_path, sd, meta, fmt, wrapper):
    path = save(WRAPPERS[wrapper](sd, METADATA[meta]), tmp_path / "checkpoint.pth", fmt)
    with pytest.raises(Exception, match="numpy"):
        torch.load(path, weights_only=True)  # what needed --trusted before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = load_state_dict(path)
    assert_same(loaded, sd)
    assert torch_compat.detect_arch(loaded) == "resnet18" and torch_compat.num_classes_of(loaded) == 10


def test_metadata_values_are_rebuilt_exactly(tmp_path, sd):
    """The stand-ins give back what numpy's unpickling gives: same types, dtypes and values."""
    meta = {**METADATA["scalars"], **METADATA["arrays"], **METADATA["nested"]}
    path = save({"state_dict": sd, **meta}, tmp_path / "checkpoint.pth", "zip")
    with torch.serialization.safe_globals(_load._EXTRA_SAFE_GLOBALS):
        loaded = torch.load(path, weights_only=True)
    assert_equal_values({k: loaded[k] for k in meta}, meta)
    assert loaded["fortran"].flags.f_contiguous


def test_the_allowed_names_are_the_ones_numpy_writes(tmp_path, sd):
    meta = {**METADATA["scalars"], **METADATA["arrays"], **METADATA["nested"]}
    path = save({"state_dict": sd, **meta}, tmp_path / "checkpoint.pth", "zip")
    core = "core" if np.__version__.startswith("1.") else "_core"
    assert sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path)) == sorted([
        "argparse.Namespace", "numpy.dtype", "numpy.ndarray", f"numpy.{core}.multiarray._reconstruct",
        f"numpy.{core}.multiarray.scalar", "builtins.bytes"])  # `bytes()`: an empty array's data
    # Allowed only while one file loads, never globally.
    load_state_dict(path)
    assert not any(entry in torch.serialization.get_safe_globals() for entry in _load._EXTRA_SAFE_GLOBALS)
    with pytest.raises(Exception, match="numpy"):
        torch.load(path, weights_only=True)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_numpy_1_names(tmp_path, sd, fmt):
    """Files written with numpy 1.x name `numpy.core.multiarray`, which numpy 2 renamed `numpy._core`."""
    path = save({"model": sd, **METADATA["scalars"], **METADATA["arrays"]}, tmp_path / "checkpoint.pth", fmt)
    if fmt == "zip":
        with zipfile.ZipFile(path) as z:
            records = {info.filename: z.read(info) for info in z.infolist()}
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            for name, data in records.items():
                z.writestr(name, data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
                           if name.endswith("data.pkl") else data)
    else:
        path.write_bytes(path.read_bytes().replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    if fmt == "zip":
        assert "numpy.core.multiarray.scalar" in torch.serialization.get_unsafe_globals_in_checkpoint(path)
    assert_same(load_state_dict(path), sd)


def test_flat_state_dict_with_numpy_metadata_warns_and_ports(tmp_path, sd):
    path = save({**sd, "epoch": np.int64(3), "lr_history": np.array([0.1, 0.01])}, tmp_path / "flat.pth", "zip")
    with pytest.warns(UserWarning, match=r"ignored 2 metadata entries .*'epoch' \(int64\), 'lr_history' \(ndarray\)"):
        loaded = load_state_dict(path)
    assert_same(loaded, sd)


# --- refused: numpy values holding Python objects, and forged numpy pickles -------------------

class Payload:
    """Unpickling this runs `os.system`: creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_object_array_is_refused_and_its_payload_never_runs(tmp_path, sd, fmt):
    marker = tmp_path / "payload_ran"
    path = save({"model": sd, "extra": np.array([Payload(marker), 1], dtype=object)}, tmp_path / "hostile.pth", fmt)

    with pytest.raises(CheckpointError) as excinfo:
        load_state_dict(path)
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message
    assert "numpy dtype 'O8'" in message and "Python objects" in message
    assert "nothing from the file was run" in message and "trusted=True" in message
    assert not marker.exists()

    # on purpose, in tmp_path: trusted=True really unpickles, so the payload above was live
    assert_same(load_state_dict(path, trusted=True), sd)
    assert marker.exists()


@pytest.mark.parametrize("value,dtype", [
    (np.array([1, "a"], dtype=object), "'O8'"),  # objects, no code: still not numbers
    (np.zeros(2, dtype=[("a", "f4"), ("b", "O")]), "'V12'"),  # a structured dtype with an object field
    (np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]), "'V8'"),
    (np.array(["resnet18"]), "'U8'"),
    (np.str_("resnet18"), "'U8'"),
    (np.datetime64("2024-01-01"), "'M8'"),
])
def test_other_numpy_dtypes_are_refused(tmp_path, sd, value, dtype):
    path = save({"model": sd, "extra": value}, tmp_path / "checkpoint.pth", "zip")
    with pytest.raises(CheckpointError, match=f"holds a numpy dtype {dtype}.*nothing from the file was run"):
        load_state_dict(path)


class Forged:
    """Pickles as `func(*args)` with `state` BUILT into the result: numpy's names, other arguments."""

    def __init__(self, func, args, state=None):
        self.reduced = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.reduced


_reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]  # numpy.(_)core.multiarray._reconstruct
_scalar = np.float64(0).__reduce__()[0]  # numpy.(_)core.multiarray.scalar
F8 = (3, "<", None, None, None, -1, -1, 0)  # what numpy writes for float64
OBJECT_FLAGS = 63  # NPY_ITEM_REFCOUNT | NPY_ITEM_IS_POINTER | ...: "the items are PyObject pointers"


@pytest.mark.parametrize("forged,named", [
    (Forged(np.dtype, ("f8", False, True), (3, "<", None, ("a",), {"a": (np.dtype("f8"), 0)}, 8, 8, 0)),
     "with a pickled state numpy does not write"),
    (Forged(np.dtype, ("f8", False, True), (3, "<", (np.dtype("f8"), (2,)), None, None, 16, 8, 0)),
     "with a pickled state numpy does not write"),
    (Forged(_scalar, (np.dtype("f8"), b"\x00" * 3)), "float64 scalar pickled as b'\\x00\\x00\\x00', not as its 8"),
    (Forged(_scalar, ("f8", b"\x00" * 8)), "whose dtype is 'f8', not a pickled numpy dtype"),
    (Forged(_reconstruct, (np.ndarray, (0,), b"b"), (1, (1000,), np.dtype("f8"), False, b"\x00" * 8)),
     "float64 array of shape (1000,) pickled as"),
    (Forged(_reconstruct, (np.ndarray, (0,), b"b"), (1, (-1,), np.dtype("f8"), False, b"")), "array with the shape"),
    (Forged(_reconstruct, (np.ndarray, (4,), b"b")), "array rebuilt with arguments numpy does not write"),
    (Forged(np.ndarray, ((2,), "f8")), "ndarray built by calling numpy.ndarray"),
])
def test_forged_numpy_pickles_are_refused(tmp_path, sd, forged, named):
    path = save({"model": sd, "extra": forged}, tmp_path / "forged.pth", "zip")
    with pytest.raises(CheckpointError, match="refusing to load") as excinfo:
        load_state_dict(path)
    assert named in str(excinfo.value)
    assert "nothing from the file was run" in str(excinfo.value)


def test_dtype_flags_and_sharing_in_the_file_are_not_used(tmp_path, sd):
    """`dtype("f8", False, False)` is numpy's shared float64 dtype; with numpy's own `__setstate__`,
    the file's object flags would make numpy treat every float64's bytes as object pointers."""
    forged_dtype = Forged(np.dtype, ("f8", False, False), F8[:-1] + (OBJECT_FLAGS,))
    forged_array = Forged(_reconstruct, (np.ndarray, (0,), b"b"),
                          (1, (2,), forged_dtype, False, np.array([1.5, -2.0]).tobytes()))
    path = save({"model": sd, "a": forged_array, "s": Forged(_scalar, (forged_dtype, np.float64(3).tobytes()))},
                tmp_path / "flags.pth", "zip")
    assert_same(load_state_dict(path), sd)
    assert np.dtype("f8").flags == 0 and not np.dtype("f8").hasobject
    with torch.serialization.safe_globals(_load._EXTRA_SAFE_GLOBALS):
        loaded = torch.load(path, weights_only=True)
    assert loaded["a"].dtype == np.float64 and loaded["a"].dtype.flags == 0 and loaded["a"].tolist() == [1.5, -2.0]
    assert type(loaded["s"]) is np.float64 and loaded["s"] == 3


def test_an_array_is_filled_once():
    """A second BUILD would free the data a tensor made from the array in between points to."""
    dtype = _load._NumpyDType("f8")
    array = _load._numpy_reconstruct(_load._NumpyArray, (0,), b"b")
    array.__setstate__((1, (2,), dtype, False, np.array([1.0, 2.0]).tobytes()))
    with pytest.raises(Exception, match="set twice"):
        array.__setstate__((1, (0,), dtype, False, b""))
    assert array.tolist() == [1.0, 2.0]


# --- the command line ---------------------------------------------------------------------------

def test_cli_ports_a_checkpoint_with_numpy_metadata(tmp_path, sd):
    path = save({"state_dict": sd, **METADATA["scalars"], **METADATA["nested"]}, tmp_path / "ckpt.pth", "zip")
    out = tmp_path / "r18.safetensors"
    proc = subprocess.run([sys.executable, "-m", "jaxport", "port", str(path), "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "architecture: resnet18 (detected), 10 classes" in proc.stdout
    back = torch_compat.flax_to_torch(jaxport.load_variables(out), "resnet18")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
