"""torchvision's data recipe (`--train-crop-size`, `--val-resize-size`, `--val-crop-size`,
`--interpolation`, `--auto-augment`, `--ra-magnitude`, `--augmix-severity`, `--random-erase`)
against torchvision's own presets, built in each test exactly as
`references/classification/presets.py` builds them; then the checks of the flags, and one
`jaxport train` run with them and its `--resume`.
"""
import argparse
import dataclasses
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import autoaugment, transforms
from torchvision.transforms.functional import InterpolationMode

from jaxport._cli import main
from jaxport._errors import ConfigError
from jaxport.train import TrainConfig, train
from jaxport.train import _data, _loop, _presets
from jaxport.train._cli import add_parser, config_from_args
from tests.helpers import write_images

DATA = os.path.dirname(os.path.abspath(__file__))  # a directory for --data, never scanned by `validate`


# pytorch/vision references/classification/presets.py (commit 080836e5824eded4f6249bf88b5fd4a51e446a04),
# its two classes' Compose as written there, with the arguments train.py passes them.
class ClassificationPresetTrain:
    def __init__(self, *, crop_size, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                 interpolation=InterpolationMode.BILINEAR, hflip_prob=0.5, auto_augment_policy=None,
                 ra_magnitude=9, augmix_severity=3, random_erase_prob=0.0):
        trans = [transforms.RandomResizedCrop(crop_size, interpolation=interpolation)]
        if hflip_prob > 0:
            trans.append(transforms.RandomHorizontalFlip(hflip_prob))
        if auto_augment_policy is not None:
            if auto_augment_policy == "ra":
                trans.append(autoaugment.RandAugment(interpolation=interpolation, magnitude=ra_magnitude))
            elif auto_augment_policy == "ta_wide":
                trans.append(autoaugment.TrivialAugmentWide(interpolation=interpolation))
            elif auto_augment_policy == "augmix":
                trans.append(autoaugment.AugMix(interpolation=interpolation, severity=augmix_severity))
            else:
                aa_policy = autoaugment.AutoAugmentPolicy(auto_augment_policy)
                trans.append(autoaugment.AutoAugment(policy=aa_policy, interpolation=interpolation))
        trans.extend([transforms.PILToTensor(), transforms.ConvertImageDtype(torch.float),
                      transforms.Normalize(mean=mean, std=std)])
        if random_erase_prob > 0:
            trans.append(transforms.RandomErasing(p=random_erase_prob))
        self.transforms = transforms.Compose(trans)

    def __call__(self, img):
        return self.transforms(img)


class ClassificationPresetEval:
    def __init__(self, *, crop_size, resize_size=256, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                 interpolation=InterpolationMode.BILINEAR):
        self.transforms = transforms.Compose([
            transforms.Resize(resize_size, interpolation=interpolation), transforms.CenterCrop(crop_size),
            transforms.PILToTensor(), transforms.ConvertImageDtype(torch.float),
            transforms.Normalize(mean=mean, std=std)])

    def __call__(self, img):
        return self.transforms(img)


def _image(seed: int = 0) -> Image.Image:
    """A 64x48 RGB image with structure every policy acts on: gradients, a bright block, noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:48, 0:64]
    a = np.stack([x * 4, y * 5, (x + y) * 2], -1).astype(np.int64)
    a[10:30, 20:40] = (250, 30, 120)
    a += rng.integers(-20, 21, a.shape)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def _same(f, g, img, seeds=range(6)) -> None:
    """`f(img) == g(img)` bit for bit, each from the same torch seed; several seeds, so that the
    policies' random branches (ops, flips, erasing) are taken."""
    for s in seeds:
        torch.manual_seed(s)
        want = g(img)
        torch.manual_seed(s)
        got = f(img)
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got, want), f"seed {s}: max |diff| {float((got - want).abs().max())}"


@pytest.mark.parametrize("interpolation", _presets.INTERPOLATIONS)
@pytest.mark.parametrize("random_erase", [0.0, 0.5])
@pytest.mark.parametrize("auto_augment", [None, *_presets.AUTO_AUGMENTS])
def test_the_train_transform_is_presets_train(auto_augment, random_erase, interpolation):
    """jaxport's train transform == `ClassificationPresetTrain` with the same arguments. The
    magnitude and severity are not the defaults, so that dropping either would show."""
    kw = dict(interpolation=interpolation, auto_augment=auto_augment, ra_magnitude=13, augmix_severity=5,
              random_erase=random_erase)
    ours = _presets.train_transform(24, **kw)
    ref = ClassificationPresetTrain(crop_size=24, interpolation=InterpolationMode(interpolation),
                                    auto_augment_policy=auto_augment, ra_magnitude=13, augmix_severity=5,
                                    random_erase_prob=random_erase)
    if (auto_augment, interpolation) == ("augmix", "bicubic"):
        # torchvision's AugMix fails on it (its tensor affine ops take nearest and bilinear only):
        # refused up front instead, and the two fail alike.
        for f in (ours, ref):
            with pytest.raises(ValueError, match="Interpolation mode 'bicubic' is unsupported"):
                _same(f, f, _image())
        with pytest.raises(ConfigError, match=r"`--interpolation` \(=bicubic\) does not work with `--auto-augment augmix`"):
            TrainConfig(workdir="w", data=DATA, **kw).validate()
        return
    _same(ours, ref, _image())


@pytest.mark.parametrize("interpolation", _presets.INTERPOLATIONS)
@pytest.mark.parametrize("resize, crop", [(20, 16), (37, 37), (18, 24)])  # (18, 24): CenterCrop pads
def test_the_eval_transform_is_presets_eval(interpolation, resize, crop):
    ours = _presets.eval_transform(crop, resize, interpolation=interpolation)
    ref = ClassificationPresetEval(crop_size=crop, resize_size=resize, interpolation=InterpolationMode(interpolation))
    _same(ours, ref, _image(1), seeds=[0])


def _resolved(**kw) -> TrainConfig:
    cfg = TrainConfig(workdir="w", data=DATA, **kw)
    cfg.validate()
    return _loop._plain(cfg)


@pytest.mark.parametrize("kw, train_crop, val_resize, val_crop", [
    (dict(), 32, 37, 32),  # today's: --image-size 32 (the default) everywhere, resized to 32 * 256 / 224
    (dict(image_size=24), 24, 27, 24),
    (dict(train_crop_size=16), 16, 18, 16),  # --train-crop-size is --image-size by train.py's name
    (dict(image_size=16, train_crop_size=16, val_resize_size=20), 16, 20, 16),
    (dict(train_crop_size=16, val_crop_size=20, val_resize_size=23), 16, 23, 20),
])
def test_the_sizes_default_to_image_sizes(kw, train_crop, val_resize, val_crop):
    cfg = _resolved(**kw)
    assert (cfg.image_size, cfg.train_crop_size, cfg.val_resize_size, cfg.val_crop_size) == (
        train_crop, train_crop, val_resize, val_crop)


@pytest.mark.parametrize("kw", [dict(), dict(auto_augment="ra", ra_magnitude=20, interpolation="bicubic",
                                            random_erase=0.5, train_crop_size=12, val_resize_size=15, val_crop_size=10),
                                dict(auto_augment="cifar10", interpolation="nearest")])
def test_loaded_examples_are_the_presets_under_each_examples_seed(tmp_path, kw):
    """What `train` loads (`_data.image_folder` with `_presets.transforms(cfg)`, as `_loop` calls it)
    is the presets applied to the file under torch's seed `example_seed(seed, epoch, index)`,
    whatever loaded the examples before it."""
    files = {}
    for split, n in (("train", 5), ("val", 2)):  # torchvision's layout: each split's files in a known order
        for c in ("a", "b"):
            write_images(tmp_path / split / c, n, size=(20, 26))
        files[split] = [tmp_path / split / c / f"{i}.png" for c in ("a", "b") for i in range(n)]
    cfg = _resolved(seed=3, **kw)
    data = _data.image_folder(str(tmp_path), cfg.image_size, cfg.seed, workers=0,
                              transforms=_presets.transforms(cfg, _data.MEAN.tolist(), _data.STD.tolist()))
    ref_train = ClassificationPresetTrain(
        crop_size=cfg.train_crop_size, interpolation=InterpolationMode(cfg.interpolation),
        auto_augment_policy=cfg.auto_augment, ra_magnitude=cfg.ra_magnitude, augmix_severity=cfg.augmix_severity,
        random_erase_prob=cfg.random_erase)
    ref_eval = ClassificationPresetEval(crop_size=cfg.val_crop_size, resize_size=cfg.val_resize_size,
                                        interpolation=InterpolationMode(cfg.interpolation))
    for split, paths, ref in ((data.train, files["train"], ref_train), (data.val, files["val"], ref_eval)):
        assert split.num_examples == len(paths)
        indices = [len(paths) - 1, 0, 1]
        for epoch in (0, 2):
            x, _ = split.load(indices, epoch)
            for row, i in zip(x, indices):
                torch.manual_seed(_data.example_seed(3, epoch, i))
                want = ref(Image.open(paths[i]).convert("RGB")).permute(1, 2, 0).numpy()
                np.testing.assert_array_equal(row, want)


@pytest.mark.parametrize("kw, message", [
    (dict(interpolation="bicubc"), "`--interpolation` (='bicubc') must be one of nearest, bilinear, bicubic; did you "
                                   "mean --interpolation bicubic?"),
    (dict(interpolation="BILINEAR"), "`--interpolation` (='BILINEAR') must be one of nearest, bilinear, bicubic"),
    (dict(auto_augment="trivialaugment"), "`--auto-augment` (='trivialaugment') must be one of ra, ta_wide, augmix, "
                                          "imagenet, cifar10, svhn"),
    (dict(auto_augment="ImageNet"), "`--auto-augment` (='ImageNet') must be one of ra, ta_wide, augmix, imagenet, "
                                    "cifar10, svhn; did you mean --auto-augment imagenet?"),
    (dict(ra_magnitude=31), "`--ra-magnitude` (=31) must be an integer from 0 to 30 (RandAugment's 31 magnitude "
                            "bins), e.g. 9"),
    (dict(ra_magnitude=-1), "`--ra-magnitude` (=-1) must be an integer from 0 to 30"),
    (dict(ra_magnitude=9.5), "`--ra-magnitude` (=9.5) must be an integer from 0 to 30"),
    (dict(augmix_severity=0), "`--augmix-severity` (=0) must be an integer from 1 to 10 (AugMix's severity), e.g. 3"),
    (dict(augmix_severity=11), "`--augmix-severity` (=11) must be an integer from 1 to 10"),
    (dict(random_erase=1.5), "`--random-erase` (=1.5) must be a probability from 0 to 1 (RandomErasing's p), e.g. "
                             "0.25; 0 for none"),
    (dict(random_erase=float("nan")), "`--random-erase` (=nan) must be a probability from 0 to 1"),
    (dict(random_erase=-0.1), "`--random-erase` (=-0.1) must be a probability from 0 to 1"),
    (dict(train_crop_size=0), "`--train-crop-size` (=0) must be an integer >= 1 (pixels), or left out for the size "
                              "--image-size derives"),
    (dict(val_resize_size=20.0), "`--val-resize-size` (=20.0) must be an integer >= 1"),
    (dict(val_crop_size="16"), "`--val-crop-size` (='16') must be an integer >= 1"),
    (dict(image_size=24, train_crop_size=16), "`--train-crop-size` (=16) contradicts `--image-size` (=24): both set "
                                              "the training crop (--image-size also derives the held-out "
                                              "--val-crop-size and --val-resize-size); give one of them, or the same "
                                              "value to both"),
    (dict(auto_augment="augmix", interpolation="bicubic"), "`--interpolation` (=bicubic) does not work with "
                                                           "`--auto-augment augmix`: "),
])
def test_a_bad_setting_is_refused_naming_the_flag(kw, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(workdir="w", data=DATA, **kw).validate()
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("kw", [dict(train_crop_size=16), dict(val_resize_size=20), dict(val_crop_size=16),
                                dict(interpolation="nearest"), dict(auto_augment="ta_wide"), dict(ra_magnitude=5),
                                dict(augmix_severity=4), dict(random_erase=0.25)])
def test_the_digits_refuse_each_flag(kw):
    """The digits are 8x8 numpy images with their own augmentation: torchvision's do not apply."""
    (name, value), = kw.items()
    with pytest.raises(ConfigError) as e:
        TrainConfig(workdir="w", **kw).validate()
    assert str(e.value) == (f"`--{name.replace('_', '-')}` (={value}) applies to --data's images (torchvision's "
                            "transforms): the embedded digits are 8x8 images with their own augmentation (shifts of "
                            "up to --image-size / 8 pixels, no flips); leave it out, or pass --data DIR")


@pytest.mark.parametrize("flags, message", [
    # --image-size given is checked against --train-crop-size, even at its default
    (["--image-size", "32", "--train-crop-size", "16"], "jaxport: error: `--train-crop-size` (=16) contradicts "
                                                        "`--image-size` (=32): both set the training crop"),
    (["--auto-augment", "rand"], "jaxport: error: `--auto-augment` (='rand') must be one of ra, ta_wide, augmix, "
                                 "imagenet, cifar10, svhn"),
    (["--ra-magnitude", "9.5"], "jaxport: error: `--ra-magnitude` (=9.5) must be an integer from 0 to 30; use "
                                "--ra-magnitude 9 or --ra-magnitude 10"),
    (["--random-erase", "0,25"], "jaxport: error: `--random-erase` (='0,25') must be a number; use --random-erase "
                                 "0.25"),
    (["--val-crop-size", "x"], "jaxport: error: `--val-crop-size` (='x') must be an integer >= 1"),
])
def test_the_command_line_refuses_before_any_work(tmp_path, capsys, flags, message):
    work = tmp_path / "w"
    try:  # argparse's type errors exit; TrainConfig's return
        status = main(["train", "--workdir", str(work), "--data", DATA, *flags])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not work.exists()


def test_the_command_line_takes_train_pys_flags():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--workdir", "w", "--data", DATA, "--train-crop-size", "176",
                              "--val-resize-size", "232", "--val-crop-size", "224", "--interpolation", "bicubic",
                              "--auto-augment", "ta_wide", "--ra-magnitude", "7", "--augmix-severity", "2",
                              "--random-erase", "0.1"])
    cfg = config_from_args(args)
    assert (cfg.image_size, cfg.train_crop_size, cfg.val_resize_size, cfg.val_crop_size, cfg.interpolation,
            cfg.auto_augment, cfg.ra_magnitude, cfg.augmix_severity, cfg.random_erase) == (
        32, 176, 232, 224, "bicubic", "ta_wide", 7, 2, 0.1)
    cfg.validate()
    assert _loop._plain(cfg).image_size == 176  # the training crop is what the model is built and measured at
    defaults = config_from_args(parser.parse_args(["train", "--workdir", "w"]))
    assert defaults == TrainConfig(workdir="w", progress=None)


OLD = {k: v for k, v in dataclasses.asdict(TrainConfig(workdir="w")).items() if k in _loop._RESUMABLE
       and k not in _presets.DEFAULTS}  # what a checkpoint from before these settings recorded
NOW = {k: getattr(_resolved(), k) for k in _loop._RESUMABLE}


def test_a_checkpoint_from_before_the_presets_resumes_silently():
    assert _loop._changes(OLD, NOW) == ""
    assert _loop._changes(OLD, NOW | {"auto_augment": "ra"}) == " with changed settings: --auto-augment ra (was off)"


@pytest.mark.parametrize("change, said", [
    (dict(auto_augment="ta_wide"), "--auto-augment ta_wide (was off)"),
    (dict(interpolation="bicubic", random_erase=0.25), "--interpolation bicubic (was bilinear), --random-erase 0.25 "
                                                       "(was 0.0)"),
    (dict(ra_magnitude=5, augmix_severity=2), "--ra-magnitude 5 (was 9), --augmix-severity 2 (was 3)"),
    (dict(val_resize_size=40, val_crop_size=30), "--val-resize-size 40 (was 37), --val-crop-size 30 (was 32)"),
])
def test_a_resume_says_each_presets_change(change, said):
    assert _loop._changes(NOW, NOW | change) == f" with changed settings: {said}"
    assert _loop._changes(NOW | change, NOW).startswith(" with changed settings: ")


@pytest.mark.slow
def test_jaxport_train_with_the_presets_runs_and_resumes(tmp_path):
    """`train` on a tiny folder with torchvision's data flags: it trains and evaluates (at the
    held-out crop), and a --resume with another --auto-augment says so; one with another
    --train-crop-size is refused as another --image-size is."""
    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 10, size=(20, 24))  # 18 train / 2 val
    base = dict(workdir=str(tmp_path / "w"), data=str(tmp_path / "data"), batch_size=8, epochs=2, workers=0,
                devices=1, progress=False, checkpoint_every=1000, auto_augment="ta_wide", random_erase=0.5,
                train_crop_size=16, val_resize_size=20, val_crop_size=16)
    result = train(TrainConfig(**base, max_steps=2))
    assert int(result["state"].step) == 2 and result["epoch"] == 0 and 0 <= result["val_acc"] <= 1
    lines = []
    # (nothing left to train: the check of the settings is what is tested, without compiling again)
    result = train(TrainConfig(**base | dict(auto_augment="augmix", resume=True), max_steps=2), log=lines.append)
    assert int(result["state"].step) == 2 and not result["steps_run"]
    assert any(line.startswith("resuming from step 2 with changed settings: --auto-augment augmix (was ta_wide)")
               for line in lines), lines
    with pytest.raises(ConfigError, match=r"--resume: `--image-size` \(=24\) differs from the checkpoint's \(16\)"):
        train(TrainConfig(**base | dict(train_crop_size=24, resume=True, epochs=3)))
