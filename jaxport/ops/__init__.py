"""Exact JAX equivalents of PyTorch ranking idioms, top-k masks and logsumexp.

Every op reproduces torch's result exactly (ranks, masks) or to floating-point rounding
(logsumexp), works under `jit` and `vmap`, and on arrays sharded across a device mesh.
"""
from ._logsumexp import logsumexp as logsumexp
from ._rank import rank as rank
from ._topk import hard_negative_mask as hard_negative_mask
from ._topk import topk_mask as topk_mask

__all__ = ["hard_negative_mask", "logsumexp", "rank", "topk_mask"]
