"""The DataLoader workers of `--data`: spawned once per split, they serve every epoch and
evaluation of a run, and stop when it ends, however it ends (`jaxport.train._data._Loader`).

A loader per stream spawned new workers at each epoch's training and at each evaluation: ~4 s
each on 2 cores, twice an epoch. Workers are found as this process's children spawned by
multiprocessing, or as those of its forkserver. ResNet-18 at 16 px on 18 training images, batch 4: 4 steps an epoch.
"""
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

from jaxport.train import TrainConfig, _data, _loop, train
from tests.helpers import write_images

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads child processes from /proc")


def workers_of(pid: int) -> set[int]:
    """The DataLoader workers of process `pid`: its children spawned by multiprocessing, or those
    of its multiprocessing forkserver (`_data._worker_context`; the server itself is not a worker,
    and stays for the process's lifetime). Also run by the script of
    `test_workers_left_running_at_exit_do_not_hang_it` (its source, hence the import here)."""
    import os

    table = {}
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{child}/cmdline", "rb") as f:
                table[int(child)] = ppid, f.read()
        except (OSError, ValueError, IndexError):
            continue
    servers = {p for p, (ppid, cmd) in table.items() if ppid == pid and b"multiprocessing.forkserver" in cmd}
    return {p for p, (ppid, cmd) in table.items() if (ppid == pid and b"spawn_main" in cmd) or ppid in servers}


def _children(pid: int | None = None) -> set[int]:
    """The DataLoader workers of `pid` (this process)."""
    return workers_of(os.getpid() if pid is None else pid)


def _alive(pids) -> set[int]:
    return {p for p in pids if os.path.exists(f"/proc/{p}")}


@pytest.fixture
def data(tmp_path):
    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 10, size=(10, 12))  # 18 train / 2 val
    return tmp_path / "data"


def _cfg(workdir, data, **kw):
    return TrainConfig(**{**dict(workdir=str(workdir), data=str(data), image_size=16, batch_size=4, epochs=2,
                                 workers=2, progress=False, devices=1), **kw})


def _watch_workers(monkeypatch, after_step=None):
    """Records the workers alive at each training step and each evaluation batch, as
    (phase, pids) with phase "train 0", "eval 0", "train 1", ...; `after_step(n)` runs after
    the n-th step."""
    before = _children()
    seen: list[tuple[str, frozenset]] = []
    make_step, make_eval = _loop.make_train_step, _loop.make_eval_step

    count = {"train": -1, "eval": -1}

    def record(what):
        if not seen or not seen[-1][0].startswith(what):  # a new phase
            count[what] += 1
        seen.append((f"{what} {count[what]}", frozenset(_children() - before)))

    def stepping(*args, **kwargs):
        step, count = make_step(*args, **kwargs), [0]

        def counted(*a):
            out = step(*a)
            record("train")
            count[0] += 1
            if after_step is not None:
                after_step(count[0])
            return out
        return counted

    def evaluating(*args, **kwargs):
        evaluate = make_eval(*args, **kwargs)
        return lambda *a: (record("eval"), evaluate(*a))[1]

    monkeypatch.setattr(_loop, "make_train_step", stepping)
    monkeypatch.setattr(_loop, "make_eval_step", evaluating)
    return before, seen


def _phases(seen) -> dict[str, set[frozenset]]:
    phases: dict[str, set[frozenset]] = {}
    for phase, pids in seen:
        phases.setdefault(phase, set()).add(pids)
    return phases


def test_the_same_workers_serve_every_epoch_and_evaluation_and_stop_with_the_run(tmp_path, data, monkeypatch):
    """Two pools of 2 (train's, then val's from the first evaluation on) serve epochs 1 and 2 and
    both evaluations; none is left once `train` returns."""
    before, seen = _watch_workers(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(_cfg(tmp_path / "w", data))
    phases = _phases(seen)
    assert list(phases) == ["train 0", "eval 0", "train 1", "eval 1"], seen
    assert all(len(p) == 1 for p in phases.values()), phases  # the same workers through each phase
    (trainers,), (both,) = phases["train 0"], phases["eval 0"]
    assert len(trainers) == 2 and len(both) == 4 and trainers < both, phases
    assert phases["train 1"] == phases["eval 1"] == {both}, phases
    assert _children() == before and not _alive(both)


def test_workers_stop_when_an_image_fails_an_evaluation(tmp_path, data, monkeypatch):
    """Class folder a/ moved away at the end of epoch 2's training: its held-out image fails the
    evaluation (an `_Undecodable` the workers return) and the run raises; every worker stops."""
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    before, seen = _watch_workers(monkeypatch, lambda n: n == 8 and shutil.move(copy / "a", tmp_path / "aside"))
    with pytest.raises(_data.ImageError, match="held out for evaluation, cannot be read"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(_cfg(tmp_path / "w", copy))
    phases = _phases(seen)
    assert list(phases) == ["train 0", "eval 0", "train 1"], seen
    assert phases["train 1"] == phases["eval 0"] and len(next(iter(phases["eval 0"]))) == 4, phases
    assert _children() == before and not _alive(next(iter(phases["eval 0"])))


def test_workers_stop_after_a_stop_request(tmp_path, data, monkeypatch):
    """Ctrl-C in epoch 2 (the handler `train` installs, called as the signal would): the step is
    checkpointed, `Interrupted` raised, and every worker stops."""
    before, seen = _watch_workers(monkeypatch, lambda n: n == 6 and signal.getsignal(signal.SIGINT)(signal.SIGINT, None))
    with pytest.raises(_loop.Interrupted) as e:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train(_cfg(tmp_path / "w", data))
    assert e.value.step == 6
    phases = _phases(seen)
    assert list(phases) == ["train 0", "eval 0", "train 1"] and phases["train 1"] == phases["eval 0"], seen
    assert _children() == before and not _alive(next(iter(phases["eval 0"])))


def _status(pid: int) -> tuple[int, int]:
    """(parent pid, mask of blocked signals) of process `pid`, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["PPid"]), int(fields["SigBlk"], 16)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked from a forkserver on Linux")
def test_workers_are_forked_from_a_server_that_holds_off_ctrl_c_and_sigterm(data):
    """Spawned, every worker imported torch and torchvision itself (~5 s of CPU each, 4 a run on 2
    cores). Forked from multiprocessing's forkserver, a child of this process that imported them
    once. The server is started with SIGINT and SIGTERM blocked, as the workers are: a SIGTERM to
    the process group (a scheduler's) would end it, and torch's workers stop once their parent
    is gone, while the trainer still needs them for the step it checkpoints."""
    before = _children()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = _data.image_folder(str(data), image_size=16, workers=2)
    with loaded:
        stream = loaded.train.stream(iter([[0, 1], [2, 3]]), 0)
        next(stream)
        workers = _children() - before
        (server,) = {_status(w)[0] for w in workers}
        with open(f"/proc/{server}/cmdline", "rb") as f:
            assert b"multiprocessing.forkserver" in f.read()
        held = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
        for pid in (server, *workers):
            blocked = _status(pid)[1]
            assert blocked & held == held, (pid, hex(blocked))
        assert len(workers) == 2 and _status(server)[0] == os.getpid()
        stream.close()
    assert _children() == before


def test_a_stream_closed_mid_epoch_leaves_the_workers_to_the_next_one(data):
    """A stream closed after one batch (a stop, or max_steps) left batches queued in the
    workers: the next stream, of another epoch, gets its own batches only, from the same
    workers, as `load` makes them. A second stream opened while one is still being read gets
    workers of its own, shut when it ends. `close()` stops the workers; a stream after it
    starts new ones."""
    before = _children()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = _data.image_folder(str(data), image_size=16, workers=2)
    batches = [[i, i + 1] for i in range(0, 16, 2)]
    try:
        first = data.train.stream(iter(batches), 0)
        next(first)
        workers = _children() - before
        first.close()
        for (x, y), b in zip(data.train.stream(iter(batches[::-1]), 1), batches[::-1]):
            want_x, want_y = data.train.load(b, 1)
            np.testing.assert_array_equal(x, want_x)
            np.testing.assert_array_equal(y, want_y)
        assert len(workers) == 2 and _children() - before == workers

        outer = data.train.stream(iter(batches[:2]), 2)
        np.testing.assert_array_equal(next(outer)[0], data.train.load(batches[0], 2)[0])
        inner = list(data.train.stream(iter(batches[:2]), 3))  # while `outer` is open
        np.testing.assert_array_equal(inner[1][0], data.train.load(batches[1], 3)[0])
        np.testing.assert_array_equal(next(outer)[0], data.train.load(batches[1], 2)[0])
        outer.close()
        assert _children() - before == workers

        reading = data.train.stream(iter(batches), 4)
        next(reading)
        data.train.close()
        assert _children() == before and not _alive(workers)
        with pytest.raises(RuntimeError, match="the split's loader was closed while a stream was reading it"):
            next(reading)
    finally:
        data.close()
    assert _children() == before
    with data:  # a stream after `close()` starts new workers; the `with` block's end stops them
        assert len(list(data.val.stream(iter([[0], [1]]), 0))) == 2
        assert len(_children() - before) == 2
    assert _children() == before

    plain = _data.Data(_data.Split(3, lambda i, e: (i, e)), _data.Split(1, lambda i, e: (i, e)), ["a", "b"])
    plain.close()  # a Split built without `close_fn` has nothing to stop


def test_workers_left_running_at_exit_do_not_hang_it(data):
    """A script that ends with a stream half read and nothing closed: at the interpreter's exit
    torch leaves its workers to multiprocessing, which sends them the SIGTERM they ignore and
    joins them (seen: tracebacks of workers that lost their queues, and torch's "exited
    unexpectedly"; the comments in `_data` saw it hang)."""
    script = inspect.getsource(workers_of) + textwrap.dedent(f"""
        import os, warnings
        from jaxport.train import _data

        if __name__ == "__main__":
            warnings.simplefilter("ignore")
            data = _data.image_folder({str(data)!r}, image_size=16, workers=2)
            stream = data.train.stream(iter([[0, 1], [2, 3], [4, 5]]), 0)
            next(stream)
            print("workers", *workers_of(os.getpid()), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in _children(proc.pid):  # before their parent goes: then they ignore SIGTERM for good
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script hung at exit: {out}{err[-2000:]}")
    assert proc.returncode == 0, err[-3000:]
    # Without the shutdown at exit, multiprocessing's joins raced torch's: "DataLoader worker
    # (pid ...) exited unexpectedly" from its SIGCHLD handler, and the workers' own tracebacks.
    assert "Traceback" not in err and "exited unexpectedly" not in err, err[-3000:]
    workers = {int(p) for p in re.fullmatch(r"workers((?: \d+)+)\n", out).group(1).split()}
    assert len(workers) == 2
    deadline = time.monotonic() + 10
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(workers)


@pytest.mark.parametrize("stream", ["persistent", "second"])
def test_workers_of_data_dropped_in_a_reference_cycle_stop_when_it_is_collected(data, stream):
    """Data dropped in a reference cycle, its workers running (those of the split's persistent
    loader, or those of a second stream opened while the first was read): the cyclic collector
    took torch's iterator with it and finalised multiprocessing's queues first, so torch's
    shutdown queued its stop message to a feeder thread already gone. The workers stayed, and
    the interpreter's exit hung joining them (`test_train_loop.py`'s image-folder test, run
    alone: pytest's exit collects garbage before the interpreter's exit handlers)."""
    import gc

    before = _children()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = _data.image_folder(str(data), image_size=16, workers=2)
    first = loaded.train.stream(iter([[0, 1], [2, 3]]), 0)
    next(first)
    if stream == "second":
        second = loaded.train.stream(iter([[4, 5], [6, 7]]), 0)  # the first is not done: workers of its own
        next(second)
    else:
        first.close()
    workers = _children() - before
    assert len(workers) == (4 if stream == "second" else 2)
    cycle = [loaded, first] + ([second] if stream == "second" else [])
    cycle.append(cycle)
    del loaded, first, cycle
    if stream == "second":
        del second
    try:
        gc.collect()
        deadline = time.monotonic() + 10
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(workers)
    finally:
        for pid in _alive(workers):  # else this process's exit would hang joining them
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_the_run_and_every_worker(tmp_path, data):
    """`jaxport train` with workers, Ctrl-C to its whole process group (as a terminal sends it)
    after epoch 1: the workers ignore it, the trainer checkpoints and exits with status 130, and
    no process of the group is left."""
    cmd = [sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), "--data", str(data),
           "--image-size", "16", "--batch-size", "4", "--epochs", "50", "--workers", "2", "--no-progress"]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("epoch 1:"):  # both splits' workers are running
                os.killpg(proc.pid, signal.SIGINT)
                break
        lines += proc.stderr.read().splitlines(keepends=True)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, "".join(lines)[-3000:]
    assert any(line.startswith("jaxport: interrupted: SIGINT at step") for line in lines), lines
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        group = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[3]) == proc.pid:
                        group.append(pid)
            except (OSError, ValueError, IndexError):
                continue
        if not group:
            break
        time.sleep(0.1)
    assert not group, group
