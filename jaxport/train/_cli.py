"""`jaxport train`: argument parsing only; the work is `jaxport.train.train`."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

from ._loop import Interrupted, TrainConfig, train


def _batch_size(text: str):
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"`--batch-size` (={text!r}) must be an integer or 'auto'") from None


def add_parser(subparsers) -> None:
    """Register the `train` subcommand on an argparse subparsers object."""
    d = TrainConfig(workdir="")
    p = subparsers.add_parser(
        "train", help="train a ResNet data-parallel over every device (torch-equivalent SGD)",
        description="Train data-parallel over all devices. With no --data, trains on the handwritten digits "
                    "scikit-learn ships (upsampled to RGB); ResNet-18 reaches >= 95% held-out accuracy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, help="ImageFolder directory (one sub-folder per class, or train/ and val/ "
                                                 "(or validation/, valid/))")
    p.add_argument("--arch", default=d.arch, help="torchvision ResNet name")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=_batch_size, default=d.batch_size,
                   help="global batch (divisible by the device count) or 'auto'")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (cosine annealed per epoch)")
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and training_curves.png go here")
    p.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across devices")
    p.add_argument("--init", default=None,
                   help="starting weights: torch checkpoint, .safetensors, or a workdir (not read when --resume "
                        "finds a checkpoint)")
    p.add_argument("--trusted", action="store_true",
                   help="allow a full unpickle of the --init checkpoint (runs code from the file): only for files you trust")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --workdir")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype, help="compute dtype")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--workers", type=int, default=None, help="DataLoader worker processes (ImageFolder)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this global step")
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no progress bar (by default there is one when stderr is a terminal; logs get the "
                        "per-epoch lines only)")
    p.add_argument("--coordinator", default=None, help="multi-process: coordinator host:port")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in TrainConfig.__dataclass_fields__.values()}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})


def run(args: argparse.Namespace) -> int:
    """Run `jaxport train`; JaxportError propagates to the CLI, which prints it on one line."""
    try:
        with _stdout_to_stderr():
            result = train(config_from_args(args))
    except Interrupted as e:  # SIGINT/SIGTERM: the last finished step was checkpointed
        print(f"jaxport: interrupted: {e}", file=sys.stderr)
        return 128 + e.signum
    print(summary(result, args.workdir))
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


def summary(result: dict, workdir: str) -> str:
    """The last line of a run: what `train` returned, said truthfully."""
    step = int(result["state"].step)
    if not result["steps_run"]:
        return f"nothing to train: already at step {step}, checkpoints in {workdir}"
    if result.get("step") == step:  # the run ended with an epoch, and its evaluation
        return f"val accuracy {result['val_acc']:.4f}, checkpoints in {workdir}"
    # --max-steps ended the run mid-epoch, after the last evaluation (if any)
    last = (f"; last evaluation (epoch {result['epoch'] + 1}, step {result['step']}): val accuracy "
            f"{result['val_acc']:.4f}") if "val_acc" in result else ""
    return f"stopped at step {step} (--max-steps){last}, checkpoints in {workdir}"
