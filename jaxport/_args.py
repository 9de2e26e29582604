"""Checks of scalar arguments shared by the models, the optimizers and the cross-check.

`bool` is an `int` in Python, so `isinstance(True, int)` lets `num_classes=True` or `rtol=True`
through; every check here refuses bools (Python's and numpy's) and accepts numpy scalars.
Errors name the argument and the value.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import shlex

import numpy as np

from ._errors import ConfigError


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A Python or numpy real number (int or float), not a bool; NaN and inf included."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_finite(value) -> bool:
    """`is_real` and neither NaN nor inf."""
    return is_real(value) and math.isfinite(value)


def shown(value) -> str:
    """A number as its flag would be written (0.1, nan), anything else as Python writes it ('0.1')."""
    return str(value) if is_real(value) else repr(value)


def finite(name: str, value, *, minimum: float | None = None, hint: str = "") -> float:
    """`value` as a float if it is a finite real number (>= `minimum` if given).

    None, a string or NaN otherwise fail later inside optax or jax with an error naming none of
    the arguments (and a NaN compares false with everything, so range checks alone pass it).
    """
    if not (is_real(value) and math.isfinite(value)) or (minimum is not None and not value >= minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise ConfigError(f"`{name}` (={value!r}) must be a finite number{bound}{hint}")
    return float(value)  # a numpy float32 would round whatever is computed from it to float32


def whole(name: str, value, minimum: int | None = None) -> int:
    """`value` as an int if it is an integer or an integral float (>= `minimum` if given).

    torch's schedulers compare steps with ==, so a fractional value would silently never be
    reached.
    """
    if not (is_real(value) and math.isfinite(value) and value == int(value)) \
            or (minimum is not None and value < minimum):
        raise ConfigError(f"`{name}` (={value!r}) must be a whole number"
                          + (f" >= {minimum}" if minimum is not None else ""))
    return int(value)


def closest(text: str, names, aliases: dict[str, str] | None = None) -> str | None:
    """The name `text` most likely meant: the same letters and digits in another case or with other
    separators (resnet-18, ResNet18, BFLOAT16), a known alias (bf16), else the nearest spelling."""
    def key(name: str) -> str:
        return re.sub(r"[^a-z0-9]", "", name.lower())

    same = [n for n in names if key(n) == key(text)]
    if same:
        return same[0]
    if (aliases or {}).get(key(text)) in names:
        return aliases[key(text)]
    lower = {n.lower(): n for n in names}  # spelling compared without case, on both sides
    close = difflib.get_close_matches(text.lower(), list(lower), n=1, cutoff=0.6)
    return lower[close[0]] if close else None


def one_of(name: str, value, names, *, why: dict[str, str] | None = None,
           aliases: dict[str, str] | None = None) -> str:
    """`value` if it is one of `names`, else one error listing them and naming the one meant
    (`closest`); `why` adds a reason for particular values (e.g. one that is not supported)."""
    if value in names:
        return value
    text = value if isinstance(value, str) else repr(value)
    guess = closest(text, names, aliases) if isinstance(value, str) else None
    fix = f"; did you mean {name} {guess}?" if guess else ""
    reason = (why or {}).get(text.lower(), "")
    raise ConfigError(f"`{name}` (={value!r}) must be one of {', '.join(names)}{reason}{fix}")


def shell_word(path: str | os.PathLike) -> str:
    """`path` as one shell word that a command line reads as a path: quoted where needed, and a
    relative path starting with '-' as './-x' (quoting alone leaves it an option). For every
    command an error or hint tells the user to run."""
    text = str(path)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)


# torchvision's weights names, as `torchvision.models.get_weight` takes them: `ResNet50_Weights.IMAGENET1K_V2`.
# Matched without case, so that a misspelt case gets torch_compat's "did you mean"; but a name
# ending in a file extension (`model_weights.pth`, missing) is a path, and says it does not exist.
_WEIGHTS_NAME = re.compile(r"[a-z]\w*_weights\.([a-z]\w*)", re.IGNORECASE)
_FILE_SUFFIXES = {"pt", "pth", "bin", "ckpt", "tar", "safetensors", "pkl", "pickle", "zip", "npz", "npy", "h5",
                  "msgpack", "onnx", "json"}


def names_a_download(text: str | os.PathLike) -> bool:
    """Whether a checkpoint argument is an http(s) URL or a torchvision weights name, which
    `torch_compat.download_checkpoint` fetches, rather than a path. An existing file of that
    name is a path. (Here, not in torch_compat: deciding imports no torch.)"""
    text = os.fspath(text) if isinstance(text, os.PathLike) else text
    if not isinstance(text, str) or os.path.lexists(text):
        return False
    name = _WEIGHTS_NAME.fullmatch(text)
    return text.startswith(("http://", "https://")) or (name is not None and name[1].lower() not in _FILE_SUFFIXES)
