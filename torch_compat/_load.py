"""Read a PyTorch checkpoint file into a plain state dict of CPU tensors, without running its code.

Three on-disk formats are recognised by their first bytes, never by the file extension:

- ``zip``: `torch.save` since 1.6 (``PK\\x03\\x04``);
- ``pickle``: the legacy `torch.save(..., _use_new_zipfile_serialization=False)` stream
  (pickle ``PROTO`` opcode ``\\x80`` followed by the protocol number);
- ``safetensors``: an 8-byte little-endian header length followed by the JSON header ``{``.

Look-alikes are named for what they are: a tar archive is torch's pre-0.4 format only when it
holds that format's members (``sys_info``, ``pickle``, ``storages``, ``tensors``), otherwise it
is an archive to extract; pickles of protocol 0 or 1 (no ``PROTO`` opcode) are torch.save files
only when they start with torch's magic number. torch's weights-only unpickler reads protocol 2
and up, so a ``pickle_protocol=1`` file needs ``trusted=True``, and torch cannot read its own
``pickle_protocol=0`` files back at all.

torch files are read with ``weights_only=True`` (only tensors, containers, numbers, strings,
`argparse.Namespace`, and numpy's bool, integer, float and complex scalars and arrays may be
built) and ``map_location="cpu"``, so a checkpoint written from CUDA tensors loads on a CPU-only
machine. numpy values, which training scripts save beside the weights (``"epoch": np.int64(3)``,
``"best_acc1": np.float64(76.1)``), are rebuilt by checked stand-ins for numpy's own unpickling
functions, never by numpy's, and only from their raw bytes: a numpy value of any other dtype
(an object array holds Python objects, whose unpickling can run code) is refused like any other
global outside the allowed set. ``trusted=True`` switches to a full unpickle, which can run
arbitrary code from the file: use it only for files whose source you trust.

Training scripts wrap the weights; `load_state_dict` unwraps them deterministically:
``{"state_dict": ...}`` (PyTorch Lightning), ``{"model": ...}`` (torchvision reference scripts),
``{"model_state_dict": ...}``, and with ``ema=True`` one of ``model_ema`` / ``ema`` /
``state_dict_ema`` / ``model_ema_state_dict`` / ``ema_state_dict``. Then the prefixes wrappers
put on every key, ``module.`` (DataParallel / DDP / AveragedModel), ``_orig_mod.``
(torch.compile) and ``model.`` (LightningModule attribute), are removed, each only when *every*
key carries it. A bare ``AveragedModel(model).state_dict()`` (``module.*`` and its
``n_averaged`` counter) is the averaged weights, with or without ``ema=True``. Metadata saved
beside the weights in one dict (``{**model.state_dict(), "epoch": 3}``) is dropped with a
warning naming it, when no such value holds a tensor and every tensor is named like a module's
(``conv1.weight``); anything else that is not a tensor is an error.
"""
from __future__ import annotations

import _compat_pickle
import argparse
import contextlib
import errno
import inspect
import json
import math
import mmap as _mmap
import os
import pickle
import pickletools
import re
import shlex
import stat
import struct
import tarfile
import warnings
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from jaxport._args import shell_word
from jaxport._errors import CheckpointError
from jaxport._io import key_separator

# Keys under which training scripts store the weights, in the order they are looked up.
STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model")
EMA_KEYS = ("model_ema", "ema", "state_dict_ema", "model_ema_state_dict", "ema_state_dict")
# Prefixes wrappers add to every key; each is stripped only when all keys carry it.
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.")
_MIN_TORCH = (2, 6)  # CVE-2025-32434: weights_only=True could be bypassed to run code
_SAFE_TORCH = (2, 10)  # further weights-only unpickler bypasses fixed
_TRUSTED_HINT = (
    "load it with trusted=True (CLI --trusted) only if you trust its source, since a full "
    "unpickle can run arbitrary code"
)


def _torch_version() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if match is None:  # an unparseable version is treated as the oldest, i.e. refused
        return (0, 0)
    return int(match.group(1)), int(match.group(2))


def weights_only_is_safe() -> tuple[bool, str]:
    """Whether the installed torch's weights-only unpickler has the known bypasses fixed.

    torch < 2.6 could be made to run code even with ``weights_only=True`` (CVE-2025-32434);
    further bypasses were fixed in 2.10. `load_state_dict` refuses untrusted pickle checkpoints
    on torch < 2.6 and warns on 2.6 <= torch < 2.10. safetensors files are unaffected.

    Returns:
      ``(safe, message)``: `safe` is True only on torch >= 2.10; `message` is one line naming
      the installed version and, when not safe, what to do.
    """
    version = str(torch.__version__)
    major_minor = _torch_version()
    if major_minor >= _SAFE_TORCH:
        return True, (
            f"torch {version}: weights-only loading includes the fixes for all known "
            "unpickler bypasses (2.6, 2.10)"
        )
    if major_minor >= _MIN_TORCH:
        return False, (
            f"torch {version} has known bypasses of its weights-only unpickler that were fixed "
            "in torch 2.10; untrusted checkpoints are loaded with a warning; upgrade to "
            "torch>=2.10 or use .safetensors files"
        )
    return False, (
        f"torch {version} is older than 2.6: its weights-only unpickler can be bypassed to run "
        "code from the file (CVE-2025-32434), so untrusted pickle checkpoints are refused; "
        "upgrade to torch>=2.10 or use .safetensors files"
    )


def load_state_dict(
    path: str | os.PathLike,
    *,
    trusted: bool = False,
    ema: bool = False,
    mmap: bool = False,
    prefix: str | None = None,
    check_crc: bool = False,
) -> dict[str, torch.Tensor]:
    """Load the weights of a checkpoint file as ``{name: CPU tensor}``, without running its code.

    Args:
      path: a `torch.save` file (zip or legacy format, any extension) or a ``.safetensors`` file.
      trusted: allow a full unpickle (``weights_only=False``), e.g. for a pickled ``nn.Module``
        or a TorchScript archive, whose ``state_dict()`` is then taken (torch.jit's deprecation
        warning is not passed on). It can run arbitrary code from the file.
      ema: take the EMA copy of the weights (``model_ema``, ``ema``, ``state_dict_ema``,
        ``model_ema_state_dict`` or ``ema_state_dict``, or the file itself when it is a bare
        ``AveragedModel`` state dict); an error if the file has none. Without it an EMA copy
        stored beside the model is never chosen.
      mmap: memory-map zip-format files instead of reading them (about 2x faster load+convert,
        see the benchmark). The tensors then share pages with the file: do not overwrite or
        truncate the file in place while they are alive (the process dies with SIGBUS), e.g.
        re-saving to the same path. Ignored for other formats.
      check_crc: for a zip-format file, first check every record against the CRC-32 the archive
        stores for it, so that a checkpoint damaged inside a tensor's data (a bad disk, network
        or copy) is refused instead of ported; torch.load checks none. It reads the whole file
        once more (~30 ms per 100 MB here: about half of ResNet-50's load + convert, which is why
        it is not the default here; the CLI turns it on). Legacy and safetensors files carry
        no checksum.
      prefix: keep only the keys under this prefix, with it removed, for a ResNet stored inside
        a bigger model: ``"encoder_q."`` selects MoCo's query encoder, ``"backbone.body."``
        torchvision Faster R-CNN's ResNet (the trailing dot may be left out). It applies after
        the wrapper prefixes are removed (``module.encoder_q.`` works too), and they are
        removed again from what it selects; an ``AveragedModel`` under it (``model_ema.``
        holding ``module.*`` and ``n_averaged``) gives its averaged weights.

    Returns:
      A plain dict, keys in file order (safetensors: data order), wrapper prefixes removed,
      tensors on CPU with their stored dtypes (bf16/fp16 kept). With `prefix`, a dict that also
      remembers it, so that `detect_arch`'s hint about a ResNet nested deeper names the whole
      prefix (`backbone.body.`, not `body.`); it pickles as an OrderedDict.

    Warns:
      UserWarning: naming the metadata entries (``epoch``, ``arch``, a 0-d ``best_acc1`` tensor,
        ...) saved beside the weights in the same dict, which are left out.

    Raises:
      CheckpointError: the path is missing, a directory, a pipe, a file of a torch.distributed.checkpoint
        directory (a shard or its .metadata), empty, truncated, corrupt or not a
        checkpoint (e.g. a tar or zip archive holding one: extract it); its pickle needs
        globals outside the weights-only set, holds numpy values other than bool, integer, float
        and complex scalars and arrays, or uses pickle protocol 0/1 (nothing was run);
        it holds no recognisable state dict; no key is under `prefix`; or torch is too old
        for untrusted loading.

    Example:
      >>> sd = load_state_dict("resnet50.pth")  # doctest: +SKIP
      >>> sd["conv1.weight"].shape  # doctest: +SKIP
      torch.Size([64, 3, 7, 7])
    """
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"`path` is {type(path).__module__}.{type(path).__qualname__}; expected the path of a "
                              "checkpoint file (a str or pathlib.Path)")
    shown = os.fspath(path)
    if prefix is not None and (not isinstance(prefix, str) or not prefix.strip(".")):
        raise CheckpointError(f"`prefix` (={prefix!r}) must name a submodule, e.g. 'encoder_q.' or 'backbone.body.'")
    kind = sniff(shown)
    if kind == "safetensors":
        obj: Any = _load_safetensors(shown)
        # jaxport's `collection/path/leaf` keys, or a Flax tree a user flattened with another
        # separator (`params.conv1.kernel`): a port, not a state dict.
        sep = key_separator(list(obj), {}) if obj else None
        if sep is not None:
            what = ("a jaxport variables file (written by `jaxport port` or `jaxport train`)" if sep == "/" else
                    f"a file of Flax variables (keys such as {next(iter(obj))!r})")
            raise CheckpointError(
                f"'{shown}' is already {what}, not a torch checkpoint: read it with jaxport.load_variables, or "
                f"turn it back into a torch state_dict with `jaxport export {shell_word(shown)} --out model.pt`")
    else:
        obj = _load_torch(shown, kind, trusted=trusted, mmap=mmap and kind == "zip", check_crc=check_crc)
    try:
        return _selected(_weights(obj, shown, ema=ema, prefix=prefix, where=""), prefix)
    except CheckpointError as first:
        # A prefix may name nested dicts instead of a key prefix: DINO saves
        # `{"teacher": {"backbone.conv1.weight": ...}, "student": ...}` (`--prefix teacher.backbone.`).
        nested = _descend(obj, prefix) if prefix is not None else None
        if nested is None:
            raise
        where, inner, rest = nested
        try:
            return _selected(_weights(inner, shown, ema=ema, prefix=rest, where=where,
                                      above=prefix.strip(".")[: -len(rest)] if rest else prefix.strip(".") + "."),
                             prefix)
        except _NoEmaError:
            if isinstance(first, _NoEmaError):  # no EMA copy anywhere: that first error says so
                raise first from None
            # `{"model": sd, "model_ema": ...}` with --prefix model --ema: the EMA copy has no
            # `model.` keys, and checkpoint['model'] has no EMA copy. This said the file had no
            # EMA weights at all.
            raise CheckpointError(
                f"checkpoint '{shown}': `prefix` (={prefix!r}, CLI --prefix) leads to {where}, which holds no EMA "
                "weights of its own, and the checkpoint's EMA weights have no keys under it: the two select different "
                f"copies here; pass --ema alone for the EMA weights, or --prefix {shlex.quote(prefix)} alone for "
                f"{where}") from None


class _Selected(dict):
    """The keys `load_state_dict(..., prefix=...)` selected, remembering that prefix (`.prefix`, with
    its trailing dot): a hint about a ResNet nested deeper (a Faster R-CNN's `--prefix backbone`
    leads to `body.*` and `fpn.*`) must name the whole prefix from the checkpoint's top,
    `backbone.body.`; the rest of it alone, `body.`, is not found there."""

    def __init__(self, sd: Mapping, prefix: str, beside: Mapping[str, int] | None = None, head: str = ""):
        super().__init__(sd)
        # `head`: wrapper prefixes removed inside the selection (`model_ema.` + `module.` of an
        # AveragedModel), which a prefix naming a deeper module must go on to include.
        self.head = head
        self.prefix = prefix + head
        # The top-level names of the keys left out (`classifier`, `aux_classifier`, ...), each with
        # the most dimensions among its tensors (a conv head's 4, a Linear's 2): they may say what
        # model the selected weights were part of.
        self.beside = dict(beside or {})

    def __reduce__(self):
        # Pickled as an OrderedDict, as model.state_dict() is: a torch.save of the selection must
        # load with weights_only=True, which refuses any class of ours.
        return OrderedDict, (), None, None, iter(self.items())


def _selected(sd: dict[str, torch.Tensor], prefix: str | None) -> dict[str, torch.Tensor]:
    if prefix is None:
        return sd
    return _Selected(sd, prefix if prefix.endswith(".") else prefix + ".", getattr(sd, "beside", None),
                     getattr(sd, "head", ""))


def applied_prefix(state_dict: Mapping) -> str:
    """The `prefix` `load_state_dict` selected `state_dict` with ('' for none, or a dict of the
    caller's): hints about ResNets nested inside it start with it."""
    return state_dict.prefix if isinstance(state_dict, _Selected) else ""


def _weights(obj: Any, shown: str, *, ema: bool, prefix: str | None, where: str,
             above: str = "") -> dict[str, torch.Tensor]:
    found, sd = _select_state_dict(obj, shown, ema=ema, prefix=prefix, above=above)
    where = f"{where}{found[len('checkpoint'):]}" if where and found.startswith("checkpoint[") else where or found
    sd = _check_tensors(sd, shown, where)
    stripped = _strip_wrapper_prefixes(sd)
    return stripped if prefix is None else _select_prefix(sd, stripped, prefix, shown)


def _descend(obj: Any, prefix: str) -> tuple[str, Any, str | None] | None:
    """(where, the dict that `prefix`'s leading names lead to, the rest of `prefix`), following
    nested dicts (or modules) from the top level or from a training checkpoint's weights key
    (`{"model": {"teacher": ...}}`), or None when its first name leads to none."""
    starts = [("checkpoint", obj)] + [(f"checkpoint[{k!r}]", obj[k]) for k in STATE_DICT_KEYS + EMA_KEYS
                                      if isinstance(obj, Mapping) and isinstance(obj.get(k), Mapping)]
    for where, node in starts:
        found = _descend_from(node, prefix, where)
        if found is not None:
            return found
    return None


def _descend_from(node: Any, prefix: str, where: str) -> tuple[str, Any, str | None] | None:
    parts, taken = prefix.strip(".").split("."), 0
    while taken < len(parts) and isinstance(node, Mapping) and isinstance(node.get(parts[taken]), (Mapping, torch.nn.Module)):
        node = _as_state_dict(node[parts[taken]])
        where += f"[{parts[taken]!r}]"
        taken += 1
    if not taken:
        return None
    return where, node, ".".join(parts[taken:]) or None


def _select_prefix(raw: dict[str, torch.Tensor], stripped: dict[str, torch.Tensor], prefix: str,
                   shown: str) -> dict[str, torch.Tensor]:
    prefix = prefix if prefix.endswith(".") else prefix + "."
    for sd in (stripped, raw):  # `encoder_q.` after `module.` is removed, or `module.encoder_q.` as written
        selected = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and len(k) > len(prefix)}
        if selected:  # an `AveragedModel` submodule (`model_ema.module.*`, `model_ema.n_averaged`): its weights
            beside: dict[str, int] = {}
            for k, v in sd.items():
                if not k.startswith(prefix):
                    name = k.split(".", 1)[0]
                    beside[name] = max(beside.get(name, 0), getattr(v, "ndim", 0))
            inner = dict(_without_n_averaged(selected))
            kept = _strip_wrapper_prefixes(inner)
            first, stripped = next(iter(inner), ""), next(iter(kept), "")
            return _Selected(kept, prefix, beside, head=first[:len(first) - len(stripped)])
    raise CheckpointError(f"checkpoint '{shown}' has no keys under the prefix {prefix!r} (`prefix`, CLI --prefix); "
                          f"its keys are {describe_keys(stripped)}")


def describe_keys(keys, limit: int = 6) -> str:
    """The keys grouped by their first component, biggest groups first: `encoder_q.* (320 keys),
    queue` -- a summary that shows where the weights are in an unfamiliar checkpoint."""
    groups: dict[str, int] = {}
    for k in keys:
        group = k.split(".", 1)[0] + (".*" if "." in k else "")
        groups[group] = groups.get(group, 0) + 1
    if not groups:
        return "no keys"
    ranked = sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = [f"{g} ({n} key{'s' if n > 1 else ''})" if g.endswith("*") else g for g, n in ranked[:limit]]
    return ", ".join(shown) + (f", ... ({len(ranked) - limit} more groups)" if len(ranked) > limit else "")


# --- format detection ----------------------------------------------------------------------

_NOT_CHECKPOINT_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (Keras/TensorFlow weights?)"),
    (b"PK\x05\x06", "an empty zip archive"),
    (b"\x1f\x8b", "a gzip archive (extract it first)"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"version https://git-lfs", "a Git LFS pointer, not the weights (run `git lfs pull`)"),
)


def sniff(shown: str) -> str:
    """The kind of checkpoint at `shown` ("zip", "pickle", "safetensors", "tar", ...), read from its
    first bytes; a CheckpointError naming the path for anything that is not one (missing, a
    directory, a pipe, empty, another format). The CLI calls it to check a path before any work."""
    try:
        os.stat(shown)
    except FileNotFoundError:
        if os.path.islink(shown):
            raise CheckpointError(f"checkpoint '{shown}' is a symbolic link to {os.readlink(shown)!r}, which does "
                                  "not exist; check the link") from None
        raise CheckpointError(f"checkpoint '{shown}' does not exist; check the path") from None
    except OSError as e:  # os.path.exists said "does not exist" for each of these
        why = ("a symbolic link loop" if e.errno == errno.ELOOP
               else "permission denied on a directory of its path" if isinstance(e, PermissionError)
               else e.strerror or type(e).__name__)
        raise CheckpointError(f"checkpoint '{shown}' cannot be reached: {why}") from None
    if os.path.isdir(shown):
        listing = os.listdir(shown)
        if _is_dcp_directory(listing):
            raise CheckpointError(
                f"checkpoint '{shown}' is a torch.distributed.checkpoint (DCP) directory of shards, not one "
                f"checkpoint file; {_DCP_FIX.format(it='it', directory=shown)}"
            )
        inside = sorted(
            name for name in listing
            if name.endswith((".pt", ".pth", ".bin", ".ckpt", ".safetensors"))
        )
        found = f" (it contains {', '.join(inside[:5])})" if inside else ""
        raise CheckpointError(
            f"checkpoint '{shown}' is a directory{found}; pass the path of a checkpoint file"
        )
    _refuse_dcp_file(shown)
    if stat.S_ISFIFO(os.stat(shown).st_mode):  # `<(zcat model.pt.gz)`, `cat model.pt | ... /dev/stdin`
        raise CheckpointError(
            f"checkpoint '{shown}' is a pipe, not a file: a checkpoint is read by seeking in it (a zip archive, "
            "a safetensors header), which a pipe cannot do; write it to a file first (e.g. zcat model.pt.gz > "
            "model.pt) and pass that file"
        )
    try:
        with open(shown, "rb") as f:
            head = f.read(512)
    except OSError as e:
        raise CheckpointError(f"checkpoint '{shown}' cannot be read: {e.strerror}") from e
    if not head:
        raise CheckpointError(
            f"checkpoint '{shown}' is empty (0 bytes); re-download or re-save it"
        )
    if head.startswith(b"PK\x03\x04"):  # the test torch.load itself uses
        return _sniff_zip(shown)
    if len(head) >= 2 and head[0] == pickle.PROTO[0] and 2 <= head[1] <= pickle.HIGHEST_PROTOCOL:
        if _starts_with_torch_magic(head) is False:  # pickle.dump's: torch.load fails on it, trusted or not
            raise CheckpointError(_old_pickle_message(shown, head[1], torch_magic=False))
        return "pickle"  # (cut short inside the magic number: torch.load's error says truncated)
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    if head[257:262] == b"ustar":
        return _sniff_tar(shown)
    old_protocol = _old_pickle(head)
    if old_protocol is not None:
        torch_magic = _starts_with_torch_magic(head) is True
        if torch_magic and old_protocol == 1:
            return "pickle1"  # a full unpickle (trusted) reads it
        raise CheckpointError(_old_pickle_message(shown, old_protocol, torch_magic=torch_magic))
    raise CheckpointError(
        f"'{shown}' is not a PyTorch or safetensors checkpoint: it looks like "
        f"{_describe(head)}; expected a torch.save file (.pt/.pth/.bin) or a .safetensors file"
    )


_DCP_FIX = ("gather {it} into one with torch.distributed.checkpoint.format_utils.dcp_to_torch_save({directory!r}, "
            "'model.pt') and pass that file")


def _utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode's surrogates for bytes that are not UTF-8
        return False
    return True


def _is_dcp_directory(listing: list[str]) -> bool:
    return ".metadata" in listing and any(name.endswith(".distcp") for name in listing)


def _refuse_dcp_file(shown: str) -> None:
    """A file of a DCP directory (a `__0_0.distcp` shard, or its `.metadata`) is no checkpoint by
    itself: a shard is a series of torch.save zips, which torch.load read as a corrupt archive
    ("re-download or re-save it"). The directory is what converts to one file."""
    directory, name = os.path.split(os.path.abspath(shown))
    try:
        listing = os.listdir(directory)
    except OSError:
        listing = []
    if not (name.endswith(".distcp") or (name == ".metadata" and _is_dcp_directory(listing))):
        return
    # The directory as the user wrote it ('.' when they named a shard in the current one).
    shown_dir = os.path.dirname(shown) or "."
    what = "a shard" if name.endswith(".distcp") else "the metadata file"
    missing = "" if ".metadata" in listing else (
        " (its .metadata file, which the conversion needs, is not beside it: use the whole directory as saved)")
    raise CheckpointError(
        f"checkpoint '{shown}' is {what} of a torch.distributed.checkpoint (DCP) directory, '{shown_dir}', not a "
        f"checkpoint file by itself{missing}; {_DCP_FIX.format(it='the directory', directory=shown_dir)}"
    )


# The members of a torch.save file written before torch 0.4 (a tar archive).
_LEGACY_TAR_MEMBERS = {"sys_info", "pickle", "storages", "tensors"}


def _sniff_tar(shown: str) -> str:
    """"tar" for torch's pre-0.4 tar checkpoint; any other tar archive is named for what it holds."""
    try:
        with tarfile.open(shown, mode="r:") as tar:  # lists the members; nothing is extracted
            names = tar.getnames()
    except (tarfile.TarError, OSError) as e:
        raise CheckpointError(f"'{shown}' is a tar archive that cannot be read ({e}); it is not a checkpoint: "
                              "re-download it, or extract the checkpoint from it") from e
    if _LEGACY_TAR_MEMBERS <= set(names):
        return "tar"
    held = _short_list(names, 5) if names else "no files"
    raise CheckpointError(f"'{shown}' is a tar archive holding {held}, not a checkpoint; extract the checkpoint "
                          f"from it (tar xf '{shown}') and pass that file")


def _sniff_zip(shown: str) -> str:
    """"zip" for a torch.save zip (`<name>/data.pkl` beside its `data/` records) or one that cannot
    be listed (truncated: torch.load's error then says so); any other zip archive, e.g. one
    holding `model/r18.pth`, is named for what it holds."""
    try:
        with zipfile.ZipFile(shown) as z:  # lists the members; nothing is extracted
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, EOFError):
        return "zip"
    if not names or any(n == "data.pkl" or (n.count("/") == 1 and n.endswith("/data.pkl")) for n in names):
        return "zip"
    if any(n.count("/") == 1 and n.endswith("/archive_format") for n in names):  # torch's PT2 archive layout
        raise CheckpointError(f"'{shown}' is a torch.export program archive (torch.export.save, .pt2), not a state "
                              f"dict; save its weights with torch.save(torch.export.load({shown!r}).module()."
                              "state_dict(), 'model.pt') and pass that file")
    raise CheckpointError(f"'{shown}' is a zip archive holding {_short_list(names, 5)}, not a checkpoint; extract "
                          f"the checkpoint from it (unzip '{shown}') and pass that file")


# What protocol 0 and 1 pickles start with (protocol 2+ start with PROTO): a MARK, an empty
# dict/list/tuple, a GLOBAL or an integer (torch.save's legacy magic number).
_OLD_PICKLE_STARTS = {"MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "GLOBAL", "LONG", "INT"}
# torch.save's legacy format writes this number as its first pickle (torch/serialization.py).
_TORCH_MAGIC = 0x1950A86A20F9469CFC6C


def _old_pickle(head: bytes) -> int | None:
    """0 or 1 when `head` reads as a protocol 0/1 pickle stream (its highest opcode protocol)."""
    ops, start = [], 0
    with contextlib.suppress(ValueError):  # the stream runs past the 512 bytes read, or is no pickle
        while start < len(head):  # torch.save's legacy format is several pickles in a row
            for opcode, _arg, pos in pickletools.genops(head[start:]):
                ops.append(opcode)
            start += pos + 1
    if len(ops) < 3 or ops[0].name not in _OLD_PICKLE_STARTS or any(op.proto > 1 for op in ops):
        return None
    return max(op.proto for op in ops)


def _starts_with_torch_magic(head: bytes) -> bool | None:
    """Whether the first value of the (legacy, non-zip) pickle stream is torch.save's magic number;
    read with pickletools, so nothing is unpickled. None when the bytes end inside that value (a
    file cut short: it is not known, and was called a pickle.dump file)."""
    try:
        for opcode, arg, _pos in pickletools.genops(head):
            if opcode.name in ("PROTO", "FRAME"):
                continue
            return opcode.name in ("LONG", "LONG1", "INT") and arg == _TORCH_MAGIC
    except ValueError:
        return None
    return None


def _old_pickle_message(shown: str, protocol: int, *, torch_magic: bool) -> str:
    if not torch_magic:
        return (f"'{shown}' is a pickle file (protocol {protocol}) but not a torch.save checkpoint (no torch magic "
                "number; e.g. written by pickle.dump), which torch.load cannot read; nothing from the file was run. "
                "Save the weights with torch.save(model.state_dict(), path)")
    if protocol == 0:
        return (f"checkpoint '{shown}' was written by torch.save(..., pickle_protocol=0), which torch.load cannot read "
                "back, trusted or not (protocol 0 turns torch's storage references into strings); nothing from the "
                "file was run. Save the weights again from the model, with torch.save's default pickle protocol")
    return (f"checkpoint '{shown}' was written by torch.save(..., pickle_protocol=1), whose opcodes the weights-only "
            "loader does not read (it reads protocol 2 and up); nothing from the file was run. Re-save it with "
            f"torch.save's default pickle protocol, or {_TRUSTED_HINT}")


def _zip_pickle_protocol(shown: str) -> int | None:
    """The pickle protocol of a torch.save zip's `data.pkl` (0 or 1 for old protocols), if readable."""
    with contextlib.suppress(Exception):  # best effort, only to word an error
        with zipfile.ZipFile(shown) as z:
            name = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            with z.open(name) as f:
                head = f.read(512)
        if head[:1] == pickle.PROTO:
            return head[1]
        return _old_pickle(head)
    return None


def _describe(head: bytes) -> str:
    for magic, what in _NOT_CHECKPOINT_MAGIC:
        if head.startswith(magic):
            return what
    if head.lstrip().lower().startswith((b"<!doctype html", b"<html")):
        return "an HTML page (a failed download?)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"unknown binary data starting with {head[:8]!r}"
    if all(c.isprintable() or c.isspace() for c in text):
        return f"a text file starting with {text[:24]!r}"
    return f"unknown binary data starting with {head[:8]!r}"


# --- numpy values in training metadata -------------------------------------------------------
#
# numpy pickles `np.float64(76.1)` as `scalar(dtype("f8", False, True), b"...")`, the dtype's byte
# order set by a BUILD of `(3, "<", None, None, None, -1, -1, 0)`, and an array as
# `_reconstruct(ndarray, (0,), b"b")` followed by a BUILD of `(1, shape, dtype, fortran, raw bytes)`.
# Allow-listing numpy's own functions and classes (what torch's docs suggest) would hand that BUILD
# state to numpy's `dtype.__setstate__`, which takes item flags (`NPY_ITEM_REFCOUNT`: "the items are
# PyObject pointers"), fields and sizes from the file, and with `dtype("f8", False, False)` applies
# them to numpy's shared float64 dtype: raw file bytes would then be used as object pointers. The
# stand-ins below take only a dtype's kind, size and byte order from the file and make the dtype
# themselves; the only numpy code they run is making numeric dtypes and copying bytes into arrays.

def _refuse_numpy(what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"numpy {what}")  # worded by `_refusal_message`


class _NumpyDType:
    """Stands in for `numpy.dtype` while unpickling: `dtype("f8", align, copy)`, then the BUILD
    state's byte order. `.dtype` is the numpy dtype, made here from its kind, size and byte order."""

    def __init__(self, spec: Any, align: Any = False, copy: Any = True):
        del align, copy  # the dtype is always made anew, never shared with or aligned like numpy's
        if not (isinstance(spec, str) and re.fullmatch(r"[biufc]\d{1,2}", spec)):
            holds_objects = isinstance(spec, str) and spec.startswith("O")
            objects = " (its items are Python objects, whose unpickling can run code)" if holds_objects else ""
            raise _refuse_numpy(f"dtype {spec!r}{objects}")
        try:
            self.dtype = np.dtype(spec)
        except TypeError as e:  # a size numpy has no type for, e.g. "f3"
            raise _refuse_numpy(f"dtype {spec!r} does not exist") from e
        self._spec = spec

    def __setstate__(self, state: Any) -> None:
        # What numpy writes for a number type: (3, byteorder, subarray, names, fields, elsize,
        # alignment, flags), plus metadata as a 9th item in version 4. elsize, alignment and flags
        # describe the dtype the spec already fixes, so they are not read.
        ok = (type(state) is tuple and len(state) in (8, 9) and type(state[0]) is int and state[0] == len(state) - 5
              and isinstance(state[1], str) and state[1] in ("<", ">", "|", "=")
              and all(item is None for item in state[2:5] + state[8:]))
        if not ok:
            raise _refuse_numpy(f"dtype {self._spec!r} with a pickled state numpy does not write for number types "
                                f"(subarray, fields or metadata): {_short_repr(state)}")
        self.dtype = np.dtype(self._spec).newbyteorder(state[1]) if state[1] in "<>" else np.dtype(self._spec)

    def __repr__(self) -> str:
        return repr(self.dtype)


def _numpy_dtype(value: Any) -> np.dtype:
    # `type(...) is` and a real numpy dtype inside: the allowed argparse.Namespace can be turned into
    # a stand-in by a pickle that sets its `__class__`, carrying any `dtype` attribute it likes.
    if type(value) is not _NumpyDType or not isinstance(vars(value).get("dtype"), np.dtype):
        raise _refuse_numpy(f"value whose dtype is {_short_repr(value)}, not a pickled numpy dtype")
    return value.dtype


def _numpy_scalar(dtype: Any, data: Any) -> Any:
    """Stands in for `numpy.core.multiarray.scalar` (`numpy._core` in numpy 2)."""
    dtype = _numpy_dtype(dtype)
    if not (isinstance(data, bytes) and len(data) == dtype.itemsize):
        raise _refuse_numpy(f"{dtype} scalar pickled as {_short_repr(data)}, not as its {dtype.itemsize} bytes")
    return np.frombuffer(data, dtype)[0]


class _NumpyArray(np.ndarray):
    """Stands in for `numpy.ndarray` while unpickling; a BUILD fills it from its checked state."""

    def __new__(cls, *args, **kwargs):  # what a pickle could call it with; numpy itself never does
        raise _refuse_numpy("ndarray built by calling numpy.ndarray, which numpy's pickles do not do")

    def __setstate__(self, state: Any) -> None:
        if getattr(self, "_filled", False):
            # A second BUILD would free the data that a tensor made from this array in between
            # (torch's allowed `_rebuild_device_tensor_from_numpy`) still points to.
            raise _refuse_numpy("array whose pickled state is set twice, which numpy's pickles do not do")
        if not (type(state) is tuple and len(state) == 5 and type(state[0]) is int and state[0] == 1):
            raise _refuse_numpy(f"array with a pickled state numpy does not write: {_short_repr(state)}")
        _, shape, dtype, fortran, data = state
        dtype = _numpy_dtype(dtype)
        if not (type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape)):
            raise _refuse_numpy(f"{dtype} array with the shape {_short_repr(shape)}")
        size = math.prod(shape) * dtype.itemsize
        if not (isinstance(data, bytes) and len(data) == size and isinstance(fortran, bool)):
            raise _refuse_numpy(f"{dtype} array of shape {shape} pickled as {_short_repr(data)}, not as its "
                                f"{size} bytes")
        super().__setstate__((1, shape, dtype, fortran, data))
        self._filled = True


# Warnings and errors name a value's type: they say what the file holds, not the stand-in.
_NumpyDType.__name__, _NumpyArray.__name__ = "dtype", "ndarray"


def _numpy_reconstruct(cls: Any, shape: Any, typecode: Any) -> _NumpyArray:
    """Stands in for `numpy.core.multiarray._reconstruct` (`numpy._core` in numpy 2): the empty
    array that the BUILD after it fills."""
    if not (cls is _NumpyArray and type(shape) is tuple and shape == (0,) and type(typecode) is bytes
            and typecode == b"b"):
        raise _refuse_numpy(f"array rebuilt with arguments numpy does not write: {_short_repr((cls, shape, typecode))}")
    return np.ndarray.__new__(_NumpyArray, (0,), np.int8)


def _empty_bytes(*args: Any) -> bytes:
    """Stands in for `bytes`, which pickle protocol 2 calls with no arguments for ``b""`` (the data of
    an empty numpy array); other bytes are pickled as `_codecs.encode(text, "latin1")`."""
    if args:
        raise pickle.UnpicklingError(f"bytes{_short_repr(args)} is not how pickle writes bytes")
    return b""


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _named_globals_supported() -> bool:
    """Whether `torch.serialization.safe_globals` takes `(object, "module.name")` pairs, which the
    stand-ins need to answer to numpy's names (a torch without them keeps refusing numpy values)."""
    parameter = inspect.signature(torch.serialization.safe_globals).parameters.get("safe_globals")
    return parameter is not None and "tuple" in str(parameter.annotation).lower()


# The names numpy 1.x (`numpy.core`) and 2.x (`numpy._core`) pickles use, each with its stand-in.
# Not allowed: the `numpy.dtypes.*DType` classes (pickled only for a dtype class itself, not for a
# value) and every other numpy name.
_NUMPY_GLOBALS = [
    (_empty_bytes, "builtins.bytes"),
    (_NumpyDType, "numpy.dtype"),
    (_NumpyArray, "numpy.ndarray"),
    *[(_numpy_scalar, f"numpy.{core}.multiarray.scalar") for core in ("core", "_core")],
    *[(_numpy_reconstruct, f"numpy.{core}.multiarray._reconstruct") for core in ("core", "_core")],
]
# Globals allowed beyond torch's weights-only set, only for the duration of one load.
_EXTRA_SAFE_GLOBALS = [argparse.Namespace, *(_NUMPY_GLOBALS if _named_globals_supported() else [])]


# --- torch.save files -----------------------------------------------------------------------

def _zip_records(shown: str) -> list[zipfile.ZipInfo] | None:
    """The records of a zip file, from its central directory; None if it cannot be listed (then
    torch.load's own error says what is wrong)."""
    try:
        with zipfile.ZipFile(shown) as z:
            return z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None


def _bad_records(shown: str, infos: list[zipfile.ZipInfo]) -> list[str]:
    """The records whose data does not match the CRC-32 the zip stores for them.

    torch.load checks no checksum: a checkpoint damaged inside a tensor's data (a bad disk or
    copy) loaded, ported and cross-checked as if it were the one saved. Stored records are summed
    from a memory map of the file (no copy), compressed ones through `zipfile`, which checks as
    it inflates. (Run in a thread beside torch.load it was slower: both fault in the file's pages.)
    A file that cannot be read through is left to torch.load's own error.
    """
    bad: list[str] = []
    unreadable = (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError)
    with contextlib.suppress(*unreadable), open(shown, "rb") as f, zipfile.ZipFile(f) as z, \
            _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ) as mm, memoryview(mm) as view:
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                try:
                    with z.open(info) as member:
                        while member.read(1 << 24):
                            pass
                except zipfile.BadZipFile:
                    bad.append(info.filename)
                continue
            # The local header: 30 bytes, then the name and the extra field (torch's alignment
            # padding), then the data.
            name_len, extra_len = struct.unpack_from("<HH", mm, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            with view[start:start + info.compress_size] as data:
                if len(data) != info.compress_size or zlib.crc32(data) != info.CRC:
                    bad.append(info.filename)
    return bad


def _load_torch(shown: str, kind: str, *, trusted: bool, mmap: bool, check_crc: bool) -> Any:
    infos = _zip_records(shown) if kind == "zip" else None
    if infos is not None:
        # A zip re-packed with compression (`zip -r` of an extracted checkpoint) loads, but not
        # memory-mapped (torch: "Trying to resize storage that is not resizable").
        mmap = mmap and all(info.compress_type == zipfile.ZIP_STORED for info in infos)
        bad = _bad_records(shown, infos) if check_crc else []
        if bad:  # before anything is unpickled from it
            raise CheckpointError(
                f"checkpoint '{shown}' is corrupt: {len(bad)} of its {len(infos)} zip records "
                f"({_short_list(bad, 3)}) do not match the checksums the archive stores for them, so its tensors "
                "are not the ones saved; re-download or re-save it")
    return _unpickle(shown, kind, trusted=trusted, mmap=mmap)


def _unpickle(shown: str, kind: str, *, trusted: bool, mmap: bool) -> Any:
    if kind == "pickle1" and not trusted:  # torch's weights-only unpickler would fail on its first opcode
        raise CheckpointError(_old_pickle_message(shown, 1, torch_magic=True))
    if not trusted:
        safe, message = weights_only_is_safe()
        if not safe and _torch_version() < _MIN_TORCH:
            raise CheckpointError(f"refusing to load checkpoint '{shown}': {message}")
        if not safe:
            warnings.warn(f"loading checkpoint '{shown}': {message}", UserWarning, stacklevel=3)
    try:
        with warnings.catch_warnings():
            # torch warns before refusing a TorchScript archive; the error below says it all.
            for noise in (".*TorchScript archive", "Detected pickle protocol"):
                warnings.filterwarnings("ignore", message=noise, category=UserWarning)
            if trusted:
                # A trusted TorchScript archive is read by torch.jit.load, which warns that it is
                # deprecated: only its state_dict is kept, so nothing of TorchScript is used later.
                for category in (FutureWarning, DeprecationWarning):
                    warnings.filterwarnings("ignore", message=r".*torch\.jit", category=category)
            with contextlib.ExitStack() as stack:
                source: Any = shown
                if shown.endswith(".safetensors"):
                    # torch.load hands any path named *.safetensors to safetensors, whatever it
                    # holds; the first bytes said torch.save, so give it the open file instead.
                    source, mmap = stack.enter_context(open(shown, "rb")), False
                elif mmap and not _utf8(shown):
                    # torch's C++ reader takes the path as UTF-8: a name of other bytes (a Latin-1
                    # directory) failed "UnicodeEncodeError", reported as a corrupt file. Read
                    # from an open file instead, which cannot be memory-mapped.
                    source, mmap = stack.enter_context(open(shown, "rb")), False
                if trusted:
                    obj = torch.load(source, map_location="cpu", weights_only=False, mmap=mmap)
                else:
                    with torch.serialization.safe_globals(_EXTRA_SAFE_GLOBALS):
                        obj = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except (AttributeError, ImportError) as e:
        if not trusted:
            raise CheckpointError(_corrupt_message(shown, kind, e)) from e
        # A full unpickle imports the classes the file names; one is not importable here.
        missing = re.search(r"Can't get attribute '([^']+)' on <module '([^']+)'", str(e))
        name = f"{missing.group(2)}.{missing.group(1)}" if missing else getattr(e, "name", None) or str(e)
        raise CheckpointError(
            f"checkpoint '{shown}' pickles an object whose class `{name}` cannot be imported here ({type(e).__name__}); "
            "a trusted load rebuilds the saved objects, so run it where that class is importable (its module on "
            "sys.path; a class defined in a script's __main__ needs that script), or re-save the weights alone "
            "with torch.save(model.state_dict(), path)") from e
    except pickle.UnpicklingError as e:
        if trusted:
            raise CheckpointError(_corrupt_message(shown, kind, e)) from e
        protocol = _zip_pickle_protocol(shown) if kind == "zip" else None
        raise CheckpointError(_refusal_message(shown, str(e), protocol)) from e
    except Exception as e:  # torch, zip and pickle raise many types for one broken file
        raise CheckpointError(_corrupt_message(shown, kind, e)) from e
    if isinstance(obj, torch.nn.Module):  # only reachable with trusted=True
        obj = obj.state_dict()
    return obj


def _refusal_message(shown: str, torch_message: str, protocol: int | None = None) -> str:
    inner = torch_message.split("WeightsUnpickler error:")[-1]
    inner = inner.split("Check the documentation of torch.load")[0]
    inner = " ".join(inner.split())
    found = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", torch_message)
    if found is None:
        found = re.search(r"unrecognized function (.+?)(?: which belongs to .*)?$", inner)
    if found is not None:
        global_name = _py3_name(found.group(1))
        what = f"imports `{global_name}`, which is outside the weights-only allowed set"
    elif inner.startswith("numpy "):  # from the numpy stand-ins
        what = (f"holds a {inner}, which is outside the weights-only allowed set (numpy's bool, integer, float and "
                "complex scalars and arrays)")
    elif protocol is not None and protocol < 2 and "Unsupported operand" in inner:
        if protocol == 0:
            return _old_pickle_message(shown, 0, torch_magic=True)
        what = ("uses pickle protocol 1 (torch.save(..., pickle_protocol=1)), whose opcodes the weights-only loader "
                "does not read (it reads protocol 2 and up)")
    elif (op := re.search(r"Unsupported operand (\d+)", inner)) is not None:
        opcode = pickletools.code2op.get(chr(int(op.group(1))))
        name = opcode.name if opcode else op.group(1)
        if opcode is not None and opcode.proto >= 3:
            # Protocol 3 differs from 2 only in how it pickles bytes, which numpy numbers and
            # b"..." metadata are: a state_dict alone loads at any protocol up to 3.
            cause = (f"pickle protocol {opcode.proto} or later, e.g. torch.save(..., pickle_protocol={opcode.proto})"
                     + (", which pickles bytes values (numpy numbers, b'...' metadata) with it"
                        if opcode.proto == 3 else ""))
            what = (f"uses pickle opcode {name} ({cause}), which the weights-only loader does not read (it reads "
                    "protocol 2, torch.save's default)")
        else:
            what = (f"uses pickle opcode {name} (the file may be corrupt), which the weights-only loader cannot "
                    "check")
    else:
        what = f"cannot be read in weights-only mode ({inner or 'unpickling failed'})"
    return (
        f"refusing to load checkpoint '{shown}': its pickle {what}; nothing from the file was "
        f"run. Re-save it as a plain state_dict or .safetensors, or {_TRUSTED_HINT}"
    )


def _py3_name(full: str) -> str:
    """``posix.system`` -> ``posix.system (os.system)``; ``eval`` -> ``builtins.eval``."""
    if "." not in full:
        return f"builtins.{full}"
    module, name = full.rsplit(".", 1)
    if module in ("posix", "nt"):
        return f"{full} (os.{name})"
    module3, name3 = _compat_pickle.NAME_MAPPING.get(
        (module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name)
    )
    py3 = f"{module3}.{name3}"
    return full if py3 == full else f"{full} ({py3})"


def _stray_members(shown: str) -> str:
    """` ([NAME, ...])`: the members of a zip archive outside the folder most of them are in (torch.save
    puts them all in one)."""
    try:
        with zipfile.ZipFile(shown) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return ""
    folders = [n.split("/", 1)[0] if "/" in n else None for n in names]
    main = max(set(folders) - {None}, key=folders.count, default=None)
    stray = [n for n, folder in zip(names, folders) if folder != main]
    return f" ({_short_list(stray, 3)})" if stray else ""


def _last_frame(error: BaseException) -> str | None:
    """The name of the function `error` was raised in."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return None if tb is None else tb.tb_frame.f_code.co_name


def _corrupt_message(shown: str, kind: str, error: BaseException) -> str:
    text = " ".join(str(error).split()) or "unexpected end of data"
    text = text.split(". This is an internal miniz error")[0]
    # torch's own persistent ids, unpickled as strings. torch 2.6 asserts it without a message.
    if "saved_id must be a tuple" in text or (isinstance(error, AssertionError) and
                                              _last_frame(error) == "persistent_load"):
        return _old_pickle_message(shown, 0, torch_magic=True)
    if kind == "zip":
        if "central directory" in text:
            problem = "the zip archive has no central directory"
        elif "TorchScript" in text:
            return (
                f"checkpoint '{shown}' is a TorchScript archive (torch.jit.save), not a state "
                "dict; save `torch.jit.load(path).state_dict()` with torch.save instead, or "
                f"{_TRUSTED_HINT}"
            )
        elif "not in a subdirectory" in text:
            return (
                f"'{shown}' is a torch.save zip archive with a member outside its folder"
                f"{_stray_members(shown)}, added after it was saved: torch refuses to read it; remove that "
                "member (zip -d) or save the checkpoint again"
            )
        elif "data.pkl" in text:
            return (
                f"'{shown}' is a zip archive but not a torch.save checkpoint (no data.pkl "
                "record); expected a torch.save file (.pt/.pth/.bin) or a .safetensors file"
            )
        else:
            problem = f"reading the zip archive failed ({type(error).__name__}: {text})"
    elif kind in ("pickle", "pickle1"):
        if "Invalid magic number" in text:
            return (
                f"'{shown}' is a pickle file but not a torch.save checkpoint (no torch magic "
                "number); save the weights with torch.save(model.state_dict(), path)"
            )
        problem = f"reading the pickle stream failed ({type(error).__name__}: {text})"
    elif "legacy .tar format" in text:
        return (
            f"checkpoint '{shown}' uses torch's pre-0.4 .tar format, which weights-only loading "
            f"cannot read; re-save it with a current torch, or {_TRUSTED_HINT}"
        )
    else:
        problem = f"reading it failed ({type(error).__name__}: {text})"
    return f"checkpoint '{shown}' is truncated or corrupt: {problem}; re-download or re-save it"


# --- safetensors ----------------------------------------------------------------------------

def _load_safetensors(shown: str) -> dict[str, torch.Tensor]:
    import safetensors
    import safetensors.torch

    def corrupt(problem: str) -> CheckpointError:
        return CheckpointError(
            f"safetensors checkpoint '{shown}' is truncated or corrupt: {problem}; "
            "re-download or re-save it"
        )

    size = os.path.getsize(shown)
    with open(shown, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8:
            raise corrupt(
                f"its header claims {header_len} bytes but only {size - 8} bytes follow the "
                "8-byte length"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise corrupt(f"its {header_len}-byte header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise corrupt(f"its header is a JSON {type(header).__name__}, expected an object")
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        what = f"is a JSON {type(meta).__name__}"
    else:
        bad_meta = [k for k, v in (meta or {}).items() if not isinstance(v, str)]
        what = bad_meta and f"maps {_short_list(bad_meta, 3)} to non-strings (e.g. {json.dumps(meta[bad_meta[0]])})"
    if what:
        # safetensors refuses the whole file for it, which read as "truncated or corrupt".
        raise CheckpointError(
            f"safetensors checkpoint '{shown}': its header's __metadata__ {what}, where the format allows only "
            "string values, so the safetensors library will not read it (the tensors themselves may be intact); "
            "re-save it with string metadata, e.g. safetensors.torch.save_file(tensors, path, "
            "metadata={k: str(v) for k, v in metadata.items()})")
    data_len = size - 8 - header_len
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            raise corrupt(f"header entry '{name}' has no [begin, end] data_offsets")
        if not 0 <= offsets[0] <= offsets[1] <= data_len:
            raise corrupt(
                f"tensor '{name}' claims bytes {offsets[0]}..{offsets[1]} but the data section "
                f"has {data_len} bytes"
            )
        spans.append((offsets[0], name))
    try:
        tensors = safetensors.torch.load_file(shown, device="cpu")
    except Exception as e:  # SafetensorError and others: wrong dtype names, shape mismatches
        raise corrupt(f"{type(e).__name__}: {' '.join(str(e).split())}") from e
    return {name: tensors[name] for _, name in sorted(spans, key=lambda span: span[0])}


# --- unwrapping -----------------------------------------------------------------------------

def _is_weights(value: Any) -> bool:
    return isinstance(value, (Mapping, torch.nn.Module))


class _NoEmaError(CheckpointError):
    """`ema=True` found no EMA copy where it looked."""


def _select_state_dict(obj: Any, shown: str, *, ema: bool, prefix: str | None = None,
                       above: str = "") -> tuple[str, Mapping]:
    """Returns (description of where the weights were found, the mapping itself).

    `prefix` is the one to apply next and `above` the part of it that led to `obj` (both
    only word a hint, which must give the whole prefix from the checkpoint's top).
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"checkpoint '{shown}' holds {_a(type(obj).__name__)} at the top level, expected a "
            f"dict: a state dict or a training checkpoint with one of the keys "
            f"{list(STATE_DICT_KEYS + EMA_KEYS)}; save model.state_dict() instead"
        )
    keys = list(obj)
    is_flat = bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())
    looked_for = EMA_KEYS if ema else STATE_DICT_KEYS
    found = [k for k in looked_for if k in obj and _is_weights(obj[k])]
    if len(found) > 1:
        # A dict of settings under another candidate key (`{"state_dict": ..., "model": {"arch": "resnet18"}}`,
        # `{"model_ema": ..., "ema": {"decay": 0.9999}}`) holds no weights: it does not compete.
        found = [k for k in found if _holds_tensors(obj[k])] or found
    if len(found) > 1:
        raise CheckpointError(
            f"checkpoint '{shown}' holds several candidate state dicts {found}; it is ambiguous "
            "which to use; re-save the one you want with torch.save(checkpoint[key], path)"
        )
    if found:
        key = found[0]
        value = obj[key]
        if isinstance(value, torch.nn.Module):
            value = value.state_dict()
        return f"checkpoint[{key!r}]", _without_n_averaged(value)
    shown_keys = _short_list(keys)
    if ema and _is_averaged_model(obj):
        # The file is `AveragedModel(model).state_dict()` itself: these are the averaged weights.
        return "the top-level AveragedModel state dict", _without_n_averaged(obj)
    averaged = [k for k in STATE_DICT_KEYS if k in obj and _is_averaged_model(_as_state_dict(obj[k]))]
    if ema and len(averaged) == 1:
        # `{"model": AveragedModel(model).state_dict(), ...}`: the only weights are the averaged ones.
        key = averaged[0]
        return f"the AveragedModel state dict checkpoint[{key!r}]", _without_n_averaged(_as_state_dict(obj[key]))
    if ema:
        what = (
            f"a plain state dict ({len(keys)} tensors)" if is_flat
            else f"top-level keys {shown_keys}"
        )
        raise _NoEmaError(
            f"ema=True but checkpoint '{shown}' has no EMA weights: found {what}, looked for "
            f"{list(EMA_KEYS)} or an AveragedModel state dict (with n_averaged); load it without ema (CLI: drop --ema)"
        )
    if is_flat or any(isinstance(v, torch.Tensor) for v in obj.values()):
        # A state dict at the top level (a bare AveragedModel's too); non-tensor values are
        # dealt with by _check_tensors.
        return "the top-level dict", _without_n_averaged(obj)
    hint = ""
    ema_found = [k for k in EMA_KEYS if k in obj and _is_weights(obj[k])]
    if ema_found:
        hint = (
            f"; it holds EMA weights under {ema_found[0]!r}: pass ema=True (CLI --ema) to use them"
        )
    else:
        holders = [k for k in keys if isinstance(k, str) and _is_weights(obj[k]) and _holds_tensors(obj[k])]
        # DINO's {"teacher": ..., "student": ...} with --prefix backbone.: the prefix goes on after
        # the holder (`teacher.backbone.`); `teacher.` alone would lead back to `backbone.`.
        rest = prefix.strip(".") + "." if prefix else ""
        leading = [k for k in holders if rest and _leads_to(obj[k], rest)]
        if holders:  # which one is the user's to say
            first = f"{above}{(leading or holders)[0]}.{rest if leading else ''}"
            hint = (f"; it holds tensors under {_short_list(holders, 4)}: select one with prefix={first!r} "
                    f"(CLI --prefix {first})")
    raise CheckpointError(
        f"checkpoint '{shown}' has no recognisable state dict: found top-level keys "
        f"{shown_keys}, looked for a dict of tensors or one of the keys {list(STATE_DICT_KEYS)}"
        f"{hint or '; save model.state_dict() with torch.save'}"
    )


def _leads_to(value: Any, prefix: str) -> bool:
    """Whether `prefix` (with its trailing dot) selects something in `value`: keys under it, as
    written or after the wrapper prefixes, or nested dicts its leading names lead to."""
    sd = _as_state_dict(value)
    if not isinstance(sd, Mapping):
        return False
    for inner in (sd, *(sd[k] for k in STATE_DICT_KEYS if isinstance(sd.get(k), Mapping))):
        keys = [k for k in inner if isinstance(k, str)]
        stripped = _strip_wrapper_prefixes(dict.fromkeys(keys)) if keys else {}
        if any(k.startswith(prefix) for k in (*keys, *stripped)) or _descend_from(inner, prefix, "") is not None:
            return True
    return False


def _as_state_dict(value: Any) -> Any:
    return value.state_dict() if isinstance(value, torch.nn.Module) else value


def _is_averaged_model(sd: Any) -> bool:
    """`torch.optim.swa_utils.AveragedModel(model).state_dict()`: the update counter `n_averaged`
    beside the averaged model's weights, all under `module.`."""
    return (isinstance(sd, Mapping) and isinstance(sd.get("n_averaged"), torch.Tensor) and len(sd) > 1
            and all(isinstance(k, str) and k.startswith("module.") for k in sd if k != "n_averaged"))


def _without_n_averaged(sd: Mapping) -> Mapping:
    return {k: v for k, v in sd.items() if k != "n_averaged"} if _is_averaged_model(sd) else sd


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _short_list(keys: list, limit: int = 12) -> str:
    shown = [str(k) for k in keys[:limit]]
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{shown}{more}"


def _check_tensors(sd: Mapping, shown: str, where: str) -> dict[str, torch.Tensor]:
    if not sd:
        raise CheckpointError(
            f"checkpoint '{shown}': {where} is empty; expected a state dict of tensors; re-save "
            "it with torch.save(model.state_dict(), path)"
        )
    memo: dict[int, bool] = {}
    extras = _ignorable_extras(sd, memo)
    if extras:
        listed = ", ".join(f"{k!r} ({'0-d tensor' if isinstance(sd[k], torch.Tensor) else type(sd[k]).__name__})"
                           for k in extras[:6])
        entries = "entry" if len(extras) == 1 else "entries"
        warnings.warn(f"checkpoint '{shown}': ignored {len(extras)} metadata {entries} of {where} beside its "
                      f"weights: {listed}{', ...' if len(extras) > 6 else ''}", UserWarning, stacklevel=3)
        sd = {k: v for k, v in sd.items() if k not in extras}
    out = {}
    # The entry that blocks: a non-str key, else a value holding tensors (not metadata), else the first.
    order = sorted(sd, key=lambda k: (isinstance(k, str), not _holds_tensors(sd[k], memo=memo)))
    for key in order:
        value = sd[key]
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            holding = " holding tensors" if _holds_tensors(value, memo=memo) else ""
            problem = (
                f"has a {type(key).__name__} key {key!r}" if not isinstance(key, str)
                else f"maps {key!r} to {_a(type(value).__name__)}{holding}, not a tensor"
            )
            nested = (f"; to port the weights under {key!r}, select them with prefix='{key}.' (CLI --prefix {key}.)"
                      if isinstance(key, str) and holding else "")
            raise CheckpointError(
                f"checkpoint '{shown}': {where} {problem}; a state dict maps parameter names "
                f"to tensors; re-save it with torch.save(model.state_dict(), path){nested}"
            )
        # Parameters (trusted loads) become plain tensors; map_location already put them on CPU.
        out[key] = value.detach() if value.requires_grad else value
    meta = [k for k, v in out.items() if v.is_meta]
    if meta:
        raise CheckpointError(
            f"checkpoint '{shown}': {len(meta)} of its {len(out)} tensors ({_short_list(meta, 3)}) are meta "
            "tensors, which have a shape but no data: the model was saved before its weights were "
            "materialised (built under torch.device('meta') or accelerate's init_empty_weights); "
            "save it after loading or initialising the real weights"
        )
    return out


def _ignorable_extras(sd: Mapping, memo: dict[int, bool] | None = None) -> list[str]:
    """The keys of metadata saved beside the weights, `{**model.state_dict(), "epoch": 3, "arch":
    "resnet18", "best_acc1": torch.tensor(71.2)}`: values that hold no tensor, and 0-d tensors
    under a bare name (`best_acc1`, AveragedModel's `n_averaged`), beside tensors named like a
    module's (`conv1.weight`). Empty when anything else is off (non-str keys, tensors nested in a
    value, other bare tensor names, a non-tensor under a module tensor's name such as an int
    `layer1.0.bn1.num_batches_tracked`, which was dropped and ported as 0), which `_check_tensors`
    then reports."""
    if not all(isinstance(k, str) for k in sd):
        return []
    extras = [k for k, v in sd.items()
              if not isinstance(v, torch.Tensor) or ("." not in k and v.ndim == 0)]
    tensor_keys = [k for k in sd if k not in extras]
    if (not extras or not tensor_keys or not all("." in k for k in tensor_keys)
            or any("." in k and k.rsplit(".", 1)[1] in _MODULE_TENSOR_NAMES for k in extras)
            or any(_holds_tensors(sd[k], memo=memo) for k in extras if not isinstance(sd[k], torch.Tensor))):
        return []
    return extras


# The last part of a torch module's state_dict names (weights, buffers): never metadata.
_MODULE_TENSOR_NAMES = frozenset({"weight", "bias", "running_mean", "running_var", "num_batches_tracked"})


def _holds_tensors(value: Any, depth: int = 0, memo: dict[int, bool] | None = None) -> bool:
    """Whether `value` holds a tensor (or a module) anywhere; a structure deeper than 8 levels
    counts as holding one (it is not metadata).

    Each container is walked once per `memo` (pass one dict to the calls over one checkpoint): a
    pickle can reference one list many times, and `L = [L] * 16` eight levels deep (2 KB on disk)
    has 16**8 paths, which a plain recursive walk followed for hours while torch had read the
    file in 0.02 s. Containers are alive while the checkpoint is, so their ids are stable."""
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return True
    if depth > 8:
        return True
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        items = value.values()
    elif isinstance(value, (list, tuple, set)):
        items = value
    else:
        return False
    memo = {} if memo is None else memo
    if id(value) not in memo:
        memo[id(value)] = False  # a container holding itself: its other items decide
        memo[id(value)] = any(_holds_tensors(v, depth + 1, memo) for v in items)
    return memo[id(value)]


def _strip_wrapper_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove `WRAPPER_PREFIXES` in any order and combination, each only if all keys have it."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) and len(k) > len(prefix) for k in sd):
                sd = {k[len(prefix):]: v for k, v in sd.items()}
                stripped = True
    return sd
