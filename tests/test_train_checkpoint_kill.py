"""Checkpoint directories a killed run (or a damaged disk) leaves behind, and what `--resume` says.

A run SIGKILLed while orbax's keep-last rotation deletes the oldest step leaves that directory
half-deleted (orbax removes it with a recursive delete); killed while writing a step, it leaves a
`<step>.orbax-checkpoint-tmp` directory. Neither stops an exact resume from the newest step (the
next run removes the temporary one; the rotation deletes the half-deleted one): checked by killing
`jaxport train` at random moments. What broke was the advice when the newest
step itself cannot be read: it named the next older step without asking whether that one reads,
though it may be the half-deleted one, and for the only checkpoint it said to train again without
--resume, which a workdir holding metrics.jsonl refuses. The states are built by hand on a small
state tree, so the file takes seconds.
"""
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxport import _io
from jaxport._errors import CheckpointError, ConfigError
from jaxport.train import TrainConfig, _checkpoint, _loop, load_workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(step):
    """A small tree shaped like a TrainState's leaves, each value telling the step it was saved at."""
    return {"step": jnp.int32(step), "params": {"w": jnp.full((8, 8), float(step)), "b": jnp.arange(4.0) + step},
            "batch_stats": {"mean": jnp.full((4,), -float(step))}}


def _workdir(tmp_path, steps, keep=3):
    work = tmp_path / "w"
    mngr = _checkpoint.manager(str(work), keep)
    for s in steps:
        _checkpoint.save(mngr, s, _state(s), {"arch": "resnet18", "epoch_sums": [0.0, 0.0, 0.0]})
    mngr.close()
    return work


def _half_delete(step_dir):
    """What a kill leaves mid-way through orbax's recursive delete: the directory and part of its
    files (here every file of the `state` item: `meta` still reads, the weights do not)."""
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            os.remove(os.path.join(root, f))


def _restore(work, keep=3):
    mngr = _checkpoint.manager(str(work), keep)
    try:
        _checkpoint.latest_meta(mngr)
        return _checkpoint.restore(mngr, _state(0))
    finally:
        mngr.close()


def test_a_broken_newest_step_names_the_newest_that_reads_not_a_half_deleted_one(tmp_path):
    """Newest step 4 unreadable, step 3 half-deleted by a killed rotation, step 2 intact: the
    advice was "delete .../4 to resume from step 3", and following it failed on step 3 next."""
    work = _workdir(tmp_path, [2, 3, 4])
    ckpt = work / "checkpoints"
    shutil.rmtree(ckpt / "4" / "state")
    _half_delete(ckpt / "3")
    (ckpt / "5.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # and a kill mid-write of step 5
    with pytest.raises(CheckpointError) as e:
        _restore(work)
    assert re.fullmatch(rf"checkpoint step 4 in {ckpt} cannot be read \(.+\); delete {ckpt / '4'} and "
                        rf"{ckpt / '3'} \(unreadable too\) to resume from step 2", str(e.value)), e.value
    # No step is removed for the user; the partial write of step 5, which no reader takes, is.
    assert sorted(os.listdir(ckpt)) == ["2", "3", "4"]

    # Following the advice resumes exactly from step 2, and the next saves go past the leftovers.
    shutil.rmtree(ckpt / "4")
    shutil.rmtree(ckpt / "3")
    state, _ = _restore(work)
    jax.tree.map(np.testing.assert_array_equal, state, _state(2))
    mngr = _checkpoint.manager(str(work), 2)
    for s in (3, 4, 5):
        _checkpoint.save(mngr, s, _state(s), {"epoch_sums": [0.0, 0.0, 0.0]})
    mngr.close()
    assert sorted(os.listdir(ckpt)) == ["4", "5"]
    jax.tree.map(np.testing.assert_array_equal, _restore(work)[0], _state(5))


def test_unreadable_metadata_with_no_older_step_that_reads_says_to_start_over(tmp_path):
    """The newest step's `meta` gone and the only older step half-deleted: the advice named the
    half-deleted step as the one to resume from."""
    work = _workdir(tmp_path, [3, 4])
    ckpt = work / "checkpoints"
    shutil.rmtree(ckpt / "4" / "meta")
    _half_delete(ckpt / "3")
    with pytest.raises(CheckpointError) as e:
        _restore(work)
    assert re.fullmatch(rf"checkpoint step 4 in {ckpt} cannot be read \(.+\); no older checkpoint \(step 3\) can "
                        rf"be read either: delete {ckpt} and rerun with --resume to train from step 0",
                        str(e.value)), e.value


def test_the_only_checkpoint_unreadable_gives_advice_the_workdir_accepts(tmp_path):
    """"delete .../4 and train again without --resume" was refused at once: the workdir still holds
    metrics.jsonl, which only --resume continues (and --resume with no checkpoint starts at 0)."""
    work = _workdir(tmp_path, [4])
    (work / "metrics.jsonl").write_text('{"epoch": 0}\n')  # (an empty one holds nothing, and blocks nothing)
    shutil.rmtree(work / "checkpoints" / "4" / "state")
    with pytest.raises(CheckpointError, match=r"it is the only checkpoint: delete \S+4 and rerun with --resume to "
                                              r"train from step 0$"):
        _restore(work)
    shutil.rmtree(work / "checkpoints" / "4")
    cfg = TrainConfig(workdir=str(work), progress=False)
    with pytest.raises(ConfigError, match="already holds metrics.jsonl"):
        _loop._check_workdir(cfg)
    _loop._check_workdir(TrainConfig(**{**cfg.__dict__, "resume": True}))
    assert _restore(work) is None


def test_export_names_the_newest_step_that_reads(tmp_path):
    """`jaxport export WORKDIR` (`load_workdir`) said "move .../4 aside to read step 3" of a
    half-deleted step 3; the error stays one line, without a traceback."""
    work = _workdir(tmp_path, [2, 3, 4])
    ckpt = work / "checkpoints"
    for f in os.listdir(ckpt / "4" / "state"):
        if os.path.isfile(ckpt / "4" / "state" / f):
            with open(ckpt / "4" / "state" / f, "r+b") as fh:
                fh.truncate(os.path.getsize(ckpt / "4" / "state" / f) // 3)
    _half_delete(ckpt / "3")
    fix = rf"move {ckpt / '4'} and {ckpt / '3'} \(unreadable too\) aside to read step 2"
    with pytest.raises(CheckpointError, match=rf"checkpoint step 4 in {ckpt} cannot be read \(.+\); {fix}$"):
        load_workdir(str(work))

    out = subprocess.run([sys.executable, "-m", "jaxport", "export", str(work), "--out", str(tmp_path / "x.pt")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert re.fullmatch(rf"jaxport: error: checkpoint step 4 in {ckpt} cannot be read \(.+\); {fix}\n",
                        out.stderr), out.stderr

    shutil.rmtree(ckpt / "4")
    shutil.rmtree(ckpt / "3")
    variables, arch = load_workdir(str(work))
    assert arch == "resnet18"
    jax.tree.map(np.testing.assert_array_equal, variables,
                 {k: v for k, v in _state(2).items() if k in ("params", "batch_stats")})


def test_export_reads_the_newer_step_when_the_run_rotates_the_listed_one_away(tmp_path, monkeypatch):
    """An export while `jaxport train --keep-checkpoints 1` runs listed step 1, the run saved step
    2 and deleted step 1 before the read: "step 1 cannot be read; it is the only checkpoint" (6 of
    12 exports in a probe), though nothing was damaged. It reads the newer step now."""
    work = _workdir(tmp_path, [1], keep=1)
    read = _checkpoint._read_as_saved
    calls = []

    def racing(mngr, step):
        if not calls:  # the training run, between the export's listing and its read
            trainer = _checkpoint.manager(str(work), 1)
            _checkpoint.save(trainer, 2, _state(2), {"arch": "resnet18", "epoch_sums": [0.0, 0.0, 0.0]})
            trainer.close()
            assert not (work / "checkpoints" / "1").exists()
        calls.append(step)
        return read(mngr, step)

    monkeypatch.setattr(_checkpoint, "_read_as_saved", racing)
    variables, arch = load_workdir(str(work))
    assert calls == [1, 2] and arch == "resnet18"
    np.testing.assert_array_equal(variables["params"]["w"], _state(2)["params"]["w"])
    assert sorted(os.listdir(work / "checkpoints")) == ["2"]  # the reader wrote and deleted nothing


def test_export_waits_for_the_newer_step_when_the_read_fails_before_the_rotation_shows(tmp_path, monkeypatch):
    """An export while `jaxport train --keep-checkpoints 1` saved a step a second failed reading
    step 42 ("Truncated Zstd-compressed stream": its files were being deleted) before step 43 was
    listed: "step 42 cannot be read; it is the only checkpoint" (1 run in 3 of a probe), and
    checkpoints/ held 43 right after. The listing is watched for a moment after a failed read."""
    import threading

    work = _workdir(tmp_path, [1], keep=1)
    read, calls = _checkpoint._read_as_saved, []

    def save_step_2():  # the run, a moment after the read failed: step 2 saved, step 1 rotated away
        trainer = _checkpoint.manager(str(work), 1)
        _checkpoint.save(trainer, 2, _state(2), {"arch": "resnet18", "epoch_sums": [0.0, 0.0, 0.0]})
        trainer.close()

    run = threading.Timer(0.3, save_step_2)

    def racing(mngr, step):
        calls.append(step)
        if len(calls) == 1:
            run.start()
            raise ValueError("FAILED_PRECONDITION: Error reading \"params.w/0\": Truncated Zstd-compressed stream")
        return read(mngr, step)

    monkeypatch.setattr(_checkpoint, "_read_as_saved", racing)
    try:
        variables, arch = load_workdir(str(work))
    finally:
        run.join()
    assert calls == [1, 2] and arch == "resnet18"
    np.testing.assert_array_equal(variables["params"]["w"], _state(2)["params"]["w"])


def _rotation_after_next_listing(monkeypatch):
    """Orbax's listing of the step directories, where a live run's rotation deletes the oldest
    step listed right after the next listing once `armed` holds True, before orbax reads that
    step's metadata (what /tmp/audit_fs/race_export.py did to `jaxport export`). Returns
    `(armed, listings)`: the steps each listing found."""
    from orbax.checkpoint._src.path import step as step_lib

    find_all, armed, listings = step_lib._StandardNameFormat.find_all, [False], []

    def listing(self, base_path):
        found = list(find_all(self, base_path))
        listings.append(sorted(m.step for m in found))
        if armed[0] and found:
            armed[0] = False
            shutil.rmtree(min(found, key=lambda m: m.step).path)
        return found

    monkeypatch.setattr(step_lib._StandardNameFormat, "find_all", listing)
    return armed, listings


@pytest.mark.parametrize("race", ["opening", "reloading"])
def test_export_reads_on_when_the_run_rotates_a_step_away_while_orbax_lists_them(tmp_path, monkeypatch, caplog, race):
    """Orbax's manager reads each listed step's metadata and commit time when it is made (and
    reloaded, after the step read was gone): a step the run deleted in between ended 1 export in
    11 against `jaxport train --checkpoint-every 1 --keep-checkpoints 1` in "No such file or
    directory: '.../checkpoints/2'", after absl's "WARNING: Metadata file does not exist". The
    next listing no longer holds that step."""
    work = _workdir(tmp_path, [1, 2, 3] if race == "opening" else [1], keep=3 if race == "opening" else 1)
    armed, listings = _rotation_after_next_listing(monkeypatch)
    read, calls = _checkpoint._read_as_saved, []

    def racing(mngr, step):
        calls.append(step)
        if race == "reloading" and len(calls) == 1:
            # The run saves steps 2 and 3 (deleting 1, the step listed) before this read; its
            # next rotation deletes step 2 right after the reader lists the steps again.
            trainer = _checkpoint.manager(str(work), 2)
            for s in (2, 3):
                _checkpoint.save(trainer, s, _state(s), {"arch": "resnet18", "epoch_sums": [0.0, 0.0, 0.0]})
            trainer.close()
            armed[0] = True
        return read(mngr, step)

    monkeypatch.setattr(_checkpoint, "_read_as_saved", racing)
    armed[0] = race == "opening"
    with caplog.at_level(logging.WARNING):
        variables, arch = load_workdir(str(work))
    np.testing.assert_array_equal(variables["params"]["w"], _state(3)["params"]["w"])
    assert calls == ([3] if race == "opening" else [1, 3]), calls
    assert listings[-2:] == ([[1, 2, 3], [2, 3]] if race == "opening" else [[2, 3], [3]]), listings
    assert [r.getMessage() for r in caplog.records] == []
    assert sorted(os.listdir(work / "checkpoints")) == (["2", "3"] if race == "opening" else ["3"])


def test_a_killed_save_leaves_nothing_once_the_run_is_resumed_and_a_reader_removes_nothing(tmp_path, caplog):
    """A SIGKILL while orbax wrote step 5 left `5.orbax-checkpoint-tmp/` (full size). Orbax reused
    it only if the resumed run saved step 5 again, logging "WARNING:absl:Attempted to create
    temporary directory ... which already exists" on the user's terminal; resumed with another
    --checkpoint-every (step 8 here), it stayed for good. The same for `atomic_path`'s hidden
    temporaries of the run's other files."""
    work = _workdir(tmp_path, [3])
    ckpt = work / "checkpoints"
    for step in (5, 8):
        shutil.copytree(ckpt / "3", ckpt / f"{step}.orbax-checkpoint-tmp")
    leftovers = [work / ".metrics.jsonl.k2j4h1xz.tmp", work / ".variables.safetensors.0a9b8c7d.tmp",
                 work / ".training_curves.png.zz_1y2x3.tmp"]
    for f in leftovers:
        f.write_bytes(b"\0" * 1000)
    (work / ".notes.txt.abcdefgh.tmp").write_text("not ours")

    variables, _ = load_workdir(str(work))  # a reader (export while a run trains) removes nothing
    np.testing.assert_array_equal(variables["params"]["w"], _state(3)["params"]["w"])
    assert sorted(os.listdir(ckpt)) == ["3", "5.orbax-checkpoint-tmp", "8.orbax-checkpoint-tmp"]

    with caplog.at_level(logging.WARNING):
        mngr = _checkpoint.manager(str(work), 3)
        _checkpoint.save(mngr, 5, _state(5), {"arch": "resnet18", "epoch_sums": [0.0, 0.0, 0.0]})
        mngr.close()
    assert sorted(os.listdir(ckpt)) == ["3", "5"]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    jax.tree.map(np.testing.assert_array_equal, _restore(work)[0], _state(5))

    # `jaxport train` sweeps the hidden files on start (its resume tests check it does), and finds
    # what the writer itself leaves: a write never finished (its block not left, as under SIGKILL).
    writing = _io.atomic_path(work / "training_curves.png")
    leftovers.append(writing.__enter__())
    assert sorted(_io.remove_temporaries(work, _loop.OUTPUTS)) == sorted(leftovers)
    assert sorted(f.name for f in work.iterdir()) == [".notes.txt.abcdefgh.tmp", "checkpoints"]


_READ_DAMAGED = """
import os, sys
from jaxport.train import load_workdir
for _ in range(3):
    try:
        load_workdir(sys.argv[1])
    except Exception as e:
        print(type(e).__name__, str(e)[:100])
import gc, time
time.sleep(1)  # the reads left pending end, and are collected, after the error
gc.collect()
"""


def test_load_workdir_keeps_the_leftovers_of_a_failed_read_off_stderr(tmp_path, monkeypatch):
    """The CLI dropped what orbax's pending reads print once one has failed, but the library's
    `load_workdir` did not: 2.6k-20k lines ("Task exception was never retrieved" with
    tensorstore's whole spec, "Exception ignored ... Event loop is closed") on a script's stderr
    while it read a workdir a run was rotating. A user's own unraisable hook still gets the rest."""
    import types

    work = tmp_path / "w"
    mngr = _checkpoint.manager(str(work), 1)
    rng = np.random.default_rng(0)  # incompressible: 60 arrays in one data file, read concurrently
    state = {"step": jnp.int32(1), "params": {f"w{i}": jnp.asarray(rng.random((64, 64), np.float32))
                                              for i in range(60)}, "batch_stats": {"mean": jnp.zeros(4)}}
    _checkpoint.save(mngr, 1, state, {"arch": "resnet18"})
    mngr.close()
    data = max((os.path.join(d, f) for d, _, fs in os.walk(work / "checkpoints" / "1" / "state") for f in fs),
               key=os.path.getsize)
    with open(data, "r+b") as fh:
        fh.truncate(1000)
    out = subprocess.run([sys.executable, "-c", _READ_DAMAGED, str(work)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "1"}, timeout=300)
    assert out.returncode == 0 and out.stdout.count("CheckpointError checkpoint step 1 in ") == 3, out.stdout
    assert out.stderr == "", out.stderr[-3000:]

    from jaxport import _abandoned_reads

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    _abandoned_reads.quiet_abandoned_reads()
    for error in (RuntimeError("Event loop is closed"), RuntimeError("mine")):
        sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=error, object=None))
    assert [str(u.exc_value) for u in seen] == ["mine"]


def test_a_writers_manager_has_removed_a_killed_saves_leftovers_when_returned(tmp_path, monkeypatch):
    """Orbax removes a killed save's `<step>.orbax-checkpoint-tmp` in a thread that only its
    `save` waits for: a manager closed without saving left it running, and once its workdir was
    gone (a passing test's tmp_path, removed) it logged an absl ERROR, which failed the
    no-warnings check of the next test on the same xdist worker (seen once in a full run). The
    removal is slowed here so that a thread left running is seen."""
    import asyncio
    import threading

    from orbax.checkpoint._src.path import temporary_paths

    real = temporary_paths.cleanup_temporary_paths

    async def slow(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await real(*args, **kwargs)

    work = _workdir(tmp_path, [1])
    leftover = work / "checkpoints" / "2.orbax-checkpoint-tmp"
    (leftover / "state").mkdir(parents=True)
    monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow)
    mngr = _checkpoint.manager(str(work), 3)
    try:
        assert not leftover.exists()
        assert not [t.name for t in threading.enumerate() if "_target_setting_result" in t.name]
    finally:
        mngr.close()
    assert _restore(work) is not None  # step 1, untouched
