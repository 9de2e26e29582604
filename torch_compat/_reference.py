"""torchvision reference models with realistic, non-default BatchNorm state.

No pretrained weights can be downloaded here, and a freshly constructed torchvision model has
running_mean=0, running_var=1, weight=1, bias=0: values under which swapping mean/var or
scale/bias goes unnoticed. These models get random affine BatchNorm parameters and running
statistics calibrated by a few train-mode batches, so every tensor is distinguishable.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torchvision

from jaxport.models import check_arch, check_dilation


def reference_model(arch: str, *, num_classes: int = 1000, seed: int = 0, image_size: int = 64,
                    calibration_batches: int = 3, batch_size: int = 4, dtype: torch.dtype = torch.float32,
                    replace_stride_with_dilation: Sequence[bool] | None = None) -> torch.nn.Module:
    """A torchvision `arch` with seeded weights and calibrated BatchNorm, in eval mode.

    Args:
      arch: torchvision constructor name, e.g. "resnet50".
      num_classes: classifier size.
      seed: seeds weights, BatchNorm affine parameters and calibration inputs.
      image_size: side of the calibration images (small keeps large models fast).
      calibration_batches: train-mode forward passes that update the running statistics.
      batch_size: images per calibration batch.
      dtype: dtype of the returned model's parameters and buffers.
      replace_stride_with_dilation: three bools for layer2..4, as torchvision's (None: none);
        the weights are those of the undilated model with the same seed, the statistics are
        calibrated through the dilated one.
    """
    check_arch(arch)
    dilate = check_dilation(replace_stride_with_dilation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(torchvision.models, arch)(num_classes=num_classes, replace_stride_with_dilation=list(dilate))
    return calibrate(model, seed=seed, image_size=image_size, calibration_batches=calibration_batches,
                     batch_size=batch_size).to(dtype)


def calibrate(model: torch.nn.Module, *, seed: int = 0, image_size: int = 64, calibration_batches: int = 3,
              batch_size: int = 4) -> torch.nn.Module:
    """`model` (any torchvision ResNet, e.g. one built with `replace_stride_with_dilation`) with
    random BatchNorm affine parameters and running statistics from `calibration_batches`
    train-mode passes, in place; returned in eval mode. The arguments are `reference_model`'s."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * 0.1)
        model.train()
        # Inputs with per-channel offsets and scales, like normalised images that are not
        # exactly zero-mean, so the statistics are far from 0/1.
        shift = torch.randn(1, 3, 1, 1, generator=gen) * 0.5
        scale = torch.rand(1, 3, 1, 1, generator=gen) + 0.5
        for _ in range(calibration_batches):
            model(torch.randn(batch_size, 3, image_size, image_size, generator=gen) * scale + shift)
    return model.eval()
