"""Argument checks shared by the ops: errors name the argument, the value and the fix."""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import ConfigError

METHODS = ("auto", "xla", "host")


def to_array(x, name: str) -> jax.Array:
    """`x` as a jax array of numbers or bools; anything else is one error naming `name`."""
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError):
        raise ConfigError(f"`{name}` must be an array of numbers or bools, got {_describe(x)}; "
                          f"convert it, e.g. jnp.asarray(values, jnp.float32)") from None


def _describe(x) -> str:
    dtype = getattr(x, "dtype", None)
    return f"{type(x).__name__} of dtype {dtype}" if dtype is not None else f"{type(x).__name__} {x!r}"[:80]


def check_flag(value, name: str) -> bool:
    """A Python (or numpy) bool; a traced value names the fix (it picks the program's shape)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, jax.Array) and value.shape == () and value.dtype == bool:
        try:
            return bool(value)
        except jax.errors.ConcretizationTypeError:
            raise ConfigError(f"`{name}` is traced; it must be a bool known when tracing: under jit pass it "
                              f"as a static argument (static_argnames=('{name}',))") from None
    raise ConfigError(f"`{name}` (={value!r}) must be True or False")


def check_method(method) -> str:
    if not (isinstance(method, str) and method in METHODS):
        raise ConfigError(f"`method` (={method!r}) must be one of {', '.join(map(repr, METHODS))}")
    return method


def normalize_axis(axis, ndim: int, name: str = "axis") -> int:
    """A single axis in [-ndim, ndim) -> [0, ndim); 0-d arrays accept axis 0 or -1."""
    try:
        if isinstance(axis, (bool, np.bool_)):
            raise TypeError
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
            if isinstance(a, (bool, np.bool_)):
                raise TypeError
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
