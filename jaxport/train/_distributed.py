"""Multi-process set-up: `jax.distributed.initialize`, explicit or detected from the cluster."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import signal
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from .._errors import ConfigError, JaxportError

# What jax.distributed's auto-detection needs to find each kind of launch (its clusters/*.py),
# and the variable holding the number of processes. A variable alone was taken for a launch
# that jax then could not set up: `SLURM_NTASKS` in a shell inside an allocation (no task of a
# step) or `JOBSET_NAME` outside Kubernetes ended in "coordinator_address should be defined".
_CLUSTERS = {
    "SLURM": (("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
              "SLURM_NTASKS"),
    "Open MPI": (("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), "OMPI_COMM_WORLD_SIZE"),
    "Kubernetes (JobSet)": (("JOBSET_NAME", "KUBERNETES_SERVICE_HOST"), None),
}


def _cluster() -> str | None:
    """The kind of cluster launch of several processes this process belongs to, if any, e.g.
    "SLURM (SLURM_NTASKS=2)"."""
    for kind, (needed, count) in _CLUSTERS.items():
        if not all(var in os.environ for var in needed):
            continue
        if count is None:
            return kind
        try:
            if int(os.environ[count]) > 1:
                return f"{kind} ({count}={os.environ[count]})"
        except ValueError:
            continue
    return None


def _in_cluster() -> bool:
    return _cluster() is not None


# jax.distributed.initialize's own default: how long a process waits for the others.
CONNECT_TIMEOUT_S = 300
# jax gives up this much later than jaxport's watchdog, so the watchdog's message comes first.
_JAX_TIMEOUT_MARGIN_S = 30
EXIT_NOT_CONNECTED = 2


def _give_up(unconnected: str, pending: Exception | None = None) -> None:
    """End a process whose connect timed out with one line: `unconnected` says who did not
    connect and how to start them; `pending` is the error it connected only to tell the others."""
    if pending is not None:
        print(f"jaxport: error: {pending} (not told to the others: {unconnected})", file=sys.stderr, flush=True)
    else:
        print(f"jaxport: error: {unconnected}", file=sys.stderr, flush=True)
    os._exit(EXIT_NOT_CONNECTED)  # jax's connect blocks the main thread in C++: nothing else can stop it


@contextlib.contextmanager
def _signals_end_the_wait(what: str):
    """Ctrl-C and SIGTERM end the process, with one line and 128 + the signal, while the block
    waits in C++. jax's connect holds the main thread, where Python runs signal handlers, so a
    process waiting for the others ignored both until the connect timeout (up to 5 minutes).
    Python's C-level handler still writes each signal's number to the wakeup fd: a thread reads
    it. Nothing has been written at this point, so nothing is lost by leaving at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # pragma: no cover - not the main interpreter
        os.close(read_end), os.close(write_end)
        yield
        return
    done = threading.Event()

    def watch():
        while True:
            try:
                got = os.read(read_end, 1)
            except OSError:
                return
            if not got or done.is_set():
                return
            if got[0] in (signal.SIGINT, signal.SIGTERM):  # other handled signals go on to Python
                name = "" if got[0] == signal.SIGINT else f": {signal.Signals(got[0]).name}"
                print(f"jaxport: interrupted{name} {what}", file=sys.stderr, flush=True)
                os._exit(128 + got[0])

    watcher = threading.Thread(target=watch, daemon=True, name="jaxport-signal-watch")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        os.close(write_end)  # the watcher reads end-of-file and returns
        watcher.join(timeout=1)
        os.close(read_end)


def _check_port_free(coordinator: str, port: int) -> None:
    """Process 0 serves the coordinator on `port`: a port in use was an internal
    "Failed to start RPC server" from jax. (A race with another program remains possible.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # only a listener blocks it
        try:
            sock.bind(("", port))
        except OSError as e:
            raise ConfigError(f"`--coordinator` (={coordinator!r}): port {port} is in use on this machine, and process "
                              f"0 serves the coordinator there ({e.strerror}); choose a free port, the same for "
                              "every process") from None


def _wait_for_coordinator(coordinator: str, host: str, port: int, timeout_s: float,
                          log: Callable[[str], None]) -> None:
    """Wait until process 0's coordinator accepts connections. Without this, a process whose
    coordinator never comes up (wrong address, process 0 not started, a firewall) hung for five
    minutes and then died in a C++ abort with a stack trace."""
    deadline = time.monotonic() + timeout_s
    waiting = False
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=5):
                return
        except socket.gaierror as e:
            raise ConfigError(f"`--coordinator` (={coordinator!r}): cannot resolve host {host!r} ({e.strerror}); "
                              "pass the address of the machine that runs process 0") from None
        except OSError as e:
            problem = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(f"`--coordinator` (={coordinator!r}) did not answer within {timeout_s:g} s ({problem}): "
                              "start process 0 (--process-id 0) with the same --coordinator, on the machine at that "
                              "address, and check that the port is reachable from here")
        if not waiting:
            log(f"waiting for the coordinator at {coordinator} (process 0) ...")
            waiting = True
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


def requested(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Whether this process is launched as one of several (explicitly, or by a cluster)."""
    return (num_processes is not None and num_processes > 1 and coordinator is not None
            and process_id is not None) or _in_cluster()


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
               log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
               pending_error: Exception | None = None) -> bool:
    """Start jax's multi-process runtime when asked to or when launched by a cluster.

    With `coordinator`, `num_processes` and `process_id` given, uses them (e.g.
    `--coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0`); under SLURM, Open MPI or
    Kubernetes with more than one task, lets jax detect them; otherwise does nothing (one
    process). Must run before anything touches a device. Returns whether it initialised.

    Before jax connects, process 0 checks that the coordinator's port is free and the others
    wait (up to `connect_timeout_s`) until it answers, so a wrong address or a process 0 that
    never started is a clear error. If the processes have not all connected after
    `connect_timeout_s`, the process prints one line and exits with status 2 (jax itself would
    abort with a C++ stack trace 30 s later). `pending_error`: this process connects only to
    tell the others about it (`publish_failure`); if they never connect, it is what is printed.

    Raises:
      ConfigError: only some of the three explicit arguments given, inconsistent ones, a port
        in use (process 0), or a coordinator that cannot be resolved or did not answer in time.
    """
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("`--coordinator`, `--num-processes` and `--process-id` go together; "
                          f"got coordinator={coordinator}, num_processes={num_processes}, process_id={process_id}")
    if all(given):
        if num_processes < 1:
            raise ConfigError(f"`--num-processes` (={num_processes}) must be >= 1")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"`--process-id` (={process_id}) must be in [0, {num_processes})")
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"`--coordinator` (={coordinator!r}) must be host:port, e.g. 10.0.0.1:1234: the "
                              "address where process 0 listens, the same for every process")
        if process_id == 0:
            _check_port_free(coordinator, int(port))
            if num_processes > 1:
                log(f"coordinator at {coordinator}: waiting for the {num_processes - 1} other process(es) to join "
                    f"(up to {connect_timeout_s:g} s)")
        else:
            _wait_for_coordinator(coordinator, host, int(port), connect_timeout_s, log)
            # Said: when another program held the port, this process connected to it and then
            # printed nothing for the whole timeout.
            log(f"process {process_id}: the coordinator at {coordinator} answered; waiting for all {num_processes} "
                f"processes to join (up to {connect_timeout_s:g} s)")
        # jax's own timeout ends in a C++ abort with a stack trace; a watchdog that fires first
        # ends the process with one line instead. Nothing has been written yet at this point.
        unconnected = (f"the {num_processes} processes did not all connect to the coordinator at {coordinator} "
                       f"within {connect_timeout_s:g} s: start every process (--process-id 0 to {num_processes - 1}) "
                       "with the same --coordinator and --num-processes")
        if process_id != 0:
            unconnected += (f" (something answers at {coordinator}; if process 0 of this run is not running there, "
                            "another program holds that port)")
        watchdog = threading.Timer(connect_timeout_s, _give_up, (unconnected, pending_error))
        watchdog.daemon = True
        watchdog.start()
        try:
            with _signals_end_the_wait(f"while waiting for the {num_processes} processes to connect to the "
                                       f"coordinator at {coordinator}"):
                jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                           process_id=process_id,
                                           initialization_timeout=int(connect_timeout_s) + _JAX_TIMEOUT_MARGIN_S)
        finally:
            watchdog.cancel()
        return True
    launch = _cluster()
    if launch is None:
        return False
    # The same protections as above: one line instead of jax's C++ abort when the others never
    # come, and Ctrl-C or SIGTERM end the wait.
    unconnected = (f"the processes of this {launch} launch did not all connect within {connect_timeout_s:g} s: "
                   "start one process per task with the launcher (srun, mpirun)")
    watchdog = threading.Timer(connect_timeout_s, _give_up, (unconnected, pending_error))
    watchdog.daemon = True
    watchdog.start()
    try:
        with _signals_end_the_wait(f"while waiting for the processes of this {launch} launch to connect"):
            jax.distributed.initialize(initialization_timeout=int(connect_timeout_s) + _JAX_TIMEOUT_MARGIN_S)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"launched as one of several processes by {launch}, but jax could not set the run up from "
                          f"its environment ({str(e).strip().splitlines()[0]}); start one process per task with the "
                          "launcher (srun, mpirun), or pass --coordinator, --num-processes and --process-id") from None
    finally:
        watchdog.cancel()
    return True


def _allgather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data`, in process order (a collective: all processes must call it)."""
    from jax.experimental import multihost_utils

    sizes = multihost_utils.process_allgather(np.array([len(data)], np.int32))
    longest = int(np.max(sizes))
    padded = np.zeros(longest, np.uint8)
    padded[:len(data)] = np.frombuffer(data, np.uint8)
    rows = multihost_utils.process_allgather(padded)
    return [bytes(rows[i][:int(sizes[i][0])]) for i in range(len(rows))]


def _show(value) -> str:
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(str, value[:4]))}, ... ({len(value)} items)]"
    return str(value)


def check_same_settings(settings: dict) -> None:
    """Refuse a multi-process run whose processes were started with different settings.

    Every process trains its share of the same global step, so any difference is a silent
    error or a hang: another `--lr` or `--seed` trains other weights on that process (and only
    process 0's are saved); another `--max-steps` or data set leaves the others waiting in a
    collective forever. `settings` maps a flag (as the user types it) to a JSON-able value; all
    processes exchange theirs and each raises the same error naming every difference.

    Raises:
      ConfigError: the processes' settings differ (naming the flag and each process's value).
    """
    if jax.process_count() == 1:
        return
    # Known to every process without a collective, and needed by the one below: with 1 device
    # on one process and 3 on the other, the exchange failed with an internal reshape error.
    per_process = [sum(d.process_index == i for d in jax.devices()) for i in range(jax.process_count())]
    if len(set(per_process)) > 1:
        counts = ", ".join(f"{n} on process {i}" for i, n in enumerate(per_process))
        raise _everywhere(f"every process must have the same number of devices, and they have {counts}; give each "
                          "process as many (e.g. the same CUDA_VISIBLE_DEVICES count or JAX_NUM_CPU_DEVICES) "
                          "(nothing was trained)")
    mine = json.dumps(settings, sort_keys=True, default=str).encode()
    every = [json.loads(b) for b in _allgather_bytes(mine)]
    if all(s == every[0] for s in every):
        return
    diffs = []
    for flag in sorted({k for s in every for k in s}):
        values = [s.get(flag, "(not set)") for s in every]
        if any(v != values[0] for v in values):
            per = ", ".join(f"{_show(v)} on process {i}" for i, v in enumerate(values))
            diffs.append(f"{flag}: {per}")
    raise _everywhere(f"the {len(every)} processes were started with different settings ({'; '.join(diffs)}); "
                      "every process must run the same command apart from --process-id (nothing was trained)")


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (e.g. the batch each one's memory allows)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.array([value], np.int64))))


def check_shared_workdir(workdir: str) -> None:
    """Refuse a multi-process run whose processes do not all see process 0's `workdir`.

    Orbax writes each checkpoint from every process into one directory and process 0 commits
    it, so the workdir must be the same directory on every process (one shared file system).
    Separate directories hung in orbax's commit barrier, then failed with "No such file".
    Process 0 leaves a marker file, every process looks for it, all agree on the outcome.

    Raises:
      ConfigError: some process does not see the marker (naming those processes).
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    token = _allgather_bytes(secrets.token_hex(8).encode())[0].decode()  # process 0's
    marker = os.path.join(workdir, f".jaxport-shared-{token}")
    if jax.process_index() == 0:
        with open(marker, "w") as f:
            f.write("written by process 0 of a `jaxport train` run to check that every process sees this "
                    "directory; removed right away\n")
    multihost_utils.sync_global_devices("jaxport: workdir marker written")
    seen = os.path.exists(marker)
    mine = json.dumps([seen, os.path.abspath(workdir)]).encode()
    every = [json.loads(b) for b in _allgather_bytes(mine)]
    if jax.process_index() == 0:
        os.remove(marker)
    blind = [i for i, (ok, _) in enumerate(every) if not ok]
    if blind:
        shown = ", ".join(f"process {i} (its --workdir: {every[i][1]})" for i in blind)
        raise _everywhere(f"`--workdir` must be one directory that every process sees (a shared file system): "
                           f"process 0 writes {every[0][1]}, which {shown} cannot see. Checkpoints are written "
                           "by all processes together; pass a --workdir on a file system shared by every machine "
                           "(nothing was trained)")


def _everywhere(message: str) -> ConfigError:
    """An error every process raises at the same point, so none needs telling (`publish_failure`)."""
    err = ConfigError(message)
    err.every_process = True
    return err


# A process that stops alone leaves the others blocked in the step's collectives, where nothing
# reaches them: they hung until jax's heartbeat or shutdown timeouts (minutes) and then aborted
# with C++ stack traces. So a stopping process writes its error into the coordination service's
# key-value store, and every process watches it: all stop within a second, each printing the
# cause. Each then exits with os._exit, skipping jax's shutdown barrier (which would wait for the
# processes stuck in a collective), process 0 last: it hosts the service.
# A process killed outright (SIGKILL, the kernel's out-of-memory killer) cannot write anything,
# so every watcher also bumps a heartbeat key twice a second and reads the others': one that has
# not moved for _STALE_S means that process is gone. jax's own verdict came only after ~50 s,
# as a C++ abort with a stack trace (or, in a first step's collective, a Gloo timeout traceback
# after 30 s); _STALE_S comes first, and is long enough that a busy process (compiling, loading
# data: the heartbeat thread needs the GIL only for microseconds) is never taken for a dead one.
_FAILED, _EXITING, _ALIVE = "jaxport/failed/", "jaxport/exiting/", "jaxport/alive/"
EXIT_FAILED = 2  # the CLI's status for an error; an interrupted process exits with 128 + the signal
_INTERRUPTED = "interrupted ("  # + "Ctrl-C)" or "SIGTERM)"
_POLL_S, _EXIT_WAIT_S, _STALE_S = 0.5, 10.0, 15.0
_watch: dict = {"started": False, "published": False, "finished": False, "thread": None}


def _client():
    from jax._src import distributed  # the coordination service client jax.distributed made

    return distributed.global_state.client


def _layout() -> tuple[int, int]:
    """(this process's index, the number of processes) from the coordination service, without
    touching a backend: jax builds its CPU backend with an exchange between all the processes,
    which blocks for good when one died after connecting, so the watcher must not need it."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return 0, 1
    return int(state.process_id), int(state.num_processes)


def _senders(client, prefix: str) -> set[int]:
    return {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(prefix)}


def _exit_together(client, code: int, gone: frozenset[int] = frozenset()) -> None:
    """os._exit(code); process 0 last, since it hosts the service (the others abort in C++
    when it disappears first) and the store the others may still be reading. Process 0 does
    not wait for the processes `gone` (killed: they will never say they exit)."""
    _end_children()
    sys.stdout.flush()
    sys.stderr.flush()
    me, n = _layout()
    if me != 0:
        with contextlib.suppress(Exception):
            client.key_value_set(_EXITING + str(me), "1")
        os._exit(code)
    deadline = time.monotonic() + _EXIT_WAIT_S
    while time.monotonic() < deadline:
        try:
            if len(_senders(client, _EXITING) | gone) >= n - 1:
                time.sleep(0.2)  # their os._exit, just after they said so
                break
        except Exception:  # noqa: BLE001
            break
        time.sleep(0.1)
    os._exit(code)


def _end_children() -> None:
    """What a normal exit does for `multiprocessing` and os._exit skips: the semaphores of the
    DataLoader workers' queues unlinked. Skipped, a process stopped by another's failure
    mid-epoch printed "resource_tracker: There appear to be 28 leaked semaphore objects to clean
    up at shutdown" after its error line (Python's tracker process, once the workers had gone).
    The workers are not killed here: torch's SIGCHLD handler would raise in the main thread,
    which printed an internal error beside the real one. They exit by themselves within ~5 s of
    this process (torch's watchdog of the parent)."""
    if "multiprocessing" in sys.modules:
        from multiprocessing import util

        with contextlib.suppress(Exception):
            util._run_finalizers(0)  # exit's first stage (`util._exit_function`): the semaphores' unlinks


def watch_for_failures() -> None:
    """In a multi-process run, stop this process (status 2, one line) as soon as another one
    stops with an error (`publish_failure`) or stops sending heartbeats for `_STALE_S` (killed
    outright: SIGKILL, out of memory, a lost machine). When process 0 itself is killed, the
    coordination service goes with it and jax aborts the others at once, with its own message:
    nothing in Python runs first."""
    me, count = _layout()
    if count == 1 or _watch["started"]:
        return
    _watch["started"] = True
    client = _client()

    def stop(message: str, gone: frozenset[int] = frozenset()) -> None:
        print(f"\njaxport: error: {message}", file=sys.stderr, flush=True)
        _exit_together(client, EXIT_FAILED, gone)

    def loop():
        beats = 0
        # process -> (its last heartbeat, when it changed here). Every other process starts as
        # seen now: one that connected and then died before its first heartbeat (killed while
        # the others were still connecting) was never taken for gone, and jax aborted the rest
        # in C++ after ~100 s. The watchers all start as `initialize` returns, within a second.
        start = time.monotonic()
        seen: dict[int, tuple[str, float]] = {p: ("", start) for p in range(count) if p != me}
        while not _watch["finished"]:
            beats += 1
            try:
                client.key_value_set(_ALIVE + str(me), str(beats), allow_overwrite=True)
                failed = dict(client.key_value_dir_get(_FAILED))
                alive = dict(client.key_value_dir_get(_ALIVE))
            except Exception:  # noqa: BLE001 - the service is shutting down: the run is over
                return
            if _watch["published"] or _watch["finished"]:
                return  # a process that failed itself exits from atexit
            others = sorted((int(k.rsplit("/", 1)[1]), v) for k, v in failed.items()
                            if int(k.rsplit("/", 1)[1]) != me)
            if others:
                who, why = others[0]
                if why.startswith(_INTERRUPTED):
                    what, fix = f"was {why}", ("start every process again with --resume to continue from the "
                                               "latest checkpoint")
                else:
                    what, fix = f"stopped ({why})", ("fix the cause and start every process again (--resume "
                                                     "continues from the latest checkpoint)")
                stop(f"process {who} {what}, so process {me} stops too; {fix}")
            now = time.monotonic()
            for key, beat in alive.items():
                who = int(key.rsplit("/", 1)[1])
                if who != me and seen.get(who, ("", 0.0))[0] != beat:
                    seen[who] = (beat, now)
            silent = sorted(who for who, (_, since) in seen.items() if now - since > _STALE_S)
            if silent:
                names = ", ".join(map(str, silent))
                stop(f"process {names} stopped responding (no heartbeat for {_STALE_S:g} s: killed, e.g. by the "
                     f"out-of-memory killer, or its machine lost), so process {me} stops too; see that process's "
                     "log and its machine's kernel log (dmesg), then start every process again (--resume continues "
                     "from the latest checkpoint)", frozenset(silent))
            time.sleep(_POLL_S)

    _watch["thread"] = threading.Thread(target=loop, daemon=True, name="jaxport-failure-watch")
    _watch["thread"].start()
    atexit.register(_at_exit)  # after jax's shutdown hook, so it runs first


# What jax's collectives and coordination client say when the other end has gone: a Gloo
# connection reset at once, or a timeout (Gloo's key-value exchange, 30 s).
_PEER_LOST = ("Gloo", "Connection reset", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CoordinationService")


def _peer_lost(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(marker in str(error) for marker in _PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


def await_lost_process(error: BaseException) -> None:
    """Called with an error this process is about to stop with: when a collective failed because
    its peer went away (a Gloo connection reset or timeout: the other process was killed), give
    the watcher time to name the process that died; it then exits this process itself with
    that message, instead of this error's (e.g. "could not write checkpoint step 3 ... Gloo
    AllGather failed: Connection reset by peer", when the kill came during a checkpoint)."""
    if not _watch["started"] or _watch["published"] or isinstance(error, KeyboardInterrupt):
        return
    if not _peer_lost(error):
        return
    deadline = time.monotonic() + _STALE_S + 4 * _POLL_S
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)


def publish_failure(error: BaseException) -> None:
    """Tell the other processes that this one stops with `error`; at exit, this process then
    skips jax's shutdown barrier (the others will not reach it). Errors every process raises
    together (`every_process`) need no telling."""
    if not _watch["started"] or getattr(error, "every_process", False):
        return
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C, or a SIGTERM jax's preemption service missed
        signum = getattr(error, "signum", signal.SIGINT)  # `jaxport._io.Terminated` has SIGTERM
        text = _INTERRUPTED + ("Ctrl-C)" if signum == signal.SIGINT else f"{signal.Signals(signum).name})")
        _watch["code"] = 128 + signum
    else:
        text = (str(error).strip().splitlines() or [""])[0] or type(error).__name__
        if not isinstance(error, JaxportError):
            text = f"{type(error).__name__}: {text}"
    try:
        _client().key_value_set(_FAILED + str(_layout()[0]), text[:2000])
    except Exception:  # noqa: BLE001 - best effort: the others then stop at jax's timeouts
        return
    _watch["published"] = True


def _at_exit() -> None:
    """A process that published its failure exits here (skipping jax's shutdown barrier). Any
    other stops its watcher first, and waits for it: at interpreter shutdown a daemon thread
    that comes back from a C++ call (the watcher's key-value reads release the GIL) is ended
    with pthread_exit, whose unwinding through the binding's C++ frames aborts the process
    ("terminate called ... FATAL: exception not rethrown", status -6). Seen once on a loaded
    machine: process 0 of a SIGTERM-interrupted run printed its line, then aborted instead of
    exiting 143."""
    if _watch["published"]:
        _exit_together(_client(), _watch.get("code", EXIT_FAILED))
    _watch["finished"] = True
    thread = _watch.get("thread")
    if thread is not None:
        thread.join(timeout=_EXIT_WAIT_S)  # one poll: a sleep, then at most a few quick reads


def finish_together() -> None:
    """Wait until every process has finished its part of the run: one that fails in its final
    writes (process 0 writes the plot and the final variables) then stops the others here,
    before they report success."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("jaxport: run finished")
        _watch["finished"] = True  # from here the processes exit one by one: silence is expected
