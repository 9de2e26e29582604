"""Save CPU tensors so that the file looks exactly like one written from a GPU.

`torch.save` records, for every storage, the device it lived on (a *location tag* such as
``'cpu'`` or ``'cuda:0'``); `torch.load` without ``map_location`` restores storages there and
fails on a machine without CUDA. Checkpoints in the wild are mostly saved from GPUs, so the
loader must be tested against such files, and those tests have to run on CPU-only machines.

`saving_as_cuda` registers (once) a tagger ahead of torch's own that, only inside the context
and only in the calling thread / task, tags CPU storages with a CUDA location. Nothing else
about the file changes: the bytes of the tensors are identical to a plain CPU save.

Example:
    >>> import torch
    >>> from torch_compat._cuda_tag import saving_as_cuda
    >>> with saving_as_cuda():
    ...     torch.save({"w": torch.ones(2)}, "/tmp/w.pt")  # tagged 'cuda:0'
"""
from __future__ import annotations

import contextlib
import contextvars
import re
import threading
from collections.abc import Iterator

import torch

from jaxport._errors import ConfigError

# Lower runs first; torch's own taggers use 10 (cpu), 20 (cuda) and up. A unique value also keeps
# `register_package`'s sort from comparing two functions when priorities tie.
_PRIORITY = -1_000_003
_device: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "_cuda_tag_device", default=None
)
_registered = False
_lock = threading.Lock()


def _tag(storage) -> str | None:
    device = _device.get()
    if device is not None and storage.device.type == "cpu":
        return device
    return None  # defer to torch's taggers


def _restore(storage, location):  # noqa: ARG001 - never restores; torch's deserializers do
    return None


def _register_once() -> None:
    global _registered
    with _lock:
        if not _registered:
            torch.serialization.register_package(_PRIORITY, _tag, _restore)
            _registered = True


@contextlib.contextmanager
def saving_as_cuda(device: str = "cuda:0") -> Iterator[None]:
    """Within the context, `torch.save` tags CPU storages as if they lived on `device`.

    The tagger is active only inside the context and only for the current thread (a context
    variable), so concurrent saves elsewhere are unaffected. Contexts nest; the innermost wins.

    Args:
      device: the CUDA location to record, ``'cuda'`` or ``'cuda:<index>'``.

    Raises:
      ConfigError: if `device` is not a CUDA location.
    """
    if not isinstance(device, str) or not re.fullmatch(r"cuda(:\d+)?", device):
        raise ConfigError(
            f"`device` (={device!r}) must be a CUDA location such as 'cuda:0' or 'cuda:1'"
        )
    _register_once()
    token = _device.set(device)
    try:
        yield
    finally:
        _device.reset(token)
