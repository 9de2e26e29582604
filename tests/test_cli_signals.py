"""Ctrl-C and SIGTERM end any `jaxport` command with one line and 128 + the signal, at any time:
also while jax or torch is still being imported, and when the signal lands in a callback that
Python cannot raise from (it prints "Exception ignored" and goes on)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The signal's exception raised inside a gc callback (where jax's own gc hook, running while
# torch is imported, received it in the field): Python reports it as unraisable and carries on.
_IN_GC_CALLBACK = """
import gc, sys
from jaxport import _cli, _io

def raise_once(phase, info, fired=[]):
    if not fired:
        fired.append(1)
        raise {exc}

build_parser = _cli.build_parser

def build_parser_then_collect():
    gc.callbacks.append(raise_once)
    gc.collect()
    return build_parser()

_cli.build_parser = build_parser_then_collect
sys.argv = ["jaxport", "env"]
sys.exit(_cli.main())  # as the console script calls it
"""


@pytest.mark.parametrize("exc, status", [("KeyboardInterrupt", 130), ("_io.Terminated('SIGTERM')", 143)])
def test_a_signal_raised_inside_a_callback_still_stops_the_command(exc, status):
    proc = subprocess.run([sys.executable, "-c", _IN_GC_CALLBACK.format(exc=exc)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == status, (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.startswith("jaxport: interrupted"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "jax" not in proc.stdout  # `env` never ran


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_jax_is_imported_gives_one_line(signum, tmp_path):
    """The signal arrives while the parser is built (it imports jax): it waits for the imports
    to finish (an import cut short crashed Python's teardown), then one line, 128 + signum, and
    the command never runs."""
    ready = tmp_path / "ready"
    code = ("import sys, time, pathlib\n"
            "from jaxport import _cli\n"
            "build_parser = _cli.build_parser\n"
            "def slow_build_parser():\n"
            f"    pathlib.Path({str(ready)!r}).touch()\n"
            "    time.sleep(2)\n"
            "    return build_parser()\n"
            "_cli.build_parser = slow_build_parser\n"
            "sys.argv = ['jaxport', 'env']\n"
            "sys.exit(_cli.main())\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    assert err.startswith("jaxport: interrupted") and "Traceback" not in err, err[-2000:]
    assert "jax" not in out  # `env` never ran
