"""Training data: the embedded digits and torchvision ImageFolder directories.

Every example's augmentation and every epoch's order depend only on `(seed, epoch, index)`,
never on the device layout or on which process loads it, so runs on 1 or 8 devices (or 2
processes) see the same global batches, and a resumed run sees the batches the killed one
would have. A global step `s` of an epoch holds `order(epoch)[s * B:(s + 1) * B]`; process `p`
of `P` loads rows `[p * B / P, (p + 1) * B / P)` of it.

ImageFolder directories are loaded by torch's DataLoader with worker processes and
torchvision's transforms (the ImageNet recipe); torch is imported inside this module only,
where that loader is built.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import pickle
import signal
import sys
import warnings
import weakref
from typing import Callable, Iterator, Sequence

import numpy as np

from .._args import is_int, is_real, shell_word
from .._cpus import usable_cpus
from .._errors import ConfigError

MEAN = np.array((0.485, 0.456, 0.406), np.float32)
STD = np.array((0.229, 0.224, 0.225), np.float32)
# The held-out split's folder beside train/: torchvision's `val`, and the names other datasets use.
VAL_NAMES = ("val", "validation", "valid")
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The permutation of `n` examples for `epoch`, a function of `(seed, epoch)` only."""
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n)


def example_seed(seed: int, epoch: int, index: int, copy: int = 0) -> int:
    """The augmentation seed of one example in one epoch; `copy` > 0: of its `copy`-th repeat
    under --ra-sampler (`ra_epoch_order`), each with an augmentation of its own."""
    return int(np.random.default_rng([seed, epoch, index, 0xA06, *([copy] if copy else [])]).integers(2**31 - 1))


def ra_epoch_images(n: int) -> int:
    """The images (copies included) an epoch of --ra-sampler trains on out of `n` training images:
    `n` rounded down to a multiple of 256, what torchvision's RASampler (references/classification,
    from DeiT) yields over all its ranks together, whatever the number of copies."""
    return n // 256 * 256


def ra_epoch_order(seed: int, epoch: int, n: int, reps: int, batch: int) -> np.ndarray:
    """--ra-sampler's training order of `epoch` (repeated augmentation), in global batches of `batch`.

    torchvision's RASampler repeats each image of the epoch's permutation `reps` times in a row
    and deals that list out to the W ranks in turn (rank r takes entries r, r + W, ...), each
    rank keeping `ra_epoch_images(n) / W` of them. So the global batch of step i, every rank's
    i-th batch together, holds entries [i * batch, (i + 1) * batch) of the repeated list, for any
    W: here too, from `epoch_order`'s permutation. Within a batch, jaxport puts every first copy
    before every second one, and so on (stably), so that a device's share holds distinct images
    whenever the devices are at least as many as the copies, as torch's dealing does, and the
    order stays one of the seed alone, not of the device count. The last partial batch is left
    out, as every epoch of `jaxport train` leaves it.

    Entry `copy * n + i` is copy `copy` of example `i`: a `Split` loads it with the augmentation
    seed `example_seed(seed, epoch, i, copy)`.
    """
    copies = epoch_order(seed, epoch, n)[:, None] + n * np.arange(reps)[None, :]  # each image's copies in a row
    steps = ra_epoch_images(n) // batch
    batches = copies.reshape(-1)[:steps * batch].reshape(steps, batch)
    by_copy = np.argsort(batches // n, axis=1, kind="stable")
    return np.take_along_axis(batches, by_copy, axis=1).reshape(-1)


@dataclasses.dataclass
class Split:
    """One split: `load(indices, epoch) -> (images NHWC float32, labels int32)`. An index
    `copy * num_examples + i` is example `i` augmented as its `copy`-th repeat (`ra_epoch_order`).

    `stream_fn(batches, epoch)`, if any, loads ahead (an ImageFolder's DataLoader workers);
    `close_fn()`, if any, ends what it keeps between streams (those workers).
    """

    num_examples: int
    load: Callable[[Sequence[int], int], tuple[np.ndarray, np.ndarray]]
    stream_fn: Callable | None = None
    close_fn: Callable[[], None] | None = None

    def stream(self, batches: Iterator[Sequence[int]], epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Loaded batches for the index lists in `batches` (loaded ahead by workers if any)."""
        if self.stream_fn is not None:
            return self.stream_fn(batches, epoch)
        return (self.load(b, epoch) for b in batches)

    def close(self) -> None:
        """Stops the split's loader workers, which otherwise serve every stream until garbage
        collection or the interpreter's exit. A later stream starts new ones."""
        if self.close_fn is not None:
            self.close_fn()


@dataclasses.dataclass
class Data:
    """Both splits and the class names. Closing it (`close()`, or leaving a `with` block) stops
    the splits' loader workers."""

    train: Split
    val: Split
    classes: list[str]
    skipped: int = 0  # unreadable images left out, with a warning
    # `() -> {"files": digest, "names": digest}` of the files (`_fingerprint`), which a resumed run
    # and every process of a run compare. None: nothing to compare (the embedded digits).
    fingerprint: Callable[[], dict[str, str]] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def close(self) -> None:
        try:
            self.train.close()
        finally:
            self.val.close()

    def __enter__(self) -> Data:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------- digits


def _resize_bilinear(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of (N, h, w) float images to (N, size, size), align_corners=False."""
    n, h, w = images.shape

    def grid(src, dst):
        x = (np.arange(dst) + 0.5) * src / dst - 0.5
        x0 = np.clip(np.floor(x).astype(int), 0, src - 1)
        x1 = np.clip(x0 + 1, 0, src - 1)
        t = np.clip(x - x0, 0, 1)
        return x0, x1, t

    y0, y1, ty = grid(h, size)
    x0, x1, tx = grid(w, size)
    rows = images[:, y0] * (1 - ty)[None, :, None] + images[:, y1] * ty[None, :, None]
    return rows[:, :, x0] * (1 - tx) + rows[:, :, x1] * tx


def _available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits' (1797, 8, 8) images and their labels, as `sklearn.datasets.load_digits`
    returns them: read from the CSV file it reads, without importing sklearn. That import takes
    ~1.6 s (scipy and its array-API layer), a fifth of the start of every `jaxport train` on the
    digits; the file alone takes ~0.05 s. Where the file is not found (another layout of the
    package), it is sklearn's own loader."""
    spec = importlib.util.find_spec("sklearn")  # locates the package; runs none of its code
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            data = np.loadtxt(path, delimiter=",")
            if data.shape == (1797, 65):
                return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images, d.target


def _check_split(image_size, seed, val_fraction) -> None:
    """Refuse what would split or size the data wrongly without an error: a negative
    `val_fraction` slices from the end (1618 of the 1797 digits held out), 1 leaves nothing to
    train on, and a string size fails deep in numpy or torchvision."""
    if not (is_int(image_size) and image_size >= 1):
        raise ConfigError(f"`image_size` (={image_size!r}) must be an integer >= 1, e.g. image_size=32")
    if not is_int(seed):
        raise ConfigError(f"`seed` (={seed!r}) must be an integer, e.g. seed=0")
    if not (is_real(val_fraction) and 0 < val_fraction < 1):
        raise ConfigError(f"`val_fraction` (={val_fraction!r}) must be a number between 0 and 1 (exclusive): the "
                          "share of each class's images held out for evaluation, e.g. val_fraction=0.2")


def digits(image_size: int = 32, seed: int = 0, val_fraction: float = 0.2) -> Data:
    """scikit-learn's handwritten digits (1797 8x8 images, 10 classes) as RGB `image_size` px.

    A stratified, fixed split (independent of `seed`) holds out `val_fraction`. Training
    images are shifted by up to `image_size // 8` pixels (zero-padded), a function of
    `(seed, epoch, index)`; no flips, which would change a digit. Normalised with ImageNet's
    mean and std like every other input. torchvision's data flags (`_presets`: `--auto-augment`,
    the crop sizes, ...) are `--data`'s, and `TrainConfig` refuses them here.
    """
    _check_split(image_size, seed, val_fraction)
    if image_size < 8:
        raise ConfigError(f"`--image-size` (={image_size}) must be >= 8 for the digits (8x8 images); use "
                          "--image-size 8 or more (the default, 32, reaches >= 95%)")
    # All 1797 images are upsampled up front (they are small at the sizes they are meant for); at
    # 10000 px that would be ~2 TB, growing until the kernel killed the process: refuse it first.
    per_pixel = 2 * 1797 * 3 * 4  # 1797 RGB float32 images, and their copy while they are made
    need, free = per_pixel * image_size**2, _available_memory()
    if free is not None and need > free:
        fits = int((free / per_pixel) ** 0.5)
        raise ConfigError(f"`--image-size` (={image_size}) would need {need / 2**30:.1f} GiB to hold the digits "
                          f"upsampled, and {free / 2**30:.1f} GiB of memory is available; use --image-size {fits} "
                          "or less (the digits are 8x8 images; the default, 32, reaches >= 95%)")
    raw, target = _load_digits()
    images = _resize_bilinear(raw.astype(np.float32) / 16.0, image_size)
    images = ((np.repeat(images[..., None], 3, axis=-1) - MEAN) / STD).astype(np.float32)
    labels = target.astype(np.int32)
    rng = np.random.default_rng(1234)
    val_idx = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[: int(round(val_fraction * np.sum(labels == c)))]
                              for c in range(10)])
    is_val = np.zeros(len(labels), bool)
    is_val[val_idx] = True
    tr_x, tr_y, va_x, va_y = images[~is_val], labels[~is_val], images[is_val], labels[is_val]
    pad = image_size // 8
    fill = (0.0 - MEAN) / STD  # black, normalised

    def load_train(indices, epoch):
        out = np.empty((len(indices), image_size, image_size, 3), np.float32)
        copies, indices = np.divmod(np.asarray(indices, int), len(tr_y))
        for j, (i, copy) in enumerate(zip(indices.tolist(), copies.tolist())):
            dy, dx = np.random.default_rng(example_seed(seed, epoch, i, copy)).integers(-pad, pad + 1, 2)
            canvas = np.broadcast_to(fill, (image_size + 2 * pad, image_size + 2 * pad, 3)).copy()
            canvas[pad:pad + image_size, pad:pad + image_size] = tr_x[i]
            out[j] = canvas[pad + dy:pad + dy + image_size, pad + dx:pad + dx + image_size]
        return out, tr_y[indices]

    def load_val(indices, epoch):
        idx = np.asarray(indices, int)
        return va_x[idx], va_y[idx]

    return Data(Split(len(tr_y), load_train), Split(len(va_y), load_val), [str(c) for c in range(10)])


# ----------------------------------------------------------------------------- ImageFolder


def _image_files(class_dir: str, blocked: set[str]) -> list[str]:
    """The image paths under `class_dir`, following symbolic links but never into a loop.

    A linked directory is skipped when its real path was already walked, is another class's
    folder (`blocked`), or is an ancestor of the directory linking it (`ln -s .. loop`):
    followed, those would repeat images without end, or label another class's images as this one.
    """
    visited, found = set(), []

    def unreadable(e: OSError) -> None:  # os.walk skips such a folder silently, and its images with it
        warnings.warn(f"skipping unreadable folder {e.filename}: {e.strerror or e}; its images are left out "
                      "(check its permissions)", stacklevel=4)

    for dirpath, dirnames, files in os.walk(class_dir, followlinks=True, onerror=unreadable):
        real = os.path.realpath(dirpath)
        visited.add(real)
        keep = []
        for d in sorted(dirnames):
            sub = os.path.realpath(os.path.join(dirpath, d))
            if not (sub in visited or sub in blocked or (real + os.sep).startswith(sub + os.sep)):
                keep.append(d)
                visited.add(sub)  # claimed now: a second link to it, met later, is skipped
        dirnames[:] = keep
        found += [(dirpath, f) for f in files if f.lower().endswith(IMG_EXTENSIONS)]
    # The order of paths, not of the walk: the held-out split depends on it.
    return [os.path.join(d, f) for d, f in sorted(found)]


def _scan(root: str, name: str, seen: set | None = None, *,
          held_out: bool = False) -> tuple[list[str], list[tuple[str, int]], int]:
    """Classes, readable (path, label) samples and the number of unreadable files of a folder.

    `held_out`: the folder is val/ beside train/, whose classes it must have, each with images.

    A file reached twice (symbolic or hard links) is a sample once: in the class folder that really
    holds it, else the first to reach it. `seen` holds the files already taken (train/'s, when
    scanning val/), so no file is in both splits.
    """
    from PIL import Image

    if not os.path.isdir(root):
        raise ConfigError(f"`{name}` (={root}) is not a directory; pass an ImageFolder directory "
                          "(one sub-folder of images per class)")
    seen = set() if seen is None else seen
    classes = sorted(_subfolders(root))
    class_dirs = [os.path.realpath(os.path.join(root, c)) for c in classes]
    blocked = {os.path.realpath(root), *class_dirs}  # never entered through a link from a class folder
    candidates = [(path, label) for label, (cls, real) in enumerate(zip(classes, class_dirs))
                  for path in _image_files(os.path.join(root, cls), blocked - {real})]
    # One sample per real file: a file linked (itself, or a folder above it) into another class
    # folder belongs to the class folder that really holds it (then a class folder that is itself
    # a link loses, as does a link to the file itself), else to the first path reaching it.
    folder_links = {label for label, c in enumerate(classes) if os.path.islink(os.path.join(root, c))}

    def rank(i: int) -> tuple[bool, bool, bool]:
        path, label = candidates[i]
        return (os.path.realpath(path).startswith(class_dirs[label] + os.sep), label not in folder_links,
                not os.path.islink(path))

    owner: dict[object, int] = {}
    for i, (path, _) in enumerate(candidates):
        real = _identity(path)
        if real in seen:  # taken by the other split
            continue
        j = owner.get(real)
        if j is None or rank(i) > rank(j):
            owner[real] = i
    seen.update(owner)
    repeated = len(candidates) - len(owner)
    samples, skipped = [], 0
    for path, label in (candidates[i] for i in sorted(owner.values())):
        try:
            with Image.open(path) as im:
                im.verify()
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped
            # PNG's verify() checks every chunk's CRC and the IEND chunk, past the header: a PNG
            # with a bad checksum or no IEND, which decodes exactly (and torchvision trains on),
            # was skipped. Kept when it decodes.
            if not _decodes(path):
                warnings.warn(f"skipping unreadable image {path}: {e}", stacklevel=2)
                skipped += 1
                continue
        samples.append((path, label))
    if repeated:
        warnings.warn(f"{repeated} image path(s) in {root} lead to a file already taken (symbolic or hard links): each file "
                      "is used once", stacklevel=2)
    if not samples:
        loose = sum(e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS) for e in os.scandir(root))
        if loose and not classes:  # "holds no images" would be false: they are not in class folders
            raise ConfigError(f"`{name}` (={root}) holds {loose} image(s) but no class sub-folders: ImageFolder "
                              "labels an image by the sub-folder holding it; move them into one sub-folder per class")
        raise ConfigError(f"`{name}` (={root}) holds no images: expected one sub-folder per class with "
                          f"{', '.join(IMG_EXTENSIONS)} files in it")
    has_images = {label for _, label in samples}
    used = sorted(has_images)
    empty = [c for i, c in enumerate(classes) if i not in has_images]
    if empty and (len(used) >= 2 or held_out):
        # A class the model could never learn, which would also shift every label after it;
        # torchvision's ImageFolder refuses such folders too. In val/ removing the folder is no
        # way out (train/ has the class), and one class left was "a single class" there.
        linked = _links_only(candidates, owner, seen, classes, empty)
        what = (f"no images of their own: {linked}" if linked else
                f"no readable images ({', '.join(IMG_EXTENSIONS)})")
        fix = (f"add held-out images of each (e.g. move a few from train/): {os.path.basename(root)}/ needs every "
               "class of train/, as torchvision's ImageFolder does" if held_out else "add images or remove the folder(s)")
        raise ConfigError(f"`{name}` (={root}): class folder(s) {', '.join(map(repr, empty[:5]))} hold {what}; {fix}")
    if len(used) < 2 and not held_out:  # val/'s classes are compared with train/'s instead
        linked = _links_only(candidates, owner, seen, classes, empty)
        raise ConfigError(f"`{name}` (={root}) has images of a single class ({classes[used[0]]!r})"
                          f"{'; ' + linked if linked else ''}; classification needs at least 2 class sub-folders "
                          "with images")
    return classes, samples, skipped


def _links_only(candidates: list[tuple[str, int]], owner: dict, seen: set, classes: list[str],
                empty: list[str]) -> str | None:
    """Why class folders in `empty` that do hold image files have no samples: each of their files
    is another class folder's (a link, or the folder itself links to that class), or the other
    split's (in `seen` but owned by no path of this split). Said, since "hold no readable images"
    of a folder full of images misleads."""
    others: dict[str, set[str]] = {}
    for i, (path, label) in enumerate(candidates):
        if classes[label] in empty:
            real = _identity(path)
            j = owner.get(real)
            other = repr(classes[candidates[j][1]]) if j is not None and j != i else \
                "the training split" if real in seen else None
            if other:
                others.setdefault(classes[label], set()).add(other)
    if not others:
        return None
    said = [f"{c!r} only links to the images of {' and '.join(sorted(o))}" for c, o in others.items()]
    return f"{', '.join(said[:5])} (each file is one sample, with one label)"


def _identity(path: str) -> object:
    """What makes two paths the same file: its device and inode (a hard link is another path to
    the same inode, and a val/ image hard-linked into train/ would leak into the held-out
    accuracy just as a symbolic link would); its real path where it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.realpath(path)
    return (st.st_dev, st.st_ino)


def _decodes(path: str) -> bool:
    """Whether Pillow decodes the image at `path` (the whole of it, as a training step would)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
    except Exception:  # noqa: BLE001 - any failure means no
        return False
    return True


@dataclasses.dataclass
class _Undecodable:
    """What a worker returns, in place of an image or a batch, for a file that fails to decode.

    Raised there, the error would reach the trainer as torch's re-raise: the worker's whole
    traceback as its message, and no path. Returned, it becomes one `ConfigError` here.
    """

    path: str
    reason: str
    unreadable: bool = False  # the file itself (gone, forbidden, an I/O error), not its data

    def error(self) -> ImageError:
        if self.unreadable:
            return ImageError(f"`--data`: image {self.path} cannot be read ({self.reason}), though it could when the "
                              "run started; restore it (or its permissions), or remove it, then rerun", self)
        return ImageError(f"`--data`: image {self.path} cannot be decoded past its header ({self.reason}); remove "
                          "it, or re-encode it (open and save it again), then rerun", self)


class ImageError(ConfigError):
    """An image of `--data` that failed to load after the scan (`_Undecodable`). A training run
    checkpoints the last step it finished, then tells what continues from there (`after`); a run
    of several processes cannot, and tells what continues from its latest checkpoint (`unsaved`)."""

    def __init__(self, message: str, bad: _Undecodable):
        super().__init__(message)
        self.bad = bad

    def after(self, step: int, workdir: str, evaluating: int | None = None) -> ImageError:
        """This error for a run checkpointed at `step`: "then rerun" started over, and removing
        the image changes `--data`, which --resume refuses, so that advice never continued.
        `evaluating`: the epoch (from 0) whose evaluation failed; `step` ends its training, and
        --resume evaluates it before training on."""
        if evaluating is None:
            saved, then = f"the run is checkpointed at step {step}", "continue from there"
        else:
            saved = (f"the run is checkpointed at step {step}, the end of epoch {evaluating + 1}'s training (its "
                     "evaluation did not finish)")
            then = f"evaluate epoch {evaluating + 1} and continue from there"
        return self._continue(saved, then, workdir, "the weights", evaluating is not None)

    def unsaved(self, latest: int | None, workdir: str, held_out: bool = False) -> ImageError:
        """This error for a run of several processes, which cannot checkpoint where it failed: the
        other processes wait for this one in the step's (or the evaluation's) collectives, and a
        checkpoint needs them all. It continues from `latest`, the run's latest checkpoint (None:
        there is none, and the run starts over). `held_out`: the image failed an evaluation."""
        if latest is None:
            fix = ("restore it (or its permissions), or remove it" if self.bad.unreadable else
                   "remove it, or re-encode it (open and save it again)")
            return ImageError(f"{self._what(held_out)}; no checkpoint was written yet: {fix}, then rerun", self.bad)
        saved = ("the other processes of this run wait for this one in a collective, so it could not be "
                 f"checkpointed here; its latest checkpoint is step {latest}")
        return self._continue(saved, "continue from there (the steps after it are trained again)", workdir,
                              "that checkpoint's weights", held_out)

    def _what(self, held_out: bool) -> str:
        bad = self.bad
        held = ", held out for evaluation," if held_out else ""
        return (f"`--data`: image {bad.path}{held} " +
                (f"cannot be read ({bad.reason}), though it could when the run started" if bad.unreadable else
                 f"cannot be decoded past its header ({bad.reason})"))

    def _continue(self, saved: str, then: str, workdir: str, weights: str, held_out: bool) -> ImageError:
        fix = ("restore it (or its permissions)" if self.bad.unreadable else "re-encode it (open and save it again)")
        return ImageError(f"{self._what(held_out)}; {saved}: {fix} and rerun with --resume to {then}; or remove it "
                          f"and train a new --workdir with --init {shell_word(workdir)} to keep {weights} (a removed "
                          "image changes --data, which --resume refuses)", self.bad)


class _Folder:
    """A map-style dataset over `(path, label)`, keyed by `(epoch, index)` for reproducibility."""

    def __init__(self, samples, transform, seed):
        self.samples, self.transform, self.seed = samples, transform, seed

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        import torch
        from PIL import Image

        epoch, index = key
        copy, index = divmod(index, len(self.samples))  # a --ra-sampler repeat (`ra_epoch_order`)
        path, label = self.samples[index]
        try:
            with Image.open(path) as im:
                img = _rgb(im)
        except Exception as e:  # noqa: BLE001 - truncated or corrupt data behind a valid header
            first = (str(e).strip().splitlines() or [""])[0]
            # An errno is the system's refusal; PIL's decoding errors are OSErrors without one.
            gone = isinstance(e, OSError) and e.errno is not None
            return _Undecodable(path, f"{type(e).__name__}: {first[:200]}", gone), label
        # torchvision's random transforms draw from torch's global RNG: seeding it per example
        # (inside the worker) makes the crop a function of (seed, epoch, index) alone.
        torch.manual_seed(example_seed(self.seed, epoch, index, copy))
        return self.transform(img).permute(1, 2, 0).numpy(), label


def _rgb(im):
    """`im.convert("RGB")`, but 16-bit greyscale keeps its high byte, as Pillow reads 16-bit RGB.

    Pillow clips 16-bit grey at 255 instead (and opens 16-bit PNG and TIFF as `I;16`, 16-bit
    PGM as `I`): torchvision's ImageFolder trains on white images (pytorch/vision#2218).
    """
    from PIL import Image

    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N") or (im.mode == "I" and im.format in ("PNG", "PPM")):
        grey = np.clip(np.asarray(im).astype(np.int64) >> 8, 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    return im.convert("RGB")


def _collate(items):
    bad = next((x for x, _ in items if isinstance(x, _Undecodable)), None)
    if bad is not None:
        return bad
    return np.stack([x for x, _ in items]).astype(np.float32), np.array([y for _, y in items], np.int32)


def _init_worker(_worker_id: int, showwarning=None) -> None:
    """DataLoader workers leave SIGINT/SIGTERM to the training process, and show warnings as
    it does.

    Ctrl-C reaches the whole process group, and schedulers signal every process of a job: the
    trainer checkpoints the step in progress before stopping (`_loop._StopRequests`), and the
    workers must still be serving it. They end when the loader shuts them down or the trainer
    exits (torch's workers watch their parent: the trainer, or the forkserver that exits with it).
    Workers start with Python's warning display (spawned, or forked from a fresh forkserver): a
    PIL warning raised while decoding printed two raw lines beside the CLI's one-line
    `jaxport: warning: ...`.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if showwarning is not None:
        warnings.showwarning = showwarning


@contextlib.contextmanager
def _signals_blocked(workers: int):
    """SIGINT and SIGTERM blocked in this thread while it starts `workers`, which inherit the mask.

    `_init_worker` ignores them only once a worker has imported torch and torchvision (seconds
    after it starts, when spawned): a Ctrl-C in between (as the first epoch or evaluation starts) printed
    every worker's KeyboardInterrupt traceback, and failed the loader. Blocked in this thread
    only, a signal still reaches the trainer through its other threads, or on unblocking.
    The forkserver the workers are forked from (`_worker_context`) is started by the first of
    them, so under the mask too, and keeps it: a SIGTERM to the process group (a scheduler's)
    would end the server, and torch's workers stop once their parent is gone, while the trainer
    still needs them for the step it checkpoints.
    """
    if not workers or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    # Started first: starting, it unblocks both signals in this thread (rather than restoring).
    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# What a DataLoader worker runs: imported once by the forkserver the workers are forked from.
_WORKER_MODULES = ("torch", "torch.utils.data", "torchvision.transforms", "PIL.Image", "PIL.PngImagePlugin",
                   "PIL.JpegImagePlugin", "jaxport.train._data", "jaxport.train._presets")


def _worker_context():
    """How DataLoader workers start: on Linux, forked from multiprocessing's forkserver, which
    has imported `_WORKER_MODULES`; elsewhere spawned.

    Spawned, every worker imported torch and torchvision itself, ~5 s of CPU each: the 4 workers
    of a 2-core run (2 per split) took ~20 s of CPU to start, before any image was read (a
    2-epoch run on a 60-image folder: 45-54 s of CPU spawned, 33-38 s forked from the server,
    2026-12-07). A forked worker starts in milliseconds and shares the server's memory: two
    splits' 2 workers took 1,718 MiB (PSS) spawned, 579 MiB with the server. Never a plain fork
    of the trainer: jax's threads make that unsafe. The server is a fresh interpreter that
    imports no jax; it lives as long as this process (multiprocessing's one per process, also
    used by later runs) and stops when it exits. Not on macOS, where forking a process that has
    loaded the system's frameworks is unsafe (why Python spawns there by default). Its preload
    replaces multiprocessing's default one, `__main__`: the forkserver would run the calling
    script.
    """
    import multiprocessing

    if not sys.platform.startswith("linux") or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_WORKER_MODULES))
    return context


def _worker_init_fn():
    """`_init_worker` with this process's warning display, when it can travel to a worker."""
    try:
        pickle.dumps(warnings.showwarning)
    except Exception:  # noqa: BLE001 - e.g. a lambda: the workers keep Python's display
        return _init_worker
    return functools.partial(_init_worker, showwarning=warnings.showwarning)


def refuse_in_worker_start(call: str) -> None:
    """Raises when `call` runs while a spawned process (a DataLoader worker) starts.

    Workers are spawned, or forked from a forkserver (never from the trainer: jax's threads make
    that unsafe), so each runs the script that started the loader again, as Python's
    `multiprocessing` does for both, before it serves any batch. A script
    that calls `train` at its top level, with no `if __name__ == "__main__":` guard, then trained
    again in every worker: that failed on the workdir's lock, the parent reported only that "a
    DataLoader worker exited unexpectedly", and nothing named the missing guard. (Python's own
    check, `multiprocessing.spawn._check_not_importing_main`, reads the same flag.)
    """
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ConfigError(f"{call} ran while a data-loading worker process started: loading --data's images "
                          "spawns worker processes, and each runs the calling script again (as Python's "
                          "multiprocessing does); put the script's work under `if __name__ == \"__main__\":`, "
                          "or load in the main process with workers=0")


class _Batches:
    """A persistent loader's batch sampler: the keyed batches of the stream it serves now."""

    def __init__(self):
        self.batches: list[list[tuple[int, int]]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


# The shutdowns of the live workers (`_watch`), by id of the torch iterator that holds them.
_OPEN: dict[int, weakref.finalize] = {}


@functools.cache
def _register_close_at_exit() -> None:
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    """Shuts down the workers nobody closed, as the interpreter exits: torch leaves them to
    multiprocessing then, which sends them the SIGTERM they ignore (`_init_worker`) and joins
    them, without end. Registered after torch (atexit runs the last registered first), so this
    runs while torch can still shut them down."""
    for shutdown in list(_OPEN.values()):
        shutdown()


def _shut_down(iterator) -> None:
    _OPEN.pop(id(iterator), None)
    iterator._shutdown_workers()


def _watch(owner, iterator) -> weakref.finalize:
    """Shuts down the workers of torch's `iterator` once, at the first of: the returned
    finalizer called, `owner` collected, or the interpreter's exit (`_close_at_exit`).

    Not left to the iterator's own `__del__`: an owner dropped in a reference cycle took the
    iterator into the cyclic collector's garbage with it, and the collector runs the weakref
    callbacks of multiprocessing's queues before any `__del__`. Those stopped the queues' feeder
    threads, so the stop message torch's shutdown then queued never reached the workers: they
    stayed, idle, and the interpreter's exit hung joining them (seen after pytest's own
    collection at the end of a session). Held here, the iterator is never garbage itself."""
    _register_close_at_exit()  # after torch's handlers (imported by now): runs before them
    shutdown = weakref.finalize(owner, _shut_down, iterator)
    shutdown.atexit = False  # `_close_at_exit` runs it: weakref's own exit hook may come after multiprocessing's
    _OPEN[id(iterator)] = shutdown
    return shutdown


class _Loader:
    """One split's DataLoader, whose worker processes, spawned by its first stream, serve every
    later stream of the split (each epoch's training, or each evaluation) until `close()`.

    Spawning the workers took ~4 s on 2 cores (each imports torch, torchvision and PIL): a
    loader per stream paid it twice an epoch. Streams take the workers in turn; one started
    while another is open (not yet exhausted or closed) gets a loader of its own, shut down when
    it ends. Without workers, each stream loads in this process, as it always did.
    """

    def __init__(self, dataset: _Folder, workers: int):
        self.dataset, self.workers = dataset, workers
        self.sampler = _Batches()
        self.loader = None  # the persistent DataLoader, from the first stream to `close()`
        self.iterator = None  # its iterator, which holds the workers
        self.shutdown = None  # the workers' shutdown (`_watch`)
        self.busy = False  # a stream is reading the workers' batches

    def _data_loader(self, batch_sampler, persistent: bool):
        import torch.utils.data as tud

        return tud.DataLoader(self.dataset, batch_sampler=batch_sampler, num_workers=self.workers,
                              collate_fn=_collate, worker_init_fn=_worker_init_fn() if self.workers else None,
                              prefetch_factor=4 if self.workers else None, persistent_workers=persistent,
                              # jax runs threads: a fork of this process could deadlock.
                              multiprocessing_context=_worker_context() if self.workers else None)

    def stream(self, batches: list[list[tuple[int, int]]]) -> Iterator:
        """The collated `batches` of `(epoch, index)` keys, in order."""
        if not self.workers or self.busy:
            yield from self._own_loader(batches)
            return
        self.busy = True
        try:
            try:
                self.sampler.batches = batches  # read by iter() below
                if self.loader is None:
                    self.loader = self._data_loader(self.sampler, persistent=True)
                    with _signals_blocked(self.workers):
                        self.iterator = iter(self.loader)  # starts the workers
                    self.shutdown = _watch(self, self.iterator)
                else:
                    # Later streams: the same workers, told to start over. Batches a stream closed
                    # mid-epoch left queued are loaded, and dropped, first.
                    iter(self.loader)
            except BaseException:
                self.close()
                raise
            iterator = self.iterator
            while True:
                if self.iterator is not iterator:
                    raise RuntimeError("the split's loader was closed while a stream was reading it; "
                                       "start a new stream")
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                except BaseException:
                    # Torch's iterator failed mid-fetch (a worker gone, a second Ctrl-C): it is
                    # never started over; the next stream spawns new workers.
                    self.close()
                    raise
                yield batch
        finally:
            self.busy = False

    def _own_loader(self, batches):
        loader = self._data_loader(batches, persistent=False)
        with _signals_blocked(self.workers):
            it = iter(loader)  # starts the workers, if any
        # `loader` is this generator's alone (torch's iterator does not hold it): collected with
        # the generator, it shuts the workers down, as an abandoned stream's `_Loader` does.
        shutdown = _watch(loader, it) if self.workers else None
        try:
            yield from it
        finally:
            # Now, not when garbage collection finds the iterator: at exit, torch leaves its
            # workers to multiprocessing, whose SIGTERM they ignore (`_init_worker`),
            # and joining them would hang. Closing this generator (or an error) lands here.
            if shutdown is not None:
                shutdown()

    def close(self) -> None:
        """Shuts the workers down now (joined: no process is left), if they were started."""
        shutdown, self.shutdown, self.iterator, self.loader = self.shutdown, None, None, None
        if shutdown is not None:
            shutdown()


def _torch_split(samples, transform, seed, workers) -> Split:
    dataset = _Folder(samples, transform, seed)
    loader = _Loader(dataset, workers)

    def load(indices, epoch):
        # A one-batch DataLoader per call would respawn workers; instead callers use `stream`.
        batch = _collate([dataset[(epoch, int(i))] for i in indices])
        if isinstance(batch, _Undecodable):
            raise batch.error()
        return batch

    def stream(batches: Iterator[Sequence[int]], epoch: int):
        # closing(): closed mid-epoch (or failing), this stream hands the workers back at once.
        with contextlib.closing(loader.stream([[(epoch, int(i)) for i in b] for b in batches])) as loaded:
            for batch in loaded:
                if isinstance(batch, _Undecodable):
                    raise batch.error()
                yield batch

    return Split(len(samples), load, stream, loader.close)


# Folder names that mean a split, not a class (any case).
_SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "eval"})


def _subfolders(root: str) -> list[str]:
    """The folders `_scan` would take as classes (hidden ones are not)."""
    return [e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")]


def image_folder(root: str, image_size: int = 224, seed: int = 0, val_fraction: float = 0.1,
                 workers: int | None = None, transforms: tuple[Callable, Callable] | None = None) -> Data:
    """A torchvision ImageFolder directory with the ImageNet recipe.

    By default torchvision's `ClassificationPresetTrain(crop_size=image_size)` and
    `ClassificationPresetEval(crop_size=image_size, resize_size=round(image_size * 256 / 224))`
    (`_presets`): train `RandomResizedCrop(image_size)`, `RandomHorizontalFlip()`; eval
    `Resize(round(image_size * 256 / 224))`, `CenterCrop(image_size)`; both then `PILToTensor()`,
    `ConvertImageDtype(torch.float)` and `Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224,
    0.225))`. `transforms`: another (train, eval) pair of PIL image -> CHW tensor callables
    (`_presets.transforms`), drawing only from torch's global RNG. A `root` with a
    `train/` sub-folder is split torchvision's way: `train/` and the held-out `val/` (or
    `validation/` or `valid/`), each with one sub-folder per class (a `train/` holding images
    and no sub-folders, with no held-out folder beside it, is a class like any other);
    otherwise the sub-folders are the classes and a fixed stratified `val_fraction` of the
    images is held out (rounded per class, never a class's last image). Folders named `.*` (`.ipynb_checkpoints`) are not
    classes, where torchvision's ImageFolder makes them one. Images whose header cannot be read
    (or, for PNG, whose chunks fail Pillow's `verify` and that do not decode) are skipped
    with a warning and counted; symbolic links are followed, and a file reached twice (symbolic or
    hard links) is used once, in the class folder that really holds it. Images are read as torchvision's loader
    reads them (`convert("RGB")`), except 16-bit greyscale, which keeps its high byte where
    that loader clips it to white.

    Raises:
      ConfigError: a missing or empty directory, a class folder without images, a single class,
        a `train/` folder without exactly one of `val/`, `validation/`, `valid/` beside it, or
        only split-named folders otherwise (`Train/` + `Val/`, `training/` + `validation/`),
        which would have been taken as two classes.
        Loading an image that fails to decode past its header, or that can no longer be read,
        raises it too, naming the file.
    """
    refuse_in_worker_start("jaxport.train.image_folder()")
    _check_split(image_size, seed, val_fraction)
    from ._presets import eval_transform, train_transform

    train_tf, val_tf = transforms or (train_transform(image_size, mean=MEAN.tolist(), std=STD.tolist()),
                                      eval_transform(image_size, round(image_size * 256 / 224), mean=MEAN.tolist(),
                                                     std=STD.tolist()))
    workers = min(4, usable_cpus()) if workers is None else workers

    train_dir = os.path.join(root, "train")
    if os.path.isdir(train_dir) and not any(os.path.isdir(os.path.join(root, n)) for n in VAL_NAMES) \
            and not _subfolders(train_dir):
        # A class named "train" (bus/, car/, train/), not a split: train/ holds images, no classes.
        train_dir = None
    if train_dir is not None and os.path.isdir(train_dir):
        held_out = [n for n in VAL_NAMES if os.path.isdir(os.path.join(root, n))]
        if not held_out:
            raise ConfigError(f"`--data` (={root}) has a train/ split folder but no val/ (nor validation/, valid/) "
                              f"beside it; put the held-out images in {os.path.join(root, 'val')} (one sub-folder "
                              f"per class, as in train/), or pass --data {train_dir} to hold out {val_fraction:.0%} "
                              "of it")
        if len(held_out) > 1:
            raise ConfigError(f"`--data` (={root}) has train/ and several held-out folders "
                              f"({', '.join(h + '/' for h in held_out)}); keep one of them")
        seen: set = set()
        val_name = held_out[0]
        classes, train_samples, skipped = _scan(train_dir, "--data", seen)
        val_classes, val_samples, vskipped = _scan(os.path.join(root, val_name), "--data", seen, held_out=True)
        if val_classes != classes:
            only_train, only_val = sorted(set(classes) - set(val_classes)), sorted(set(val_classes) - set(classes))
            raise ConfigError(f"`--data` (={root}): train/ and {val_name}/ have different class folders (only in "
                              f"train/: {', '.join(only_train) or 'none'}; only in {val_name}/: "
                              f"{', '.join(only_val) or 'none'}); give both the same class sub-folders")
        skipped += vskipped
    else:
        folders = _subfolders(root)
        splits = sorted(n for n in folders if n.casefold() in _SPLIT_NAMES)
        if len(splits) >= 2 and len(splits) == len(folders):
            # Train/ + Val/, training/ + validation/: taken as two classes, the split's name
            # became every image's label and the real classes (nested folders) were lost.
            raise ConfigError(f"`--data` (={root}) holds split folders ({', '.join(n + '/' for n in splits)}), not "
                              "class folders; jaxport reads the splits from train/ and val/ (or validation/, "
                              "valid/), each with one sub-folder per class: rename them so, or pass the training "
                              "split's folder alone to hold out part of it")
        classes, samples, skipped = _scan(root, "--data")
        labels = np.array([y for _, y in samples])
        rng = np.random.default_rng(1234)
        is_val = np.zeros(len(samples), bool)
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            # Rounded (floored, classes under 1 / val_fraction images held out none: 9 images in
            # each of 100 classes were "too few images to hold out 10%"), and never a whole class.
            is_val[idx[: min(int(np.floor(val_fraction * len(idx) + 0.5)), len(idx) - 1)]] = True
        train_samples = [s for s, v in zip(samples, is_val) if not v]
        val_samples = [s for s, v in zip(samples, is_val) if v]
        if not val_samples:
            raise ConfigError(f"`--data` (={root}) has too few images to hold out {val_fraction:.0%} "
                              "for validation; add images or provide train/ and val/ sub-folders")
    if skipped:  # the one summary line (each file was named as it was skipped)
        warnings.warn(f"{skipped} unreadable image(s) skipped in {root}", stacklevel=2)
    return Data(_torch_split(train_samples, train_tf, seed, workers), _torch_split(val_samples, val_tf, seed, workers),
                classes, skipped, functools.partial(_fingerprint, root, train_samples, val_samples))


def _fingerprint(root: str, *splits: list[tuple[str, int]], sizes: int = 256) -> dict[str, str]:
    """Digests of each split's files, in one pass: "files", of their paths (relative to `root`),
    labels and the sizes of up to `sizes` of them, evenly spread, on which two processes reading
    other copies of a data set (each machine mounts its own) agree unless the copies differ;
    "names", of the paths and labels alone, which an image replaced in place (re-encoded) keeps.
    Sizes of a sample only, since a stat per file of a million-image set on a network file system
    takes minutes."""
    files, names = hashlib.sha256(), hashlib.sha256()
    for split in splits:
        for h in (files, names):
            h.update(b"split;")
        for path, label in split:
            # os.fsencode: a name that is not UTF-8 (undecodable bytes) is a str .encode() refuses
            entry = os.fsencode(os.path.relpath(path, root)) + f":{label};".encode()
            files.update(entry)
            names.update(entry)
        for path, _ in split[::max(1, len(split) // sizes)][:sizes]:
            files.update(f"{os.path.getsize(path)};".encode())
    return {"files": files.hexdigest()[:16], "names": names.hexdigest()[:16]}
