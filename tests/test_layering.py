"""Data flows one way: the JAX side never imports torch; only torch_compat does."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_jax_side_does_not_import_torch():
    code = ("import sys, jaxport, jaxport.models, jaxport.ops, jaxport.train, jaxport._io, jaxport._cli\n"
            "v = jaxport.models.resnet18()\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torchvision', 'torch_compat')))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
