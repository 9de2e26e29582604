"""Orbax checkpoints of a training run: atomic, the last few kept, exact resume.

A checkpoint is `WORKDIR/checkpoints/<step>/` with two items: `state` (the whole TrainState:
step, params, batch_stats, optimizer state) and `meta` (JSON: arch, num_classes, classes, seed,
batch size, image size, epoch accumulators; `unevaluated`: the training half of the metrics row
of an epoch whose evaluation failed, which --resume evaluates first), and with --model-ema a
third, `ema` (the average, `_ema.EMA`). Orbax writes into a
temporary directory and renames it when complete, so a run killed mid-save leaves no
half-written step; the next run removes its temporary. A run killed
while the rotation deletes the oldest step may leave it half-deleted: resuming reads the newest
step, and the next save deletes that one. A newest step that cannot be read (a damaged disk, not a
kill) stops `--resume` with an error naming the newest step that reads, never a silent fallback.
The data order and augmentation are functions of `(seed, epoch, index)`, so the step number
and the seed are the whole RNG state.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Iterator, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from .._abandoned_reads import quiet_abandoned_reads
from .._errors import CheckpointError
from .._io import free_inodes, require_space


# Orbax's default jax.Array handler writes a replicated array "replica-parallel": each device
# writes a slice of its copy, cut by an eager `lax.slice` that is compiled anew for every array
# shape and device. A run's first save (and every save of a new process) compiled ~1,000 of them:
# ~8 s of a 33 s one-step ResNet-18 run on 8 CPU devices. Here one replica writes each array (as
# orbax did before replica-parallel): the checkpoint's files are the same. The other types keep
# the handlers orbax has registered for them.
_TYPES = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False)),
    *((t, ocp.type_handlers.get_type_handler(t)) for t in (np.ndarray, int, float, bytes, np.number, str)))

TMP_DIR_SUFFIX = ocp.utils.TMP_DIR_SUFFIX  # of a step orbax is writing: `<step>.orbax-checkpoint-tmp`
FINAL_VARIABLES = "variables.safetensors"  # written at the end of a run, beside checkpoints/
FINAL_EMA = "variables_ema.safetensors"  # the --model-ema average, written beside it
_T = TypeVar("_T")
_READ_TRIES = 5  # listings, and reads of the newest step, by `load_workdir` while a run may rotate them
_ROTATION_WAIT_S = 2.0  # how long `load_workdir` watches for a rotation after a failed read
# Files and directories a save makes, per process, asked of the file system first: 20-28 in a
# ResNet-18's step (orbax's metadata files and a dozen OCDBT data files cut by tensorstore's
# writer threads; each process of a run adds its own `ocdbt.process_N/` tree). Generous: it is
# there to refuse a file system with next to no inodes left, not to ration them.
_SAVE_FILES_PER_PROCESS = 64


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def manager(workdir: str, max_to_keep: int | None = 3, reader: bool = False) -> ocp.CheckpointManager:
    """The run's checkpoint manager; a `reader` (`load_workdir`) creates, removes and rotates
    nothing, since a run may be writing into `workdir` meanwhile. (Not orbax's `read_only`: it
    logs two absl warnings on each open, which reached `jaxport export`'s one-line output.)"""
    # A run killed while orbax wrote a step leaves `<step>.orbax-checkpoint-tmp/`, as large as a
    # checkpoint. Orbax reused it only when the resumed run saved that same step again, logging
    # a raw absl WARNING on the user's terminal; a run resumed with another --checkpoint-every
    # kept it for good. The writing run removes them on start (orbax's primary process does).
    options = ocp.CheckpointManagerOptions(max_to_keep=None if reader else max_to_keep, create=not reader,
                                           enable_async_checkpointing=False, cleanup_tmp_directories=not reader)
    # Handlers named up front: `item_metadata` (used by `load_workdir`) then knows how to read
    # each item instead of warning that it "could not be restored".
    handlers = {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_TYPES), "meta": ocp.JsonCheckpointHandler(),
                "ema": ocp.PyTreeCheckpointHandler(type_handler_registry=_TYPES)}
    path = checkpoint_dir(workdir)
    if reader:
        return _listing(path, lambda: ocp.CheckpointManager(path, options=options, item_handlers=handlers))
    mngr = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
    # Orbax removes them in a thread that only its `save` waits for: a manager closed without
    # saving (a resume with nothing left to train, an error before the first step) left the
    # thread running past `close()`, and where the workdir was deleted meanwhile it logged an
    # absl ERROR ("_SignalingThread.run() raised an exception: No such file or directory") into
    # whatever ran next. Waited for here, the removal is done when the manager is returned. (A
    # private attribute: an orbax without it returns at once, as before.)
    cleanup = getattr(mngr, "_cleanup_tmp_directory_future", None)
    if cleanup is not None:
        cleanup.result()
    return mngr


def _listing(path: str, list_steps: Callable[[], _T]) -> _T:
    """`list_steps()` (a reader's manager made, or reloaded), tried again where a step it listed
    was gone when orbax read it: a run training into the workdir deletes its oldest step once it
    has saved a newer one, and the next listing no longer holds it.

    Orbax lists `path`'s step directories, then reads each one's commit time and metrics; the
    rotation between the two ended 1 export in 11 against `jaxport train --checkpoint-every 1
    --keep-checkpoints 1` in "No such file or directory: '.../checkpoints/2'", after absl's
    "Metadata file does not exist" warning. Orbax's loggers are quiet meanwhile: it warns of each
    step without metadata, which is this race, or a step a killed rotation left half-deleted,
    which the read that follows reports.

    Raises:
      CheckpointError: steps vanished in each of `_READ_TRIES` listings.
    """
    for _ in range(_READ_TRIES):
        try:
            with _quiet():
                return list_steps()
        except FileNotFoundError as e:
            gone = os.path.abspath(e.filename) if isinstance(e.filename, str) else ""
            if not (gone.startswith(path + os.sep) and os.path.isdir(path)):
                raise  # not a step in a listing: checkpoints/ itself, or a file of orbax's own
    raise CheckpointError(f"the checkpoints in {path} were deleted while they were listed, {_READ_TRIES} times "
                          "in a row (a run saving into it deletes its oldest step at each save): try again")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Orbax's and absl's loggers silenced for the block: what they would say reached the CLI's
    terminal in raw absl format, beside the one line that says what went wrong."""
    quiet = logging.getLogger("absl"), logging.getLogger("orbax")
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, meta: dict, ema: Any = None) -> None:
    """Save `state` and `meta` at `step` (all processes call it; returns when written), and the
    run's `--model-ema` average (`_ema.EMA`), if any, as a third item, `ema`.

    Raises:
      CheckpointError: the file system has no room for it, in bytes or in inodes (checked first,
        so orbax's writer threads do not fail mid-way), or the write failed; the message names
        the directory and the latest checkpoint left intact. A write that fails anyway (another
        process filled the disk meanwhile) logs nothing: the error is the whole report.
    """
    where = str(mngr.directory)
    try:
        require_space(where, sum(int(x.nbytes) for x in jax.tree.leaves((state, ema))) + (1 << 20), "save it",
                      files=_SAVE_FILES_PER_PROCESS * jax.process_count())
    except OSError as e:  # orbax writes a little less than the arrays' bytes: the bound is safe
        raise _not_written(mngr, step, e.strerror) from None
    # Each of orbax's writer threads that fails logs its error with a full traceback in raw absl
    # format (~140 lines from 3 threads when the inodes ran out) before the one line below says
    # the same. Held back meanwhile: dropped when the save fails, logged when it succeeds (orbax
    # logs, and goes on, when the rotation cannot delete the oldest step).
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            held.append(record)
            return False
        return _no_preemption_notice(record)

    loggers = logging.getLogger("absl"), logging.getLogger("orbax")
    for logger in loggers:
        logger.addFilter(hold)
    try:
        items = {"state": ocp.args.PyTreeSave(state), "meta": ocp.args.JsonSave(meta)}
        if ema is not None:
            items["ema"] = ocp.args.PyTreeSave(ema)
        mngr.save(step, args=ocp.args.Composite(**items), force=True)
        mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - any failed write: the run cannot go on without checkpoints
        why = _why_not_written(where, e)  # before the removal below frees the inodes it took
        # Orbax leaves its unfinished temporary directory; remove it, it can only hold a partial step.
        for name in os.listdir(where):
            if name.startswith(f"{step}.") and TMP_DIR_SUFFIX in name:
                shutil.rmtree(os.path.join(where, name), ignore_errors=True)
        raise _not_written(mngr, step, why) from None
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
    for record in held:
        logging.getLogger(record.name).handle(record)


def _why_not_written(where: str, e: Exception) -> str:
    """The reason a failed save gives. A file system out of inodes fails a write with ENOSPC, as
    one out of bytes does (orbax says "No space left on device" for both), so its counts tell."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "No space left on device" not in str(e) and getattr(e, "errno", None) != errno.ENOSPC:
        return f"{type(e).__name__}: {first[:300]}"
    try:
        inodes, free = free_inodes(where), shutil.disk_usage(where).free
    except OSError:
        inodes, free = None, 0
    if inodes == 0 and free >= 1 << 20:  # out of both: freeing space frees inodes too
        return (f"no free inodes (files) left on its file system, though {free / 1e6:.1f} MB are free: delete some "
                "files there")
    return "the disk is full: free some space"


def _no_preemption_notice(record: logging.LogRecord) -> bool:
    """Drops orbax's "Reached preemption sync point, step=N" warning. Saving the step that
    every process agreed on after a SIGTERM, orbax logged it (twice on process 0) in raw absl
    format beside the CLI's own line saying the same: "interrupted: SIGTERM at step N"."""
    return "Reached preemption sync point" not in str(record.msg)


def _restore_args(abstract: Any) -> ocp.args.PyTreeRestore:
    """Read into `abstract`'s shapes, dtypes and shardings (what orbax's StandardRestore does)."""
    return ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def _not_written(mngr: ocp.CheckpointManager, step: int, why: str) -> CheckpointError:
    return CheckpointError(f"could not write checkpoint step {step} in {mngr.directory}: {why}; {kept(mngr)}")


def kept(mngr: ocp.CheckpointManager) -> str:
    """What a run stopped by a failed write still has, and how to continue it."""
    latest = mngr.latest_step()
    return (f"the latest checkpoint, step {latest}, is intact: rerun with --resume to continue from it"
            if latest is not None else "no checkpoint was written yet")


def _unreadable(mngr: ocp.CheckpointManager, step: int, err: Exception, *,
                reading: str | None = None) -> CheckpointError:
    """The error for checkpoint `step` that cannot be read. The fix resumes from an older step
    (training); with `reading` (for `load_workdir`'s readers such as `jaxport export`: what else
    holds the weights, or "") it says what can be read instead of retraining.

    The older step named is one that reads: a run killed while its keep-last rotation deleted
    the oldest step leaves that directory half-deleted (orbax removes it with a recursive
    delete), and naming it sent the user from one unreadable checkpoint to the next. Every
    unreadable step above the one named is listed to be moved, since the newest is resumed.
    """
    path = _where(mngr)
    older = sorted((s for s in mngr.all_steps() if s < step), reverse=True)
    good = next((s for s in older if _reads(mngr, s)), None)
    bad = [os.path.join(path, str(s)) for s in [step, *older] if good is not None and s > good]
    what = bad[0] + (f" and {', '.join(bad[1:])} (unreadable too)" if len(bad) > 1 else "") if bad else ""
    if good is not None:
        fix = (f"move {what} aside to read step {good}" if reading is not None
               else f"delete {what} to resume from step {good}")
    elif reading is not None:
        fix = "it is the only checkpoint" if not older else f"no older checkpoint in {path} can be read either"
    elif not older:
        # Not "train again without --resume": the workdir's metrics.jsonl (and final weights)
        # make a run without it refuse the workdir; --resume without a checkpoint starts at 0.
        fix = (f"it is the only checkpoint: delete {os.path.join(path, str(step))} and rerun with --resume to train "
               "from step 0")
    else:
        fix = (f"no older checkpoint (step {', '.join(map(str, sorted(older)))}) can be read either: delete {path} "
               "and rerun with --resume to train from step 0")
    fix += reading or ""
    cause = _root_cause(err)
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return CheckpointError(f"checkpoint step {step} in {path} cannot be read ({type(cause).__name__}: "
                           f"{first[:300]}); {fix}")


def _root_cause(err: BaseException) -> BaseException:
    """The innermost explicit cause with a message. Orbax wraps a failed array read in "Encountered
    error while reading array index: (...). See full TensorStore details: <bound method ...", cut
    at 200 characters mid-repr; tensorstore's own error below it names the array and the file
    ("OUT_OF_RANGE: Error reading "params.fc.kernel/0" in OCDBT database at ...")."""
    while err.__cause__ is not None and str(err.__cause__).strip():
        err = err.__cause__
    return err


def _read_as_saved(mngr: ocp.CheckpointManager, step: int, item: str = "state") -> tuple[Any, dict]:
    """`(state, meta)` of checkpoint `step`, laid out as saved (its own shapes, on the CPU);
    `item="ema"`: its `--model-ema` average instead of the state (a CheckpointError if it has none)."""
    meta_tree = mngr.item_metadata(step).get(item)
    if meta_tree is None and item == "ema":
        raise _no_ema(mngr, step)
    shapes = meta_tree.tree if hasattr(meta_tree, "tree") else meta_tree
    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), shapes,
                            is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
    out = mngr.restore(step, args=ocp.args.Composite(**{item: _restore_args(abstract)},
                                                     meta=ocp.args.JsonRestore()))
    return out[item], dict(out["meta"] or {})


def _rotated(path: str, listed: list[int]) -> bool:
    """Whether the steps in `path` change from `listed` within `_ROTATION_WAIT_S`, after a read of
    the newest of them failed: a live run's rotation (its newer step saved, then the one being
    read deleted) rather than a damaged step. The read can fail before that step's directory is
    gone, and before the newer step is listed (a truncated array file, 1 export in 3 against
    --keep-checkpoints 1): asked once, the newest step was blamed though the run had moved on."""
    deadline = time.monotonic() + _ROTATION_WAIT_S
    while True:
        try:
            now = sorted(ocp.utils.checkpoint_steps(path))
        except OSError:  # a step deleted while it was listed
            now = None
        # (An empty listing waits for the newer step, which orbax may not have renamed into place yet.)
        if now and now != listed:
            return True
        if time.monotonic() >= deadline:
            return now != listed
        time.sleep(0.05)


def _reads(mngr: ocp.CheckpointManager, step: int) -> bool:
    """Whether checkpoint `step` reads whole (only asked on the way to an error: it reads every array)."""
    # Orbax logs a warning (on stderr, beside the CLI's one-line error) for each item it cannot
    # read; the answer here is the whole report, so its loggers are quiet meanwhile.
    try:
        with _quiet():
            _read_as_saved(mngr, step)
    except Exception:  # noqa: BLE001 - any failure to read is the answer
        return False
    return True


def _where(mngr: ocp.CheckpointManager) -> str:
    return mngr.directory.as_posix() if hasattr(mngr.directory, "as_posix") else str(mngr.directory)


def peek_meta(workdir: str, step: int) -> dict | None:
    """The `meta` item of checkpoint `step` read straight from its file, without a manager
    (creating one is a barrier across processes); None where it cannot be read."""
    try:
        with open(os.path.join(checkpoint_dir(workdir), str(step), "meta", "metadata")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def latest_meta(mngr: ocp.CheckpointManager) -> dict | None:
    """The `meta` item of the latest checkpoint (arch, classes, seed, ...), or None.

    Read alone, without the state: a resumed run checks it against its own settings first,
    since restoring the state of another model fails inside orbax with no word of why.

    Raises:
      CheckpointError: the latest checkpoint exists but its metadata cannot be read.
    """
    steps = sorted(mngr.all_steps())
    if not steps:
        return None
    try:
        return dict(mngr.restore(steps[-1], args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        raise _unreadable(mngr, steps[-1], e) from None


def restore(mngr: ocp.CheckpointManager, target: Any) -> tuple[Any, dict] | None:
    """The latest `(state, meta)`, laid out like `target` (arrays with shardings), or None.

    Raises:
      CheckpointError: the latest checkpoint exists but cannot be read (truncated or corrupt
        files), naming the step directory and what to do.
    """
    steps = sorted(mngr.all_steps())
    if not steps:
        return None
    step = steps[-1]
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    try:
        out = mngr.restore(step, args=ocp.args.Composite(state=_restore_args(abstract),
                                                         meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        if "tree structures do not match" in str(e):  # readable, but not into this run's state
            raise CheckpointError(
                f"checkpoint step {step} in {_where(mngr)} holds a training state of another structure than this "
                "run's (the optimizer's settings differ, e.g. --momentum or --weight-decay changed to or from 0); "
                "the checkpoint is intact: resume with the settings it was trained with, or start a new --workdir"
            ) from None
        raise _unreadable(mngr, step, e) from None


def restore_ema(mngr: ocp.CheckpointManager, step: int, target: Any) -> Any:
    """The `--model-ema` average (`_ema.EMA`) of checkpoint `step`, laid out like `target`.

    Raises:
      CheckpointError: the checkpoint holds no EMA, or it cannot be read.
    """
    if mngr.item_metadata(step).get("ema") is None:
        raise _no_ema(mngr, step)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    try:
        return mngr.restore(step, args=ocp.args.Composite(ema=_restore_args(abstract)))["ema"]
    except Exception as e:  # noqa: BLE001 - any failure to read is reported the same way
        raise _unreadable(mngr, step, e) from None


def _no_ema(mngr: ocp.CheckpointManager, step: int) -> CheckpointError:
    return CheckpointError(f"checkpoint step {step} in {_where(mngr)} holds no EMA: its run was trained without "
                           "--model-ema")


def load_workdir(workdir: str) -> tuple[dict, str | None]:
    """`(variables, arch)` of the latest checkpoint in a `jaxport train` workdir, as numpy.

    `variables` is `{"params", "batch_stats"}`, ready for `torch_compat.flax_to_torch(variables,
    arch)` (what `jaxport export WORKDIR --out model.pt` does); `arch` is None where the
    checkpoint does not record it.

    A read that fails leaves orbax's other reads pending, and their leftovers (thousands of
    lines on stderr) come after it returns: the first call therefore installs, for the process,
    an asyncio log filter, a warnings filter and an unraisable hook that drop those leftovers
    alone (`jaxport._abandoned_reads`); a read of a rotating checkpoint is retried for 2 s.

    Raises:
      CheckpointError: no checkpoint in `workdir`, or it cannot be read (naming what can be
        read instead: an older checkpoint, or the run's final variables file).
    """
    variables, arch, _ = read_latest(workdir)
    return variables, arch


def read_latest(workdir: str, ema: bool = False) -> tuple[dict, str | None, int]:
    """`load_workdir`'s `(variables, arch)` and the step they were read from (a run still
    training into `workdir` may have moved on from the step that was newest when it was listed).
    `ema`: the variables of the checkpoint's `--model-ema` average instead (a CheckpointError
    where its run had none)."""
    # A read that fails (damage, or a run rotating the step away) leaves orbax's other reads
    # pending: thousands of lines on stderr as they end, after the error that says it all.
    quiet_abandoned_reads()
    path = checkpoint_dir(workdir)
    final = os.path.join(workdir, FINAL_VARIABLES)
    instead = f"; its final weights are in {final} (jaxport export can read it)" if os.path.isfile(final) else ""
    if not os.path.isdir(path):
        raise CheckpointError(f"`workdir` (={workdir}) has no checkpoints/ directory"
                              + (instead or "; train into it with `jaxport train --workdir` first"))
    mngr = manager(workdir, reader=True)
    try:
        steps = sorted(mngr.all_steps())
        if not steps:
            raise CheckpointError(f"`workdir` (={workdir}) holds no finished checkpoint in {path} (a run stopped "
                                  "before its first checkpoint, or they were deleted)"
                                  + (instead or "; train into it with `jaxport train --workdir` first"))
        for attempt in range(_READ_TRIES):
            try:
                state, meta = _read_as_saved(mngr, steps[-1], "ema") if ema else _read_as_saved(mngr, steps[-1])
                break
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001
                # A run still training into `workdir` deletes its oldest step once a newer one is
                # saved: with --keep-checkpoints 1 an export made meanwhile found the step it had
                # listed gone midway (6 of 12 exports), and called it unreadable. A listing that
                # changes means that race, not damage: read the newest again.
                if not _rotated(path, steps) or attempt + 1 == _READ_TRIES:
                    raise _unreadable(mngr, steps[-1], e, reading=instead) from None
                failed = steps[-1]
                _listing(path, mngr.reload)  # the rotation may delete another step meanwhile
                steps = sorted(mngr.all_steps())
                if not steps:
                    raise CheckpointError(f"checkpoint step {failed} in {path} was deleted while it was read, and no "
                                          "other is there: try again once a checkpoint is saved" + instead) from None
        if ema:
            state = state["variables"]
        variables = {"params": state["params"], "batch_stats": state["batch_stats"]}
    finally:
        mngr.close()  # its threads would outlive an error (`quiet_abandoned_reads` drops their leftovers)
    arch = meta.get("arch")
    return jax.tree.map(np.asarray, variables), arch if isinstance(arch, str) and arch else None, steps[-1]
