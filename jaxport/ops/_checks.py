"""Argument checks shared by the ops: errors name the argument, the value and the fix."""
from __future__ import annotations

import operator

from .._errors import ConfigError


def normalize_axis(axis, ndim: int, name: str = "axis") -> int:
    """A single axis in [-ndim, ndim) -> [0, ndim); 0-d arrays accept axis 0 or -1."""
    try:
        axis = operator.index(axis)
    except TypeError:
        raise ConfigError(f"`{name}` (={axis!r}) must be an int; pass one axis, e.g. {name}=-1") from None
    size = max(ndim, 1)
    if not -size <= axis < size:
        raise ConfigError(
            f"`{name}` (={axis}) is out of range for an array with {ndim} dimension(s); "
            f"use a value in [{-size}, {size - 1}]"
        )
    return axis % size


def normalize_axes(axis, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """None (all axes), an int, or a sequence of distinct ints -> sorted tuple in [0, ndim).

    A 0-d array takes axis 0 or -1 and reduces nothing (`()`), as torch's reductions do.
    """
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if not isinstance(axis, (tuple, list)) else tuple(axis)
    out = []
    for a in axes:
        try:
            a = operator.index(a)
        except TypeError:
            raise ConfigError(f"`{name}` (={axis!r}) must be None, an int or a tuple of ints") from None
        if ndim == 0:
            if a in (0, -1) and len(axes) == 1:
                return ()
            raise ConfigError(f"`{name}` (={axis!r}) cannot index a 0-d array, which has no axes; pass {name}=None")
        if not -ndim <= a < ndim:
            raise ConfigError(
                f"`{name}` (={axis!r}) is out of range for an array with {ndim} dimension(s); "
                f"use values in [{-ndim}, {ndim - 1}]"
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ConfigError(f"`{name}` (={axis!r}) repeats an axis; list each axis once")
    return tuple(sorted(out))
