"""Inputs shared by the ops tests (no tests here): arrays full of ties, signed zeros, infinities, NaN."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

FLOAT_POOL = np.array([-np.inf, -2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf, np.nan, -np.nan], np.float32)
# Subnormals of each dtype: XLA:CPU flushes them to zero in float compares, so an order built
# on `x == 0` merged them with 0.0 (torch orders them).
SUBNORMALS = {"float32": [1e-45, -1e-45, 3e-42, -1e-40], "float16": [6e-8, -6e-8, 3e-5, -1.2e-7],
              "bfloat16": [1e-39, -1e-39, 5e-40, -9e-41]}

TORCH_DTYPE = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def tricky(shape, dtype: str, seed: int = 0) -> np.ndarray:
    """Random values with many ties; floats also hold +-0, +-inf and NaN of both signs."""
    rng = np.random.default_rng(seed)
    if dtype in ("float32", "float16", "bfloat16"):
        x = rng.choice(FLOAT_POOL, size=shape)
        # Some distinct values too, so not every element is tied.
        distinct = rng.random(shape) < 0.5
        x = np.where(distinct, rng.standard_normal(shape).astype(np.float32), x)
        tiny = rng.random(shape) < 0.1
        x = np.where(tiny, rng.choice(np.array(SUBNORMALS[dtype], np.float32), size=shape), x)
        return x.astype(np_dtype(dtype))
    if dtype == "bool":
        return rng.random(shape) < 0.5
    info = np.iinfo(dtype)
    pool = np.array([info.min, info.min + 1, -1 if info.min < 0 else 1, 0, 2, info.max], dtype)
    small = rng.integers(-5 if info.min < 0 else 0, 6, shape)
    return np.where(rng.random(shape) < 0.5, rng.choice(pool, size=shape), small).astype(dtype)


def to_torch(x: np.ndarray, dtype: str) -> torch.Tensor:
    if dtype == "bfloat16":
        return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def torch_rank(xt: torch.Tensor, axis: int, descending: bool) -> np.ndarray:
    """The reference: torch's double sort."""
    return xt.sort(dim=axis, descending=descending, stable=True).indices.argsort(dim=axis).numpy()


# float8 values with ties, both zeros and NaNs of both signs (e5m2 also has infinities).
FLOAT8_POOL = {"float8_e4m3fn": [-448.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, 448.0, np.nan, -np.nan],
               "float8_e5m2": [-np.inf, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf, np.nan, -np.nan]}


def float8_data(shape, dtype: str, seed: int = 0) -> np.ndarray:
    """Random float8 values drawn from `FLOAT8_POOL` (mostly ties) and a few distinct ones."""
    rng = np.random.default_rng(seed)
    x = rng.choice(np.array(FLOAT8_POOL[dtype], np.float32), size=shape)
    x = np.where(rng.random(shape) < 0.3, rng.standard_normal(shape).astype(np.float32), x)
    x = x.astype(getattr(ml_dtypes, dtype))
    bits = x.view(np.uint8)
    assert {0x00, 0x80} <= set(np.unique(bits)), "both zeros must occur"
    return x
