"""Optax transformations and learning-rate schedules equal to torch.optim's.

Pure optax (no torch import), so the JAX training loop can use them; `torch_compat.optim`
re-exports them under the names torch users look for.

Update equations (torch.optim, `maximize=False`, one param group):

* SGD: `g = grad + wd * p`; `buf = g` on the first step, else `buf = momentum * buf +
  (1 - dampening) * g`; `g = g + momentum * buf` if nesterov else `buf`; `p -= lr * g`.
* AdamW: `p *= 1 - lr * wd`; `m = b1 m + (1 - b1) g`; `v = b2 v + (1 - b2) g^2`;
  `p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)`.
* RMSprop: `g = grad + wd * p`; `v = alpha v + (1 - alpha) g^2`; `buf = momentum buf + g /
  (sqrt(v) + eps)`; `p -= lr * buf` (see `rmsprop`, also for `centered`).

Schedules reproduce torch's `lr_scheduler` values exactly, including the recursive
(multiplicative) formulas torch uses, by running the same recursion in Python floats once and
looking the result up by step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._args import finite, is_real, whole
from .._errors import ConfigError

Schedule = Callable[[jax.Array], jax.Array]
ScalarOrSchedule = float | Schedule


# Low-precision (bfloat16, float16) parameters. torch computes each op on such a tensor in float32
# ("opmath") and rounds its result to the tensor's dtype once; a Python number it multiplies by
# (`mul_(momentum)`, `lerp_`'s weight, `addcdiv_`'s value) enters as a float32, but `add(t,
# alpha=a)` first rounds `a` to the tensor's dtype. jnp rounds a Python number to the array's
# dtype in every product instead (momentum 0.9 -> 0.8984 in bfloat16, beta2 0.999 -> 1.0), so a
# constant gradient's momentum buffer settled ~2% low. The helpers below do torch's arithmetic op
# for op. (torch's CPU loop computes the last `size % 32` elements of a tensor one at a time,
# rounding `alpha * t` before the add; these follow its vectorised body, used for all others.)

def _low_precision(x) -> bool:
    """A floating dtype narrower than float32 (bfloat16, float16), which torch computes in float32."""
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def _add(x: jax.Array, t: jax.Array, alpha, dtype) -> jax.Array:
    """torch's `x.add(t, alpha=alpha)` into `dtype`: `alpha` rounded to `dtype` first, as torch does."""
    return (_f32(x) + _f32(alpha).astype(dtype).astype(jnp.float32) * _f32(t)).astype(dtype)


def _mul(x: jax.Array, number) -> jax.Array:
    """torch's `x.mul(number)`: the number in float32, one rounding."""
    return (_f32(x) * _f32(number)).astype(x.dtype)


def _buffer_step(buf: jax.Array, g: jax.Array, momentum, dampening) -> jax.Array:
    """torch's `buf.mul_(momentum).add_(g, alpha=1 - dampening)`, in the buffer's dtype."""
    if _low_precision(buf):
        return _add(_mul(buf, momentum), g, 1 - dampening, buf.dtype)
    return momentum * buf + (1 - dampening) * g


def _trace(momentum: float, nesterov: bool) -> optax.GradientTransformation:
    """optax.trace (same state, so checkpoints are interchangeable) with torch's rounding for
    low-precision leaves. Its buffer starts at zeros, so the first is `0 * m + g = g`, as torch's."""
    base = optax.trace(decay=momentum, nesterov=nesterov)

    def update(updates, state, params=None):
        out, new = base.update(updates, state, params)
        trace = jax.tree.map(lambda t, g, b: _buffer_step(b, g, momentum, 0.0) if _low_precision(b) else t,
                             new.trace, updates, state.trace)
        if nesterov:  # torch: `g.add(buf, alpha=momentum)`
            out = jax.tree.map(lambda o, g, b: _add(g, b, momentum, g.dtype) if _low_precision(g) else o,
                               out, updates, trace)
        else:
            out = jax.tree.map(lambda o, b: b if _low_precision(b) else o, out, trace)
        return out, optax.TraceState(trace=trace)

    return optax.GradientTransformation(base.init, update)


def _add_decayed_weights(weight_decay, *, decoupled: bool) -> optax.GradientTransformation:
    """optax.add_decayed_weights (same state). Low-precision leaves: SGD's `g.add(p, alpha=wd)`
    rounded as torch; AdamW's decoupled decay (`decoupled`) is left to `_scale_by_learning_rate`,
    which applies it to the parameter as torch does, so their updates pass unchanged."""
    base = optax.add_decayed_weights(weight_decay)

    def update(updates, state, params=None):
        out, state = base.update(updates, state, params)
        if params is None:  # weight decay 0: optax needs no parameters
            return out, state
        return jax.tree.map(lambda o, g, p: (g if decoupled else _add(g, p, weight_decay, g.dtype))
                            if _low_precision(p) else o, out, updates, params), state

    return optax.GradientTransformation(base.init, update)


def _scale_by_learning_rate(learning_rate: ScalarOrSchedule, decoupled_weight_decay=None) -> optax.GradientTransformation:
    """optax.scale_by_learning_rate (same state). For a low-precision parameter it returns the
    update that `optax.apply_updates` (`p + u`, rounded) turns into torch's once-rounded
    `p.add_(g, alpha=-lr)` (SGD), or `p.mul_(1 - lr * wd)` then `p += -lr * g` with `g` the
    float32 Adam step (AdamW, `decoupled_weight_decay=wd`); such an update is float32. Rounding
    `-lr * g` to the parameter's dtype first, then `p + u`, rounded twice, ~1 ulp off torch on
    one element in 200 per step."""
    base = optax.scale_by_learning_rate(learning_rate)

    def update(updates, state, params=None):
        out, new_state = base.update(updates, state, params)
        if params is None or not any(_low_precision(p) for p in jax.tree.leaves(params)):
            return out, new_state
        neg_lr = base.update(jnp.ones([], jnp.float32), state)[0]  # -lr at this step, in float32 as torch's

        def one(o, g, p):
            if not _low_precision(p):
                return o
            if decoupled_weight_decay is None:
                new = _add(p, g, neg_lr, p.dtype)
            else:
                new = (_f32(_mul(p, 1 + neg_lr * decoupled_weight_decay)) + neg_lr * _f32(g)).astype(p.dtype)
            # Kept in float32: `optax.apply_updates` then adds `p + u` in float32 and rounds once,
            # landing on `new` exactly whenever `new - p` is exact in float32 (every step that
            # does not move a parameter across ~2^24 of its own size). Rounded to p's dtype, `u`
            # was exact only where new is within a factor 2 of p (Sterbenz): a parameter that
            # moved by more than its own size (near 0) landed an ulp away, ~0.5% of a ResNet's
            # weights per step at lr 0.1.
            return _f32(new) - _f32(p)

        return jax.tree.map(one, out, updates, params), new_state

    return optax.GradientTransformation(base.init, update)


class _TorchMomentumState(NamedTuple):
    count: jax.Array  # steps that used the buffer (momentum != 0): 0 means torch has none yet
    trace: optax.Updates


def _torch_momentum(momentum: float, dampening: float, nesterov: bool) -> optax.GradientTransformation:
    """torch's momentum buffer with dampening: `buf = g` on its first step, then `m buf + (1 - d) g`."""

    def init(params):
        return _TorchMomentumState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del params
        # momentum == 0 only reaches here as an array (optax.inject_hyperparams): torch then
        # uses the gradient itself, ignores dampening, and leaves its buffer as it was (none, or
        # the last one), which it resumes from once momentum is set again. Counting only the
        # steps that used the buffer keeps that: a buffer that was never used starts as `g`.
        active = jnp.asarray(momentum) != 0
        first = state.count == 0
        trace = jax.tree.map(
            lambda g, b: jnp.where(active, jnp.where(first, g, _buffer_step(b, g, momentum, dampening)), b).astype(b.dtype),
            updates, state.trace,
        )
        if nesterov:
            out = jax.tree.map(lambda g, b: _add(g, b, momentum, g.dtype) if _low_precision(g)
                               else (g + momentum * b).astype(g.dtype), updates, trace)
        else:
            out = jax.tree.map(lambda g, b: jnp.where(active, b, g).astype(g.dtype), updates, trace)
        count = jnp.where(active, optax.safe_int32_increment(state.count), state.count)
        return out, _TorchMomentumState(count, trace)

    return optax.GradientTransformation(init, update)


def _scale_by_adam(b1: float | Schedule, b2: float, eps) -> optax.GradientTransformation:
    """optax.scale_by_adam (same state, so checkpoints are interchangeable) with torch's bias
    corrections. optax computes `1 - b**t` in the moments' dtype: in float32, b2 = 0.99999
    rounds to 0.99998999, so `1 - b2**t` came out 0.14% large and the updates 0.07% off, for
    ~1 / (1 - b2) steps (torch computes it in Python floats). `-expm1(t * log(b))` with log(b)
    taken in Python floats is accurate to float32 rounding for every t.

    `b1` may be a schedule (updates done -> beta1), as torch's OneCycleLR sets `betas[0]` on
    Adam before each step; torch's step then uses that beta1 in both the moment and its bias
    correction `1 - beta1**t`, and so does this (log(beta1) then taken in the schedule's dtype)."""
    init = optax.scale_by_adam().init  # its state (count, mu, nu), which no hyper-parameter shapes
    log_b2 = math.log(b2) if b2 > 0 else -math.inf  # b = 0: 1 - 0**t = 1

    def update(updates, state, params=None):
        del params
        if callable(b1):
            decay1 = jnp.asarray(b1(state.count))
            log_b1 = jnp.log(decay1)  # log(0) = -inf: 1 - 0**t = 1, as for a number
        else:
            decay1, log_b1 = b1, math.log(b1) if b1 > 0 else -math.inf
        mu = optax.tree_utils.tree_update_moment(updates, state.mu, decay1, 1)
        nu = optax.tree_utils.tree_update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count = optax.safe_int32_increment(state.count)

        def corrected(moment, log_b):  # in float32 at least (bfloat16 cannot even count to 257), as torch's floats
            def one(m):
                wide = jnp.promote_types(m.dtype, jnp.float32)
                return (m / -jnp.expm1(count.astype(wide) * jnp.asarray(log_b, wide))).astype(m.dtype)
            return jax.tree.map(one, moment)

        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), corrected(mu, log_b1), corrected(nu, log_b2))
        nu = jax.tree.map(lambda n, old: n.astype(old.dtype), nu, state.nu)
        if any(_low_precision(m) for m in jax.tree.leaves(state.mu)):
            bc1, bc2 = (-jnp.expm1(_f32(count) * jnp.asarray(log_b, jnp.float32)) for log_b in (log_b1, log_b2))

            def low(o, m, v, g, old_m, old_v):  # torch's ops on low-precision moments, each rounded once
                if not _low_precision(old_m):
                    return o, m, v
                # `exp_avg.lerp_(g, 1 - b1)`, torch's two-sided lerp with its weight in float32 (a
                # scheduled b1 is already rounded to float32 here, 1 - b1 then once more)
                w = _f32(1 - decay1) if callable(b1) else np.float32(1 - b1)
                d = _f32(g) - _f32(old_m)
                m = jnp.where(w < 0.5, _f32(old_m) + w * d, _f32(g) - d * (1 - w)).astype(old_m.dtype)
                v = (_f32(_mul(old_v, b2)) + np.float32(1 - b2) * _f32(g) * _f32(g)).astype(old_v.dtype)  # mul_, addcmul_
                denom = (_f32(jnp.sqrt(_f32(v)).astype(v.dtype)) / jnp.sqrt(bc2)).astype(v.dtype)  # (sqrt(v) / sqrt(bc2)).add_(eps)
                denom = (_f32(denom) + _f32(eps)).astype(v.dtype)
                return _f32(m) / _f32(denom) / bc1, m, v  # float32: `_scale_by_learning_rate` adds it to p

            triples = jax.tree.map(low, out, mu, nu, updates, state.mu, state.nu)
            is_triple = lambda x: isinstance(x, tuple)  # noqa: E731
            out, mu, nu = (jax.tree.map(lambda t, i=i: t[i], triples, is_leaf=is_triple) for i in range(3))
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def _is_array(value) -> bool:
    """A jax or numpy array, as `optax.inject_hyperparams` passes hyper-parameters (traced
    inside `jit`); numpy scalars are plain numbers here."""
    return isinstance(value, (jax.Array, np.ndarray))


def _hyperparameter(name: str, value, *, minimum: float | None = None, hint: str = ""):
    """`value` checked as `finite` does, also when it is a 0-d real array (jax or numpy): a
    concrete one is checked by value, a traced one (`inject_hyperparams` under `jit`) passes, as
    its concrete value was checked when the optimizer state was initialised. Arrays are
    returned unchanged (optax reads them as they are); numbers as `finite` returns them."""
    if not _is_array(value):
        return finite(name, value, minimum=minimum, hint=hint)
    if value.shape != () or not (jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)):
        raise ConfigError(f"`{name}` (={value!r}) must be a number or a 0-d real array{hint}")
    if not isinstance(value, jax.core.Tracer):
        scalar = np.asarray(value)[()]  # a numpy scalar: its repr in the error names the dtype
        finite(name, scalar if is_real(scalar) else float(scalar), minimum=minimum, hint=hint)  # bfloat16: a float
    return value


def _check_non_negative(**values) -> None:
    """torch.optim refuses negative values; NaN and inf are refused too (torch takes them and
    trains to NaN). A learning-rate schedule (a callable) is left to its own checks; as in torch,
    nothing else takes one (a callable momentum or eps failed later, naming no argument; a
    weight-decay schedule worked with some optax versions only)."""
    for name, value in values.items():
        if callable(value) and name != "learning_rate":
            raise ConfigError(f"`{name}` (={value!r}) must be a number; only `learning_rate` takes a schedule "
                              "(step -> lr); to change another while training, use optax.inject_hyperparams")
        if not callable(value):
            _hyperparameter(name, value, minimum=0, hint=" or a schedule (step -> lr)" if name == "learning_rate" else "")


def _concrete(value) -> float | None:
    """A hyper-parameter's value, or None when it is traced (and cannot be read)."""
    return None if isinstance(value, jax.core.Tracer) else float(value)


def _floating_only(tx: optax.GradientTransformation, low_precision: str | None = None
                   ) -> optax.GradientTransformationExtraArgs:
    """`tx` refusing non-floating parameters at `init` and float0 gradients at `update`: optax
    would update an integer leaf and truncate it silently (torch refuses integer tensors as
    parameters), and fails on a float0 gradient (jax.grad(..., allow_int=True) of one) with its
    own obscure errors. Both are refused, naming the leaf; such leaves belong outside the
    optimizer. `low_precision`, if given, refuses bfloat16/float16 parameters too, with that
    reason."""
    fix = ("keep integer leaves out of the optimizer, e.g. optax.multi_transform({'train': sgd(...), "
           "'fixed': optax.set_to_zero()}, labels) with label 'fixed' for them")

    def init(params):
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
                raise ConfigError(f"parameter {jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}: only "
                                  f"floating-point parameters can be optimized (torch.optim refuses others too); {fix}")
            if low_precision and jnp.finfo(jnp.result_type(leaf)).bits < 32:
                raise ConfigError(f"parameter {jax.tree_util.keystr(path)} has dtype {jnp.result_type(leaf)}: "
                                  f"{low_precision}")
        return tx.init(params)

    def update(updates, state, params=None, **extra_args):
        for path, leaf in jax.tree_util.tree_leaves_with_path(updates):
            if jnp.result_type(leaf) == jax.dtypes.float0:
                raise ConfigError(f"gradient {jax.tree_util.keystr(path)} has dtype float0 (the gradient of an integer "
                                  f"leaf, from jax.grad(..., allow_int=True)), which no optimizer step can apply; {fix}")
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
) -> optax.GradientTransformation:
    """`torch.optim.SGD` as an optax transformation, update for update.

    Weight decay applies to every parameter (torch's default, BatchNorm and biases included).
    With `dampening == 0` this is optax's own chain (`add_decayed_weights`, `trace`, scale):
    `optax.trace` starts from zeros, so its first buffer is `g`, as torch's. With dampening,
    torch's first buffer is `g` but later ones add `(1 - dampening) g`; a small transformation
    does that.

    Args:
      learning_rate: a float or an optax schedule (step -> lr), e.g. `step_lr(...)`.
      momentum, dampening, weight_decay, nesterov, maximize: as torch.optim.SGD (maximize
        ascends: the gradient is negated before weight decay, as torch does).

    The numbers may also be 0-d arrays, as `optax.inject_hyperparams(sgd)` passes them: that
    is how to read or change the lr while training (torch's `param_groups[0]["lr"] = ...`):
    `tx = optax.inject_hyperparams(sgd)(0.1, momentum=0.9)`, then set
    `state.hyperparams["learning_rate"]`.

    A parameter that torch leaves alone because its `.grad` is None (unused in that step) has a
    zero gradient in JAX, so weight decay and momentum still move it; a ResNet uses every
    parameter every step, so its training is unaffected. For frozen layers use
    `optax.multi_transform({"train": sgd(...), "frozen": optax.set_to_zero()}, labels)`, which
    equals torch; torch's param groups (e.g. no decay on biases) are `multi_transform` too.
    Low-precision (bfloat16, float16) parameters are updated in their dtype, momentum buffer
    included, as torch does: each of torch's ops computed in float32 and rounded once, so the
    two agree bit for bit (torch's CPU loop rounds twice on a tensor's last `size % 32`
    elements; see tests/test_optim_probe.py). Their updates are float32: apply them with
    `optax.apply_updates`, which rounds `p + u` once into the parameter's dtype (an update
    rounded to that dtype first would round twice, an ulp off torch where a step moves a
    parameter by more than its own size).

    Raises:
      ConfigError: for the combinations torch refuses (nesterov without momentum or with
        dampening, negative values); at `init`, a non-floating (e.g. integer) parameter; at
        `update`, a float0 gradient (both name the leaf: keep such leaves out of the optimizer).

    Example:
      >>> tx = sgd(0.1, momentum=0.9, weight_decay=1e-4)
    """
    _check_non_negative(learning_rate=learning_rate, momentum=momentum, weight_decay=weight_decay)
    _hyperparameter("dampening", dampening)  # torch takes any number here, negative ones included
    m, d = _concrete(momentum), _concrete(dampening)
    if nesterov and ((m is not None and m <= 0) or (d is not None and d != 0)):
        raise ConfigError(
            f"nesterov momentum needs `momentum` > 0 and `dampening` == 0 (got momentum={momentum}, "
            f"dampening={dampening}), as torch.optim.SGD; set nesterov=False or fix them"
        )
    parts = [optax.scale(-1.0)] if maximize else []
    if any(_is_array(v) for v in (momentum, dampening, weight_decay)):
        # Arrays (optax.inject_hyperparams): one chain whatever their values, so the state
        # made at init (concrete values) fits the update (traced ones).
        parts += [_add_decayed_weights(weight_decay, decoupled=False), _torch_momentum(momentum, dampening, nesterov)]
    else:
        if weight_decay:
            parts.append(_add_decayed_weights(weight_decay, decoupled=False))
        if momentum:
            if dampening == 0:
                parts.append(_trace(momentum, nesterov))
            else:
                parts.append(_torch_momentum(momentum, dampening, nesterov))
    parts.append(_scale_by_learning_rate(learning_rate))
    return _floating_only(optax.chain(*parts))


def adamw(
    learning_rate: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> optax.GradientTransformation:
    """`torch.optim.AdamW` (torch's defaults) as an optax transformation.

    optax's `scale_by_adam` is torch's Adam step (bias-corrected moments, `eps` added after the
    square root); decoupled decay `p -= lr * wd * p` equals torch's `p *= 1 - lr * wd` followed
    by the Adam step, since both use the parameter before the step. Every parameter is decayed,
    as torch does by default. `maximize=True` ascends: torch negates the gradient first.
    Param groups, frozen layers, `optax.inject_hyperparams` and low-precision parameters: as
    for `sgd`.

    `betas[0]` may be a schedule (step -> beta1): torch's `OneCycleLR` cycles Adam's beta1 by
    default (`cycle_momentum=True`), which is
    `adamw(one_cycle_lr(max_lr, n), betas=(one_cycle_momentum(n), 0.999))`. torch uses each
    step's beta1 in the moment and in its bias correction `1 - beta1**t`, and so does this.

    Raises:
      ConfigError: `amsgrad=True` (not reproduced), out-of-range betas, or what torch refuses
        (a negative learning rate, eps or weight decay); integer parameters and float0
        gradients, as for `sgd`.
    """
    _check_non_negative(learning_rate=learning_rate, eps=eps, weight_decay=weight_decay)
    if amsgrad:
        # torch takes the maximum of the raw second moment and bias-corrects it with the current
        # step; optax.amsgrad takes the maximum of the corrected ones: the updates differ.
        raise ConfigError("`amsgrad` (=True) is not supported (torch's AMSGrad is not reproduced); use amsgrad=False")
    try:
        if any(isinstance(b, (str, bytes)) for b in betas):  # float("0.9") works; torch refuses strings
            raise TypeError
        b1, b2 = betas
        b1, b2 = b1 if callable(b1) else float(b1), float(b2)
    except (TypeError, ValueError):
        raise ConfigError(f"`betas` (={betas!r}) must be two numbers (beta1, beta2), e.g. (0.9, 0.999), beta1 "
                          "perhaps a schedule (step -> beta1) such as one_cycle_momentum(...)") from None
    # A schedule is checked where its values are known: this module's (`.table`) here; another's
    # values are its own affair, as a learning-rate schedule's are.
    if callable(b1):
        outside = [(step, b) for step, b in enumerate(getattr(b1, "table", ())) if not 0 <= b < 1]
        if outside:
            raise ConfigError(f"`betas[0]`, a beta1 schedule, must stay in [0, 1), as torch's Adam requires; it "
                              f"reaches {outside[0][1]} at step {outside[0][0]} (e.g. one_cycle_momentum's "
                              "base_momentum and max_momentum must both be below 1)")
    if not ((callable(b1) or 0 <= b1 < 1) and 0 <= b2 < 1):
        raise ConfigError(f"`betas` (={betas}) must both be in [0, 1)")
    return _floating_only(optax.chain(
        *([optax.scale(-1.0)] if maximize else []),  # torch negates the gradient first
        _scale_by_adam(b1, b2, eps),
        _add_decayed_weights(weight_decay, decoupled=True),
        _scale_by_learning_rate(learning_rate, decoupled_weight_decay=weight_decay),
    ))


def rmsprop(
    learning_rate: ScalarOrSchedule = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
) -> optax.GradientTransformation:
    """`torch.optim.RMSprop` (torch's defaults) as an optax transformation.

    torch's step: `g = grad + wd * p`; `v = alpha v + (1 - alpha) g^2`; with `centered`,
    `m = alpha m + (1 - alpha) g` and `avg = sqrt(v - m^2)`, else `avg = sqrt(v)`; then
    `avg + eps` divides: with momentum `buf = momentum buf + g / (avg + eps)` and `p -= lr buf`,
    else `p -= lr g / (avg + eps)`. That is optax's own chain: `add_decayed_weights`,
    `scale_by_rms` (`scale_by_stddev` when centered) with `eps_in_sqrt=False` (torch adds eps
    after the square root) and `initial_scale=0` (torch's averages start at zero), `trace` (its
    buffer starts at zero, so the first is `g / (avg + eps)`, as torch's), the learning rate.
    torchvision's recipe (`--opt rmsprop`) uses `alpha=0.9, eps=0.0316`. Weight decay applies to
    every parameter; `maximize=True` ascends (torch negates the gradient first). Param groups,
    frozen layers and `optax.inject_hyperparams`: as for `sgd`.

    Raises:
      ConfigError: what torch refuses (a negative learning rate, alpha, eps, weight decay or
        momentum); at `init`, a non-floating parameter, or a low-precision (bfloat16, float16)
        one, whose torch rounding this does not reproduce (keep float32 parameters: `jaxport
        train --dtype bfloat16` keeps float32 masters); float0 gradients, as for `sgd`.

    Example:
      >>> tx = rmsprop(0.01, alpha=0.9, eps=0.0316, momentum=0.9, weight_decay=1e-5)
    """
    _check_non_negative(learning_rate=learning_rate, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum)
    parts = [optax.scale(-1.0)] if maximize else []  # torch negates the gradient first
    if weight_decay or _is_array(weight_decay):
        parts.append(optax.add_decayed_weights(weight_decay))
    scale = optax.scale_by_stddev if centered else optax.scale_by_rms
    parts.append(scale(decay=alpha, eps=eps, initial_scale=0.0, eps_in_sqrt=False))
    if momentum or _is_array(momentum):
        parts.append(optax.trace(decay=momentum))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return _floating_only(optax.chain(*parts), low_precision=(
        "rmsprop reproduces torch.optim.RMSprop for float32 and float64 parameters, not torch's rounding in low "
        "precision; keep float32 parameters (compute in bfloat16 with float32 masters, as jaxport train --dtype "
        "bfloat16 does)"))


# ---------------------------------------------------------------------------------------------
# Schedules. Each returns an optax schedule `count -> lr`, where count is the number of times
# torch's `scheduler.step()` has been called (epochs when stepped per epoch; wrap with
# `per_epoch` to drive it from the optimizer's step count).
#
# torch computes most schedules recursively from the previous lr, so each schedule runs torch's
# recursion once in Python floats and looks the value up by step. The table covers every value
# the schedule can take (StepLR and ExponentialLR: one entry per decay; MultiStepLR: one per
# milestone; LinearLR and ConstantLR: the warm-up, then it is constant), so any step count is
# exact. Only where a table would be unbounded is a closed form used past it, equal to torch's
# recursion within rounding: CosineAnnealingLR past max(T_max, 10,000) steps, and StepLR
# (ExponentialLR) past 100,000 decays.

_COSINE_EXACT = 10_000
_MAX_DECAYS = 100_000
_COSINE_MAX = 10_000_000  # 80 MB of table and ~4 s to build it: past that, refused


def _step_count(count) -> jax.Array:
    """`count` as an integer array. A float step (e.g. `sched(3.0)`) failed with "Indexer must
    have integer type": an integral one is taken; a concrete fractional one is refused (torch's
    recursive schedulers only ever reach whole steps); a traced float is floored."""
    if not isinstance(count, jax.core.Tracer) and jnp.issubdtype(jnp.result_type(count), jnp.floating):
        if not np.all(np.mod(count, 1) == 0):
            raise ConfigError(f"the schedule's step `count` (={count!r}) must be a whole number (the number of "
                              "scheduler.step() calls); use an int")
    count = jnp.asarray(count)
    if jnp.issubdtype(count.dtype, jnp.floating):
        count = jnp.floor(count).astype(jnp.result_type(int))
    return count


def _floor_div(count: jax.Array, divisor: int) -> jax.Array:
    """`count // divisor` also for a divisor past the count's integer range (int32 without x64),
    where jax failed at the first update with an OverflowError: the quotient of any such count
    is then 0 (or -1 below 0)."""
    if divisor > jnp.iinfo(count.dtype).max:
        return jnp.where(count < 0, -1, 0).astype(count.dtype)
    return count // divisor


def _lookup(values: Sequence[float], index: Callable[[jax.Array], jax.Array],
            beyond: Callable[[jax.Array, jax.Array], jax.Array] | None = None) -> Schedule:
    """A schedule reading `values[index(count)]`; past the table's end `beyond(count, value)`
    (default: the last value holds)."""
    table = np.asarray(values, np.float64)

    def schedule(count):
        count = _step_count(count)
        i = index(count)
        value = jnp.asarray(table, dtype=jnp.result_type(float))[jnp.clip(i, 0, len(table) - 1)]
        if beyond is None:
            return value
        return jnp.where(i < len(table), value, beyond(count, value))

    schedule.table = table  # the exact Python-float values, for inspection and tests
    return schedule


def _check_base_lr(base_lr: float) -> float:
    return finite("base_lr", base_lr, minimum=0, hint=", as torch.optim's learning rate")


def step_lr(base_lr: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """torch's `StepLR(step_size, gamma)`: `lr *= gamma` every `step_size` steps.

    Exact at every step: one table entry per decay (torch's repeated multiplication), until the
    lr stops changing (it reaches 0, or gamma is 1) or for 100,000 decays, past which it goes on
    as `lr * gamma ** k`, equal within rounding.
    """
    base_lr = _check_base_lr(base_lr)
    step_size = whole("step_size", step_size, 1)
    gamma = finite("gamma", gamma)
    lrs = [base_lr]
    while len(lrs) <= _MAX_DECAYS:
        lr = lrs[-1] * gamma
        if lr == lrs[-1] or math.isinf(lrs[-1]):
            break
        lrs.append(lr)
    decays = lambda count: _floor_div(count, step_size)  # noqa: E731
    # gamma == 1 or 0 converge at once: past the table the last value holds. |gamma| > 1
    # overflows to inf, as torch's lr does (it held the last finite value); a negative gamma
    # then alternates inf and -inf, as torch's.
    if math.isinf(lrs[-1]):
        lrs.append(lrs[-1] * gamma)
        return _lookup(lrs, decays, lambda count, last: jnp.where(
            (decays(count) - len(lrs)) % 2 == 0, lrs[-2], lrs[-1]).astype(last.dtype))
    if len(lrs) <= _MAX_DECAYS:
        return _lookup(lrs, decays)
    return _lookup(lrs, decays,
                   lambda count, last: last * jnp.asarray(gamma, last.dtype) ** (decays(count) - _MAX_DECAYS))


def multistep_lr(base_lr: float, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    """torch's `MultiStepLR(milestones, gamma)`: `lr *= gamma ** k` at a milestone listed k times.

    Exact at every step (one table entry per distinct milestone). Milestones must be whole
    numbers: torch never reaches a fractional one, which is almost always a mistake.
    """
    base_lr = _check_base_lr(base_lr)
    gamma = finite("gamma", gamma)
    if isinstance(milestones, (str, bytes)) or not hasattr(milestones, "__iter__"):
        raise ConfigError(f"`milestones` (={milestones!r}) must be a list of steps, e.g. [30, 60, 90]")
    counts: dict[int, int] = {}
    for m in milestones:
        m = whole("milestones", m)
        if m >= 0:  # torch's step count never goes below 0: a negative milestone never fires
            counts[m] = counts.get(m, 0) + 1
    at = sorted(counts)
    lrs = [base_lr]
    for m in at:
        lrs.append(lrs[-1] * gamma ** counts[m])
    if not at:
        return _lookup(lrs, lambda count: jnp.zeros_like(count))
    edges = np.asarray(at, np.int64)
    # a milestone past the count's range (2**31 steps in int32 without x64) is never reached
    return _lookup(lrs, lambda count: jnp.searchsorted(
        jnp.asarray(np.minimum(edges, jnp.iinfo(count.dtype).max), count.dtype), count, side="right"))


def cosine_annealing_lr(base_lr: float, t_max: int, eta_min: float = 0.0) -> Schedule:
    """torch's `CosineAnnealingLR(T_max, eta_min)` with its recursive update, value for value.

    torch does not evaluate `eta_min + (base - eta_min) (1 + cos(pi t / T_max)) / 2` but a
    recursion on the previous lr (and a special rise at `t - 1 - T_max = 0 mod 2 T_max`); the
    two differ in the last bits and past `T_max`. This runs torch's recursion for the first
    max(T_max, 10,000) + 1 steps, exactly; past them (only reached beyond T_max, where torch's
    lr rises again) it evaluates that closed form, which torch's recursion follows within rounding.
    The table is a constant of the jitted update (8 bytes a step), so `t_max` is limited to
    10,000,000 (ConfigError past it; optax.cosine_decay_schedule is the closed form).
    """
    return _cosine(base_lr, t_max, eta_min)


def _cosine(base_lr: float, t_max: int, eta_min: float = 0.0, *, restarted: bool = False) -> Schedule:
    """`cosine_annealing_lr`; `restarted`: as torch's `SequentialLR` runs it after a milestone,
    where it sets the scheduler to step 0 by its closed form, `eta_min + (base - eta_min) (1 +
    cos 0) / 2`, and recurses from that value on. With an `eta_min` it can be an ulp off
    `base_lr` (0.0123 with eta_min 1e-3: 0.012300000000000002), and the recursion carries it."""
    base_lr = _check_base_lr(base_lr)
    t_max = whole("t_max", t_max, 1)
    if t_max > _COSINE_MAX:
        raise ConfigError(f"`t_max` (={t_max}) must be at most {_COSINE_MAX:,}: torch's recursion is reproduced "
                          "with a table of one value per step up to t_max (8 bytes each); for a longer "
                          "schedule use optax.cosine_decay_schedule (the closed form, equal within rounding)")
    eta_min = finite("eta_min", eta_min)
    lrs, lr = [], base_lr
    for t in range(max(t_max, _COSINE_EXACT) + 1):
        if t == 0:
            lr = eta_min + (base_lr - eta_min) * (1 + math.cos(math.pi * 0 / t_max)) / 2 if restarted else base_lr
        elif (t - 1 - t_max) % (2 * t_max) == 0:
            lr = lr + (base_lr - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
        else:
            lr = (1 + math.cos(math.pi * t / t_max)) / (1 + math.cos(math.pi * (t - 1) / t_max)) * (lr - eta_min) + eta_min
        lrs.append(lr)

    def closed_form(count, last):
        phase = jnp.mod(count, 2 * t_max).astype(last.dtype) / t_max  # the period is 2 T_max
        # (1 + cos(pi p)) / 2 as cos(pi p / 2)^2: no cancellation near the minimum (float32)
        return eta_min + (base_lr - eta_min) * jnp.cos(jnp.pi / 2 * phase) ** 2

    return _lookup(lrs, lambda count: count, closed_form)


def exponential_lr(base_lr: float, gamma: float) -> Schedule:
    """torch's `ExponentialLR(gamma)`: `lr *= gamma` at every step.

    torch multiplies the previous lr by `gamma` (its closed form `base_lr * gamma ** t` differs
    in the last bits), which is `step_lr(base_lr, 1, gamma)`'s recursion: exact at every step,
    one table entry per step until the lr stops changing or for 100,000 steps, then
    `lr * gamma ** k`, equal within rounding. `gamma` > 1 grows to inf, as torch's lr does.
    """
    return step_lr(base_lr, 1, gamma)


def constant_lr(base_lr: float, *positional, factor: float = 1.0 / 3, total_iters: int = 5) -> Schedule:
    """torch's `ConstantLR(factor, total_iters)`: `base_lr * factor` for the first `total_iters`
    steps, then `base_lr` again.

    Value for value: torch returns to the lr by multiplying `base_lr * factor` by `1 / factor`
    at step `total_iters` (0.1 * 0.1 * (1 / 0.1) is 0.10000000000000002), as here; with
    `total_iters=0` it stays at `base_lr * factor`, as torch's. Combine with a decay the way
    torch's `SequentialLR` does, with `optax.join_schedules([constant_lr(...), step_lr(...)],
    [total_iters])`. `factor` and `total_iters` are keywords, as for `linear_warmup`.
    """
    if positional:
        raise ConfigError(f"constant_lr takes factor and total_iters as keywords, as torch's ConstantLR(optimizer, "
                          f"factor, total_iters) names them (got {positional} by position): "
                          f"constant_lr({base_lr!r}, factor=..., total_iters=...)")
    base_lr = _check_base_lr(base_lr)
    factor = finite("factor", factor)
    if not 0 < factor <= 1:
        # torch takes 0 too, then divides by it at step total_iters (ZeroDivisionError)
        raise ConfigError(f"`factor` (={factor}) must be in (0, 1]: the lr is multiplied by it, then by 1 / factor "
                          "at `total_iters`, as torch's ConstantLR")
    total_iters = whole("total_iters", total_iters, 0)
    lrs = [base_lr * factor] * max(total_iters, 1)
    if total_iters:
        lrs.append(lrs[-1] * (1.0 / factor))
    return _lookup(lrs, lambda count: count)


def _one_cycle_steps(total_steps, epochs, steps_per_epoch) -> int:
    """torch's OneCycleLR length: `total_steps`, else `epochs * steps_per_epoch`."""
    if total_steps is not None:
        total = whole("total_steps", total_steps, 1)
    elif epochs is not None and steps_per_epoch is not None:
        total = whole("epochs", epochs, 1) * whole("steps_per_epoch", steps_per_epoch, 1)
    else:
        raise ConfigError("give `total_steps`, or `epochs` and `steps_per_epoch` (their product), as torch's "
                          "OneCycleLR: the schedule's length in optimizer steps")
    if total > _COSINE_MAX:
        raise ConfigError(f"the one-cycle schedule's length ({total:,} steps) must be at most {_COSINE_MAX:,}: "
                          "torch's values are reproduced with a table of one value per step (8 bytes each)")
    return total


def _one_cycle(ends: tuple[float, ...], total: int, pct_start, anneal_strategy: str, three_phase: bool,
               what: str) -> Schedule:
    """torch's OneCycleLR phases, value for value: `ends` are (initial, peak, final) for the two
    phases (the peak reached at `pct_start`), and (initial, peak, initial, final) for three.
    Torch's own arithmetic in Python floats, once per step up to `total` (torch's last valid
    step count); past it torch raises, and here the value at `total` holds."""
    pct_start = finite("pct_start", pct_start)
    if not 0 <= pct_start <= 1:
        raise ConfigError(f"`pct_start` (={pct_start}) must be from 0 to 1: the fraction of the cycle spent "
                          "raising the lr, as torch's OneCycleLR")
    if anneal_strategy not in ("cos", "linear"):
        raise ConfigError(f"`anneal_strategy` (={anneal_strategy!r}) must be 'cos' or 'linear', as torch's OneCycleLR")
    if three_phase:
        phases = [(float(pct_start * total) - 1, ends[0], ends[1]),
                  (float(2 * pct_start * total) - 2, ends[1], ends[2]), (total - 1, ends[2], ends[3])]
    else:
        phases = [(float(pct_start * total) - 1, ends[0], ends[1]), (total - 1, ends[1], ends[2])]

    def anneal(start, end, pct):  # torch's _annealing_cos / _annealing_linear
        if anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    values = []
    for step in range(total + 1):  # torch's get_lr at last_epoch == step
        start_step = 0.0
        for i, (end_step, start, end) in enumerate(phases):
            if step <= end_step or i == len(phases) - 1:
                try:
                    values.append(anneal(start, end, (step - start_step) / (end_step - start_step)))
                except ZeroDivisionError:
                    raise ConfigError(
                        f"`pct_start` (={pct_start}) over {total} steps makes a phase of the one-cycle {what} "
                        "schedule end where it starts (torch's OneCycleLR divides by zero there); choose "
                        "another pct_start or more steps") from None
                break
            start_step = end_step
    return _lookup(values, lambda count: jnp.maximum(count, 0))


def one_cycle_lr(max_lr: float, total_steps: int | None = None, *, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 div_factor: float = 25.0, final_div_factor: float = 1e4, three_phase: bool = False) -> Schedule:
    """torch's `OneCycleLR` learning rate, value for value (stepped per optimizer step).

    From `max_lr / div_factor` up to `max_lr` over the first `pct_start` of `total_steps` (or
    `epochs * steps_per_epoch`), then down to `max_lr / div_factor / final_div_factor`; with
    `three_phase`, back to the initial lr first, then down. Annealed by cosine (`"cos"`) or
    linearly, with torch's own arithmetic, each step's value computed once in Python floats.
    torch raises when stepped past `total_steps`; here the value at `total_steps` holds.

    torch's OneCycleLR also cycles SGD's momentum by default (`cycle_momentum=True`, between
    0.85 and 0.95): that is `one_cycle_momentum`, given to `optax.inject_hyperparams(sgd)`:

      >>> import optax
      >>> lr, momentum = one_cycle_lr(0.1, 1000), one_cycle_momentum(1000)
      >>> tx = optax.inject_hyperparams(sgd)(learning_rate=lr, momentum=momentum, weight_decay=1e-4)

    (torch's `cycle_momentum=False`: `sgd(one_cycle_lr(...), momentum=0.9)`.) For Adam and
    AdamW torch cycles beta1 instead: `adamw(lr, betas=(one_cycle_momentum(...), 0.999))`.
    `optax.cosine_onecycle_schedule` is another formula.

    Raises:
      ConfigError: as torch's OneCycleLR refuses (no length, a `pct_start` outside [0, 1],
        another anneal_strategy), and where torch divides by zero (a phase of no steps).
    """
    max_lr = finite("max_lr", max_lr, minimum=0, hint=", as torch.optim's learning rate")
    div_factor = finite("div_factor", div_factor, minimum=0)
    final_div_factor = finite("final_div_factor", final_div_factor, minimum=0)
    if not div_factor or not final_div_factor:
        raise ConfigError(f"`div_factor` (={div_factor}) and `final_div_factor` (={final_div_factor}) must be > 0: "
                          "the lr is divided by them, as torch's OneCycleLR")
    total = _one_cycle_steps(total_steps, epochs, steps_per_epoch)
    initial = max_lr / div_factor  # torch's group["initial_lr"], then group["min_lr"]
    ends = (initial, max_lr, initial, initial / final_div_factor) if three_phase else (
        initial, max_lr, initial / final_div_factor)
    return _one_cycle(ends, total, pct_start, anneal_strategy, three_phase, "lr")


def one_cycle_momentum(total_steps: int | None = None, *, epochs: int | None = None,
                       steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                       base_momentum: float = 0.85, max_momentum: float = 0.95,
                       three_phase: bool = False) -> Schedule:
    """The momentum torch's `OneCycleLR` sets on SGD at each step (its `cycle_momentum=True`,
    the default): from `max_momentum` down to `base_momentum` while the lr rises, and back up
    while it falls (with `three_phase`, it holds `max_momentum` in the last phase). Value for
    value, with the arguments shared with `one_cycle_lr` given alike; a schedule for
    `optax.inject_hyperparams(sgd)(..., momentum=one_cycle_momentum(...))`, or for AdamW's beta1,
    which torch cycles instead: `adamw(..., betas=(one_cycle_momentum(...), 0.999))` (see
    `one_cycle_lr`)."""
    base_momentum = finite("base_momentum", base_momentum, minimum=0)
    max_momentum = finite("max_momentum", max_momentum, minimum=0)
    total = _one_cycle_steps(total_steps, epochs, steps_per_epoch)
    ends = (max_momentum, base_momentum, max_momentum, max_momentum) if three_phase else (
        max_momentum, base_momentum, max_momentum)
    return _one_cycle(ends, total, pct_start, anneal_strategy, three_phase, "momentum")


class PlateauState(NamedTuple):
    """`reduce_lr_on_plateau`'s state: Python numbers, kept on the host (save it with a
    checkpoint as `state._asdict()`; `PlateauState(**d)` restores it). The fields are torch's
    ReduceLROnPlateau attributes of the same names; `lr` is its param group's lr."""

    lr: float
    best: float
    num_bad_epochs: int
    cooldown_counter: int
    last_epoch: int


@dataclasses.dataclass(frozen=True)
class ReduceLROnPlateau:
    """torch's `ReduceLROnPlateau`, as `init` and `step` on a `PlateauState` (see `reduce_lr_on_plateau`)."""

    lr: float
    mode: str
    factor: float
    patience: int
    threshold: float
    threshold_mode: str
    cooldown: int
    min_lr: float
    eps: float

    def __post_init__(self):
        """Checked here, however it is made (`reduce_lr_on_plateau`, or this class directly):
        what torch refuses, and negative or non-finite settings, by name."""
        if self.mode not in ("min", "max"):
            raise ConfigError(f"`mode` (={self.mode!r}) must be 'min' (the metric should fall, e.g. a loss) or 'max' "
                              "(rise, e.g. an accuracy), as torch's ReduceLROnPlateau")
        if self.threshold_mode not in ("rel", "abs"):
            raise ConfigError(f"`threshold_mode` (={self.threshold_mode!r}) must be 'rel' or 'abs', as torch's "
                              "ReduceLROnPlateau")
        checked = dict(lr=finite("lr", self.lr, minimum=0, hint=", as torch.optim's learning rate"),
                       factor=finite("factor", self.factor, minimum=0), patience=whole("patience", self.patience, 0),
                       threshold=finite("threshold", self.threshold), cooldown=whole("cooldown", self.cooldown, 0),
                       min_lr=finite("min_lr", self.min_lr, minimum=0), eps=finite("eps", self.eps, minimum=0))
        if checked["factor"] >= 1:
            raise ConfigError(f"`factor` (={checked['factor']}) must be < 1: the lr is multiplied by it on a plateau, "
                              "as torch's ReduceLROnPlateau (which refuses it too)")
        for name, value in checked.items():  # plain Python numbers (frozen: set as dataclasses do)
            object.__setattr__(self, name, value)

    def init(self) -> PlateauState:
        """The state before the first `step`: the lr given, no best value yet."""
        return PlateauState(lr=self.lr, best=math.inf if self.mode == "min" else -math.inf, num_bad_epochs=0,
                            cooldown_counter=0, last_epoch=0)

    def step(self, state: PlateauState, metric) -> PlateauState:
        """torch's `scheduler.step(metric)`: the state after one more epoch whose result is
        `metric` (a number, or a 0-d jax, numpy or torch array). A NaN metric is never better,
        as in torch."""
        try:
            current = float(metric)
        except (TypeError, ValueError):
            raise ConfigError(f"`metric` (={metric!r}) must be a number or a 0-d array: the epoch's result, e.g. its "
                              "validation loss") from None
        best, bad, cooldown, lr = state.best, state.num_bad_epochs, state.cooldown_counter, state.lr
        if self._is_better(current, best):
            best, bad = current, 0
        else:
            bad += 1
        if cooldown > 0:  # ignore bad epochs in cooldown
            cooldown, bad = cooldown - 1, 0
        if bad > self.patience:
            new_lr = max(lr * self.factor, self.min_lr)
            if lr - new_lr > self.eps:  # torch leaves the lr when the change is below eps
                lr = new_lr
            cooldown, bad = self.cooldown, 0
        return PlateauState(lr=lr, best=best, num_bad_epochs=bad, cooldown_counter=cooldown,
                            last_epoch=state.last_epoch + 1)

    def _is_better(self, a: float, best: float) -> bool:  # torch's, comparison for comparison
        if self.mode == "min":
            return a < best * (1.0 - self.threshold) if self.threshold_mode == "rel" else a < best - self.threshold
        return a > best * (self.threshold + 1.0) if self.threshold_mode == "rel" else a > best + self.threshold


def reduce_lr_on_plateau(lr: float, *, mode: str = "min", factor: float = 0.1, patience: int = 10,
                         threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0,
                         min_lr: float = 0.0, eps: float = 1e-8) -> ReduceLROnPlateau:
    """torch's `ReduceLROnPlateau(optimizer, mode, factor, patience, threshold, threshold_mode,
    cooldown, min_lr, eps)` starting from the optimizer's `lr`, decision for decision.

    It reads a metric once per epoch on the host, so it is not a schedule of the step count:
    `init()` gives the state, `step(state, metric)` the next one (torch's
    `scheduler.step(val_loss)`), and its `lr` goes to the optimizer through
    `optax.inject_hyperparams`:

      >>> import optax
      >>> plateau = reduce_lr_on_plateau(0.1, patience=2)
      >>> sched = plateau.init()
      >>> tx = optax.inject_hyperparams(sgd)(learning_rate=sched.lr, momentum=0.9)
      >>> opt_state = tx.init({"w": jnp.zeros(3)})
      >>> for val_loss in [1.0, 1.0, 1.0, 1.0]:  # each epoch: train, evaluate, then
      ...     sched = plateau.step(sched, val_loss)
      ...     opt_state.hyperparams["learning_rate"] = jnp.asarray(sched.lr)
      >>> round(sched.lr, 6)
      0.01

    The lr is a Python float, as torch's, rounded once where the optimizer reads it.
    `optax.contrib.reduce_on_plateau` is another rule (it scales the updates, counts steps, and
    compares with both a relative and an absolute tolerance).

    Raises:
      ConfigError: what torch refuses (`factor` >= 1, another mode or threshold_mode), and
        negative or non-finite settings, by name.
    """
    return ReduceLROnPlateau(lr=lr, mode=mode, factor=factor, patience=patience, threshold=threshold,
                             threshold_mode=threshold_mode, cooldown=cooldown, min_lr=min_lr, eps=eps)


def clip_grad_norm(max_norm: float, norm_type: float = 2.0) -> optax.GradientTransformation:
    """torch's `torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)`, as a stateless
    optax transformation to chain before the optimizer.

    The total norm is torch's: the `norm_type` norm of each gradient's own norm (`inf`: the
    largest magnitude), and every gradient is scaled by `min(1, max_norm / (total + 1e-6))`.
    `optax.clip_by_global_norm` scales by `max_norm / total`, without torch's 1e-6: ~2.5e-8
    relative off torch on every clipped step (a gradient norm of ~40), beyond float64 parity.
    A non-finite total scales as torch's does (inf: to zeros, NaN: to NaN).

    torch leaves parameters whose `.grad` is None (frozen) out of the norm. Zero their gradients
    first, so they add nothing, and keep the optimizer off them::

        optax.chain(optax.masked(optax.set_to_zero(), frozen),   # frozen: a pytree of bools
                    clip_grad_norm(1.0),
                    optax.multi_transform({"train": sgd(...), "frozen": optax.set_to_zero()}, labels))

    (Clipping inside one group of `multi_transform` would take that group's norm alone; torch's
    one call takes every trained parameter's.)

    Raises:
      ConfigError: `max_norm` is negative or not a finite number; `norm_type` is not a number > 0.
    """
    max_norm = finite("max_norm", max_norm, minimum=0.0)
    if not (is_real(norm_type) and not math.isnan(norm_type) and norm_type > 0):
        raise ConfigError(f"`norm_type` (={norm_type!r}) must be a number > 0 (2.0 as torch's default, or "
                          "float('inf'))")
    norm_type = float(norm_type)

    def update(updates, state, params=None):
        del params
        leaves = jax.tree.leaves(updates)
        if not leaves:
            return updates, state
        norms = jnp.stack([jnp.linalg.vector_norm(g, ord=norm_type) for g in leaves])
        total = jnp.linalg.vector_norm(norms, ord=norm_type)
        coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def linear_warmup(base_lr: float, *positional, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                  total_iters: int = 5) -> Schedule:
    """torch's `LinearLR(start_factor, end_factor, total_iters)`: linear warm-up, recursively.

    Exact at every step: the lr is constant after `total_iters` (with `total_iters=0`, at
    `start_factor * base_lr`, as torch). Combine with a decay the way torch's `SequentialLR`
    does, with `optax.join_schedules([linear_warmup(...), cosine_annealing_lr(...)], [total_iters])`.
    The factors and `total_iters` are keywords: torch's positional order differs from the one
    this function had (total_iters first), and `LinearLR(opt, 1.0, 0.5, 1)` translated by
    position was a warm-up from 0.05 instead of a decay from 0.1.
    """
    if positional:
        raise ConfigError(f"linear_warmup takes start_factor, end_factor and total_iters as keywords, as torch's "
                          f"LinearLR(optimizer, start_factor, end_factor, total_iters) names them (got {positional} "
                          f"by position): linear_warmup({base_lr!r}, start_factor=..., end_factor=..., total_iters=...)")
    base_lr = _check_base_lr(base_lr)
    start_factor, end_factor = finite("start_factor", start_factor), finite("end_factor", end_factor)
    if not (0 < start_factor <= 1 and 0 <= end_factor <= 1):
        raise ConfigError(f"`start_factor` (={start_factor}) must be in (0, 1] and `end_factor` (={end_factor}) in [0, 1]")
    total_iters = whole("total_iters", total_iters, 0)
    lrs, lr = [], base_lr
    for t in range(total_iters + 1):
        if t == 0:
            lr = base_lr * start_factor
        else:
            d = end_factor - start_factor
            lr = lr * (1.0 + d / (total_iters * start_factor + (t - 1) * d))
        lrs.append(lr)
    return _lookup(lrs, lambda count: count)


def per_epoch(schedule: Schedule, steps_per_epoch: int) -> Schedule:
    """Drive a per-epoch schedule from the optimizer's step count (torch users' `sched.step()`
    after each epoch): `lr(step) = schedule(step // steps_per_epoch)`."""
    if not callable(schedule):
        raise ConfigError(f"`schedule` (={schedule!r}) must be a schedule (epoch -> lr), e.g. step_lr(0.1, 30); "
                          "a constant learning rate needs no per_epoch")
    # A float (even 3.0) failed at the first update with "Indexer must have integer type".
    steps_per_epoch = whole("steps_per_epoch", steps_per_epoch, 1)
    return lambda count: schedule(_floor_div(_step_count(count), steps_per_epoch))
