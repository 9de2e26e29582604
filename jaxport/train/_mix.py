"""torchvision's MixUp and CutMix (`--mixup-alpha`, `--cutmix-alpha`) over a batch, in jax.

torchvision's `references/classification/train.py` builds `v2.MixUp(alpha=mixup_alpha,
num_classes=C)` and/or `v2.CutMix(alpha=cutmix_alpha, num_classes=C)` (each only if its alpha
is > 0), picks one per batch with `v2.RandomChoice` (uniformly), and applies it to the batch in
the DataLoader's `collate_fn`. With `rolled = x.roll(1, 0)` (example `i - 1` beside example `i`)
and `lam ~ Beta(alpha, alpha)`:

    MixUp:   x = rolled * (1 - lam) + x * lam
    CutMix:  x[..., y1:y2, x1:x2] = rolled[..., y1:y2, x1:x2]     (the box, below)
             lam = 1 - (x2 - x1) * (y2 - y1) / (W * H)               (the box's real area)
    target = one_hot(y).roll(1, 0) * (1 - lam) + one_hot(y) * lam

CutMix's box: `r_x ~ randint(W)`, `r_y ~ randint(H)`, `r = 0.5 * sqrt(1 - lam)`, half sides
`int(r * W)` and `int(r * H)`, clipped to the image (`cutmix_box`). The loss is then torch's
cross-entropy against these probabilities (`_step.cross_entropy` takes them), and the train
accuracy compares the prediction with `target.argmax(-1)`, as torchvision's `utils.accuracy`.

Where the randomness comes from: `mix` draws the choice, `lam` and the box from one key, which
`make_train_step` derives from the seed and the global step (`step_key`): one draw per global
batch, rolled over the whole global batch (across devices: `axis_name`). So the mixed batch is
a function of (seed, step, global batch) alone, the same on 1 or 8 devices and in 1 or several
processes, and a resumed run draws what the uninterrupted one drew. torch's DDP differs: each
GPU's DataLoader mixes its own per-GPU batch, with its own draws, so there the result depends on
the GPU count; jaxport's equals torch on one GPU with the global batch.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .._args import is_real, shown
from .._errors import ConfigError

_MIX_STREAM = 0x6D6978  # "mix": a stream of the seed's own, apart from the model's initialisation


def check_alpha(value, name: str) -> float:
    """`value` as a float if it is a finite number >= 0 (0: off, as train.py), else a ConfigError."""
    # `not x >= 0` rather than `x < 0`: NaN fails every comparison and must be refused too.
    if not (is_real(value) and math.isfinite(value) and value >= 0):
        what = "MixUp" if "mixup" in name else "CutMix"
        raise ConfigError(f"`{name}` (={shown(value)}) must be a finite number >= 0: the alpha of {what}'s "
                          f"Beta(alpha, alpha), as torchvision's train.py takes it, e.g. "
                          f"{0.2 if what == 'MixUp' else 1.0}; 0 for no {what}")
    return float(value)


def step_key(seed: int, step) -> jax.Array:
    """The key of global step `step`'s draw (`step` may be traced): from the seed and step only."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _MIX_STREAM), step)


def _roll(x: jax.Array, axis_name: str | None) -> jax.Array:
    """`x.roll(1, 0)` over the whole batch; with `axis_name`, `x` is this device's share of a
    batch split along that mesh axis in device order, and each device's last example moves to
    the next device (one example per device crosses, never the whole batch)."""
    if axis_name is None:
        return jnp.roll(x, 1, axis=0)
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return jnp.roll(x, 1, axis=0)
    last = jax.lax.ppermute(x[-1:], axis_name, [(i, (i + 1) % n) for i in range(n)])
    return jnp.concatenate([last, x[:-1]], axis=0)


def _targets(labels: jax.Array, num_classes: int, weights, dtype, axis_name: str | None) -> jax.Array:
    """`one_hot(labels).roll(1, 0) * (1 - lam) + one_hot(labels) * lam`, with `weights` the pair
    `(lam, 1 - lam)` as torch multiplies by them (`_lam_weights`, `_area_weights`); a label outside
    `[0, num_classes)` makes its row NaN (and so the next example's): its loss is NaN, as
    `cross_entropy` makes it for integer labels (torch's one_hot raises)."""
    keep, rolled = weights
    valid = (labels >= 0) & (labels < num_classes)
    one_hot = jnp.where(valid[:, None], jax.nn.one_hot(labels, num_classes, dtype=dtype), jnp.nan)
    return _roll(one_hot, axis_name) * rolled + one_hot * keep


def _lam_weights(lam) -> tuple:
    """MixUp's `(lam, 1 - lam)`: torch takes `1.0 - lam` in float64 from its float32 draw and
    multiplies float32 tensors by it rounded once, which is float32's own `1 - lam`."""
    return lam, 1 - lam


def _blend(rolled: jax.Array, images: jax.Array, lam) -> jax.Array:
    """MixUp's images, `rolled * (1 - lam) + images * lam`, as torchvision's
    `rolled.mul_(1.0 - lam).add_(inpt.mul_(lam))` up to rounding: XLA:CPU computes the sum with
    fused multiply-adds where torch rounds each product (in float32, 30% of the pixels differ in
    their last bits; an `optimization_barrier` between the products and the sum does not keep
    them apart on XLA:CPU, which removes barriers before fusing)."""
    return rolled * (1 - lam) + images * lam


def _dtype(images: jax.Array):
    return jnp.promote_types(images.dtype, jnp.float32)


def mixup(images: jax.Array, labels: jax.Array, num_classes: int, lam, *,
          axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
    """torchvision's `v2.MixUp(num_classes=num_classes)` with the draw `lam`: `(images, targets)`.

    `images` (N, ...) and integer `labels` (N,); returns `rolled * (1 - lam) + images * lam`
    (`rolled = images.roll(1, 0)`) and the soft targets (N, num_classes) mixed alike, in the
    images' dtype (at least float32). `axis_name`: inside `shard_map`, the mesh axis the batch
    is split along (the roll is then over the whole batch)."""
    rolled = _roll(images, axis_name)
    return _blend(rolled, images, lam), _targets(labels, num_classes, _lam_weights(lam), _dtype(images), axis_name)


def cutmix_box(lam, r_x, r_y, height: int, width: int) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """torchvision's `v2.CutMix.make_params`: the box `(x1, y1, x2, y2)` centred at `(r_x, r_y)`
    for the draw `lam`, and the `lam` its real (clipped) area gives:

        r = 0.5 * sqrt(1 - lam); half sides int(r * width), int(r * height)
        x1, x2 = max(r_x - half_w, 0), min(r_x + half_w, width)      (y alike, with height)
        lam_adjusted = 1 - (x2 - x1) * (y2 - y1) / (width * height)

    torchvision computes the half sides from its float32 draw in float64; here a float32 `lam`
    (the training step's, without x64) gets exactly those (`_half_side_thresholds`).
    """
    lam = jnp.asarray(lam)
    if lam.dtype == jnp.float64:  # (with jax_enable_x64) torch's own float64 arithmetic
        r = 0.5 * jnp.sqrt(1.0 - lam)
        # int() truncates towards 0; r * width >= 0, so floor is the same.
        half_w = jnp.floor(r * width).astype(jnp.int32)
        half_h = jnp.floor(r * height).astype(jnp.int32)
    else:
        lam = lam.astype(jnp.float32)  # exact for bfloat16 / float16
        half_w = jnp.sum(lam <= _half_side_thresholds(width), dtype=jnp.int32)
        half_h = jnp.sum(lam <= _half_side_thresholds(height), dtype=jnp.int32)
    x1, y1 = jnp.maximum(r_x - half_w, 0), jnp.maximum(r_y - half_h, 0)
    x2, y2 = jnp.minimum(r_x + half_w, width), jnp.minimum(r_y + half_h, height)
    return (x1, y1, x2, y2), _area_weights((x1, y1, x2, y2), height, width)[0]


@functools.cache
def _half_side_thresholds(size: int) -> np.ndarray:
    """`t[c - 1]`, c = 1..size // 2: the largest float32 `lam` whose half side
    `int(0.5 * math.sqrt(1.0 - lam) * size)`, in torch's float64 (`v2.CutMix.make_params`), is
    at least `c`. The half side of a float32 `lam` is then the count of `t >= lam`.

    Computed in float32 instead, it missed torch's in 1.6% of CutMix draws at alpha 0.2: Beta(0.2,
    0.2) draws many `lam` below 2^-25, where float32's `1 - lam` is 1 and the half side
    `size // 2` where torch's is one less (3e-6 of draws at alpha 1). The half side falls as `lam`
    grows (rounding is monotone), so each threshold is a bisection over the float32 bit patterns
    of [0, 1], with torch's own formula in float64. Checked against it for every float32 in
    [0, 1] at sizes 7, 8, 176 and 224 (2026-12-07: no difference in 1,065,353,217 values each).
    """
    counts = np.arange(1, size // 2 + 1)
    lo = np.zeros(counts.shape, np.int64)  # bit patterns whose half side is >= c (lam = 0)
    hi = np.full(counts.shape, np.float32(1).view(np.int32) + 1, np.int64)  # past 1.0: < c
    while np.any(hi - lo > 1):
        mid = (lo + hi) // 2
        lam = mid.astype(np.uint32).view(np.float32).astype(np.float64)
        fits = np.floor(0.5 * np.sqrt(1.0 - lam) * size) >= counts
        lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid)
    return lo.astype(np.uint32).view(np.float32)


def _area_weights(box, height: int, width: int) -> tuple[jax.Array, jax.Array]:
    """CutMix's `(lam_adjusted, 1 - lam_adjusted)` for the box `(x1, y1, x2, y2)`, as torch
    multiplies the targets by them: `lam_adjusted = 1 - area / (width * height)` in float64,
    each weight then rounded to the targets' float32.

    In float64 (x64) that is torch's own arithmetic. In float32 each weight is one division of
    whole numbers, `(width * height - area) / (width * height)` and `area / (width * height)`,
    rounded once: the same floats as torch's for every area at 16 to 4096 px (checked
    exhaustively with numpy at 10 sizes, 2026-12-07), where `1 - area / (width * height)` and
    one minus that, in float32, missed torch's for 41% and 33% of the areas at 224 px. The
    divisor goes through an `optimization_barrier`: XLA turns a division by a constant into a
    product with its rounded reciprocal (19 of the 144 areas at 11x13 px then missed).
    """
    x1, y1, x2, y2 = box
    area = jnp.asarray((x2 - x1) * (y2 - y1)).astype(jnp.result_type(float))
    if area.dtype == jnp.float64:
        keep = 1.0 - area / (width * height)
        return keep, 1.0 - keep
    pixels = jax.lax.optimization_barrier(jnp.asarray(width * height, area.dtype))
    return (pixels - area) / pixels, area / pixels


def cutmix(images: jax.Array, labels: jax.Array, num_classes: int, box, *,
           axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
    """torchvision's `v2.CutMix(num_classes=num_classes)` with the box `(x1, y1, x2, y2)`
    (`cutmix_box`): `(images, targets)`.

    `images` are NHWC (jaxport's layout: torch's `[..., y1:y2, x1:x2]` is axes 1 and 2 here);
    inside the box each image takes the previous one's pixels (`images.roll(1, 0)`), and the
    targets are mixed with `lam = 1 - box area / image area`. `axis_name`: as `mixup`."""
    height, width = images.shape[1:3]
    mixed = jnp.where(_inside(box, height, width), _roll(images, axis_name), images)
    return mixed, _targets(labels, num_classes, _area_weights(box, height, width), _dtype(images), axis_name)


def _inside(box, height: int, width: int) -> jax.Array:
    """(1, height, width, 1): True inside the box `(x1, y1, x2, y2)`, for NHWC images."""
    x1, y1, x2, y2 = box
    rows, cols = jnp.arange(height)[:, None], jnp.arange(width)[None, :]
    return ((rows >= y1) & (rows < y2) & (cols >= x1) & (cols < x2))[None, :, :, None]


def draw(key: jax.Array, height: int, width: int, mixup_alpha: float, cutmix_alpha: float) -> dict[str, jax.Array]:
    """One batch's draw, as torchvision's `RandomChoice([MixUp, CutMix])` makes it: `cutmix`
    (whether CutMix was chosen: uniformly between the ones whose alpha is > 0), `lam ~
    Beta(alpha, alpha)` of the chosen one, and CutMix's centre `r_x ~ randint(width)`, `r_y ~
    randint(height)` (drawn either way, used by CutMix only)."""
    mixup_alpha, cutmix_alpha = check_alpha(mixup_alpha, "mixup_alpha"), check_alpha(cutmix_alpha, "cutmix_alpha")
    if not (mixup_alpha or cutmix_alpha):
        raise ConfigError("`mixup_alpha` and `cutmix_alpha` are both 0: there is nothing to draw")
    k_choice, k_lam, k_x, k_y = jax.random.split(key, 4)
    if mixup_alpha and cutmix_alpha:
        use_cutmix = jax.random.bernoulli(k_choice)
    else:
        use_cutmix = jnp.asarray(bool(cutmix_alpha))
    # Both alphas' draws are made, the chosen one kept: a traced choice cannot pick the shape parameter.
    lam_mix = jax.random.beta(k_lam, mixup_alpha or 1.0, mixup_alpha or 1.0)
    lam_cut = jax.random.beta(k_lam, cutmix_alpha or 1.0, cutmix_alpha or 1.0)
    return {"cutmix": use_cutmix, "lam": jnp.where(use_cutmix, lam_cut, lam_mix),
            "r_x": jax.random.randint(k_x, (), 0, width), "r_y": jax.random.randint(k_y, (), 0, height)}


def mix(key: jax.Array, images: jax.Array, labels: jax.Array, num_classes: int, mixup_alpha: float,
        cutmix_alpha: float, *, axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
    """torchvision's train.py mixing of one batch: `draw(key, ...)`, then `mixup` or `cutmix`.

    `key` must be the same on every device (e.g. `step_key(seed, step)`): the draw is one per
    global batch. Returns the mixed NHWC images and the soft targets (N, num_classes).
    """
    height, width = images.shape[1:3]
    d = draw(key, height, width, mixup_alpha, cutmix_alpha)
    box, _ = cutmix_box(d["lam"], d["r_x"], d["r_y"], height, width)
    # One roll of the images and one of the targets, whichever is chosen: building both `mixup`'s
    # and `cutmix`'s results rolled each twice (across devices, a collective each) every step.
    rolled, lam = _roll(images, axis_name), d["lam"]
    mixed = jnp.where(d["cutmix"], jnp.where(_inside(box, height, width), rolled, images), _blend(rolled, images, lam))
    weights = [jnp.where(d["cutmix"], b, m) for b, m in zip(_area_weights(box, height, width), _lam_weights(lam))]
    return mixed, _targets(labels, num_classes, weights, _dtype(images), axis_name)
