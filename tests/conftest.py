"""Test-wide settings that must exist before jax is imported.

8 simulated CPU devices let the sharded and data-parallel tests run on any machine; parity
tests need full-precision matmuls (the CPU default may use lower precision passes).
"""
import os
import shutil
import signal
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")


def _ram_temproot(room: int = 4 << 30, available: int = 12 << 30) -> str | None:
    """/dev/shm where it is a writable tmpfs with `room` bytes free and the machine has
    `available` bytes of memory available (Linux), else None (pytest's default).

    The suite writes gigabytes of checkpoints, workdirs and exports under tmp_path. On a VM's
    disk each orbax save of a ResNet-18 state (~90 MB) took 0.4-1.7 s, against 0.4-0.6 s in RAM:
    tensorstore fsyncs every file, and the page cache's writeback throttles the writes
    (2026-12-07, `test_train_resume_order.py` and `test_train_ema.py` at -n 2: 157-169 s on disk,
    127-132 s in RAM). Nothing tested depends on a disk: a killed process loses no page cache.
    A run holds up to ~2 GB there (its session-wide workdirs) until it ends. pytest removes a
    passing run's directory then (`tmp_path_retention_policy = "failed"`); a failing run's stays
    for inspection, in pytest's rotation of the last 3 runs, until a reboot empties it.
    """
    root = "/dev/shm"
    try:
        with open("/proc/meminfo") as f:
            memory = int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) << 10
        with open("/proc/mounts") as f:
            tmpfs = any(line.split()[1:3] == [root, "tmpfs"] for line in f)
        st = os.statvfs(root)
    except (OSError, StopIteration, ValueError):
        return None
    free = st.f_bavail * st.f_frsize
    return root if tmpfs and os.access(root, os.W_OK) and free >= room and memory >= available else None


# Where tmp_path's directories go (pytest's own variable: its numbered `pytest-of-<user>/pytest-N`
# and its rotation stay as they are, in another root). One the caller set is kept.
_RAM_ROOT = "PYTEST_DEBUG_TEMPROOT" not in os.environ and _ram_temproot()
if _RAM_ROOT:
    os.environ["PYTEST_DEBUG_TEMPROOT"] = _RAM_ROOT
# One XLA compilation cache per test run. Many tests compile the same programs again under new
# closures (each `train()` call builds its own ResNet-18 step): a cache hit replaces a compile of
# seconds. pytest-xdist's workers and the tests' subprocesses inherit this process's
# environment, so they all share the directory that the first process (xdist's controller)
# makes here; it is removed when the run ends. A cached executable is the compiled program
# itself, so no result depends on it. A cache the caller set up is used as it is.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxport-tests-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# XLA:CPU runs the simulated devices' collectives as threads that meet at a rendezvous, logs
# when one is 20 s late and aborts the whole process at 40 s (xla_cpu_collective_call_*). On 2
# cores shared by 2 xdist workers a device's thread can be starved that long: once seen as
# "Termination timeout for `all gather ...` of 40 seconds exceeded", which killed the worker and
# its tests. A late thread is only slow here, never a deadlock of the program's own making, and
# tests that read a command's stderr would take the 20 s log line for output of jaxport's.
# (Both flags exist from jaxlib 0.8.2, pyproject's floor, on.)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_cpu_collective_call_warn_stuck_timeout_seconds=900",
                                    "--xla_cpu_collective_call_terminate_timeout_seconds=1800"]).strip()
# Keep torch and XLA from oversubscribing the 2 cores when pytest-xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A suite started in the background (`make test &` from a script, nohup) inherits SIGINT ignored,
# and so would every command the signal tests start and interrupt: jaxport, like Python, leaves
# an ignored SIGINT ignored. The tests' own process and children get Python's default instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


@pytest.fixture
def x64():
    """float64 inside the test (``jax.enable_x64``), for comparisons tight enough to mean exact."""
    with jax.enable_x64(True):
        yield


def pytest_collection_modifyitems(config, items):
    # The `slow` tests first (stable order otherwise): pytest-xdist hands tests out in collection
    # order, and one of several minutes handed out last (the default digits run came late, from
    # test_train_loop.py) kept one worker busy alone at the end of the run. Every process
    # sorts the same list the same way, as xdist requires.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session):
    # xdist's workers inherit _OWN_CACHE as False (the variable is set by then): only the
    # process that made the directory removes it, after every worker has finished.
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
