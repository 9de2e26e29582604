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
ARGS = ["--arch", "resnet18", "--image-size", "16", "--batch-size", "16", "--epochs", "1", "--max-steps", "1",
        "--checkpoint-every", "1000", "--no-progress", "--sync-bn"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices):
    return dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), PYTHONPATH=ROOT)


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    single = subprocess.run([sys.executable, "-m", "jaxport.train", "--workdir", str(tmp_path / "one"), *ARGS],
                            env=_env(4), capture_output=True, text=True, timeout=400)
    assert single.returncode == 0, single.stderr[-3000:]

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxport.train", "--workdir", str(tmp_path / "two"), *ARGS,
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
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
    a step; both checkpoint it, exit 143 with one line, and --resume continues from it."""
    workdir = tmp_path / "run"
    args = [a for a in ARGS if a != "--sync-bn"]
    args[args.index("--max-steps") + 1] = "60"
    args[args.index("--checkpoint-every") + 1] = "5"
    port = _free_port()

    def launch(*extra):
        return [subprocess.Popen([sys.executable, "-m", "jaxport.train", "--workdir", str(workdir), *args, *extra,
                                  "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                                 env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(2)]

    procs = launch()
    deadline = time.time() + 300
    while not (workdir / "checkpoints" / "5").exists() and time.time() < deadline:
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300) for p in procs]
    stopped = set()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "Traceback" not in err
        m = re.search(r"^jaxport: interrupted: SIGTERM at step (\d+): checkpoint saved", err, re.M)
        assert m, err[-3000:]
        stopped.add(int(m[1]))
    assert len(stopped) == 1, stopped
    step = stopped.pop()
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == step and 5 <= step < 60, (steps, step)

    port = _free_port()
    procs = launch("--resume")
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert f"resuming from step {step}" in outs[0][1]
