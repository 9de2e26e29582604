"""Test-wide settings that must exist before jax is imported.

8 simulated CPU devices let the sharded and data-parallel tests run on any machine; parity
tests need full-precision matmuls (the CPU default may use lower precision passes).
"""
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
# Keep torch and XLA from oversubscribing the 2 cores when pytest-xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


@pytest.fixture
def x64():
    """float64 inside the test (``jax.enable_x64``), for comparisons tight enough to mean exact."""
    with jax.enable_x64(True):
        yield
