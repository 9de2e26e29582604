"""Argument checks shared by the ops: errors name the argument, the value and the fix."""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import ConfigError

METHODS = ("auto", "xla", "host")


def to_array(x, name: str, *, exact: bool = False, overflow: bool = False, flush: bool = False) -> jax.Array:
    """`x` as a jax array of numbers or bools; anything else is one error naming `name`.

    With jax's 64-bit mode off, jax silently wraps int64 / uint64 to 32 bits (2**40 becomes 0),
    which makes any result wrong: such an input is refused when the wrap changes a value.
    float64 is rounded to float32 then, which is only rounding, as everywhere in jax, unless:
    `exact`: `x`'s values decide a discrete result (an order), so any changed value is refused
    (close values would become ties); `overflow`: a finite value that becomes +-inf is refused
    (1e300 would turn a finite logsumexp infinite); `flush`: a nonzero value that becomes 0 is
    refused (a scale factor of 1e-300 would drop its entry).
    A numpy array in non-native byte order is converted (jax refuses it); a torch tensor that
    requires grad is refused with the fix (jax cannot read it before it is detached).
    """
    if getattr(x, "requires_grad", False) and callable(getattr(x, "detach", None)):
        # A torch tensor in an autograd graph: jnp.asarray fails on it with torch's RuntimeError.
        raise ConfigError(f"`{name}` is a torch tensor that requires grad, which jax cannot read; "
                          f"pass {name}.detach()")
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    if not isinstance(x, jax.Array) and not jax.config.jax_enable_x64 and (exact or overflow or flush
                                                                          or hasattr(x, "dtype")):
        # Lists and Python numbers too (float64 to numpy): [1e300, 0.0] or b=[1e-50] were
        # narrowed to inf or 0 unchecked, where the same values as a numpy array were refused.
        # (Python ints that 32 bits cannot hold need no check: jnp.asarray refuses them, below.)
        _check_narrowing(x, name, floats=("exact",) if exact else
                         tuple(m for m, on in (("overflow", overflow), ("flush", flush)) if on))
    try:
        return jnp.asarray(x)
    except OverflowError:  # Python ints beyond 64 bits, or beyond 32 bits with x64 off
        raise ConfigError(f"`{name}` holds integers too large for jax's integer types (32-bit while "
                          "jax_enable_x64 is off); pass floats, or enable 64-bit mode with "
                          "jax.config.update('jax_enable_x64', True)") from None
    except (TypeError, ValueError):
        raise ConfigError(f"`{name}` must be an array of numbers or bools, got {_describe(x)}; "
                          f"convert it, e.g. jnp.asarray(values, jnp.float32)") from None


_NARROW = {np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32, np.dtype(np.float64): np.float32}


# What rounding float64 to float32 may do that a caller refuses: the words for it, and a mask of
# the values where it happens.
_FLOAT_CHANGES = {
    "overflow": ("overflow to inf", lambda host, back: np.isfinite(host) & np.isinf(back)),
    "flush": ("flush to 0", lambda host, back: (host != 0) & (back == 0)),
    "exact": ("change", lambda host, back: ~((back == host) | (np.isnan(host) & np.isnan(back)))),
}


def _check_narrowing(x, name: str, floats: tuple[str, ...] = ()) -> None:
    """Refuse `x` if jax's 32-bit narrowing changes it: any wrapped integer, and the float
    changes named in `floats` (keys of _FLOAT_CHANGES; none: float64 is only rounded)."""
    try:
        host = np.asarray(x)
    except Exception:  # noqa: BLE001 - not array-like: jnp.asarray names the problem
        return
    narrow = _NARROW.get(host.dtype)
    if narrow is None or host.size == 0 or (host.dtype.kind == "f" and not floats):
        return
    with np.errstate(all="ignore"):
        back = host.astype(narrow).astype(host.dtype)
    if host.dtype.kind != "f":
        bad, how, would = back != host, "wrap", "change"
    else:
        bad = np.zeros(host.shape, bool)
        for kind in floats:
            bad |= _FLOAT_CHANGES[kind][1](host, back)
        how, would = "round", " or ".join(_FLOAT_CHANGES[kind][0] for kind in floats)
    changed = int(np.count_nonzero(bad))
    if changed:
        if how == "wrap":
            fix = ""
        elif would == "change":
            fix = f", or cast `{name}` to float32 yourself if its rounding is acceptable"
        else:
            fix = f", or scale `{name}` into float32's range (about 1.2e-38 to 3.4e38)"
        raise ConfigError(
            f"`{name}` has dtype {host.dtype}, but jax's 64-bit mode is off, so jax would {how} it to "
            f"{np.dtype(narrow).name}, where {changed} of its {host.size} values would {would} (the result "
            f"could then differ from torch's on the {host.dtype} input); enable 64-bit mode with "
            f"jax.config.update('jax_enable_x64', True){fix}")


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
