"""BatchNorm with torch's exact semantics.

flax.linen.BatchNorm updates its running variance with the *biased* batch variance; torch
normalises with the biased variance but updates `running_var` with the *unbiased* one
(`var * n / (n - 1)`). Ported weights fine-tuned in train mode would drift from torch's, so
jaxport uses this module instead. It also keeps torch's `num_batches_tracked` counter so a
Flax -> torch round trip restores it exactly.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .._errors import ConfigError
from .._vma import vary_like
from ._grads import explicitly_sharded, use_custom_vjps

Dtype = Any


class BatchNorm(nn.Module):
    """torch.nn.BatchNorm2d (affine, track_running_stats) over NHWC inputs.

    Eval: `y = (x - mean) / sqrt(var + eps) * scale + bias` with the running statistics.
    Train (`train=True`, `mutable=["batch_stats"]`): normalise with the batch mean and biased
    batch variance over (N, H, W); then `mean <- (1 - m) mean + m batch_mean` and
    `var <- (1 - m) var + m batch_var * n / (n - 1)`, `num_batches_tracked += 1`, as torch.
    Statistics are computed in at least float32 whatever the input dtype.

    Attributes:
      momentum: torch's momentum (0.1), i.e. flax's `1 - momentum`; None is torch's cumulative
        average, `1 / num_batches_tracked` (counted after this batch).
      epsilon: torch's eps.
      axis_name: if set, batch statistics are averaged over this mesh axis (SyncBatchNorm);
        every device must hold the same number of examples.
      zero_scale: initialise `scale` to zeros (torchvision's `zero_init_residual`).
      param_dtype: dtype of `scale`, `bias`, `mean`, `var`.
      custom_vjps: differentiate per-device train mode with torch's backward formula (a
        `jax.custom_vjp`, faster on XLA:CPU); False uses autodiff, so forward-mode AD works too;
        None (default): True when jax's default backend is the CPU, as `ResNet`'s.
    """

    momentum: float | None = 0.1
    epsilon: float = 1e-5
    axis_name: str | None = None
    zero_scale: bool = False
    param_dtype: Dtype = jnp.float32
    custom_vjps: bool | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        features = x.shape[-1]
        scale = self.param(
            "scale", nn.initializers.zeros if self.zero_scale else nn.initializers.ones, (features,), self.param_dtype
        )
        bias = self.param("bias", nn.initializers.zeros, (features,), self.param_dtype)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (features,), self.param_dtype)
        ra_var = self.variable("batch_stats", "var", jnp.ones, (features,), self.param_dtype)
        count = self.variable("batch_stats", "num_batches_tracked", jnp.zeros, (), jnp.int32)

        if train and not self.is_initializing():
            if x.size == 0 and self.axis_name is None:
                # torch passes an empty batch through in train mode: an empty output, the
                # running statistics untouched, num_batches_tracked still counted.
                count.value = count.value + 1
                return x
            self._check_values_per_channel(x)
        stat_dtype = jnp.promote_types(jnp.promote_types(x.dtype, self.param_dtype), jnp.float32)
        xs = x.astype(stat_dtype)
        if (train and self.axis_name is None and use_custom_vjps(self.custom_vjps, "BatchNorm")
                and not explicitly_sharded(x)):  # Explicit sharding: autodiff, whose rules carry it
            # Per-device statistics: the hand-written VJP below (torch's backward formula,
            # two reductions and one pass) instead of autodiff through mean and variance,
            # which XLA:CPU ran as more passes: ~5% of ResNet-50's training step.
            # vary_like: inside shard_map (check_vma on), as jax's own rules would (see `Conv`).
            y, mean, var = _train_norm(xs, vary_like(scale.astype(stat_dtype), xs),
                                       vary_like(bias.astype(stat_dtype), xs), self.epsilon)
            if not self.is_initializing():
                self._update_running(ra_mean, ra_var, count, mean, var, x.size // features)
            return y.astype(x.dtype)
        if train:
            # SyncBatchNorm (or custom_vjps=False): autodiff through the statistics (its
            # transposes of pmean are what the device-count tests prove).
            mean, var, inv = _stats(xs, self.epsilon, self.axis_name)
            if not self.is_initializing():
                n = x.size // features
                n = n * jax.lax.psum(1, self.axis_name) if self.axis_name is not None else n
                self._update_running(ra_mean, ra_var, count, mean, var, n)
        else:
            mean = ra_mean.value.astype(stat_dtype)
            inv = jax.lax.rsqrt(ra_var.value.astype(stat_dtype) + self.epsilon)
        return _affine(xs, mean, inv, scale.astype(stat_dtype), bias.astype(stat_dtype)).astype(x.dtype)

    def _check_values_per_channel(self, x):
        """torch refuses train mode over one value per channel ("Expected more than 1 value per
        channel when training"): the batch variance is 0, every output is the bias, and the
        unbiased running variance divides by zero. Here it trained on, silently."""
        n = x.size // x.shape[-1]
        devices = jax.lax.axis_size(self.axis_name) if self.axis_name is not None else 1
        if n * devices < 2:
            where = "/".join(self.scope.path) or "BatchNorm"
            across = f" on each of {devices} devices" if devices > 1 else ""
            values = "no values" if n * devices == 0 else "one value"
            raise ConfigError(f"BatchNorm `{where}` in train mode got input {tuple(x.shape)}{across}: {values} per "
                              "channel, which torch refuses (its statistics are undefined); give it more images or "
                              "larger maps, or synchronise the statistics across devices (`axis_name`)")

    def _update_running(self, ra_mean, ra_var, count, mean, var, n):
        """torch's update: biased batch variance normalises, the unbiased one is stored."""
        # momentum None: torch's cumulative average (was `int - NoneType` from deep in the update)
        m = self.momentum if self.momentum is not None else \
            1.0 / (count.value + 1).astype(jnp.promote_types(ra_mean.value.dtype, jnp.float32))
        unbiased = var * (n / max(n - 1, 1)) if isinstance(n, int) else var * n / jnp.maximum(n - 1, 1)
        # Keep the stored dtype (float64 weights stay float64), not param_dtype.
        ra_mean.value = ((1 - m) * ra_mean.value + m * mean).astype(ra_mean.value.dtype)
        ra_var.value = ((1 - m) * ra_var.value + m * unbiased).astype(ra_var.value.dtype)
        count.value = count.value + 1


def _affine(xs, mean, inv, scale, bias):
    """The normalisation itself, one formula for every path (so their outputs agree bit for bit)."""
    return (xs - mean) * (inv * scale) + bias


def _stats(xs: jax.Array, eps: float, axis_name: str | None = None):
    """Batch mean, biased variance and 1/sqrt(var + eps) over N, H, W (and `axis_name`'s devices).

    Two passes (centre, then square) rather than E[x^2] - E[x]^2: no cancellation.
    """
    axes = tuple(range(xs.ndim - 1))
    mean = jnp.mean(xs, axes)
    if axis_name is not None:
        mean = jax.lax.pmean(mean, axis_name)
    var = jnp.mean(jnp.square(xs - mean), axes)
    if axis_name is not None:
        var = jax.lax.pmean(var, axis_name)
    return mean, var, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _train_norm(xs: jax.Array, scale: jax.Array, bias: jax.Array, eps: float):
    """`(y, batch_mean, batch_var)` of train-mode BatchNorm over the last axis' features."""
    return _train_norm_fwd(xs, scale, bias, eps)[0]


def _train_norm_fwd(xs, scale, bias, eps):
    mean, var, inv = _stats(xs, eps)
    return (_affine(xs, mean, inv, scale, bias), mean, var), (xs, scale, mean, inv)


def _train_norm_bwd(eps, res, cts):
    # torch's batch_norm_backward: with c = x - mean, dx = scale * inv * (gy - mean(gy)
    # - c * inv^2 * mean(gy * c)); the cotangents of the returned statistics (zero when they
    # only feed the running averages) add their own terms.
    xs, scale, mean, inv = res
    gy, g_mean, g_var = cts
    axes = tuple(range(xs.ndim - 1))
    n = xs.size // xs.shape[-1]
    centred = xs - mean
    sum_g = jnp.sum(gy, axes)
    sum_gc = jnp.sum(gy * centred, axes)
    d_scale = sum_gc * inv
    k = scale * inv
    dx = k * (gy - sum_g / n - centred * (sum_gc * inv * inv / n)) + g_mean / n + centred * (2 * g_var / n)
    return dx, d_scale, sum_g


_train_norm.defvjp(_train_norm_fwd, _train_norm_bwd)
