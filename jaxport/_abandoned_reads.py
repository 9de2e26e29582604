"""Quiets what orbax's and tensorstore's reads leave behind once a checkpoint read has failed.

Orbax raises the first array read that fails and leaves the others pending. As they finish or
are collected, asyncio logged each ("Future exception was never retrieved", with tensorstore's
whole spec), their callbacks into orbax's closed event loop printed "Exception ignored ...
Event loop is closed", and coroutines that never started warned: 2.6k-20k lines on stderr
during one `load_workdir` against a run rotating its checkpoints, after the one error that says
what failed. They come after the read has returned, so they are filtered for the process, not
around the call; only these leftovers are dropped, anything else still shows.
"""
from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import warnings


class AbandonedCheckpointReads(logging.Filter):
    """Drops asyncio's "Future/Task exception was never retrieved" for orbax's and
    tensorstore's reads. Once one array of a damaged checkpoint fails, orbax raises that error
    (the command's one line) and leaves its other reads pending; each was logged with
    tensorstore's whole spec as it was collected (hundreds of lines after the error, in 1 run of
    3 of tests/test_train_loop.py's damaged-workdir export)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Future, Task or _GatheringFuture (asyncio.gather's, as orbax reads arrays)
        if not re.match(r"\w*(Future|Task) exception was never retrieved", str(record.msg)) or not record.exc_info:
            return True
        error, tb = record.exc_info[1], record.exc_info[2]
        if "OCDBT" in str(error) or "TensorStore" in str(error):
            return False
        while tb is not None:
            if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


ABANDONED_READS = AbandonedCheckpointReads()


def is_abandoned_read(u) -> bool:
    """Whether an unraisable exception (`sys.unraisablehook`'s argument) is a leftover read's."""
    # After a checkpoint read fails (a corrupt file), tensorstore's other pending reads finish
    # later and call back into orbax's event loop, already closed: each printed an "Exception
    # ignored ... RuntimeError: Event loop is closed" traceback. Those callbacks have nothing
    # left to deliver.
    if u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed":
        return True
    # A coroutine that turned its closing into an error: orbax's array reads catch
    # BaseException, so each read left pending by a failed checkpoint read printed its error
    # with tensorstore's whole spec as it was collected (~1,400 lines in a probe).
    return inspect.iscoroutine(u.object) and isinstance(getattr(u.exc_value, "__cause__", None), GeneratorExit)


def quiet_abandoned_reads() -> None:
    """Drop the leftovers of failed checkpoint reads from this process's stderr from now on (once
    is enough; calling again changes nothing). A hook already dropping them is kept as it is."""
    logging.getLogger("asyncio").addFilter(ABANDONED_READS)  # adding it again is a no-op
    # The same reads' coroutines that never started, collected after the error (1 run in 3).
    warnings.filterwarnings("ignore", r"coroutine '_read_array_index_and_device_put' was never awaited",
                            RuntimeWarning)
    if not getattr(sys.unraisablehook, "drops_abandoned_reads", False):
        sys.unraisablehook = dropping_abandoned_reads(sys.unraisablehook)


def dropping_abandoned_reads(hook):
    """`hook` (an unraisable hook) without the leftover reads' exceptions."""
    def unraisable(u):
        if not is_abandoned_read(u):
            hook(u)

    unraisable.drops_abandoned_reads = True
    return unraisable
