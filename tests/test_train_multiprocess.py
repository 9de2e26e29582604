"""Two processes x 2 CPU devices over loopback train the weights of one process x 4 devices.

Each process loads only its half of every global batch and builds the global array with
`jax.make_array_from_process_local_data`; gradients and BatchNorm statistics cross processes
through jax's CPU collectives.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxport._io import flatten
from jaxport.train import load_workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Its `sitecustomize.py` lets both processes of a run read what earlier runs compiled (see its docstring).
SITE = os.path.join(ROOT, "tests", "two_process_site")
ARGS = ["--arch", "resnet18", "--image-size", "16", "--batch-size", "16", "--epochs", "1", "--max-steps", "1",
        "--checkpoint-every", "1000", "--no-progress", "--sync-bn"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices):
    return dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=os.pathsep.join([SITE, ROOT]))


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    import dataclasses

    import jax

    from jaxport._cli import build_parser
    from jaxport.train import train
    from jaxport.train._cli import config_from_args

    # The one-process run of `ARGS` (parsed as `jaxport train` parses them, so the two runs
    # cannot drift apart) over 4 of this process's devices, with no process of its own to
    # start, at the matmul precision a `jaxport train` process has (conftest sets "highest").
    args = build_parser().parse_args(["train", "--workdir", str(tmp_path / "one"), *ARGS])
    with jax.default_matmul_precision(None):
        train(dataclasses.replace(config_from_args(args), devices=4), log=lambda msg: None)

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxport.train", "--workdir", str(tmp_path / "two"), *ARGS,
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        # stdout is the result line alone: jax's Gloo collectives print "[Gloo] Rank 0 is
        # connected to 1 peer ranks ..." on it from C++, now redirected to stderr while training.
        assert re.fullmatch(r"stopped at step 1 \(--max-steps\).*checkpoints in \S+two\n", out), out
    assert "over 4 device(s) in 2 process(es)" in outs[0][1]

    # Read as `jaxport export WORKDIR` reads them: the 2-process checkpoint restores in this
    # 1-process reader too.
    a = flatten(load_workdir(str(tmp_path / "one"))[0])
    b = flatten(load_workdir(str(tmp_path / "two"))[0])
    assert a.keys() == b.keys() and len(a) > 100
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_checkpointed_step(tmp_path):
    """A scheduler's SIGTERM reaching one process: jax's preemption service makes both agree on
    a step; both checkpoint it, exit 143 with one line, and --resume continues from it.

    The second SIGTERM goes to process 0 of the resumed run, after it has rewritten metrics.jsonl
    (`atomic_path`): that write set and then restored a Python SIGTERM handler, which took the
    signal away from jax's C++ one, and process 0 stopped alone."""
    workdir = tmp_path / "run"
    args = [a for a in ARGS if a != "--sync-bn"]
    args[args.index("--max-steps") + 1] = "60"
    args[args.index("--checkpoint-every") + 1] = "5"

    def checkpoints():
        folder = workdir / "checkpoints"
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []

    def interrupt(target, after, *extra):
        """Launches both processes, sends SIGTERM to `target` once a checkpoint past step `after`
        exists, and returns the step both stopped at, with their stderr."""
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "jaxport.train", "--workdir", str(workdir), *args, *extra,
                                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                   str(i)], env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
        deadline = time.time() + 300
        while not any(s > after for s in checkpoints()) and time.time() < deadline:
            time.sleep(0.05)
        procs[target].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=300)[1] for p in procs]
        stopped = set()
        for p, err in zip(procs, errs):
            assert p.returncode == 128 + signal.SIGTERM, (target, err[-3000:])
            assert "Traceback" not in err
            # orbax's raw absl notice of the same step (twice on process 0), dropped while saving
            assert "Reached preemption sync point" not in err, (target, err[-3000:])
            m = re.search(r"^jaxport: interrupted: SIGTERM at step (\d+): checkpoint saved", err, re.M)
            assert m, (target, err[-3000:])
            stopped.add(int(m[1]))
        assert len(stopped) == 1, stopped
        step = stopped.pop()
        assert checkpoints()[-1] == step and after < step < 60, (checkpoints(), step)
        return step, errs

    step, _ = interrupt(1, 0)
    assert not (workdir / "metrics.jsonl").exists()  # no epoch ended: nothing was written by atomic_path
    resumed, errs = interrupt(0, step, "--resume")
    assert f"resuming from step {step}" in errs[0]


@pytest.mark.slow
def test_sigkill_of_one_process_stops_the_other_with_one_line(tmp_path):
    """A process killed outright (the out-of-memory killer's SIGKILL) cannot tell the others.
    Process 0 waited in the step's collective until jax's heartbeat verdict (~50 s here), then
    aborted in C++ with a stack trace; killed during the first step, it died of a Gloo timeout
    traceback after 30 s. Now the heartbeat watcher names the silent process within ~15 s."""
    workdir = tmp_path / "run"
    args = [a for a in ARGS if a != "--sync-bn"]
    args[args.index("--max-steps") + 1] = "500"
    args[args.index("--checkpoint-every") + 1] = "3"
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxport.train", "--workdir", str(workdir), *args,
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    deadline = time.time() + 300
    while not (workdir / "checkpoints" / "3").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert procs[0].poll() is None and procs[1].poll() is None
    procs[1].kill()
    t0 = time.time()
    _, err = procs[0].communicate(timeout=200)
    waited = time.time() - t0
    procs[1].communicate(timeout=10)
    assert procs[0].returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Check failure" not in err, err[-3000:]
    assert re.search(r"^jaxport: error: process 1 stopped responding \(no heartbeat for 15 s: killed", err, re.M), err
    assert waited < 45, waited  # 15 s of silence, up to 10 s waiting for the others' exits, slack


def _run_two(tmp_path, per_process, devices=(2, 2), timeout=300):
    """Launch processes 0 and 1 of a run of 2, with `ARGS` and then each its own flags
    `per_process[i]` (which may name another --num-processes), over `devices[i]` CPU devices;
    their (returncode, stderr)."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxport.train", *ARGS, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), *extra],
                              env=_env(n), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, (n, extra) in enumerate(zip(devices, per_process))]
    return [(p.returncode, err) for p, (_, err) in zip(procs, [p.communicate(timeout=timeout) for p in procs])]


def _clean_stop(results, pattern):
    """Every process exits 2 with one error line matching `pattern`: no Python traceback, no C++
    abort (jax's heartbeat/shutdown timeouts end in 'Check failure stack trace'), no second
    error, and no "leaked semaphore objects" from Python's resource tracker (a process stopped
    by the others' failure leaves by os._exit: `_distributed._end_children`)."""
    for i, (rc, err) in enumerate(results):
        assert rc == 2, (i, err[-3000:])
        assert "Traceback" not in err and "Check failure" not in err, (i, err[-3000:])
        assert "resource_tracker" not in err and len(re.findall(r"(?m)^jaxport: (internal )?error", err)) == 1, (
            i, err[-3000:])
        assert re.search(pattern, err), (i, err[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["init_and_data", "workdir"])
def test_processes_started_differently_are_refused_on_every_process(tmp_path, case):
    """A difference between the processes' launch lines trained silently wrong weights (another
    --lr or --init on one process; only process 0's are saved), or hung (separate workdirs;
    another --max-steps). Every process now refuses, naming the difference, before training.

    --init and --data are compared at one point (after loading), which names every difference:
    one launch whose processes differ in both shows that each is checked. Another --lr is in
    `test_processes_told_different_counts_are_refused`, beside another --num-processes."""
    if case == "init_and_data":
        import torch
        import torchvision
        from PIL import Image

        for seed in (0, 1):
            torch.manual_seed(seed)
            torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / f"r18_{seed}.pth")
        # The same file names and counts; one image of another size on process 1.
        for root in ("d0", "d1"):
            for c in ("a", "b"):
                os.makedirs(tmp_path / root / c)
                for i in range(20):
                    side = 24 if (root, c, i) == ("d1", "b", 7) else 20
                    Image.new("RGB", (side, side), (i, 0, 0)).save(tmp_path / root / c / f"{i}.png")
        extra = [["--workdir", "w", "--init", f"r18_{i}.pth", "--data", f"d{i}"] for i in range(2)]
        pattern = (r"different settings \(--data \(files\): \w+ on process 0, \w+ on process 1; "
                   r"starting weights \(--init, --seed\): \w+ on process 0, \w+ on process 1\)")
    else:
        extra = [["--workdir", "w0"], ["--workdir", "w1"]]
        pattern = (r"`--workdir` must be one directory that every process sees .*process 0 writes \S+w0, which "
                   r"process 1 \(its --workdir: \S+w1\) cannot see")
    _clean_stop(_run_two(tmp_path, extra), pattern + r".*nothing was trained")
    for w in tmp_path.glob("w*"):
        assert not (w / "checkpoints").exists() or not any((w / "checkpoints").iterdir())


@pytest.mark.slow
def test_one_process_failing_mid_run_stops_every_process_with_its_error(tmp_path):
    """Process 1's images do not decode past their headers (same names and sizes, so the
    settings agree: the second half of each JPEG is 0xFF fill): it stops at its first batch. Process 0, waiting in that step's collectives, was stuck until
    jax's timeouts, then aborted in C++; now both stop within seconds, naming the image."""
    from PIL import Image

    for root in ("good", "bad"):
        for c in ("a", "b"):
            os.makedirs(tmp_path / root / c)
            for i in range(20):
                img = (np.random.default_rng(i).random((64, 64, 3)) * 255).astype(np.uint8)
                Image.fromarray(img).save(tmp_path / root / c / f"{i}.jpg", quality=95)
                if root == "bad":
                    path = tmp_path / root / c / f"{i}.jpg"
                    data = path.read_bytes()
                    path.write_bytes(data[:len(data) // 2] + b"\xff" * (len(data) - len(data) // 2))
    t0 = time.time()
    # Loaded in each trainer (--workers 0): spawned workers (tested in test_train_workers.py)
    # import torch and torchvision each, which more than doubled these two-process tests' time.
    results = _run_two(tmp_path, [["--workdir", "w", "--data", str(tmp_path / d), "--workers", "0"]
                                  for d in ("good", "bad")])
    _clean_stop(results, r"image \S+\.jpg cannot be decoded past its header \(.*\); no checkpoint was written yet: "
                         r"remove it, or re-encode it \(open and save it again\), then rerun")
    assert re.search(r"^jaxport: error: process 1 stopped \(`--data`: image \S+bad\S+\.jpg cannot be decoded", results[0][1], re.M)
    assert time.time() - t0 < 120  # jax's own timeouts are 100 s (heartbeat) and 300 s (shutdown)


@pytest.mark.slow
def test_one_process_failing_an_evaluation_names_the_checkpoint_that_continues(tmp_path):
    """Process 1's held-out images do not decode past their headers (as above; its training
    images do): epoch 1's evaluation fails there at step 2, where the others wait in the
    evaluation's collectives and nothing can be checkpointed. The message said "remove it, or
    re-encode it, then rerun" (a rerun of the workdir is refused, and --resume refuses a changed
    --data); it now names the latest checkpoint, step 1, that --resume continues from."""
    from PIL import Image

    for root in ("good", "bad"):
        for split, n in (("train", 16), ("val", 2)):
            for c in ("a", "b"):
                os.makedirs(tmp_path / root / split / c)
                for i in range(n):
                    path = tmp_path / root / split / c / f"{i}.jpg"
                    img = (np.random.default_rng(i).random((64, 64, 3)) * 255).astype(np.uint8)
                    Image.fromarray(img).save(path, quality=95)
                    if (root, split) == ("bad", "val"):
                        data = path.read_bytes()
                        path.write_bytes(data[:len(data) // 2] + b"\xff" * (len(data) - len(data) // 2))
    results = _run_two(tmp_path, [["--workdir", "w", "--data", str(tmp_path / d), "--max-steps", "2",
                                   "--checkpoint-every", "1", "--workers", "0"] for d in ("good", "bad")])
    _clean_stop(results, r"image \S+bad/val/\S+\.jpg, held out for evaluation, cannot be decoded past its header "
                         r"\(.*\); the other processes of this run wait for this one in a collective, so it could not "
                         r"be checkpointed here; its latest checkpoint is step 1: re-encode it \(open and save it "
                         r"again\) and rerun with --resume to continue from there \(the steps after it are trained "
                         r"again\); or remove it and train a new --workdir with --init w to keep that checkpoint's "
                         r"weights \(a removed image changes --data, which --resume refuses\)")
    assert sorted(p.name for p in (tmp_path / "w" / "checkpoints").iterdir()) == ["1"]
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_flag_error_before_connecting_stops_every_process(tmp_path):
    """Process 1's flags fail validation (before jax connects): it exited alone and process 0
    waited five minutes for it to connect. It now connects first to tell the others."""
    t0 = time.time()
    results = _run_two(tmp_path, [["--workdir", "w"], ["--workdir", "w", "--data", str(tmp_path / "missing")]])
    _clean_stop(results, r"`--data` \(=\S+missing\) is not a directory")
    assert re.search(r"^jaxport: error: process 1 stopped \(`--data`", results[0][1], re.M), results[0][1]
    assert time.time() - t0 < 120


_AUTO = """
import sys
from jaxport.train import TrainConfig, train
train(TrainConfig(workdir=sys.argv[1], batch_size="auto", memory_limit_bytes=int(sys.argv[2]) << 20, arch="resnet18",
                  image_size=16, epochs=1, max_steps=1, progress=False, coordinator=sys.argv[3], num_processes=2,
                  process_id=int(sys.argv[4])), log=lambda m: print(m, file=sys.stderr, flush=True))
"""


@pytest.mark.slow
def test_batch_size_auto_takes_the_smallest_process_pick(tmp_path):
    """Each process measures its own devices' memory; the step is one program over all of
    them, so every process must take the smallest pick (else their shards' shapes differ and
    the step cannot be built). Process 0 is given room for 256 per device, process 1 far less."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _AUTO, str(tmp_path / "w"), str(limit), f"127.0.0.1:{port}",
                               str(i)], env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, limit in enumerate((300, 190))]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    err0 = outs[0][1]
    assert "--batch-size auto: 256 per device, the most it picks" in err0, err0  # process 0's own pick
    agreed = re.search(r"process 0: --batch-size auto: (\d+) per device, the most every process fits", err0)
    assert agreed and 2 <= int(agreed[1]) < 256, err0
    assert f"global batch {4 * int(agreed[1])} ({agreed[1]} per device)" in err0, err0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_wait_for_the_other_processes(tmp_path, signum):
    """Process 0 waits in jax's connect (C++, on the main thread) for a process that never comes:
    Ctrl-C and SIGTERM were ignored until the connect timeout (5 minutes by default)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), *ARGS,
                             "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2",
                             "--process-id", "0"], env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        said = []
        for line in proc.stderr:
            said.append(line)
            if "other process(es) to join" in line:
                break
        time.sleep(1.5)  # into jax's connect
        t0 = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, "".join(said) + err
    assert time.monotonic() - t0 < 10
    assert err.startswith("jaxport: interrupted") and err.count("\n") == 1, err
    assert "while waiting for the 2 processes to connect to the coordinator at 127.0.0.1:" in err, err


_CONNECT_AND_DIE = """
import os, sys
import jax
jax.distributed.initialize(sys.argv[1], 2, 1)
os._exit(0)  # gone before a single heartbeat of jaxport's watcher
"""


@pytest.mark.slow
def test_a_process_gone_before_its_first_heartbeat_is_named(tmp_path):
    """A process that connected and died before its watcher's first heartbeat (killed while the
    others were still connecting) was never taken for gone: process 0 waited in its first
    collective until jax aborted it in C++ after ~100 s."""
    port = _free_port()
    zero = subprocess.Popen([sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), *ARGS,
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"],
                            env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    one = subprocess.run([sys.executable, "-c", _CONNECT_AND_DIE, f"127.0.0.1:{port}"], env=_env(2),
                         capture_output=True, text=True, timeout=120)
    t0 = time.time()
    _, err = zero.communicate(timeout=200)
    assert one.returncode == 0, one.stderr[-2000:]
    _clean_stop([(zero.returncode, err)], r"(?m)^jaxport: error: process 1 stopped responding \(no heartbeat")
    assert time.time() - t0 < 45


@pytest.mark.slow
def test_processes_told_different_counts_are_refused(tmp_path):
    """Told 2 and 3 processes, processes 0 and 1 trained as a run of 2 (process 2, if started,
    is aborted by jax). Given 1 and 2 devices, both died of an internal reshape error.

    The first launch differs in --lr too, which trained silently wrong weights on process 1
    (`test_processes_started_differently_are_refused_on_every_process`): every difference
    between the flags is named, checked before anything is loaded."""
    _clean_stop(_run_two(tmp_path, [["--workdir", "w"], ["--workdir", "w", "--num-processes", "3", "--lr", "0.2"]]),
                r"different settings \(--lr: 0\.05 on process 0, 0\.2 on process 1; "
                r"--num-processes: 2 on process 0, 3 on process 1\).*nothing was trained")
    _clean_stop(_run_two(tmp_path, [["--workdir", "w"]] * 2, devices=(1, 2)),
                r"every process must have the same number of devices, and they have 1 on process 0, 2 on process 1")
    assert not (tmp_path / "w" / "checkpoints").exists() or not any((tmp_path / "w" / "checkpoints").iterdir())


_SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
          "SLURM_LOCALID": "0"}


def test_a_cluster_launch_is_what_jax_can_set_up(monkeypatch):
    """`SLURM_NTASKS` alone (a shell inside an allocation) or `JOBSET_NAME` alone was taken for a
    launch of several processes, and jax failed: "internal error (ValueError: coordinator_address
    should be defined.)". Those now train as one process; a full launch is still detected."""
    from jaxport.train import _distributed

    for var in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
                "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    for partial in ({"SLURM_NTASKS": "2", "SLURM_JOB_ID": "1", "SLURM_NODELIST": "localhost"}, {"JOBSET_NAME": "x"},
                    {"OMPI_COMM_WORLD_SIZE": "2"}, {**_SLURM, "SLURM_NTASKS": "1"}):
        with monkeypatch.context() as m:
            for k, v in partial.items():
                m.setenv(k, v)
            assert not _distributed.requested(None, None, None), partial
    for k, v in _SLURM.items():
        monkeypatch.setenv(k, v)
    assert _distributed._cluster() == "SLURM (SLURM_NTASKS=2)"


_CLUSTER_WAIT = """
import sys
from jaxport.train import _distributed
_distributed.initialize(connect_timeout_s=float(sys.argv[1]))
print("connected")
"""


@pytest.mark.parametrize("signum", [None, signal.SIGINT])
def test_a_cluster_launch_whose_others_never_come_ends_with_one_line(tmp_path, signum):
    """Task 0 of a SLURM launch whose task 1 never started ignored Ctrl-C and SIGTERM, then
    aborted in C++ after 306 s ("RPC: .../RegisterTask *** Check failure stack trace ***")."""
    port = _free_port()
    env = {**_env(1), **_SLURM, "JAX_COORDINATOR_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-c", _CLUSTER_WAIT, "60" if signum else "4"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if signum:
            time.sleep(6)  # into jax's connect
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "connected" not in out and "Check failure" not in err and "Traceback" not in err, err
    if signum:
        assert proc.returncode == 128 + signum, err
        assert "jaxport: interrupted while waiting for the processes of this SLURM (SLURM_NTASKS=2) launch" in err
    else:
        assert proc.returncode == 2, err
        assert re.search(r"^jaxport: error: the processes of this SLURM \(SLURM_NTASKS=2\) launch did not all "
                         r"connect within 4 s: start one process per task with the launcher", err, re.M), err
