"""`jaxport train` end to end at toy sizes: resume after SIGKILL, export, bad inputs, batch auto.

Subprocess runs use 2 simulated CPU devices and ResNet-18 at 16 px so each takes seconds.
"""
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
import types

import jax
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from jaxport._errors import CheckpointError, ConfigError
from jaxport.train import DivergedError, Interrupted, TrainConfig, load_workdir, train
from jaxport.train import _data
from jaxport._io import Terminated, flatten as flatten_tree
from torch_compat import flax_to_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = ["--arch", "resnet18", "--image-size", "16", "--batch-size", "32", "--epochs", "2", "--lr", "0.05",
       "--checkpoint-every", "4", "--no-progress"]


def _cli(workdir, *extra, devices=2):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=ROOT)
    return [sys.executable, "-m", "jaxport.train", "--workdir", str(workdir), *TOY, *extra], env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of the toy run to step 14, uninterrupted: what a killed or stopped run
    must reach once resumed. The tests that use it share an xdist group, so it runs once."""
    # 1438 digits / 32 = 44 steps per epoch; stop at step 14 (not at a checkpoint or epoch end).
    full = tmp_path_factory.mktemp("full")
    cmd, env = _cli(full, "--max-steps", "14")
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return load_workdir(str(full))[0]


@pytest.mark.slow
@pytest.mark.xdist_group("uninterrupted")
def test_resume_after_sigkill_gives_the_uninterrupted_weights(tmp_path, uninterrupted):
    killed = tmp_path / "killed"
    cmd, env = _cli(killed, "--max-steps", "14")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "8").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # just after step 8's checkpoint, mid-way to 12
    proc.wait()
    steps = sorted(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] < 14, steps
    # What a kill during a write leaves (seen with random kills): orbax's temporary of the step it
    # was saving (12, or 10 with another --checkpoint-every) and atomic_path's hidden file.
    for step in (10, 12):
        shutil.copytree(killed / "checkpoints" / str(steps[-1]), killed / "checkpoints" / f"{step}.orbax-checkpoint-tmp")
    (killed / ".metrics.jsonl.q1w2e3r4.tmp").write_text('{"epoch": 0}')
    out = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "resuming from step" in out.stderr and "WARNING" not in out.stderr, out.stderr
    assert not [p.name for p in killed.rglob("*") if "tmp" in p.name]
    assert out.stdout.strip() == f"stopped at step 14 (--max-steps), checkpoints in {killed}"

    b, arch = load_workdir(str(killed))
    assert arch == "resnet18"
    jax.tree.map(np.testing.assert_array_equal, uninterrupted, b)


@pytest.mark.slow
@pytest.mark.xdist_group("uninterrupted")
def test_sigterm_checkpoints_the_last_step_and_resume_is_exact(tmp_path, uninterrupted):
    """A scheduler's SIGTERM (or Ctrl-C's SIGINT) stops after the step in progress, checkpoints
    it, and exits 128 + signal with one line; --resume ends with the uninterrupted weights."""
    stopped = tmp_path / "stopped"
    cmd, env = _cli(stopped, "--max-steps", "14")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (stopped / "checkpoints" / "4").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    m = re.search(r"^jaxport: interrupted: SIGTERM at step (\d+): checkpoint saved in .*; continue with --resume$",
                  err, re.M)
    assert m, err
    steps = sorted(int(p.name) for p in (stopped / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == int(m[1]) and 4 <= steps[-1] < 14, (steps, err)

    out = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    b, _ = load_workdir(str(stopped))
    jax.tree.map(np.testing.assert_array_equal, uninterrupted, b)


def test_ctrl_c_in_process_raises_interrupted_after_checkpointing(tmp_path):
    """Through the library: SIGINT mid-run raises `Interrupted` (a KeyboardInterrupt) once the
    last finished step is checkpointed, and jax's handlers are back afterwards."""
    import threading

    before = signal.getsignal(signal.SIGINT)

    def log(msg):
        if msg.startswith("training"):  # the loop starts right after this line
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()

    said = []
    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=64, epochs=6, checkpoint_every=1000,
                      progress=False, devices=1)
    with pytest.raises(Interrupted) as e:
        train(cfg, log=lambda msg: (said.append(msg), log(msg)))
    assert isinstance(e.value, KeyboardInterrupt) and e.value.signum == signal.SIGINT
    # Said when the signal came: the stop waits for the step (or an epoch's evaluation) and its
    # checkpoint, and a silent wait drew the second Ctrl-C that lost them.
    assert ("SIGINT received: stopping after this step (or this epoch's evaluation), once it is checkpointed; "
            "another Ctrl-C stops at once, without that checkpoint") in said, said
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == e.value.step < 6 * 22
    assert signal.getsignal(signal.SIGINT) is before
    # The final weights file is the checkpointed step's: a resumed run that was interrupted left
    # the previous run's file, steps behind, for --init and export to read as its own.
    from jaxport._io import load_variables, read_metadata
    from jaxport.train import load_workdir

    assert read_metadata(tmp_path / "variables.safetensors")["step"] == str(e.value.step)
    saved, _ = load_workdir(str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, load_variables(tmp_path / "variables.safetensors"), saved)


@pytest.mark.slow
def test_train_digits_export_and_metrics(tmp_path):
    # One short epoch in-process (8 devices), then export to torchvision with strict=True.
    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=128, epochs=1, progress=False, sync_bn=True, devices=2)
    result = train(cfg)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 1 and rows[0]["step"] == 1438 // 128
    assert {"train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr"} <= rows[0].keys()
    assert (tmp_path / "training_curves.png").stat().st_size > 1000
    assert result["val_acc"] == rows[0]["val_acc"]

    variables, arch = load_workdir(str(tmp_path))
    # The final weights file (jaxport's variables format) equals the last checkpoint, bit for bit.
    from jaxport import load_variables, read_metadata
    from jaxport._io import flatten
    from jaxport.train._loop import FINAL_VARIABLES

    final = tmp_path / FINAL_VARIABLES
    assert read_metadata(final)["arch"] == arch
    ours, ckpt = flatten(load_variables(final)), flatten(variables)
    assert ours.keys() == ckpt.keys() and all(np.array_equal(ours[k], ckpt[k]) for k in ckpt)
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(flax_to_torch(variables, arch), strict=True)
    # torch and JAX agree on predictions for the exported weights
    x = _data.digits(16).val.load(range(32), 0)[0]
    from jaxport.models import build

    jax_logits = build(arch, num_classes=10).apply(variables, x)
    with torch.no_grad():
        torch_logits = model.eval()(torch.tensor(x.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(jax_logits, torch_logits, rtol=1e-4, atol=1e-4)

    # `jaxport export WORKDIR` may write beside the run's files, never over them
    from jaxport._cli import main

    assert main(["export", str(tmp_path), "--out", str(final)]) == 2
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "checkpoints" / "x.pt")]) == 2
    assert read_metadata(final)["arch"] == arch
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "model.pt")]) == 0

    # the same workdir without --resume is refused
    with pytest.raises(ConfigError, match="already holds checkpoints.*--resume"):
        train(cfg)


# A run of 2 steps that checkpoints both: what the tests below break or resume, each in a copy
# of its own. They share an xdist group, so it is trained once (it was once per test).
TWO_STEPS = dict(image_size=16, batch_size=64, epochs=1, max_steps=2, checkpoint_every=1, progress=False, devices=1)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    work = tmp_path_factory.mktemp("two-steps") / "w"
    train(TrainConfig(workdir=str(work), **TWO_STEPS))
    return work


def _copy_of(workdir, tmp_path):
    shutil.copytree(workdir, tmp_path / "w")
    return tmp_path / "w"


@pytest.mark.xdist_group("two_steps")
def test_corrupt_checkpoint_on_resume(tmp_path, two_steps):
    work = _copy_of(two_steps, tmp_path)
    cfg = TrainConfig(workdir=str(work), **TWO_STEPS)
    latest = work / "checkpoints" / "2" / "state"
    for root, _, files in os.walk(latest):
        for f in files:
            with open(os.path.join(root, f), "r+b") as fh:
                fh.truncate(max(0, os.path.getsize(os.path.join(root, f)) // 3))
    with pytest.raises(CheckpointError, match=r"checkpoint step 2 .* cannot be read .*delete .*2 to resume from step 1"):
        train(TrainConfig(**{**cfg.__dict__, "resume": True}))


@pytest.mark.parametrize("terminal", [True, False])
def test_the_clis_default_shows_a_progress_bar_on_a_terminal_only(tmp_path, monkeypatch, terminal):
    """`jaxport train` passes progress=None (no --no-progress); the bar was built only for a
    true value, so the CLI never showed one, on a terminal or not."""
    class Stderr(io.StringIO):
        def isatty(self):
            return terminal

    monkeypatch.setattr(sys, "stderr", Stderr())
    train(TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=64, epochs=1, max_steps=2,
                      checkpoint_every=1000, progress=None, devices=1))
    shown = sys.stderr.getvalue()
    assert ("epoch 1/1" in shown and "img_s=" in shown) == terminal, shown
    assert "training resnet18" in shown  # the log lines go there either way


@pytest.mark.slow
@pytest.mark.xdist_group("two_steps")
def test_export_of_a_workdir_names_what_can_be_read(tmp_path, capsys, two_steps):
    """`jaxport export WORKDIR` with an unreadable latest checkpoint: besides the one-line error,
    tensorstore's leftover reads printed up to hundreds of lines of "Event loop is closed"
    tracebacks, and the advice was to delete the checkpoint and train again, though the run's
    final variables file was intact. A checkpoint meta without `arch` was a KeyError even with
    --arch."""
    _copy_of(two_steps, tmp_path)  # tmp_path / "w"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def export(workdir, *extra):
        return subprocess.run([sys.executable, "-m", "jaxport", "export", str(workdir), "--out",
                               str(tmp_path / "x.pt"), "--force", *extra], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": root}, timeout=300)

    def export_here(workdir, *extra):
        """The messages alone, in this process: a command line's own exit is what `export`'s
        subprocesses below are for (each costs seconds of imports)."""
        from jaxport._cli import main

        capsys.readouterr()
        code = main(["export", str(workdir), "--out", str(tmp_path / "x.pt"), "--force", *extra])
        return code, capsys.readouterr().err

    meta = tmp_path / "w" / "checkpoints" / "2" / "meta" / "metadata"
    saved_meta = meta.read_text()
    record = json.loads(saved_meta)
    del record["arch"]
    meta.write_text(json.dumps(record))
    code, err = export_here(tmp_path / "w")
    assert code == 2 and "does not record its architecture; pass --arch" in err, err
    assert export_here(tmp_path / "w", "--arch", "resnet18")[0] == 0
    meta.write_text(saved_meta)

    # One data file cut short (a disk filled mid-copy): orbax failed on one array and left its
    # other reads pending; each printed tensorstore's whole spec as it was collected (66 to
    # 2,467 lines after the error), and the error itself ended in orbax's cut-off repr of a
    # bound method instead of tensorstore's message naming the array.
    data = max((os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "w" / "checkpoints" / "2" / "state")
                for f in fs), key=os.path.getsize)
    with open(data, "r+b") as fh:
        fh.truncate(1000)
    resume = subprocess.run([sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), "--resume",
                             "--image-size", "16", "--batch-size", "64", "--epochs", "1", "--max-steps", "3",
                             "--checkpoint-every", "1", "--no-progress"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": root}, timeout=300)
    for proc in [resume] + [export(tmp_path / "w") for _ in range(2)]:
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert "checkpoint step 2 in" in proc.stderr and 'Error reading "' in proc.stderr, proc.stderr
        assert "bound method" not in proc.stderr, proc.stderr

    for dirpath, _, files in os.walk(tmp_path / "w" / "checkpoints" / "2" / "state"):
        for f in files:
            with open(os.path.join(dirpath, f), "r+b") as fh:
                fh.truncate(os.path.getsize(os.path.join(dirpath, f)) // 3)
    for _ in range(3):  # the leftover callbacks raced the interpreter's exit: seen in 3 of 12 runs
        proc = export(tmp_path / "w")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
        assert re.fullmatch(r"jaxport: error: checkpoint step 2 in \S+checkpoints cannot be read \(.*\); move "
                            r"\S+2 aside to read step 1; its final weights are in \S+variables\.safetensors "
                            r"\(jaxport export can read it\)\n", proc.stderr), proc.stderr

    shutil.rmtree(tmp_path / "w" / "checkpoints")
    code, err = export_here(tmp_path / "w")
    assert code == 2 and "has no checkpoints/ directory; its final weights are in" in err, err


@pytest.mark.parametrize("sync_bn, refused", [(False, True), (True, False)])
def test_one_image_per_device_at_1x1_maps_is_refused_before_compiling(tmp_path, monkeypatch, sync_bn, refused):
    """At 16 px layer4's maps are 1x1, so per-device BatchNorm over 1 image per device sees one
    value per channel (torch refuses it); synchronised over 2 devices it sees two."""
    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=2, epochs=1, max_steps=1, progress=False,
                      devices=2, sync_bn=sync_bn)
    if refused:
        with pytest.raises(ConfigError, match=r"`--batch-size` \(=2\) gives 1 image per device, and at `--image-size` "
                                              r"\(=16\) layer4's maps are 1x1: .* use --batch-size 4 \(2 per device\) "
                                              r"or --sync-bn, or --image-size 33 or more"):
            train(cfg)
        assert not os.listdir(tmp_path)
    else:
        assert train(cfg)["steps_run"] == 1
        # Resumed without --sync-bn: the batch and image size are the checkpoint's (--resume
        # refuses others), so suggesting them sent the user from one refusal to the next.
        with pytest.raises(ConfigError, match=r"gives 1 image per device, .*; a resumed run keeps the checkpoint's "
                                              r"batch and image size: use --sync-bn, or resume where jax sees at most 1 "
                                              r"device \(the checkpoint's run had 2\)$"):
            train(TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 2, "sync_bn": False}))


def test_resume_says_which_settings_changed(tmp_path):
    """--resume may change the learning rate or the epochs (e.g. after a divergence), but never
    silently: the checkpoint records the settings and the resumed run names each change."""
    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=64, epochs=2, max_steps=1, lr=0.05,
                      checkpoint_every=1000, progress=False, devices=1)
    train(cfg)
    same, changed = [], []
    train(TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 2}), log=same.append)
    assert "resuming from step 1" in same and not any("changed" in m for m in same), same
    # No epoch has ended: a resume wrote an empty metrics.jsonl all the same.
    assert not (tmp_path / "metrics.jsonl").exists()
    train(TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 3, "lr": 0.01, "epochs": 3,
                         "sync_bn": True, "bn_stats": "first", "label_smoothing": 0.1}), log=changed.append)
    assert ("resuming from step 2 with changed settings: --epochs 3 (was 2), --lr 0.01 (was 0.05), --sync-bn "
            "(was off), --bn-stats first (was mean), --label-smoothing 0.1 (was 0.0) (the cosine schedule now ends at "
            "the new --epochs)") in changed, changed
    # A momentum of 0 keeps no buffer (as torch): the state's structure differs. This said
    # "cannot be read ... delete checkpoints/3" of a good checkpoint.
    with pytest.raises(ConfigError, match=r"--resume: `--momentum` \(=0.0\) cannot continue the run in .*, trained "
                                          r"with --momentum 0.9: changing it to or from 0"):
        train(TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 4, "momentum": 0.0}))


def test_numpy_typed_settings_train_and_checkpoint_as_python_values(tmp_path):
    """`validate` takes numpy scalars, but the settings go into every checkpoint as JSON: a run
    with them trained to its first checkpoint, failed there ("Object of type bool is not JSON
    serializable") with the steps lost, and left a workdir that refused a fresh run."""
    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=np.int64(64), epochs=np.int32(1),
                      max_steps=np.int64(1), lr=np.float32(0.05), momentum=np.float64(0.9), sync_bn=np.bool_(False),
                      dtype=np.dtype("float32"), checkpoint_every=1000, progress=False, devices=1)
    cfg.validate()
    assert train(cfg)["steps_run"] == 1
    logged = []
    train(TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=64, epochs=1, max_steps=2,
                      lr=float(np.float32(0.05)), checkpoint_every=1000, progress=False, devices=1, resume=True),
          log=logged.append)
    assert "resuming from step 1" in logged, logged  # the same settings, read back as Python values


@pytest.mark.parametrize("field, value, match", [
    ("checkpoint_every", 0, r"`--checkpoint-every` \(=0\) must be >= 1"),  # was a ZeroDivisionError
    ("keep_checkpoints", 0, r"`--keep-checkpoints` \(=0\) must be >= 1"),
    ("max_steps", 0, r"`--max-steps` \(=0\) must be >= 1"),
    ("devices", 0, r"`devices` \(=0\) must be >= 1"),  # library only: no CLI flag
    ("workers", -1, r"`--workers` \(=-1\) must be >= 0"),
    ("lr", float("nan"), r"`--lr` \(=nan\) must be a finite number > 0"),  # NaN passes `lr <= 0`
    ("lr", float("inf"), r"`--lr` \(=inf\) must be a finite number > 0"),
    ("momentum", -0.5, r"`--momentum` \(=-0.5\) must be a finite number >= 0"),
    ("weight_decay", float("nan"), r"`--weight-decay` \(=nan\) must be a finite number >= 0"),
    # library only; was a bare TypeError after a compile, and -5 "more than the -0 MiB available"
    ("memory_limit_bytes", "1G", r"`memory_limit_bytes` \(='1G'\) must be a number of bytes >= 1"),
    ("memory_limit_bytes", -5, r"`memory_limit_bytes` \(=-5\) must be a number of bytes >= 1"),
])
def test_invalid_settings_are_refused_before_any_work(tmp_path, field, value, match):
    with pytest.raises(ConfigError, match=match):
        train(TrainConfig(workdir=str(tmp_path / "w"), **{field: value}))
    assert not (tmp_path / "w").exists()


def test_a_workdir_that_is_a_file_is_refused_by_name(tmp_path):
    """Was jax/orbax's bare "File exists: 'w'" / "Not a directory"."""
    (tmp_path / "w").write_text("notes")
    with pytest.raises(ConfigError, match=r"`--workdir` \(=.*w\) is a file, not a directory"):
        train(TrainConfig(workdir=str(tmp_path / "w")))
    with pytest.raises(ConfigError, match=r"`--workdir` \(=.*w/run/1\) is inside '.*w', which is a file"):
        train(TrainConfig(workdir=str(tmp_path / "w" / "run" / "1")))
    assert (tmp_path / "w").read_text() == "notes"


@pytest.mark.parametrize("coordinator, num_processes, process_id, match", [
    (None, 2, None, "`--coordinator`, `--num-processes` and `--process-id` go together"),
    ("127.0.0.1:1234", 0, 0, r"`--num-processes` \(=0\) must be >= 1"),
    ("127.0.0.1:1234", 2, 5, r"`--process-id` \(=5\) must be in \[0, 2\)"),
    ("nohost", 1, 0, r"`--coordinator` \(='nohost'\) must be host:port"),  # was an internal IndexError
    ("host:99999", 1, 0, r"`--coordinator` \(='host:99999'\) must be host:port"),
])
def test_invalid_multi_process_settings_are_refused_before_any_connection(coordinator, num_processes, process_id,
                                                                          match):
    from jaxport.train import _distributed

    with pytest.raises(ConfigError, match=match):
        _distributed.initialize(coordinator, num_processes, process_id)


def test_an_unreachable_or_busy_coordinator_is_a_clear_error():
    """A wrong --coordinator hung for five minutes, then died in a C++ abort with a stack trace;
    a busy port was an internal "Failed to start RPC server"."""
    import socket

    from jaxport.train import _distributed

    with socket.socket() as listener:  # something else already listens on the port
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} is in use on this machine, and process 0 serves"):
            _distributed.initialize(f"127.0.0.1:{port}", 2, 0)
    said = []
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"`--coordinator` \(='127.0.0.1:{port}'\) did not answer within 1.5 s "
                                          r"\(Connection refused\): start process 0 \(--process-id 0\)"):
        _distributed.initialize(f"127.0.0.1:{port}", 2, 1, connect_timeout_s=1.5, log=said.append)
    assert 1.5 <= time.monotonic() - t0 < 10
    assert said == [f"waiting for the coordinator at 127.0.0.1:{port} (process 0) ..."]
    with pytest.raises(ConfigError, match=r"cannot resolve host 'no-such-host.invalid'"):
        _distributed.initialize("no-such-host.invalid:1234", 2, 1, connect_timeout_s=1.5)


def test_a_process_whose_peers_never_join_stops_with_one_line():
    """Process 0 of 2 with nobody else: jax aborts after its timeout with a C++ stack trace
    (rc 134); jaxport's watchdog ends it first with one line and status 2."""
    import socket

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("from jaxport.train import _distributed\n"
            f"_distributed.initialize('127.0.0.1:{port}', 2, 0, connect_timeout_s=3)\n"
            "print('initialised')")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc.stderr
    assert 3 <= time.monotonic() - t0 < 60
    assert "initialised" not in proc.stdout and "stack trace" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("jaxport: error")]
    assert lines == [f"jaxport: error: the 2 processes did not all connect to the coordinator at 127.0.0.1:{port} "
                     "within 3 s: start every process (--process-id 0 to 1) with the same --coordinator and "
                     "--num-processes"], proc.stderr


def test_a_coordinator_port_held_by_another_program_is_said():
    """Process 1 connected to whatever held the port (here a plain listener, not jax), then
    printed nothing for the whole timeout and ended with the generic line."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = ("from jaxport.train import _distributed\n"
                f"_distributed.initialize('127.0.0.1:{port}', 2, 1, connect_timeout_s=3)\n"
                "print('initialised')")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and "initialised" not in proc.stdout and "stack trace" not in proc.stderr, proc.stderr
    said = [x for x in proc.stderr.splitlines() if x.strip()]
    assert said[0] == (f"process 1: the coordinator at 127.0.0.1:{port} answered; waiting for all 2 processes to "
                       "join (up to 3 s)"), proc.stderr
    assert said[-1].startswith("jaxport: error: the 2 processes did not all connect"), proc.stderr
    assert said[-1].endswith(f"(something answers at 127.0.0.1:{port}; if process 0 of this run is not running "
                             "there, another program holds that port)"), proc.stderr


@pytest.mark.xdist_group("two_steps")
def test_divergence_stops_and_keeps_the_good_checkpoints(tmp_path, two_steps):
    """A run whose loss or weights turn non-finite stops with a clear error naming the step and
    the latest checkpoint; nothing non-finite is ever saved, so the checkpoints left (and the
    previous run's final variables) are finite and --resume can continue from them."""
    work = _copy_of(two_steps, tmp_path)  # trained with --keep-checkpoints 3 (the default): 1 and 2 are kept
    cfg = TrainConfig(workdir=str(work), **{**TWO_STEPS, "keep_checkpoints": 2})
    final = (work / "variables.safetensors").read_bytes()
    with pytest.raises(DivergedError) as e:
        train(TrainConfig(**{**cfg.__dict__, "resume": True, "lr": 1e12, "max_steps": 12}))
    m = re.fullmatch(r"training diverged: the (loss|weights) became \S+ at step (\d+); nothing non-finite was "
                     r"saved, and the latest checkpoint, step (\d+), is intact: rerun with --resume and a lower "
                     r"--lr \(now 1000000000000.0; --momentum 0.9\) to continue from it \(or check .*\)", str(e.value))
    assert m, str(e.value)
    failed, latest = int(m[2]), int(m[3])
    assert 2 <= latest < failed
    steps = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == latest and len(steps) <= 2
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(load_workdir(str(work))[0]))
    assert (work / "variables.safetensors").read_bytes() == final


def test_a_full_disk_while_checkpointing_is_named_as_such(tmp_path, monkeypatch):
    """A full disk during a checkpoint was reported as "out of device memory (RESOURCE_EXHAUSTED)
    ... use --batch-size 56" (orbax says RESOURCE_EXHAUSTED too), after ~900 lines of tracebacks
    from orbax's writer threads."""
    import collections

    import orbax.checkpoint as ocp

    from jaxport.train import _checkpoint

    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=64, epochs=1, max_steps=3,
                      checkpoint_every=1, progress=False, devices=1)
    save = ocp.CheckpointManager.save

    def disk_fills_after_step_1(self, step, *args, **kwargs):
        if step >= 2:
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "params.fc.bias/0" in OCDBT database: Failed to '
                             "write 4096 bytes to file 17: No space left on device [os_error_code='28']")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_fills_after_step_1)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint step 2 in .*checkpoints: the disk is full: "
                                              r"free some space; "
                                              r".*the latest checkpoint, step 1, is intact: rerun with --resume"):
        train(cfg)
    monkeypatch.undo()
    # Checked before writing: orbax's threads never start a write that cannot fit.
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(_checkpoint.shutil, "disk_usage", lambda p: usage(10**12, 10**12 - 10**6, 10**6))
    with pytest.raises(CheckpointError, match=r"could not write checkpoint step 2 .*: not enough space to save it: it "
                                              r"needs [\d.]+ MB and 1.0 MB are free there; .*step 1, is intact"):
        train(TrainConfig(**{**cfg.__dict__, "resume": True}))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]


def _image_folder(root, classes=("a", "b"), per_class=6, corrupt=0):
    rng = np.random.default_rng(0)
    for c in classes:
        os.makedirs(root / c, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    for i in range(corrupt):
        (root / classes[0] / f"bad{i}.jpg").write_bytes(b"not an image")
    return root


def test_image_folder_trains_and_skips_unreadable(tmp_path, monkeypatch):
    """Also: the run's `variables.safetensors` says what its outputs mean and how it was fed, in
    the fields a port of torchvision's weights has: its classes in output order (`categories`),
    the held-out transform the run used (`preprocess`, read off that transform's torchvision
    objects) and `--init`. Before, it recorded the step alone."""
    from jaxport._io import read_metadata
    from jaxport.train import _presets

    root = _image_folder(tmp_path / "data", per_class=10, corrupt=2)
    with pytest.warns(UserWarning) as record:
        data = _data.image_folder(str(root), image_size=16, workers=0)
    messages = [str(w.message) for w in record]
    # One warning per file, naming it, and one count at the end.
    assert sum("skipping unreadable image" in m and "bad" in m for m in messages) == 2, messages
    assert any("2 unreadable image" in m for m in messages), messages
    assert data.skipped == 2 and data.classes == ["a", "b"]
    assert data.train.num_examples + data.val.num_examples == 20
    x, y = data.train.load([0, 1], 0)
    assert x.shape == (2, 16, 16, 3) and x.dtype == np.float32
    # augmentation is a function of (seed, epoch, index): same twice, different next epoch
    np.testing.assert_array_equal(x, data.train.load([0, 1], 0)[0])
    assert not np.array_equal(x, data.train.load([0, 1], 1)[0])
    # parallel loading (spawned workers) gives the same batches
    batches = [[0, 1], [2, 3]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        par = _data.image_folder(str(root), image_size=16, workers=2)
    for (xa, ya), b in zip(par.train.stream(iter(batches), 0), batches):
        xb, yb = data.train.load(b, 0)
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)

    used, real = [], _presets.transforms
    monkeypatch.setattr(_presets, "transforms", lambda *a, **kw: used.append(real(*a, **kw)) or used[-1])
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "start.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(TrainConfig(workdir=str(tmp_path / "w"), data=str(root), image_size=16, batch_size=8,
                                   epochs=1, workers=0, progress=False, devices=1, val_resize_size=20,
                                   interpolation="bicubic", init=str(tmp_path / "start.pt")))
    assert 0 <= result["val_acc"] <= 1
    meta = read_metadata(tmp_path / "w" / "variables.safetensors")
    assert json.loads(meta["categories"]) == data.classes and meta["init"] == str(tmp_path / "start.pt")
    resize, crop, _, _, normalize = used[-1][1].transforms  # the evaluation's Compose (`_presets.eval_transform`)
    assert json.loads(meta["preprocess"]) == {
        "resize_size": [resize.size], "crop_size": [crop.size[0]], "interpolation": resize.interpolation.value,
        "antialias": resize.antialias, "mean": list(normalize.mean), "std": list(normalize.std)}
    assert (resize.size, crop.size, resize.interpolation.value) == (20, (16, 16), "bicubic")  # as given


def test_init_reads_every_format_and_refuses_the_wrong_ones(tmp_path):
    """`--init` takes what `jaxport port` takes (torch checkpoints, including .safetensors of
    torch keys as the hubs publish them) plus jaxport's own files, with the same safety."""
    import safetensors.numpy
    import safetensors.torch

    import jaxport
    from jaxport.train._cli import config_from_args
    from jaxport.train._init import fit_head, load_init
    from tests.helpers import reference
    from torch_compat import torch_to_flax

    model = reference("resnet18")
    want = flatten_tree(torch_to_flax(model.state_dict(), "resnet18"))
    torch.save(model.state_dict(), tmp_path / "sd.pth")
    safetensors.torch.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "hub.safetensors")
    jaxport.save_variables(tmp_path / "ours.safetensors", torch_to_flax(model.state_dict()), arch="resnet18")
    torch.save(model, tmp_path / "whole.pt")
    for name in ("sd.pth", "hub.safetensors", "ours.safetensors"):
        got = flatten_tree(load_init(str(tmp_path / name), "resnet18"))
        assert got.keys() == want.keys(), name
        assert all(np.array_equal(got[k], want[k]) for k in want), name
    with pytest.raises(ConfigError, match=r"`--init` \(=.*ours.safetensors\) holds resnet18 weights but `--arch` is resnet34"):
        load_init(str(tmp_path / "ours.safetensors"), "resnet34")  # the recorded arch is checked too
    with pytest.raises(CheckpointError, match="whole.pt.*outside the weights-only allowed set.*--trusted"):
        load_init(str(tmp_path / "whole.pt"), "resnet18")
    got = flatten_tree(load_init(str(tmp_path / "whole.pt"), "resnet18", trusted=True))
    assert all(np.array_equal(got[k], want[k]) for k in want)
    from jaxport._cli import build_parser

    args = build_parser().parse_args(["train", "--workdir", "w", "--init", "whole.pt", "--trusted"])
    assert args.trusted and config_from_args(args).trusted  # the flag the refusal names exists
    safetensors.numpy.save_file({}, str(tmp_path / "empty.safetensors"))
    with pytest.raises(CheckpointError, match="--init weights hold no ResNet parameters"):
        fit_head(load_init(str(tmp_path / "empty.safetensors"), "resnet18"), {})  # was a KeyError
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match=r"`--init` \(=.*folder\) is a directory but not a `jaxport train` workdir"):
        load_init(str(tmp_path / "folder"), "resnet18")


def test_init_knows_a_variables_file_by_content_and_names_another_architecture(tmp_path):
    """A port under another name (`R18.SAFETENSORS`, `r18.st`: `port --out` takes any) was sent
    to the torch loader, which refused it as "already a jaxport variables file". A variables
    file that records no architecture (`save_variables` without `arch=`) of a resnet34 given
    with --arch resnet18 was an internal pytree error; of a resnet50, a "re-initialising fc
    (10 -> 10 outputs)" line, then a bare list of tuples."""
    import shutil

    import jaxport
    from jaxport.models import build
    from jaxport.train._init import fit_head, load_init
    from tests.helpers import reference
    from torch_compat import torch_to_flax

    variables = torch_to_flax(reference("resnet18").state_dict(), "resnet18")
    jaxport.save_variables(tmp_path / "r18.safetensors", variables, arch="resnet18")
    want = flatten_tree(variables)
    for name in ("R18.SAFETENSORS", "r18.st"):
        shutil.copy(tmp_path / "r18.safetensors", tmp_path / name)
        got = flatten_tree(load_init(str(tmp_path / name), "resnet18"))
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), name

    fresh = jax.tree.map(np.asarray, build("resnet18", num_classes=10).init(jax.random.key(0),
                                                                            np.zeros((1, 16, 16, 3), np.float32)))
    for other, what in (("resnet34", r"\d+ unexpected \(params/layer1/2/bn1/bias, "),
                        ("resnet50", r"\d+ of another shape \(batch_stats/layer2/0/downsample/1/mean: \(512,\) in the "
                                     r"file, \(128,\) in the model")):
        # Only the names and shapes matter here: zeros of the shapes `init` gives (ResNet-50's
        # `init`, run op by op, took most of this test's time).
        theirs = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), jax.eval_shape(
            build(other, num_classes=10).init, jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32)))
        jaxport.save_variables(tmp_path / f"{other}.safetensors", theirs)  # no arch recorded
        said = []
        with pytest.raises(CheckpointError, match=rf"--init weights do not fit a resnet18: .*{what}.*they are "
                                                  r"another architecture's: pass the --arch they were trained with"):
            fit_head(load_init(str(tmp_path / f"{other}.safetensors"), "resnet18"), fresh, said.append, "resnet18")
        assert said == [], said


def test_init_says_whether_the_head_is_kept_and_nothing_before_a_misfit():
    """A kept classifier printed nothing, so a user could not tell it from one silently
    re-initialised; a misfit of another class count printed "re-initialising fc" before its error."""
    from jaxport.models import build
    from jaxport.train._init import fit_head

    def variables(arch, classes):
        return jax.tree.map(np.asarray, build(arch, num_classes=classes).init(jax.random.key(0),
                                                                            np.zeros((1, 16, 16, 3), np.float32)))

    fresh, same = variables("resnet18", 10), variables("resnet18", 10)
    said = []
    out = fit_head(same, fresh, said.append, "resnet18")
    assert said == ["--init: every weight taken, the classifier's included (10 classes, as the data has)"]
    np.testing.assert_array_equal(out["params"]["fc"]["kernel"], same["params"]["fc"]["kernel"])
    # Half weights (kept so by `port`) become float32 master weights: said, not silent.
    for half_dtype in (np.float16, jax.numpy.bfloat16):  # (numpy does not call ml_dtypes' bfloat16 floating)
        half = jax.tree.map(lambda a: a.astype(half_dtype) if a.dtype == np.float32 else a, same)
        said = []
        out = fit_head(half, fresh, said.append, "resnet18")
        assert said == ["--init: every weight taken, the classifier's included (10 classes, as the data has); "
                        f"{np.dtype(half_dtype).name} weights upcast to the run's float32"]
        assert out["params"]["conv1"]["kernel"].dtype == np.float32
    said = []
    fit_head(variables("resnet18", 4), fresh, said.append, "resnet18")
    assert said == ["--init: classifier head has 4 classes, the data 10: re-initialising fc (4 -> 10 outputs)"]
    said = []
    with pytest.raises(CheckpointError, match="--init weights do not fit a resnet18: "):
        fit_head(variables("resnet34", 4), fresh, said.append, "resnet18")
    assert said == [], said


def test_a_workdir_another_run_is_writing_is_refused(tmp_path, monkeypatch):
    """Two runs started together into one empty workdir both passed the check for an earlier
    run's files, trained side by side, and both died at their first checkpoint (FileExistsError
    on each other's temporary directory), all their work lost. The refusal then came after
    loading the data and compiling (minutes for ResNet-50 on a real --data); now before."""
    import fcntl

    work = tmp_path / "w"
    work.mkdir()
    cfg = TrainConfig(workdir=str(work), image_size=16, batch_size=64, epochs=1, max_steps=1, progress=False,
                      devices=1)
    fd = os.open(work, os.O_RDONLY)  # what the other run holds while it trains
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with monkeypatch.context() as m:
            m.setattr(_data, "digits", lambda *a, **k: pytest.fail("the data was loaded before the lock was asked"))
            for resume in (False, True):
                with pytest.raises(ConfigError, match=r"`--workdir` \(=\S+w\) is in use by another `jaxport train` "
                                                      r"run on this machine; wait for it to end .*nothing was written"):
                    train(TrainConfig(**{**cfg.__dict__, "resume": resume}))
    finally:
        os.close(fd)
    assert list(work.iterdir()) == []
    assert train(cfg)["steps_run"] == 1  # once it has ended
    assert train(TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 2}))["steps_run"] == 1  # released


def test_bad_data_directories(tmp_path):
    with pytest.raises(ConfigError, match=r"`--data` \(=.*missing\) is not a directory"):
        train(TrainConfig(workdir=str(tmp_path / "w"), data=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no images"):
        _data.image_folder(str(tmp_path / "empty"))
    split = tmp_path / "split"
    _image_folder(split / "train", classes=("a", "b"))
    _image_folder(split / "val", classes=("a", "c"))
    with pytest.raises(ConfigError, match=r"only in train/: b; only in val/: c"):
        _data.image_folder(str(split))
    # val/ with one class folder, or with one of two left empty, was "has images of a single
    # class ... classification needs at least 2", though train/ had two; and the advice for an
    # empty val/ folder, to remove it, led to the refusal above.
    shutil.rmtree(split / "val" / "c")
    with pytest.raises(ConfigError, match=r"only in train/: b; only in val/: none"):
        _data.image_folder(str(split))
    (split / "val" / "b").mkdir()
    with pytest.raises(ConfigError, match=r"val\): class folder\(s\) 'b' hold no readable images .*; add held-out "
                                          r"images of each \(e.g. move a few from train/\): val/ needs every class"):
        _data.image_folder(str(split))
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes b"):  # torchvision agrees
        torchvision.datasets.ImageFolder(str(split / "val"))
    one = _image_folder(tmp_path / "one", classes=("only",))
    with pytest.raises(ConfigError, match="single class .*'only'.*at least 2"):
        _data.image_folder(str(one))
    # An empty class folder was trained on as a class with no images (torchvision refuses it).
    gap = _image_folder(tmp_path / "gap", classes=("a", "b"), per_class=10)
    (gap / "b_new").mkdir()
    (gap / "b_new" / "notes.txt").write_text("labels to come")
    with pytest.raises(ConfigError, match=r"class folder\(s\) 'b_new' hold no readable images"):
        _data.image_folder(str(gap))
    with pytest.raises(FileNotFoundError, match="b_new"):  # torchvision's own verdict on the same folder
        torchvision.datasets.ImageFolder(str(gap))


def test_batch_not_dividing_devices_is_refused_up_front(tmp_path):
    with pytest.raises(ConfigError, match=r"`--batch-size` \(=30\) must be divisible by the number of devices \(=8\); use 32 or 24"):
        train(TrainConfig(workdir=str(tmp_path), batch_size=30, image_size=16))
    assert not (tmp_path / "checkpoints").exists()


def test_cli_reports_errors_on_one_line(tmp_path):
    cmd, env = _cli(tmp_path, "--data", str(tmp_path / "nope"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "is not a directory" in out.stderr


def test_batch_size_auto_from_memory_analysis():
    from jaxport.models import build
    from jaxport.train import OutOfMemoryError, create_state, largest_batch, make_mesh, make_train_step, step_bytes
    from torch_compat import optim

    mesh = make_mesh(jax.devices()[:1])
    model = build("resnet18", num_classes=10)
    variables = model.init(jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32))
    tx = optim.sgd(0.1, momentum=0.9)
    state = create_state(variables, tx, mesh)
    step = make_train_step(model, tx, mesh, donate=False)
    m4, m5 = step_bytes(step, state, mesh, 4, 8), step_bytes(step, state, mesh, 5, 8)
    assert m5 > m4 > 0  # XLA's analysis grows with the batch
    messages = []
    # At 8 px one image per device is no valid train step (1x1 maps): the search starts at 2. It
    # compiles each size it asks about; up to 8, not the default 256, it asks fewer and smaller
    # ones (the search itself is checked on many curves in test_train_memory.py).
    assert largest_batch(step, state, mesh, 8, (m4 + m5) // 2, log=messages.append, min_per_device=2,
                         max_per_device=8) == 4
    assert "4 per device" in messages[0]
    with pytest.raises(OutOfMemoryError, match="a batch of 2 per device needs"):
        largest_batch(step, state, mesh, 8, 1000, min_per_device=2)


@pytest.mark.slow
def test_default_digits_run_reaches_95_percent(tmp_path):
    """The issue's claim, as a user runs it: `jaxport train` with every default, one device."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = root
    proc = subprocess.run([sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "run"),
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == TrainConfig(workdir="w").epochs and rows[-1]["val_acc"] >= 0.95, rows[-1]
    assert (tmp_path / "run" / "training_curves.png").stat().st_size > 10_000


def test_the_last_line_says_how_the_run_ended():
    """It used to report an earlier epoch's accuracy as the result of a run that --max-steps
    stopped later, and 'stopped (--max-steps)' for a resumed run that had nothing left to do."""
    from types import SimpleNamespace

    from jaxport.train._cli import summary

    state = SimpleNamespace(step=np.int32(25))
    row = {"epoch": 0, "step": 22, "val_acc": 0.5}
    assert summary({**row, "state": state, "steps_run": 25}, "w", 2) == (
        "stopped at step 25 (--max-steps); last evaluation (epoch 1, step 22): val accuracy 0.5000, checkpoints in w")
    assert summary({"state": state, "steps_run": 3}, "w", 2) == "stopped at step 25 (--max-steps), checkpoints in w"
    assert summary({**row, "step": 25, "state": state, "steps_run": 3}, "w", 1) == "val accuracy 0.5000, checkpoints in w"
    # --max-steps at the end of epoch 1 of 2 was reported as a finished run
    assert summary({**row, "step": 25, "state": state, "steps_run": 3}, "w", 2) == (
        "stopped at step 25 (--max-steps) after epoch 1 of 2: val accuracy 0.5000, checkpoints in w")
    assert summary({"state": state, "steps_run": 0}, "w", 2) == "nothing to train: already at step 25, checkpoints in w"
    # a resumed epoch evaluated (its evaluation had failed) at the run's end: trained before, not "nothing to train"
    assert summary({**row, "step": 25, "state": state, "steps_run": 0}, "w", 1) == "val accuracy 0.5000, checkpoints in w"


@pytest.mark.parametrize("error, text, code", [
    (KeyboardInterrupt(), "interrupted (Ctrl-C)", 130),
    (Terminated("SIGTERM"), "interrupted (SIGTERM)", 143),
    (ConfigError("`--data` (=x) does not exist"), "`--data` (=x) does not exist", 2),
])
def test_a_process_that_stops_alone_tells_the_others_why_and_exits_as_the_cli_would(monkeypatch, error, text, code):
    """A SIGTERM that reached one process before jax's preemption service held the signal
    (while it waited for the coordinator) was told to the others as "Ctrl-C", and exited 130."""
    from jaxport.train import _distributed

    published = {}
    client = types.SimpleNamespace(key_value_set=lambda key, value: published.update({key: value}))
    monkeypatch.setattr(_distributed, "_client", lambda: client)
    monkeypatch.setattr(_distributed, "_watch", {"started": True, "published": False, "finished": False})
    _distributed.publish_failure(error)
    assert published == {"jaxport/failed/0": text}
    assert _distributed._watch.get("code", _distributed.EXIT_FAILED) == code


def test_the_failure_watcher_is_stopped_and_joined_before_jax_shuts_down(monkeypatch):
    """At interpreter shutdown a daemon thread returning from a C++ call is ended with
    pthread_exit, and unwinding through the binding's frames aborted the process (process 0 of
    a SIGTERM-interrupted two-process run printed its line, then died with status -6 instead of
    143). The exit hook now stops the watcher and waits for it: no key-value call after it."""
    import atexit
    import threading

    from jaxport.train import _distributed

    calls, after_exit = [], threading.Event()

    def record(name):
        def call(*args, **kwargs):
            if after_exit.is_set():
                calls.append(name)
            time.sleep(0.01)  # a slow read: the thread is inside the client when exit comes
            return []
        return call

    client = types.SimpleNamespace(key_value_set=record("set"), key_value_dir_get=record("dir_get"))
    hooks = []
    monkeypatch.setattr(_distributed, "_client", lambda: client)
    monkeypatch.setattr(_distributed, "_watch", {"started": False, "published": False, "finished": False})
    monkeypatch.setattr(_distributed, "_layout", lambda: (0, 2))  # process 0 of 2
    monkeypatch.setattr(atexit, "register", hooks.append)
    before = set(threading.enumerate())
    _distributed.watch_for_failures()
    (watcher,) = set(threading.enumerate()) - before
    assert watcher.daemon and watcher.is_alive()
    time.sleep(0.3)
    (hook,) = hooks
    hook()  # what the interpreter runs at exit, before jax's own shutdown hook
    after_exit.set()
    assert not watcher.is_alive()
    time.sleep(0.6)  # longer than one poll
    assert calls == []


def test_a_checkpoints_directory_that_cannot_be_written_is_refused_before_training(tmp_path, monkeypatch):
    """A workdir handed over with `chown` without -R: checkpoints/ refused the first checkpoint,
    after every step up to it had trained, and again on each `--resume` the error advised. (The
    refusal is simulated: the suite may run as root, whom permission bits do not stop.)"""
    from jaxport.train import _loop

    real = _loop.unwritable
    monkeypatch.setattr(_loop, "unwritable", lambda path: "its directory 'X' does not accept new files (Permission "
                        "denied)" if os.path.basename(os.path.dirname(path)) == "checkpoints" else real(path))
    monkeypatch.setattr(_data, "digits", lambda *a, **k: pytest.fail("the data was loaded before the check"))
    for resume in (False, True):
        with pytest.raises(ConfigError, match=r"`--workdir` \(=\S+w\) cannot hold checkpoints: its directory 'X' does "
                                              r"not accept new files \(Permission denied\); fix its permissions"):
            train(TrainConfig(workdir=str(tmp_path / "w"), image_size=16, progress=False, resume=resume))


def test_a_second_ctrl_c_stops_at_once_and_names_the_latest_checkpoint(tmp_path, monkeypatch, capfd):
    """Two Ctrl-C during an epoch's evaluation (minutes on a large val set): the second stops at
    once, and the line said only "jaxport: interrupted", not what was kept."""
    from jaxport._cli import main
    from jaxport.train import _loop

    evaluate = _loop._evaluate

    def twice_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled: a stop is requested
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)  # the previous handler again: KeyboardInterrupt here
        time.sleep(5)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(_loop, "_evaluate", twice_interrupted)
    # The CLI trains on every device jax sees (the suite's 8 simulated ones); one device stops
    # the same way at less cost, with the step other tests compile too.
    from jaxport.train import _cli as train_cli

    config = train_cli.config_from_args
    monkeypatch.setattr(train_cli, "config_from_args", lambda args: dataclasses.replace(config(args), devices=1))
    code = main(["train", "--workdir", str(tmp_path / "w"), "--image-size", "16", "--batch-size", "64",
                 "--epochs", "2", "--checkpoint-every", "10", "--no-progress"])
    err = capfd.readouterr().err
    assert code == 130, err
    assert err.splitlines()[-2:] == [
        "SIGINT received: stopping after this step (or this epoch's evaluation), once it is checkpointed; another "
        "Ctrl-C stops at once, without that checkpoint",
        f"jaxport: interrupted: SIGINT: the latest checkpoint, step 20, is in {tmp_path / 'w' / 'checkpoints'}: "
        "continue with --resume"], err


def test_a_failed_final_write_says_the_training_is_kept(tmp_path, monkeypatch):
    """A disk too full for the final variables file: the run's error said "free some space or
    write elsewhere" (a new workdir?) though every step was checkpointed; after Ctrl-C, the
    same error replaced the interruption (status 2, not 130), hiding the checkpoint."""
    import errno
    import threading

    from jaxport.train import _loop

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "not enough space to write 'W/variables.safetensors': it needs 44.8 MB and 42.6 MB "
                                    "are free there; free some space or write elsewhere")

    monkeypatch.setattr(_loop, "_save_final", no_space)
    cfg = TrainConfig(workdir=str(tmp_path / "w"), image_size=16, batch_size=64, epochs=1, max_steps=2,
                      progress=False, devices=1)
    with pytest.raises(CheckpointError, match=r"^training finished at step 2 \(checkpointed in \S+checkpoints\), but "
                                              r"its final files could not be written: not enough space to write "
                                              r"'W/variables.safetensors': it needs 44.8 MB and 42.6 MB are free there; "
                                              r"fix that, then rerun with --resume: it writes them without training$"):
        train(cfg)

    def log(msg):
        if msg.startswith("training"):
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()

    with pytest.raises(Interrupted, match=r"^SIGINT at step \d+: checkpoint saved in \S+ \(variables.safetensors was "
                                          r"not written: not enough space to write 'W/variables.safetensors': it "
                                          r"needs 44.8 MB and 42.6 MB are free there\); continue with --resume$"):
        train(TrainConfig(**{**cfg.__dict__, "workdir": str(tmp_path / "v"), "max_steps": None, "epochs": 6,
                             "checkpoint_every": 1000}), log=log)
    monkeypatch.undo()
    assert train(TrainConfig(**{**cfg.__dict__, "resume": True}))["steps_run"] == 0  # "writes them without training"
    assert (tmp_path / "w" / "variables.safetensors").exists()


def test_a_metrics_row_that_cannot_be_appended_names_the_file_and_what_is_kept(tmp_path, monkeypatch):
    """A disk full as the epoch's row was appended: "jaxport: error: No space left on device",
    no file named; and the empty metrics.jsonl it left made a fresh run refuse the workdir."""
    import builtins
    import errno

    from jaxport.train import _loop

    def full_disk_open(path, mode="r", *args, **kwargs):
        if mode == "a":
            builtins.open(path, mode).close()  # created empty, as on a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        return builtins.open(path, mode, *args, **kwargs)

    cfg = TrainConfig(workdir=str(tmp_path / "w"), image_size=16, batch_size=256, epochs=2, progress=False, devices=1)
    with monkeypatch.context() as m:
        m.setattr(_loop, "open", full_disk_open, raising=False)
        with pytest.raises(CheckpointError, match=r"^could not append epoch 1's row to \S+metrics.jsonl \(No space "
                                                  r"left on device\); no checkpoint was written yet$"):
            train(cfg)
    assert (tmp_path / "w" / "metrics.jsonl").read_text() == ""
    # the empty file held nothing: a fresh run is not refused (one step shows it: the refusal
    # comes before any)
    assert train(TrainConfig(**{**cfg.__dict__, "max_steps": 1}))["steps_run"] > 0


def test_a_signal_the_process_ignores_stays_ignored():
    """A script's background job (`jaxport train ... &`, nohup) starts with SIGINT ignored. The
    stop handling took it over, answered one Ctrl-C meant for the foreground, then put the
    ignoring back, so its promised "another Ctrl-C stops at once" did nothing."""
    import signal

    from jaxport.train._loop import _StopRequests

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _StopRequests(1) as stops:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stops._handle  # still taken: nothing ignores it
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_the_plot_leaves_the_callers_matplotlib_as_it_was(tmp_path):
    """`train` ends with the plot, which called `matplotlib.use("Agg")`: a notebook's inline
    backend was switched off for the rest of the session. A failed write also left pyplot holding
    the figure. Checked in a fresh interpreter, whose backend is the caller's choice."""
    rows = [{"epoch": e, "train_loss": 1.0 / (e + 1), "val_loss": 2.0 / (e + 1), "train_acc": 0.5, "val_acc": 0.4}
            for e in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dir.png").mkdir()  # a write that fails: a directory in the plot's place
    script = """
import sys, matplotlib
matplotlib.use("svg")
import matplotlib.pyplot as plt
from jaxport.train._loop import plot_metrics
work = sys.argv[1]
plot_metrics(work + "/metrics.jsonl", work + "/curves.png")
try:
    plot_metrics(work + "/metrics.jsonl", work + "/dir.png")
except OSError:
    pass
print(matplotlib.get_backend(), plt.get_fignums())
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["svg", "[]"], proc.stdout
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
