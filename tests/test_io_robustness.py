"""Writing and reading jaxport's files when something else goes wrong: a malformed variables
file, a SIGTERM mid-write, a dangling symbolic link at the output, a jax that cannot start."""
import importlib.metadata as md
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import jaxport
from jaxport import CheckpointError
from jaxport._cli import main
from jaxport._io import atomic_path, raise_on_sigterm, unflatten

REPO = Path(__file__).resolve().parents[1]
META = {"format": "jaxport.variables", "version": "1", "arch": "resnet18"}


@pytest.fixture(scope="module")
def small_port(tmp_path_factory):
    """A real resnet18 variables file (4 classes, ~45 MB), as `jaxport port` writes one."""
    variables = jaxport.models.resnet18(num_classes=4).init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    return jaxport.save_variables(tmp_path_factory.mktemp("port") / "r18.safetensors", variables, arch="resnet18")


# --- a tensor path that is also a group: `params/fc` beside `params/fc/bias` ------------------

@pytest.mark.parametrize("flat", [
    {"params/fc": 1, "params/fc/bias": 2},
    {"params/fc/bias": 2, "params/fc": 1},  # this order silently replaced the whole `fc` subtree
    {"params/fc/bias/x": 2, "params/fc": 1, "params/conv/kernel": 3},
], ids=["leaf first", "group first", "deeper"])
def test_unflatten_refuses_a_key_that_is_also_a_group_in_either_order(flat):
    inner = next(k for k in flat if k.startswith("params/fc/"))
    with pytest.raises(ValueError, match=f"key 'params/fc' is both a leaf and the prefix of key '{inner}'"):
        unflatten(flat)
    assert unflatten({"params/fc/bias": 2, "params/fc/kernel": 1}) == {"params": {"fc": {"bias": 2, "kernel": 1}}}


@pytest.mark.parametrize("extra", ["params/fc", "params/layer1"])
def test_a_tensor_that_is_also_a_group_is_one_clear_error_in_load_and_export(tmp_path, small_port, extra, capsys):
    """A safetensors file holding `params/fc` beside `params/fc/bias` ended `load_variables`,
    `jaxport export` and `verify` in "ValueError: assignment destination is read-only" or
    "AttributeError: 'memmap' object has no attribute 'setdefault'" (an internal error)."""
    flat = {k: np.array(v) for k, v in jaxport._io.flatten(jaxport.load_variables(small_port)).items()}
    bad = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file({**flat, extra: np.zeros(3, np.float32)}, str(bad), metadata=META)
    with pytest.raises(CheckpointError) as e:
        jaxport.load_variables(bad)
    msg = str(e.value)
    assert f"variables file '{bad}' is not a valid variables file: key '{extra}' is both a leaf and the prefix " \
           f"of key '{extra}/" in msg and "`jaxport port`" in msg and "\n" not in msg, msg

    assert main(["export", str(bad), "--out", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxport: error: variables file '{bad}' is not a valid variables file") and \
        "internal" not in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors"]


# --- a file replaced while it is read --------------------------------------------------------

def test_export_takes_the_architecture_from_the_file_it_read_the_weights_from(tmp_path, small_port, monkeypatch,
                                                                            capsys):
    """`export` read the weights, then opened the file again for its `arch`: a file replaced in
    between (a re-port of another model) gave one version's weights and the other's
    architecture, and the export failed or was labelled wrongly."""
    src = tmp_path / "r18.safetensors"
    src.write_bytes(small_port.read_bytes())
    newer = jaxport.save_variables(tmp_path / "newer.safetensors", {"params": {"x": np.zeros(2, np.float32)}},
                                   arch="resnet34")
    real = jaxport._io.unflatten

    def replaced_after_reading(flat, *args, **kwargs):  # the weights are read: the file is replaced
        tree = real(flat, *args, **kwargs)
        if newer.exists():
            os.replace(newer, src)
        return tree

    monkeypatch.setattr(jaxport._io, "unflatten", replaced_after_reading)
    assert main(["export", str(src), "--out", str(tmp_path / "r18.pt")]) == 0, capsys.readouterr().err
    assert "a torchvision resnet18 state_dict" in capsys.readouterr().out
    assert not newer.exists() and jaxport.read_metadata(src)["arch"] == "resnet34"


# --- SIGTERM while a file is written ----------------------------------------------------------

# `jaxport export` in its own process, held inside the write: the temporary file is fully
# written, then the writer waits (as a large write would) until the test sends SIGTERM.
_HELD_EXPORT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    ready, argv = Path(sys.argv[1]), sys.argv[2:]
    save = torch.save
    def held_save(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        ready.touch()
        time.sleep(300)
    torch.save = held_save
    from jaxport._cli import main
    sys.exit(main(argv))
""")


def test_sigterm_during_export_removes_the_temporary_file(tmp_path, small_port):
    """A SIGTERM (`kill`, a scheduler's preemption) while `jaxport export` wrote ended the process
    at once, without running `atomic_path`'s cleanup: the full-size hidden `.x.pt.XXXX.tmp` stayed."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _HELD_EXPORT, str(ready), "export", str(small_port),
                             "--out", str(out_dir / "x.pt")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the export never reached its write"
            time.sleep(0.1)
        names = [p.name for p in out_dir.iterdir()]
        assert len(names) == 1 and names[0].startswith(".x.pt."), names  # the write is under way
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # only if still running
        proc.wait()
    assert list(out_dir.iterdir()) == []  # neither the output nor its temporary file
    # Stopped by jaxport, not killed by the signal (-15): the CLI reports it on one line, 130 as
    # for Ctrl-C (143 once the CLI exits with 128 + the signal number, as `jaxport train` does).
    assert proc.returncode == 143, (proc.returncode, err)
    assert err.splitlines() and err.splitlines()[-1].startswith("jaxport: interrupted"), err
    assert "Traceback" not in err and "internal error" not in err, err


def test_atomic_path_only_replaces_the_default_sigterm_action(tmp_path):
    """The handler is set for the write and put back after it; a handler someone installed
    deliberately (`jaxport train` checkpoints on SIGTERM) is left alone, and a thread other than
    the main one, which cannot set handlers, writes as before."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with atomic_path(tmp_path / "a.bin") as tmp:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        tmp.write_bytes(b"a")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "b.bin"):
            raise RuntimeError("failed write")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def own(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with atomic_path(tmp_path / "c.bin") as tmp:
            assert signal.getsignal(signal.SIGTERM) is own
            tmp.write_bytes(b"c")
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, previous)

    # The CLI's process-wide handler (SIGTERM as Ctrl-C) gives way to the one that names the
    # file being written, and is back after it.
    previous = signal.signal(signal.SIGTERM, raise_on_sigterm)
    try:
        with atomic_path(tmp_path / "d.bin") as tmp:
            assert signal.getsignal(signal.SIGTERM) not in (raise_on_sigterm, signal.SIG_DFL)
            tmp.write_bytes(b"d")
        assert signal.getsignal(signal.SIGTERM) is raise_on_sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)

    errors = []

    def write_in_a_thread():
        try:
            with atomic_path(tmp_path / "d.bin") as tmp:
                tmp.write_bytes(b"d")
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    t = threading.Thread(target=write_in_a_thread)
    t.start()
    t.join()
    assert not errors and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "c.bin", "d.bin"]


# --- a dangling symbolic link at the output ---------------------------------------------------

def test_export_does_not_replace_a_dangling_symlink_without_force(tmp_path, small_port, capsys):
    """A symbolic link whose target is missing is an entry the rename replaces, like a file:
    `Path.exists` is false for it, so it was replaced without --force."""
    link = tmp_path / "link.pt"
    link.symlink_to(tmp_path / "missing.pt")
    assert main(["export", str(small_port), "--out", str(link)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxport: error: `--out` (={link}) already exists") and "--force" in err, err
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "missing.pt")
    assert main(["export", str(small_port), "--out", str(link), "--force"]) == 0
    assert link.is_file() and not link.is_symlink()


# --- `jaxport env` when jax cannot start ------------------------------------------------------

def test_env_reports_a_jax_failure_with_no_message(monkeypatch):
    """jax fails with AssertionError('') when JAX_PLATFORMS names a backend that cannot start
    (cuda, without a GPU): `str(e).splitlines()[0]` raised IndexError out of a report that
    promises never to raise, and `jaxport env` printed only "internal error"."""
    from jaxport._env import report

    def devices_that_fail(*args, **kwargs):
        raise AssertionError()

    monkeypatch.setattr(jax, "devices", devices_that_fail)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    rows, warnings = report()
    (line,) = [w for w in warnings if w.startswith("jax failed to initialise its devices")]
    assert line.startswith("jax failed to initialise its devices: AssertionError (JAX_PLATFORMS=cuda is set"), line
    assert "JAX_PLATFORMS=cpu" in line
    assert not any(name == "jax devices" for name, _ in rows)


@pytest.mark.skipif(any((d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda")) for d in md.distributions()),
                    reason="a jax CUDA plugin is installed: JAX_PLATFORMS=cuda may well start here")
def test_env_with_jax_platforms_cuda_and_no_cuda_plugin_prints_its_report():
    proc = subprocess.run([sys.executable, "-m", "jaxport", "env"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cuda"})
    assert proc.returncode == 0, proc.stderr
    assert "warning: jax failed to initialise its devices: " in proc.stdout, proc.stdout
    assert proc.stdout.splitlines()[0].startswith("python "), proc.stdout
    assert "internal error" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("target", ["fifo", "dev_null_link", "trailing_slash", "directory"])
def test_save_variables_never_replaces_a_device_fifo_or_directory(tmp_path, target):
    """save_variables renames its temporary file onto `path`: as root, `save_variables("/dev/null",
    ...)` replaced the device with a regular file, a FIFO became a file, and "newdir/" a file named
    newdir. `jaxport port` refused these already; the library function now does too."""
    from jaxport import ConfigError

    if target == "fifo":
        path = tmp_path / "pipe"
        os.mkfifo(path)
        match = r"exists and is a FIFO \(named pipe\), not a regular file"
    elif target == "dev_null_link":  # never /dev/null itself: were the check broken, the test would break it
        path = tmp_path / "null"
        path.symlink_to("/dev/null")
        match = r"exists and is a character device, not a regular file"
    elif target == "trailing_slash":
        path = str(tmp_path / "newdir") + os.sep
        match = r"names a directory; pass a file path in it"
    else:
        path = tmp_path
        match = r"names a directory"
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match=match):
        jaxport.save_variables(path, {"params": {"w": np.zeros(3, np.float32)}})
    assert sorted(os.listdir(tmp_path)) == before
    if target == "dev_null_link":
        assert os.path.islink(tmp_path / "null")
    # The guard under every writer, atomic_path, refuses the same targets.
    if target in ("fifo", "dev_null_link"):
        with pytest.raises(OSError, match="not a regular file; nothing was written"):
            with atomic_path(path):
                pass


def test_save_variables_names_why_a_path_cannot_be_written(tmp_path):
    """A file where a directory of the path should be raised mkdir's bare "File exists"; /proc
    (which takes no files) was reported as a full disk: "it needs 0.0 MB and 0.0 MB are free
    there; free some space"."""
    (tmp_path / "notes.txt").write_text("kept")
    variables = {"params": {"w": np.zeros(3, np.float32)}}
    with pytest.raises(OSError) as e:
        jaxport.save_variables(tmp_path / "notes.txt" / "x.safetensors", variables)
    assert (e.value.strerror, e.value.filename) == ("'" + str(tmp_path / "notes.txt") + "' is a file, not a directory",
                                                    str(tmp_path / "notes.txt" / "x.safetensors"))
    assert (tmp_path / "notes.txt").read_text() == "kept"
    if os.path.isdir("/proc/self"):
        with pytest.raises(OSError, match=r"cannot write '/proc/x.safetensors': its directory '/proc' does not "
                                          r"accept new files \(.+\); write elsewhere$"):
            jaxport.save_variables("/proc/x.safetensors", variables)


def test_save_variables_on_a_file_system_out_of_inodes_says_so(tmp_path, monkeypatch):
    """With no inodes left (bytes to spare) the temporary file's creation failed with a bare "No
    space left on device", read as a full disk, which `df -h` denied. A file system that counts
    no inodes (btrfs, NFS, /proc: 0 in all) is not refused for it."""
    real = os.statvfs
    inodes = {"files": 10**6, "free": 0}
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result(
        (*real(p)[:5], inodes["files"], inodes["free"], inodes["free"], *real(p)[8:])))
    variables = {"params": {"w": np.zeros(3, np.float32)}}
    with pytest.raises(OSError) as e:
        jaxport.save_variables(tmp_path / "v.safetensors", variables)
    assert re.fullmatch(rf"no free inodes \(files\) left to write '{re.escape(str(tmp_path))}/v.safetensors': it needs a "
                        r"new file and 0 can be made there, though [\d.]+ MB are free; delete some files there or "
                        r"write elsewhere", e.value.strerror), e.value.strerror
    assert os.listdir(tmp_path) == []
    inodes["files"] = 0
    jaxport.save_variables(tmp_path / "v.safetensors", variables)
    assert os.listdir(tmp_path) == ["v.safetensors"]
