"""The examples run and report agreement (each exits non-zero when torch and JAX disagree)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run_example(name, tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXPORT_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=900)


def test_port_resnet_example(tmp_path):
    proc = _run_example("port_resnet.py", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same prediction: True" in proc.stdout
