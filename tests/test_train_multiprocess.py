"""Two processes x 2 CPU devices over loopback train the weights of one process x 4 devices.

Each process loads only its half of every global batch and builds the global array with
`jax.make_array_from_process_local_data`; gradients and BatchNorm statistics cross processes
through jax's CPU collectives.
"""
import os
import socket
import subprocess
import sys

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
