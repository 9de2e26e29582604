"""examples/finetune_ported_resnet.py runs end to end: port, fine-tune, export, torch == JAX.

A smoke-sized run (16 px, a few steps) keeps it to seconds of training; the example's default
(3 epochs at 32 px, about 2 minutes on 2 CPU cores) is the real demo.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_finetune_example_exports_a_model_torch_agrees_with(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAXPORT_CACHE": str(tmp_path / "cache"), "JAX_NUM_CPU_DEVICES": "2"}
    # --bn-mode eval: the example's other settings are train()'s defaults, which other tests run
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "finetune_ported_resnet.py"), "--image-size", "16",
                           "--max-steps", "4", "--bn-mode", "eval", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "re-initialising fc (1000 -> 10 outputs)" in proc.stderr
    assert "predictions agree on 100.00% of 359 held-out images" in proc.stdout
    assert (tmp_path / "model.pt").exists() and (tmp_path / "run" / "checkpoints" / "4").exists()
    assert "could not be restored" not in proc.stderr  # orbax's warning when handlers are not named
