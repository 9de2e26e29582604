"""`--ra-sampler` / `--ra-reps`: torchvision's repeated augmentation (RASampler, from DeiT).

torchvision's sampler lives in its reference scripts (references/classification/sampler.py), not
in the package, so the reference here is its documented behaviour, written out below: each
image of the epoch's permutation repeated `reps` times in a row (padded by wrapping to a
multiple of the W ranks), rank r taking entries r, r + W, r + 2W, ... and keeping the first
floor((n // 256 * 256) / W) of them.
"""
import math
import re

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from jaxport._errors import ConfigError
from jaxport.train import TrainConfig, train
from jaxport.train import _data


def _torch_rank_lists(permutation: np.ndarray, reps: int, world: int) -> list[np.ndarray]:
    """What RASampler yields on each of `world` ranks for one epoch, given its permutation."""
    n = len(permutation)
    repeated = np.repeat(permutation, reps)
    per_rank = math.ceil(n * reps / world)
    repeated = np.concatenate([repeated, repeated[:per_rank * world - len(repeated)]])
    kept = (n // 256 * 256) // world
    return [repeated[r::world][:kept] for r in range(world)]


@pytest.mark.parametrize("n", [1438, 700, 256])
@pytest.mark.parametrize("reps", [1, 3, 4])
@pytest.mark.parametrize("world", [1, 2, 8])
def test_each_global_batch_holds_what_torchs_ranks_take_together(n, reps, world):
    per_rank = 8
    batch = per_rank * world
    order = _data.ra_epoch_order(7, 2, n, reps, batch)
    ranks = _torch_rank_lists(_data.epoch_order(7, 2, n), reps, world)
    # torch's last, partial batch is left out, as every jaxport epoch leaves it
    steps = len(ranks[0]) // per_rank
    assert len(order) == steps * batch and steps == _data.ra_epoch_images(n) // batch
    for i in range(steps):
        want = np.concatenate([r[i * per_rank:(i + 1) * per_rank] for r in ranks])
        got = order[i * batch:(i + 1) * batch]
        np.testing.assert_array_equal(np.sort(got % n), np.sort(want))
    # every (image, copy) once: an image's copies are told apart, each with its own augmentation
    assert len(np.unique(order)) == len(order) and order.max() < n * reps


@pytest.mark.parametrize("reps, devices", [(3, 4), (4, 4), (4, 8), (2, 8)])
def test_a_devices_share_holds_distinct_images_when_devices_are_at_least_the_copies(reps, devices):
    """torch's rank-by-rank dealing puts an image's copies on different GPUs; jaxport's copy-major
    batches do the same for its contiguous split of each global batch over the devices."""
    n, batch = 1438, 16 * devices
    order = _data.ra_epoch_order(0, 0, n, reps, batch)
    for share in order.reshape(-1, batch // devices):
        assert len(np.unique(share % n)) == len(share)


def test_digit_copies_are_augmented_apart_and_the_first_copy_as_without_the_sampler():
    data = _data.digits(16, seed=3)
    n = data.train.num_examples
    first, labels = data.train.load(list(range(20)), 1)
    assert _data.example_seed(3, 1, 5) == _data.example_seed(3, 1, 5, 0)  # runs without the sampler: unchanged
    np.testing.assert_array_equal(data.train.load([n + 4, 4, 2 * n + 4], 1)[1], labels[[4, 4, 4]])
    np.testing.assert_array_equal(data.train.load([4], 1)[0][0], first[4])
    copies = [data.train.load([c * n + i for i in range(20)], 1) for c in (1, 2)]
    for images, copy_labels in copies:
        np.testing.assert_array_equal(copy_labels, labels)
    # a shift of 25 draws each: two copies coincide with probability 1/25 per image
    differ = [int(np.sum([not np.array_equal(a, b) for a, b in zip(first, images)])) for images, _ in copies]
    assert min(differ) >= 14, differ


def test_an_image_folder_copy_is_torchvisions_transform_under_its_own_seed(tmp_path):
    samples = []
    for i in range(3):
        path = tmp_path / f"{i}.png"
        Image.fromarray((np.random.default_rng(i).random((40, 48, 3)) * 255).astype(np.uint8)).save(path)
        samples.append((str(path), i % 2))
    transform = T.Compose([T.RandomResizedCrop(16), T.RandomHorizontalFlip(), T.PILToTensor()])
    dataset = _data._Folder(samples, transform, seed=11)
    for copy in (0, 1, 2):
        got, label = dataset[(5, copy * 3 + 2)]
        torch.manual_seed(_data.example_seed(11, 5, 2, copy))
        with Image.open(samples[2][0]) as im:
            want = transform(im.convert("RGB")).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(got, want)
        assert label == 0


def test_train_runs_the_sampler_and_resume_refuses_another(tmp_path, monkeypatch):
    calls = []
    real = _data.ra_epoch_order
    monkeypatch.setattr(_data, "ra_epoch_order", lambda *a: (calls.append(a), real(*a))[1])
    messages = []
    cfg = TrainConfig(workdir=str(tmp_path / "w"), image_size=16, batch_size=64, epochs=1, max_steps=2, devices=2,
                      ra_sampler=True, ra_reps=4, seed=5, progress=False)
    out = train(cfg, log=messages.append)
    assert int(out["state"].step) == 2
    # 1438 training digits: 1280 images an epoch, 20 steps of 64
    assert any("20 steps/epoch" in m and "--ra-sampler: 4 copies of each image, 1280 images an epoch" in m
               for m in messages), messages
    assert calls == [(5, 0, 1438, 4, 64)]
    for other, said in ((dict(ra_reps=3), "--ra-sampler --ra-reps 3"), (dict(ra_sampler=False), "no --ra-sampler")):
        again = TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 3, **other})
        with pytest.raises(ConfigError, match=rf"--resume: this run asks for {said}, but the checkpoint's run in \S+ "
                                              r"trained with --ra-sampler --ra-reps 4, which fixes its epochs' length "
                                              r"and data order; resume with --ra-sampler --ra-reps 4"):
            train(again, log=lambda m: None)


def test_too_few_images_for_the_sampler_and_reps_without_it_are_told(tmp_path):
    # digits: 1438 training images, 1280 an epoch under the sampler
    cfg = TrainConfig(workdir=str(tmp_path / "a"), image_size=16, batch_size=1536, ra_sampler=True, progress=False)
    with pytest.raises(ConfigError, match=re.escape(
            "`--ra-sampler` trains an epoch on the training images rounded down to a multiple of 256 (torchvision's "
            "RASampler): 1280 of the 1438 here, fewer than `--batch-size` (=1536); use at most 1280")):
        train(cfg, log=lambda m: None)
    for c in ("x", "y"):
        (tmp_path / "few" / c).mkdir(parents=True)
        for i in range(12):
            Image.new("RGB", (20, 20), (i * 20, 0, 0)).save(tmp_path / "few" / c / f"{i}.png")
    with pytest.raises(ConfigError, match=r"`--ra-sampler` trains an epoch .*: 0 of the \d+ here, so no step; add "
                                          r"training images, or leave out --ra-sampler"):
        train(TrainConfig(workdir=str(tmp_path / "b"), data=str(tmp_path / "few"), image_size=16, batch_size=8,
                          ra_sampler=True, workers=0, progress=False), log=lambda m: None)
    # --batch-size auto said "the training set (0 images)" of a folder holding 24
    with pytest.raises(ConfigError, match=r"`--batch-size auto`: an epoch under `--ra-sampler` \(0 of the (\d+) "
                                          r"training images, rounded down to a multiple of 256 .*\) has fewer images "
                                          r"than the 2 devices.*; add training images, or leave out --ra-sampler$"):
        train(TrainConfig(workdir=str(tmp_path / "e"), data=str(tmp_path / "few"), image_size=16, batch_size="auto",
                          ra_sampler=True, devices=2, workers=0, progress=False), log=lambda m: None)
    messages = []
    with pytest.raises(ConfigError, match=r"larger than the training set"):
        train(TrainConfig(workdir=str(tmp_path / "c"), image_size=16, batch_size=1536, ra_reps=4, progress=False),
              log=messages.append)
    assert "--ra-reps 4 is not used (it sets --ra-sampler's copies of each image, and there is no --ra-sampler)" in messages
    with pytest.raises(ConfigError, match=r"`--ra-reps` \(=0\) must be >= 1"):
        train(TrainConfig(workdir=str(tmp_path / "d"), ra_sampler=True, ra_reps=0), log=lambda m: None)
