"""SSD's MultiBox classification loss with hard-negative mining: JAX beside the torch original.

Run: python examples/ssd_hard_negative_mining.py

The torch half is torchvision's `SSDHead.compute_loss` classification term
(torchvision/models/detection/ssd.py), written out; the JAX half uses `jaxport.ops`
(`logsumexp` for the cross-entropy, `hard_negative_mask` for the mining). Same inputs, same
loss: the script prints both and exits non-zero if they differ beyond float32 rounding.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from jaxport.ops import hard_negative_mask, logsumexp  # noqa: E402

NEG_POS_RATIO = 3
RTOL = 1e-5  # float32: the two sides sum ~10^5 per-anchor losses in different orders


def torch_ssd_classification_loss(cls_logits: torch.Tensor, cls_targets: torch.Tensor):
    """torchvision's SSD classification loss with hard-negative mining (3 negatives/positive)."""
    num_classes = cls_logits.size(-1)
    cls_loss = F.cross_entropy(cls_logits.view(-1, num_classes), cls_targets.view(-1), reduction="none")
    cls_loss = cls_loss.view(cls_targets.size())
    foreground_idxs = cls_targets > 0
    num_foreground = foreground_idxs.sum(1, keepdim=True)
    num_negative = NEG_POS_RATIO * num_foreground
    negative_loss = cls_loss.clone()
    negative_loss[foreground_idxs] = -float("inf")  # use -inf to detect positive values that creeped in the sample
    values, idx = negative_loss.sort(1, descending=True)
    background_idxs = idx.sort(1)[1] < num_negative
    N = max(1, num_foreground.sum())
    return (cls_loss[foreground_idxs].sum() + cls_loss[background_idxs].sum()) / N, background_idxs


@jax.jit
def jax_ssd_classification_loss(cls_logits: jax.Array, cls_targets: jax.Array):
    """The same loss in JAX: cross-entropy via logsumexp, mining via hard_negative_mask."""
    picked = jnp.take_along_axis(cls_logits, cls_targets[..., None], axis=-1)[..., 0]
    cls_loss = logsumexp(cls_logits, axis=-1) - picked
    foreground = cls_targets > 0
    background = hard_negative_mask(cls_loss, foreground, NEG_POS_RATIO, axis=1)
    n = jnp.maximum(1, foreground.sum())
    return jnp.sum(cls_loss, where=foreground | background) / n, background


def main() -> int:
    # no options: parsing still gives `--help` and refuses a stray argument instead of ignoring it
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rng = np.random.default_rng(0)
    batch, anchors, num_classes = 8, 8732, 21  # SSD300 on VOC
    logits = (rng.standard_normal((batch, anchors, num_classes)) * 2).astype(np.float32)
    targets = np.where(rng.random((batch, anchors)) < 0.02, rng.integers(1, num_classes, (batch, anchors)), 0)

    torch_loss, torch_bg = torch_ssd_classification_loss(torch.from_numpy(logits), torch.from_numpy(targets))
    jax_loss, jax_bg = jax_ssd_classification_loss(jnp.asarray(logits), jnp.asarray(targets, jnp.int32))
    torch_loss, jax_loss = float(torch_loss), float(jax_loss)
    diff = abs(torch_loss - jax_loss)
    same_mask = bool((torch_bg.numpy() == np.asarray(jax_bg)).all())
    print(f"torch loss: {torch_loss:.7f}")
    print(f"jax   loss: {jax_loss:.7f}")
    print(f"|difference|: {diff:.3g} (tolerance {RTOL:g} relative); mined negatives identical: {same_mask}")
    if diff > RTOL * abs(torch_loss) or not same_mask:
        print("FAIL: the JAX loss differs from torchvision's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
