"""ImageFolder loading (`jaxport.train._data`) against torchvision's ImageFolder and transforms,
on files found by a probe. Images are a few pixels and `image_size` 16, so each test takes a second.
"""
import io
import os
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets
from torchvision import transforms as T
from torchvision.datasets.folder import pil_loader

from jaxport.train import _data

SIZE = 16
NORMALIZE = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # torchvision's ImageNet values


def _png(seed: int, size=(20, 24)) -> bytes:
    im = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), np.uint8))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes, crc_flip: int = 0) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) ^ crc_flip)


def _broken(png: bytes, how: str) -> bytes:
    """`png` with a fault Pillow's `verify` refuses and its decoder does not mind."""
    iend = png.rindex(b"IEND") - 4
    if how == "bad IDAT checksum":
        idat = png.index(b"IDAT")
        at = idat + 4 + struct.unpack(">I", png[idat - 4:idat])[0]
        return png[:at] + bytes([png[at] ^ 0xFF]) + png[at + 1:]
    if how == "bad checksum in a text chunk after IDAT":
        return png[:iend] + _chunk(b"tEXt", b"k\0v", crc_flip=1) + png[iend:]
    assert how == "no IEND"
    return png[:iend]


@pytest.mark.parametrize("how", ["bad IDAT checksum", "bad checksum in a text chunk after IDAT", "no IEND"])
def test_pngs_that_decode_are_kept_though_they_fail_verify(tmp_path, how):
    """The scan's `verify()` checks every PNG chunk's CRC and the IEND chunk, beyond the header:
    PNGs that decode exactly, and that torchvision's ImageFolder trains on, were skipped as
    "unreadable". Kept, both splits read as torchvision reads them, pixel for pixel; a PNG cut
    in half (which does not decode) is still skipped."""
    root = tmp_path / "data"
    for split in ("train", "val"):
        for k, c in enumerate(("a", "b")):
            os.makedirs(root / split / c)
            for i in range(3):
                (root / split / c / f"{i}.png").write_bytes(_png(100 * k + i))
            (root / split / c / "broken.png").write_bytes(_broken(_png(100 * k + 50), how))
    for path in (root / "val" / "a" / "broken.png", root / "val" / "b" / "broken.png"):
        with pytest.raises(Exception):  # the fault: Pillow's verify refuses it
            with Image.open(path) as im:
                im.verify()
    half = _png(7, size=(60, 60))
    (root / "train" / "a" / "half.png").write_bytes(half[:len(half) // 2])

    with pytest.warns(UserWarning) as record:
        data = _data.image_folder(str(root), image_size=SIZE, workers=0)
    messages = [str(w.message) for w in record]
    skips = [m for m in messages if m.startswith("skipping")]
    half_path = root / "train" / "a" / "half.png"
    assert len(skips) == 1 and skips[0].startswith(f"skipping unreadable image {half_path}: "), messages

    for split, split_data in (("train", data.train), ("val", data.val)):
        tv = datasets.ImageFolder(str(root / split))
        want = [s for s in tv.samples if not s[0].endswith("half.png")]
        assert data.classes == tv.classes
        assert split_data.num_examples == len(want), split
        x, y = split_data.load(range(len(want)), 0)
        np.testing.assert_array_equal(y, [label for _, label in want], err_msg=split)
        for i, (path, _) in enumerate(want):
            if split == "val":
                tf = T.Compose([T.Resize(round(SIZE * 256 / 224)), T.CenterCrop(SIZE), T.ToTensor(), NORMALIZE])
            else:
                # The training crop is torchvision's, drawn from torch's RNG seeded per example.
                tf = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.ToTensor(), NORMALIZE])
                torch.manual_seed(_data.example_seed(0, 0, i))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = tf(pil_loader(path)).permute(1, 2, 0).numpy()
            np.testing.assert_array_equal(x[i], ref, err_msg=f"{split} {path}")
