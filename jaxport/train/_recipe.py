"""torchvision's classification recipe (`references/classification/train.py`) as optax.

`jaxport train` takes that script's optimizer flags, with its names and meanings. In torch the
script builds (stepping the scheduler once after each epoch, and clipping before each step):

    params = model.parameters()                      # or, with --norm-weight-decay / --bias-weight-decay:
    params = set_weight_decay(model, weight_decay, norm_weight_decay, [("bias", bias_weight_decay)])
           # groups "other", "norm" (the normalization layers' parameters), "bias" (every parameter
           # named bias, the BatchNorms' too: the key wins over the norm group)
    opt = SGD(params, lr, momentum, weight_decay, nesterov="nesterov" in name) | AdamW(params, lr, weight_decay)
          | RMSprop(params, lr, momentum=momentum, weight_decay=weight_decay, eps=0.0316, alpha=0.9)
    main = CosineAnnealingLR(T_max=epochs - warmup_epochs, eta_min=lr_min) | StepLR(lr_step_size, lr_gamma)
           | ExponentialLR(lr_gamma)
    sched = SequentialLR([LinearLR(start_factor=lr_warmup_decay, total_iters=warmup_epochs)  # or ConstantLR(factor=)
                          , main], milestones=[warmup_epochs])          # with --lr-warmup-epochs > 0
    nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)       # with --clip-grad-norm

`optimizer` builds the same from `_optim`'s torch-exact pieces: `optimizer(cfg, steps_per_epoch)`
updates as torch's optimizer does, step for step, at the lr torch's scheduler gives each epoch.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import jax
import numpy as np
import optax

from .._args import is_finite, is_int, one_of, shown
from .._errors import ConfigError
from ._optim import (Schedule, _cosine, adamw, clip_grad_norm, constant_lr, exponential_lr, linear_warmup, per_epoch,
                     rmsprop, sgd, step_lr)

OPTIMIZERS = ("sgd", "sgd-nesterov", "adamw", "rmsprop")
# torchvision's train.py: RMSprop(parameters, lr, momentum, weight_decay, eps=0.0316, alpha=0.9)
RMSPROP_EPS, RMSPROP_ALPHA = 0.0316, 0.9
SCHEDULERS = ("cosineannealinglr", "steplr", "exponentiallr")
WARMUP_METHODS = ("linear", "constant")
# What the schedulers are called elsewhere (optax, the torch docs' prose), for the suggestion.
_SCHEDULER_ALIASES = {"cosine": "cosineannealinglr", "cosineannealing": "cosineannealinglr", "step": "steplr",
                      "exponential": "exponentiallr", "exp": "exponentiallr"}
# The settings (TrainConfig's fields) this module reads, with what runs trained with before they
# were settings: SGD on a cosine without warm-up, every parameter decayed, no clipping.
DEFAULTS = {"opt": "sgd", "lr_scheduler": "cosineannealinglr", "lr_step_size": 30, "lr_gamma": 0.1, "lr_min": 0.0,
            "lr_warmup_epochs": 0, "lr_warmup_method": "constant", "lr_warmup_decay": 0.01,
            "norm_weight_decay": None, "bias_weight_decay": None, "clip_grad_norm": None}


class Recipe(Protocol):
    """What the recipe reads of a `TrainConfig` (its fields of these names)."""

    lr: float
    epochs: int
    momentum: float
    weight_decay: float
    opt: str
    lr_scheduler: str
    lr_step_size: int
    lr_gamma: float
    lr_min: float
    lr_warmup_epochs: int
    lr_warmup_method: str
    lr_warmup_decay: float
    norm_weight_decay: float | None
    bias_weight_decay: float | None
    clip_grad_norm: float | None


def optimizer_name(opt: str) -> str:
    """`--opt` as torchvision reads it, by its name here: any name starting with "sgd" (in any
    case) is SGD, with nesterov momentum if it contains "nesterov" ("sgd-nesterov"); "adamw",
    "rmsprop"."""
    name = opt.lower()
    if name.startswith("sgd"):
        return "sgd-nesterov" if "nesterov" in name else "sgd"
    return name


def names(r: Recipe) -> dict[str, str]:
    """The recipe's named settings as this module spells them (torchvision takes any case), for
    a run's records: `SGD_Nesterov` and `sgd-nesterov` are one optimizer, and resume as one."""
    return {"opt": optimizer_name(r.opt), "lr_scheduler": r.lr_scheduler.lower(),
            "lr_warmup_method": r.lr_warmup_method.lower()}


def check(r: Recipe) -> None:
    """Refuse a recipe torchvision's script would refuse, or one that cannot train, naming the
    flag, its value, what is expected and the fix. `r.lr`, `r.epochs`, `r.momentum` and
    `r.weight_decay` are taken as checked already (`TrainConfig.validate`).

    Raises:
      ConfigError: the first bad setting.
    """
    if not (isinstance(r.opt, str) and optimizer_name(r.opt) in OPTIMIZERS):
        one_of("--opt", r.opt, OPTIMIZERS)  # raises, naming the closest
    if optimizer_name(r.opt) == "sgd-nesterov" and not r.momentum > 0:
        raise ConfigError(f"`--opt` (={r.opt}) needs `--momentum` > 0 (it is {r.momentum}): nesterov momentum without "
                          "momentum, which torch refuses; use --opt sgd, or a --momentum such as 0.9")
    for flag, value, choices, aliases in (("--lr-scheduler", r.lr_scheduler, SCHEDULERS, _SCHEDULER_ALIASES),
                                          ("--lr-warmup-method", r.lr_warmup_method, WARMUP_METHODS, None)):
        if not (isinstance(value, str) and value.lower() in choices):
            one_of(flag, value, choices, aliases=aliases)
    if not (is_int(r.lr_step_size) and r.lr_step_size >= 1):
        raise ConfigError(f"`--lr-step-size` (={r.lr_step_size!r}) must be an integer >= 1: the epochs between the "
                          "decays of --lr-scheduler steplr, e.g. 30")
    if not (is_int(r.lr_warmup_epochs) and r.lr_warmup_epochs >= 0):
        raise ConfigError(f"`--lr-warmup-epochs` (={r.lr_warmup_epochs!r}) must be an integer >= 0: the epochs of "
                          "warm-up before the --lr-scheduler, 0 for none")
    # `not 0 < x` rather than `x <= 0`: NaN fails every comparison and must be refused too.
    if not (is_finite(r.lr_gamma) and r.lr_gamma > 0):
        raise ConfigError(f"`--lr-gamma` (={shown(r.lr_gamma)}) must be a finite number > 0: the factor "
                          "--lr-scheduler steplr or exponentiallr multiplies the lr by at each decay, e.g. 0.1")
    if not (is_finite(r.lr_min) and r.lr_min >= 0):
        raise ConfigError(f"`--lr-min` (={shown(r.lr_min)}) must be a finite number >= 0: the lr that --lr-scheduler "
                          "cosineannealinglr ends at (torch's eta_min), e.g. 0")
    if not (is_finite(r.lr_warmup_decay) and 0 < r.lr_warmup_decay <= 1):
        raise ConfigError(f"`--lr-warmup-decay` (={shown(r.lr_warmup_decay)}) must be a number in (0, 1]: the "
                          "warm-up starts at --lr times it (torch's LinearLR start_factor, ConstantLR factor), e.g. "
                          "0.01")
    if r.norm_weight_decay is not None and not (is_finite(r.norm_weight_decay) and r.norm_weight_decay >= 0):
        raise ConfigError(f"`--norm-weight-decay` (={shown(r.norm_weight_decay)}) must be a finite number >= 0 (the "
                          "weight decay of the BatchNorm layers' parameters, e.g. 0), or left out to decay them by "
                          "--weight-decay")
    if r.bias_weight_decay is not None and not (is_finite(r.bias_weight_decay) and r.bias_weight_decay >= 0):
        raise ConfigError(f"`--bias-weight-decay` (={shown(r.bias_weight_decay)}) must be a finite number >= 0 (the "
                          "weight decay of every bias: the classifier's and the BatchNorm layers', e.g. 0), or left "
                          "out to decay them as the others")
    if r.clip_grad_norm is not None and not (is_finite(r.clip_grad_norm) and r.clip_grad_norm > 0):
        raise ConfigError(f"`--clip-grad-norm` (={shown(r.clip_grad_norm)}) must be a finite number > 0 (the "
                          "largest norm of all gradients together, torch's clip_grad_norm_ max_norm, e.g. 1), or "
                          "left out for no clipping")
    if r.lr_scheduler.lower() == "cosineannealinglr" and r.lr_warmup_epochs >= r.epochs:
        raise ConfigError(f"`--lr-warmup-epochs` (={r.lr_warmup_epochs}) must be less than `--epochs` (={r.epochs}) "
                          "with --lr-scheduler cosineannealinglr, which anneals over the epochs after the warm-up "
                          f"(T_max = epochs - warm-up epochs = {r.epochs - r.lr_warmup_epochs}); use "
                          f"--lr-warmup-epochs {r.epochs - 1} or fewer, or --epochs {r.lr_warmup_epochs + 1} or more")


def epoch_schedule(r: Recipe) -> Schedule:
    """The lr after `count` epochs (`scheduler.step()` calls), as torch's scheduler in
    torchvision's script gives it: the warm-up (if any), then the main scheduler, restarted at
    the milestone as `SequentialLR` restarts it (torch sets a cosine's step 0 there by its
    closed form, an ulp off `--lr` with an `--lr-min`; `_optim._cosine`)."""
    scheduler, warmup = r.lr_scheduler.lower(), r.lr_warmup_epochs
    if scheduler == "steplr":
        main = step_lr(r.lr, r.lr_step_size, r.lr_gamma)
    elif scheduler == "exponentiallr":
        main = exponential_lr(r.lr, r.lr_gamma)
    else:
        main = _cosine(r.lr, r.epochs - warmup, r.lr_min, restarted=warmup > 0)
    if not warmup:
        return main
    if r.lr_warmup_method.lower() == "linear":
        first = linear_warmup(r.lr, start_factor=r.lr_warmup_decay, total_iters=warmup)
    else:
        first = constant_lr(r.lr, factor=r.lr_warmup_decay, total_iters=warmup)
    return optax.join_schedules([first, main], [warmup])


def epoch_lr(r: Recipe, epoch: int) -> float:
    """The lr of epoch `epoch` (0-based), in float64: the Python float torch's scheduler holds,
    exactly (the jitted step computes with its float32 rounding)."""
    with jax.enable_x64(True):
        return float(epoch_schedule(r)(np.int64(epoch)))


def norm_labels(params: Any) -> Any:
    """"norm" for every parameter of a normalization layer, "other" for the rest, over a Flax
    params tree: torchvision's `split_normalization_params(model)`, which puts every parameter
    of a BatchNorm (or another normalization) module in the first group.

    jaxport's BatchNorm is the one module holding a "scale" (with its "bias"); convolutions and
    the classifier hold a "kernel". So a leaf is "norm" where its module holds a "scale".
    """
    return group_labels(params, norm=True, bias=False)


def group_labels(params: Any, *, norm: bool, bias: bool) -> Any:
    """Each parameter's group in torchvision's `utils.set_weight_decay(model, weight_decay,
    norm_weight_decay, custom_keys_weight_decay=[("bias", bias_weight_decay)])`, over a Flax
    params tree: with `bias`, "bias" for every leaf named bias (torch names the classifier's and
    each BatchNorm's shift so, as Flax does; the key is matched first, so a BatchNorm's bias is
    in it, not in "norm"); with `norm`, "norm" for the other parameters of a normalization layer
    (`norm_labels`); "other" for the rest.
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    norms = {path[:-1] for path, _ in leaves if _key(path[-1]) == "scale"}

    def label(path, _) -> str:
        if bias and _key(path[-1]) == "bias":
            return "bias"
        return "norm" if norm and path[:-1] in norms else "other"

    return jax.tree_util.tree_map_with_path(label, params)


def _key(entry) -> Any:
    return getattr(entry, "key", getattr(entry, "name", entry))


def optimizer(r: Recipe, steps_per_epoch: int) -> optax.GradientTransformation:
    """The optimizer torchvision's script builds for this recipe, as one optax transformation:
    SGD (nesterov), AdamW or RMSprop at `epoch_schedule`'s lr, stepped per epoch, the BatchNorm
    parameters in their own group with `--norm-weight-decay`, the biases in theirs with
    `--bias-weight-decay` (`optax.multi_transform` over `group_labels`), the gradients clipped
    first with torch's `clip_grad_norm_`.

    The clip keeps no state, and the optimizer's state is the plain optimizer's, so that
    `--clip-grad-norm` can be turned on or off when a run resumes (after a divergence, say).
    """
    lr = per_epoch(epoch_schedule(r), max(steps_per_epoch, 1))
    name = optimizer_name(r.opt)

    def make(weight_decay: float) -> optax.GradientTransformation:
        if name == "adamw":  # torchvision: AdamW(parameters, lr=lr, weight_decay=wd), torch's other defaults
            return adamw(lr, weight_decay=weight_decay)
        if name == "rmsprop":
            return rmsprop(lr, alpha=RMSPROP_ALPHA, eps=RMSPROP_EPS, weight_decay=weight_decay, momentum=r.momentum)
        return sgd(lr, momentum=r.momentum, weight_decay=weight_decay, nesterov=optimizer_name(r.opt) == "sgd-nesterov")

    norm, bias = r.norm_weight_decay is not None, r.bias_weight_decay is not None
    if not (norm or bias):
        tx = make(r.weight_decay)
    else:
        decays = {"other": r.weight_decay, "norm": r.norm_weight_decay, "bias": r.bias_weight_decay}
        groups = ["other"] + ["norm"] * norm + ["bias"] * bias
        tx = optax.multi_transform({g: make(decays[g]) for g in groups},
                                   lambda params: group_labels(params, norm=norm, bias=bias))
    if r.clip_grad_norm is None:
        return tx
    clip = clip_grad_norm(r.clip_grad_norm)

    def update(updates, state, params=None):  # torch: clip_grad_norm_(model.parameters()), then opt.step()
        updates, _ = clip.update(updates, optax.EmptyState())
        return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update)


def state_structure(settings: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """What of a run's recorded settings (TrainConfig's fields, `DEFAULTS` where absent) fixes
    the structure of its optimizer state, as (setting, fact) pairs in the order a refused
    resume names them: a checkpoint restores only into a state of the same structure.

    SGD, AdamW and RMSprop keep other state; `--norm-weight-decay` and `--bias-weight-decay`
    split it into groups. torch's SGD and RMSprop keep no momentum buffer at momentum 0 and optax
    no decay step at weight decay 0 (AdamW keeps both whatever their values). Nesterov, the schedule and the clip change
    no state.
    """
    s = DEFAULTS | dict(settings)
    name = optimizer_name(s["opt"])
    adam = name == "adamw"
    groups = [k for k in ("norm_weight_decay", "bias_weight_decay") if s[k] is not None]
    facts: list[tuple[str, Any]] = [("opt", "sgd" if name.startswith("sgd") else name),
                                    *((k, s[k] is not None) for k in ("norm_weight_decay", "bias_weight_decay"))]
    if not adam:
        facts += [("momentum", s["momentum"] == 0), ("weight_decay", s["weight_decay"] == 0)]
        facts += [(k, s[k] == 0) for k in groups]
    return facts
