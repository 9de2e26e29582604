"""examples/ssd_hard_negative_mining.py runs and agrees with torchvision's loss."""
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ssd_hard_negative_mining.py"


def test_ssd_hard_negative_mining_example_matches_torch():
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mined negatives identical: True" in proc.stdout
