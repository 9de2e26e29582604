"""The `jaxport` command line. Thin: it parses, calls library functions, prints.

torch is imported only inside the commands that need it (port, verify, export, env), through
`torch_compat`, and by `jaxport train` only for what is torch's (a torch checkpoint as --init, an
ImageFolder --data read by torch's DataLoader); the digits run and the JAX side stay free of it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import shlex
import signal
import sys
import _thread
import threading
import time
import warnings
from pathlib import Path
from typing import Iterator, Sequence

from ._abandoned_reads import ABANDONED_READS, is_abandoned_read, quiet_abandoned_reads
from ._args import names_a_download, shell_word
from ._parser import Parser, shown
from ._errors import ConfigError, JaxportError

EXIT_ERROR, EXIT_MISMATCH = 2, 1


@contextlib.contextmanager
def _steps(total: int, desc: str) -> Iterator:
    """A progress bar over named steps (on stderr; silent when stderr is not a terminal)."""
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=None, leave=False) as bar:
        def step(name: str):
            bar.set_postfix_str(name)
            bar.update(1)

        yield step


def _human(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:.1f} MB"


def _load_checkpoint(path: str, args):
    """The state_dict the loading flags select, and the `replace_stride_with_dilation` its
    cross-check uses (`--dilation`; auto: what torchvision builds a segmentation backbone with)."""
    from torch_compat import backbone_state_dict, load_state_dict
    from torch_compat._convert import dilation_note, segmentation_dilation
    from torch_compat._load import describe_keys

    # mmap: the conversion copies every tensor at once, so nothing is read twice and the peak
    # stays near one copy of the weights (see torch_compat.load_state_dict on when not to).
    state_dict = load_state_dict(path, trusted=args.trusted, ema=args.ema, mmap=True, prefix=args.prefix,
                                 check_crc=True)  # ~30 ms per 100 MB: nothing beside the CLI's start
    note, detected = dilation_note(state_dict), segmentation_dilation(state_dict)  # before --backbone-only's copy
    if note:
        print(f"note: {note}")
    auto = args.dilation in (None, "auto")
    dilation = detected if auto else None if args.dilation == "none" else args.dilation
    if auto and detected and getattr(args, "verify", True):  # `verify`, or `port --verify`
        print(f"note: cross-checking them dilated, replace_stride_with_dilation={dilation} on both sides "
              "(--dilation auto; --dilation none checks them undilated)")
    if args.backbone_only:
        kept = backbone_state_dict(state_dict)
        if not set(kept) & set(state_dict):  # renamed, not selected
            print(f"backbone only: {len(kept)} tensors of an nn.Sequential of the ResNet's children, "
                  "renamed to torchvision's names")
        else:
            dropped = [k for k in state_dict if k not in kept]
            print(f"backbone only: kept {len(kept)} tensors, dropped {len(dropped)}"
                  + (f" ({describe_keys(dropped)})" if dropped else ""))
        state_dict = kept
    return state_dict, dilation


def _local_checkpoint(spec: str) -> str:
    """`spec`, or for an http(s) URL or a torchvision weights name (ResNet50_Weights.IMAGENET1K_V2),
    the file it downloads to, once, in torch's cache (`torch_compat.download_checkpoint`)."""
    if not names_a_download(spec):
        return spec
    from torch_compat import download_checkpoint

    return str(download_checkpoint(spec, progress=sys.stderr.isatty()))


def _weights_metadata(name: str, num_classes: int) -> dict[str, str]:
    """`torch_compat.weights_metadata(name, num_classes)` for the port's header, said in one line."""
    import json

    from torch_compat import weights_metadata

    meta = weights_metadata(name, num_classes)
    left_out = ""
    if "categories" not in meta and num_classes:  # a file at their URL that is not theirs (its name had no digest)
        left_out = f"; not their categories and accuracy, which describe no output of this {num_classes}-class port"
    pre = json.loads(meta["preprocess"])
    what = [f"{len(json.loads(meta['categories']))} categories"] if "categories" in meta else []
    what += [f"{data} acc@1 {m['acc@1']}" for data, m in json.loads(meta.get("metrics", "{}")).items() if "acc@1" in m]
    what += [f"evaluated at resize {pre['resize_size'][0]}, crop {pre['crop_size'][0]}"]
    print(f"weights: {meta['weights']} ({', '.join(what)}): recorded in the port's metadata{left_out}")
    return meta


def _loading_flags(args) -> str:
    """The loading options of this command line, to repeat in the next one."""
    flags = [f"--prefix {shlex.quote(args.prefix)}"] if args.prefix else []
    flags += [f"--{name.replace('_', '-')}" for name in ("backbone_only", "ema", "trusted") if getattr(args, name)]
    return "".join(" " + f for f in flags)


def _classes(arch: str, num_classes: int) -> str:
    from .models import ARCHS

    if num_classes:
        return f"{num_classes} classes"
    return f"no classifier (a backbone: outputs {512 * ARCHS[arch].expansion} pooled features)"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


# What a `jaxport train` workdir holds (an export may go beside them, never over them).
_WORKDIR_FILES = ("checkpoints", "variables.safetensors", "variables_ema.safetensors", "metrics.jsonl",
                  "training_curves.png")


def _check_output(out: Path, src: Path, what: str) -> None:
    """Refuse an output path that would destroy the input, that is a directory, or whose
    directory cannot be made or written (a parent is a file, no permission, a read-only file
    system): before any work, so a refusal costs nothing."""
    from ._io import file_kind, unwritable

    inside_run = src.is_dir() and any(
        out.resolve() == (src / name).resolve() or out.resolve().is_relative_to((src / name).resolve())
        for name in _WORKDIR_FILES)
    if _same_file(out, src) or inside_run:
        raise ConfigError(f"`--out` (={out}) is part of the {what} being read; writing there would destroy it: "
                          "choose another output path")
    if out.is_dir():
        raise ConfigError(f"`--out` (={out}) is a directory; pass a file path, e.g. {out / 'model.safetensors'}")
    if out.exists() and not out.is_file():  # --force replaces files, never a device, FIFO or socket
        raise ConfigError(f"`--out` (={out}) exists and is {file_kind(out)}, not a regular file; nothing was "
                          "replaced (not even with --force): choose another output path")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"`--out` (={out}) cannot be written: '{blocking}' is a file, not a directory; "
                          "choose another output path")
    reason = unwritable(out)
    if reason is not None:
        raise ConfigError(f"`--out` (={out}) cannot be written: {reason}; choose another output path, or make "
                          "the directory writable")


def _out_path(text: str) -> Path:
    """`--out` as a Path; `Path("newdir/")` would drop the slash and write a file named `newdir`."""
    if text.endswith(("/", os.sep)):
        raise ConfigError(f"`--out` (={text}) ends in a path separator, so it names a directory; pass a file path, "
                          f"e.g. {Path(text) / 'model.safetensors'}")
    path = Path(text)
    if ".." in path.parts:
        # `nodir/../ck.pt` is ck.pt once the writer has made nodir, but every check asked the
        # file system about the literal path, which does not exist while nodir does not: the
        # checkpoint or variables file being read, or any other file, was replaced without --force.
        # The directory is resolved as the kernel will (links first, then `..`); the name is
        # kept, so that a link named by --out is still refused or replaced, never followed.
        full = Path(os.path.realpath(path)) if path.name == ".." else Path(os.path.realpath(path.parent)) / path.name
        path = full if path.is_absolute() else Path(os.path.relpath(full))
    return path


def _port_source(out: Path) -> dict[str, str] | None:
    """The header metadata of an existing jaxport variables file, which says the checkpoint it
    was ported from (`_is_port_of`; `_source_name` for showing it); None when `out` is not a
    jaxport variables file at all."""
    from ._io import FORMAT, read_metadata

    try:
        metadata = read_metadata(out)
    except JaxportError:
        return None
    return metadata if metadata.get("format") == FORMAT else None


def _source_name(metadata: dict[str, str]) -> str:
    """The checkpoint a port records, as shown: a path (earlier ports), else its name;
    '' when it records none (`jaxport train`'s variables, `jaxport.save_variables`)."""
    return metadata.get("source_path") or metadata.get("source", "")


def _source_id(ckpt: Path) -> str:
    """What a port records to know its checkpoint again: a digest of the checkpoint's absolute
    path. The path itself, recorded before, put the user's directory names (often their login)
    into every port they publish."""
    import hashlib

    return hashlib.sha256(os.fsencode(ckpt.resolve())).hexdigest()


def _is_port_of(metadata: dict[str, str], ckpt: Path) -> bool:
    # A file that records no source is not a port: `jaxport train`'s variables and files
    # written by `jaxport.save_variables` record none, and were replaced without --force.
    if metadata.get("source_id"):
        return metadata["source_id"] == _source_id(ckpt)
    source = _source_name(metadata)
    return bool(source) and (source == _header_text(ckpt.resolve())
                             or (os.sep not in source and source == _header_text(ckpt.name)))


def _header_text(path: str | os.PathLike) -> str:
    """A path as the safetensors header (JSON, UTF-8) can hold it: bytes of a name that are not
    UTF-8 (os.fsdecode's surrogates, which failed the write) as backslash escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _refuse_overwrite(out: Path, force: bool, unless: str) -> None:
    """A command never silently replaces a file it may not have written: an existing `out` is
    replaced only with --force (`unless` says what else is replaced without it)."""
    # lexists: a symbolic link to a missing file is an entry the rename would replace, too.
    if os.path.lexists(out) and not force:
        raise ConfigError(f"`--out` (={out}) already exists{unless}; nothing was overwritten: choose another "
                          "output path, or pass --force to replace it")


@contextlib.contextmanager
def _refused_if_made(out: Path, force: bool) -> Iterator[None]:
    """`_refuse_overwrite`'s refusal for an `out` that another process made during the block."""
    try:
        yield
    except FileExistsError:
        _refuse_overwrite(out, force, "")
        raise


_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def _default_port_output(ckpt: Path, force: bool) -> Path:
    """`<checkpoint name without its extension(s)>.safetensors` in the current directory. It never
    replaces the checkpoint, a file that is not a jaxport port, or (without --force) the port of
    another checkpoint: `a.epoch10.pth` and `a.epoch20.pth` get different names."""
    stem = ckpt.stem if ckpt.suffix else ckpt.name
    if Path(stem).suffix in _CHECKPOINT_SUFFIXES:  # model_best.pth.tar -> model_best
        stem = Path(stem).stem
    stem = stem or "variables"
    out = Path(stem + ".safetensors")
    if _same_file(out, ckpt) or ckpt.suffix == ".safetensors":
        out = Path(stem + ".flax.safetensors")
    # (The checkpoint itself is never the output: `_check_output` refuses that, --force or not.)
    if os.path.lexists(out) and not force:
        metadata = _port_source(out)
        if metadata is None or not _is_port_of(metadata, ckpt):
            source = "" if metadata is None else _source_name(metadata)
            if metadata is None:
                held = "is not a jaxport variables file"
            elif not source:
                held = "holds jaxport variables that were not ported from a checkpoint (trained or saved weights)"
            elif source == _header_text(ckpt.name):
                held = f"holds the port of another '{source}' (another directory's, or a file since moved)"
            else:
                held = f"holds the port of '{source}', not of '{ckpt.name}'"
            raise ConfigError(f"the default output '{out}' already exists and {held}; nothing was overwritten: "
                              "pass --out to name the output, or --force to replace it")
    return out


def _port_output(ckpt: Path, args) -> Path:
    """Where `jaxport port` writes: --out or the default name, once the checks that it may
    write there have passed."""
    out = _out_path(args.out) if args.out else _default_port_output(ckpt, args.force)
    _check_output(out, ckpt, "checkpoint")
    # Re-porting over an earlier port is the usual re-run; trained or saved variables record no
    # source ('') and are kept like any other file.
    if args.out and not _source_name(_port_source(out) or {}):
        _refuse_overwrite(out, args.force, " and is not an earlier port of a checkpoint (an earlier port is replaced)")
    return out


def _non_finite(state_dict) -> str | None:
    """Which floating tensors hold NaN or inf (a diverged run's checkpoint), or None."""
    import torch

    found = []
    for key, t in state_dict.items():
        if t.is_floating_point():
            bad = ~torch.isfinite(t if t.element_size() > 1 else t.float())  # (no isfinite for float8)
            if bool(bad.any()):
                nan = int(torch.isnan(t.float()[bad]).sum())
                found.append(f"{key}: {nan} NaN, {int(bad.sum()) - nan} inf")
    if not found:
        return None
    return f"{len(found)} tensor(s) hold NaN or inf values ({'; '.join(found[:3])}{'; ...' if len(found) > 3 else ''})"


def _print_reports(reports) -> bool:
    for r in reports:
        print(r.table())
    return all(r.ok for r in reports)


def _cmd_port(args) -> int:
    import torch_compat
    from torch_compat import _default

    from ._io import save_variables

    if args.dilation is not None and not args.verify:
        raise ConfigError(f"`--dilation` (={_dilation_flag(args.dilation)}) changes only the --verify cross-check "
                          "(dilation leaves the weights as they are, so the port is the same): add --verify, or leave "
                          "it out and build the model with jaxport.models.<arch>(replace_stride_with_dilation=...)")
    with _steps(5 if args.verify else 4, "port") as step:
        if args.checkpoint is None:
            step("building the embedded default checkpoint")
            ckpt, named = _default.default_checkpoint(), False
            print(f"checkpoint: {ckpt} ({_default.DESCRIPTION})")
        else:
            step("checking the checkpoint")
            # torchvision's weights by name: what it records beside them goes into the port
            named = names_a_download(args.checkpoint) and not args.checkpoint.startswith(("http://", "https://"))
            ckpt = Path(_local_checkpoint(args.checkpoint))
            print(f"checkpoint: {ckpt}")
            if ckpt.is_dir():  # said as such, before the output checks below take `.` for a training workdir
                from torch_compat._load import sniff

                sniff(str(ckpt))
        # Decided before any work, so a refused output costs nothing.
        out = _port_output(ckpt, args)
        # A path found free must still be free when the port is written (see the save below).
        replaceable = args.force or os.path.lexists(out)
        t0 = time.perf_counter()
        step("loading (weights-only)" if not args.trusted else "loading (trusted: full unpickle)")
        state_dict, dilation = _load_checkpoint(str(ckpt), args)
        step("converting")
        arch = None if args.arch == "auto" else args.arch
        detected = torch_compat.detect_arch(state_dict) if arch is None else arch
        dtype = None if args.dtype == "keep" else args.dtype
        variables = torch_compat.torch_to_flax(state_dict, detected, dtype=dtype)
        t1 = time.perf_counter()
        dtypes = sorted({str(v.dtype) for v in state_dict.values() if v.is_floating_point()})
        if dtype is not None and dtypes != [f"torch.{dtype}"]:
            dtypes[-1] += f" cast to {dtype} (--dtype)"
        n_params = sum(int(v.numel()) for k, v in state_dict.items() if k.endswith(("weight", "bias")))
        print(f"architecture: {detected} ({'detected' if arch is None else 'given'}), "
              f"{_classes(detected, torch_compat.num_classes_of(state_dict))}, {len(state_dict)} tensors, "
              f"{n_params / 1e6:.2f}M parameters, {'/'.join(dtypes)}")
        if (bad := _non_finite(state_dict)) is not None:  # ported as they are, but not silently
            print(f"warning: the checkpoint's {bad}; they are copied as they are (was it saved after its training "
                  "diverged?), and the model's outputs will be NaN or inf")
        step("saving")
        metadata = {"source": _header_text(ckpt.name), "source_id": _source_id(ckpt)}
        if named:
            metadata |= _weights_metadata(args.checkpoint, torch_compat.num_classes_of(state_dict))
        try:
            save_variables(out, variables, arch=detected, metadata=metadata, overwrite=replaceable)
        except FileExistsError:
            # Written since the checks above (another `jaxport port` started at the same time):
            # they decide about it as they would have had it been there first. The port is
            # written again only when they let it replace the file (the same checkpoint's port).
            _port_output(ckpt, args)
            save_variables(out, variables, arch=detected, metadata=metadata)
        print(f"wrote: {out} ({_human(out.stat().st_size)}; loaded + converted in {t1 - t0:.2f} s)")
        ok = True
        if args.verify:
            step("cross-checking against torchvision")
            # The port holds the cast weights: it is checked against torch running those.
            as_ported = torch_compat.cast_floating(state_dict, dtype)
            ok = _print_reports(torch_compat.cross_check(as_ported, variables, arch=detected,
                                                         replace_stride_with_dilation=dilation))
    print("verify: " + ("PASS: the Flax port matches torchvision" if ok else "FAIL: beyond tolerance")
          if args.verify else f"next: jaxport verify {shell_word(ckpt)} {shell_word(out)}"
                              f"{_loading_flags(args)}")
    return 0 if ok else EXIT_MISMATCH


def _cmd_verify(args) -> int:
    import torch_compat

    from ._io import load_with_metadata

    args.checkpoint = _local_checkpoint(args.checkpoint)  # the file's path from here on, in every message
    state_dict, dilation = _load_checkpoint(args.checkpoint, args)
    variables, arch = None, None if args.arch == "auto" else args.arch
    differences = []
    if not args.variables:
        _refuse_uncomputable(state_dict, args.checkpoint)
    else:
        from torch_compat._convert import variables_look_like
        from torch_compat._crosscheck import port_differences

        from ._io import flatten

        variables, metadata = load_with_metadata(args.variables)
        held = arch or torch_compat.detect_arch(state_dict)
        # The shapes say what the variables are; the recorded name only where shapes cannot
        # (a mislabelled file was called what its label said, and --arch could not override it).
        looks = variables_look_like(flatten(variables)) or metadata.get("arch")
        if looks and looks != held:
            other = f"--arch is {held}" if arch else f"'{args.checkpoint}' is a {held} checkpoint"
            raise ConfigError(f"'{args.variables}' holds {looks} variables but {other}: verify compares a "
                              "checkpoint with its own port; pass the variables `jaxport port` wrote for it")
        arch = held
        state_dict, impossible = _as_ported(state_dict, variables, args.variables)
        if impossible:  # no port of this checkpoint holds the variables' dtype: nothing to run
            print(f"weights: {impossible}")
            print("verify: FAIL: the variables are not the checkpoint's port (re-port it with `jaxport port`)")
            return EXIT_MISMATCH
        differences = port_differences(state_dict, variables, arch)
    from .models import check_dilation, layer4_side

    # A 3x3 conv dilated by d on an n x n map reaches its outer taps only where n > d (d = 1
    # undilated); layer4 has the smallest maps and the largest dilation.
    side, spread = layer4_side(args.image_size, dilation), 2 ** sum(check_dilation(dilation))
    if side <= spread:
        dilated = f" and its 3x3 kernels dilated by {spread}" if spread > 1 else ""
        print(f"note: at --image-size {args.image_size} layer4's maps are {side}x{side}{dilated}, so the outer taps "
              "of its 3x3 kernels never reach the output and the cross-check cannot see them; the default (64) can")
    bad = _non_finite(state_dict)
    if bad is not None:
        print(f"note: the checkpoint's {bad}: both models' outputs are NaN or inf, so the output check below fails "
              "whatever the port" + (" (the port itself is compared tensor by tensor)" if args.variables else ""))
    modes = ("eval", "train") if args.mode == "both" else (args.mode,)
    with _steps(1, "verify") as step:
        step("running torchvision and the Flax port")
        reports = []
        try:
            for mode in modes:  # one at a time: eval's table is shown even if train mode is refused
                reports += torch_compat.cross_check(state_dict, variables, arch=arch, modes=(mode,),
                                                    batch_size=args.batch_size, image_size=args.image_size,
                                                    rtol=args.rtol, train_rtol=args.train_rtol,
                                                    replace_stride_with_dilation=dilation)
        except ConfigError:  # e.g. train mode at inputs too small for any comparison to mean anything
            if reports:
                _print_reports(reports)
            raise
        except (MemoryError, RuntimeError) as e:  # XLA's RESOURCE_EXHAUSTED, torch's allocator
            if not (isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) or "allocate" in str(e)):
                raise
            raise ConfigError(f"out of memory running both models at `--batch-size` (={args.batch_size}) and "
                              f"`--image-size` (={args.image_size}); use smaller values (the defaults, 2 and 64, "
                              "check every stage)") from None
    ok = _print_reports(reports)
    if differences:
        # A port is an exact copy: outputs within tolerance do not make a changed tensor right.
        shown = differences[:10] + ([f"... and {len(differences) - 10} more"] if len(differences) > 10 else [])
        print(f"weights: {len(differences)} tensor(s) of '{args.variables}' differ from the checkpoint's own "
              "port:\n  " + "\n  ".join(shown))
        print("verify: FAIL: the variables are not the checkpoint's port (re-port it with `jaxport port`)")
        return EXIT_MISMATCH
    if not ok and bad is not None:
        exact = " (every tensor is an exact copy of the checkpoint's own port)" if args.variables else ""
        print(f"verify: FAIL: the checkpoint holds NaN or inf values, which no output check can pass{exact}; "
              "verify a checkpoint saved before its training diverged")
        return EXIT_MISMATCH
    print("verify: PASS" if ok else "verify: FAIL: beyond tolerance")
    return 0 if ok else EXIT_MISMATCH


def _refuse_uncomputable(state_dict, checkpoint: str) -> None:
    """A float8 checkpoint converts only with a cast (`port --dtype`), which verify has no flag
    for: the converter's advice, "(CLI --dtype float32)", sent the user to a flag verify lacks."""
    import torch

    from torch_compat._convert import _FLOAT_DTYPES

    odd = sorted({str(t.dtype).removeprefix("torch.") for t in state_dict.values()
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in _FLOAT_DTYPES})
    if odd:
        raise ConfigError(f"'{checkpoint}' holds {', '.join(odd)} weights, which jax and numpy cannot compute with; "
                          f"port it with a cast first (jaxport port {shell_word(checkpoint)} --dtype float32), then "
                          f"check that port: jaxport verify {shell_word(checkpoint)} PORT")


def _as_ported(state_dict, variables, shown: str):
    """The checkpoint's weights in the dtype its port holds: a `jaxport port --dtype` port equals
    torch's cast of the checkpoint, so that is what it is checked against. Returns them, and why
    no port of the checkpoint can hold that dtype (a value beyond its range), or None."""
    import torch_compat
    from torch_compat._convert import OutOfRangeError

    from ._io import flatten

    ported = {np_dtype.name for np_dtype in (getattr(v, "dtype", None) for v in flatten(variables).values())
              if np_dtype is not None and (np_dtype.kind == "f" or np_dtype.name == "bfloat16")}
    held = {str(v.dtype).removeprefix("torch.") for v in state_dict.values() if v.is_floating_point()}
    if len(ported) != 1 or held == ported:
        return state_dict, None
    (dtype,) = ported
    print(f"note: '{shown}' holds {dtype} weights and the checkpoint {'/'.join(sorted(held))}: checking it "
          f"against the checkpoint cast to {dtype}, as `jaxport port --dtype {dtype}` writes it")
    try:
        return torch_compat.cast_floating(state_dict, dtype), None
    except OutOfRangeError as e:  # its message is worded for `port --dtype`, a flag verify does not have
        return state_dict, f"{e.beyond}: no {dtype} port of the checkpoint exists, so '{shown}' is not one"


def _cmd_export(args) -> int:
    import torch
    import torch_compat

    from ._io import atomic_path, load_with_metadata, open_for_writer, safetensors_os_errors

    src, out = Path(args.variables), _out_path(args.out)
    _check_output(out, src, "variables file" if not src.is_dir() else "training workdir")
    # A torch file does not say who wrote it, so even an earlier export is kept without --force.
    if args.ema and not src.is_dir():
        raise ConfigError(f"`--ema` (the average of a `jaxport train --model-ema` run) takes a workdir, and '{src}' "
                          "is a variables file: export it without --ema (a run's average is its "
                          "variables_ema.safetensors)")
    _refuse_overwrite(out, args.force, "")
    if src.is_dir():
        from .train._checkpoint import checkpoint_dir, read_latest

        variables, recorded, step = read_latest(src, ema=args.ema)
        # A workdir holds many steps; without this line a user could not tell which one was written.
        print(f"read: step {step}{' (its --model-ema average)' if args.ema else ''}, the latest checkpoint in "
              f"{checkpoint_dir(src)}")
    else:
        variables, metadata = load_with_metadata(src)
        recorded = metadata.get("arch")
    arch = args.arch or recorded
    if not arch:
        raise ConfigError(f"'{src}' does not record its architecture; pass --arch (e.g. --arch resnet50)")
    from .models import ARCHS

    if arch not in ARCHS:  # only a recorded name can be unknown: --arch is one of the choices
        raise ConfigError(f"'{src}' records the architecture {arch!r}, which jaxport does not know; if its weights "
                          f"are a torchvision ResNet, pass --arch (one of {', '.join(ARCHS)})")
    state_dict = torch_compat.flax_to_torch(variables, arch)
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    # Without --force `out` was found free above, and is written only if it still is: a file
    # another process wrote there meanwhile gets the refusal the check above gives.
    with _refused_if_made(out, args.force), atomic_path(out, nbytes=nbytes + 200 * len(state_dict) + 65536,  # data + a bound
                                            overwrite=args.force) as tmp:
        if out.suffix.lower() == ".safetensors":  # the name says safetensors (any case): no pickle inside it
            import safetensors.torch

            with safetensors_os_errors(out):
                safetensors.torch.save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp),
                                            metadata={"format": "pt"})
            load = "safetensors.torch.load_file(path)"
        else:
            # To a file object: torch names the archive's folder after a path it is given, here the
            # random temporary one, so two exports of the same weights differed.
            with open_for_writer(tmp, out) as f:
                torch.save(state_dict, f)
            load = "torch.load(path)"
    num_classes = torch_compat.num_classes_of(state_dict)
    if num_classes:
        print(f"wrote: {out} ({_human(out.stat().st_size)}), a torchvision {arch} state_dict "
              f"(torchvision.models.{arch}(num_classes={num_classes}).load_state_dict({load}, strict=True))")
    else:
        print(f"wrote: {out} ({_human(out.stat().st_size)}), a torchvision {arch} backbone state_dict, no fc "
              f"(model = torchvision.models.{arch}(); model.fc = torch.nn.Identity(); "
              f"model.load_state_dict({load}, strict=True))")
    return 0


def _cmd_env(args) -> int:
    from ._env import report

    rows, problems = report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for p in problems:
        print(f"warning: {p}")
    if not problems:
        print("no known-bad combinations found")
    return 0


def _positive(flag: str, kind: type, example):
    """The argparse type of a flag that takes a number > 0 of `kind` (int or float)."""
    expected = "a positive integer" if kind is int else "a finite number > 0"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not (math.isfinite(value) and value > 0):  # NaN would make every comparison fail silently
            raise argparse.ArgumentTypeError(f"`{flag}` (={shown(text)}): expected {expected}, e.g. {flag} {example}")
        return value
    return parse


_BOOLS = {"t": True, "true": True, "1": True, "f": False, "false": False, "0": False}


def _dilation(text: str):
    """The argparse type of --dilation: "auto", "none", or three booleans (layer2,layer3,layer4)."""
    if text.strip().lower() in ("auto", "none"):
        return text.strip().lower()
    words = [w.strip().lower() for w in text.split(",")]
    odd = next((w for w in words if w not in _BOOLS), None)
    if len(words) != 3 or odd is not None:
        got = f"{len(words)} value{'s' * (len(words) != 1)}" if len(words) != 3 else f"{odd!r}, not a boolean"
        raise argparse.ArgumentTypeError(
            f"`--dilation` (={shown(text)}): expected three booleans for layer2,layer3,layer4 (true/false, t/f or "
            f"1/0: torchvision's replace_stride_with_dilation), auto or none; got {got}; e.g. --dilation F,T,T "
            "as torchvision's DeepLabV3 and FCN build their ResNet")
    return tuple(_BOOLS[w] for w in words)


def _dilation_flag(value) -> str:
    """A `_dilation` value as --dilation takes it: auto, none or F,T,T."""
    return value if isinstance(value, str) else ",".join("T" if v else "F" for v in value)


def build_parser() -> argparse.ArgumentParser:
    from .models import ARCHS

    parser = Parser(
        prog="jaxport", description="Port torchvision ResNet checkpoints to JAX/Flax and back, verified.")
    parser.add_argument("--version", action="version", version=f"jaxport {__import__('jaxport').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # Parser refuses a missing one
    archs = ["auto", *ARCHS]

    def dilation(p, which):
        p.add_argument("--dilation", type=_dilation, metavar="L2,L3,L4",
                       help=f"replace_stride_with_dilation of both models in {which}: three booleans for "
                            "layer2,layer3,layer4 (true/false, t/f or 1/0), e.g. F,T,T, or none; default auto: F,T,T "
                            "for a torchvision segmentation model's backbone (DeepLabV3, FCN), which torchvision "
                            "builds dilated, none otherwise")

    def loading(p):
        p.add_argument("--trusted", action="store_true",
                       help="allow a full unpickle (runs code from the file): only for files you trust")
        p.add_argument("--ema", action="store_true", help="take the EMA copy of the weights stored beside the model")
        p.add_argument("--arch", default="auto", choices=archs, metavar="ARCH",
                       help=f"architecture (default: detected from the weights); one of {', '.join(archs)}")
        p.add_argument("--prefix", metavar="PREFIX",
                       help="keep only the keys under PREFIX, removed: a ResNet inside a bigger model, "
                            "e.g. encoder_q. (MoCo) or backbone.")
        p.add_argument("--backbone-only", action="store_true",
                       help="keep conv1, bn1 and layer1..layer4 only, dropping the classifier and any "
                            "other head: a model without fc that outputs the pooled features")

    p = sub.add_parser("port", help="convert a torch checkpoint to Flax variables (safetensors)",
                       description="Convert a torch checkpoint to Flax variables. With no CHECKPOINT, ports an "
                                   "embedded default ResNet-50 saved like a GPU DataParallel run.")
    p.add_argument("checkpoint", nargs="?",
                   help="any torch.save file (.pt, .pth, .bin, .tar, .ckpt, ...) or .safetensors; or torchvision's "
                        "weights by name (ResNet50_Weights.IMAGENET1K_V2) or URL, downloaded once into torch's cache "
                        "(default: the embedded ResNet-50)")
    p.add_argument("--out", help="output file (default: <checkpoint name>.safetensors in the current directory, "
                                 "<name>.flax.safetensors for a .safetensors checkpoint)")
    p.add_argument("--verify", action="store_true", help="cross-check against torchvision and print the per-stage table")
    dilation(p, "--verify's cross-check (the port is the same either way)")
    dtype = p.add_argument("--dtype", choices=("keep", "float32", "float16", "bfloat16"), default="keep",
                           help="keep each tensor's dtype (default), or cast every floating tensor to this dtype, "
                                "rounding as torch's tensor.to(dtype) does")
    # Other names of these widths (torch's `half`, common short forms) are named in the refusal:
    # by spelling alone `half` matched nothing. (`float` stays ambiguous: numpy's is float64.)
    dtype.aliases = {"half": "float16", "fp16": "float16", "f16": "float16", "bf16": "bfloat16",
                     "single": "float32", "fp32": "float32", "f32": "float32"}
    p.add_argument("--force", action="store_true",
                   help="replace an existing output file that is not an earlier port of this checkpoint")
    loading(p)
    p.set_defaults(func=_cmd_port)

    p = sub.add_parser("verify", help="cross-check a checkpoint (and optionally its port) against torchvision",
                       description="Run the torchvision model and the Flax port on the same random images and "
                                   "print, per stage, the max absolute and relative error; exit 1 if a stage is "
                                   "beyond tolerance.")
    p.add_argument("checkpoint", help="the torch checkpoint: any torch.save file or .safetensors, or torchvision's "
                                      "weights by name (ResNet50_Weights.IMAGENET1K_V2) or URL, as `port` takes")
    p.add_argument("variables", nargs="?", help="ported variables to check (default: convert the checkpoint afresh)")
    p.add_argument("--mode", choices=("eval", "train", "both"), default="both",
                   help="eval: stem, layer1..4, pooled features, logits; train: also every BatchNorm's updated "
                        "running statistics (default: both)")
    p.add_argument("--batch-size", type=_positive("--batch-size", int, 2), default=2, metavar="N",
                   help="images per check (default: 2)")
    p.add_argument("--image-size", type=_positive("--image-size", int, 64), default=64, metavar="PIXELS",
                   help="height and width of the random images (default: 64)")
    p.add_argument("--rtol", type=_positive("--rtol", float, 1e-4), default=1e-4,
                   help="eval tolerance on each stage's max error relative to its scale (default: 1e-4)")
    p.add_argument("--train-rtol", type=_positive("--train-rtol", float, 1e-3), default=1e-3,
                   help="train-mode tolerance floor, raised to a multiple of torch's own float32 error where that "
                        "is larger (default: 1e-3)")
    dilation(p, "the cross-check")
    loading(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("export", help="write Flax variables (or a training workdir) as a torch state_dict",
                       description="Write Flax variables (a port, or a `jaxport train` workdir's weights) as a "
                                   "torch state_dict that torchvision loads with strict=True.")
    p.add_argument("variables", help="a variables .safetensors file or a `jaxport train` workdir")
    p.add_argument("--arch", choices=list(ARCHS), metavar="ARCH", help="architecture (default: recorded in the file)")
    p.add_argument("--out", required=True,
                   help="output file: torch.save format (.pt/.pth), or safetensors if it ends in .safetensors")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--ema", action="store_true",
                   help="a workdir's --model-ema average (torchvision's model_ema) instead of its weights")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("env", help="versions, devices and known-bad combinations",
                       description="Report the versions that matter (python, jax, jaxlib and its plugins, flax, "
                                   "optax, orbax, torch, torchvision, pillow, numpy) and the devices, and warn "
                                   "about known-bad combinations.")
    p.set_defaults(func=_cmd_env)

    try:
        from .train._cli import add_parser as add_train_parser
    except ImportError:
        pass
    else:
        add_train_parser(sub)
    return parser


class _ClosedPipeSafe:
    """stdout or stderr that outlives its reader: `jaxport port ... | head -3` still writes the port.

    Once the reader has gone (BrokenPipeError), the rest of the output goes to /dev/null and
    the command finishes its work, instead of dying mid-way with nothing saved.
    """

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:
                return self._write_bytes(text)
        except BrokenPipeError:
            self._discard()
            return len(text)

    def _write_bytes(self, text: str) -> int:
        """A path whose name is not UTF-8 (os.fsdecode's surrogates) failed a strict stream: it
        goes out as its own bytes, as `ls` prints it, so a printed command runs as shown."""
        encoding = getattr(self._stream, "encoding", None) or "utf-8"
        try:
            data = text.encode(encoding, "surrogateescape")
        except UnicodeEncodeError:  # a character the stream's encoding has no bytes for
            data = text.encode(encoding, "backslashreplace")
        buffer = getattr(self._stream, "buffer", None)
        if buffer is None:
            return self._stream.write(data.decode(encoding, "replace"))
        self._stream.flush()
        buffer.write(data)
        buffer.flush()
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        # The file descriptor itself now points at /dev/null, so what is still buffered (and
        # the interpreter's flush at exit) lands there without a second error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _one_line_warnings(message, category, filename, lineno, file=None, line=None):
    print(f"jaxport: warning: {message}", file=sys.stderr)


_ABANDONED_READS = ABANDONED_READS  # (the filter's home is `_abandoned_reads`, which load_workdir uses too)


def _drop_closed_loop_callbacks(hook=sys.unraisablehook):
    """`hook` without the leftovers of failed checkpoint reads (`_abandoned_reads`: up to
    hundreds of lines after the one-line error), and with a signal that lands in a callback
    delivered again; anything else still shows."""

    def unraisable(u):
        if is_abandoned_read(u):
            return
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
            # Ctrl-C (or SIGTERM, raised as `Terminated`) landed in a callback Python cannot
            # raise from, e.g. jax's garbage-collection hook while torch is imported: Python
            # printed a traceback and carried on, and the command finished with status 0.
            # Deliver the signal again, from another thread a moment later: raised in this hook,
            # it would be lost too. Should it land in a callback again, it comes back here.
            redeliver = threading.Timer(0.01, _thread.interrupt_main, (getattr(u.exc_value, "signum", signal.SIGINT),))
            redeliver.daemon = True
            redeliver.start()
            return
        hook(u)

    unraisable.drops_abandoned_reads = True  # `quiet_abandoned_reads` (load_workdir) keeps it as it is
    return unraisable


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
    except KeyboardInterrupt as e:  # while jax or torch loaded, before a command ran
        code = _interrupted(e)
    if argv is None and code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        _leave_at_once(code)
    return code


def _leave_at_once(code: int) -> None:
    """Exits an interrupted command line without Python's teardown. A signal that lands while
    XLA compiles (a ResNet's first step compiles for seconds) stops jax's wait for the compile
    but not the compile, which goes on in XLA's thread pool; the teardown then destroyed the
    client under it: SIGSEGV after the "interrupted" line (status 139 instead of 143), every
    time in a probe. Everything worth keeping is written by now: `train` checkpoints before it
    raises `Interrupted`, and the writers finish or remove their temporary files as they unwind.

    Not in a multi-process run: there jax's exit barrier tells the other processes this one has
    gone, and `_distributed` already ends failed runs its own way."""
    distributed = sys.modules.get("jax._src.distributed")
    if distributed is not None and getattr(distributed.global_state, "client", None) is not None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# The commands that import torch (through torch_compat) as they start.
_TORCH_COMMANDS = ("port", "verify", "export", "env")
# ... and torchvision: to cross-check, to build the embedded default (not to port it once built),
# to report its version.
# `port CHECKPOINT` and `export` convert only, and torch_compat leaves torchvision (~1.4 s) out.
_TORCHVISION_COMMANDS = ("verify", "env")
# What `train` imports as it reads an image folder (torchvision's transforms, PIL's decoders) or
# loads --init's checkpoint; imported otherwise only once training starts, outside the hold.
_DATA_MODULES = ("torch", "torch.utils.data", "torchvision.transforms", "PIL.Image")


def _modules_for(args: argparse.Namespace) -> tuple[str, ...]:
    """The extension-heavy modules the command will import, to import while signals are held."""
    command = getattr(args, "command", None)
    if command in _TORCHVISION_COMMANDS or (command == "port" and (args.verify or (
            args.checkpoint is None and not _default_is_built()) or _names_weights(args.checkpoint))):
        return ("torch", "torchvision")
    if command in _TORCH_COMMANDS:
        return ("torch",)
    if command == "train" and getattr(args, "data", None):
        return _DATA_MODULES  # torch among them, for --init too
    return ("torch",) if command == "train" and getattr(args, "init", None) else ()


def _names_weights(checkpoint: str | None) -> bool:
    """A torchvision weights name, whose URL only torchvision knows."""
    return checkpoint is not None and names_a_download(checkpoint) and "://" not in checkpoint


def _default_is_built() -> bool:
    """Whether `port` of the embedded default finds it in the cache, and so needs no torchvision."""
    try:
        from torch_compat import _default

        return _default.default_path().exists()
    except Exception:  # a broken torch or an unknown home directory is the command's to report
        return False


def _main(argv: Sequence[str] | None) -> int:
    warnings.showwarning = _one_line_warnings
    quiet_abandoned_reads()
    sys.unraisablehook = _drop_closed_loop_callbacks()
    with _signals_held():
        from ._io import sigterm_as_interrupt

        args = build_parser().parse_args(argv)  # imports jax
        for module in _modules_for(args):
            with contextlib.suppress(Exception):  # a broken torch is the command's to report
                importlib.import_module(module)
    # stderr too: `jaxport train ... 2>&1 | head -1` died at its first epoch's line, after that
    # epoch's checkpoint but before the final weights file, exit status 1.
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ClosedPipeSafe(stdout), _ClosedPipeSafe(stderr)
    try:
        # SIGTERM as Ctrl-C: one line and status 143 instead of a silent death (rc -15) whenever
        # it arrives outside the blocks that handle it themselves (writes, `train`'s loop).
        with sigterm_as_interrupt():
            return _run(args)
    finally:
        sys.stdout, sys.stderr = stdout, stderr


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then stop the command as usual; a second
    one stops it at once.

    The block imports jax and torch (a few seconds). With the signal raised inside those
    imports, the process crashed after printing its one line (SIGSEGV, status -11 instead of
    130 or 143: in one CI run, and 1 run in 20-50 under load, also when it ended with `os._exit`
    right after the line), most likely in a C extension the cut-short import left half set up.
    Held until the imports finish: no crash in 25 runs under load.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame):
        if held:
            raise _signal_exception(signum)
        held.append(signum)

    # An ignored signal (nohup, a background job) stays so; one set outside Python (None) too.
    saved = {s: h for s in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(s)) not in (signal.SIG_IGN, None)}
    for signum in saved:
        signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    if held:
        raise _signal_exception(held[0])


def _signal_exception(signum: int) -> KeyboardInterrupt:
    from ._io import Terminated

    return Terminated("SIGTERM") if signum == signal.SIGTERM else KeyboardInterrupt()


def _interrupted(e: KeyboardInterrupt) -> int:
    """Ctrl-C, or SIGTERM (`jaxport._io.Terminated`, `train`'s `Interrupted`): one line, 128 + signal."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"jaxport: interrupted{f': {e}' if str(e) else ''}", file=sys.stderr)
    return 128 + signum


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except JaxportError as e:
        print(f"jaxport: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM during a write (`jaxport._io.Terminated`)
        return _interrupted(e)
    except OSError as e:  # the machine, not jaxport: a full disk, a read-only or forbidden path
        where = f": '{e.filename}'" if e.filename else ""
        print(f"jaxport: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:  # a bug or an environment problem: still no traceback for the user
        if os.environ.get("JAXPORT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"jaxport: internal error ({type(e).__name__}: {first}); rerun with JAXPORT_DEBUG=1 "
              "for the traceback and report it", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
