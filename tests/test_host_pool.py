"""The host thread pool behind the ops' CPU kernels and the converter's copies.

What went wrong with it: a Ctrl-C during an eager `rank` left the kernel's other chunks writing
into XLA's freed output buffer (a segfault); a forked child inherited the pool without its
threads and hung on its first conversion; work asked for from a pool thread waited on the pool
itself (a deadlock).
"""
import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torchvision

import torch_compat
from jaxport import _cpus
from jaxport.ops import _host

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_parallel_rows_raises_only_once_every_chunk_has_stopped(error):
    done = []

    def fn(lo, hi):
        if lo == 0:
            time.sleep(0.05)  # the other chunk has started by then
            raise error("first chunk")
        time.sleep(0.3)  # still writing when the first chunk fails
        done.append(lo)

    with pytest.raises(error, match="first chunk"):
        _host._parallel_rows(fn, rows=2, n=1 << 17, threads=2)
    assert done == [1]


def test_finish_cancels_what_has_not_started_and_waits_for_what_runs():
    failed = concurrent.futures.Future()
    failed.set_exception(ZeroDivisionError())
    running = concurrent.futures.Future()
    running.set_running_or_notify_cancel()
    threading.Timer(0.2, running.set_result, (1,)).start()
    queued = concurrent.futures.Future()
    raised = []

    def wait():  # in a thread: a `finish` that forgot the queued future would wait forever
        try:
            _cpus.finish([failed, running, queued])
        except ZeroDivisionError as e:
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "finish waited for a future that never started"
    assert raised and queued.cancelled() and running.done() and not running.cancelled()


def test_finish_absorbs_a_second_ctrl_c_while_it_waits():
    """The first error (or Ctrl-C) is re-raised only once the running chunks stopped; a Ctrl-C
    in that wait must not cut it short, or they write into a buffer XLA frees. In a process of
    its own: the signal must not reach pytest."""
    r = _run("""
        import concurrent.futures, os, signal, threading
        from jaxport import _cpus
        failed = concurrent.futures.Future()
        failed.set_exception(ZeroDivisionError())
        running = concurrent.futures.Future()
        running.set_running_or_notify_cancel()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        threading.Timer(1.0, running.set_result, (1,)).start()
        try:
            _cpus.finish([failed, running])
        except ZeroDivisionError:
            print("raised the first error, after the wait:", running.done())
    """, timeout=120)
    assert r.returncode == 0 and "raised the first error, after the wait: True" in r.stdout, r.stderr[-3000:]


def test_an_interrupted_conversion_cancels_the_copies_not_yet_started(monkeypatch):
    """torch_to_flax's copies run on the pool: a Ctrl-C while it waits for them must cancel the
    queued ones, not leave them converting for nobody."""
    from torch_compat import _convert

    class Interrupting(concurrent.futures.Future):
        def result(self, timeout=None):
            raise KeyboardInterrupt

    class Pool:
        def __init__(self):
            self.futures = []

        def submit(self, fn, *args):
            self.futures.append(Interrupting())
            return self.futures[-1]

    pool = Pool()
    monkeypatch.setattr(_convert, "host_pool", lambda: pool)
    with pytest.raises(KeyboardInterrupt):
        torch_compat.torch_to_flax(torchvision.models.resnet18(num_classes=10).state_dict())
    assert len(pool.futures) > 1 and all(f.cancelled() for f in pool.futures)


def test_ctrl_c_during_an_eager_rank_leaves_a_working_process():
    # The kernel's chunks write into XLA's output buffer from the pool's threads; leaving the
    # callback on Ctrl-C while they ran freed that buffer under them. Before the fix this
    # process died of SIGSEGV in 7 of 11 runs.
    r = _run("""
        import os, signal, threading, numpy as np
        from jaxport.ops import rank
        x = np.random.default_rng(0).standard_normal((512, 8192)).astype(np.float32)
        want = np.argsort(np.argsort(x, axis=-1, kind="stable"), axis=-1, kind="stable")
        assert np.array_equal(np.asarray(rank(x)), want)
        for i in range(8):
            t = threading.Timer(0.05 + 0.07 * i, os.kill, (os.getpid(), signal.SIGINT))
            t.start()
            try:
                rank(x).block_until_ready()
                t.join()  # the signal may land after the call: let it, here
            except KeyboardInterrupt:
                pass
            except Exception as e:  # jax may wrap an interrupt inside its callback
                assert "KeyboardInterrupt" in str(e), e
            t.join()
            assert all(np.array_equal(np.asarray(rank(x)), want) for _ in range(2))
        print("ok")
    """, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_a_forked_child_converts_with_its_own_pool():
    # The child inherits the parent's executor object but not its threads; before the fix its
    # first conversion queued copies that no thread ever ran, and it hung.
    r = _run("""
        import os, sys, time, torchvision, numpy as np
        import torch_compat
        from jaxport.ops import _host
        sd = torchvision.models.resnet18(num_classes=10).state_dict()
        want = torch_compat.torch_to_flax(sd)  # starts the parent's pool threads
        pid = os.fork()
        if pid == 0:
            got = torch_compat.torch_to_flax(sd)
            ok = np.array_equal(got["params"]["layer4"]["1"]["conv2"]["kernel"],
                                want["params"]["layer4"]["1"]["conv2"]["kernel"])
            key = np.random.default_rng(0).integers(0, 2**32, (4, 1 << 16), dtype=np.uint64).astype(np.uint32)
            ok = ok and np.array_equal(_host.rank_rows(key), np.argsort(np.argsort(key, kind="stable"), kind="stable"))
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status))
                sys.exit(0)
            time.sleep(0.05)
        os.kill(pid, 9)
        print("child hung")
    """, timeout=300)
    assert "child exit 0" in r.stdout, (r.stdout, r.stderr[-2000:])


def test_a_conversion_asked_for_on_the_pool_runs_inline():
    # Every pool thread converting at once, each waiting for copies queued behind the others,
    # never finished before the fix. In a process of its own: deadlocked pool threads would
    # keep pytest from exiting.
    r = _run("""
        import numpy as np, torch, torchvision, torch_compat
        from jaxport import _cpus
        from jaxport.ops import _host
        sd = torchvision.models.resnet18(num_classes=10).state_dict()
        want = torch_compat.torch_to_flax(sd)
        futures = [_cpus.host_pool().submit(torch_compat.torch_to_flax, sd) for _ in range(_cpus.usable_cpus())]
        for f in futures:
            got = f.result(timeout=60)
            assert np.array_equal(got["params"]["fc"]["kernel"], want["params"]["fc"]["kernel"])
            assert np.array_equal(got["params"]["layer4"]["1"]["conv2"]["kernel"],
                                  want["params"]["layer4"]["1"]["conv2"]["kernel"])
        key = np.random.default_rng(0).integers(0, 2**32, (4, 1 << 16), dtype=np.uint64).astype(np.uint32)
        futures = [_cpus.host_pool().submit(_host.rank_rows, key) for _ in range(_cpus.usable_cpus())]
        want_rank = np.argsort(np.argsort(key, kind="stable"), kind="stable")
        assert all(np.array_equal(f.result(timeout=60), want_rank) for f in futures)
        assert torch.equal(torch.as_tensor(want["params"]["fc"]["bias"]), sd["fc.bias"])
        print("inline: ok", flush=True)
        import os; os._exit(0)  # a deadlocked pool thread would hang the interpreter's exit
    """, timeout=300)
    assert r.returncode == 0 and "inline: ok" in r.stdout, r.stderr[-3000:]
