"""The embedded default checkpoint that `jaxport port` ports when given none.

No weights can be downloaded on a fresh offline machine, so the default is built locally and
deterministically: torchvision's ResNet-50 from a fixed seed with calibrated BatchNorm state
(`reference_model`), saved exactly as a GPU DataParallel run of PyTorch's ImageNet example
saves it: a training-script dict (`epoch`, `arch`, `state_dict`, `best_acc1`, `optimizer`)
whose state_dict keys carry `module.` and whose storages are tagged `cuda:0`.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from jaxport._errors import CheckpointError
from jaxport._io import atomic_path, open_for_writer

from ._cuda_tag import saving_as_cuda

ARCH = "resnet50"
SEED = 0
FILENAME = "resnet50_dataparallel_cuda.pth.tar"
DESCRIPTION = (
    "embedded default: torchvision resnet50, seed 0, calibrated BatchNorm, saved like a GPU "
    "DataParallel training run (cuda:0 storages, 'module.' keys, training-script dict)"
)


def cache_dir() -> Path:
    """`$JAXPORT_CACHE`, else `$XDG_CACHE_HOME/jaxport`, else `~/.cache/jaxport`."""
    if os.environ.get("JAXPORT_CACHE"):
        return Path(os.environ["JAXPORT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxport"


def default_path() -> Path:
    """Where `default_checkpoint()` keeps the default: `cache_dir() / FILENAME`."""
    return cache_dir() / FILENAME


def default_checkpoint(path: str | os.PathLike | None = None, *, rebuild: bool = False) -> Path:
    """Path of the default checkpoint, building it first if it is not there (about 2 s).

    Args:
      path: where to keep it; default `default_path()`.
      rebuild: build it again even if the file exists.
    """
    given = path is not None
    path = Path(path) if given else default_path()
    if path.exists() and not rebuild:
        return path
    try:
        # The temporary file is made before the ~2 s build, so an unwritable cache is said at once.
        with atomic_path(path) as tmp:
            checkpoint = _training_script_dict()
            # To a file object: torch names the archive's folder after a path it is given (the
            # random temporary one), and the same checkpoint differed from one cache to another.
            with saving_as_cuda("cuda:0"), open_for_writer(tmp, path) as f:
                torch.save(checkpoint, f)
    except OSError as e:
        # It was "No such file or directory: '/x/resnet50_...'", naming neither the cache nor the
        # way to move it (a read-only or missing HOME is the usual cause).
        where = ("" if given else "; it is built once and kept in jaxport's cache: set JAXPORT_CACHE (or "
                 "XDG_CACHE_HOME) to a writable directory, or pass a checkpoint to port")
        raise CheckpointError(f"cannot write the embedded default checkpoint to '{path}' "
                              f"({e.strerror or e}){where}") from e
    return path


def _training_script_dict() -> dict:
    from ._reference import reference_model  # torchvision: imported only when the default is built

    model = reference_model(ARCH, seed=SEED)
    wrapped = torch.nn.DataParallel(model)  # on a CPU-only machine it only adds `module.`
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return {
        "epoch": 90,
        "arch": ARCH,
        "state_dict": wrapped.state_dict(),
        "best_acc1": torch.tensor(76.13),
        "optimizer": optimizer.state_dict(),
    }
