"""Flax variables on disk: one safetensors file, flat `collection/path/leaf` keys.

Writing goes through `safetensors.numpy` (atomically: a temporary file renamed into place, so
an interrupted save never leaves half a file under the requested name). Reading lets
safetensors validate the header, then maps the tensors straight from the file (read-only
numpy memmaps): no copy, so reading back costs a small fraction of `torch.load`.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from ._args import shell_word
from ._errors import CheckpointError, ConfigError

FORMAT = "jaxport.variables"
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


def flatten(tree: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """`{"params": {"fc": {"bias": a}}}` -> `{"params/fc/bias": a}`."""
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            for kk, vv in flatten(v, sep).items():
                flat[f"{k}{sep}{kk}"] = vv
        else:
            flat[str(k)] = v
    return flat


def unflatten(flat: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """Inverse of `flatten`.

    Raises:
      ValueError: one key is a prefix path of another (`params/fc` beside `params/fc/bias`): no
        tree holds both a leaf and a subtree at `params/fc`, whichever order the keys come in.
    """
    # Checked on the key set, before building: in the tree, the later key would either fail
    # inside numpy (a read-only array has no `setdefault`) or silently replace a whole subtree.
    keys = set(flat)
    conflicts = []
    for key in flat:
        parts = key.split(sep)
        conflicts += [(sep.join(parts[:i]), key) for i in range(1, len(parts)) if sep.join(parts[:i]) in keys]
    if conflicts:
        (leaf, inner), more = conflicts[0], len(conflicts) - 1
        raise ValueError(f"key '{leaf}' is both a leaf and the prefix of key '{inner}'"
                         + (f" (and {more} more such pair{'s' * (more > 1)})" if more else ""))
    tree: dict[str, Any] = {}
    for key, v in flat.items():
        *parents, leaf = key.split(sep)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def require_space(directory: str | os.PathLike, nbytes: int, what: str, files: int = 1) -> None:
    """Raise OSError(ENOSPC) naming `what` when `nbytes` in `files` new files (or directories)
    will not fit in `directory`'s file system.

    Writers that run out of space mid-way fail in their own words (safetensors' "os error 28",
    orbax's RESOURCE_EXHAUSTED), so jaxport asks before writing. A file system also runs out of
    inodes with bytes to spare (many small files, a tmpfs or an ext4 made with few): the write
    fails with the same ENOSPC, so both are asked.
    """
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        # A file system that takes no files (/proc, a read-only mount) reports 0 bytes free too:
        # "0.0 MB are free; free some space" sent the user to clean a disk that is not full.
        blocked = unwritable(os.path.join(directory, "probe"))
        if blocked:
            raise OSError(errno.EACCES, f"cannot {what}: {blocked}; write elsewhere")
        raise OSError(errno.ENOSPC, f"not enough space to {what}: it needs {nbytes / 1e6:.1f} MB and "
                                    f"{free / 1e6:.1f} MB are free there; free some space or write elsewhere")
    inodes = free_inodes(directory)
    if inodes is not None and inodes < files:
        # Said apart from bytes: "the disk is full" sent the user to a `df -h` showing space free.
        needs = f"up to {files} new files" if files > 1 else "a new file"
        raise OSError(errno.ENOSPC, f"no free inodes (files) left to {what}: it needs {needs} and {inodes} can be "
                                    f"made there, though {free / 1e6:.1f} MB are free; delete some files there or "
                                    "write elsewhere")


def free_inodes(directory: str | os.PathLike) -> int | None:
    """How many more files (or directories) `directory`'s file system can make, or None where it
    does not count them: btrfs, NFS and some FUSE mounts report 0 inodes in all."""
    st = os.statvfs(directory)
    return st.f_favail if st.f_files else None


def unwritable(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at `path`, or None: its directory refuses new files, or, when
    the directory is still to be made, its nearest existing ancestor refuses new directories.
    Asked by writing (and removing) a probe, since permission bits do not tell for root, read-only
    mounts or special file systems. A parent that is a file is left to the caller to report."""
    parent = Path(path).parent
    existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return None
    try:
        if existing == parent:
            with tempfile.TemporaryFile(dir=parent):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as e:
        if existing == parent:
            return f"its directory '{parent}' does not accept new files ({e.strerror})"
        return (f"its directory '{parent}' does not exist and cannot be made: '{existing}' does not accept new "
                f"directories ({e.strerror})")
    return None


def file_kind(path: str | os.PathLike) -> str:
    """What a path that is not a regular file or directory is, in words ("a FIFO (named pipe)")."""
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


# The bytes of a file's name kept in its temporary's name. mkstemp adds 8 characters, the affixes
# 6 more: a name of 242-255 bytes, which the file system takes, made a temporary one of over
# NAME_MAX (255 bytes on Linux, macOS and Windows), and the write failed "File name too long".
_TEMPORARY_NAME_BYTES = 200


def _temporary_affixes(name: str) -> tuple[str, str]:
    """`(prefix, suffix)` of `atomic_path`'s hidden temporary for a file `name`: one definition,
    read by the writer and by `remove_temporaries`, which must find what the writer left."""
    encoded = os.fsencode(name)
    if len(encoded) > _TEMPORARY_NAME_BYTES:  # whole characters: a cut one (and undecodable bytes) dropped
        name = encoded[:_TEMPORARY_NAME_BYTES].decode("utf-8", "ignore")
    return f".{name}.", ".tmp"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, nbytes: int | None = None, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    An interrupted or failed write never leaves a partial file under the requested name, and
    never destroys an existing one. The file gets the usual umask permissions (not mkstemp's 0600).

    With `overwrite=False` the file is published only if nothing is at `path` at that moment,
    atomically: a check made before the write leaves time for another process to write there.

    Raises:
      FileExistsError: `overwrite` is False and something is at `path`, before the block or
        once it has run; nothing is replaced and the temporary file is removed.
      OSError: (ENOSPC) `nbytes` will not fit on the file system, said before anything is
        written (a full disk otherwise surfaces as the writer's own error, e.g. safetensors');
        or the directory cannot be made or written, with `path` as the filename.
      Terminated: SIGTERM arrived during the block (from the main thread, when SIGTERM still
        had its default action), after the temporary file was removed: a KeyboardInterrupt.
    """
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        # The rename would replace a device such as /dev/null, a FIFO or a socket (as root, even
        # /dev/null itself); a directory makes the rename fail, naming `path`.
        raise OSError(errno.EEXIST, f"exists and is {file_kind(path)}, not a regular file; nothing was written "
                      "(choose a file path)", str(path))
    if not overwrite and os.path.lexists(path):
        raise _exists(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if nbytes is not None:
            require_space(path.parent, nbytes, f"write '{path}'")
    except OSError as e:
        if e.filename is None:  # require_space's own message
            raise
        # A file where a directory of the path should be: mkdir's bare "File exists" named nothing.
        file = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if file is not None:
            raise OSError(errno.ENOTDIR, f"'{file}' is a file, not a directory", str(path)) from e
        # Name the file asked for, not the first missing directory.
        raise OSError(e.errno, e.strerror, str(path)) from e
    tmp = None
    # Entered before the temporary file exists, so no moment leaves it without a cleanup.
    with _sigterm_raises(path):
        try:
            try:
                prefix, suffix = _temporary_affixes(path.name)
                fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
            except OSError as e:  # name the file asked for, not the hidden temporary one
                raise OSError(e.errno, e.strerror, str(path)) from e
            os.close(fd)
            yield Path(tmp)
            # After the write: some writers (safetensors) recreate the file with mode 0600.
            _chmod_as_created(tmp)
            try:
                if overwrite:
                    os.replace(tmp, path)
                else:
                    _publish_new(tmp, path)
            except OSError as e:  # e.g. `path` is a directory: name it, not the temporary file
                raise OSError(e.errno, e.strerror, str(path)) from e
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


def _exists(path: Path) -> FileExistsError:
    """The error for a file `overwrite=False` keeps."""
    return FileExistsError(errno.EEXIST, "already exists; nothing was written over it (pass overwrite=True to "
                                         "replace it)", str(path))


# link(2)'s errors where the file system has no hard links (FAT, exFAT, some FUSE and network
# mounts), or will not link this file: EXDEV and EMLINK cannot happen for a new temporary in
# the same directory, but say the same thing.
_NO_HARD_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def _publish_new(tmp: str, path: Path) -> None:
    """Give the file `tmp` the name `path` only if no entry has it; FileExistsError otherwise.

    A hard link is made atomically or fails with EEXIST, where a rename replaces whatever is
    there (two `jaxport port` started together both found the path free, and the last one
    silently replaced the other's file). The caller removes `tmp`, the second name.
    """
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _exists(path) from None
    except OSError as e:
        if e.errno not in _NO_HARD_LINK:
            raise
        # Without hard links the check and the rename are two steps again, as close as they go.
        if os.path.lexists(path):
            raise _exists(path) from e
        os.replace(tmp, path)


def _chmod_as_created(path: str | os.PathLike) -> None:
    """Give `path` the mode a newly created file gets (0666 less the umask)."""
    # O_NOFOLLOW and fchmod: the temporary's name is in a directory others may write to, and
    # a link put in its place would lend the mode to its target.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    # os.umask only reads it by setting it: a file another thread makes in the meantime gets
    # this mask, so it is the most private one (with 0, such a file was world-writable).
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def remove_temporaries(directory: str | os.PathLike, names: tuple[str, ...]) -> list[Path]:
    """Remove the hidden temporary files `atomic_path` left in `directory` for `names`.

    A process killed outright (SIGKILL, the out-of-memory killer) runs no cleanup, so a write it
    was in leaves `.NAME.XXXXXXXX.tmp` behind: as large as the file (a ResNet-152's variables
    take 240 MB), and never reused, since each write picks a new random name. Only for a
    directory one writer owns (a training run's workdir): a live writer's file would go too.
    Returns the files removed.
    """
    gone = []
    for name in names:
        prefix, suffix = _temporary_affixes(name)
        for tmp in Path(directory).glob(f"{glob.escape(prefix)}*{suffix}"):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                gone.append(tmp)
    return gone


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while `atomic_path` was writing; its temporary file has been removed.

    A KeyboardInterrupt, like `jaxport.train`'s `Interrupted`: code that already stops cleanly
    on Ctrl-C (the CLI prints one line) stops the same way on `kill` or a scheduler's SIGTERM.
    `signum` is SIGTERM, so a caller can exit with 128 + signum (143), as a killed process would.
    """

    signum = signal.SIGTERM


def raise_on_sigterm(signum, frame):
    """A SIGTERM handler that stops the process as Ctrl-C does: it raises `Terminated`."""
    raise Terminated("SIGTERM")


def _jax_takes_sigterm() -> bool:
    """Whether jax.distributed's preemption service holds SIGTERM (a multi-process run).

    It installs its handler in C++, which Python's `signal.getsignal` does not see: a write
    that set and then restored a Python handler took SIGTERM away from it for good, so after
    `jaxport train`'s first metrics row a scheduler's SIGTERM to the lead process killed it
    instead of making every process checkpoint the same step."""
    distributed = sys.modules.get("jax._src.distributed")  # never imports jax itself
    state = getattr(distributed, "global_state", None)
    return getattr(state, "preemption_sync_manager", None) is not None


@contextlib.contextmanager
def _sigterm_handler(handler, replaces: tuple) -> Iterator[None]:
    """Within the block SIGTERM runs `handler`, if it now runs one of `replaces`; on exit the
    previous one is back, unless the block deliberately set its own. Anything else is left
    alone: a handler someone installed on purpose (`jaxport train` checkpoints on SIGTERM),
    SIG_IGN, jax's preemption service (in C++), and any thread but the main one (Python sets
    handlers only there)."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or _jax_takes_sigterm() or \
            previous not in replaces:
        yield
        return
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)


def sigterm_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM (where it has its default action) raises `Terminated`, as
    Ctrl-C raises KeyboardInterrupt. The CLI wraps every command in it, so `kill` or a
    scheduler's SIGTERM during set-up (scanning --data, building a model) ends with one line and
    status 143, where SIGTERM's default action ended the process silently. `jaxport train`'s
    loop and `atomic_path`'s writes replace it while they run."""
    return _sigterm_handler(raise_on_sigterm, (signal.SIG_DFL,))


def _sigterm_raises(path: Path) -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM raises `Terminated` naming `path`, so `finally` clauses run
    before the process stops: SIGTERM's default action ends it at once, which left the
    full-size hidden temporary file behind. Replaces only the default or `raise_on_sigterm`
    (an enclosing block has already installed its own). Python runs the handler between
    bytecodes, so a write inside one long C call (safetensors, torch.save) finishes first."""
    def handler(signum, frame):
        raise Terminated(f"SIGTERM while writing '{path}'")

    return _sigterm_handler(handler, (signal.SIG_DFL, raise_on_sigterm))


def save_variables(path: str | os.PathLike, variables: Mapping[str, Any], *, arch: str | None = None,
                   metadata: Mapping[str, str] | None = None, overwrite: bool = True) -> Path:
    """Write Flax variables to a safetensors file, atomically.

    Args:
      path: destination file (conventionally `.safetensors`).
      variables: nested dicts of arrays (numpy or jax), e.g. `{"params": ..., "batch_stats": ...}`.
      arch: the architecture name, stored in the header so `jaxport export` and `verify` need
        not be told.
      metadata: extra string key/values for the header.
      overwrite: replace a file already at `path` (the default). With False the file is written
        only if nothing is there, checked atomically as it is put in place: one another process
        wrote during the save is kept.

    Returns:
      The path written.

    Raises:
      ConfigError: `path` ends in a path separator (it names a directory), is a directory, or
        exists and is not a regular file (a device such as /dev/null, a FIFO, a socket), which
        the atomic rename would replace; a key is not a non-empty string without '/'; an array's
        dtype is one `load_variables` cannot read (float8, complex, object); or `metadata` is not
        strings. Nothing is written.
      FileExistsError: `overwrite` is False and something is at `path`; nothing was written.
      OSError: the file cannot be written (no space, no permission), naming `path`.
    """
    if str(path).endswith(("/", os.sep)) or Path(path).is_dir():
        raise ConfigError(f"`path` (={path}) names a directory; pass a file path in it, e.g. "
                          f"{Path(path) / 'model.safetensors'}")
    if Path(path).exists() and not Path(path).is_file():
        raise ConfigError(f"`path` (={path}) exists and is {file_kind(path)}, not a regular file, which writing "
                          "would replace; nothing was written: choose a file path")
    if not isinstance(variables, Mapping):
        raise TypeError(f"`variables` is {type(variables).__module__}.{type(variables).__qualname__}; expected Flax "
                        "variables, nested dicts of arrays such as {'params': ..., 'batch_stats': ...}")
    path = Path(path)
    _check_keys(variables, "")
    # not np.ascontiguousarray: it turns 0-d arrays (num_batches_tracked) into 1-d ones
    flat = {k: np.asarray(v, order="C") for k, v in flatten(variables).items()}
    # Checked before writing: such a file was written, then refused by `load_variables`.
    readable = set(map(np.dtype, _DTYPES.values()))
    odd = [f"{k} ({a.dtype})" for k, a in flat.items() if a.dtype not in readable]
    if odd:
        raise ConfigError(f"`variables` holds {len(odd)} array(s) of a dtype a variables file cannot hold "
                          f"({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''}); it holds floats (float16, "
                          "bfloat16, float32, float64), integers and bools: cast those first, e.g. .astype(np.float32)")
    if metadata is not None and not (isinstance(metadata, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ConfigError(f"`metadata` (={metadata!r}) must map strings to strings (the safetensors header holds "
                          "text), e.g. metadata={'step': str(step)}")
    meta = {"format": FORMAT, "version": "1", **({"arch": arch} if arch else {}), **dict(metadata or {})}
    # the data plus a generous bound on the JSON header (~100 bytes per tensor)
    with atomic_path(path, nbytes=sum(a.nbytes for a in flat.values()) + 100 * len(flat) + 4096,
                     overwrite=overwrite) as tmp:
        with safetensors_os_errors(path):
            safetensors.numpy.save_file(flat, str(tmp), metadata=meta)
        _sort_metadata(tmp)
    return path


class _Writes:
    """A file whose write errors are kept: a C++ writer (torch.save's zip) turns them into a
    RuntimeError ("unexpected pos 704 vs 598") that no longer says what failed."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


@contextlib.contextmanager
def open_for_writer(tmp: str | os.PathLike, path: str | os.PathLike) -> Iterator[_Writes]:
    """`tmp` opened for a writer that takes a file object (`torch.save`); a write that failed
    there (a full disk, a quota, a file-size limit) is raised as its OSError, naming `path`."""
    with open(tmp, "wb") as f:
        writes = _Writes(f)
        try:
            yield writes
        except Exception as e:
            if writes.error is None or isinstance(e, OSError):
                raise
            raise OSError(writes.error.errno, writes.error.strerror, str(path)) from e


@contextlib.contextmanager
def safetensors_os_errors(path: str | os.PathLike) -> Iterator[None]:
    """safetensors' failed writes as the OSError they are, naming `path`.

    Its Rust writer raises `SafetensorError("... I/O error: File too large (os error 27)")`
    for a disk that fills while it writes, a quota or a file-size limit: the CLI called that
    an internal error, and callers catching OSError (as the docstrings promise) missed it.
    """
    try:
        yield
    except safetensors.SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


def _sort_metadata(path: Path) -> None:
    """Rewrite a safetensors header with its `__metadata__` keys sorted, in place.

    safetensors (0.8) writes the metadata from a Rust HashMap, whose order is random per
    process (safetensors/safetensors#584): two ports of one checkpoint differed in their header.
    The same keys and values in another order take the same bytes, so the data offsets stand.
    """
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        meta = header.pop("__metadata__", None)
        if not meta:
            return
        text = json.dumps({"__metadata__": dict(sorted(meta.items())), **header}, separators=(",", ":"),
                          ensure_ascii=False).encode()
        if len(text) <= size:  # it is as long, unless a later safetensors writes its JSON otherwise
            f.seek(8)
            f.write(text.ljust(size, b" "))  # the spec's padding: spaces before the data


def _check_keys(tree: Mapping[str, Any], where: str) -> None:
    """A key with `/` came back from the file as a deeper tree (`{"a/b": x}` as `{"a": {"b": x}}`),
    and an empty one as a path `load_variables` cannot split back."""
    for k, v in tree.items():
        if not isinstance(k, str) or not k or "/" in k:
            raise ConfigError(f"`variables` key {k!r} (under {where or 'the top level'}) must be a non-empty string "
                              "without '/': the file joins the keys into paths with '/', so it would come back as "
                              "another tree; rename it")
        if isinstance(v, Mapping):
            _check_keys(v, f"{where}/{k}" if where else k)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a variables file (`arch`, `format`, ...)."""
    return _open(Path(path))[1]


def load_variables(path: str | os.PathLike) -> dict[str, Any]:
    """Read variables written by `save_variables`, or any safetensors file of a flattened Flax tree.

    Such a file's keys are paths joined with '/' (`params/conv1/kernel`, as `save_variables` and
    `flax.traverse_util.flatten_dict(variables, sep="/")` write them) or with '.'.

    The arrays are read-only memory maps of the file: nothing is copied until used. Copy with
    `np.array(x)` before writing to one.

    Raises:
      CheckpointError: missing, empty, truncated or malformed file, naming it; a tensor path
        that is also a group of others (`params/fc` beside `params/fc/bias`), naming both; a Flax
        tree flattened with another separator (`params::conv1::kernel`), naming it and the fix; or a
        torch checkpoint in safetensors form (torch keys, no `/` paths), pointing to `jaxport port`.

    Example:
      >>> variables = load_variables("resnet50.safetensors")  # doctest: +SKIP
      >>> logits = jaxport.models.resnet50().apply(variables, images)  # doctest: +SKIP
    """
    return load_with_metadata(path)[0]


def load_with_metadata(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str]]:
    """`(load_variables(path), read_metadata(path))` from one read of the file: called one after
    the other, a file replaced in between gave the weights of one version and the `arch` of
    another. Raises as `load_variables`."""
    path = Path(path)
    header, metadata, data = _open(path, data=True)
    keys = [k for k in header if k != "__metadata__"]
    sep = key_separator(keys, metadata)
    if sep is None:
        raise CheckpointError(
            f"variables file '{path}' holds torch-style keys ({', '.join(keys[:2])}, ...), not Flax variables; "
            f"it is a torch checkpoint in safetensors form: port it with `jaxport port {shell_word(path)}` "
            "(or torch_compat.load_state_dict + torch_to_flax)")
    if sep not in ("/", "."):
        raise CheckpointError(
            f"variables file '{path}' holds Flax variables whose keys are joined with {sep!r} ({keys[0]}, ...); "
            "jaxport reads keys joined with '/' (or '.'): re-save them with "
            "safetensors.flax.save_file(flax.traverse_util.flatten_dict(variables, sep='/'), path)")
    flat = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"variables file '{path}': tensor '{key}' has dtype {info['dtype']}, which jaxport cannot read")
        lo, hi = info["data_offsets"]
        flat[key.replace(sep, "/")] = data[lo:hi].view(dtype).reshape(info["shape"])
    try:
        return unflatten(flat), metadata
    except ValueError as e:
        raise CheckpointError(
            f"variables file '{path}' is not a valid variables file: {e}, so no Flax tree can hold both "
            "tensors; it was not written by `jaxport.save_variables`: re-create it with `jaxport port`, or "
            "remove or rename one of the two") from e


def holds_variables(path: str | os.PathLike) -> bool:
    """Whether a safetensors file holds Flax variables (jaxport's format, `/` paths, or a Flax
    tree flattened with another separator, `params.conv1.kernel`), rather than a torch
    state_dict in safetensors form (`conv1.weight` keys, as the model hubs publish).

    Raises:
      CheckpointError: missing, empty, truncated or malformed file, naming it.
    """
    header, metadata, _ = _open(Path(path))
    return key_separator([k for k in header if k != "__metadata__"], metadata) is not None


# The variable collections a Flax ResNet has: keys that start with one, then a separator, are
# a flattened Flax tree, whatever the separator.
_COLLECTIONS = ("batch_stats", "params")


def key_separator(keys: list[str], metadata: Mapping[str, str]) -> str | None:
    """What joins a file's keys into Flax paths: '/' (jaxport's format, and any file whose keys
    all hold one), or what follows a collection name in every key (`flatten_dict(v, sep=".")`
    gives '.'); None for a torch state_dict's keys."""
    if metadata.get("format") == FORMAT or not keys or all("/" in k for k in keys):
        return "/"
    first = next((c for c in _COLLECTIONS if keys[0].startswith(c)), None)
    sep = first and re.match(r"[^0-9A-Za-z]+", keys[0][len(first):])
    if not sep:
        return None
    sep = sep.group()
    return sep if all(any(k.startswith(c + sep) for c in _COLLECTIONS) for k in keys) else None


# How often a read starts over when the file is replaced under it (a re-port, a training run's
# save) before it says so: each replacement is a whole new file, so a second try almost always
# reads one whole file.
_READ_ATTEMPTS = 3


def _open(path: Path, *, data: bool = False) -> tuple[dict, dict[str, str], np.ndarray | None]:
    """Validate with safetensors; return the parsed header, its metadata and, with `data`, the
    bytes after the header (a read-only memmap that tensor offsets index).

    Everything comes from one open file: opening the path for each part (the validation, the
    header, the map) gave a mix of two files when it was replaced in between (`jaxport port
    --force` while another process loads): garbage, or "cannot reshape array of size 0".
    """
    for _ in range(_READ_ATTEMPTS):
        opened = _open_once(path, data)
        if opened is not None:
            return opened
    raise CheckpointError(f"variables file '{path}' was replaced {_READ_ATTEMPTS} times while it was being read "
                          "(a writer keeps saving it: another `jaxport port --force`, a training run); read it once "
                          "that writer has finished")


def _open_once(path: Path, data: bool) -> tuple[dict, dict[str, str], np.ndarray | None] | None:
    """`_open`'s one try; None when `path` was replaced while safetensors validated it."""
    try:
        # O_NONBLOCK: opening a FIFO to read waits for a writer; it is refused below as empty.
        fh = open(path, "rb", opener=lambda name, flags: os.open(name, flags | getattr(os, "O_NONBLOCK", 0)))
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"variables file '{path}' does not exist; check the path (write one with `jaxport port`)") from None
    except IsADirectoryError:
        raise CheckpointError(f"variables file '{path}' is a directory; expected a .safetensors file written by "
                              "`jaxport port`") from None
    with fh:
        opened = os.fstat(fh.fileno())
        if opened.st_size == 0:
            raise CheckpointError(f"variables file '{path}' is empty (0 bytes); re-create it with `jaxport port`")
        try:
            # safetensors opens the path itself: what it checked is this file only if the path
            # still names it afterwards (it cannot be another file with the same inode number
            # while this one is held open).
            with safetensors.safe_open(str(path), framework="numpy") as f:
                metadata = dict(f.metadata() or {})
            if not _names(path, opened):
                return None
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        except Exception as e:  # safetensors raises its own error type for every malformation
            if not _names(path, opened):
                return None
            fh.seek(0)
            head = fh.read(8)
            if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # torch.save's zip or legacy pickle
                raise CheckpointError(
                    f"'{path}' is a torch checkpoint (torch.save), not a Flax variables file: port it first with "
                    f"`jaxport port {shell_word(path)}`, then pass the .safetensors file it writes") from e
            raise CheckpointError(
                f"variables file '{path}' is not a valid safetensors file ({e}); it may be truncated or "
                "not a variables file at all: re-create it with `jaxport port`"
            ) from e
        start = 8 + n
        if not data:
            return header, metadata, None
        # Mapped from this open file (the map keeps it open once it is closed here), not the path.
        mm = np.memmap(fh, dtype=np.uint8, mode="r")[start:] if opened.st_size > start else np.zeros(0, np.uint8)
        return header, metadata, mm


def _names(path: Path, opened: os.stat_result) -> bool:
    """Whether `path` names the open file `opened` describes."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)
