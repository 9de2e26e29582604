"""The suite's own settings that protect the machine it runs on."""
import os
import subprocess
import sys

import pytest

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


def test_tmp_path_is_under_the_temporary_root_the_suite_chose(tmp_path):
    """conftest points pytest's temporary root at /dev/shm where that is a roomy tmpfs (RAM:
    checkpoints are written there several times faster than to a VM's disk); xdist's workers
    take their directories inside the controller's."""
    root = os.environ.get("PYTEST_DEBUG_TEMPROOT")
    if not root:
        pytest.skip("pytest's default temporary root (no roomy tmpfs at /dev/shm)")
    assert tmp_path.resolve().is_relative_to(os.path.realpath(root)), (tmp_path, root)


def test_the_ram_root_needs_room_and_memory(monkeypatch):
    """Decided by the thresholds given, not by the memory the running suite happens to leave."""
    import conftest

    if not os.path.isdir("/dev/shm") or conftest._ram_temproot(room=0, available=0) is None:
        pytest.skip("no writable tmpfs at /dev/shm here")
    assert conftest._ram_temproot(room=0, available=1 << 60) is None  # not that much memory
    st = os.statvfs("/dev/shm")
    # 1 GiB free: too little for a run's ~2 GB of workdirs.
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result(
        (*st[:3], (1 << 30) // st.f_frsize, (1 << 30) // st.f_frsize, *st[5:])))
    assert conftest._ram_temproot(room=0, available=0) is not None
    assert conftest._ram_temproot(room=4 << 30, available=0) is None
