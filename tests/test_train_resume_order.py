"""What a run killed at an epoch's end leaves behind, and what `--resume` makes of it.

An epoch ends with three writes: its metrics row, its checkpoint, and (at the run's end) the
final variables and plot. A kill between any two, then `--resume`, must end with what an
uninterrupted run writes: one row per finished epoch, equal to its rows (timings aside), and
the same weights. Kills are simulated in-process and deterministically: `_checkpoint.save` is
wrapped to raise a BaseException (as SIGKILL, nothing in jaxport handles it) just before or
just after the epoch-end checkpoint. Runs are ResNet-18 at 16 px on 16 training images, batch
4: 4 steps per epoch, 3 epochs, a checkpoint every 3 steps.
"""
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest

from jaxport._errors import CheckpointError, ConfigError, DivergedError
from jaxport.train import TrainConfig, load_workdir, train
from jaxport.train import _checkpoint, _data, _loop
from tests.helpers import write_images

TIMINGS = ("seconds", "images_per_s")  # the only fields of a row that may differ between runs
EPOCH_2_END = 8  # the step of the second epoch's row and checkpoint


class _Killed(BaseException):
    """Stands for SIGKILL: no `except Exception` in the loop sees it."""


def _cfg(workdir, data, **kw):
    return TrainConfig(**{**dict(workdir=str(workdir), data=str(data), image_size=16, batch_size=4, epochs=3,
                                 checkpoint_every=3, workers=0, progress=False, devices=1), **kw})


def _rows(workdir):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]


def _steps(workdir):
    return sorted(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    for c in ("a", "b"):
        write_images(root / c, 10)  # 16 train / 4 val
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """An uninterrupted run: its workdir, metrics rows (timings left out) and final weights."""
    work = tmp_path_factory.mktemp("reference")
    train(_cfg(work, data))
    rows = _rows(work)
    assert [r["epoch"] for r in rows] == [0, 1, 2] and rows[-1]["step"] == 12
    return work, rows, load_workdir(str(work))[0]


# The tests that read `reference` run on one xdist worker (`make test`'s --dist loadgroup),
# which computes it once: ungrouped, each worker trained it again.
_REFERENCE_GROUP = pytest.mark.xdist_group("resume_order_reference")


def _kill_at_epoch_2_checkpoint(monkeypatch, when):
    """Raise `_Killed` just `when` ("before"/"after") the second epoch's checkpoint is written."""
    save = _checkpoint.save

    def killing_save(mngr, step, *args, **kwargs):
        if step == EPOCH_2_END and when == "before":
            raise _Killed
        save(mngr, step, *args, **kwargs)
        if step == EPOCH_2_END and when == "after":
            raise _Killed

    monkeypatch.setattr(_checkpoint, "save", killing_save)


def _resume_and_compare(work, data, reference, monkeypatch):
    monkeypatch.undo()
    said = []
    train(_cfg(work, data, resume=True), log=said.append)
    _, rows, weights = reference
    assert _rows(work) == rows, said
    jax.tree.map(np.testing.assert_array_equal, load_workdir(str(work))[0], weights)
    return said


@_REFERENCE_GROUP
def test_a_kill_just_after_an_epoch_checkpoint_loses_no_metrics_row(tmp_path, data, reference, monkeypatch):
    """The checkpoint was written before the row: a run killed between the two resumed after
    that epoch and never wrote its row (metrics.jsonl and the plot missed epoch 2)."""
    _kill_at_epoch_2_checkpoint(monkeypatch, "after")
    with pytest.raises(_Killed):
        train(_cfg(tmp_path, data))
    assert _steps(tmp_path)[-1] == EPOCH_2_END
    assert [r["epoch"] for r in _rows(tmp_path)] == [0, 1]  # the row came first
    said = _resume_and_compare(tmp_path, data, reference, monkeypatch)
    assert any(m.startswith(f"resuming from step {EPOCH_2_END}") for m in said), said
    assert not any("holds no row" in m for m in said), said


@pytest.fixture(scope="module")
def killed_before_epoch_2_checkpoint(tmp_path_factory, data):
    """A run killed after epoch 2's row, before its checkpoint: both cases of the test below
    resume a copy of it (one run killed, not one per case)."""
    work = tmp_path_factory.mktemp("killed-before")
    with pytest.MonkeyPatch.context() as m:
        _kill_at_epoch_2_checkpoint(m, "before")
        with pytest.raises(_Killed):
            train(_cfg(work, data))
    return work


@_REFERENCE_GROUP
@pytest.mark.parametrize("torn", [False, True], ids=["whole-row", "torn-row"])
def test_a_row_written_before_its_checkpoint_is_written_once(tmp_path, data, reference, monkeypatch, torn,
                                                             killed_before_epoch_2_checkpoint):
    """Killed after the epoch's row but before its checkpoint, the resumed run goes back to step 6
    and trains epoch 2 again: the row already there is dropped, not repeated. `torn`: killed
    while appending the row (half a line, no newline), which made --resume fail with "line 2 is
    not a metrics row"."""
    work = tmp_path / "w"
    shutil.copytree(killed_before_epoch_2_checkpoint, work)
    assert _steps(work)[-1] == 6
    metrics = work / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert [json.loads(x)["epoch"] for x in lines] == [0, 1]
    if torn:
        metrics.write_text(lines[0] + lines[1][:len(lines[1]) // 2])
    _resume_and_compare(work, data, reference, monkeypatch)


def test_a_line_that_is_not_a_row_is_still_refused(tmp_path):
    """Only a torn last line (no newline) is dropped on resume; a broken line before it, or a
    finished last line, is named as before."""
    metrics = tmp_path / "metrics.jsonl"
    row = json.dumps({"epoch": 0, "train_loss": 1, "train_acc": 0, "val_loss": 1, "val_acc": 0})
    metrics.write_text(row + "\n" + '{"epoch": 1, "tra')
    assert _loop._read_metrics(str(metrics), torn_ok=True) == [json.loads(row)]
    for text, line in ((row + "\n" + '{"epoch": 1, "tra\n', 2), ('{"epo\n' + row, 1)):
        metrics.write_text(text)
        with pytest.raises(CheckpointError, match=rf"line {line} is not a metrics row"):
            _loop._read_metrics(str(metrics), torn_ok=True)
    metrics.write_text(row + "\n" + '{"epoch": 1, "tra')
    with pytest.raises(CheckpointError, match="line 2 is not a metrics row"):
        _loop._read_metrics(str(metrics))  # the plot reads a finished run's file: nothing is dropped there


def test_weights_that_turn_non_finite_at_an_epoch_end_get_no_row(tmp_path, data, monkeypatch):
    """Now that the row is written before the checkpoint, the finiteness check must come before
    both: a diverged epoch gets neither a row nor a checkpoint."""
    calls = []

    def second_check_fails(tree):
        calls.append(1)
        return np.bool_(len(calls) < 2)

    monkeypatch.setattr(_loop, "_all_finite", second_check_fails)
    with pytest.raises(DivergedError, match=f"weights became non-finite at step {EPOCH_2_END}"):
        train(_cfg(tmp_path, data, checkpoint_every=1000))
    assert [r["epoch"] for r in _rows(tmp_path)] == [0]
    assert _steps(tmp_path) == [4]


def _copy(reference, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(reference[0], work)
    return work


@_REFERENCE_GROUP
def test_resume_does_not_read_init_when_a_checkpoint_exists(tmp_path, data, reference, monkeypatch):
    """--init with --resume was loaded (slow, and an error if the file had moved) and then
    overwritten by the checkpoint; now it is not read, and the resume line says so."""
    work = _copy(reference, tmp_path)
    init = tmp_path / "init.safetensors"
    shutil.copy(work / "variables.safetensors", init)
    read = []
    monkeypatch.setattr(_loop, "load_init", lambda *a, **k: read.append(a) or pytest.fail("--init was read"))
    said = []
    result = train(_cfg(work, data, resume=True, init=str(init)), log=said.append)
    assert read == [] and result["steps_run"] == 0
    ckpt = _checkpoint.checkpoint_dir(str(work))
    assert f"resuming from step 12; --init {init} is not used (the checkpoint in {ckpt} holds every weight)" in said
    # A file that is gone no longer matters either.
    said.clear()
    train(_cfg(work, data, resume=True, init=str(tmp_path / "moved.safetensors")), log=said.append)
    assert any("moved.safetensors is not used" in m for m in said), said


@_REFERENCE_GROUP
def test_resume_without_a_checkpoint_starts_from_init(tmp_path, data, reference, monkeypatch):
    init = tmp_path / "init.safetensors"
    shutil.copy(reference[0] / "variables.safetensors", init)
    read = []
    load_init = _loop.load_init
    monkeypatch.setattr(_loop, "load_init", lambda *a, **k: read.append(a[0]) or load_init(*a, **k))
    said = []
    result = train(_cfg(tmp_path / "w", data, resume=True, init=str(init), max_steps=1), log=said.append)
    assert read == [str(init)] and result["steps_run"] == 1
    assert f"--resume: no checkpoint in {tmp_path / 'w'}; starting from step 0" in said
    assert not any("is not used" in m for m in said), said


@_REFERENCE_GROUP
def test_resume_completes_a_workdir_killed_before_its_final_files(tmp_path, data, reference):
    """Killed after the last checkpoint but before variables.safetensors and the plot: --resume
    has nothing to train and writes both, from the checkpoint and every row. A row lost for good
    (a workdir written by an earlier jaxport, which checkpointed an epoch before its row) cannot
    be recomputed: resuming names its epoch."""
    work = _copy(reference, tmp_path)
    (work / "variables.safetensors").unlink()
    (work / "training_curves.png").unlink()
    lines = (work / "metrics.jsonl").read_text().splitlines(keepends=True)
    (work / "metrics.jsonl").write_text(lines[0] + lines[2])
    said = []
    result = train(_cfg(work, data, resume=True), log=said.append)
    assert result["steps_run"] == 0 and (work / "training_curves.png").stat().st_size > 1000
    from jaxport import load_variables

    jax.tree.map(np.testing.assert_array_equal, load_variables(work / "variables.safetensors"), reference[2])
    assert _rows(work) == [reference[1][0], reference[1][2]]
    assert f"--resume: {work / 'metrics.jsonl'} holds no row for epoch(s) 2; they cannot be recomputed, and the " \
           "plot will miss them" in said, said


def test_a_workdir_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """`--workdir /proc/x` failed only when the first checkpoint was written, after the data was
    loaded and the step compiled, with a bare 'No such file or directory'."""
    monkeypatch.setattr(_loop._data, "digits", lambda *a, **k: pytest.fail("the data was loaded"))
    with pytest.raises(ConfigError, match=r"`--workdir` \(=/proc/jaxport-x\) cannot be written: its directory "
                                          r"'/proc/jaxport-x' does not exist and cannot be made: '/proc' does not "
                                          r"accept new directories"):
        train(TrainConfig(workdir="/proc/jaxport-x", progress=False))


@_REFERENCE_GROUP
def test_resume_refuses_data_that_changed_since_the_checkpoint(tmp_path, data, reference):
    """A probe added images to --data and resumed: steps per epoch changed, so the checkpoint's
    step fell mid-way through another epoch, a finished epoch's row was deleted, an "epoch" of a
    few steps was logged as whole and the held-out split was redrawn; all without a word. The
    checkpoint records the data now (counts and a digest of its files), and a change is refused
    before anything is rewritten. The same files under another path resume as before, and so do
    files replaced in place (same names and labels)."""
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    work = _copy(reference, tmp_path)
    said = []
    assert train(_cfg(work, moved, resume=True), log=said.append)["steps_run"] == 0
    assert any(m.startswith("nothing to train") for m in said), said
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}

    write_images(moved / "a", 2, start=100)
    with pytest.raises(ConfigError, match=rf"--resume: `--data` has changed since the checkpoint in {work} was written "
                                          r"\(20 train / 2 val images, the checkpoint's run had 18 / 2\); .*restore "
                                          r"the data, or start a new --workdir"):
        train(_cfg(work, moved, resume=True, epochs=4))
    for p in (moved / "a").glob("10[01].png"):
        p.unlink()
    os.rename(moved / "b" / "3.png", moved / "b" / "3-renamed.png")  # as many images, but another file
    with pytest.raises(ConfigError, match=r"changed since .* \(the same number of images, but other files"):
        train(_cfg(work, moved, resume=True, epochs=4))
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before

    # 3.png replaced in place (same name and label, other content and size): what mending an
    # image that failed to decode mid-run does, as the error advises ("re-encode it ... and rerun
    # with --resume"). The epochs, order and split are the run's: it resumes, and says so.
    os.rename(moved / "b" / "3-renamed.png", moved / "b" / "3.png")
    write_images(moved / "b", 1, start=3, size=(30, 30))
    said = []
    train(_cfg(work, moved, resume=True), log=said.append)
    assert any(m.startswith("resuming from step 12; some of --data's images have other sizes than when the "
                            "checkpoint was written") for m in said), said


@_REFERENCE_GROUP
def test_resume_rewrites_metrics_to_one_row_per_finished_epoch(tmp_path, data, reference):
    """A deleted metrics.jsonl was not reported (a truncated one was); a row repeated by an edit
    stayed twice (and twice in the plot); an epoch that is not an integer ("0") was an internal
    error (TypeError) instead of the file's own one-line error."""
    work = _copy(reference, tmp_path)
    metrics = work / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.unlink()
    said = []
    train(_cfg(work, data, resume=True), log=said.append)
    assert f"--resume: {metrics} holds no row for epoch(s) 1, 2, 3; they cannot be recomputed, and the plot will " \
           "miss them" in said, said

    metrics.write_text(lines[0] + lines[0] + lines[1] + lines[2])
    train(_cfg(work, data, resume=True))
    assert _rows(work) == reference[1]

    for epoch in ('"0"', "null", "-1", "true", "1.5"):
        metrics.write_text(lines[0].replace('"epoch": 0', f'"epoch": {epoch}', 1))
        with pytest.raises(CheckpointError, match=rf"line 1 is not a metrics row .*integer epoch \(it is {epoch}\)"):
            train(_cfg(work, data, resume=True))


@_REFERENCE_GROUP
def test_resume_with_fewer_epochs_than_done_trains_nothing_and_names_no_new_schedule(tmp_path, data, reference):
    """Resuming a finished 3-epoch run with --epochs 2 said "(the cosine schedule now ends at the
    new --epochs)", though no step was left to run on any schedule."""
    work = _copy(reference, tmp_path)
    said = []
    assert train(_cfg(work, data, resume=True, epochs=2), log=said.append)["steps_run"] == 0
    (resumed,) = [m for m in said if m.startswith("resuming from step")]
    assert resumed == "resuming from step 12 with changed settings: --epochs 2 (was 3)", said
    assert any(m.startswith("nothing to train: the latest checkpoint is at step 12") for m in said), said


def test_images_per_s_leaves_out_the_compiling_step(tmp_path, monkeypatch, data):
    """The first epoch's rate counted the step's compile (~20 s of a ~36 s epoch for ResNet-18
    at 16 px), reading 2.6x lower than the next epoch's for the same steps. A fake clock (no
    timing measured): the first step call takes 100 s, every later one 1 s."""
    clock = [0.0]
    monkeypatch.setattr(_loop, "time", type("T", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    make = _loop.make_train_step

    def timed_make(*args, **kw):
        step = make(*args, **kw)

        def timed(*a):
            out = step(*a)
            clock[0] += 100.0 if clock[0] == 0 else 1.0
            return out
        return timed

    monkeypatch.setattr(_loop, "make_train_step", timed_make)
    train(_cfg(tmp_path / "w", data, epochs=2))
    rows = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    assert [r["seconds"] for r in rows] == [103.0, 4.0]  # the wall time, compile included
    assert [r["images_per_s"] for r in rows] == [4.0, 4.0]  # 3 steps of 4 images in 3 s; 4 in 4 s


@_REFERENCE_GROUP
def test_an_image_gone_mid_run_checkpoints_the_last_step_and_says_how_to_continue(tmp_path, data, reference,
                                                                                    monkeypatch):
    """A class folder moved away after step 5 (the loader fails fetching a later batch): the
    steps since the last checkpoint (epoch 1's end) were lost, and the advice "restore it, or remove it,
    then rerun" never continued the run (rerun: the workdir holds a run; removed: --resume
    refuses the changed --data). Now the last finished step is checkpointed, and restoring the
    images and resuming ends with the uninterrupted run's rows and weights."""
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    with monkeypatch.context() as m:
        calls = _move_after_steps(m, copy / "a", tmp_path / "a-aside", 5)
        with pytest.raises(ConfigError) as e:
            train(_cfg(tmp_path / "w", copy, checkpoint_every=100))  # only the epochs' ends (4, 8)
    saved = _steps(tmp_path / "w")[-1]
    assert saved == len(calls) > 4, (saved, len(calls))  # the last step run, not epoch 1's end
    assert re.fullmatch(rf"`--data`: image \S+ cannot be read \(FileNotFoundError: .*\), though it could when the "
                        rf"run started; the run is checkpointed at step {saved}: restore it \(or its permissions\) and "
                        r"rerun with --resume to continue from there; or remove it and train a new --workdir with "
                        r"--init \S+w to keep the weights \(a removed image changes --data, which --resume refuses\)",
                        str(e.value)), str(e.value)
    shutil.move(tmp_path / "a-aside", copy / "a")
    _resume_and_compare(tmp_path / "w", copy, reference, monkeypatch)


def _move_after_steps(monkeypatch, folder, aside, n):
    """Move `folder` to `aside` once the training step has run `n` times; returns the list that
    counts the step's runs."""
    make = _loop.make_train_step
    calls = []

    def moving(*args, **kwargs):
        step = make(*args, **kwargs)

        def counted(*a):
            out = step(*a)
            calls.append(1)
            if len(calls) == n:
                shutil.move(folder, aside)
            return out
        return counted

    monkeypatch.setattr(_loop, "make_train_step", moving)
    return calls


@_REFERENCE_GROUP
@pytest.mark.parametrize("epoch", [2, 3], ids=["mid-run", "last-epoch"])
def test_an_image_gone_during_an_evaluation_checkpoints_the_epoch_and_resume_evaluates_it(tmp_path, data, reference,
                                                                                          monkeypatch, epoch):
    """Class folder a/ moved away after epoch `epoch`'s last step: its held-out images failed
    that epoch's evaluation, which lost the steps since the last checkpoint (6 of 8, 9 of 12)
    and said "restore it ..., or remove it, then rerun" (the workdir then refused a run without
    --resume, and --resume refuses a changed --data). Now the epoch's training is checkpointed
    with no row for it, --resume evaluates it first (and fails again, saving nothing more, while
    the image is still gone), and the rows and weights end as the uninterrupted run's."""
    copy, aside, work = tmp_path / "data", tmp_path / "a-aside", tmp_path / "w"
    shutil.copytree(data, copy)
    end = 4 * epoch
    with monkeypatch.context() as m:
        _move_after_steps(m, copy / "a", aside, end)
        with pytest.raises(ConfigError) as e:
            train(_cfg(work, copy))
    assert _steps(work)[-1] == end  # the epoch's training, not the last periodic checkpoint
    assert re.fullmatch(rf"`--data`: image \S+, held out for evaluation, cannot be read \(FileNotFoundError: .*\), "
                        rf"though it could when the run started; the run is checkpointed at step {end}, the end of "
                        rf"epoch {epoch}'s training \(its evaluation did not finish\): restore it \(or its "
                        rf"permissions\) and rerun with --resume to evaluate epoch {epoch} and continue from there; or "
                        r"remove it and train a new --workdir with --init \S+w to keep the weights \(a removed image "
                        r"changes --data, which --resume refuses\)", str(e.value)), str(e.value)
    assert _rows(work) == reference[1][:epoch - 1]  # no row for the epoch, nor half of one
    assert not (work / "variables.safetensors").exists()

    shutil.move(aside, copy / "a")
    make_eval = _loop.make_eval_step
    said = []
    with monkeypatch.context() as m:  # gone again after the data is scanned: the resumed evaluation fails
        m.setattr(_loop, "make_eval_step", lambda *a, **k: (shutil.move(copy / "a", aside), make_eval(*a, **k))[1])
        with pytest.raises(ConfigError) as again:
            train(_cfg(work, copy, resume=True), log=said.append)
    assert str(again.value) == str(e.value)
    assert "--resume: epoch %d was trained, but its evaluation did not finish: evaluating it first" % epoch in said
    assert _steps(work)[-1] == end and _rows(work) == reference[1][:epoch - 1]

    shutil.move(aside, copy / "a")
    said = _resume_and_compare(work, copy, reference, monkeypatch)
    assert f"epoch {epoch} was trained, but its evaluation did not finish: evaluating it first" in " ".join(said)
    assert not any("holds no row" in m for m in said), said
    if epoch == 3:  # the run's last checkpoint is the unevaluated one: resumed again, the same row is rewritten
        _resume_and_compare(work, copy, reference, monkeypatch)


@_REFERENCE_GROUP
def test_a_loader_failing_after_a_stop_request_during_an_evaluation_keeps_the_epoch(tmp_path, data, reference,
                                                                                  monkeypatch):
    """Ctrl-C reaches the DataLoader's workers too; one failing a fetch of epoch 2's evaluation
    after the stop request (simulated: the request, then the RuntimeError torch raises for a
    worker gone) lost the steps since the last checkpoint behind a traceback. Now the epoch's
    training is checkpointed, the run stops as interrupted, and --resume evaluates the epoch."""
    import signal

    evaluate = _loop._evaluate
    calls = []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # the handler train() installed
            raise RuntimeError("DataLoader worker (pid(s) 12345) exited unexpectedly")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(_loop, "_evaluate", failing_second)
    with pytest.raises(_loop.Interrupted) as e:
        train(_cfg(tmp_path, data))
    assert e.value.step == _steps(tmp_path)[-1] == EPOCH_2_END
    assert [r["epoch"] for r in _rows(tmp_path)] == [0]
    _resume_and_compare(tmp_path, data, reference, monkeypatch)


@_REFERENCE_GROUP
def test_an_image_gone_while_a_stop_request_arrives_still_checkpoints_the_last_step(tmp_path, data, reference,
                                                                                   monkeypatch):
    """Class folder a/ moved away after step 5, and Ctrl-C during the fetch that then fails: the
    image error came with a stop request pending, and that case skipped the checkpoint (the steps
    since epoch 1's end were lost) and said "restore it ..., or remove it, then rerun", which
    does not continue the run."""
    import signal

    copy, aside, work = tmp_path / "data", tmp_path / "a-aside", tmp_path / "w"
    shutil.copytree(data, copy)
    getitem = _data._Folder.__getitem__
    requested = []

    def stop_requested_while_loading(self, key):
        item = getitem(self, key)
        if isinstance(item[0], _data._Undecodable) and not requested:
            requested.append(1)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # the handler train() installed
        return item

    with monkeypatch.context() as m:
        calls = _move_after_steps(m, copy / "a", aside, 5)
        m.setattr(_data._Folder, "__getitem__", stop_requested_while_loading)
        with pytest.raises(ConfigError) as e:
            train(_cfg(work, copy, checkpoint_every=100))  # only the epochs' ends (4, 8)
    saved = _steps(work)[-1]
    assert saved == len(calls) > 4, (saved, len(calls))  # the last step run, not epoch 1's end
    assert re.search(rf"cannot be read \(FileNotFoundError: .*\), though it could when the run started; the run "
                     rf"is checkpointed at step {saved}: restore it \(or its permissions\) and rerun with --resume",
                     str(e.value)), str(e.value)
    shutil.move(aside, copy / "a")
    _resume_and_compare(work, copy, reference, monkeypatch)


def test_only_sizes_changed_is_a_replacement_in_place():
    was = {"train": 16, "val": 4, "files": "f1", "names": "n1"}
    assert _loop._replaced_in_place(was, was | {"files": "f2"})
    assert not _loop._replaced_in_place(was, was | {"files": "f2", "names": "n2"})
    assert not _loop._replaced_in_place(was, was | {"files": "f2", "train": 17})
    # A checkpoint written before the names were recorded apart is compared whole, as then.
    assert not _loop._replaced_in_place({k: v for k, v in was.items() if k != "names"}, was | {"files": "f2"})


@_REFERENCE_GROUP
def test_resume_compiles_no_model_init_and_refuses_a_checkpoint_gone_meanwhile(tmp_path, data, reference, caplog,
                                                                               monkeypatch):
    """A resumed run compiled `model.init` (5-10 s for ResNet-50) for weights the checkpoint then
    replaced; zeros of their shapes stand in now. Those zeros must never be trained: a checkpoint
    listed at the start but gone before the restore is an error, not a run from step 0."""
    work = _copy(reference, tmp_path)
    jax.clear_caches()  # (the reference run compiled the same model.init)
    with caplog.at_level("WARNING", logger="jax"), jax.log_compiles(True):
        result = train(_cfg(work, data, resume=True, epochs=4))
    # (name, argument types): the optimizer's `tx.init` is a `jit(init)` too, without the random key.
    compiled = [(r.args[0], str(r.args[1])) for r in caplog.records if r.getMessage().startswith("Compiling ")]
    assert result["steps_run"] == 4 and len(compiled) >= 2, compiled  # (the step and the evaluation compile)
    assert not [c for c in compiled if "init" in c[0] and "key<" in c[1]], compiled

    empty = tmp_path / "empty"
    monkeypatch.setattr(_loop, "_latest_step", lambda workdir: 12)
    with pytest.raises(CheckpointError, match=r"checkpoint step 12 in .* was removed while this run started; run "
                                              r"the command again"):
        train(_cfg(empty, data, resume=True))
