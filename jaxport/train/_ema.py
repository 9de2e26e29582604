"""torchvision's model EMA (`--model-ema`) over Flax variables, update for update equal to torch.

torchvision's `references/classification/train.py` keeps

    class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
        def __init__(self, model, decay, device="cpu"):
            def ema_avg(avg_model_param, model_param, num_averaged):
                return decay * avg_model_param + (1 - decay) * model_param
            super().__init__(model, device, ema_avg, use_buffers=True)

built with `decay = ema_decay(args.model_ema_decay, args.model_ema_steps, world_size * batch_size,
args.epochs)`, and after the optimizer step of batch `i` of each epoch (`i` restarting at 0):

    if i % args.model_ema_steps == 0:
        model_ema.update_parameters(model)
        if epoch < args.lr_warmup_epochs:
            model_ema.n_averaged.fill_(0)   # the next update copies again

Here the averaged model is an `EMA`: the averaged variables (`{"params", "batch_stats"}`, every
leaf, as torch's `use_buffers=True` averages parameters and buffers alike) and torch's
`n_averaged` counter. `init_ema` is the `AveragedModel(model)`, `update_ema` its
`update_parameters(model)` and `restart_ema` the `n_averaged.fill_(0)`.
"""
from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp

from .._args import is_finite, is_int, shown
from .._errors import ConfigError


@flax.struct.dataclass
class EMA:
    """torch's `AveragedModel(model, avg_fn=ema_avg, use_buffers=True)` as a pytree.

    Attributes:
      variables: the averaged `{"params": ..., "batch_stats": ...}`, of the model's structure,
        shapes and dtypes.
      n_averaged: int32 scalar, the updates since the last (re)start; the next update copies the
        model's variables when it is 0.
    """

    variables: Any
    n_averaged: jax.Array


def ema_decay(decay: float, steps: int, global_batch: int, epochs: int) -> float:
    """The decay torchvision's script gives its EMA, from `--model-ema-decay` (`decay`),
    `--model-ema-steps` (`steps`), the global batch (torch's `world_size * batch_size`) and
    `--epochs`, as a Python float (torch's arithmetic, in double):

        alpha = min(1.0, (1.0 - decay) * (global_batch * steps / epochs))
        return 1.0 - alpha

    `decay` is the decay per image at one epoch: scaled to an update every `steps` steps of
    `global_batch` images, and to the run's length. 0 (alpha clamped at 1) makes every update a copy.

    Raises:
      ConfigError: a setting outside its range, named by its flag: `decay` must be in [0, 1]
        (above 1 the average diverges), `steps`, `global_batch` and `epochs` integers >= 1.

    >>> round(ema_decay(0.99998, steps=32, global_batch=1024, epochs=600), 12)
    0.998907733333
    >>> ema_decay(0.9, steps=32, global_batch=64, epochs=8)  # alpha clamped at 1
    0.0
    """
    if not (is_finite(decay) and 0 <= decay <= 1):
        raise ConfigError(f"`--model-ema-decay` (={shown(decay)}) must be a number in "
                          "[0, 1]: the EMA's decay per image of a one-epoch run (scaled by the global batch, "
                          "--model-ema-steps and --epochs), e.g. 0.99998")
    for flag, value in (("--model-ema-steps", steps), ("--batch-size", global_batch), ("--epochs", epochs)):
        if not (is_int(value) and value >= 1):
            raise ConfigError(f"`{flag}` (={value!r}) must be an integer >= 1" + (
                ": the EMA is updated every this many steps, e.g. 32" if flag == "--model-ema-steps" else ""))
    adjust = int(global_batch) * int(steps) / int(epochs)
    alpha = min(1.0, (1.0 - float(decay)) * adjust)
    return 1.0 - alpha


def init_ema(variables: Any) -> EMA:
    """A new EMA of `variables`: a copy of them (torch's `deepcopy(model)`), `n_averaged` 0.

    Jittable; dtypes and shardings are kept.
    """
    return EMA(jax.tree.map(lambda x: jnp.array(x, copy=True), variables), jnp.zeros((), jnp.int32))


def update_ema(ema: EMA, variables: Any, decay: float) -> EMA:
    """torch's `AveragedModel.update_parameters(model)` with torchvision's `ema_avg`: each leaf of
    `ema.variables` becomes

        variables                                 if ema.n_averaged == 0 (a copy)
        decay * ema.variables + (1 - decay) * variables   otherwise

    and `n_averaged` grows by 1. As in torch, `decay` and `1 - decay` (computed in Python's
    double) are each rounded to the leaf's dtype, the two products and their sum rounded in it:
    float32 leaves stay float32, float64 float64 (`jax.enable_x64`). Eager, that is torch's result
    bit for bit; under `jax.jit`, XLA:CPU fuses a product and the sum into one FMA, which rounds
    once where torch rounds twice: at most an ulp of the larger product and one of the result off
    per update (earlier updates' differences decay with the average, never growing).

    The integer leaves (BatchNorm's `num_batches_tracked` counters) are averaged as torch averages
    its int64 buffers: in float32 (torch's default dtype; `int * float` is float32 there), then
    truncated toward zero by the copy back, as `Tensor.copy_` does. That counter is not the
    model's step count, then, but nothing reads it: torch's BatchNorm uses `num_batches_tracked`
    only with `momentum=None` (a cumulative average), and torchvision's ResNets keep 0.1; jaxport's
    BatchNorm likewise. So the exported EMA's `num_batches_tracked` is torch's EMA's, and neither
    changes what the model computes.

    Args:
      ema: the running average (`init_ema`).
      variables: the model's variables now, of `ema.variables`' structure, shapes and dtypes.
      decay: a Python number in [0, 1] (`ema_decay`), static under `jax.jit`
        (`jax.jit(update_ema, static_argnames="decay")`): a traced float32 decay would give
        `1 - decay` in float32, ~1e-3 off torch's for decay 0.99998.

    Raises:
      ConfigError: `decay` outside [0, 1] or not a concrete number; `variables` of another
        structure, shape or dtype than `ema.variables` (named by the first leaf that differs).

    >>> ema = init_ema({"w": jnp.ones(2)})
    >>> ema = update_ema(ema, {"w": jnp.full(2, 3.0)}, decay=0.5)  # n_averaged 0: a copy
    >>> ema = update_ema(ema, {"w": jnp.full(2, 5.0)}, decay=0.5)
    >>> ema.variables["w"].tolist(), int(ema.n_averaged)
    ([4.0, 4.0], 2)
    """
    if not (is_finite(decay) and 0 <= decay <= 1):
        raise ConfigError(f"`decay` (={decay!r}) must be a Python number in [0, 1] (static under jax.jit: "
                          "jax.jit(update_ema, static_argnames='decay')), e.g. ema_decay(...)'s")
    decay = float(decay)  # a numpy float64 scalar would promote float32 leaves
    _check_like(ema.variables, variables)
    copy = ema.n_averaged == 0

    def average(avg, new):
        if jnp.issubdtype(avg.dtype, jnp.integer):
            f32 = jnp.float32
            mixed = (f32(decay) * avg.astype(f32) + f32(1.0 - decay) * new.astype(f32)).astype(avg.dtype)
        else:
            mixed = decay * avg + (1.0 - decay) * new  # weakly typed scalars: the leaf's dtype
        return jnp.where(copy, new, mixed)

    return EMA(jax.tree.map(average, ema.variables, variables), ema.n_averaged + 1)


def restart_ema(ema: EMA) -> EMA:
    """`ema` with `n_averaged` back at 0, so that its next update copies the model's variables:
    torchvision's `model_ema.n_averaged.fill_(0)` after each update of a warm-up epoch."""
    return ema.replace(n_averaged=jnp.zeros_like(ema.n_averaged))


def _check_like(averaged: Any, variables: Any) -> None:
    """Refuse `variables` that are not of `averaged`'s structure, shapes and dtypes: a shape of 1
    would broadcast silently, another dtype promote the average."""
    want, got = jax.tree_util.tree_structure(averaged), jax.tree_util.tree_structure(variables)
    if want != got:
        raise ConfigError(f"`variables` ({got}) are not of the EMA's structure ({want}); update an EMA with the "
                          "variables of the model it was made from (init_ema)")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(averaged), jax.tree.leaves(variables)):
        if (jnp.shape(a), jnp.result_type(a)) != (jnp.shape(b), jnp.result_type(b)):
            raise ConfigError(f"`variables`{jax.tree_util.keystr(path)} is {_kind(b)}, the EMA's is {_kind(a)}; update "
                              "an EMA with the variables of the model it was made from (init_ema)")


def _kind(x) -> str:
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"
