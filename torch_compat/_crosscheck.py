"""Layer-by-layer comparison of a torchvision ResNet and its Flax port on the same inputs."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torchvision

from jaxport import models
from jaxport._args import is_int, is_real
from jaxport._errors import ConfigError, ConversionError
from jaxport._io import flatten

from ._convert import (Entry, _check_flat_variables, check_state_dict, check_variables, detect_arch, flax_to_torch,
                       torch_to_flax)

STAGES = ("stem", "layer1", "layer2", "layer3", "layer4", "pooled", "logits")
# torchvision module whose forward output is each stage (forward hooks read them there).
_TORCH_MODULE = {"stem": "maxpool", "layer1": "layer1", "layer2": "layer2", "layer3": "layer3",
                 "layer4": "layer4", "pooled": "avgpool", "logits": "fc"}


# In train mode a stage passes when the port's error is within this many times torch's own
# float32 rounding error there (torch float32 vs torch float64 on the same inputs and weights).
NOISE_FACTOR = 10.0
# Beyond this much float32 error of torch's own (relative to a stage's scale) a train-mode
# comparison proves nothing: at 1 px and batch 2 every BatchNorm sees 2 values per channel and
# torch float32 is ~100% off its float64 result, so `NOISE_FACTOR` times that passed any port.
# Defaults measure <1e-3 even on ResNet-152; batch 2 at 32 px, 7e-3.
MAX_TRAIN_NOISE = 0.05


@dataclasses.dataclass(frozen=True)
class StageError:
    """Disagreement on one stage: max |jax - torch| and that divided by max |torch| (`scale`).

    `noise` is torch's own float32 error on the stage (relative to the same scale, measured
    against torch in float64; NaN where not measured) and `tol` the bound `max_rel` is held to.
    """

    stage: str
    max_abs: float
    max_rel: float
    scale: float
    tol: float = np.inf
    noise: float = np.nan
    shape: tuple[int, ...] = ()  # torch's output there, NHWC for the maps

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.max_rel) and self.max_rel <= self.tol)


@dataclasses.dataclass(frozen=True)
class CrossCheckReport:
    """Per-stage errors of one mode ("eval" or "train").

    `max_rel` is relative to the stage's scale (max |torch value|), so one tolerance fits
    stages whose magnitudes differ by orders. In train mode the rows `running_mean`,
    `running_var` and `num_batches_tracked` compare every BatchNorm's updated state (worst
    layer), and each row's tolerance is `max(rtol, NOISE_FACTOR * torch's own float32 error)`.
    `replace_stride_with_dilation` is what both models were built with; when a stage is
    dilated, the table names them and shows each map's side (a dilated stage keeps the side of
    the one before it).
    """

    arch: str
    mode: str
    rows: tuple[StageError, ...]
    rtol: float
    replace_stride_with_dilation: tuple[bool, bool, bool] = (False, False, False)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def table(self) -> str:
        train, dilate = self.mode == "train", tuple(self.replace_stride_with_dilation)
        head = f"{self.arch} {self.mode} mode"
        if any(dilate):
            dilated = ", ".join(f"layer{i + 2}" for i, d in enumerate(dilate) if d)
            head += f" (replace_stride_with_dilation={dilate}: {dilated} dilated, keeping the side of the stage before)"
        head += f": error relative to each stage's scale, tolerance {self.rtol:.0e}"
        if train:
            head += f" or {NOISE_FACTOR:g}x torch's own float32 error (torch f32 vs f64), if larger"
        cols = f"  {'stage':<20}{'max abs err':>13}{'scale':>12}{'max rel err':>13}"
        lines = [head, cols + (f"{'torch f32 err':>15}" if train else "") + f"{'tolerance':>11}  ok"]
        for r in self.rows:
            stage = r.stage
            if any(dilate) and len(r.shape) == 4:  # the sides are what dilation changes: shown
                stage += f" {r.shape[1]}x{r.shape[2]}"
            row = f"  {stage:<20}{r.max_abs:>13.3e}{r.scale:>12.3e}{r.max_rel:>13.3e}"
            row += f"{r.noise:>15.3e}" if train else ""
            lines.append(row + f"{r.tol:>11.1e}  {'yes' if r.ok else 'NO'}")
        return "\n".join(lines)


def _err(stage: str, a: np.ndarray, b: np.ndarray, rtol: float, b64: np.ndarray | None = None) -> StageError:
    """Compare `a` (the port) with `b` (torch); `b64` is torch in float64, for its own noise."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"stage {stage}: jax shape {a.shape} != torch shape {b.shape}")
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0

    def rel(x):
        return x / scale if scale > 0 else (0.0 if x == 0 else np.inf)

    noise, tol = np.nan, rtol
    if b64 is not None:
        noise = rel(float(np.max(np.abs(b - np.asarray(b64, np.float64)))) if b.size else 0.0)
        tol = max(rtol, NOISE_FACTOR * noise)
    return StageError(stage, max_abs, rel(max_abs), scale, tol, noise, b.shape)


def _classes(entries: list[Entry]) -> int:
    """The classifier size a checked conversion table describes (0: a backbone)."""
    return next((e.torch_shape[0] for e in entries if e.torch_key == "fc.weight"), 0)


def _torchvision(arch: str, num_classes: int, dilate: tuple[bool, bool, bool], state_dict: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """torchvision's `arch` holding copies of `state_dict`'s tensors (cast to `dtype`); with
    `num_classes=0` a backbone, whose `fc` is `nn.Identity()`."""
    # Built on the meta device, then given memory: torchvision's random initialisation, which
    # the weights replace, took ~1.5 s of wide_resnet101_2's cross-check per model (two in train
    # mode), and drew from the caller's global generator (a seeded script's later draws changed
    # with whether it cross-checked first).
    with torch.device("meta"):
        model = getattr(torchvision.models, arch)(num_classes=num_classes or 1000,
                                                  replace_stride_with_dilation=list(dilate))
    if not num_classes:
        model.fc = torch.nn.Identity()
    model = model.to_empty(device="cpu").to(dtype)
    model.load_state_dict(state_dict, strict=True)  # every tensor: no uninitialised memory is left
    return model


def _torch_stages(model: torch.nn.Module, x: torch.Tensor) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    hooks = []
    for stage, name in _TORCH_MODULE.items():
        def hook(_m, _i, o, stage=stage):
            o = o.detach()
            if stage == "pooled":
                o = torch.flatten(o, 1)
            elif o.ndim == 4:
                o = o.permute(0, 2, 3, 1)  # NCHW -> NHWC, as the Flax port
            out[stage] = o.numpy().copy()
        hooks.append(getattr(model, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return out


def cross_check(
    state_dict: Mapping[str, torch.Tensor],
    variables: Mapping[str, Any] | None = None,
    *,
    arch: str | None = None,
    modes: Sequence[str] = ("eval", "train"),
    batch_size: int = 2,
    image_size: int = 64,
    seed: int = 0,
    rtol: float = 1e-4,
    train_rtol: float = 1e-3,
    replace_stride_with_dilation: Sequence[bool] | None = None,
) -> list[CrossCheckReport]:
    """Run torchvision and the Flax port on the same inputs; report per-stage errors.

    Both sides run in float32 (half-precision weights are upcast exactly on both sides, so the
    check measures the port, not half-precision arithmetic) with full-precision matmuls, and
    both are built with the same `replace_stride_with_dilation`. Variables cast with
    `torch_to_flax(state_dict, dtype=...)` differ from `state_dict` by the cast's rounding:
    pass `cast_floating(state_dict, dtype)` with them, as `jaxport verify` does.

    Args:
      state_dict: the torch weights (see `load_state_dict`).
      variables: the Flax variables to check; None converts `state_dict` with `torch_to_flax`.
      arch: architecture; None detects it.
      modes: "eval" compares stem, layer1..4, pooled features and logits (none for a backbone,
        `num_classes_of(state_dict) == 0`, whose output is the pooled features); "train" also
        compares every BatchNorm's updated running statistics.
      batch_size, image_size, seed: the random NCHW/NHWC inputs.
      rtol: eval-mode tolerance on each stage's max error relative to its scale.
      train_rtol: train-mode tolerance floor. Train-mode BatchNorm divides by the standard
        deviation of few values (8 per channel in layer4 at batch 2, 64 px), which amplifies
        float32 rounding through the depth of the net: torch float32 itself differs from torch
        float64 by ~5e-5 on ResNet-50's logits and ~1e-3 on ResNet-152's, while the port agrees
        with torch to ~1e-12 in float64 (tests/test_crosscheck.py). So torch also runs in
        float64 in train mode, and a stage passes within `max(train_rtol, NOISE_FACTOR *
        torch's own float32 error)`.
      replace_stride_with_dilation: three bools for layer2..4, torchvision's meaning (True
        replaces that stage's stride by dilation); None: no dilation. Both torchvision's model
        and the Flax model are built with it. Dilation leaves the weights as they are, so
        weights ported from a dilated model (a DeepLabV3 / FCN backbone: (False, True, True))
        also pass undilated; check them with the dilation they will run with, so the check
        covers that model (its layer3 and layer4 then keep layer2's side). CLI `--dilation`.

    Returns:
      One `CrossCheckReport` per mode; `report.ok` tells whether it is within `rtol`.

    Raises:
      ConversionError: `state_dict` or `variables` does not fit `arch`, listing every misfit key.
      ConfigError: `modes` is empty or names something other than "eval" and "train"; or train
        mode at inputs so small that torch's own float32 error exceeds `MAX_TRAIN_NOISE` of a
        stage's scale (e.g. 1 px at batch 2), where no comparison could fail a wrong port; or
        `replace_stride_with_dilation` is not None or 3 bools, or dilates an architecture of
        BasicBlocks (resnet18, resnet34), which torchvision cannot dilate.

    Example (a DeepLabV3 / FCN backbone runs dilated, so it is checked dilated; ~10 s, so not
    run by the doctests: tests/test_crosscheck_dilation.py checks the same):
      >>> import torch_compat
      >>> dilated = (False, True, True)
      >>> sd = torch_compat.reference_model("resnet50", num_classes=3, image_size=40, calibration_batches=1,
      ...                                   replace_stride_with_dilation=dilated).state_dict()  # doctest: +SKIP
      >>> (report,) = cross_check(sd, modes=("eval",), image_size=40,
      ...                         replace_stride_with_dilation=dilated)  # doctest: +SKIP
      >>> report.ok, [r.shape for r in report.rows if r.stage in ("layer2", "layer4")]  # doctest: +SKIP
      (True, [(2, 5, 5, 512), (2, 5, 5, 2048)])
    """
    if isinstance(modes, str):
        raise ConfigError(f"`modes` (={modes!r}) must be a sequence of modes, e.g. ({modes!r},)")
    modes = tuple(modes)  # a generator was used up by the check below, and nothing was compared
    bad = [m for m in modes if m not in ("eval", "train")]
    if bad or not modes:
        raise ConfigError(f"`modes` (={list(modes)}) must be a non-empty subset of ('eval', 'train')")
    for name, value in (("batch_size", batch_size), ("image_size", image_size)):
        if not is_int(value) or value < 1:
            raise ConfigError(f"`{name}` (={value!r}) must be an int >= 1 (CLI --{name.replace('_', '-')})")
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise ConfigError(f"`seed` (={seed!r}) must be an int in [0, 2**63) (it seeds torch's generator of the inputs)")
    if variables is not None and not isinstance(variables, Mapping):
        raise ConfigError(f"`variables` must be a mapping {{'params': ..., 'batch_stats': ...}} (Flax variables, "
                          f"e.g. from torch_to_flax or jaxport's load_variables), got {type(variables).__name__}")
    for name, value in (("rtol", rtol), ("train_rtol", train_rtol)):
        if not (is_real(value) and math.isfinite(value) and value > 0):
            raise ConfigError(f"`{name}` (={value!r}) must be a finite number > 0")
    dilate = models.check_dilation(replace_stride_with_dilation)
    side = models.layer4_side(image_size, dilate)
    if "train" in modes and batch_size * side * side < 2:
        # torch refuses train-mode BatchNorm over a single value per channel (its unbiased
        # variance would divide by zero); say so before running anything.
        raise ConfigError(f"`batch_size` (={batch_size}) x layer4's {side}x{side} positions at `image_size` "
                          f"(={image_size}) leaves train-mode BatchNorm one value per channel, which torch refuses; "
                          "use batch_size >= 2 or image_size > 32 (CLI --batch-size, --image-size), or eval mode only")
    arch = arch or detect_arch(state_dict)
    # Both sides are checked against `arch` first (shapes only): one ConversionError naming every
    # misfit key (and what the weights look like), not torchvision's load_state_dict traceback.
    num_classes = _classes(check_state_dict(state_dict, arch))
    if any(dilate) and models.ARCHS[arch].block == "basic":
        # torchvision raised NotImplementedError("Dilation > 1 not supported in BasicBlock").
        raise ConfigError(f"`replace_stride_with_dilation` (={dilate}) dilates {arch}, whose BasicBlocks torchvision "
                          "cannot dilate (only the Bottleneck architectures take it: resnet50, resnet101, resnet152, "
                          "the ResNeXts and wide ResNets); leave it None (CLI --dilation none)")
    if variables is None:
        variables = torch_to_flax(state_dict, arch)
    else:
        theirs = _classes(check_variables(variables, arch))
        if theirs != num_classes:  # both fit `arch`, with other heads
            head = [f"{n} classes" if n else "no classifier (a backbone)" for n in (num_classes, theirs)]
            raise ConversionError(f"the state_dict has {head[0]} but the Flax variables have {head[1]}: a "
                                  "cross-check compares weights with their own port; port them with the same "
                                  "head (CLI: the same --backbone-only on both commands)")
        # Variables may omit BatchNorm's num_batches_tracked (as checkpoints of torch < 0.4.1
        # do; the converter defaults it to 0), which the Flax model's apply needed.
        variables = torch_to_flax(flax_to_torch(variables, arch), arch)
    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in state_dict.items()}
    variables = jax.tree.map(lambda a: np.asarray(a, np.float32) if np.issubdtype(np.asarray(a).dtype, np.floating)
                             or np.asarray(a).dtype.name == "bfloat16" else np.asarray(a), dict(variables))
    flax_model = models.build(arch, num_classes=num_classes, replace_stride_with_dilation=dilate)

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, image_size, image_size, generator=gen)
    x_nhwc = jnp.asarray(x.permute(0, 2, 3, 1).numpy())

    reports = []
    for mode in modes:
        torch_model = _torchvision(arch, num_classes, dilate, f32)
        torch_model.train(mode == "train")
        ref = _torch_stages(torch_model, x)
        ref64, model64 = {}, None
        if mode == "train":
            model64 = _torchvision(arch, num_classes, dilate, f32, torch.float64)
            model64.train()
            ref64 = _torch_stages(model64, x.double())
        tol = rtol if mode == "eval" else train_rtol
        with jax.default_matmul_precision("highest"):
            if mode == "eval":
                logits, state = flax_model.apply(variables, x_nhwc, mutable=["intermediates"])
            else:
                logits, state = flax_model.apply(variables, x_nhwc, train=True, mutable=["intermediates", "batch_stats"])
        sown = state["intermediates"]
        inter = {s: (sown[s]["out"] if s.startswith("layer") else sown.get(s))[0] for s in STAGES[:-1]}
        inter["logits"] = logits  # a backbone's output is the pooled features, compared as such
        stages = STAGES if num_classes else STAGES[:-1]
        rows = [_err(s, np.asarray(inter[s]), ref[s], tol, ref64.get(s)) for s in stages]
        if mode == "train":
            updated = {"params": variables["params"], "batch_stats": state["batch_stats"]}
            rows += _running_stats_rows(torch_model, model64, updated, arch, tol)
            worst = max(rows, key=lambda r: r.noise if np.isfinite(r.noise) else -np.inf)
            if worst.noise > MAX_TRAIN_NOISE:
                raise ConfigError(
                    f"train mode cannot be cross-checked at `batch_size` (={batch_size}) and `image_size` "
                    f"(={image_size}): torch's own float32 result is {worst.noise:.1%} of the scale off its float64 "
                    f"result at {worst.stage} (BatchNorm over {batch_size * side * side} values per channel in "
                    "layer4 amplifies rounding), so no tolerance could tell a wrong port from rounding; use larger "
                    "inputs, e.g. the defaults batch_size=2, image_size=64 (CLI --batch-size, --image-size), or "
                    "eval mode only (CLI --mode eval)")
        reports.append(CrossCheckReport(arch, mode, tuple(rows), tol, dilate))
    return reports


_STATS = ("running_mean", "running_var", "num_batches_tracked")


def _running_stats_rows(torch_model: torch.nn.Module, model64: torch.nn.Module, variables: Mapping[str, Any],
                        arch: str, rtol: float) -> list[StageError]:
    # The statistics alone, by the conversion table: `flax_to_torch` of the whole variables copied
    # every kernel back to torch's layout first (~500 MB of transposed copies for wide_resnet101_2).
    flat = flatten(variables)
    ours = {e.torch_key: np.asarray(flat.get(e.flax_key, 0)) for e in _check_flat_variables(flat, arch)
            if e.torch_key.endswith(_STATS)}
    ref, ref64 = torch_model.state_dict(), model64.state_dict()
    rows = []
    for stat in _STATS:
        errors = [_err(stat, ours[k], t.numpy(), rtol, ref64[k].numpy()) for k, t in ref.items() if k.endswith(stat)]
        rows.append(max(errors, key=lambda e: (not np.isfinite(e.max_rel), e.max_rel)))
    return rows


def port_differences(state_dict: Mapping[str, torch.Tensor], variables: Mapping[str, Any],
                     arch: str) -> list[str]:
    """Where `variables` are not bit for bit `torch_to_flax(state_dict, arch)`: one line per
    differing tensor (the port is an exact copy, so any difference, however small, is one).

    A cross-check of outputs within tolerance cannot see every change: a 10% change to one
    layer3 kernel, or 1e-5 on every logit bias, passed it. Counters absent from `variables`
    (num_batches_tracked, optional) are not compared.
    """
    from jaxport._io import flatten

    want, got = flatten(torch_to_flax(state_dict, arch)), flatten(variables)
    lines = []
    for key, w in want.items():
        if key not in got:
            continue
        g, w = np.asarray(got[key]), np.asarray(w)
        if g.dtype != w.dtype or g.shape != w.shape:
            lines.append(f"{key}: {g.dtype}{list(g.shape)} here, {w.dtype}{list(w.shape)} in the checkpoint's port")
            continue
        # Bits, not values: -0.0 for 0.0 or another NaN is a difference too.
        bits = lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, -1)  # noqa: E731
        count = int(np.count_nonzero((bits(g) != bits(w)).any(axis=-1))) if g.size else 0
        if count:
            diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
            lines.append(f"{key}: {count} of {g.size} values differ (max |difference| {np.nanmax(diff):.3g}, "
                         f"values up to {np.nanmax(np.abs(w.astype(np.float64))):.3g})")
    return lines
