"""Checks of scalar arguments shared by the models, the optimizers and the cross-check.

`bool` is an `int` in Python, so `isinstance(True, int)` lets `num_classes=True` or `rtol=True`
through; every check here refuses bools (Python's and numpy's) and accepts numpy scalars.
Errors name the argument and the value.
"""
from __future__ import annotations

import math

import numpy as np

from ._errors import ConfigError


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """A Python or numpy real number (int or float), not a bool; NaN and inf included."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


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
