"""Data-parallel training of jaxport's Flax ResNets, step for step equal to torch.

One step is `jax.jit` + `jax.shard_map` over a 1-D `data` mesh of every device (parameters
replicated, the global batch split, gradients averaged with `pmean`); BatchNorm statistics are
per device or synchronised (`bn_axis_name="data"`). The training loop (`train`) adds data
loading, orbax checkpoints with exact resume, metrics and plots; `jaxport train` is its CLI.

The names below are loaded on first use (PEP 562): a DataLoader worker unpickles its dataset
from `jaxport.train._data`, which needs numpy and torch only, and importing this package's
step, checkpoints and loop (jax, flax, optax, orbax) made every spawned worker take ~1.5 s and
~200 MB more as it started (once per split and run).
"""
from __future__ import annotations

import typing as _typing

from .._lazy import attach as _attach

# public name -> (module, attribute)
_LAZY = {
    "AXIS": ("._step", "AXIS"),
    "TrainState": ("._step", "TrainState"),
    "check_batch_size": ("._step", "check_batch_size"),
    "create_state": ("._step", "create_state"),
    "cross_entropy": ("._step", "cross_entropy"),
    "make_eval_step": ("._step", "make_eval_step"),
    "make_mesh": ("._step", "make_mesh"),
    "make_train_step": ("._step", "make_train_step"),
    "replicate": ("._step", "replicate"),
    "shard_batch": ("._step", "shard_batch"),
    "load_workdir": ("._checkpoint", "load_workdir"),
    "EMA": ("._ema", "EMA"),
    "ema_decay": ("._ema", "ema_decay"),
    "init_ema": ("._ema", "init_ema"),
    "restart_ema": ("._ema", "restart_ema"),
    "update_ema": ("._ema", "update_ema"),
    "digits": ("._data", "digits"),
    "image_folder": ("._data", "image_folder"),
    "Interrupted": ("._loop", "Interrupted"),
    "TrainConfig": ("._loop", "TrainConfig"),
    "train": ("._loop", "train"),
    "DivergedError": (".._errors", "DivergedError"),
    "OutOfMemoryError": ("._memory", "OutOfMemoryError"),
    "largest_batch": ("._memory", "largest_batch"),
    "step_bytes": ("._memory", "step_bytes"),
}
__all__ = [  # literal, for the tools that read it; tests/test_layering.py checks it against _LAZY
    "AXIS", "DivergedError", "EMA", "Interrupted", "OutOfMemoryError", "TrainConfig", "TrainState",
    "check_batch_size", "create_state", "cross_entropy", "digits", "ema_decay", "image_folder", "init_ema",
    "largest_batch", "load_workdir", "make_eval_step", "make_mesh", "make_train_step", "replicate",
    "restart_ema", "shard_batch", "step_bytes", "train", "update_ema",
]

if _typing.TYPE_CHECKING:  # what static tools see; at run time `__getattr__` below imports on use
    from ._step import AXIS as AXIS
    from ._step import TrainState as TrainState
    from ._step import check_batch_size as check_batch_size
    from ._step import create_state as create_state
    from ._step import cross_entropy as cross_entropy
    from ._step import make_eval_step as make_eval_step
    from ._step import make_mesh as make_mesh
    from ._step import make_train_step as make_train_step
    from ._step import replicate as replicate
    from ._step import shard_batch as shard_batch
    from ._checkpoint import load_workdir as load_workdir
    from ._ema import EMA as EMA
    from ._ema import ema_decay as ema_decay
    from ._ema import init_ema as init_ema
    from ._ema import restart_ema as restart_ema
    from ._ema import update_ema as update_ema
    from ._data import digits as digits
    from ._data import image_folder as image_folder
    from ._loop import Interrupted as Interrupted
    from ._loop import TrainConfig as TrainConfig
    from ._loop import train as train
    from .._errors import DivergedError as DivergedError
    from ._memory import OutOfMemoryError as OutOfMemoryError
    from ._memory import largest_batch as largest_batch
    from ._memory import step_bytes as step_bytes


__getattr__, __dir__ = _attach(__name__, _LAZY, __all__)
