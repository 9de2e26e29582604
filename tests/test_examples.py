"""The examples run and report agreement (each exits non-zero when torch and JAX disagree)."""
import os
import subprocess
import sys
from pathlib import Path

import torch
import torchvision

REPO = Path(__file__).resolve().parents[1]


def _run_example(name, tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXPORT_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=900)


def test_port_resnet_example(tmp_path):
    proc = _run_example("port_resnet.py", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same prediction: True" in proc.stdout


def test_examples_report_bad_input_in_one_line(tmp_path):
    torch_whole = tmp_path / "whole.pt"
    torch.save(torchvision.models.resnet18(), torch_whole)  # a pickled module: refused, never run
    for name, args, fragment in [
        ("port_resnet.py", [str(tmp_path / "nope.pth")], "does not exist"),
        ("port_resnet.py", [str(torch_whole)], "outside the weights-only allowed set"),
        ("finetune_ported_resnet.py", ["--checkpoint", str(tmp_path / "nope.pth")], "--checkpoint"),
    ]:
        proc = _run_example(name, tmp_path, *args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert fragment in proc.stderr.strip().splitlines()[-1], proc.stderr
