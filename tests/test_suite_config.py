"""The suite's own settings that protect the machine it runs on."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_passing_tests_leave_no_temporary_files(tmp_path):
    # One run of the suite wrote ~15 GB under tmp_path (ResNet checkpoints, workdirs, exported
    # models) and pytest kept every test's directory for the last 3 runs: 33 GB of them, beside
    # earlier clean clones, filled a VM's disk, and the next run failed with hundreds of errors.
    # A nested run under this project's configuration: the passing test's directory is gone
    # afterwards, the failing test's is kept for inspection.
    (tmp_path / "test_inner.py").write_text(
        "def test_passes(tmp_path):\n    (tmp_path / 'f').write_bytes(b'x' * 1000)\n\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'f').write_bytes(b'x')\n    assert False\n")
    base = tmp_path / "base"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           os.path.join(ROOT, "pyproject.toml"), "--rootdir", ROOT, "--basetemp", str(base),
                           str(tmp_path / "test_inner.py")], capture_output=True, text=True, env=env, timeout=120)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    kept = sorted(p.name for p in base.iterdir() if not p.is_symlink()) if base.exists() else []  # (not the "current" link)
    assert kept == ["test_fails0"], kept
