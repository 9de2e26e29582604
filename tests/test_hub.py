"""Checkpoints named by URL or torchvision weights name: downloaded once into torch's cache, then
ported, verified and used as --init like any file. Served from this machine (loopback HTTP): no
network is reachable here, and what matters is what jaxport does with what arrives."""
import hashlib
import json
import os

import pytest
import torch
import torchvision

import jaxport
import torch_compat
from jaxport._args import names_a_download
from jaxport._cli import main
from jaxport._errors import CheckpointError, ConfigError
from jaxport.train._init import load_init
from tests.helpers import reference, serving


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A ResNet-18 checkpoint saved as torchvision names its downloads (`<name>-<sha256[:8]>.pth`),
    the state_dict it holds, and a served copy whose name promises another digest."""
    root = tmp_path_factory.mktemp("served")
    state_dict = reference("resnet18").state_dict()
    torch.save(state_dict, root / "tmp.pth")
    data = (root / "tmp.pth").read_bytes()
    name = f"resnet18-{hashlib.sha256(data).hexdigest()[:8]}.pth"
    (root / "tmp.pth").rename(root / name)
    (root / "resnet18-00000000.pth").write_bytes(data)  # a name whose digest this content does not have
    with serving(root) as url:
        yield url, name, state_dict


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """torch's download cache in this test's directory (`torch.hub.get_dir()` reads TORCH_HOME)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return tmp_path / "torch_home" / "hub" / "checkpoints"


def _same_weights(variables, state_dict):
    back = torch_compat.flax_to_torch(variables, "resnet18")
    assert set(back) == set(state_dict)
    for k, v in state_dict.items():
        assert torch.equal(back[k], v), k


def test_port_of_a_url_downloads_once_and_ports_it(served, hub, tmp_path, capsys):
    url, name, state_dict = served
    out = tmp_path / "r18.safetensors"
    assert main(["port", f"{url}/{name}", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"downloading {url}/{name} to {hub / name}" in said, said
    assert sorted(p.name for p in hub.iterdir()) == [name]  # no temporary left beside it
    _same_weights(jaxport.load_variables(out), state_dict)
    # Again: the cached file, not a second download (which would give it a new mtime).
    os.utime(hub / name, (0, 0))
    assert main(["port", f"{url}/{name}", "--out", str(tmp_path / "again.safetensors")]) == 0
    assert f"using {hub / name}, downloaded before from {url}/{name}" in capsys.readouterr().out
    assert os.stat(hub / name).st_mtime == 0
    # verify resolves the URL too (to the cached file)
    assert main(["verify", f"{url}/{name}", str(out), "--mode", "eval"]) == 0
    assert "verify: PASS" in capsys.readouterr().out


def test_a_torchvision_weights_name_downloads_its_url(served, hub, tmp_path, monkeypatch, capsys):
    url, name, state_dict = served
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    monkeypatch.setattr(weights.value, "url", f"{url}/{name}")  # torchvision's own URL, served here
    out = tmp_path / "r18.safetensors"
    assert main(["port", "ResNet18_Weights.DEFAULT", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"downloading ResNet18_Weights.DEFAULT ({url}/{name}) to {hub / name}" in said, said
    _same_weights(jaxport.load_variables(out), state_dict)
    # `train --init` takes the name as well: the same file, from the cache this time.
    lines = []
    variables = load_init("ResNet18_Weights.IMAGENET1K_V1", "resnet18", say=lines.append)
    assert lines == [f"using {hub / name}, downloaded before from ResNet18_Weights.IMAGENET1K_V1 ({url}/{name})"]
    _same_weights(variables, state_dict)
    with pytest.raises(ConfigError, match="holds resnet18 weights but `--arch` is resnet50; use --arch resnet18"):
        load_init("ResNet18_Weights.IMAGENET1K_V1", "resnet50", say=lines.append)


def test_a_download_that_is_not_the_promised_file_keeps_nothing(served, hub):
    url, _, _ = served
    with pytest.raises(CheckpointError, match=r"the download of '.*/resnet18-00000000\.pth' is not the file its name "
                                              r"promises \(invalid hash value.*nothing was kept"):
        torch_compat.download_checkpoint(f"{url}/resnet18-00000000.pth", progress=False, log=lambda msg: None)
    assert list(hub.iterdir()) == []


@pytest.mark.parametrize("path, expected", [
    ("/no_such_file.pth", r"cannot download '.*/no_such_file\.pth': HTTP 404 File not found; check the URL"),
    ("/", r"the URL '.*/' names no file \(its path ends in '/'\)"),
])
def test_a_url_that_serves_no_checkpoint_is_one_error(served, hub, path, expected, capsys):
    url, _, _ = served
    assert main(["port", url + path]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("jaxport: error: ")
    with pytest.raises((CheckpointError, ConfigError), match=expected):
        torch_compat.download_checkpoint(url + path, progress=False, log=lambda msg: None)
    assert not hub.exists() or list(hub.iterdir()) == []


def test_an_unreachable_server_says_the_machine_may_be_offline(hub, capsys):
    with serving(hub.parent.parent) as url:
        pass  # shut down: its port now refuses connections
    assert main(["port", f"{url}/resnet18-f37072fd.pth"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxport: error: cannot download '{url}/resnet18-f37072fd.pth' (") and err.count("\n") == 1
    assert "is this machine offline? Download it where the network is reachable and pass the file's path, or " \
           f"copy it to {hub / 'resnet18-f37072fd.pth'}" in err, err


@pytest.mark.parametrize("name, expected", [
    ("ResNet50_Weights.IMAGENET1K_V3", "ResNet50_Weights has IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT; did you mean "
                                       "ResNet50_Weights.IMAGENET1K_V2?"),
    ("resnet50_weights.imagenet1k_v2", "ResNet50_Weights has IMAGENET1K_V1, IMAGENET1K_V2, DEFAULT; did you mean "
                                       "ResNet50_Weights.IMAGENET1K_V2?"),
    ("ViT_B_16_Weights.IMAGENET1K_V1", "jaxport ports torchvision's ResNet family, whose weights are "
                                       "ResNet18_Weights.IMAGENET1K_V1, "),
])
def test_an_unknown_weights_name_lists_the_names(name, expected, hub):
    with pytest.raises(ConfigError) as e:
        torch_compat.download_checkpoint(name)
    assert str(e.value).startswith(f"'{name}' is not a file, and not torchvision weights that jaxport ports: ")
    assert str(e.value).endswith(expected) if "?" in expected else expected in str(e.value)
    assert "?" in expected or "did you mean" not in str(e.value)  # ResNet-18's weights are not ViT's
    assert not hub.exists()


def test_every_resnet_the_converter_knows_has_its_torchvision_weights_named():
    from torch_compat._hub import resnet_weights

    names = resnet_weights()
    for arch in jaxport.models.ARCHS:
        enum = torchvision.models.get_model_weights(arch)
        for w in enum:
            assert names[f"{enum.__name__}.{w.name}"] == w.url == torchvision.models.get_weight(
                f"{enum.__name__}.{w.name}").url
        assert names[f"{enum.__name__}.DEFAULT"] == enum.DEFAULT.url


def test_what_names_a_download(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert names_a_download("https://download.pytorch.org/models/resnet18-f37072fd.pth")
    assert names_a_download("http://127.0.0.1:8000/a.pth")
    assert names_a_download("ResNet50_Weights.IMAGENET1K_V2") and names_a_download("resnet50_weights.default")
    assert not names_a_download("resnet50.pth") and not names_a_download("ftp://host/a.pth")
    assert not names_a_download("weights/ResNet50_Weights.IMAGENET1K_V2")
    assert not names_a_download("model_weights.pth") and not names_a_download("EMA_Weights.safetensors")
    (tmp_path / "ResNet50_Weights.IMAGENET1K_V2").write_bytes(b"")  # a file of that name is that file
    assert not names_a_download("ResNet50_Weights.IMAGENET1K_V2")
    # Not a download: a missing path is said as load_state_dict says it, and nothing is fetched.
    with pytest.raises(CheckpointError, match=r"^checkpoint 'my_weights.pth' does not exist, and is not an http\(s\) "
                                              "URL or a torchvision weights name"):
        torch_compat.download_checkpoint("my_weights.pth")
    with pytest.raises(CheckpointError, match=r"'ResNet50_Weights.IMAGENET1K_V2' is a local file, not a download"):
        torch_compat.download_checkpoint("ResNet50_Weights.IMAGENET1K_V2")
    with pytest.raises(ConfigError, match=r"`name_or_url` \(=PosixPath\('a.pth'\)\) must be a str"):
        torch_compat.download_checkpoint(tmp_path.__class__("a.pth"))


def test_a_port_by_weights_name_records_what_torchvision_knows_of_them(served, hub, tmp_path, monkeypatch, capsys):
    """The class names, the evaluation transform, the accuracy and the recipe that torchvision
    keeps beside the weights go into the port's header, for a program without torchvision."""
    url, name, _ = served
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    root = tmp_path / "served1000"
    root.mkdir()
    torch.save(torchvision.models.resnet18().state_dict(), root / "resnet18-imagenet.pth")  # 1000 classes
    with serving(root) as url1000:
        monkeypatch.setattr(weights.value, "url", f"{url1000}/resnet18-imagenet.pth")
        out = tmp_path / "r18.safetensors"
        assert main(["port", "ResNet18_Weights.DEFAULT", "--out", str(out)]) == 0
    meta = jaxport.read_metadata(out)
    t = weights.transforms()
    assert meta["weights"] == "ResNet18_Weights.IMAGENET1K_V1"  # DEFAULT, resolved
    assert json.loads(meta["categories"]) == weights.meta["categories"]
    assert json.loads(meta["preprocess"]) == {
        "resize_size": t.resize_size, "crop_size": t.crop_size, "interpolation": "bilinear", "antialias": True,
        "mean": t.mean, "std": t.std}
    assert json.loads(meta["metrics"]) == weights.meta["_metrics"] and meta["recipe"] == weights.meta["recipe"]
    said = capsys.readouterr().out
    assert ("weights: ResNet18_Weights.IMAGENET1K_V1 (1000 categories, ImageNet-1K acc@1 69.758, evaluated at resize "
            "256, crop 224): recorded in the port's metadata") in said, said
    # A backbone has no classifier for them to name; nor has a file of 10 classes at their URL.
    assert main(["port", "ResNet18_Weights.IMAGENET1K_V1", "--backbone-only", "--out", str(tmp_path / "b.st")]) == 0
    assert "weights: ResNet18_Weights.IMAGENET1K_V1 (evaluated at resize 256" in capsys.readouterr().out
    meta = jaxport.read_metadata(tmp_path / "b.st")
    assert meta["weights"] == "ResNet18_Weights.IMAGENET1K_V1" and "categories" not in meta and "metrics" not in meta
    monkeypatch.setattr(weights.value, "url", f"{url}/{name}")
    assert main(["port", "ResNet18_Weights.IMAGENET1K_V1", "--out", str(tmp_path / "c.st")]) == 0
    assert ("weights: ResNet18_Weights.IMAGENET1K_V1 (evaluated at resize 256, crop 224): recorded in the port's "
            "metadata; not their categories and accuracy, which describe no output of this 10-class port"
            in capsys.readouterr().out)
    assert "categories" not in jaxport.read_metadata(tmp_path / "c.st")
    # A port by URL imports no torchvision (tests/test_layering.py) and records none of it.
    assert main(["port", f"{url}/{name}", "--out", str(tmp_path / "d.st")]) == 0
    assert "weights" not in jaxport.read_metadata(tmp_path / "d.st")
