"""`jaxport train` on awkward inputs: broken images, split folders, symbolic links, earlier runs.

Each test is a regression named after what broke; runs are ResNet-18 at 16 px, 1-2 steps.
"""
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from PIL import Image

from jaxport import _cli
from jaxport._errors import CheckpointError, ConfigError
from jaxport.train import TrainConfig, _data, _loop, train
from tests.helpers import write_images

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _folder(root, classes=("a", "b"), per_class=10):
    for c in classes:
        write_images(root / c, per_class)
    return root


def _cfg(workdir, data, **kw):
    return TrainConfig(**{**dict(workdir=str(workdir), data=None if data is None else str(data), image_size=16, batch_size=4, epochs=1,
                                 max_steps=1, workers=0, progress=False, devices=1), **kw})


def test_an_image_that_fails_to_decode_is_named_and_the_run_exits(tmp_path):
    """A JPEG cut in half passes PIL's header check (`verify`) and fails to decode. With
    DataLoader workers that printed the worker's traceback and then hung at exit (workers ignore
    SIGTERM, and nothing shut them down); without workers the error named no file."""
    data = tmp_path / "data"
    _folder(data / "train", per_class=4)
    _folder(data / "val", per_class=1)
    bad = data / "train" / "a" / "3.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 200, 3), np.uint8)).save(bad)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    (data / "train" / "a" / "3.png").unlink()  # 8 training images: one step of 8 loads all of them
    with Image.open(bad) as im:
        im.verify()  # the header reads: the scan keeps it
    with pytest.raises(ConfigError, match=rf"image {bad} cannot be decoded .*truncated.*remove it, or re-encode it"):
        _data.image_folder(str(data), image_size=16, workers=0).train.load([0, 1, 2, 3, 4, 5, 6, 7], 0)

    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), "--data", str(data),
           "--image-size", "16", "--batch-size", "8", "--epochs", "1", "--workers", "2", "--no-progress"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("jaxport: error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "cannot be decoded" in errors[0], out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_warnings_in_loader_workers_are_one_line_like_the_clis(tmp_path):
    """Spawned DataLoader workers start with Python's warning display: PIL's warning for a
    palette PNG with byte transparency printed a file:line header and the source line."""
    data = _folder(tmp_path / "data", per_class=10)
    for c in ("a", "b"):
        for i in range(10):
            im = Image.fromarray(np.random.default_rng(i).integers(0, 255, (20, 24), np.uint8), "L").convert("P")
            im.save(data / c / f"{i}.png", transparency=bytes([0] * 10 + [255] * 246))
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), "--data", str(data),
           "--image-size", "16", "--batch-size", "4", "--epochs", "1", "--max-steps", "1", "--workers", "1",
           "--no-progress"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "jaxport: warning: Palette images with Transparency expressed in bytes" in out.stderr, out.stderr
    assert "UserWarning" not in out.stderr and "warnings.warn" not in out.stderr, out.stderr


def test_torchvision_split_folders_are_recognised_or_refused(tmp_path):
    """`train/` beside `validation/` was read as two classes named 'train' and 'validation'."""
    for held_out in ("val", "validation", "valid"):
        root = tmp_path / held_out
        _folder(root / "train", per_class=3)
        _folder(root / held_out, per_class=2)
        data = _data.image_folder(str(root), image_size=16, workers=0)
        assert data.classes == ["a", "b"], held_out
        assert (data.train.num_examples, data.val.num_examples) == (6, 4), held_out
    only = _folder(tmp_path / "only" / "train")  # was "a single class ('train')"
    with pytest.raises(ConfigError, match=r"has a train/ split folder but no val/ \(nor validation/, valid/\).*"
                                          rf"--data {only}"):
        _data.image_folder(str(tmp_path / "only"), workers=0)
    _folder(tmp_path / "val" / "validation")
    with pytest.raises(ConfigError, match=r"several held-out folders \(val/, validation/\)"):
        _data.image_folder(str(tmp_path / "val"), workers=0)


def test_symbolic_links_never_repeat_an_image(tmp_path):
    """Loops (`ln -s . again`, `ln -s .. loop`) turned 20 images into 420 samples, each in both
    splits, class b's labelled a."""
    root = _folder(tmp_path / "data", per_class=10)
    os.symlink(".", root / "a" / "again")
    os.symlink("..", root / "a" / "loop")
    os.symlink(os.path.join("..", "b"), root / "a" / "b_too")  # another class's folder
    os.symlink(os.path.join("..", "b", "0.png"), root / "a" / "also.png")  # another class's file
    with pytest.warns(UserWarning, match="1 image path"):
        classes, samples, _ = _data._scan(str(root), "--data")
    assert classes == ["a", "b"]
    reals = [os.path.realpath(p) for p, _ in samples]
    assert len(reals) == len(set(reals)) == 20
    assert all(os.path.dirname(r) == os.path.realpath(root / classes[y]) for r, (_, y) in zip(reals, samples))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = _data.image_folder(str(root), image_size=16, workers=0)
    assert (data.train.num_examples, data.val.num_examples) == (18, 2)

    split = tmp_path / "split"  # the same file in train/ and (through a link) in val/
    _folder(split / "train", per_class=3)
    os.makedirs(split / "val")
    for c in "ab":
        write_images(split / "val" / c, 1, start=100)
        os.symlink(split / "train" / c / "0.png", split / "val" / c / "x.png")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = _data.image_folder(str(split), image_size=16, workers=0)
    assert (data.train.num_examples, data.val.num_examples) == (6, 2)


def test_a_workdir_with_an_earlier_runs_files_is_left_alone(tmp_path):
    """With no checkpoints, an earlier run's metrics.jsonl was truncated and an `--init` file
    inside the workdir was overwritten by the new weights."""
    data = _folder(tmp_path / "data")
    work = tmp_path / "w"
    work.mkdir()
    (work / "metrics.jsonl").write_text('{"epoch": 0}\n')
    with pytest.raises(ConfigError, match=rf"`--workdir` \(={work}\) already holds metrics.jsonl from an earlier run; "
                                          "pass --resume"):
        train(_cfg(work, data))
    assert (work / "metrics.jsonl").read_text() == '{"epoch": 0}\n'
    assert sorted(os.listdir(work)) == ["metrics.jsonl"]
    init = work / "variables.safetensors"
    init.write_bytes(b"weights")
    for resume in (False, True):
        with pytest.raises(ConfigError, match=rf"`--init` \(={init}\) is among the files `--workdir` \(={work}\) "):
            train(_cfg(work, data, init=str(init), resume=resume))
    assert init.read_bytes() == b"weights"
    (work / "checkpoints").mkdir()  # as a run that failed before its first checkpoint leaves it
    # and a run killed while it wrote its first checkpoint: a fresh run was refused, as if an
    # earlier run's checkpoints were there ("already holds checkpoints/"), though none can be restored
    (work / "checkpoints" / "2.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    (work / "metrics.jsonl").unlink()
    init.unlink()
    train(_cfg(work, data))  # nothing to lose: allowed
    assert not [n for n in os.listdir(work / "checkpoints") if "tmp" in n]  # and the leftover removed


@pytest.mark.slow
def test_resume_refuses_another_model_or_class_set_before_restoring(tmp_path, monkeypatch, capfd):
    """Another --arch or class count failed inside orbax ("tree structures do not match"),
    advising to delete the good checkpoint, with asyncio tracebacks; other class names with the
    same count resumed silently. A metrics.jsonl row without "epoch" was a KeyError. (The
    command runs in this process: capfd reads file descriptor 2 too, where orbax's threads and
    logging handlers made before the capture would write.)"""
    data = _folder(tmp_path / "data", classes=("a", "b", "c"))
    (data / "a" / "bad.jpg").write_bytes(b"not an image")
    work = tmp_path / "w"
    messages = []
    with pytest.warns(UserWarning) as record:
        train(_cfg(work, data), log=messages.append)
    # The count of skipped images is said once (it was also logged a second time).
    assert sum("unreadable image(s) skipped" in str(w.message) for w in record) == 1
    assert not any("unreadable" in m for m in messages), messages

    capfd.readouterr()
    cmd = ["train", "--workdir", str(work), "--data", str(data), "--resume", "--arch", "resnet34", "--image-size", "16",
           "--batch-size", "4", "--epochs", "1", "--max-steps", "2", "--workers", "0", "--no-progress"]
    with warnings.catch_warnings():  # the CLI shows data/a/bad.jpg's as one "warning" line, filtered below
        code = _cli.main(cmd)
    out = capfd.readouterr()
    assert code == 2
    errors = [line for line in out.err.splitlines() if "warning" not in line]
    assert errors == [f"jaxport: error: --resume: the checkpoint in {work} was trained as resnet18 on 3 classes "
                      "[a, b, c]; this run asks for resnet34 on 3 classes [a, b, c]; use the same --arch and --data, "
                      "or a new --workdir"], out.err

    # Refused before the model is built: its initialisation compiled for seconds, to no use.
    monkeypatch.setattr(_loop, "build", lambda *a, **k: pytest.fail("the model was built before the refusal"))
    other = _folder(tmp_path / "other", classes=("x", "y", "z"))
    with pytest.raises(ConfigError, match=r"trained as resnet18 on 3 classes \[a, b, c\]; this run asks for "
                                          r"resnet18 on 3 classes \[x, y, z\]"):
        train(_cfg(work, other, resume=True, max_steps=2))
    four = _folder(tmp_path / "four", classes=("a", "b", "c", "d"))
    with pytest.raises(ConfigError, match=r"this run asks for resnet18 on 4 classes \[a, b, c, d\]"):
        train(_cfg(work, four, resume=True, max_steps=2))
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=r"`--seed` \(=5\) differs from the "
                                                                 r"checkpoint's \(0\)"):
        warnings.simplefilter("ignore")  # data/a/bad.jpg, skipped as unreadable (checked above)
        train(_cfg(work, data, resume=True, max_steps=2, seed=5))
    monkeypatch.undo()
    assert sorted(os.listdir(work / "checkpoints")) == ["1"]

    metrics = work / "metrics.jsonl"
    metrics.write_text(json.dumps({"epoch": 0, "train_loss": 1, "train_acc": 0, "val_loss": 1, "val_acc": 0})
                       + "\n" + json.dumps({"step": 3}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=rf"`{metrics}` line 2 is not a metrics row .*\(no epoch, "):
            train(_cfg(work, data, resume=True, max_steps=2))


def test_a_batch_larger_than_the_training_set_names_one_that_fits(tmp_path):
    """2 training images on 4 devices were told "use at most 0"."""
    data = tmp_path / "data"
    _folder(data / "train", per_class=1)
    _folder(data / "val", per_class=1)
    with pytest.raises(ConfigError, match=r"`--batch-size` \(=4\) is larger than the training set \(2 images\); a "
                                          r"step needs at least one image per device \(4\): add training images"):
        train(_cfg(tmp_path / "w", data, devices=4))
    write_images(data / "train" / "a", 3, start=10)  # 5 images
    with pytest.raises(ConfigError, match=r"\(5 images\); use at most 4 \(a multiple of the 4 devices\)"):
        train(_cfg(tmp_path / "w", data, devices=4, batch_size=8))


def test_batch_size_auto_names_the_fixes_when_the_data_is_too_small_for_it(tmp_path):
    """4 training images on 4 devices at 16 px: auto picked 2 per device anyway, then failed with
    "`--batch-size` (=8) is larger than the training set ... use at most 4", a size the user never
    gave whose suggestion was refused in turn (1 image per device at 1x1 maps)."""
    data = tmp_path / "data"
    _folder(data / "train", per_class=2)
    _folder(data / "val", per_class=1)
    with pytest.raises(ConfigError, match=r"^`--batch-size auto`: the training set \(4 images\) gives at most 1 image "
                                          r"per device on 4 device\(s\), and at `--image-size` \(=16\) layer4's maps are "
                                          r"1x1: train-mode BatchNorm needs 2 per device .*; use --sync-bn, or at least 8 "
                                          r"training images, or --image-size 33 or more$"):
        train(_cfg(tmp_path / "w", data, devices=4, batch_size="auto"))
    with pytest.raises(ConfigError, match=r"^`--batch-size auto`: the training set \(4 images\) has fewer images than "
                                          r"the 8 devices, and a step needs at least one image per device; add training"):
        train(_cfg(tmp_path / "w", data, devices=8, batch_size="auto", image_size=40))
    assert not (tmp_path / "w").exists()


_TERM_DURING_SETUP = """
import os, signal, sys, time
from jaxport.train import _data
digits = _data.digits
def digits_then_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or a scheduler would, while --data loads
    time.sleep(0.5)  # Python runs the handler between bytecodes: it must stop the run here
    return digits(*args, **kwargs)
_data.digits = digits_then_sigterm
from jaxport._cli import main
sys.exit(main(["train", "--workdir", sys.argv[1], "--no-progress"]))
"""


def test_sigterm_before_the_first_step_is_one_line_and_status_143(tmp_path):
    """Before the training loop installs its checkpointing handler (data, model, compile: the
    minutes of a large run's set-up), SIGTERM had its default action: the process vanished with
    status -15 and no word. It now stops as Ctrl-C does, with one line and 128 + 15."""
    workdir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _TERM_DURING_SETUP, str(workdir)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.splitlines()[-1] == "jaxport: interrupted: SIGTERM: no checkpoint was written", proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (workdir / "checkpoints").exists()


def test_a_workdir_inside_the_data_is_refused_before_anything_is_written(tmp_path):
    """A workdir inside --data: its plot (a real PNG) and checkpoints became a class 'run' of the
    next run, and --resume was refused for a class set that changed under it."""
    data = _folder(tmp_path / "data")
    for work in (data / "run", data / "a" / "run", data):
        with pytest.raises(ConfigError, match=rf"`--workdir` \(={work}\) is inside `--data` \(={data}\).*outside"):
            train(_cfg(work, data))
    assert sorted(os.listdir(data)) == ["a", "b"] and not (data / "a" / "run").exists()


def test_flags_that_change_nothing_say_so(tmp_path):
    """--workers without --data and --trusted without --init were accepted without a word."""
    said = []
    # devices=64 stops the run right after the notes, before any data or model is built.
    with pytest.raises(ConfigError, match="`devices` \\(=64\\) is more than"):
        train(_cfg(tmp_path / "w", None, workers=2, trusted=True, devices=64, sync_bn=True, bn_stats="first"),
              log=said.append)
    assert said == ["--workers 2 is not used (the embedded digits are held in memory; it sets --data's loader "
                    "processes)", "--trusted is not used (it allows a full unpickle of --init, and there is none)",
                    "--bn-stats first is not used (with --sync-bn every device's running statistics are the same "
                    "already)"]


def _snapshot(root):
    """Every file under `root`, by relative path, with its bytes."""
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_that_wrote_into_the_workdir_while_this_one_started_is_left_alone(tmp_path, monkeypatch, resume):
    """The check for an earlier run's files came only at start-up, the workdir's lock long after
    (data, model): a second `jaxport train` into the same workdir, whose data loading outlasted
    the first run, truncated that run's metrics.jsonl and rotated its checkpoints away (leaving
    steps of two seeds side by side). The run here is that second one; the first writes its files
    while the second builds its model."""
    from jaxport.train import _checkpoint

    work = tmp_path / "w"
    make_mesh = _loop.make_mesh

    def mesh_while_another_run_ends(*args, **kwargs):
        # Called after loading the data and after --resume's first look at the checkpoints.
        out = make_mesh(*args, **kwargs)
        # The other run, meanwhile: its checkpoint step 2 and its first epoch's row.
        mngr = _checkpoint.manager(str(work), 3)
        _checkpoint.save(mngr, 2, {"step": np.int32(2), "params": {"w": np.ones(4, np.float32)}},
                         {"arch": "resnet18", "epoch_sums": [0.0, 0.0, 0.0]})
        mngr.close()
        (work / "metrics.jsonl").write_text(json.dumps({"epoch": 0, "train_loss": 2.0, "train_acc": 0.5,
                                                        "val_loss": 2.5, "val_acc": 0.4}) + "\n")
        planted.update(_snapshot(work))
        return out

    planted = {}

    monkeypatch.setattr(_loop, "make_mesh", mesh_while_another_run_ends)
    want = (rf"--resume: `--workdir` \(={work}\) held no checkpoint when this run started, and checkpoint step 2 "
            "once it had the workdir to itself: another run wrote into it meanwhile; run the command again"
            if resume else
            rf"`--workdir` \(={work}\) already holds checkpoints/ \(latest step 2\), metrics.jsonl from an earlier "
            r"run; pass --resume to continue it, or choose a new directory \(nothing was changed\)")
    with pytest.raises(ConfigError, match=want):
        train(_cfg(work, None, resume=resume))
    assert "metrics.jsonl" in planted and any(f.startswith("checkpoints") for f in planted), planted
    assert _snapshot(work) == planted  # every file of the other run as it wrote it, and nothing more
    assert sorted(os.listdir(work / "checkpoints")) == ["2"]


def test_resume_refuses_a_checkpoint_that_changed_between_start_up_and_the_lock(tmp_path):
    """A resumed run builds its state (zero placeholders, checks) for the checkpoint it finds at
    start-up: one saved, or saved anew, before it holds the workdir's lock is not the one checked."""
    from jaxport.train import _checkpoint

    work = tmp_path / "w"
    mngr = _checkpoint.manager(str(work), 3)
    for step in (2, 4):
        _checkpoint.save(mngr, step, {"w": np.full(4, step, np.float32)}, {"arch": "resnet18", "seed": 0})
    mngr.close()
    cfg = _cfg(work, None, resume=True)
    meta = _checkpoint.peek_meta(str(work), 4)
    _loop._refuse_changed_since_start(cfg, 4, meta)  # unchanged
    with pytest.raises(ConfigError, match=rf"`--workdir` \(={work}\) held checkpoint step 2 when this run started, "
                                          "and checkpoint step 4 once"):
        _loop._refuse_changed_since_start(cfg, 2, _checkpoint.peek_meta(str(work), 2))
    with pytest.raises(ConfigError, match=r"held checkpoint step 4 when this run started, and a checkpoint step 4 "
                                          "written anew once it had the workdir to itself"):
        _loop._refuse_changed_since_start(cfg, 4, meta | {"seed": 1})


def test_the_lock_waits_out_another_runs_early_check(tmp_path):
    """A run starting into the same workdir holds a shared lock for an instant (its early check
    for a live run): this run's exclusive lock, asked at that instant, was refused with "in use by
    another run", though no run was training there. A lock held throughout still refuses."""
    import fcntl
    import threading

    work = tmp_path / "w"
    work.mkdir()
    other = os.open(work, os.O_RDONLY)
    release = threading.Timer(0.2, fcntl.flock, (other, fcntl.LOCK_UN))
    try:
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
        release.start()
        fd = _loop._hold_workdir(str(work))
        assert fd is not None
        os.close(fd)
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)  # held this time
        with pytest.raises(ConfigError, match=rf"`--workdir` \(={work}\) is in use by another `jaxport train` run"):
            _loop._hold_workdir(str(work))
    finally:
        release.join()
        os.close(other)
