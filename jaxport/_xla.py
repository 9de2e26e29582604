"""XLA compiler options jaxport compiles its CPU programs with, and why.

On jaxlib's CPU backend (0.10) convolutions are handed to YNNPACK by default. For ResNet's
convolutions XLA's own (Eigen) convolution is faster on the machines we measured: ResNet-50 at
batch 8 and 224 px, every 3x3 conv and the stem together 150 ms with YNNPACK against 114 ms
(torch/oneDNN: 94 ms); its training step 16 x 128 px ~1.05 s against ~0.9 s
(benchmarks/README.md). YNNPACK keeps the dots and the reductions, where it is the faster one
(without it the BatchNorm reductions alone double the training step).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

# Everything YNNPACK does by default on CPU except LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION.
_CPU_OPTIONS = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE",
}


@functools.cache
def _cpu_options_supported() -> bool:
    # jaxlib versions without the option (jax >= 0.8.2 is allowed) reject the whole compile:
    # probe once with a trivial program rather than pin the version.
    try:
        x = jax.device_put(np.float32(0), jax.devices("cpu")[0])
        jax.jit(lambda x: x + 1, compiler_options=_CPU_OPTIONS).lower(x).compile()
    except Exception:  # noqa: BLE001 - any rejection means "not supported here"
        return False
    return True


def compiler_options(platform: str | None = None) -> dict[str, str]:
    """`compiler_options` for `jax.jit` on `platform` (default: jax's default backend).

    On CPU, where the running jaxlib knows the option: XLA's own convolutions instead of
    YNNPACK's (see this module's docstring for the figures). Anywhere else: `{}`.

        apply = jax.jit(model.apply, compiler_options=jaxport.compiler_options())
    """
    platform = platform or jax.default_backend()
    if platform != "cpu" or not _cpu_options_supported():
        return {}
    return dict(_CPU_OPTIONS)
