"""`jaxport train`: argument parsing only; the work is `jaxport.train.train`."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys

from .._parser import Parser, shown
from ..models import ARCHS
from ._loop import DTYPES, Interrupted, TrainConfig, _latest_step, train
from ._presets import AUTO_AUGMENTS, INTERPOLATIONS, check_crop


# Settings of the library's `TrainConfig` that are no flag, and how to get them from the command line.
_NOT_FLAGS = {"--devices": "jaxport train uses every device jax sees: hide the others to use fewer "
                           "(e.g. CUDA_VISIBLE_DEVICES=0,1), or call jaxport.train.train(TrainConfig(devices=N))",
              "--memory-limit-bytes": "--batch-size auto measures against the device's memory; for another limit "
                                      "call jaxport.train.train(TrainConfig(memory_limit_bytes=N))"}
# The smallest value each integer flag takes, said in its type error (TrainConfig checks ranges).
_MINIMUM = {"--epochs": 1, "--image-size": 1, "--seed": 0, "--checkpoint-every": 1, "--keep-checkpoints": 1,
            "--workers": 0, "--max-steps": 1, "--num-processes": 1, "--process-id": 0, "--lr-step-size": 1,
            "--lr-warmup-epochs": 0, "--model-ema-steps": 1, "--ra-reps": 1, "--grad-accum-steps": 1}


def _integer(flag: str, expected: str = ""):
    expected = expected or f"an integer >= {_MINIMUM[flag]}"

    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            pass
        try:  # 8.0 and 1e3 say an integer; 1.5 is two integers away
            number = float(text)
        except ValueError:
            fix = ""
        else:
            if not math.isfinite(number):
                fix = ""
            elif number == int(number):
                fix = f"; use {flag} {int(number)}"
            else:
                fix = f"; use {flag} {math.floor(number)} or {flag} {math.ceil(number)}"
        raise argparse.ArgumentTypeError(f"`{flag}` (={shown(text)}) must be {expected}{fix}")
    return parse


def _real(flag: str, example: float):
    def parse(text: str) -> float:
        try:
            return float(text)  # NaN, inf and the range are TrainConfig's to refuse, naming the flag
        except ValueError:
            pass
        try:  # a decimal comma: 0,1
            fix = f"; use {flag} {float(text.replace(',', '.'))!r}"
        except ValueError:
            fix = f", e.g. {flag} {example!r}"
        raise argparse.ArgumentTypeError(f"`{flag}` (={text!r}) must be a number{fix}")
    return parse


def _batch_size(text: str):
    if text.strip().lower() == "auto":
        return "auto"
    return _integer("--batch-size", "a positive integer or 'auto'")(text)


class _TrainParser(Parser):
    """`jaxport train`'s parser: the top-level's one-line errors, and a word on the settings of
    `TrainConfig` that are no flag and on positional arguments (every setting is a flag)."""

    def _unknown(self, extras: list[str]) -> str:
        first = extras[0]
        if not first.startswith("-"):
            return (f"`jaxport train` takes no positional arguments (got {first!r}); every setting is a flag, e.g. "
                    f"--data {first}")
        flag = first.partition("=")[0]
        if flag in _NOT_FLAGS:
            return f"`{flag}` is not a `jaxport train` flag: {_NOT_FLAGS[flag]}"
        return super()._unknown(extras)


def add_parser(subparsers) -> None:
    """Register the `train` subcommand on an argparse subparsers object."""
    d = TrainConfig(workdir="")
    p = subparsers.add_parser(
        "train", help="train a ResNet data-parallel over every device (torch-equivalent SGD, AdamW or RMSprop)",
        description="Train data-parallel over all devices. With no --data, trains on the handwritten digits "
                    "scikit-learn ships (upsampled to RGB); ResNet-18 reaches >= 95% held-out accuracy. The "
                    "optimizer flags are torchvision's references/classification/train.py's, with their meanings.")
    # `add_parser` builds with the top-level parser's class; this one adds train's own words.
    p.__class__ = _TrainParser
    p.add_argument("--data", default=None, metavar="DIR",
                   help="ImageFolder directory (one sub-folder per class, or train/ and val/ (or validation/, "
                        "valid/)) (default: the handwritten digits scikit-learn ships)")
    p.add_argument("--arch", default=d.arch, metavar="ARCH",  # checked, with a suggestion, by TrainConfig
                   help=f"torchvision ResNet name: one of {', '.join(ARCHS)} (default: %(default)s)")
    p.add_argument("--epochs", type=_integer("--epochs"), default=d.epochs, metavar="N",
                   help="epochs; --lr-scheduler cosineannealinglr ends at the last (default: %(default)s)")
    p.add_argument("--batch-size", type=_batch_size, default=d.batch_size, metavar="N",
                   help="global batch (divisible by the device count), or 'auto': the largest that fits "
                        "(default: %(default)s)")
    p.add_argument("--grad-accum-steps", type=_integer("--grad-accum-steps"), default=d.grad_accum_steps,
                   metavar="N", help="passes per step, each over 1/N of every device's batch, their gradients "
                   "accumulated into one update (torch's loss / N; backward() per chunk): the same --batch-size "
                   "in one chunk's activation memory (beside an accumulator of the gradients); "
                   "BatchNorm normalises each chunk alone (default: %(default)s)")
    # given (even at its default), it must agree with --train-crop-size (`config_from_args`)
    p.add_argument("--image-size", type=_integer("--image-size"), default=d.image_size, metavar="PIXELS",
                   action=_Given, help="side of the square training images; with --data, the training crop and "
                                       "the held-out crop, after a resize to PIXELS x 256 / 224 (default: "
                                       "%(default)s)")
    # torchvision's presets.py, for --data (checked by TrainConfig, which refuses them for the digits)
    p.add_argument("--train-crop-size", type=_integer("--train-crop-size", "an integer >= 1"), default=None,
                   metavar="PIXELS", help="--data: RandomResizedCrop's size, --image-size by train.py's name "
                                          "(default: --image-size)")
    p.add_argument("--val-resize-size", type=_integer("--val-resize-size", "an integer >= 1"), default=None,
                   metavar="PIXELS", help="--data: the held-out images' Resize (default: --image-size x 256 / 224)")
    p.add_argument("--val-crop-size", type=_integer("--val-crop-size", "an integer >= 1"), default=None,
                   metavar="PIXELS", help="--data: the held-out images' CenterCrop (default: --image-size)")
    p.add_argument("--interpolation", default=d.interpolation, metavar="{" + ",".join(INTERPOLATIONS) + "}",
                   help="--data: RandomResizedCrop's, Resize's and --auto-augment's (default: %(default)s)")
    p.add_argument("--auto-augment", default=None, metavar="{" + ",".join(AUTO_AUGMENTS) + "}",
                   help="--data: RandAugment, TrivialAugmentWide, AugMix, or AutoAugment with that policy, after "
                        "the flip (default: none)")
    p.add_argument("--ra-magnitude", type=_integer("--ra-magnitude", "an integer from 0 to 30"),
                   default=d.ra_magnitude, metavar="M", help="--auto-augment ra: RandAugment's magnitude (default: "
                                                             "%(default)s)")
    p.add_argument("--augmix-severity", type=_integer("--augmix-severity", "an integer from 1 to 10"),
                   default=d.augmix_severity, metavar="S", help="--auto-augment augmix: AugMix's severity (default: "
                                                                "%(default)s)")
    p.add_argument("--random-erase", type=_real("--random-erase", 0.25), default=d.random_erase, metavar="P",
                   help="--data: RandomErasing(p=P) after Normalize (default: %(default)s, none)")
    p.add_argument("--lr", type=_real("--lr", d.lr), default=d.lr,
                   help="peak learning rate, after the warm-up, scheduled per epoch by --lr-scheduler "
                        "(default: %(default)s)")
    p.add_argument("--opt", default=d.opt, metavar="{sgd,sgd-nesterov,adamw,rmsprop}",  # checked by TrainConfig
                   help="optimizer, torch's SGD, SGD with nesterov momentum, AdamW, or RMSprop with torchvision's "
                        "eps=0.0316, alpha=0.9 (as torchvision: any case, and any name starting with sgd is SGD, "
                        "nesterov if it contains nesterov) (default: %(default)s)")
    p.add_argument("--momentum", type=_real("--momentum", d.momentum), default=d.momentum,
                   help="SGD's and RMSprop's momentum (AdamW has none) (default: %(default)s)")
    p.add_argument("--weight-decay", "--wd", type=_real("--weight-decay", d.weight_decay), default=d.weight_decay,
                   help="weight decay: SGD's and RMSprop's L2, AdamW's decoupled decay, as torch's (default: "
                        "%(default)s)")
    p.add_argument("--norm-weight-decay", type=_real("--norm-weight-decay", 0.0), default=d.norm_weight_decay,
                   metavar="WD", help="weight decay of the BatchNorm layers' parameters, which then form their own "
                                      "param group, as torchvision's (default: --weight-decay's)")
    p.add_argument("--bias-weight-decay", type=_real("--bias-weight-decay", 0.0), default=d.bias_weight_decay,
                   metavar="WD", help="weight decay of every bias (the classifier's and the BatchNorm layers'), "
                                      "which then form their own param group, as torchvision's (default: as the "
                                      "other parameters')")
    p.add_argument("--lr-scheduler", default=d.lr_scheduler, metavar="{cosineannealinglr,steplr,exponentiallr}",
                   help="torch's CosineAnnealingLR(T_max=epochs - warm-up epochs, eta_min=--lr-min), "
                        "StepLR(--lr-step-size, --lr-gamma) or ExponentialLR(--lr-gamma), stepped after each epoch "
                        "(any case) (default: %(default)s)")
    p.add_argument("--lr-step-size", type=_integer("--lr-step-size"), default=d.lr_step_size, metavar="EPOCHS",
                   help="steplr: epochs between decays (default: %(default)s)")
    p.add_argument("--lr-gamma", type=_real("--lr-gamma", d.lr_gamma), default=d.lr_gamma, metavar="GAMMA",
                   help="steplr, exponentiallr: the factor each decay multiplies the lr by (default: %(default)s)")
    p.add_argument("--lr-min", type=_real("--lr-min", d.lr_min), default=d.lr_min, metavar="LR",
                   help="cosineannealinglr: the lr it ends at (eta_min) (default: %(default)s)")
    p.add_argument("--lr-warmup-epochs", type=_integer("--lr-warmup-epochs"), default=d.lr_warmup_epochs,
                   metavar="EPOCHS", help="epochs of warm-up before --lr-scheduler, 0 for none (default: %(default)s)")
    p.add_argument("--lr-warmup-method", default=d.lr_warmup_method, metavar="{linear,constant}",
                   help="warm-up from --lr * --lr-warmup-decay: linear, to --lr (torch's LinearLR), or constant "
                        "(ConstantLR) (default: %(default)s)")
    p.add_argument("--lr-warmup-decay", type=_real("--lr-warmup-decay", d.lr_warmup_decay),
                   default=d.lr_warmup_decay, metavar="FACTOR",
                   help="the warm-up's first lr is --lr times this, in (0, 1] (default: %(default)s)")
    p.add_argument("--clip-grad-norm", type=_real("--clip-grad-norm", 1.0), default=d.clip_grad_norm,
                   metavar="MAX_NORM", help="clip the norm of all gradients together before each step, as torch's "
                                            "clip_grad_norm_ (default: no clipping)")
    p.add_argument("--model-ema", action="store_true",
                   help="keep an exponential moving average of the weights and BatchNorm statistics, as torchvision's "
                        "ExponentialMovingAverage: evaluated after each epoch (val_acc_ema in metrics.jsonl), written "
                        "to variables_ema.safetensors (jaxport export WORKDIR --ema)")
    p.add_argument("--model-ema-steps", type=_integer("--model-ema-steps"), default=d.model_ema_steps, metavar="STEPS",
                   help="update the EMA after every STEPS-th step of an epoch (its first included) (default: "
                        "%(default)s)")
    p.add_argument("--model-ema-decay", type=_real("--model-ema-decay", d.model_ema_decay), default=d.model_ema_decay,
                   metavar="DECAY", help="the EMA's decay, in [0, 1], scaled as torchvision's: 1 - min(1, (1 - DECAY) * "
                                         "global batch * --model-ema-steps / --epochs) (default: %(default)s)")
    p.add_argument("--seed", type=_integer("--seed"), default=d.seed,
                   help="initialisation, data order and augmentation (default: %(default)s)")
    # Required (`run` says so, as argparse would), except for --test-only of --init's weights.
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="checkpoints, metrics.jsonl and training_curves.png go here (required, except with --test-only "
                        "--init)")
    p.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across devices")
    # checked, with a suggestion, by TrainConfig (as --dtype)
    p.add_argument("--bn-stats", default=d.bn_stats, metavar="{mean,first}",
                   help="per-device BatchNorm's running statistics (what evaluation uses) after each step: mean over "
                        "the devices, or first: device 0's, as torch's DataParallel and DDP keep; nothing changes "
                        "with --sync-bn or one device (default: %(default)s)")
    p.add_argument("--bn-mode", default=d.bn_mode, metavar="{train,eval,frozen}",
                   help="how BatchNorm trains: train, as torch's model.train(); eval, as bn.eval() on every BatchNorm "
                        "while the rest trains (fine-tuning with few images per device: the running statistics "
                        "normalise and stay as they are, scales and biases train); frozen, as torchvision's "
                        "FrozenBatchNorm2d (scales and biases fixed too) (default: %(default)s)")
    p.add_argument("--label-smoothing", type=_real("--label-smoothing", 0.1), default=d.label_smoothing,
                   metavar="LS", help="label smoothing of the training loss, from 0 to 1, as torch's "
                                      "CrossEntropyLoss(label_smoothing=LS); the train loss shown is then the "
                                      "smoothed one, the val loss stays plain cross-entropy (default: %(default)s)")
    p.add_argument("--mixup-alpha", type=_real("--mixup-alpha", 0.2), default=d.mixup_alpha, metavar="ALPHA",
                   help="MixUp each training batch, as torchvision's v2.MixUp(alpha=ALPHA): lam ~ Beta(ALPHA, ALPHA), "
                        "each image mixed with the previous one of the global batch; 0 for none (default: %(default)s)")
    p.add_argument("--cutmix-alpha", type=_real("--cutmix-alpha", 1.0), default=d.cutmix_alpha, metavar="ALPHA",
                   help="CutMix each training batch, as torchvision's v2.CutMix(alpha=ALPHA); with --mixup-alpha too, "
                        "each step picks one of the two at random; 0 for none (default: %(default)s)")
    p.add_argument("--ra-sampler", action="store_true",
                   help="repeated augmentation, as torchvision's RASampler: each epoch trains on --ra-reps differently "
                        "augmented copies of each image, as many images in all (copies included) as the training set "
                        "holds, rounded down to a multiple of 256")
    p.add_argument("--ra-reps", type=_integer("--ra-reps"), default=d.ra_reps, metavar="N",
                   help="--ra-sampler's copies of each image (default: %(default)s)")
    p.add_argument("--test-only", action="store_true",
                   help="evaluate existing weights on the held-out split and exit, as torchvision's --test-only: "
                        "--init's, or with --resume the latest checkpoint in --workdir (its EMA with --model-ema); "
                        "nothing is trained or written")
    p.add_argument("--init", default=None, metavar="PATH",
                   help="starting weights: torch checkpoint, .safetensors, or a workdir; or torchvision's weights "
                        "by name (ResNet50_Weights.IMAGENET1K_V2) or URL, downloaded once (not read when --resume "
                        "finds a checkpoint) (default: a fresh initialisation from --seed)")
    p.add_argument("--trusted", action="store_true",
                   help="allow a full unpickle of the --init checkpoint (runs code from the file): only for files you trust")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --workdir")
    p.add_argument("--dtype", default=d.dtype, metavar="DTYPE",  # checked, with a suggestion, by TrainConfig
                   help=f"compute dtype: {' or '.join(DTYPES)} (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=_integer("--checkpoint-every"), default=d.checkpoint_every,
                   metavar="STEPS", help="steps between checkpoints; also at each epoch end (default: %(default)s)")
    p.add_argument("--keep-checkpoints", type=_integer("--keep-checkpoints"), default=d.keep_checkpoints,
                   metavar="N", help="checkpoints kept, the latest ones (default: %(default)s)")
    p.add_argument("--workers", type=_integer("--workers"), default=None, metavar="N",
                   help="DataLoader worker processes for --data; 0 loads in the main process (default: one per usable "
                        "CPU, at most 4)")
    p.add_argument("--max-steps", type=_integer("--max-steps"), default=None, metavar="STEP",
                   help="stop after this global step (default: train every epoch)")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar (by default there is one when stderr is a terminal; logs get the "
                        "per-epoch lines only)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process: the coordinator's address (with --num-processes and --process-id)")
    p.add_argument("--num-processes", type=_integer("--num-processes"), default=None, metavar="N",
                   help="multi-process: how many processes train together")
    p.add_argument("--process-id", type=_integer("--process-id"), default=None, metavar="ID",
                   help="multi-process: this process's index, 0 to --num-processes - 1")
    p.set_defaults(func=run, parser=p)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in TrainConfig.__dataclass_fields__.values()}
    values = {k: v for k, v in vars(args).items() if k in names}
    if getattr(args, "image_size_given", False):  # --image-size 32 --train-crop-size 16, though 32 is the default
        check_crop(values["image_size"], values.get("train_crop_size"), image_size_given=True)
    return TrainConfig(**values)


class _Given(argparse.Action):
    """Stores the value, and that it was given (`DEST_given`): the library sees only the value."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_given", True)


def run(args: argparse.Namespace) -> int:
    """Run `jaxport train`; JaxportError propagates to the CLI, which prints it on one line."""
    if args.workdir is None and not (args.test_only and args.init is not None and not args.resume):
        args.parser.error("the following arguments are required: --workdir")
    try:
        with _stdout_to_stderr():
            result = train(config_from_args(args))
    except Interrupted as e:  # SIGINT/SIGTERM: the last finished step was checkpointed
        print(f"jaxport: interrupted: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt as e:  # a second signal (or one before training began): stopped at once
        signum = getattr(e, "signum", signal.SIGINT)
        latest = (_latest_step(args.workdir) if args.workdir is not None
                  and os.path.isdir(os.path.join(args.workdir, "checkpoints")) else None)
        kept = (f"the latest checkpoint, step {latest}, is in {os.path.join(args.workdir, 'checkpoints')}: continue "
                "with --resume" if latest is not None else "no checkpoint was written")
        print(f"jaxport: interrupted: {signal.Signals(signum).name}: {kept}", file=sys.stderr)
        return 128 + signum
    print(summary(result, args.workdir, args.epochs))
    return 0


@contextlib.contextmanager
def _stdout_to_stderr():
    """jax's CPU collectives (Gloo) print "[Gloo] Rank 0 is connected to 1 peer ranks ..." from
    C++ on the process's stdout, once per new group of devices. `jaxport train` keeps stdout for
    its result line (scripts read it), so while training, file descriptor 1 points at stderr."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        yield
        return
    os.dup2(2, 1)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def summary(result: dict, workdir: str, epochs: int) -> str:
    """The last line of a run: what `train` returned, said truthfully."""
    if "test_only" in result:
        return (f"val accuracy {result['val_acc']:.4f} (top-5 {result['val_acc5']:.4f}), val loss "
                f"{result['val_loss']:.4f} ({result['test_only']})")
    step = int(result["state"].step)
    if not result["steps_run"] and "val_acc" not in result:  # (a resumed epoch evaluated, trained before: below)
        return f"nothing to train: already at step {step}, checkpoints in {workdir}"
    if result.get("step") == step and result["epoch"] + 1 < epochs:  # --max-steps at an epoch's end
        return (f"stopped at step {step} (--max-steps) after epoch {result['epoch'] + 1} of {epochs}: val accuracy "
                f"{result['val_acc']:.4f}, checkpoints in {workdir}")
    if result.get("step") == step:  # the run ended with its last epoch, and its evaluation
        return f"val accuracy {result['val_acc']:.4f}, checkpoints in {workdir}"
    # --max-steps ended the run mid-epoch, after the last evaluation (if any)
    last = (f"; last evaluation (epoch {result['epoch'] + 1}, step {result['step']}): val accuracy "
            f"{result['val_acc']:.4f}") if "val_acc" in result else ""
    return f"stopped at step {step} (--max-steps){last}, checkpoints in {workdir}"
