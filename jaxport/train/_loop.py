"""The training loop behind `jaxport train`: data, model, steps, checkpoints, metrics, plot."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._args import finite, is_int, is_real, one_of, shell_word, shown
from .._errors import CheckpointError, ConfigError, DivergedError, JaxportError
from .._io import atomic_path, remove_temporaries, save_variables, unwritable
from ..models import ARCHS, build, layer4_side
from . import _checkpoint, _data, _distributed, _ema, _memory, _mix, _presets, _recipe
from ._init import fit_head, load_init
from ._step import (BATCHNORM_MODES, RUNNING_STATS, check_batch_size, check_label_smoothing, create_state, divisors,
                    make_eval_step, make_mesh, make_train_step, replicate, shard_batch)

FINAL_VARIABLES = _checkpoint.FINAL_VARIABLES
FINAL_EMA = _checkpoint.FINAL_EMA
OUTPUTS = (FINAL_VARIABLES, FINAL_EMA, "metrics.jsonl", "training_curves.png")  # a run's files, with checkpoints/
METRIC_KEYS = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc")  # what resuming and the plot read


# The compute dtypes `--dtype` takes, and what other spellings of them mean.
DTYPES = ("float32", "bfloat16")
# The other precisions point to the supported one of their kind: by spelling alone `closest` sent
# float64 to bfloat16, and fp16 or half to nothing.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32", "float": "float32",
                  "fp16": "bfloat16", "f16": "bfloat16", "half": "bfloat16",
                  "float64": "float32", "fp64": "float32", "f64": "float32", "double": "float32"}
_NOT_TRAINED = {
    **dict.fromkeys(("float16", "fp16", "f16", "half"),
                    " (float16 is not supported for training: bfloat16 is the half-precision one)"),
    **dict.fromkeys(("float64", "fp64", "f64", "double"),
                    " (float64 is not supported for training: float32 is the full-precision one)"),
}

@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on; `jaxport train`'s flags map one to one.

    The optimizer settings are torchvision's `references/classification/train.py` flags, with
    their names, defaults (but `lr`, `weight_decay`) and meanings (`_recipe`): by default torch's
    SGD (`torch_compat.optim.sgd`) with `momentum` and `weight_decay`, its learning rate
    following torch's `CosineAnnealingLR(T_max=epochs)` stepped per epoch.
    """

    workdir: str | None  # None only with `test_only` of `init`'s weights, which use none
    data: str | None = None  # None: the embedded scikit-learn digits
    arch: str = "resnet18"
    epochs: int = 8  # 6 reached 0.950-0.983 held-out over seeds and thread counts; 8: 0.972-0.983
    batch_size: int | str = 64  # global; "auto" picks the largest per-device batch that fits
    # Passes per step, each over 1/N of every device's batch, their gradients accumulated into
    # one update (`make_train_step(accum_steps=)`): one pass's activations in memory, beside
    # an accumulator of the gradients. With "auto" batch size, the largest per-device pass that
    # fits, times N.
    grad_accum_steps: int = 1
    image_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9  # SGD's and RMSprop's (AdamW has none)
    weight_decay: float = 5e-4
    # torchvision's recipe: "sgd", "sgd-nesterov" (any name starting with sgd, with nesterov in it)
    # "adamw" or "rmsprop", in any case
    opt: str = "sgd"
    norm_weight_decay: float | None = None  # the BatchNorm parameters' weight decay; None: weight_decay
    bias_weight_decay: float | None = None  # every bias's (the BatchNorms' too); None: as the others
    lr_scheduler: str = "cosineannealinglr"  # or "steplr", "exponentiallr" (any case)
    lr_step_size: int = 30  # steplr: epochs between decays
    lr_gamma: float = 0.1  # steplr, exponentiallr: the factor of each decay
    lr_min: float = 0.0  # cosineannealinglr: eta_min
    lr_warmup_epochs: int = 0  # epochs before the scheduler (cosine's T_max is epochs - these)
    lr_warmup_method: str = "constant"  # "linear" (torch's LinearLR) or "constant" (ConstantLR)
    lr_warmup_decay: float = 0.01  # the warm-up's start factor
    clip_grad_norm: float | None = None  # torch's clip_grad_norm_ of all gradients, before each step
    # torchvision's --model-ema: an EMA of the weights and buffers (`_ema`), updated after every
    # `model_ema_steps`-th step of an epoch, its decay `_ema.ema_decay(model_ema_decay, ...)`.
    model_ema: bool = False
    model_ema_steps: int = 32
    model_ema_decay: float = 0.99998
    seed: int = 0
    sync_bn: bool = False
    # Per-device BatchNorm's running statistics after each step: "mean" over the devices, or
    # "first": device 0's, as torch's DataParallel and DDP keep (`make_train_step(running_stats=)`).
    bn_stats: str = "mean"
    # How BatchNorm trains (`make_train_step(batchnorm=)`): "train" as torch's model.train();
    # "eval" as bn.eval() on each BatchNorm (running statistics used and kept, scale and bias
    # trained); "frozen" as torchvision's FrozenBatchNorm2d (scale and bias fixed too).
    bn_mode: str = "train"
    # torch's CrossEntropyLoss(label_smoothing=...) for the training loss; evaluation's stays plain.
    label_smoothing: float = 0.0
    # torchvision's --mixup-alpha, --cutmix-alpha (0: off): each global batch mixed in the step (`_mix`).
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    init: str | None = None
    trusted: bool = False  # allow a full unpickle of the `init` checkpoint (runs code from it)
    resume: bool = False
    dtype: str = "float32"
    # torchvision's data recipe for --data (`_presets`: presets.py's transforms); refused for the
    # digits. The sizes' None: derived from `image_size`, which `train_crop_size` is another name for.
    train_crop_size: int | None = None
    val_resize_size: int | None = None  # None: round(image_size * 256 / 224)
    val_crop_size: int | None = None  # None: image_size
    interpolation: str = "bilinear"  # or "nearest", "bicubic"
    auto_augment: str | None = None  # "ra", "ta_wide", "augmix" or an AutoAugmentPolicy's name
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0  # RandomErasing's p, after Normalize
    # torchvision's --ra-sampler, --ra-reps (repeated augmentation, its ResNet-50 recipe of 2021):
    # each epoch trains on `ra_reps` differently augmented copies of each image, N // 256 * 256
    # images in all (`_data.ra_epoch_order`).
    ra_sampler: bool = False
    ra_reps: int = 3
    # torchvision's --test-only: evaluate existing weights on the held-out split, train nothing and
    # write nothing (`_test_only`): `init`'s, or with `resume` the workdir's latest checkpoint's
    # (its EMA with `model_ema`, as torchvision evaluates model_ema then).
    test_only: bool = False
    checkpoint_every: int = 500  # steps; also at each epoch end
    keep_checkpoints: int = 3
    # --data's loader processes (None: up to 4). Like spawned ones, they run the calling script again
    # first: a script calling `train` needs an `if __name__ == "__main__":` guard (refused without).
    workers: int | None = None
    max_steps: int | None = None  # stop after this global step (tests, smoke runs)
    memory_limit_bytes: int | None = None  # for --batch-size auto; default: the device's
    progress: bool | None = True  # None: a progress bar only when stderr is a terminal (not in logs)
    devices: int | None = None  # single process: use only the first N local devices
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def validate(self) -> None:
        """The checks `train` makes first, for callers that write something before calling it.

        Raises:
          ConfigError: a setting that `train` would refuse, named with its flag and the fix.
        """
        _validate(self)


def _validate(cfg: TrainConfig) -> None:
    # --test-only of --init's weights reads and writes no workdir: it may be None.
    no_workdir = cfg.workdir is None and cfg.test_only is True and cfg.init is not None and not cfg.resume
    # "" is no directory: it failed with "No such file or directory: ''" after the model was built.
    if not no_workdir and (not isinstance(cfg.workdir, (str, os.PathLike)) or not os.fspath(cfg.workdir)):
        raise ConfigError(f"`--workdir` (={cfg.workdir!r}) must be a directory path, new or existing")
    for name in ("data", "init"):  # `os.path.isdir(5)` asks about file descriptor 5
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
            raise ConfigError(f"`--{name}` (={value!r}) must be a path, or None")
    blocking = None if no_workdir else next((p for p in (cfg.workdir, *map(str, Path(cfg.workdir).parents))
                                             if os.path.exists(p) and not os.path.isdir(p)), None)
    if blocking is not None:
        where = "is a file" if blocking == cfg.workdir else f"is inside '{blocking}', which is a file"
        raise ConfigError(f"`--workdir` (={cfg.workdir}) {where}, not a directory; pass a new or existing directory")
    if not cfg.test_only:  # (which writes nothing there)
        _check_workdir(cfg)
    one_of("--arch", cfg.arch, list(ARCHS))
    # The library takes any Python value: a float, bool or string in an integer setting failed deep
    # in numpy or jax (or ran with 1.5 or True), naming none of the settings.
    for name in ("epochs", "image_size", "checkpoint_every", "keep_checkpoints", "max_steps", "devices", "ra_reps",
                 "grad_accum_steps"):
        value = getattr(cfg, name)
        flag = name if name == "devices" else "--" + name.replace("_", "-")  # `devices`: library only
        if value is not None and not is_int(value):
            raise ConfigError(f"`{flag}` (={value!r}) must be an integer >= 1")
        if value is not None and value < 1:
            raise ConfigError(f"`{flag}` (={value}) must be >= 1")
    if cfg.workers is not None and not (is_int(cfg.workers) and cfg.workers >= 0):
        what = "must be >= 0" if is_int(cfg.workers) else "must be an integer >= 0"
        raise ConfigError(f"`--workers` (={cfg.workers!r}) {what} (0 loads in the main process)")
    # numpy's data order takes seeds >= 0, jax's key ones < 2**63: others were internal errors.
    if not (is_int(cfg.seed) and 0 <= cfg.seed < 2**63):
        raise ConfigError(f"`--seed` (={cfg.seed!r}) must be an integer from 0 to 2**63 - 1")
    one_of("--dtype", cfg.dtype, DTYPES, why=_NOT_TRAINED, aliases=_DTYPE_ALIASES)
    one_of("--bn-stats", cfg.bn_stats, RUNNING_STATS)
    one_of("--bn-mode", cfg.bn_mode, BATCHNORM_MODES)
    if cfg.sync_bn and cfg.bn_mode != "train":
        raise ConfigError(f"`--sync-bn` synchronises the batch statistics of train-mode BatchNorm, and with "
                          f"`--bn-mode` (={cfg.bn_mode}) BatchNorm normalises with its running statistics, the same "
                          "on every device: leave out one of the two")
    check_label_smoothing(cfg.label_smoothing, "--label-smoothing")
    _mix.check_alpha(cfg.mixup_alpha, "--mixup-alpha")
    _mix.check_alpha(cfg.cutmix_alpha, "--cutmix-alpha")
    # `not x > 0` rather than `x <= 0`: NaN fails every comparison and must be refused too.
    if not (is_real(cfg.lr) and math.isfinite(cfg.lr) and cfg.lr > 0):
        raise ConfigError(f"`--lr` (={shown(cfg.lr)}) must be a finite number > 0")
    for name in ("momentum", "weight_decay"):
        finite("--" + name.replace("_", "-"), getattr(cfg, name), minimum=0)
    _recipe.check(cfg)
    _presets.check(cfg)
    _ema.ema_decay(cfg.model_ema_decay, cfg.model_ema_steps, 1, cfg.epochs)  # checks the two (the batch: below)
    if cfg.batch_size != "auto" and (not is_int(cfg.batch_size) or cfg.batch_size < 1):
        raise ConfigError(f"`--batch-size` (={cfg.batch_size!r}) must be a positive integer or 'auto'")
    # Was a bare TypeError ("'>' not supported") after a compile, or "more than the -0 MiB available".
    if cfg.memory_limit_bytes is not None and not (is_int(cfg.memory_limit_bytes) and cfg.memory_limit_bytes >= 1):
        raise ConfigError(f"`memory_limit_bytes` (={cfg.memory_limit_bytes!r}) must be a number of bytes >= 1 "
                          "(e.g. 8 << 30 for 8 GiB), or None for the device's memory")
    for name in ("sync_bn", "trusted", "resume", "model_ema", "ra_sampler", "test_only"):
        if not isinstance(getattr(cfg, name), (bool, np.bool_)):
            raise ConfigError(f"`--{name.replace('_', '-')}` (={getattr(cfg, name)!r}) must be True or False")
    if cfg.test_only and not (cfg.init or cfg.resume):
        raise ConfigError("`--test-only` evaluates existing weights: give --init CHECKPOINT (a torch checkpoint, "
                          "ported variables or a workdir) or --resume (the latest checkpoint in --workdir)")
    if cfg.test_only and cfg.batch_size == "auto":
        raise ConfigError("`--batch-size` (=auto) measures a training step; --test-only evaluates only: give a "
                          "number, e.g. 64 (the default)")
    if cfg.data is not None and not os.path.isdir(cfg.data):
        raise ConfigError(f"`--data` (={cfg.data}) is not a directory; pass an ImageFolder directory "
                          "(one sub-folder per class) or leave --data out to train on the embedded digits")
    if cfg.data is not None and not cfg.test_only:
        # Its checkpoints and plot would be scanned as images: a class more in every later run
        # (the plot is a real PNG), and --resume refused for a class set that changed under it.
        data, work = os.path.realpath(cfg.data), os.path.realpath(cfg.workdir)
        if work == data or work.startswith(data + os.sep):
            inside = os.path.relpath(work, data).split(os.sep)[0]
            raise ConfigError(f"`--workdir` (={cfg.workdir}) is inside `--data` (={cfg.data}), where its checkpoints "
                              f"and plot would be read as a class '{inside}'; choose a --workdir outside the data "
                              "directory (nothing was written)")


def _plain(cfg: TrainConfig) -> TrainConfig:
    """`cfg` (validated) with numpy scalars as the Python values they equal, and `dtype` by its
    name. `validate` takes `np.int64(8)`, `np.float32(0.05)`, `np.bool_(False)` and
    `np.dtype("float32")`, but the run's settings go into every checkpoint as JSON: those
    trained up to the first checkpoint, then failed there ("Object of type bool is not JSON
    serializable") with the steps lost."""
    def plain(value):
        if isinstance(value, np.bool_):
            return bool(value)
        return int(value) if isinstance(value, np.integer) else float(value) if isinstance(value, np.floating) else value
    values = {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    values["dtype"] = next(name for name in DTYPES if cfg.dtype == name)
    values |= _recipe.names(cfg)  # torchvision's names in any case: SGD_Nesterov is sgd-nesterov
    values |= _presets.resolve(cfg)  # the sizes --data's images are cropped and resized to
    return dataclasses.replace(cfg, **values)


def _check_workdir(cfg: TrainConfig) -> None:
    """Refuse, before anything is written, a run that would overwrite an earlier one's files.

    A fresh run truncates `metrics.jsonl` and replaces the plot and `variables.safetensors`, so
    a workdir holding any of them (or checkpoints) continues only with `resume`. An empty
    `checkpoints/` (a run that failed before its first checkpoint) holds nothing to lose, nor
    one holding only `<step>.orbax-checkpoint-tmp` directories (a run killed while it wrote its
    first checkpoint): no run can restore them, and the new run's checkpoint manager removes them.
    `init` may never be one of those files: the run would read it, then write over it.
    """
    work = os.path.realpath(cfg.workdir)
    ckpt = os.path.join(work, "checkpoints")
    if cfg.init is not None:
        init = os.path.realpath(cfg.init)
        if init in (work, ckpt, *(os.path.join(work, n) for n in OUTPUTS)) or init.startswith(ckpt + os.sep):
            raise ConfigError(f"`--init` (={cfg.init}) is among the files `--workdir` (={cfg.workdir}) is written "
                              "with, and this run would replace it; copy it out of the workdir first, or choose "
                              "another --workdir")
    # Asked now, not when the first checkpoint is written after loading the data and compiling.
    blocked = unwritable(os.path.join(work, "metrics.jsonl"))
    if blocked:
        raise ConfigError(f"`--workdir` (={cfg.workdir}) cannot be written: {blocked}; choose another directory")
    # checkpoints/ too (a workdir made by another user, handed over with a `chown` without -R):
    # it was found at the first checkpoint, every step trained until then lost, and so again
    # on each --resume the error advised.
    blocked = unwritable(os.path.join(ckpt, "probe"))
    if blocked:
        raise ConfigError(f"`--workdir` (={cfg.workdir}) cannot hold checkpoints: {blocked}; fix its permissions, "
                          "or choose another directory")
    # A live run's lock, asked now: it was met only after loading the data and compiling (minutes
    # for ResNet-50 on a real --data). Shared, and released at once, so that the processes of
    # one multi-process run, which all check here before any of them takes the lock, never
    # refuse each other.
    if os.path.isdir(work):
        fd = _hold_workdir(work, shared=True)
        if fd is not None:
            os.close(fd)
    if not cfg.resume:
        _refuse_earlier_run(cfg.workdir)


def _refuse_earlier_run(workdir: str) -> None:
    """Refuse a fresh run into `workdir` where an earlier run's files are (`_check_workdir`).

    Asked at start-up, and again by the run's first process once it holds the workdir's lock:
    another run could write its files in between (its data scan or --init load was that slow),
    and this one would then have truncated its metrics.jsonl and rotated its checkpoints away.
    """
    work = os.path.realpath(workdir)
    if not os.path.isdir(work):
        return
    ckpt = os.path.join(work, "checkpoints")
    # (An empty metrics.jsonl, a run stopped by a full disk as it appended its first row, holds
    # nothing either.)
    held = [n for n in OUTPUTS if os.path.exists(path := os.path.join(work, n))
            and not (n == "metrics.jsonl" and os.path.isfile(path) and not os.path.getsize(path))]
    kept = [n for n in os.listdir(ckpt) if _checkpoint.TMP_DIR_SUFFIX not in n] if os.path.isdir(ckpt) else []
    if kept:
        steps = [int(n) for n in kept if n.isdigit()]
        held.insert(0, "checkpoints/" + (f" (latest step {max(steps)})" if steps else ""))
    if held:
        raise ConfigError(f"`--workdir` (={workdir}) already holds {', '.join(held)} from an earlier run; pass "
                          "--resume to continue it, or choose a new directory (nothing was changed)")


def _refuse_changed_since_start(cfg: TrainConfig, step: int | None, meta: dict | None) -> None:
    """Under the workdir's lock, refuse a run whose workdir another run wrote into since start-up.

    A fresh run repeats the check for an earlier run's files. A resumed one compares the latest
    checkpoint with the one it found at start-up (`step`, `meta`): its weights (zero placeholders
    when one was found) and its checks were made for that one, and a run that finished meanwhile
    would be resumed from a checkpoint this one never looked at.
    """
    if not cfg.resume:
        _refuse_earlier_run(cfg.workdir)
        return
    now = _latest_step(cfg.workdir)
    if now is None and step is not None:
        return  # gone altogether: said below, where the restore finds no checkpoint
    if now != step or (now is not None and _checkpoint.peek_meta(cfg.workdir, now) != meta):
        was = "no checkpoint" if step is None else f"checkpoint step {step}"
        is_ = f"checkpoint step {now}" if now != step else f"a checkpoint step {now} written anew"
        raise ConfigError(f"--resume: `--workdir` (={cfg.workdir}) held {was} when this run started, and {is_} "
                          "once it had the workdir to itself: another run wrote into it meanwhile; run the command "
                          "again to resume from the checkpoint there now (nothing was changed)")


def _read_metrics(path: str, torn_ok: bool = False) -> list[dict]:
    """The rows of a `metrics.jsonl`, one JSON object per epoch; blank lines are ignored.

    With `torn_ok`, a last line that is not JSON and has no newline (a run killed while
    appending it) is dropped: its epoch was not checkpointed, so a resumed run writes it again.

    Raises:
      CheckpointError: a line that is not such a row, named by its number.
    """
    rows = []
    with open(path) as f:
        lines = f.readlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if torn_ok and n == len(lines) and not line.endswith("\n"):
                break
            why = f"not JSON: {e.msg}"
        else:
            missing = [k for k in METRIC_KEYS if k not in row] if isinstance(row, dict) else ["an object"]
            if not missing and not (isinstance(row["epoch"], int) and not isinstance(row["epoch"], bool)
                                    and row["epoch"] >= 0):
                missing = ["integer epoch (it is " + json.dumps(row["epoch"]) + ")"]
            if not missing:
                rows.append(row)
                continue
            why = f"no {', '.join(missing)}"
        raise CheckpointError(f"`{path}` line {n} is not a metrics row of `jaxport train` ({why}); repair or "
                              "delete that line, then rerun")
    return rows


def _append_metrics(path: str, row: dict, mngr) -> None:
    # Appended, not rewritten, so `tail -f` follows a run; a kill mid-line is what `torn_ok` drops.
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:  # a full disk said only "No space left on device": no file, nothing of what was kept
        raise CheckpointError(f"could not append epoch {row['epoch'] + 1}'s row to {path} ({_why(e)}); "
                              f"{_checkpoint.kept(mngr)}") from None


def _why(e: OSError) -> str:
    """What an OSError says failed, without the advice jaxport's writers add after a "; " ("free
    some space or write elsewhere", which read as if a run's training were lost), and its file."""
    return (e.strerror or str(e)).split("; ")[0] + (f" ({e.filename})" if e.filename else "")


def _latest_step(workdir: str) -> int | None:
    """The step of the latest finished checkpoint in `workdir`, or None, from the directory's
    listing alone: no manager, whose creation is a barrier every process would have to reach."""
    import orbax.checkpoint as ocp

    return max(ocp.utils.checkpoint_steps(_checkpoint.checkpoint_dir(workdir)), default=None)


def _flags(cfg: TrainConfig) -> dict:
    """The settings every process of a run must share, keyed by flag. Paths are left out (each
    machine may mount --data and --workdir elsewhere): their contents are checked instead."""
    shared = ("arch", "epochs", "batch_size", "grad_accum_steps", "image_size", "lr", "momentum", "weight_decay",
              *_recipe.DEFAULTS,
              "model_ema", "model_ema_steps", "model_ema_decay", *_presets.DEFAULTS,
              "seed", "sync_bn", "bn_stats", "bn_mode", "label_smoothing", "mixup_alpha", "cutmix_alpha", "resume",
              "dtype",
              "ra_sampler", "ra_reps", "test_only", "checkpoint_every", "keep_checkpoints", "max_steps", "devices", "num_processes")
    flags = {("devices" if k == "devices" else "--" + k.replace("_", "-")): getattr(cfg, k) for k in shared}
    return flags | {"--data given": cfg.data is not None, "--init given": cfg.init is not None}


def _min_per_device(image_size: int, sync_bn: bool, n_dev: int, bn_mode: str = "train") -> int:
    """The fewest images per device for which layer4's BatchNorm sees more than one value per
    channel (any number in eval mode, which takes no batch statistics)."""
    if bn_mode != "train":
        return 1
    return 1 if layer4_side(image_size) ** 2 * (n_dev if sync_bn else 1) >= 2 else 2


def _check_values_per_channel(per_device: int, image_size: int, sync_bn: bool, n_dev: int,
                              resumed_devices: int | None = None, bn_mode: str = "train", accum: int = 1) -> None:
    """Refuse, before compiling, a step whose BatchNorm at layer4 sees one value per channel.

    `resumed_devices`: the device count of the checkpoint's run when this run resumes one (0 if
    unknown). A resumed run keeps the checkpoint's batch and image size (--resume refuses
    others), so only --sync-bn or the device count can fix it there."""
    low = _min_per_device(image_size, sync_bn, n_dev, bn_mode)
    if per_device // accum >= low:
        return
    side = layer4_side(image_size)
    if accum > 1:  # each pass normalises its chunk alone: fewer passes, not another batch, is the fix
        fits = max(d for d in divisors(per_device) if d < accum and per_device // d >= low)  # 1 does
        fix = f"use --grad-accum-steps {fits}" + ("" if sync_bn or n_dev == 1 else ", or --sync-bn")
        raise ConfigError(f"`--grad-accum-steps` (={accum}) splits the {per_device} images per device into passes of "
                          f"{per_device // accum}, and at `--image-size` (={image_size}) layer4's maps are "
                          f"{side}x{side}: train-mode BatchNorm would see one value per channel in each pass, which "
                          f"torch refuses (every output would be the bias); {fix}")
    sync = [] if sync_bn or n_dev == 1 else ["--sync-bn"]
    if resumed_devices is None:
        fixes = f"use {' or '.join([f'--batch-size {2 * n_dev} (2 per device)'] + sync)}, or --image-size 33 or more"
    else:
        had = f" (the checkpoint's run had {resumed_devices})" if resumed_devices else ""
        fixes = ("a resumed run keeps the checkpoint's batch and image size: "
                 f"{'use --sync-bn, or ' if sync else ''}resume where jax sees at most {per_device * n_dev // 2} "
                 f"device{'s' if per_device * n_dev // 2 > 1 else ''}{had}")
    raise ConfigError(f"`--batch-size` (={per_device * n_dev}) gives {per_device} image per device, and at "
                      f"`--image-size` (={image_size}) layer4's maps are {side}x{side}: train-mode BatchNorm would see "
                      f"one value per channel, which torch refuses (every output would be the bias); {fixes}")


def _check_accum(batch: int, n_dev: int, accum: int) -> None:
    """Refuse a per-device batch that `--grad-accum-steps` does not split into equal passes,
    naming the step counts and the batch sizes that do."""
    per_device = batch // n_dev
    if per_device % accum == 0:
        return
    steps = divisors(per_device)[1:]
    unit = n_dev * accum
    down, up = batch // unit * unit, (batch // unit + 1) * unit
    sizes = f"--batch-size {up}" if not down else f"--batch-size {down} or {up}"
    raise ConfigError(f"`--grad-accum-steps` (={accum}) must divide the images per device (`--batch-size` {batch} over "
                      f"{n_dev} device(s): {per_device}) into equal passes; use "
                      + (f"--grad-accum-steps {' or '.join(map(str, steps[:4]))}, or " if steps else "")
                      + f"{sizes} (multiples of {unit})")


def _recorded_devices(meta: dict | None) -> int:
    """The device count a checkpoint's metadata records; 0 when it does not say."""
    n = ((meta or {}).get("settings") or {}).get("num_devices")
    return n if isinstance(n, int) else 0


def _check_auto_batch_fits_data(cfg: TrainConfig, total: int, n_dev: int) -> None:
    """`--batch-size auto` needs an epoch's images (the `total` training images, or under
    --ra-sampler those rounded down to a multiple of 256) to give every device its smallest
    valid batch. It picked that batch anyway, then failed as if the user had passed it
    ("`--batch-size` (=8) is larger than the training set"), suggesting a size that was refused
    in turn."""
    num_examples = _epoch_images(cfg, total)
    # Under --ra-sampler the training set itself is not what was short: it was called "the
    # training set (1280 images)" of 1438 digits.
    epoch = (f"an epoch under `--ra-sampler` ({num_examples} of the {total} training images, rounded down to a "
             "multiple of 256 as torchvision's RASampler does)" if cfg.ra_sampler else
             f"the training set ({num_examples} images)")
    low = _min_per_device(cfg.image_size, cfg.sync_bn, n_dev, cfg.bn_mode)
    k = cfg.grad_accum_steps
    if num_examples >= low * k * n_dev:
        return
    if num_examples >= low * n_dev:  # one pass fits the data: fewer of them do
        raise ConfigError(f"`--batch-size auto` with `--grad-accum-steps` (={k}): {epoch} gives at most "
                          f"{num_examples // n_dev} images per device on {n_dev} device(s), fewer than {k} passes of "
                          f"{low}, the smallest pass; use --grad-accum-steps {num_examples // n_dev // low} or fewer, "
                          "or more training images")
    if num_examples < n_dev:
        raise ConfigError(f"`--batch-size auto`: {epoch} has fewer images than the "
                          f"{n_dev} devices, and a step needs at least one image per device; add training images"
                          + (", or leave out --ra-sampler" if cfg.ra_sampler else ""))
    side = layer4_side(cfg.image_size)
    need = -(-low * n_dev // 256) * 256 if cfg.ra_sampler else low * n_dev
    fixes = ([] if cfg.sync_bn or n_dev == 1 else ["--sync-bn"]) + [f"at least {need} training images",
                                                                     "--image-size 33 or more"]
    raise ConfigError(f"`--batch-size auto`: {epoch} gives at most "
                      f"{num_examples // n_dev} image per device on {n_dev} device(s), and at `--image-size` "
                      f"(={cfg.image_size}) layer4's maps are {side}x{side}: train-mode BatchNorm needs {low} per device "
                      f"(one value per channel otherwise, which torch refuses); use {', or '.join(fixes)}")


def _digest(variables) -> str:
    """A fingerprint of every array's shape, dtype and bytes, in tree order."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path(variables):
        x = np.ascontiguousarray(x)
        h.update(f"{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape};".encode())
        h.update(x.view(np.uint8).reshape(-1) if x.size else b"")
    return h.hexdigest()[:16]


def _names(classes: list) -> str:
    shown = ", ".join(map(str, classes[:8]))
    return f"[{shown}{', ...' if len(classes) > 8 else ''}]"


def _check_resumable(saved: dict, meta: dict, workdir: str) -> None:
    """Refuse to resume a checkpoint of another model, label set or data pipeline.

    Checked on the checkpoint's metadata before its state is read: restoring another
    architecture or head fails deep in orbax (and blames the checkpoint), and the same number
    of differently named classes would restore without error and give every label a new meaning.
    """
    def run(m):
        classes = m.get("classes")
        return f"{m.get('arch')} on {m.get('num_classes')} classes" + (f" {_names(classes)}" if classes else "")

    if (saved.get("arch"), saved.get("num_classes")) != (meta["arch"], meta["num_classes"]) or (
            saved.get("classes") is not None and list(saved["classes"]) != meta["classes"]):
        raise ConfigError(f"--resume: the checkpoint in {workdir} was trained as {run(saved)}; this run asks for "
                          f"{run(meta)}; use the same --arch and --data, or a new --workdir")
    # The data set's size fixes steps per epoch, hence which epoch the checkpoint's step falls in,
    # the data order and which metrics rows are kept; its files fix which images are held out.
    # A changed --data (images added, removed or replaced) resumed mid-way through another epoch,
    # dropped finished epochs' rows and reported an epoch trained on a few steps as whole.
    was, now = saved.get("data"), meta["data"]
    if was is not None and was != now and not _replaced_in_place(was, now):
        what = (f"{now['train']} train / {now['val']} val images, the checkpoint's run had {was['train']} / "
                f"{was['val']}" if (was["train"], was["val"]) != (now["train"], now["val"]) else
                "the same number of images, but other files (names, labels or sizes)")
        raise ConfigError(f"--resume: `--data` has changed since the checkpoint in {workdir} was written ({what}); "
                          "its epochs, data order and held-out split would no longer be that run's: restore the "
                          "data, or start a new --workdir (--init it from this one to keep its weights)")
    for key in ("seed", "batch_size", "image_size"):
        if key in meta and saved.get(key) != meta[key]:  # (the early check has no batch size under auto)
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"--resume: `{flag}` (={meta[key]}) differs from the checkpoint's ({saved.get(key)}) "
                              f"in {workdir}; use {flag} {saved.get(key)} to continue that run")
    was, now = saved.get("ra_reps", 0), meta["ra_reps"]  # (0: none, as in checkpoints written before the flag)
    if was != now:
        def said(reps: int) -> str:
            return f"--ra-sampler --ra-reps {reps}" if reps else "no --ra-sampler"

        raise ConfigError(f"--resume: this run asks for {said(now)}, but the checkpoint's run in {workdir} trained with "
                          f"{said(was)}, which fixes its epochs' length and data order; resume with {said(was)}, or "
                          f"start a new --workdir (--init {shell_word(workdir)} starts it from these weights)")


def _ra_reps(cfg: TrainConfig) -> int:
    """The copies of each image an epoch trains on under --ra-sampler; 0 without it."""
    return cfg.ra_reps if cfg.ra_sampler else 0


def _epoch_images(cfg: TrainConfig, n: int) -> int:
    """The images an epoch trains on (before its last partial batch is left out), of `n`."""
    return _data.ra_epoch_images(n) if cfg.ra_sampler else n


def _replaced_in_place(was: dict, now: dict) -> bool:
    """Whether `--data` differs from the checkpoint's only in the sizes of some files: the same
    files by name and label, so the same epochs, data order and held-out split. That is what
    mending an image does (a good copy of one that failed to decode mid-run, or one re-encoded,
    as `_data.ImageError` advises), and what --resume must then take. (Checkpoints written before
    the names were recorded apart compare whole, as then.)"""
    return was.get("names") is not None and all(was.get(k) == now.get(k) for k in ("train", "val", "names"))


def _check_resumable_early(cfg: TrainConfig, data, files) -> tuple[int | None, dict | None]:
    """`_check_resumable` before the model is built: a --resume of another model or label set
    (or data, seed, size) initialised its model first, compiling for seconds (~6 s for
    ResNet-18, ~12 s for ResNet-50), only to be refused. The latest checkpoint's metadata file is
    read directly, since creating a checkpoint manager is a barrier across processes; what
    cannot be read here is left to the check before restoring, which reports it.

    Returns the latest checkpoint's step (None: no checkpoint) and its metadata (None: unreadable)."""
    step = _latest_step(cfg.workdir)
    saved = None if step is None else _checkpoint.peek_meta(cfg.workdir, step)
    if saved is not None:
        batch = {} if cfg.batch_size == "auto" else {"batch_size": cfg.batch_size}  # auto: not known yet
        _check_resumable(saved, _run_meta(cfg, data, files) | batch, cfg.workdir)
        _check_optimizer_state(saved.get("settings"), _settings(cfg), cfg.workdir)
    return step, saved


def _run_meta(cfg: TrainConfig, data, files: dict[str, str]) -> dict:
    """What every checkpoint records of the run that wrote it, for --resume to compare
    (`_check_resumable`) and `jaxport export` to read (the arch). `files`: `Data.fingerprint()`'s
    digests."""
    return {"arch": cfg.arch, "num_classes": data.num_classes, "classes": data.classes, "seed": cfg.seed,
            "image_size": cfg.image_size, "ra_reps": _ra_reps(cfg),
            "data": {"train": data.train.num_examples, "val": data.val.num_examples, **files}}


# Settings a resumed run may change (they act from the resumed step on), recorded in every
# checkpoint so the change is said, never silent. Those that fix the optimizer state's structure
# change only where it stays the same (`_check_optimizer_state`).
# (--train-crop-size is not: it is the run's --image-size, which a resume must keep.)
_RESUMABLE = ("epochs", "lr", "momentum", "weight_decay", *_recipe.DEFAULTS, "sync_bn", "bn_stats", "bn_mode",
              "label_smoothing", "grad_accum_steps",
              "mixup_alpha", "cutmix_alpha", "dtype", "model_ema", "model_ema_steps", "model_ema_decay",
              *(k for k in _presets.DEFAULTS if k != "train_crop_size"))
# What checkpoints written before a setting was recorded trained with, so that a resume with
# another value says so too (and one with the same values, silently).
_BEFORE_RECORDED = {"bn_stats": "mean", "bn_mode": "train", "label_smoothing": 0.0, "mixup_alpha": 0.0,
                    "cutmix_alpha": 0.0, "grad_accum_steps": 1,
                    **_recipe.DEFAULTS,
                    **{k: getattr(TrainConfig, k) for k in ("model_ema", "model_ema_steps", "model_ema_decay")},
                    # (not the held-out sizes: earlier runs derived them from --image-size, unrecorded)
                    **{k: v for k, v in _presets.DEFAULTS.items() if k not in _presets.SIZES}}


def _step_options(cfg: TrainConfig) -> dict:
    """`make_train_step`'s options for the run: the running statistics kept, BatchNorm's mode,
    the loss's label smoothing, and MixUp and CutMix (whose draws come from `--seed`). One
    place, so that the steps `--batch-size auto` and the out-of-memory advice measure are the
    one that trains."""
    return {"running_stats": cfg.bn_stats, "batchnorm": cfg.bn_mode, "label_smoothing": cfg.label_smoothing,
            "mixup_alpha": cfg.mixup_alpha, "cutmix_alpha": cfg.cutmix_alpha, "seed": cfg.seed,
            "accum_steps": cfg.grad_accum_steps}


# A process that calls `train` again (a notebook's reruns, a resumed run, a test suite) gets the
# jitted programs of an earlier call with the same model, devices, optimizer and step options:
# each call used to build new closures, which jax traced, lowered and compiled again (ResNet-18
# at 16 px, 2 steps on 8 CPU devices: 12.4 s a call, 3.0 s with a persistent compilation cache;
# 1.3 s either way when the programs are reused). The key holds everything the programs close
# over: the model (a Flax module compares by its fields), the mesh, every `_recipe.Recipe` field
# (all the optimizer reads) with the steps per epoch its schedule counts, `make_train_step`'s
# options, and the two builders themselves (a builder replaced in this module, as tests do,
# neither gets nor leaves programs built by another). jax's own caches still retrace for another
# jax configuration (x64, matmul precision) or input shape. Two entries: the programs hold
# compiled executables, and a sweep alternates between few settings.
def _recipe_key(cfg: TrainConfig) -> tuple:
    """The `_recipe.Recipe` fields of `cfg`: everything `_recipe.optimizer` reads."""
    return tuple((name, getattr(cfg, name)) for name in _recipe.Recipe.__annotations__)


@functools.lru_cache(maxsize=2)
def _programs(model, mesh, recipe: tuple, steps_per_epoch: int, options: tuple, builders: tuple) -> tuple:
    """`(tx, step, evaluate)` for a run: the optimizer of the recipe `recipe` (`_recipe_key`), its
    donating training step and the evaluation step from `builders` (`make_train_step`,
    `make_eval_step`), built once per key."""
    make_step, make_eval = builders
    # A namespace of the key's fields alone: an optimizer that read a field the key misses would fail
    # here rather than be cached for settings it does not tell apart.
    tx = _recipe.optimizer(types.SimpleNamespace(**dict(recipe)), steps_per_epoch)
    return tx, make_step(model, tx, mesh, **dict(options)), make_eval(model, mesh)


@functools.lru_cache(maxsize=2)
def _jitted_init(model) -> Callable:
    """`jax.jit(model.init)`, once per model (see `_programs`)."""
    return jax.jit(model.init)


def _test_only(cfg: TrainConfig, data: _data.Data, say: Callable[[str], None]) -> dict:
    """torchvision's `--test-only`: the held-out loss and accuracy of existing weights, which must
    be `cfg.arch` with a classifier of the data's classes (one re-initialised would be evaluated
    at chance). Nothing is trained, and nothing is written to the workdir.

    Returns `{"val_loss", "val_acc", "val_acc5", "test_only": <what was evaluated>}`: `val_acc5`
    is torchvision's Acc@5 (the label among the 5 largest logits; all of them with fewer classes)."""
    mesh = make_mesh(jax.devices()[:cfg.devices] if cfg.devices else None)
    check_batch_size(cfg.batch_size, mesh.devices.size, "--batch-size")
    _check_accum(cfg.batch_size, mesh.devices.size, cfg.grad_accum_steps)  # evaluated in one pass's batches
    model = build(cfg.arch, num_classes=data.num_classes, dtype=jnp.bfloat16 if cfg.dtype == "bfloat16" else None)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, cfg.image_size, cfg.image_size, 3)))
    if cfg.resume:
        variables, arch, step = _checkpoint.read_latest(cfg.workdir, ema=cfg.model_ema)
        what = f"{'the --model-ema average of ' if cfg.model_ema else ''}checkpoint step {step} in {cfg.workdir}"
        if cfg.init:
            say(f"--init {cfg.init} is not used (--test-only --resume evaluates the checkpoint in {cfg.workdir})")
        meta = _checkpoint.peek_meta(cfg.workdir, step) or {}
        if arch not in (None, cfg.arch):
            raise ConfigError(f"--test-only --resume: {what} is a {arch}, not `--arch` {cfg.arch}; use --arch {arch}")
        classes = meta.get("classes")
        if classes is not None and list(classes) != data.classes:
            raise ConfigError(f"--test-only --resume: {what} was trained on the classes {_names(classes)}, and --data "
                              f"has {_names(data.classes)}: its outputs would mean other labels; evaluate it on its "
                              "own --data")
    else:
        variables = load_init(cfg.init, cfg.arch, cfg.trusted, say=say)
        what = f"--init {cfg.init}"
    head = np.shape(variables.get("params", {}).get("fc", {}).get("kernel", ()))
    if head[1:] != (data.num_classes,):
        has = f"a classifier of {head[1]} classes" if len(head) == 2 else "no classifier (a backbone)"
        raise ConfigError(f"--test-only: {what} has {has}, and --data has {data.num_classes} classes; it evaluates "
                          "weights as they are: give weights trained on these classes, or train (without "
                          "--test-only) to fit a new classifier")
    variables = fit_head(variables, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), lambda m: None, cfg.arch)
    row = _evaluate(make_eval_step(model, mesh), replicate(variables, mesh), data.val,
                    cfg.batch_size // cfg.grad_accum_steps, mesh, top5=True)
    say(f"--test-only: {what} on {data.val.num_examples} held-out images of {data.num_classes} classes: val loss "
        f"{row['val_loss']:.4f} acc {row['val_acc']:.4f} (top-5 {row['val_acc5']:.4f})")
    return row | {"test_only": what}


def _memory_for_steps(cfg: TrainConfig, variables, log: Callable[[str], None]) -> int:
    """Bytes per device the training step may use: the device's (or `memory_limit_bytes`), less
    what stays on every device beside the step's buffers: with --model-ema, its average (a copy
    of the variables)."""
    limit = cfg.memory_limit_bytes or _memory.device_memory_bytes()
    if cfg.model_ema:
        limit = _memory.leave_for(limit, "--model-ema's average", _memory.tree_bytes(variables), log=log)
    return limit


def _settings(cfg: TrainConfig) -> dict:
    """The settings every checkpoint records, for a resumed run to compare (`_changes`)."""
    return {k: getattr(cfg, k) for k in _RESUMABLE}


def _check_optimizer_state(saved: dict | None, now: dict, workdir: str) -> None:
    """Refuse to resume into an optimizer state of another structure than the checkpoint's, which
    it cannot be restored into (`_recipe.state_structure`): another optimizer, weight decay
    groups, or (SGD) a momentum or weight decay changed to or from 0, as torch keeps no momentum
    buffer or decay step for 0. And a `--model-ema` added or dropped (the checkpoint's EMA)."""
    if saved is None:  # written before settings were recorded: the restore says what differs
        return
    saved = _BEFORE_RECORDED | saved
    if saved["model_ema"] != now["model_ema"]:
        # Refused both ways. Added, the EMA of the steps already trained is lost (torchvision's own
        # resume fails on the checkpoint's missing "model_ema"); dropped, the run would end with
        # no EMA of its last steps, beside an earlier `variables_ema.safetensors` of older ones.
        if now["model_ema"]:
            raise ConfigError(f"--resume: `--model-ema` cannot be added to the run in {workdir}, trained without it: "
                              "its EMA would start at the resumed step, not be the average of the whole run; resume "
                              "without --model-ema, or start a new --workdir with --model-ema (--init "
                              f"{shell_word(workdir)} starts it from these weights)")
        raise ConfigError(f"--resume: the run in {workdir} was trained with --model-ema: resume with --model-ema (its "
                          "EMA continues), or start a new --workdir without it (--init "
                          f"{shell_word(workdir)} starts it from these weights)")
    for (key, was), (_, is_) in zip(_recipe.state_structure(saved), _recipe.state_structure(now)):
        if was == is_:
            continue
        flag, old, new = "--" + key.replace("_", "-"), saved[key], now[key]
        if key == "opt":
            raise ConfigError(f"--resume: `--opt` (={new}) cannot continue the run in {workdir}, trained with --opt "
                              f"{old}: SGD, AdamW and RMSprop keep different optimizer states (a momentum "
                              "buffer; two moment estimates; a squared-gradient average), so the checkpoint cannot be "
                              f"restored; resume with --opt {old}, or start a new --workdir (--init "
                              f"{shell_word(workdir)} starts it from these weights)")
        if key in ("norm_weight_decay", "bias_weight_decay") and (old is None) != (new is None):
            trained = "without it" if old is None else f"with {flag} {old}"
            fix = f"without {flag}" if old is None else f"with {flag} {old}"
            whose = "the BatchNorm parameters'" if key == "norm_weight_decay" else "the biases'"
            raise ConfigError(f"--resume: `{flag}` (={'not given' if new is None else new}) cannot continue "
                              f"the run in {workdir}, trained {trained}: a {flag} keeps {whose} "
                              "optimizer state apart from the others' (torch's param groups), so the "
                              f"checkpoint cannot be restored; resume {fix}, or start a new --workdir")
        raise ConfigError(f"--resume: `{flag}` (={new}) cannot continue the run in {workdir}, trained with "
                          f"{flag} {old}: changing it to or from 0 changes what the optimizer keeps "
                          f"(its state), so the checkpoint cannot be restored; resume with a {flag} that is "
                          f"{'0' if old == 0 else 'not 0'}, or start a new --workdir")


def _changes(saved: dict | None, now: dict, batch: int | None = None, trains: bool = True) -> str:
    """` with changed settings: --lr 0.01 (was 0.05), ...`, or nothing. `trains`: whether any step
    is left to run (if not, a new --epochs moves no schedule: nothing is said of it)."""
    if saved is None:  # written before settings were recorded
        return " (its checkpoint does not record the earlier settings; this run uses the ones given now)"
    def change(k: str) -> str:  # a switch as the command line has it: "--sync-bn (was off)", not "True (was False)"
        name = "--" + k.replace("_", "-")
        if isinstance(now[k], bool):
            return f"{name} (was off)" if now[k] else f"no {name} (was on)"
        if now[k] is None or saved[k] is None:  # an optional setting: "--clip-grad-norm 1.0 (was off)"
            return f"no {name} (was {saved[k]})" if now[k] is None else f"{name} {now[k]} (was off)"
        return f"{name} {now[k]} (was {saved[k]})"

    saved = _BEFORE_RECORDED | saved
    changed = [change(k) for k in _RESUMABLE if k in saved and saved[k] != now[k]]
    # Another device count resumes exactly with SyncBatchNorm, but per-device BatchNorm then
    # normalises over another number of images: a change of the training, said like the others.
    was, n = saved.get("num_devices"), now.get("num_devices")
    if was is not None and n is not None and was != n:
        # (over each --grad-accum-steps pass's images)
        k, k_was = now.get("grad_accum_steps", 1), saved.get("grad_accum_steps", 1)
        bn = "" if now["sync_bn"] or batch is None else (
            f": per-device BatchNorm now normalises over {batch // n // k} images, was {batch // was // k_was}")
        changed.append(f"{n} device(s) (was {was}{bn})")
    if not changed:
        return ""
    # (the other schedulers do not depend on --epochs)
    schedule = (" (the cosine schedule now ends at the new --epochs)" if trains and saved.get("epochs") != now["epochs"]
                and now["lr_scheduler"] == "cosineannealinglr" else "")
    return f" with changed settings: {', '.join(changed)}{schedule}"


def _last_step(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """The global step the run ends at: the last epoch's end, or --max-steps before it."""
    end = steps_per_epoch * cfg.epochs
    return end if cfg.max_steps is None else min(cfg.max_steps, end)


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (e.g. a scheduler's preemption) stopped `train` after it had
    checkpointed the last finished step; `--resume` continues exactly from there."""

    def __init__(self, signum: int, step: int, workdir: str, note: str = ""):
        self.signum, self.step, self.workdir = signum, step, workdir
        super().__init__(f"{signal.Signals(signum).name} at step {step}: checkpoint saved in {workdir}"
                         f"{f' ({note})' if note else ''}; continue with --resume")


class _StopRequests:
    """Turns SIGINT/SIGTERM into a request to stop at a step boundary, with a checkpoint.

    Without it, Ctrl-C or a scheduler's SIGTERM loses every step since the last periodic
    checkpoint (500 by default). `poll(step)` is called after every step by every process.
    - One process: the first signal only sets `signum` and puts the previous handlers back,
      so a second one acts at once (orbax's atomic saves keep that safe too). Handlers can only
      be set from the main thread; elsewhere signals keep their default effect. A signal the
      process ignores (SIG_IGN: a background job's SIGINT) stays ignored.
    - Several processes must agree on the step to save. jax.distributed's preemption service
      already takes SIGTERM on every process and runs that agreement;
      `reached_preemption_sync_point` is true on all of them at the same step. SIGINT keeps its
      default effect there.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, processes: int, say: Callable[[str], None] = lambda msg: None):
        self.say = say
        self.multi = processes > 1
        self.enabled = not self.multi and threading.current_thread() is threading.main_thread()
        self.signum: int | None = None
        self._previous: dict = {}

    def poll(self, step: int) -> bool:
        """Whether to stop after `step` (stays true once it is)."""
        if self.multi and self.signum is None:
            from jax.experimental import multihost_utils

            try:
                if multihost_utils.reached_preemption_sync_point(step):
                    self.signum = signal.SIGTERM
            except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
                self.multi = False
        return self.signum is not None

    def _handle(self, signum, frame):
        self.signum = signum
        self._restore()
        # Said at once: the stop waits for the step (or the epoch's evaluation, minutes on a large
        # val set) and the checkpoint, and a silent wait drew the second Ctrl-C that lost them.
        name = signal.Signals(signum).name
        self.say(f"{name} received: stopping after this step (or this epoch's evaluation), once it is checkpointed; "
                 f"another {'Ctrl-C' if signum == signal.SIGINT else name} stops at once, without that checkpoint")

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self):
        if self.enabled:
            # A signal the process was started ignoring stays ignored, as Python itself leaves
            # it: a script's background job (`cmd &`, `nohup`) ignores SIGINT so that a Ctrl-C
            # meant for the foreground does not reach it. Taking it over answered that Ctrl-C,
            # then put the ignoring back, so the "another Ctrl-C stops at once" it promised did not.
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self._SIGNALS
                              if signal.getsignal(sig) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc):
        self._restore()


def _batches(order: np.ndarray, start: int, stop: int, batch: int, process: int, processes: int):
    share = batch // processes
    for s in range(start, stop):
        rows = order[s * batch:(s + 1) * batch]
        yield rows[process * share:(process + 1) * share]


def _evaluate(evaluate, variables, split: _data.Split, batch: int, mesh, top5: bool = False) -> dict:
    """`{"val_loss", "val_acc"}` over `split` (and `val_acc5`, torchvision's Acc@5, with `top5`)."""
    p, n_proc = jax.process_index(), jax.process_count()
    share = batch // n_proc
    totals = np.zeros(4)
    n = split.num_examples
    chunks = [np.arange(i, min(i + batch, n)) for i in range(0, n, batch)]
    # Pad every chunk to the global batch; padded rows repeat example 0 and are masked out.
    padded = [np.concatenate([c, np.zeros(batch - len(c), int)]) for c in chunks]
    masks = [np.arange(batch) < len(c) for c in chunks]
    local = [pc[p * share:(p + 1) * share] for pc in padded]
    # closing(): an error here ends the stream now, handing the split's loader workers back to
    # the next evaluation (see `_data._Loader`).
    with contextlib.closing(split.stream(iter(local), 0)) as batches:
        for (x, y), m in zip(batches, masks):
            out = evaluate(variables, *shard_batch(mesh, x, y, m[p * share:(p + 1) * share].astype(np.float32)))
            totals += [float(out["loss_sum"]), float(out["correct"]), float(out["count"]), float(out["correct5"])]
    return {"val_loss": totals[0] / totals[2], "val_acc": totals[1] / totals[2],
            **({"val_acc5": totals[3] / totals[2]} if top5 else {})}


def plot_metrics(metrics_path: str, out_path: str) -> None:
    """A PNG of train/val loss and accuracy per epoch from `metrics.jsonl` (and the EMA's val
    loss and accuracy, where rows hold them: `--model-ema`)."""
    # A Figure of its own, not pyplot's: `matplotlib.use("Agg")` switched the caller's backend
    # (a notebook's inline plots stopped), and pyplot kept the figure when the write failed.
    from matplotlib.figure import Figure

    rows = _read_metrics(metrics_path)
    ep = [r["epoch"] + 1 for r in rows]  # 1-based, as the log lines count them
    fig = Figure(figsize=(10, 4))
    a, b = fig.subplots(1, 2)
    a.plot(ep, [r["train_loss"] for r in rows], "o-", label="train")
    a.plot(ep, [r["val_loss"] for r in rows], "o-", label="val")
    ema = [r for r in rows if "val_loss_ema" in r]  # --model-ema
    if ema:
        a.plot([r["epoch"] + 1 for r in ema], [r["val_loss_ema"] for r in ema], "o--", label="val (EMA)")
    a.set_yscale("log")  # the first epoch's val loss (BatchNorm statistics still settling) can be 100x the rest
    a.set_xlabel("epoch"), a.set_ylabel("cross-entropy"), a.legend(), a.grid(alpha=0.3)
    b.plot(ep, [r["train_acc"] for r in rows], "o-", label="train")
    b.plot(ep, [r["val_acc"] for r in rows], "o-", label="val")
    if ema:
        b.plot([r["epoch"] + 1 for r in ema], [r["val_acc_ema"] for r in ema], "o--", label="val (EMA)")
    b.set_xlabel("epoch"), b.set_ylabel("accuracy"), b.legend(), b.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")  # Agg: a Figure's own canvas draws PNG without a backend


def train(cfg: TrainConfig, log: Callable[[str], None] | None = None) -> dict:
    """Train `cfg.arch` data-parallel over every device.

    Returns the last evaluated epoch's metrics row (as in metrics.jsonl; none when no epoch
    ended in this call) plus `state` (the final `TrainState`) and `steps_run` (steps this call
    trained: 0 when resuming a run that is already at its last step, though it may evaluate its
    last epoch, trained before).

    Writes `WORKDIR/checkpoints/<step>` (orbax), `WORKDIR/metrics.jsonl` (one JSON object per
    epoch), `WORKDIR/training_curves.png` and the final `WORKDIR/variables.safetensors`; with
    `model_ema`, torchvision's EMA too: in each checkpoint, evaluated each epoch (`val_loss_ema`,
    `val_acc_ema`), and at the end in `WORKDIR/variables_ema.safetensors`. With `resume`,
    continues from the latest checkpoint exactly: same step, optimizer state (and EMA) and data
    order; `init` is then not read (it applies when there is no checkpoint yet). An epoch's row
    is written before its checkpoint, and a resumed run drops rows past its checkpoint and writes
    them again: however a run was killed and resumed, metrics.jsonl holds one row per finished
    epoch, as an uninterrupted run's.
    An epoch whose evaluation failed (an image, or a stop request) is checkpointed without its
    row; `resume` evaluates it and writes its row before training on.

    A later call in the same process with the same model, devices, optimizer settings and step
    options (`_programs`; the workdir, step limit or checkpoint interval may differ) reuses this
    call's jitted programs instead of tracing and compiling them again.

    Raises:
      ConfigError: invalid settings (a batch that does not divide the devices, a workdir that
        already holds a run without `resume`, bad data directories, ...). `_data.ImageError`,
        one of them, for an image of `--data` that stopped loading mid-run: a single process
        checkpoints the last finished step (or epoch's training) first, and the message says how
        to continue.
      CheckpointError: a checkpoint to resume from or an `init` file cannot be read.
      OutOfMemoryError: the step does not fit in device memory (names a batch that fits).
      Interrupted: SIGINT (Ctrl-C) or SIGTERM arrived (single process); the last finished step
        was checkpointed first, so `resume` continues exactly. A KeyboardInterrupt subclass.
      DivergedError: the loss or the weights became non-finite (inf/NaN); raised before any
        such state is checkpointed, naming the step and the last good checkpoint.

    With `data` an image folder and `workers` > 0 (the default), loading starts worker processes
    that each run the calling script again before they load anything, as Python's
    multiprocessing does: a script calling `train` must do so under `if __name__ == "__main__":`
    (without it, the workers' run of the script stops with a ConfigError that says so).

    With several processes, all must be given the same settings (checked: flags, data, starting
    weights, a shared workdir). One that stops with an error tells the others, which print it
    and exit with status 2 at once (they are blocked in the step's collectives, where no
    exception can reach them); the one that failed raises as usual and exits with status 2 too.
    """
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"`cfg` (a {type(cfg).__name__}) must be a TrainConfig: train(TrainConfig(workdir=...))")
    _data.refuse_in_worker_start("jaxport.train.train()")
    invalid = None
    try:
        _validate(cfg)
        cfg = _plain(cfg)
    except ConfigError as e:
        if not _distributed.requested(cfg.coordinator, cfg.num_processes, cfg.process_id):
            raise
        invalid = e  # the other processes are waiting for this one to connect: tell them first
    _distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, pending_error=invalid)
    _distributed.watch_for_failures()
    held: list[int] = []  # the workdir's lock, while this run writes there
    try:
        if invalid is not None:
            raise invalid
        return _train(cfg, log, held)
    except Interrupted:  # every process stops at the same step (jax's preemption sync point)
        raise
    except BaseException as e:
        _distributed.await_lost_process(e)  # a collective lost its peer: name the process that died
        _distributed.publish_failure(e)  # the others would wait for this one in a collective
        raise
    finally:
        for fd in held:
            os.close(fd)


_LOCK_WAIT_S = 1.0  # how long `_hold_workdir` tries the exclusive lock before refusing


def _hold_workdir(workdir: str, shared: bool = False) -> int | None:
    """An exclusive lock on the workdir for as long as this run writes in it (released when the
    process ends, even by SIGKILL). Two runs started together into one empty workdir both
    passed the check for an earlier run's files, trained side by side, and both died at their
    first checkpoint on each other's temporary directories, all their work lost. `shared`: a
    shared lock instead, which only a live run's exclusive one refuses (the early check)."""
    try:
        fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # a directory that cannot be opened for reading: the check for earlier files remains
        return None
    # The exclusive lock is tried for a moment: a run starting into the same workdir holds the
    # shared one of its early check for an instant, and refused this run as if a live run held it.
    deadline = None  # (the clock is read only once the lock is refused)
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if deadline is None:
                deadline = time.monotonic() + (0.0 if shared else _LOCK_WAIT_S)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            os.close(fd)
            raise ConfigError(f"`--workdir` (={workdir}) is in use by another `jaxport train` run on this machine; "
                              "wait for it to end (then --resume continues it), or choose another --workdir (nothing "
                              "was written)") from None
        except OSError:  # a file system without locks: the check for an earlier run's files remains
            os.close(fd)
            return None


def _train(cfg: TrainConfig, log: Callable[[str], None] | None, held: list[int]) -> dict:
    lead = jax.process_index() == 0
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say = log if lead else (lambda msg: None)
    # Checked before anything is loaded: flags that differ between processes (a typo in one
    # launch line) would train silently wrong weights or hang in a collective.
    _distributed.check_same_settings(_flags(cfg))

    # Flags that change nothing in this run say so, as --init does when --resume finds a checkpoint.
    if cfg.workers is not None and cfg.data is None:
        say(f"--workers {cfg.workers} is not used (the embedded digits are held in memory; it sets --data's "
            "loader processes)")
    if cfg.ra_reps != TrainConfig.ra_reps and not cfg.ra_sampler:
        say(f"--ra-reps {cfg.ra_reps} is not used (it sets --ra-sampler's copies of each image, and there is no "
            "--ra-sampler)")
    if cfg.trusted and cfg.init is None:
        say("--trusted is not used (it allows a full unpickle of --init, and there is none)")
    if cfg.bn_stats != "mean" and cfg.sync_bn:
        say(f"--bn-stats {cfg.bn_stats} is not used (with --sync-bn every device's running statistics are the same "
            "already)")
    if cfg.bn_stats != "mean" and cfg.bn_mode != "train":
        say(f"--bn-stats {cfg.bn_stats} is not used (with --bn-mode {cfg.bn_mode} the running statistics stay as "
            "they are)")
    if cfg.devices and cfg.devices > jax.device_count():  # the slice below would silently take fewer
        raise ConfigError(f"`devices` (={cfg.devices}) is more than the {jax.device_count()} device(s) jax sees; "
                          f"use at most {jax.device_count()}, or None for all of them")
    data = (_data.digits(cfg.image_size, cfg.seed) if cfg.data is None
            else _data.image_folder(cfg.data, cfg.image_size, cfg.seed, workers=cfg.workers,
                                    transforms=_presets.transforms(cfg, _data.MEAN.tolist(), _data.STD.tolist())))
    if cfg.test_only:
        try:
            return _test_only(cfg, data, say)
        finally:
            data.close()
    # What --resume and other processes compare.
    files = data.fingerprint() if data.fingerprint else {"files": "digits", "names": "digits"}
    # A run that resumes takes every weight from its checkpoint: --init would be read (slowly,
    # or failing on a file since moved) only to be overwritten.
    resumed_step, resumed_meta = _check_resumable_early(cfg, data, files) if cfg.resume else (None, None)
    mesh = make_mesh(jax.devices()[:cfg.devices] if cfg.devices else None)
    n_dev, n_proc = mesh.devices.size, jax.process_count()
    if cfg.bn_stats != "mean" and not cfg.sync_bn and n_dev == 1:
        say(f"--bn-stats {cfg.bn_stats} is not used (it chooses between the devices' running statistics, and there "
            "is one device)")

    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else None
    model = build(cfg.arch, num_classes=data.num_classes, bn_axis_name="data" if cfg.sync_bn else None, dtype=dtype)
    image = jnp.zeros((1, cfg.image_size, cfg.image_size, 3))
    # A resumed run takes every weight from its checkpoint: zeros of the right shapes stand in for
    # them until the restore, where jit(model.init) took 4-6 s here (ResNet-18 at 32 px, ResNet-50
    # at 224 px) only to be overwritten.
    placeholder = resumed_step is not None
    if placeholder:
        variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(model.init, jax.random.key(0), image))
    else:
        variables = jax.tree.map(np.asarray, _jitted_init(model)(jax.random.key(cfg.seed), image))
    if cfg.init and not placeholder:
        variables = fit_head(load_init(cfg.init, cfg.arch, cfg.trusted, say=say), variables, say, cfg.arch)
    if n_proc > 1:  # what the flags cannot show: each process reads its own copy of --data and --init
        _distributed.check_same_settings({
            "--resume (latest checkpoint step)": resumed_step,
            "--data (classes)": data.classes,
            "--data (train/val images)": [data.train.num_examples, data.val.num_examples],
            "--data (files)": files["files"],
            "starting weights (--init, --seed)": _digest(variables)})

    per_device_batch = None
    if cfg.batch_size == "auto":
        steps_per_epoch = 1  # provisional: the schedule's shape does not change memory
    else:
        check_batch_size(cfg.batch_size, n_dev, "--batch-size")
        _check_accum(cfg.batch_size, n_dev, cfg.grad_accum_steps)
        steps_per_epoch = _epoch_images(cfg, data.train.num_examples) // cfg.batch_size
    tx_for = lambda spe: _recipe.optimizer(cfg, spe)  # noqa: E731
    if cfg.batch_size == "auto":
        _check_auto_batch_fits_data(cfg, data.train.num_examples, n_dev)
        tx = tx_for(1)
        state = create_state(variables, tx, mesh)
        step = make_train_step(model, tx, mesh, donate=False, **_step_options(cfg))
        limit = _memory_for_steps(cfg, variables, say)
        cap = _epoch_images(cfg, data.train.num_examples) // n_dev
        low = _min_per_device(cfg.image_size, cfg.sync_bn, n_dev, cfg.bn_mode)
        # With --grad-accum-steps the search is over one pass's images per device.
        per_device_batch = _memory.largest_batch(step, state, mesh, cfg.image_size, limit,
                                                 max_per_device=max(low, min(256, cap // cfg.grad_accum_steps)),
                                                 log=say, min_per_device=low,
                                                 also=_evaluation_bytes(cfg, model, mesh, state),
                                                 accum=cfg.grad_accum_steps) * cfg.grad_accum_steps
        # Each process measured its own devices; the step is one program, so all take the smallest.
        agreed = _distributed.agree_min(per_device_batch)
        if agreed != per_device_batch:
            log(f"process {jax.process_index()}: --batch-size auto: {agreed} per device, the most every process fits")
            per_device_batch = agreed
        batch = per_device_batch * n_dev
        steps_per_epoch = _epoch_images(cfg, data.train.num_examples) // batch
    else:
        batch = cfg.batch_size
    if steps_per_epoch < 1:
        n = _epoch_images(cfg, data.train.num_examples)
        fix = (f"use at most {n // n_dev * n_dev} (a multiple of the {n_dev} devices)" if n >= n_dev else
               f"a step needs at least one image per device ({n_dev}): add training images")
        if cfg.ra_sampler:
            raise ConfigError(f"`--ra-sampler` trains an epoch on the training images rounded down to a multiple of "
                              f"256 (torchvision's RASampler): {n} of the {data.train.num_examples} here, "
                              + (f"fewer than `--batch-size` (={batch}); {fix}" if n else
                                 "so no step; add training images, or leave out --ra-sampler"))
        raise ConfigError(f"`--batch-size` (={batch}) is larger than the training set ({n} images); {fix}")
    _check_values_per_channel(batch // n_dev, cfg.image_size, cfg.sync_bn, n_dev,
                              None if resumed_step is None else _recorded_devices(resumed_meta), cfg.bn_mode,
                              accum=cfg.grad_accum_steps)
    tx, step_fn, evaluate = _programs(model, mesh, _recipe_key(cfg), steps_per_epoch,
                                      tuple(sorted(_step_options(cfg).items())), (make_train_step, make_eval_step))
    state = create_state(variables, tx, mesh)
    ema = None  # torchvision's --model-ema: the average (`_ema.EMA`), replicated like the state
    if cfg.model_ema:
        ema_decay = _ema.ema_decay(cfg.model_ema_decay, cfg.model_ema_steps, batch, cfg.epochs)
        # From the host's starting variables: buffers of its own (the step donates the state's), on
        # every device of the mesh, in every process (the first update copies the weights anyway).
        ema = replicate(_ema.init_ema(variables), mesh)
        ema_step = jax.jit(_ema_step, static_argnames=("decay", "restart"), donate_argnums=0)

    os.makedirs(cfg.workdir, exist_ok=True)
    if lead:  # process 0 writes for the whole run; the others share its lock
        held += [fd for fd in [_hold_workdir(cfg.workdir)] if fd is not None]
        # Once more, now that no other run can start writing: the check at start-up came before
        # loading the data and building the model (minutes for a large --data), time enough for
        # another run to write there and end. (Process 0 alone, as with the lock: its error
        # reaches the others through `_distributed.publish_failure`.)
        _refuse_changed_since_start(cfg, resumed_step, resumed_meta)
    _distributed.check_shared_workdir(cfg.workdir)
    mngr = _checkpoint.manager(cfg.workdir, cfg.keep_checkpoints)
    if lead:  # what a SIGKILL during an earlier run's metrics, plot or variables write left
        remove_temporaries(cfg.workdir, OUTPUTS)
    eval_batch = batch // cfg.grad_accum_steps
    meta = _run_meta(cfg, data, files) | {
        "batch_size": batch, "epoch_sums": [0.0, 0.0, 0.0],
        "settings": _settings(cfg) | {"num_devices": n_dev}}
    metrics_path = os.path.join(cfg.workdir, "metrics.jsonl")
    result: dict = {}
    bar = None
    # Dispatch is asynchronous: XLA's RESOURCE_EXHAUSTED surfaces where a result is waited for
    # (device_get, evaluation, checkpointing), so the whole loop is covered, not one call.
    stops = _StopRequests(n_proc, say)
    unevaluated = None  # a resumed checkpoint's epoch whose evaluation failed: its row's training half

    def end_epoch(row: dict) -> dict:
        """Evaluate the epoch whose training ended at `gstep` and write its metrics `row` (given
        its training half), then its checkpoint; returns the whole row.

        An evaluation that fails on an image (or after a stop request) loses no training: one
        process checkpoints `gstep` first, its metadata holding `row` as "unevaluated", from which
        --resume evaluates the epoch before training on. Such a checkpoint stays as it is when
        that evaluation succeeds (orbax writes a step once): a later --resume from it evaluates
        the epoch again, and writes the same row in place of the one there.
        """
        try:
            # In batches of one pass's images: those are what --grad-accum-steps fitted in memory.
            row = row | _evaluate(evaluate, state.variables, data.val, eval_batch, mesh)
            if ema is not None:  # torchvision: evaluate(model_ema, ..., log_suffix="EMA")
                row |= {f"{k}_ema": v for k, v in _evaluate(evaluate, ema.variables, data.val, eval_batch,
                                                             mesh).items()}
        except Exception as e:  # noqa: BLE001 - only an image error, or a failure after a stop request, is handled
            image = isinstance(e, _data.ImageError)
            if image and n_proc > 1:  # the others wait in the evaluation's collectives: a checkpoint needs them all
                raise e.unsaved(mngr.latest_step(), cfg.workdir, held_out=True) from None
            if n_proc > 1 or not (image or (stops.signum is not None and not isinstance(e, JaxportError))):
                raise
            if mngr.latest_step() != gstep:  # (a resumed evaluation's checkpoint is this one already)
                _save_finite(mngr, gstep, state, meta | {"epoch_sums": [0.0, 0.0, 0.0], "unevaluated": row}, cfg, ema)
            if image:
                raise e.after(gstep, cfg.workdir, evaluating=row["epoch"]) from None
            # The same signal reached the DataLoader's workers, which then failed a fetch.
            raise Interrupted(stops.signum, gstep, cfg.workdir) from None
        meta["epoch_sums"] = [0.0, 0.0, 0.0]
        # The row before the checkpoint: a run killed between the two resumes before this
        # epoch and writes its row again (the stale one is dropped). The other order resumed
        # after the epoch and never wrote its row. Weights that are no longer finite get
        # neither (DivergedError).
        _check_weights_finite(state, gstep, mngr, cfg)
        if lead:
            _append_metrics(metrics_path, row, mngr)
        if mngr.latest_step() != gstep:  # (see above: a resumed evaluation's checkpoint stays)
            _checkpoint.save(mngr, gstep, state, meta, ema)
        if lead:
            say(f"epoch {row['epoch'] + 1}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
                f"val loss {row['val_loss']:.4f} acc {row['val_acc']:.4f}"
                + (f" | EMA val loss {row['val_loss_ema']:.4f} acc {row['val_acc_ema']:.4f}" if ema is not None else ""))
        if stops.signum is not None and gstep < last_step:  # requested during the epoch's last step or evaluation
            raise Interrupted(stops.signum, gstep, cfg.workdir)
        return row

    try:
        if cfg.resume and mngr.all_steps():
            saved = _checkpoint.latest_meta(mngr)
            _check_resumable(saved, meta, cfg.workdir)
            _check_optimizer_state(saved.get("settings"), meta["settings"], cfg.workdir)
            state, saved = _checkpoint.restore(mngr, state)
            if ema is not None:  # (`_check_optimizer_state` refused a checkpoint trained without --model-ema)
                ema = _checkpoint.restore_ema(mngr, int(state.step), ema)
            meta["epoch_sums"] = saved["epoch_sums"]
            unevaluated = saved.get("unevaluated")
            unused = (f"; --init {cfg.init} is not used (the checkpoint in {_checkpoint.checkpoint_dir(cfg.workdir)} "
                      "holds every weight)" if cfg.init else "")
            changes = _changes(saved.get("settings"), meta["settings"], batch,
                               trains=int(state.step) < _last_step(cfg, steps_per_epoch))
            if saved.get("data") not in (None, meta["data"]):  # (`_check_resumable` took it: `_replaced_in_place`)
                changes += ("; some of --data's images have other sizes than when the checkpoint was written (the "
                            "same files by name and label: replaced in place), and are used as they are now")
            say(f"resuming from step {int(state.step)}{changes}{unused}")
            if unevaluated is not None:
                say(f"--resume: epoch {unevaluated['epoch'] + 1} was trained, but its evaluation did not finish: "
                    "evaluating it first")
        elif cfg.resume:
            if placeholder:  # the checkpoint listed before the model was built is gone: never train from zeros
                raise CheckpointError(f"--resume: checkpoint step {resumed_step} in "
                                      f"{_checkpoint.checkpoint_dir(cfg.workdir)} was removed while this run "
                                      "started; run the command again")
            say(f"--resume: no checkpoint in {cfg.workdir}; starting from step 0")
        start = int(state.step)
        # A metrics.jsonl deleted since the checkpoint is missing every row: said, like a truncated one.
        # (Before the first epoch's end there is no row to miss, and no file to write.) An
        # unevaluated epoch's row is written again after its evaluation.
        done = start // steps_per_epoch - (unevaluated is not None)
        if lead and (os.path.exists(metrics_path) or done):
            # Rows past the checkpoint (a run killed between an epoch's row and its checkpoint)
            # are dropped: this run trains those epochs again and writes their rows once more.
            read = _read_metrics(metrics_path, torn_ok=True) if os.path.exists(metrics_path) else []
            # One row per epoch, the last written (an edited file repeated one; the plot showed it twice).
            rows = sorted({r["epoch"]: r for r in read if r["epoch"] < done}.values(), key=lambda r: r["epoch"])
            with atomic_path(metrics_path) as tmp, open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            missing = sorted(set(range(done)) - {r["epoch"] for r in rows})
            if missing:  # written by a jaxport that checkpointed an epoch before writing its row
                say(f"--resume: {metrics_path} holds no row for epoch(s) {', '.join(str(e + 1) for e in missing)}; "
                    "they cannot be recomputed, and the plot will miss them")

        last_step = _last_step(cfg, steps_per_epoch)
        bn = "synchronised" if cfg.sync_bn else "per device"
        if cfg.bn_stats == "first" and not cfg.sync_bn and n_dev > 1:
            bn += " (running statistics: device 0's)"
        k = cfg.grad_accum_steps
        passes = f", in {k} passes of {batch // n_dev // k} accumulated into each update" if k > 1 else ""
        say(f"training {cfg.arch} on {data.num_classes} classes ({data.train.num_examples} train / "
            f"{data.val.num_examples} val images) over {n_dev} device(s) in {n_proc} process(es): global batch "
            f"{batch} ({batch // n_dev} per device{passes}), {steps_per_epoch} steps/epoch, BatchNorm {bn}"
            + (f"; --ra-sampler: {cfg.ra_reps} copies of each image, {_epoch_images(cfg, data.train.num_examples)} "
               "images an epoch" if cfg.ra_sampler else ""))
        if start >= last_step:
            say(f"nothing to train: the latest checkpoint is at step {start} and the run ends at step {last_step} "
                "(raise --epochs or --max-steps to train further)")
        gstep = start
        # images/s counts from the end of this run's first step, which compiles the step (~20 s
        # of a ~36 s first epoch for ResNet-18 at 16 px): the first epoch's rate read 2.6x lower
        # than the next epochs' for the same steps. `seconds` stays the epoch's wall time.
        compiled = False
        with stops:
            if unevaluated is not None:
                result = end_epoch(unevaluated)
            while gstep < last_step:
                epoch, offset = divmod(gstep, steps_per_epoch)
                stop = min(steps_per_epoch, last_step - epoch * steps_per_epoch)
                order = (_data.ra_epoch_order(cfg.seed, epoch, data.train.num_examples, cfg.ra_reps, batch)
                         if cfg.ra_sampler else _data.epoch_order(cfg.seed, epoch, data.train.num_examples))
                sums = np.array(meta["epoch_sums"] if offset else [0.0, 0.0, 0.0])
                pending = []
                bar = None
                if lead and cfg.progress is not False:  # None (the CLI default): tqdm shows it on a terminal only
                    from tqdm import tqdm

                    bar = tqdm(total=steps_per_epoch, initial=offset, desc=f"epoch {epoch + 1}/{cfg.epochs}",
                               unit="step", dynamic_ncols=True, file=sys.stderr,
                               disable=None if cfg.progress is None else False)  # None: tqdm asks isatty
                t0, seen = time.perf_counter(), 0
                t_rate, unrated = t0, 0  # the rate counts from t_rate, without the images before it
                loader = data.train.stream(_batches(order, offset, stop, batch, jax.process_index(), n_proc), epoch)

                def flush():
                    nonlocal sums, pending
                    got = jax.device_get(pending)
                    _check_finite([float(p["loss"]) for p in got], gstep, mngr, cfg)
                    sums += [sum(float(p["loss"]) * batch for p in got), sum(int(p["correct"]) for p in got), batch * len(got)]
                    pending = []
                    if bar is not None:
                        rated = seen - unrated
                        rate = rated / (time.perf_counter() - t_rate) if rated else seen / (time.perf_counter() - t0)
                        bar.set_postfix(loss=f"{sums[0] / sums[2]:.3f}", acc=f"{sums[1] / sums[2]:.3f}", img_s=f"{rate:.0f}")

                try:
                    for s, (x, y) in enumerate(loader, start=offset):
                        state, m = step_fn(state, *shard_batch(mesh, x, y))
                        if ema is not None and s % cfg.model_ema_steps == 0:  # torchvision's i: s, within the epoch
                            # (torchvision: n_averaged.fill_(0) in warm-up epochs: each update there copies)
                            ema = ema_step(ema, state.variables, decay=ema_decay,
                                           restart=epoch < cfg.lr_warmup_epochs)
                        pending.append(m)
                        gstep, seen = epoch * steps_per_epoch + s + 1, seen + batch
                        if not compiled:
                            jax.block_until_ready(m)
                            compiled, t_rate, unrated = True, time.perf_counter(), seen
                        # An epoch's last step is never a stop point: its evaluation and metrics row follow.
                        stopping = stops.poll(gstep) and s + 1 != steps_per_epoch
                        if len(pending) >= 10 or gstep % cfg.checkpoint_every == 0 or s + 1 == stop or stopping:
                            flush()
                        if bar is not None:
                            bar.update(1)
                        if (gstep % cfg.checkpoint_every == 0 or stopping) and s + 1 != steps_per_epoch:
                            meta["epoch_sums"] = sums.tolist()
                            _save_finite(mngr, gstep, state, meta, cfg, ema)
                        if stopping:
                            break
                except Exception as e:  # noqa: BLE001 - only a loader failing after a stop request is absorbed
                    if isinstance(e, _data.ImageError) and n_proc == 1:
                        # An image gone or undecodable since the scan: the steps since the last
                        # checkpoint were lost, up to --checkpoint-every of them. The state is the
                        # last finished step's (the loader failed fetching the next batch). (With
                        # more processes the others wait in the next step's collectives, and a
                        # checkpoint needs them all.) A stop request that came during that fetch
                        # is answered by the same checkpoint; the image needs restoring either way.
                        if pending:
                            flush()
                        if gstep and mngr.latest_step() != gstep:
                            meta["epoch_sums"] = sums.tolist()
                            _save_finite(mngr, gstep, state, meta, cfg, ema)
                        if mngr.latest_step() is not None:
                            raise e.after(mngr.latest_step(), cfg.workdir) from None
                    if isinstance(e, _data.ImageError) and n_proc > 1:
                        raise e.unsaved(mngr.latest_step(), cfg.workdir) from None
                    if stops.signum is None or isinstance(e, JaxportError):
                        raise
                    # The same signal reached the DataLoader's workers, which then fail the next fetch:
                    # the state of the last finished step stands, and is saved below.
                    if pending:
                        flush()
                finally:
                    loader.close()  # ends the stream now, error or not; its workers serve on (`_data._Loader`)
                elapsed = time.perf_counter() - t0
                if bar is not None:
                    bar.close()
                if stop < steps_per_epoch or (stops.signum is not None and (gstep % steps_per_epoch or not seen)):
                    # max_steps reached, or a stop requested, mid-epoch (or before this epoch's first step)
                    meta["epoch_sums"] = sums.tolist()
                    if mngr.latest_step() != gstep:
                        _save_finite(mngr, gstep, state, meta, cfg, ema)
                    if stops.signum is not None:
                        raise Interrupted(stops.signum, gstep, cfg.workdir)
                    break
                row = {"epoch": epoch, "step": gstep, "train_loss": sums[0] / sums[2], "train_acc": sums[1] / sums[2],
                       "lr": _recipe.epoch_lr(cfg, epoch),
                       "images_per_s": ((seen - unrated) / (elapsed - (t_rate - t0)) if seen > unrated else
                                        seen / elapsed if seen else None),
                       "seconds": elapsed}
                result = end_epoch(row)
    except (DivergedError, Interrupted) as e:  # the checkpoints on disk are good: stop
        if bar is not None:
            bar.close()
        if lead and isinstance(e, Interrupted):
            # The step just checkpointed: an earlier run's final file (a resumed run's) was left
            # as if it were this run's, steps behind the checkpoints, read silently by --init.
            try:
                _save_final(state, cfg, gstep, data.classes, ema)
            except OSError as err:  # a full disk: the error replaced the interruption (status 2,
                # not 130/143) and hid that the step was checkpointed
                raise Interrupted(e.signum, e.step, e.workdir,
                                  note=f"{FINAL_VARIABLES} was not written: {_why(err)}") from None
        raise
    except Exception as e:  # noqa: BLE001 - only out-of-memory is translated; the rest propagates
        if bar is not None:
            bar.close()  # end the progress line so the error starts on its own
        if not _memory.is_out_of_memory(e):
            raise
        raise _oom_error(model, tx, variables, mesh, cfg, batch, n_dev) from None
    finally:
        # On every exit: left open, orbax's threads and event loop outlive the error and print
        # asyncio tracebacks ("Event loop is closed") as the interpreter shuts down.
        try:
            mngr.close()
        finally:
            # The loader workers, which served every epoch and evaluation, stop now, whatever
            # ended the run: left to the interpreter's exit, they could hang it (`_data._Loader`).
            data.close()
    try:
        if lead:  # before the plot: the weights matter more
            _save_final(state, cfg, gstep, data.classes, ema)
        if lead and os.path.exists(metrics_path) and os.path.getsize(metrics_path):
            plot_metrics(metrics_path, os.path.join(cfg.workdir, "training_curves.png"))
    except OSError as e:  # "free some space or write elsewhere" read as if the training were lost
        raise CheckpointError(f"training finished at step {gstep} (checkpointed in "
                              f"{_checkpoint.checkpoint_dir(cfg.workdir)}), but its final files could not be written: "
                              f"{_why(e)}; fix that, then rerun with --resume: it writes them without training") from None
    _distributed.finish_together()
    result["state"] = state
    result["steps_run"] = gstep - start
    return result


def _save_final(state, cfg: TrainConfig, step: int, classes: list[str], ema=None) -> None:
    """The weights in jaxport's variables format, readable whatever the topology (replicated, so
    this process's first shard is the value); `jaxport export`, `verify` and `--init` read it
    like any ported file. With `ema` (--model-ema), its variables beside them, in `FINAL_EMA`,
    alike. Their header records the step, the classes in output order (`categories`), how
    --data's held-out images were fed (`preprocess`) and `--init` as this run was given it
    (checkpoints do not record it: a `--resume` without it records none), the first two as JSON
    in the fields a port of torchvision's weights has (`torch_compat.weights_metadata`)."""
    metadata = {"step": str(step), "categories": json.dumps(classes)}
    if cfg.data is not None:
        metadata["preprocess"] = json.dumps(_presets.preprocess_metadata(cfg, _data.MEAN, _data.STD))
    if cfg.init is not None:
        metadata["init"] = os.fspath(cfg.init)
    for name, variables in ((FINAL_VARIABLES, state.variables), (FINAL_EMA, None if ema is None else ema.variables)):
        if variables is not None:
            final = jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), variables)
            save_variables(os.path.join(cfg.workdir, name), final, arch=cfg.arch, metadata=metadata)


def _ema_step(ema: _ema.EMA, variables, decay: float, restart: bool) -> _ema.EMA:
    """torchvision's `model_ema.update_parameters(model)`, then, with `restart` (a warm-up
    epoch), `model_ema.n_averaged.fill_(0)`."""
    ema = _ema.update_ema(ema, variables, decay)
    return _ema.restart_ema(ema) if restart else ema


def _diverged(what: str, step: int, mngr, cfg: TrainConfig) -> DivergedError:
    good = mngr.latest_step()
    lower = f"a lower --lr (now {cfg.lr}{'' if cfg.opt == 'adamw' else f'; --momentum {cfg.momentum}'})"
    kept = (f"the latest checkpoint, step {good}, is intact: rerun with --resume and {lower} to continue from it"
            if good is not None else f"no checkpoint was written: train again with {lower}")
    err = DivergedError(f"training diverged: {what} at step {step}; nothing non-finite was saved, and {kept} "
                        "(or check the data and --init weights)")
    err.every_process = True  # the loss and weights are global: every process stops here together
    return err


def _check_finite(losses: list[float], gstep: int, mngr, cfg: TrainConfig) -> None:
    """Stop at the first non-finite loss of the steps just fetched (the last one is `gstep`)."""
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            raise _diverged(f"the loss became {loss}", gstep - len(losses) + i + 1, mngr, cfg)


def _all_finite(tree) -> bool:
    """Whether every floating leaf of `tree` is finite, read on the host from this process's
    first copy of each (the weights are replicated: every device holds the same values). As a
    jitted reduction over the ~100-300 leaves it compiled for 1-2 s at a run's first checkpoint,
    in every process; the host reads ~0.1 GB for ResNet-50, which a checkpoint copies anyway."""
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            local = x.addressable_data(0) if isinstance(x, jax.Array) else x
            if not np.isfinite(np.asarray(local)).all():
                return False
    return True


def _check_weights_finite(state, gstep: int, mngr, cfg: TrainConfig) -> None:
    """Stop when the weights are no longer finite (a finite loss can still be followed by an
    update that overflows)."""
    if not _all_finite(state.variables):
        raise _diverged("the weights became non-finite", gstep, mngr, cfg)


def _save_finite(mngr, gstep: int, state, meta: dict, cfg: TrainConfig, ema=None) -> None:
    """Save a checkpoint (with the --model-ema average `ema`, if any), unless the weights are no
    longer finite: never rotate good checkpoints out for broken ones."""
    _check_weights_finite(state, gstep, mngr, cfg)
    _checkpoint.save(mngr, gstep, state, meta, ema)


def _evaluation_bytes(cfg: TrainConfig, model, mesh, state) -> tuple[str, Callable[[int], int]] | None:
    """`(what, bytes_at)` for `_memory.largest_batch`: the evaluation's bytes per device at a
    per-device batch, where they may exceed the training step's: at a held-out crop larger
    than the training crop (torchvision's ResNet-50 recipe trains at 176 px and evaluates at
    224, 1.6x the pixels). The evaluation runs at one pass's batch (the training batch over
    --grad-accum-steps) while the optimizer state stays on the devices; its arguments are the
    weights, or the --model-ema average in their place (of their size, which
    `_memory_for_steps` already left room for). At the training crop or smaller, a forward
    pass that keeps nothing for a backward needs less than the step: not compiled."""
    if cfg.val_crop_size is None or cfg.val_crop_size <= cfg.image_size:
        return None
    evaluate = make_eval_step(model, mesh)
    resident = _memory.tree_bytes(state.opt_state)
    return (f"the evaluation at --val-crop-size {cfg.val_crop_size}",
            lambda b: _memory.eval_bytes(evaluate, state.variables, mesh, b, cfg.val_crop_size) + resident)


def _oom_error(model, tx, variables, mesh, cfg, batch, n_dev) -> _memory.OutOfMemoryError:
    """The out-of-memory message, naming a per-device batch XLA's memory analysis predicts fits,
    and the fewest --grad-accum-steps that fit the same --batch-size, where some do.

    The batch that failed did not fit whatever the analysis says of it (other processes,
    fragmentation), so each suggestion must need less than it, and a smaller batch is at least
    1/8 smaller.
    """
    per_device, k = batch // n_dev, cfg.grad_accum_steps
    per_pass = per_device // k
    passes = f", {k} passes of {per_pass}" if k > 1 else ""
    where = f"out of device memory (RESOURCE_EXHAUSTED) at `--batch-size` (={batch}, {per_device} per device{passes})"
    low = _min_per_device(cfg.image_size, cfg.sync_bn, n_dev, cfg.bn_mode)
    try:
        limit = _memory_for_steps(cfg, variables, lambda m: None)  # as --batch-size auto counts it
        state = create_state(variables, tx, mesh)
        step = make_train_step(model, tx, mesh, donate=False, **_step_options(cfg))
        also = _evaluation_bytes(cfg, model, mesh, state)  # it may be the evaluation that ran out
        failed = max(_memory.step_bytes(step, state, mesh, per_device, cfg.image_size),
                     also[1](per_pass) if also else 0)
        limit = min(limit, failed - 1)
        more = _fewest_passes(model, tx, mesh, state, cfg, per_device, low, limit, also)
        fits = _memory.largest_batch(step, state, mesh, cfg.image_size, limit,
                                     max_per_device=max(1, per_pass - max(1, per_pass // 8)), log=lambda m: None,
                                     min_per_device=low, also=also, accum=k)
    except _memory.OutOfMemoryError as e:  # not even one image per device
        return _memory.OutOfMemoryError(f"{where}; {e}")
    except Exception:  # noqa: BLE001 - the hint is best effort
        return _memory.OutOfMemoryError(f"{where}; use a smaller --batch-size, or --batch-size auto")
    keep = (f"--grad-accum-steps {more} (the same --batch-size in passes of {per_device // more} per device), or "
            if more else "")
    return _memory.OutOfMemoryError(
        f"{where}; use {keep}--batch-size {fits * k * n_dev} ({fits * k} per device"
        f"{f' in {k} passes' if k > 1 else ''}), which XLA's memory analysis predicts fit{'' if more else 's'} "
        f"(the failed one: {failed / 2**20:.0f} MiB per device)")


def _fewest_passes(model, tx, mesh, state, cfg, per_device: int, low: int, limit: int, also) -> int | None:
    """The fewest --grad-accum-steps above the run's that split `per_device` into equal passes of
    at least `low` images whose step (and `also`, at one pass) fits `limit`; None if none does.
    A step's memory falls as its passes grow, so a bisection over the counts compiles ~log2 of
    them, each for its memory analysis only (a count returned was compiled and fits)."""
    counts = [d for d in divisors(per_device) if d > cfg.grad_accum_steps and per_device // d >= low]

    def fits(d: int) -> bool:
        step = make_train_step(model, tx, mesh, donate=False, **(_step_options(cfg) | {"accum_steps": d}))
        return (_memory.step_bytes(step, state, mesh, per_device, cfg.image_size) <= limit
                and (also is None or also[1](per_device // d) <= limit))

    lo, hi = 0, len(counts)  # counts[hi:] fit (none known yet); find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(counts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return counts[lo] if lo < len(counts) else None
