"""Convolution pieces of the ResNets whose gradients XLA:CPU computes slowly, with hand-written VJPs.

Every function here returns what jax's own autodiff would (the same products, summed in
another order: equal to float rounding, tested against torch in tests/test_custom_vjps.py). Each
exists because of one measured profile of ResNet-50's training step (benchmarks/README.md,
section 4), or of XLA:CPU's convolution on small maps and grouped kernels (`small_map_conv`,
`grouped_conv`), not for style.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import ConfigError


def on_xla_cpu() -> bool:
    """Whether the model is being traced for XLA:CPU (jax's default backend, as `jax.jit` uses).

    The CPU-tuned lowering (1x1 convs as dots over strided slices, the hand-written VJPs below)
    is for XLA:CPU only. On XLA:GPU (jax 0.11.2, an H200) it breaks the compiler: Triton's GEMM
    fusion aborts the whole process with a CHECK failure (`triton_tiling_propagation.cc: Check
    failed: subdim_size_accumulator == dim_size`), compiling ResNet-50's training step with the
    VJPs ("784 vs. 56") and, with the VJPs off, `jaxport train`'s ResNet-18 on the digits ("16 vs.
    8"). With plain convolutions both trained: ResNet-50 at 6,318 img/s in bf16 (`bench_train.py
    --gpu`, H200), the digits to 0.97-0.98 held-out (benchmarks/README.md, GPU figures).
    """
    return jax.default_backend() == "cpu"


def explicitly_sharded(x: jax.Array) -> bool:
    """Whether `x`'s type lives on a mesh with Explicit axes (`jax.make_mesh`'s default since
    jax 0.9): `x` placed on such a mesh, or traced under `jax.set_mesh` of one.

    The CPU lowering's reshapes merge the sharded batch axis into others, and its hand-written
    gradients contract over it, which Explicit sharding refuses (ShardingTypeError) unless each
    names its output's sharding. The models then use lax.conv and jax's own rules, which carry
    it. The mesh decides, not the spec: under `jax.vmap` of a split axis, the type of each
    slice shows no split (P(None, ...)) while the reshapes still meet it. Auto meshes (jaxport's
    own training), shard_map's manual axes and plain arrays keep the CPU lowering.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in axis_types)


def use_custom_vjps(flag: bool | None, owner: str = "ResNet") -> bool:
    """Resolve a model's `custom_vjps` attribute: None (the default) means on XLA:CPU only."""
    if flag is None:
        return on_xla_cpu()
    if not isinstance(flag, bool):
        raise ConfigError(f"{owner}'s `custom_vjps` (={flag!r}) must be True, False or None "
                          "(None: the hand-written VJPs on XLA:CPU, jax's own rules elsewhere)")
    return flag


def _flat(a: jax.Array) -> jax.Array:
    return a.reshape(-1, a.shape[-1])


def conv1x1_primal(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """A 1x1, stride-1 convolution of NHWC `x` with a (C, O) `kernel`: a dot over channels."""
    return jnp.einsum("nhwc,co->nhwo", x, kernel)


# The same values with the hand-written gradient below; `conv1x1_primal` keeps jax's own rules
# (for forward-mode AD, which no custom_vjp supports: ResNet(custom_vjps=False)).
conv1x1 = jax.custom_vjp(conv1x1_primal)


def _conv1x1_fwd(x, kernel):
    return conv1x1(x, kernel), (x, kernel)


def _conv1x1_bwd(res, g):
    x, kernel = res
    dx = jnp.einsum("nhwo,co->nhwc", g, kernel)
    # jax's own transpose contracts (n, h, w) of both operands at once, which XLA:CPU rewrites
    # into a transposed copy of `g` fused with the BatchNorm backward that produces it: a strided
    # 16 MiB write that took 30-60 ms per layer at 16 x 128 px (more than all the layer's dots).
    # Contracting the leading axis of two 2-D views is one dot with no copy at all.
    dk = jax.lax.dot_general(_flat(x), _flat(g), (((0,), (0,)), ((), ())))
    return dx, dk.astype(kernel.dtype)


conv1x1.defvjp(_conv1x1_fwd, _conv1x1_bwd)


def _window_views(xp: jax.Array, window: int | tuple[int, int], stride: int, out_hw: tuple[int, int],
                  dilation: int = 1) -> list[jax.Array]:
    """The window's taps of the padded NHWC `xp`, row-major (torch's scan order), each (N, OH, OW, C)."""
    kh, kw = (window, window) if isinstance(window, int) else window
    oh, ow = out_hw
    return [
        xp[:, i * dilation: i * dilation + (oh - 1) * stride + 1: stride,
           j * dilation: j * dilation + (ow - 1) * stride + 1: stride]
        for i in range(kh) for j in range(kw)
    ]


def max_pool_primal(x: jax.Array, window: int, stride: int, padding: int) -> jax.Array:
    """torch's `MaxPool2d(window, stride, padding)` on NHWC `x`: padded with -inf, floor mode."""
    return jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, window, window, 1), (1, stride, stride, 1),
        ((0, 0), (padding, padding), (padding, padding), (0, 0)),
    )


# The gradient goes to the first maximum of each window in row-major order, as torch's kernel
# picks it (`val > maxval || isnan(val)`: the first of tied values, the last NaN), so ties
# split exactly as in torch.
max_pool = jax.custom_vjp(max_pool_primal, nondiff_argnums=(1, 2, 3))


def _max_pool_fwd(x, window, stride, padding):
    # The winning tap is chosen here, from the very values `y` is made of, and saved (int8).
    # Found in the backward pass by comparing `x`'s taps with `y`, it missed windows whenever
    # XLA recomputed `x` there with other rounding: after a train-mode BatchNorm under jit on
    # CPU, 214 of 13,824 windows of a (2, 17, 24, 64) stem matched no tap, and the stem's
    # gradients were off by 20-90%.
    pad = ((0, 0), (padding, padding), (padding, padding), (0, 0))
    xp = jnp.pad(x, pad, constant_values=-jnp.inf)
    out_hw = tuple((s + 2 * padding - window) // stride + 1 for s in x.shape[1:3])
    views = _window_views(xp, window, stride, out_hw)
    y, first = views[0], jnp.zeros(views[0].shape, jnp.int8 if len(views) < 127 else jnp.int32)
    for t in range(1, len(views)):
        v = views[t]
        take = (v > y) | jnp.isnan(v)
        y = jnp.where(take, v, y)
        first = jnp.where(take, jnp.asarray(t, first.dtype), first)
    return y, (first, x.shape)


def _max_pool_bwd(window, stride, padding, res, g):
    # jax's own rule (select_and_gather_add + select_and_scatter) runs on XLA:CPU as a variadic
    # reduce-window over four int32 index planes of the padded input: ~85 ms of ResNet-50's
    # 16 x 128 px step. Here: one strided scatter-free sum of the taps' contributions, routed
    # by the winners the forward pass saved.
    first, x_shape = res
    xp_shape = (x_shape[0], x_shape[1] + 2 * padding, x_shape[2] + 2 * padding, x_shape[3])
    y_shape = first.shape
    dxp = jnp.zeros(xp_shape, g.dtype)
    zero = jnp.zeros((), g.dtype)
    # Taps in reverse add each input's contributions in the order of the windows they come
    # from, as torch's kernel accumulates them: the sums match torch's bit for bit.
    for t in reversed(range(window * window)):
        i, j = divmod(t, window)
        tap = jnp.where(first == t, g, zero)
        # Interior padding puts tap (oh, ow) at (i + oh * stride, j + ow * stride) of the padded input.
        dxp = dxp + jax.lax.pad(tap, zero, (
            (0, 0, 0),
            (i, xp_shape[1] - i - ((y_shape[1] - 1) * stride + 1), stride - 1),
            (j, xp_shape[2] - j - ((y_shape[2] - 1) * stride + 1), stride - 1),
            (0, 0, 0),
        ))
    return (dxp[:, padding: padding + x_shape[1], padding: padding + x_shape[2]],)


max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def _conv(x: jax.Array, kernel: jax.Array, stride: int, padding: int) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), ((padding, padding), (padding, padding)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def strided_conv(x: jax.Array, kernel: jax.Array, stride: int, padding: int) -> jax.Array:
    """A strided convolution (NHWC, HWIO, symmetric `padding`, no dilation, no groups).

    The same as `lax.conv_general_dilated`; only the gradient w.r.t. `x` is computed another way.
    """
    return _conv(x, kernel, stride, padding)


def _strided_conv_fwd(x, kernel, stride, padding):
    return _conv(x, kernel, stride, padding), (x, kernel)


def _phase_taps(size: int, k: int, stride: int, padding: int, a: int) -> tuple[int, int, int, int]:
    """For output phase `a` (input rows `stride * i + a`) along one axis of size `size`:
    (first kernel tap r, tap count T, low pad of g, number of rows n)."""
    r = (a + padding) % stride
    taps = max(0, -(-(k - r) // stride))
    q = (a + padding) // stride
    n = -(-(size - a) // stride)
    return r, taps, taps - 1 - q, n


def _strided_conv_bwd(stride, padding, res, g):
    x, kernel = res
    d_kernel = jax.vjp(lambda w: _conv(x, w, stride, padding), kernel)[1](g)[0]
    # The phase split is an XLA:CPU finding; GPU convolution libraries handle strides natively.
    # Each branch computes its own input gradient, so the CPU program never holds jax's.
    dx = jax.lax.platform_dependent(
        x, kernel, g,
        cpu=lambda x_, w, g_: _phase_input_grad(x_, w, g_, stride, padding),
        default=lambda x_, w, g_: _default_input_grad(x_, w, g_, stride, padding),
    )
    return dx, d_kernel


def _default_input_grad(x, kernel, g, stride, padding):
    """jax's own input gradient (a convolution over the zero-dilated `g`)."""
    return jax.vjp(lambda x_: _conv(x_, kernel, stride, padding), x)[1](g)[0]


def _phase_input_grad(x, kernel, g, stride, padding):
    # XLA computes the input gradient of a strided conv as a convolution over the gradient
    # dilated with stride - 1 zeros: at stride 2, 4x the multiply-adds, 4x its forward time
    # on XLA:CPU at 56x56x128 (ResNet's first 3x3 conv of layer2 at 224 px: 112 ms against
    # 29 ms). Split by output phase instead (the input rows stride*i + a, columns stride*j + b):
    # each phase is a dense stride-1 convolution of g with the kernel taps that reach it,
    # flipped, channels swapped (48 ms there). The phases are interleaved with one reshape.
    n, h, w_, c = x.shape
    kh, kw = kernel.shape[:2]
    oh, ow = g.shape[1:3]
    ph, pw = -(-h // stride), -(-w_ // stride)
    phases = []
    for a in range(stride):
        row = []
        for b in range(stride):
            ra, ta, lo_a, na = _phase_taps(h, kh, stride, padding, a)
            rb, tb, lo_b, nb = _phase_taps(w_, kw, stride, padding, b)
            if ta == 0 or tb == 0 or na <= 0 or nb <= 0:
                row.append(jnp.zeros((n, ph, pw, c), g.dtype))
                continue
            sub = kernel[ra::stride, rb::stride][::-1, ::-1].swapaxes(2, 3)  # (ta, tb, O, C)
            # Rows of g from i - lo to i - lo + ta - 1 for i < na: pad (or crop) g to fit.
            hi_a = (na - 1 - lo_a + ta - 1) - (oh - 1)
            hi_b = (nb - 1 - lo_b + tb - 1) - (ow - 1)
            gp = jax.lax.pad(g, jnp.zeros((), g.dtype), ((0, 0, 0), (lo_a, hi_a, 0), (lo_b, hi_b, 0), (0, 0, 0)))
            d = jax.lax.conv_general_dilated(gp, sub, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            row.append(jnp.pad(d, ((0, 0), (0, ph - na), (0, pw - nb), (0, 0))))
        phases.append(jnp.stack(row, axis=3))  # (N, ph, pw, stride_b, C)
    dx = jnp.stack(phases, axis=2)  # (N, ph, stride_a, pw, stride_b, C)
    dx = dx.reshape(n, ph * stride, pw * stride, c)[:, :h, :w_]
    return dx.astype(x.dtype)


strided_conv.defvjp(_strided_conv_fwd, _strided_conv_bwd)


def small_map_conv(x: jax.Array, kernel: jax.Array, stride: int, padding: int, dilation: int = 1,
                   groups: int = 1) -> jax.Array:
    """A convolution (NHWC, HWIO, symmetric `padding`) as one dot over gathered windows (im2col).

    For maps whose output has a few positions (ResNet's layer3/4 below ~100 px: 2x2, 1x1, 2x4).
    XLA:CPU's convolution runs those 10-60x slower than the same products as a dot: a 3x3 conv
    of (64, 2, 2, 256) took 68 ms forward and 128 ms with its gradients, against 1.4 and 3.6 ms
    here (`jaxport train`'s default ResNet-18 at 32 px spent ~90% of its step there). jax's
    own rules differentiate it (slices, pads and dots), in both modes. At 4x4 outputs the two
    are within ~15% (2026-12-03, batch 16, 4x4x512: forward 9.3 ms as XLA's convolution, 9.2
    here; with both gradients 22.6 and 19.0) and at 7x7 XLA's convolution is clearly faster
    (40.7 against 61.6 ms), so `small_map` still stops at 9 positions.
    """
    n = x.shape[0]
    kh, kw, cg, o = kernel.shape
    oh, ow = _out_hw(x.shape, kh, stride, padding, dilation)
    # Taps that read only padding at every output position add exact zeros: they are left
    # out of both operands (a 3x3 conv on a 1x1 map reads one tap of nine; 9x less kernel to
    # read, and its gradient there stays exactly zero, as torch's).
    live_h = _live_taps(kh, x.shape[1], oh, stride, padding, dilation)
    live_w = _live_taps(kw, x.shape[2], ow, stride, padding, dilation)
    xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    views = _window_views(xp, (kh, kw), stride, (oh, ow), dilation)
    taps = len(live_h) * len(live_w)
    cols = jnp.stack([views[i * kw + j] for i in live_h for j in live_w], axis=3)  # (i, j, c): the kernel's HWI order
    k = _take(_take(kernel, live_h, 0), live_w, 1)
    if groups == 1:
        # One 2-D dot of two contiguous views. As an einsum with a unit group axis XLA:CPU
        # treated the groups as a batch axis and transposed the whole kernel into (O, 9C)
        # before every use: 6-10 ms per 512x512 kernel, 65 of the 179 ms of ResNet-18's
        # training step at 32 px.
        y = cols.reshape(n * oh * ow, taps * cg) @ k.reshape(taps * cg, o)
        return y.reshape(n, oh, ow, o)
    y = jnp.einsum("ptgc,tcgo->pgo", cols.reshape(n * oh * ow, taps, groups, cg),
                   k.reshape(taps, cg, groups, o // groups))
    return y.reshape(n, oh, ow, o)


def _live_taps(k: int, size: int, out: int, stride: int, padding: int, dilation: int) -> list[int]:
    """The kernel offsets along one axis that read a real (unpadded) input at some output position."""
    live = [i for i in range(k) if any(0 <= q * stride + i * dilation - padding < size for q in range(out))]
    return live or list(range(k))  # no real input anywhere (padding only): keep the taps, all zeros


def _take(a: jax.Array, idx: list[int], axis: int) -> jax.Array:
    """`a`'s entries `idx` along `axis`: a slice (free when it is the whole axis) where `idx` is a range."""
    if idx == list(range(idx[0], idx[-1] + 1)):
        return jax.lax.slice_in_dim(a, idx[0], idx[-1] + 1, axis=axis)
    return jnp.take(a, np.asarray(idx), axis=axis)


def small_map(x_shape: tuple[int, ...], kernel: int, stride: int, padding: int, dilation: int = 1) -> bool:
    """Whether a conv's output has at most 9 positions: `small_map_conv` is faster there on XLA:CPU
    (measured: 2x2, 2x4 and 3x3 outputs faster; 4x4 within ~15% either way; 7x7 slower)."""
    oh, ow = _out_hw(x_shape, kernel, stride, padding, dilation)
    return oh * ow <= 9


def _out_hw(x_shape: tuple[int, ...], kernel: int, stride: int, padding: int, dilation: int) -> tuple[int, int]:
    """A square-kernel conv's output height and width for NHWC `x_shape` (torch's floor rule)."""
    oh, ow = ((s + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1 for s in x_shape[1:3])
    return oh, ow


def _grouped(x, kernel, stride, padding, dilation, groups):
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), ((padding, padding), (padding, padding)), rhs_dilation=(dilation, dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def grouped_conv(x: jax.Array, kernel: jax.Array, stride: int, padding: int, dilation: int, groups: int) -> jax.Array:
    """A grouped convolution (ResNeXt's 3x3 convs); only the kernel's gradient is computed another way.

    XLA:CPU computes a grouped conv's kernel gradient 30-130x slower than its forward pass: 3.2 s
    for (8, 28, 28, 256) with 32 groups, 15 s with 64 groups, where this takes ~0.1 s: per
    kernel tap, one dot per group over every output position (the window's view of `x` against
    the output gradient, no copy of the windows).
    """
    return _grouped(x, kernel, stride, padding, dilation, groups)


def _grouped_fwd(x, kernel, stride, padding, dilation, groups):
    return _grouped(x, kernel, stride, padding, dilation, groups), (x, kernel)


def _grouped_bwd(stride, padding, dilation, groups, res, g):
    x, kernel = res
    dx = jax.vjp(lambda x_: _grouped(x_, kernel, stride, padding, dilation, groups), x)[1](g)[0]
    kh, kw, cg, o = kernel.shape
    n, oh, ow, _ = g.shape
    xp = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    gg = g.reshape(n * oh * ow, groups, o // groups)
    taps = [jnp.einsum("pgc,pgo->cgo", view.reshape(n * oh * ow, groups, cg), gg).reshape(cg, o)
            for view in _window_views(xp, (kh, kw), stride, (oh, ow), dilation)]
    dk = jnp.stack(taps).reshape(kh, kw, cg, o)
    return dx, dk.astype(kernel.dtype)


grouped_conv.defvjp(_grouped_fwd, _grouped_bwd)
