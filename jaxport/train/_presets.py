"""torchvision's data recipe (`references/classification/presets.py`) for `--data`'s images.

`jaxport train` takes `references/classification/train.py`'s data flags with their names and
meanings, and builds with torchvision's own transform classes, in presets.py's order:

    train: RandomResizedCrop(train_crop_size, interpolation), RandomHorizontalFlip(0.5),
           [RandAugment(interpolation, magnitude=ra_magnitude) | TrivialAugmentWide(interpolation)
            | AugMix(interpolation, severity=augmix_severity)
            | AutoAugment(AutoAugmentPolicy(auto_augment), interpolation)],   # with --auto-augment
           PILToTensor(), ConvertImageDtype(torch.float), Normalize(mean, std),
           [RandomErasing(p=random_erase)]                                    # with --random-erase > 0
    eval:  Resize(val_resize_size, interpolation), CenterCrop(val_crop_size),
           PILToTensor(), ConvertImageDtype(torch.float), Normalize(mean, std)

i.e. `ClassificationPresetTrain(...)` and `ClassificationPresetEval(...)` with those arguments.
The sizes default to `--image-size`'s, not train.py's 224 / 256 / 224: `--image-size N` is the
training crop N (the model's input side), the held-out crop N, after a resize to
`round(N * 256 / 224)`. `--train-crop-size` is the same setting by train.py's name, so the two
must agree; `--val-crop-size` and `--val-resize-size` replace their part of what `--image-size`
derives. The embedded digits (no `--data`) refuse every one of these flags (`check`): they are 8x8
numpy images with their own augmentation (shifts, no flips, which would change a digit), loaded
without torch.

Each example's draw of these transforms comes from torch's global RNG, seeded per example by
`_data._Folder` with `(seed, epoch, index)`, so it stays a function of those alone.
"""
from __future__ import annotations

from typing import Any, Protocol

from .._args import is_finite, is_int, one_of, shown
from .._errors import ConfigError

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
AUTO_AUGMENTS = ("ra", "ta_wide", "augmix", "imagenet", "cifar10", "svhn")
SIZES = ("train_crop_size", "val_resize_size", "val_crop_size")
# The settings (TrainConfig's fields) this module reads, at what runs used before they were
# settings. The sizes' None: derived from `image_size` (`resolve`).
DEFAULTS: dict[str, Any] = {"train_crop_size": None, "val_resize_size": None, "val_crop_size": None,
                            "interpolation": "bilinear", "auto_augment": None, "ra_magnitude": 9,
                            "augmix_severity": 3, "random_erase": 0.0}
IMAGE_SIZE = 32  # TrainConfig's default `image_size`, which a `train_crop_size` may replace


class Presets(Protocol):
    """What the recipe reads of a `TrainConfig` (its fields of these names)."""

    data: str | None
    image_size: int
    train_crop_size: int | None
    val_resize_size: int | None
    val_crop_size: int | None
    interpolation: str
    auto_augment: str | None
    ra_magnitude: int
    augmix_severity: int
    random_erase: float


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_crop(image_size: int, train_crop_size: int | None, image_size_given: bool) -> None:
    """Refuse an `--image-size` given beside a `--train-crop-size` other than it: both are the
    training crop, the side of every image the model trains on. A `TrainConfig` cannot tell an
    `image_size` left at its default (32) from one given so: there `train_crop_size` is taken
    (`image_size_given` is false); the command line knows, and refuses `--image-size 32` too."""
    if image_size_given and train_crop_size is not None and image_size != train_crop_size:
        raise ConfigError(f"`--train-crop-size` (={train_crop_size}) contradicts `--image-size` (={image_size}): both "
                          "set the training crop (--image-size also derives the held-out --val-crop-size and "
                          "--val-resize-size); give one of them, or the same value to both")


def check(p: Presets) -> None:
    """Refuse a setting torchvision's presets would refuse or fail on, and any of them for the
    embedded digits, naming the flag, its value and the fix. `p.image_size` is taken as checked.

    Raises:
      ConfigError: the first bad setting.
    """
    for name in SIZES:
        value = getattr(p, name)
        if value is not None and not (is_int(value) and value >= 1):
            raise ConfigError(f"`{flag(name)}` (={value!r}) must be an integer >= 1 (pixels), or left out for the "
                              "size --image-size derives")
    one_of("--interpolation", p.interpolation, INTERPOLATIONS)
    if p.auto_augment is not None:
        one_of("--auto-augment", p.auto_augment, AUTO_AUGMENTS)
    # RandAugment indexes 31 magnitude bins with it (a negative one silently from the end); AugMix
    # refuses a severity outside 1..10 only once the transform is built.
    if not (is_int(p.ra_magnitude) and 0 <= p.ra_magnitude <= 30):
        raise ConfigError(f"`--ra-magnitude` (={p.ra_magnitude!r}) must be an integer from 0 to 30 (RandAugment's "
                          "31 magnitude bins), e.g. 9")
    if not (is_int(p.augmix_severity) and 1 <= p.augmix_severity <= 10):
        raise ConfigError(f"`--augmix-severity` (={p.augmix_severity!r}) must be an integer from 1 to 10 (AugMix's "
                          "severity), e.g. 3")
    if not (is_finite(p.random_erase) and 0 <= p.random_erase <= 1):
        raise ConfigError(f"`--random-erase` (={shown(p.random_erase)}) must be a probability from 0 to 1 "
                          "(RandomErasing's p), e.g. 0.25; 0 for none")
    if p.auto_augment == "augmix" and p.interpolation == "bicubic":
        # torchvision's AugMix works on tensors, whose affine ops have no bicubic: it failed mid-epoch.
        raise ConfigError("`--interpolation` (=bicubic) does not work with `--auto-augment augmix`: torchvision's "
                          "AugMix transforms tensors, and their shear, translate and rotate take nearest or bilinear "
                          "only (train.py fails on it in the first batch); use --interpolation bilinear")
    check_crop(p.image_size, p.train_crop_size, p.image_size != IMAGE_SIZE)
    if p.data is None:
        for name, default in DEFAULTS.items():
            value = getattr(p, name)
            if value != default:
                raise ConfigError(f"`{flag(name)}` (={value}) applies to --data's images (torchvision's transforms): "
                                  "the embedded digits are 8x8 images with their own augmentation (shifts of up to "
                                  "--image-size / 8 pixels, no flips); leave it out, or pass --data DIR")


def resolve(p: Presets) -> dict[str, int]:
    """The sizes a checked `p` trains and evaluates at, by field: `image_size` is the training crop
    (`train_crop_size` if given), which the held-out crop and resize derive from when not given.
    Nothing for the digits, whose images are `image_size` px."""
    if p.data is None:
        return {}
    crop = p.image_size if p.train_crop_size is None else p.train_crop_size
    return {"image_size": crop, "train_crop_size": crop,
            "val_crop_size": crop if p.val_crop_size is None else p.val_crop_size,
            "val_resize_size": round(crop * 256 / 224) if p.val_resize_size is None else p.val_resize_size}


def preprocess_metadata(p: Presets, mean, std) -> dict[str, Any]:
    """The evaluation transform of a checked and resolved `p` with `--data`, in the fields
    torchvision's `weights.transforms()` has (`torch_compat.weights_metadata`'s `preprocess`),
    so a trained model's file says how to feed it as a ported one's does."""
    return {"resize_size": [p.val_resize_size], "crop_size": [p.val_crop_size], "interpolation": p.interpolation,
            "antialias": True, "mean": [float(m) for m in mean], "std": [float(s) for s in std]}


def train_transform(crop_size: int, *, interpolation: str = "bilinear", auto_augment: str | None = None,
                    ra_magnitude: int = 9, augmix_severity: int = 3, random_erase: float = 0.0,
                    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
    """torchvision's `ClassificationPresetTrain(crop_size=crop_size, mean=mean, std=std,
    interpolation=InterpolationMode(interpolation), hflip_prob=0.5, auto_augment_policy=auto_augment,
    ra_magnitude=ra_magnitude, augmix_severity=augmix_severity, random_erase_prob=random_erase)`,
    the PIL pipeline: a PIL image in, a normalised CHW float32 tensor out."""
    import torch
    from torchvision import transforms as T

    mode = T.InterpolationMode(interpolation)
    trans = [T.RandomResizedCrop(crop_size, interpolation=mode), T.RandomHorizontalFlip(0.5)]
    if auto_augment == "ra":
        trans.append(T.RandAugment(interpolation=mode, magnitude=ra_magnitude))
    elif auto_augment == "ta_wide":
        trans.append(T.TrivialAugmentWide(interpolation=mode))
    elif auto_augment == "augmix":
        trans.append(T.AugMix(interpolation=mode, severity=augmix_severity))
    elif auto_augment is not None:
        trans.append(T.AutoAugment(policy=T.AutoAugmentPolicy(auto_augment), interpolation=mode))
    trans += [T.PILToTensor(), T.ConvertImageDtype(torch.float), T.Normalize(mean=list(mean), std=list(std))]
    if random_erase > 0:
        trans.append(T.RandomErasing(p=random_erase))
    return T.Compose(trans)


def eval_transform(crop_size: int, resize_size: int, *, interpolation: str = "bilinear",
                   mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)):
    """torchvision's `ClassificationPresetEval(crop_size=crop_size, resize_size=resize_size,
    mean=mean, std=std, interpolation=InterpolationMode(interpolation))`, the PIL pipeline."""
    import torch
    from torchvision import transforms as T

    mode = T.InterpolationMode(interpolation)
    return T.Compose([T.Resize(resize_size, interpolation=mode), T.CenterCrop(crop_size), T.PILToTensor(),
                      T.ConvertImageDtype(torch.float), T.Normalize(mean=list(mean), std=list(std))])


def transforms(p: Presets, mean, std) -> tuple[Any, Any]:
    """The (train, eval) transforms of a checked and resolved `p` with `--data`."""
    return (train_transform(p.train_crop_size, interpolation=p.interpolation, auto_augment=p.auto_augment,
                            ra_magnitude=p.ra_magnitude, augmix_severity=p.augmix_severity,
                            random_erase=p.random_erase, mean=mean, std=std),
            eval_transform(p.val_crop_size, p.val_resize_size, interpolation=p.interpolation, mean=mean, std=std))
