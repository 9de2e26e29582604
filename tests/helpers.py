"""Reference objects shared by tests (cached per test process)."""
import functools

import torch_compat

ALL_ARCHS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2",
)


@functools.lru_cache(maxsize=2)
def reference(arch: str, num_classes: int = 10):
    """A calibrated torchvision model (eval mode). Small heads keep the big models cheap."""
    return torch_compat.reference_model(arch, num_classes=num_classes, image_size=64)
