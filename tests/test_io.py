"""jaxport.save_variables / load_variables: bit-exact, atomic, clear errors."""
import json
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import jaxport
from jaxport import CheckpointError


def _variables():
    rng = np.random.default_rng(0)
    return {
        "params": {"conv1": {"kernel": rng.standard_normal((7, 7, 3, 64)).astype(np.float32)},
                   "fc": {"bias": rng.standard_normal(10).astype(ml_dtypes.bfloat16),
                          "kernel": rng.standard_normal((4, 10)).astype(np.float16)}},
        "batch_stats": {"bn1": {"mean": rng.standard_normal(64), "num_batches_tracked": np.array(7, np.int32)}},
    }


def test_round_trip_is_bit_exact_with_metadata(tmp_path):
    v = _variables()
    path = jaxport.save_variables(tmp_path / "v.safetensors", v, arch="resnet18")
    back = jaxport.load_variables(path)
    flat_v = jaxport._io.flatten(v)
    flat_b = jaxport._io.flatten(back)
    assert set(flat_v) == set(flat_b)
    for k in flat_v:
        assert flat_b[k].dtype == flat_v[k].dtype and flat_b[k].shape == flat_v[k].shape, k
        assert flat_b[k].tobytes() == np.asarray(flat_v[k]).tobytes(), k
    meta = jaxport.read_metadata(path)
    assert meta["arch"] == "resnet18" and meta["format"] == "jaxport.variables"
    assert [p.name for p in tmp_path.iterdir()] == ["v.safetensors"]  # no temporary left behind
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # umask permissions, not mkstemp's 0600


def test_loading_closes_every_file_it_opens(tmp_path):
    """`load_variables` read the header's length from a file object it never closed: a
    ResourceWarning (an error under `-W error`) on every load."""
    import gc
    import warnings

    path = jaxport.save_variables(tmp_path / "v.safetensors", _variables(), arch="resnet18")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for read in (jaxport.load_variables, jaxport.read_metadata, jaxport._io.holds_variables):
            read(path)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_the_same_variables_give_the_same_bytes(tmp_path):
    """safetensors writes the header's metadata in a random order (a Rust HashMap's, new with
    each save): two ports of one checkpoint differed. The header is rewritten sorted."""
    v = _variables()
    meta = {k: f"value {k}" for k in ("source", "source_path", "step", "zeta", "alpha")}
    files = [jaxport.save_variables(tmp_path / f"{i}.safetensors", v, arch="resnet18", metadata=meta).read_bytes()
             for i in range(6)]
    assert all(f == files[0] for f in files)
    path = tmp_path / "0.safetensors"
    assert jaxport.read_metadata(path) == {"format": jaxport._io.FORMAT, "version": "1", "arch": "resnet18", **meta}
    header = json.loads(files[0][8:8 + int.from_bytes(files[0][:8], "little")])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    back = jaxport._io.flatten(jaxport.load_variables(path))
    flat = jaxport._io.flatten(v)
    assert all(np.array_equal(back[k], flat[k]) and back[k].dtype == flat[k].dtype for k in flat)
    assert safetensors.numpy.load_file(str(path)).keys() == flat.keys()  # the library still reads it


@pytest.mark.parametrize("variables,named", [
    ({"params": {"a": ml_dtypes.float8_e4m3fn(1) * np.ones(2, ml_dtypes.float8_e4m3fn)}}, r"params/a \(float8_e4m3fn\)"),
    ({"params": {"a": np.ones(2, np.complex64)}}, r"params/a \(complex64\)"),
    ({"params": {"a": None}}, r"params/a \(object\)"),
    ({"params": {"fc/bias": np.ones(2, np.float32)}}, r"key 'fc/bias' \(under params\) must be a non-empty string"),
    ({"params": {"": np.ones(2, np.float32)}}, r"key '' \(under params\)"),
    ({"params": {0: np.ones(2, np.float32)}}, r"key 0 \(under params\)")])
def test_save_refuses_what_the_file_would_not_give_back(tmp_path, variables, named):
    """Such variables were written, then refused by `load_variables` (float8, complex, None) or
    read back as another tree (`fc/bias` became `fc` -> `bias`)."""
    path = tmp_path / "v.safetensors"
    with pytest.raises(jaxport.ConfigError, match=named):
        jaxport.save_variables(path, variables)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(jaxport.ConfigError, match=r"`metadata` \(=\{'step': 3\}\) must map strings to strings"):
        jaxport.save_variables(path, {"a": np.ones(2)}, metadata={"step": 3})  # was safetensors' TypeError


def test_failed_save_keeps_the_old_file(tmp_path):
    path = jaxport.save_variables(tmp_path / "v.safetensors", _variables(), arch="resnet18")
    before = path.read_bytes()
    with pytest.raises(Exception):
        jaxport.save_variables(path, {"params": {"bad": object()}})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["v.safetensors"]


def test_a_full_disk_is_named_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """A full disk ended `jaxport port` in "internal error (SafetensorError: ... os error 28) ... report it"."""
    import collections
    import errno

    import jax
    import jax.numpy as jnp

    import jaxport._io
    from jaxport._cli import main

    path = jaxport.save_variables(tmp_path / "v.safetensors", _variables(), arch="resnet18")
    r18 = jaxport.models.resnet18(num_classes=4).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    port = jaxport.save_variables(tmp_path / "r18.safetensors", r18, arch="resnet18")
    before = path.read_bytes()
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(jaxport._io.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(OSError, match=r"not enough space to write .*v.safetensors': it needs .* MB and 0.0 MB") as e:
        jaxport.save_variables(path, _variables())
    assert e.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r18.safetensors", "v.safetensors"]  # no temporary left
    assert main(["export", str(port), "--out", str(tmp_path / "r18.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxport: error: not enough space to write") and "internal" not in err
    assert not (tmp_path / "r18.pt").exists()


@pytest.mark.parametrize("case", ["missing", "empty", "directory", "truncated", "garbage", "lying header"])
def test_broken_files_give_one_clear_error(tmp_path, case):
    path = tmp_path / "v.safetensors"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "directory":
        path.mkdir()
    elif case == "truncated":
        jaxport.save_variables(path, _variables())
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "garbage":
        path.write_text("hello, I am not a tensor file\n" * 10)
    elif case == "lying header":
        header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
        path.write_bytes((len(header) + 1000).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(CheckpointError) as e:
        jaxport.load_variables(path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg
    expected = {"missing": "does not exist", "empty": "is empty", "directory": "is a directory"}.get(case, "not a valid safetensors")
    assert expected in msg


def test_a_torch_checkpoint_in_safetensors_form_is_named_as_such(tmp_path):
    """The hubs publish torch weights as .safetensors; read as Flax variables they would give a
    tree of `conv1.weight` leaves that fails far away. One error says what the file is."""
    path = tmp_path / "the hub.safetensors"  # the hint quotes it: a command to run as printed
    safetensors.numpy.save_file({"conv1.weight": np.zeros((2, 3), np.float32), "fc.bias": np.zeros(2, np.float32)},
                                str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'.*the hub.safetensors' holds torch-style keys .* `jaxport port "
                                              r"'.*/the hub.safetensors'`"):
        jaxport.load_variables(path)


def _user_file(path, variables, sep):
    """What a user writes with safetensors' own flax API, no jaxport metadata."""
    import flax.traverse_util
    import safetensors.flax

    safetensors.flax.save_file(flax.traverse_util.flatten_dict(variables, sep=sep), str(path))
    return path


@pytest.mark.parametrize("sep", ["/", "."])
def test_a_users_own_flax_file_loads_with_either_separator(tmp_path, sep):
    """A file of `flatten_dict(variables, sep=".")` was called a torch checkpoint ("port it with
    jaxport port"), and `jaxport port` then refused it as no ResNet: a dead end."""
    v = {"params": {"layer1": {"0": {"conv1": {"kernel": np.ones((3, 3, 4, 4), np.float32)}}}},
         "batch_stats": {"bn1": {"mean": np.arange(4, dtype=np.float32)}}}
    path = _user_file(tmp_path / "mine.safetensors", v, sep)
    assert jaxport._io.holds_variables(path)  # what `train --init` and `export` ask first
    back = jaxport.load_variables(path)
    assert jaxport._io.flatten(back).keys() == jaxport._io.flatten(v).keys()
    assert np.array_equal(back["batch_stats"]["bn1"]["mean"], v["batch_stats"]["bn1"]["mean"])


@pytest.mark.parametrize("sep", ["::", "_", "|"])
def test_a_flax_file_with_another_separator_names_it_and_the_fix(tmp_path, sep):
    v = {"params": {"conv1": {"kernel": np.ones((3, 3, 4, 4), np.float32)}},
         "batch_stats": {"bn1": {"mean": np.zeros(4, np.float32)}}}
    path = _user_file(tmp_path / "mine.safetensors", v, sep)
    assert jaxport._io.holds_variables(path)  # so callers reach the error below, not a torch one
    with pytest.raises(CheckpointError) as e:
        jaxport.load_variables(path)
    msg = str(e.value)
    assert f"holds Flax variables whose keys are joined with {sep!r}" in msg and "torch" not in msg, msg
    assert "flatten_dict(variables, sep='/')" in msg and str(path) in msg, msg


def test_atomic_path_names_the_target_when_the_rename_fails(tmp_path):
    """A directory where the file should go (e.g. a workdir's training_curves.png/) failed with
    the hidden temporary file's name."""
    from jaxport._io import atomic_path

    target = tmp_path / "training_curves.png"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(OSError) as err:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"png")
    assert err.value.filename == str(target), err.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["training_curves.png"]  # no temporary left


@pytest.mark.parametrize("name", ["v" * 241 + ".pt", "v" * 252 + ".pt", "a" + "é" * 120 + ".safetensors"],
                         ids=["244 bytes", "255 bytes", "253 bytes, cut inside a character"])
def test_atomic_path_writes_names_up_to_the_file_systems_limit(tmp_path, name):
    """`.NAME.XXXXXXXX.tmp` is 14 bytes longer than NAME: an --out of 242-255 bytes, which the
    file system takes, failed "File name too long" on its temporary file. `remove_temporaries`
    still finds what a killed writer left of such a name."""
    from jaxport._io import atomic_path, remove_temporaries

    assert 244 <= len(os.fsencode(name)) <= 255
    target = tmp_path / name
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"data")
        os.link(tmp, tmp_path / "kept")
    assert target.read_bytes() == b"data"
    os.rename(tmp_path / "kept", tmp)  # the temporary file as a killed writer leaves it
    assert remove_temporaries(tmp_path, (name,)) == [tmp]
    assert [p.name for p in tmp_path.iterdir()] == [name]


def _two_layouts():
    """The same keys as float32 (`x`) and bfloat16 (`y`), as a re-port with --dtype writes them."""
    rng = np.random.default_rng(0)
    x = {"params": {f"layer{i}": {"kernel": rng.standard_normal((64, 64)).astype(np.float32)} for i in range(4)}}
    y = {"params": {k: {"kernel": v["kernel"].astype(ml_dtypes.bfloat16)} for k, v in x["params"].items()}}
    return x, y


def _whole(back, x, y):
    """Which of `x` and `y` `back` is, in every tensor; None for a mix or garbage."""
    flat = jaxport._io.flatten(back)
    for name, want in (("x", x), ("y", y)):
        want = jaxport._io.flatten(want)
        if flat.keys() == want.keys() and all(flat[k].dtype == want[k].dtype and np.array_equal(flat[k], want[k])
                                              for k in want):
            return name
    return None


@pytest.mark.parametrize("when", ["validation", "mapping"])
def test_a_file_replaced_while_it_loads_gives_one_whole_file(tmp_path, monkeypatch, when):
    """`load_variables` opened the path four times (safetensors' check, the header, its size, the
    memmap): a file replaced in between (`jaxport port --force` while `export` reads it) came back
    as float32 offsets over bfloat16 data, "cannot reshape array of size 0" or silent garbage.
    The replacement happens just before safetensors validates, or just before the map."""
    x, y = _two_layouts()
    path = jaxport.save_variables(tmp_path / "v.safetensors", x, arch="resnet18")
    newer = jaxport.save_variables(tmp_path / "newer.safetensors", y, arch="resnet34")
    real = {"validation": safetensors.safe_open, "mapping": np.memmap}[when]

    def replaced_first(*args, **kwargs):
        if newer.exists():
            os.replace(newer, path)
        return real(*args, **kwargs)

    monkeypatch.setattr(*{"validation": (safetensors, "safe_open"), "mapping": (np, "memmap")}[when], replaced_first)
    assert _whole(jaxport.load_variables(path), x, y) == {"validation": "y", "mapping": "x"}[when]
    assert not newer.exists()  # the replacement did happen


def test_a_file_replaced_on_every_read_is_one_clear_error(tmp_path, monkeypatch):
    """A file replaced each time it is validated is never read as a mix: after a few tries the
    error names it and why."""
    x, y = _two_layouts()
    path = jaxport.save_variables(tmp_path / "v.safetensors", x)
    versions = [jaxport.save_variables(tmp_path / f"{i}.safetensors", (x, y)[i % 2]) for i in range(8)]
    real = safetensors.safe_open

    def replaced_each_time(*args, **kwargs):
        opened = real(*args, **kwargs)
        os.replace(versions.pop(), path)
        return opened

    monkeypatch.setattr(safetensors, "safe_open", replaced_each_time)
    with pytest.raises(CheckpointError, match=f"variables file '{path}' was replaced 3 times while it was being read"):
        jaxport.load_variables(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the umask is read from /proc/self/status")
def test_a_written_file_honours_the_umask_without_changing_it(tmp_path, monkeypatch):
    """`atomic_path` read the umask by setting it to 0 and back: a file another thread created in
    between (a training run's metrics beside a checkpoint save) got mode 0666, a directory 0777."""
    from jaxport._io import atomic_path

    real = os.umask
    changed = []

    def watched(mask):
        old = real(mask)
        if mask != old:
            changed.append(f"{old:o} -> {mask:o}")
        return old

    previous = real(0o027)
    try:
        monkeypatch.setattr(os, "umask", watched)
        path = jaxport.save_variables(tmp_path / "v.safetensors", _variables())
        with atomic_path(tmp_path / "m.jsonl") as tmp:
            tmp.write_text("{}\n")
    finally:
        real(previous)
    assert changed == []
    assert [os.stat(p).st_mode & 0o777 for p in (path, tmp_path / "m.jsonl")] == [0o640, 0o640]


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
def test_atomic_path_without_overwrite_keeps_a_file_made_during_the_write(tmp_path, monkeypatch, links):
    """`overwrite=False` is decided when the file is put in place (a hard link, which fails where
    a rename replaces), so a file another process made during the write is kept. A file system
    without hard links (FAT, some network mounts) falls back to a check and a rename."""
    import errno

    from jaxport._io import atomic_path

    if not links:
        def no_link(*args, **kwargs):
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))

        monkeypatch.setattr(os, "link", no_link)
    target = tmp_path / "m.jsonl"
    with pytest.raises(FileExistsError, match="already exists; nothing was written over it") as e:
        with atomic_path(target, overwrite=False) as tmp:
            tmp.write_text("mine\n")
            target.write_text("theirs\n")
    assert e.value.filename == str(target) and target.read_text() == "theirs\n"
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]  # no temporary left
    with pytest.raises(FileExistsError):  # already there: refused before anything is written
        jaxport.save_variables(target, _variables(), overwrite=False)
    target.unlink()
    path = jaxport.save_variables(target, _variables(), overwrite=False)
    assert jaxport.load_variables(path).keys() == {"params", "batch_stats"}
    assert [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]


@pytest.mark.parametrize("swap", ["a torch checkpoint", "nothing"])
def test_a_file_swapped_or_removed_during_validation_is_judged_as_it_is_now(tmp_path, monkeypatch, swap):
    """Replaced by another kind of file, or removed, while safetensors validated it: the error
    is about the file now at the path (a torch checkpoint is named as one; a removed file does
    not exist), not a failure of the one that was there."""
    path = jaxport.save_variables(tmp_path / "v.safetensors", _variables())
    if swap == "a torch checkpoint":
        import torch

        torch.save({"w": torch.zeros(2)}, tmp_path / "ckpt.pt")
    real = safetensors.safe_open

    def swapped_first(*args, **kwargs):
        if swap == "nothing":
            path.unlink(missing_ok=True)
        elif (tmp_path / "ckpt.pt").exists():
            os.replace(tmp_path / "ckpt.pt", path)
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", swapped_first)
    message = {"a torch checkpoint": "is a torch checkpoint (torch.save), not a Flax variables file",
               "nothing": "does not exist; check the path"}[swap]
    with pytest.raises(CheckpointError, match=re.escape(message)):
        jaxport.load_variables(path)


def test_a_fifo_or_a_path_under_a_file_is_one_clear_error(tmp_path):
    """Opening a FIFO to read waits for a writer: a load must not hang on one. A path whose
    directory is a regular file (NotADirectoryError) does not exist."""
    import subprocess
    import sys

    fifo = tmp_path / "v.safetensors"
    os.mkfifo(fifo)
    script = ("import sys, jaxport\ntry:\n    jaxport.load_variables(sys.argv[1])\n"
              "except Exception as e:\n    print(type(e).__name__, e)")
    proc = subprocess.run([sys.executable, "-c", script, str(fifo)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert "CheckpointError" in proc.stdout and "is empty (0 bytes)" in proc.stdout, proc.stdout + proc.stderr
    (tmp_path / "notes.txt").write_text("a file")
    with pytest.raises(CheckpointError, match="does not exist; check the path"):
        jaxport.load_variables(tmp_path / "notes.txt" / "v.safetensors")


def test_atomic_path_without_overwrite_refuses_an_existing_file_before_the_block(tmp_path):
    from jaxport._io import atomic_path

    target = tmp_path / "m.jsonl"
    target.write_text("theirs\n")
    with pytest.raises(FileExistsError):
        with atomic_path(target, overwrite=False):
            pytest.fail("the block ran: the write would be wasted")
    assert target.read_text() == "theirs\n" and [p.name for p in tmp_path.iterdir()] == ["m.jsonl"]


@pytest.mark.parametrize("errno_name", ["EPERM", "ENOTSUP", "EOPNOTSUPP", "EXDEV", "EMLINK", "ENOSYS"])
def test_every_no_hard_link_error_falls_back_to_a_checked_rename(tmp_path, monkeypatch, errno_name):
    import errno

    from jaxport._io import atomic_path

    code = getattr(errno, errno_name)

    def no_link(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", no_link)
    with atomic_path(tmp_path / "m.jsonl", overwrite=False) as tmp:
        tmp.write_text("mine\n")
    assert (tmp_path / "m.jsonl").read_text() == "mine\n" and len(list(tmp_path.iterdir())) == 1


def test_a_link_put_in_place_of_the_temporary_lends_no_mode_to_its_target(tmp_path):
    """The temporary's directory may be writable by others: a symbolic link put in its place
    must not have the new file's mode applied to its target."""
    from jaxport._io import atomic_path

    secret = tmp_path / "secret"
    secret.write_text("private")
    secret.chmod(0o600)
    with pytest.raises(OSError):
        with atomic_path(tmp_path / "m.jsonl") as tmp:
            tmp.unlink()
            tmp.symlink_to(secret)
    assert secret.stat().st_mode & 0o777 == 0o600 and not (tmp_path / "m.jsonl").exists()


def test_the_umask_fallback_sets_the_most_private_mask_and_restores_it(monkeypatch):
    """Where /proc/self/status cannot be read, the umask is read by setting it: to 0o077 (a file
    another thread creates meanwhile is private, not world-writable), then back."""
    import builtins

    import jaxport._io

    real_open, real_umask, calls = builtins.open, os.umask, []

    def no_proc(name, *args, **kwargs):
        if str(name) == "/proc/self/status":
            raise OSError("no /proc here")
        return real_open(name, *args, **kwargs)

    def watched(mask):
        calls.append(mask)
        return real_umask(mask)

    previous = real_umask(0o022)
    try:
        monkeypatch.setattr(builtins, "open", no_proc)
        monkeypatch.setattr(os, "umask", watched)
        assert jaxport._io._umask() == 0o022
        assert calls == [0o077, 0o022] and real_umask(0o022) == 0o022
    finally:
        real_umask(previous)
