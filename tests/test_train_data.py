"""ImageFolder loading (`jaxport.train._data`) on awkward folders, each test a regression named
after what broke. Images are a few pixels and `image_size` 16, so each test takes seconds.
"""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets.folder import pil_loader

from jaxport._errors import ConfigError
from jaxport.train import _data
from tests.helpers import write_images

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _images(folder, n, start=0, size=(10, 12)):
    write_images(folder, n, start, size)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_a_folder_linked_from_another_class_keeps_its_images_in_their_own_class(tmp_path):
    """`cat/dogs -> dog/more` labelled dog/more's images cat, and took them out of dog: only a
    link to a file lost to the file itself, not a path through a linked folder."""
    root = tmp_path / "data"
    for c in ("cat", "dog"):
        _images(root / c, 3)
        _images(root / c / "more", 3, start=10)
    os.symlink(root / "dog" / "more", root / "cat" / "dogs")
    with pytest.warns(UserWarning, match="3 image path"):
        classes, samples, _ = _data._scan(str(root), "--data")
    reals = [os.path.realpath(p) for p, _ in samples]
    assert len(reals) == len(set(reals)) == 12
    assert [sum(y == k for _, y in samples) for k in range(2)] == [6, 6]
    assert all(r.startswith(os.path.realpath(root / classes[y]) + os.sep) for r, (_, y) in zip(reals, samples))


def test_an_unreadable_folder_is_named(tmp_path, monkeypatch):
    """os.walk skips a folder it cannot list without a word: its images were silently left
    out, and an unreadable class folder was said to "hold no readable images"."""
    root = tmp_path / "data"
    for c in ("a", "b", "c"):
        _images(root / c, 10)
    _images(root / "b" / "locked", 5, start=10)
    locked = {str(root / "b" / "locked"), str(root / "c")}
    if os.geteuid() == 0:  # root lists folders whatever their mode: refuse as the kernel would
        scandir = os.scandir
        monkeypatch.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(
            PermissionError(13, "Permission denied", os.fspath(p))) if os.fspath(p) in locked else scandir(p))
    for p in locked:
        os.chmod(p, 0)
    try:
        with pytest.warns(UserWarning) as record:
            with pytest.raises(ConfigError, match=r"class folder\(s\) 'c' hold no readable images"):
                _data.image_folder(str(root), workers=0)
        for p in locked:
            assert any(f"skipping unreadable folder {p}: Permission denied; its images are left out" in str(w.message)
                       for w in record), [str(w.message) for w in record]
    finally:
        for p in locked:
            os.chmod(p, 0o755)


def test_16_bit_greyscale_trains_as_its_8_bit_copy(tmp_path):
    """Pillow opens 16-bit grey PNG and TIFF as `I;16` (PGM as `I`) and `convert("RGB")` clips
    it at 255: every such image was trained on as white, as in torchvision's ImageFolder
    (pytorch/vision#2218), while 16-bit RGB keeps its high byte. Now grey does too:
    `v * 257 >> 8 == v`, so a 16-bit image loads exactly as its 8-bit copy."""
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        for i, ext in enumerate(("png", "tif", "pgm") * 2):
            v = rng.integers(0, 256, (10, 12), dtype=np.uint16)
            for bits, pixels in ((8, v.astype(np.uint8)), (16, v * 257)):
                os.makedirs(tmp_path / str(bits) / c, exist_ok=True)
                Image.fromarray(pixels).save(tmp_path / str(bits) / c / f"{i}.{ext}")
    with Image.open(tmp_path / "16" / "a" / "0.png") as im:
        assert im.mode == "I;16"
    assert (np.asarray(pil_loader(str(tmp_path / "16" / "a" / "0.png"))) == 255).mean() > 0.95  # torchvision: white
    eight, sixteen = (_data.image_folder(str(tmp_path / b), image_size=16, workers=0, val_fraction=0.5)
                      for b in ("8", "16"))
    for split in ("train", "val"):
        n = getattr(eight, split).num_examples
        want, got = getattr(eight, split).load(range(n), 0), getattr(sixteen, split).load(range(n), 0)
        np.testing.assert_array_equal(got[0], want[0], err_msg=split)
        np.testing.assert_array_equal(got[1], want[1], err_msg=split)


def test_classes_smaller_than_one_over_val_fraction_hold_out_a_rounded_share(tmp_path):
    """The held-out count per class was floored: 9 images in each of 12 classes (108) were
    "too few images to hold out 10%", and 19 images held out 1 (5%)."""
    for k in range(12):
        _images(tmp_path / "nine" / f"c{k:02d}", 9, size=(4, 4))
    data = _quiet(_data.image_folder, str(tmp_path / "nine"), image_size=16, workers=0)
    assert (data.train.num_examples, data.val.num_examples) == (96, 12)
    for n in (1, 4, 5, 15, 19):
        _images(tmp_path / "sizes" / f"n{n:02d}", n, size=(4, 4))
    data = _quiet(_data.image_folder, str(tmp_path / "sizes"), image_size=16, workers=0)
    # round(0.1 n), halves up: 0, 0, 1, 2, 2
    assert (data.train.num_examples, data.val.num_examples) == (44 - 5, 5)
    data = _quiet(_data.image_folder, str(tmp_path / "sizes"), image_size=16, workers=0, val_fraction=0.9)
    assert (data.train.num_examples, data.val.num_examples) == (6, 38)  # each class keeps a training image
    assert sorted(set(data.train.load(range(6), 0)[1])) == [0, 1, 2, 3, 4]
    for c in ("a", "b"):
        _images(tmp_path / "few" / c, 4, size=(4, 4))
    with pytest.raises(ConfigError, match="too few images to hold out 10%"):  # 2 x 4 images: still none
        _data.image_folder(str(tmp_path / "few"), workers=0)


def test_the_fingerprint_takes_names_that_are_not_utf8(tmp_path):
    """A file or class name that is not UTF-8 (undecodable bytes, as Linux allows) failed the
    cross-process data check of a multi-process run with a UnicodeEncodeError."""
    root = os.fsencode(tmp_path / "data")
    try:
        for c in (b"caf\xe9", b"b"):
            folder = os.path.join(root, c)
            os.makedirs(folder)
            for i in range(10):
                Image.new("RGB", (4, 4), (i, 0, 0)).save(os.path.join(folder, b"x\xff%d.png" % i))
    except (OSError, ValueError):
        pytest.skip("this file system takes only UTF-8 names")
    data = _data.image_folder(os.fsdecode(root), image_size=16, workers=0)
    assert data.classes == ["b", "caf\udce9"]
    digest = data.fingerprint()
    assert sorted(digest) == ["files", "names"] and {len(d) for d in digest.values()} == {16}
    os.rename(os.path.join(root, b"b", b"x\xff0.png"), os.path.join(root, b"b", b"x\xfe0.png"))
    assert _data.image_folder(os.fsdecode(root), image_size=16, workers=0).fingerprint() != digest


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask") or not os.path.isdir("/proc/self"),
                    reason="POSIX signal masks and /proc")
def test_ctrl_c_while_loader_workers_start_leaves_them_serving(tmp_path):
    """Workers ignore SIGINT only once they have imported torch, seconds after they start (at
    every epoch's and evaluation's start): a Ctrl-C then printed each worker's KeyboardInterrupt
    traceback and failed the loader, so the trainer could not finish the step it checkpoints."""
    _images(tmp_path / "data" / "a", 10)
    _images(tmp_path / "data" / "b", 10)
    script = textwrap.dedent(f"""
        import os, signal, threading, time, warnings
        from jaxport.train import _data

        warnings.simplefilter("ignore")
        data = _data.image_folder({str(tmp_path / "data")!r}, image_size=16, workers=1)
        done = threading.Event()

        def interrupt_children():  # Ctrl-C reaches the whole process group; here only the descendants
            while not done.is_set():  # (workers forked from a forkserver are its children, not ours)
                parents = {{}}
                for pid in filter(str.isdigit, os.listdir("/proc")):
                    try:
                        with open(f"/proc/{{pid}}/stat") as f:
                            parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
                    except (OSError, ValueError, IndexError):
                        continue
                ours = {{os.getpid()}}
                while new := {{p for p, ppid in parents.items() if ppid in ours}} - ours:
                    ours |= new
                for pid in ours - {{os.getpid()}}:
                    os.kill(pid, signal.SIGINT)
                time.sleep(0.01)

        threading.Thread(target=interrupt_children, daemon=True).start()
        stream = data.train.stream(iter([[0, 1], [2, 3]]), 0)
        try:
            shapes = [x.shape for x, _ in stream]
        finally:
            done.set()
            stream.close()
        print("loaded", shapes)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded [(2, 16, 16, 3), (2, 16, 16, 3)]" in out.stdout
    assert "KeyboardInterrupt" not in out.stderr, out.stderr[-3000:]


def test_images_outside_class_folders_and_files_gone_since_the_scan_are_told_as_such(tmp_path):
    """A folder of images without class sub-folders was said to "hold no images"; a file
    deleted (or made unreadable) after the scan "cannot be decoded past its header", with the
    advice to re-encode it."""
    _images(tmp_path / "flat", 5, size=(4, 4))
    with pytest.raises(ConfigError, match=r"`--data` \(=\S+flat\) holds 5 image\(s\) but no class sub-folders: "
                                          "ImageFolder labels an image by the sub-folder holding it; move them"):
        _data.image_folder(str(tmp_path / "flat"), workers=0)
    for c in ("a", "b"):
        _images(tmp_path / "data" / c, 10, size=(4, 4))
    data = _data.image_folder(str(tmp_path / "data"), image_size=16, workers=0)
    gone = tmp_path / "data" / "b" / "9.png"
    gone.unlink()
    with pytest.raises(ConfigError, match=rf"image {gone} cannot be read \(FileNotFoundError: .*\), though it could "
                                          r"when the run started; restore it \(or its permissions\), or remove it"):
        data.train.load(range(data.train.num_examples), 0)


def test_digits_refuse_an_image_size_whose_upsampled_set_cannot_fit(monkeypatch):
    """--image-size 10000 upsampled all 1797 digits up front (~2 TB) until the kernel killed the
    run; it is refused before anything is allocated, with the largest size that fits."""
    monkeypatch.setattr(_data, "_available_memory", lambda: 4 * 2**30)
    with pytest.raises(ConfigError, match=r"`--image-size` \(=10000\) would need 4016\.\d GiB .* 4\.0 GiB of memory "
                                          r"is available; use --image-size 315 or less"):
        _data.digits(10000)
    assert _data.digits(8).train.num_examples > 0  # the small sizes it is meant for still load


def test_digits_refuse_images_smaller_than_the_digits():
    with pytest.raises(ConfigError, match=r"`--image-size` \(=7\) must be >= 8 .* use --image-size 8 or more"):
        _data.digits(7)


@pytest.mark.parametrize("kwargs,named", [
    ({"val_fraction": -0.1}, r"`val_fraction` \(=-0\.1\) must be a number between 0 and 1"),
    ({"val_fraction": 1.0}, r"`val_fraction` \(=1\.0\) must be a number between 0 and 1"),
    ({"val_fraction": "0.2"}, r"`val_fraction` \(='0\.2'\) must be a number"),
    ({"image_size": "32"}, r"`image_size` \(='32'\) must be an integer >= 1"),
    ({"image_size": 32.5}, r"`image_size` \(=32\.5\) must be an integer"),
    ({"seed": 1.5}, r"`seed` \(=1\.5\) must be an integer")])
def test_split_arguments_are_checked_by_both_datasets(tmp_path, kwargs, named):
    """`digits(val_fraction=-0.1)` held out 1618 of the 1797 images (a negative slice), 1.0 left
    none to train on, and a string size was a raw TypeError from deep in numpy."""
    with pytest.raises(ConfigError, match=named):
        _data.digits(**kwargs)
    _images(tmp_path / "a", 4)
    _images(tmp_path / "b", 4)
    with pytest.raises(ConfigError, match=named):
        _data.image_folder(str(tmp_path), **kwargs)


def test_digits_are_sklearns_without_importing_sklearn(monkeypatch):
    """Importing sklearn took ~1.6 s of every digits run's start; its data file is read
    directly, and sklearn's own loader is the fallback where that file is not found."""
    from sklearn.datasets import load_digits

    want = load_digits()
    images, labels = _data._load_digits()
    np.testing.assert_array_equal(images, want.images)
    np.testing.assert_array_equal(labels, want.target)
    monkeypatch.setattr(_data.importlib.util, "find_spec", lambda name: None)
    images, labels = _data._load_digits()
    np.testing.assert_array_equal(images, want.images)
    np.testing.assert_array_equal(labels, want.target)
    code = "import sys; from jaxport.train import _data; _data.digits(8); print(sorted(m for m in sys.modules if m.startswith('sklearn')))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stderr[-2000:] + out.stdout


def test_a_val_image_hard_linked_into_train_is_held_out_of_neither_twice(tmp_path):
    """Files were one sample per real path, so a hard link (another path to the same inode) from
    val/ into train/ trained on a held-out image, and one within a class counted twice."""
    root = tmp_path / "data"
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            _images(root / split / c, 3, start=0 if split == "train" else 10)
    os.link(root / "val" / "cat" / sorted(os.listdir(root / "val" / "cat"))[0], root / "train" / "cat" / "leak.png")
    os.link(root / "train" / "dog" / sorted(os.listdir(root / "train" / "dog"))[0], root / "train" / "dog" / "again.png")
    seen: set = set()
    _, train, _ = _quiet(_data._scan, str(root / "train"), "--data", seen)
    _, val, _ = _quiet(_data._scan, str(root / "val"), "--data", seen)
    inodes = [os.stat(p).st_ino for p, _ in train + val]
    assert len(inodes) == len(set(inodes)) == 12  # 6 + 6 files, two of them reached twice
    assert (len(train), len(val)) == (7, 5)  # the linked file is train/'s, which is scanned first


def test_a_class_folder_that_only_links_to_another_class_is_named_as_such(tmp_path):
    """`bird -> cat` (or val/dog -> train/dog): every file is another class's (or split's), so the
    folder has no sample, and the error said it "holds no readable images" though it is full of
    them. It says whose images they are now."""
    root = tmp_path / "data"
    for c in ("cat", "dog"):
        _images(root / c, 3, start=10 * (c == "dog"))
    os.symlink(root / "cat", root / "bird")
    with pytest.raises(ConfigError) as e:
        _quiet(_data._scan, str(root), "--data")
    assert str(e.value) == (f"`--data` (={root}): class folder(s) 'bird' hold no images of their own: 'bird' only links "
                            "to the images of 'cat' (each file is one sample, with one label); add images or remove "
                            "the folder(s)")

    split = tmp_path / "split"
    for c in ("cat", "dog"):
        _images(split / "train" / c, 3, start=10 * (c == "dog"))
    _images(split / "val" / "cat", 3, start=20)
    os.symlink(split / "train" / "dog", split / "val" / "dog")
    seen: set = set()
    _quiet(_data._scan, str(split / "train"), "--data", seen)
    with pytest.raises(ConfigError, match=r"has images of a single class \('cat'\); 'dog' only links to the images of "
                                          r"the training split \(each file is one sample, with one label\); "
                                          r"classification needs at least 2"):
        _quiet(_data._scan, str(split / "val"), "--data", seen)

    os.remove(root / "bird")  # a folder with no image files at all keeps the plain message
    (root / "bird").mkdir()
    with pytest.raises(ConfigError, match=r"class folder\(s\) 'bird' hold no readable images \(\.jpg"):
        _quiet(_data._scan, str(root), "--data")


@pytest.mark.parametrize("splits", [("training", "validation"), ("Train", "Val"), ("train_set", "Test")])
def test_split_named_folders_are_not_taken_for_two_classes(tmp_path, splits):
    """`training/` + `validation/` (or `Train/` + `Val/`) trained silently on two classes, named
    after the splits, with the real classes (the folders inside) lost."""
    for split in splits:
        for c in ("cat", "dog"):
            _images(tmp_path / split / c, 3, size=(4, 4))
    if splits[0] == "train_set":  # one split-like name is not a split layout: two classes
        data = _quiet(_data.image_folder, str(tmp_path), image_size=16, workers=0)
        assert data.classes == sorted(splits)
        return
    with pytest.raises(ConfigError, match=rf"holds split folders \({splits[0]}/, {splits[1]}/\).*train/ and val/"):
        _data.image_folder(str(tmp_path), workers=0)


def test_a_class_named_train_is_a_class(tmp_path):
    """bus/, car/, train/ (a vehicle set): train/ was taken for a split without val/, and the way
    out the error named (--data DIR/train) held no class folders."""
    for c in ("bus", "car", "train"):
        _images(tmp_path / c, 10, size=(4, 4))
    data = _quiet(_data.image_folder, str(tmp_path), image_size=16, workers=0)
    assert data.classes == ["bus", "car", "train"]
    assert (data.train.num_examples, data.val.num_examples) == (27, 3)
    _images(tmp_path / "train" / "nested", 2, size=(4, 4))  # with a sub-folder it is a split again
    with pytest.raises(ConfigError, match="has a train/ split folder but no val/"):
        _data.image_folder(str(tmp_path), workers=0)


@pytest.mark.parametrize("call", ["train", "image_folder"])
def test_a_script_without_a_main_guard_is_told_so(tmp_path, call):
    """DataLoader workers are spawned and run the calling script again: one that trains at its top
    level trained again in every worker, which failed on the workdir's lock, and the parent said
    only that a worker exited unexpectedly. A script that only loads the images is told too."""
    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 10)
    script = tmp_path / "noguard.py"
    if call == "train":
        script.write_text(
            "from jaxport.train import TrainConfig, train\n"
            f"train(TrainConfig(workdir={str(tmp_path / 'w')!r}, data={str(tmp_path / 'data')!r}, epochs=1, "
            "image_size=16, batch_size=4, workers=1, max_steps=1, progress=False))\n")
    else:
        script.write_text(
            "from jaxport.train import image_folder\n"
            f"data = image_folder({str(tmp_path / 'data')!r}, image_size=16, workers=1)\n"
            "print(next(iter(data.train.stream(iter([[0, 1]]), 0)))[0].shape)\n")
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]
    assert f"jaxport.train.{call}() ran while a data-loading worker process started" in proc.stderr
    assert "in use by another" not in proc.stderr
