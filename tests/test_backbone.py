"""Backbones without a classifier, and ResNets stored inside bigger checkpoints (MoCo's query
encoder, a custom head), ported and checked against torchvision with `fc = nn.Identity()`."""
import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision

import torch_compat
from jaxport import models
from jaxport._cli import main
from jaxport._errors import CheckpointError, ConfigError, ConversionError
from jaxport.train._init import fit_head
from tests.helpers import reference

# One basic-block, one bottleneck and one grouped architecture.
ARCHS = ("resnet18", "resnet50", "resnext50_32x4d")
EVAL_RTOL = 1e-4  # float32, relative to the features' scale, as the issue's bar for logits
BACKBONE = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4")


def _headless(arch):
    """What `model.fc = nn.Identity(); torch.save(model.state_dict())` writes (DINO, Barlow Twins)."""
    return {k: v for k, v in reference(arch).state_dict().items() if not k.startswith("fc.")}


def _torchvision_backbone(arch, state_dict):
    model = getattr(torchvision.models, arch)()
    model.fc = torch.nn.Identity()
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_headless_checkpoint_ports_runs_like_torchvision_and_goes_back(arch):
    sd = _headless(arch)
    assert torch_compat.detect_arch(sd) == arch
    assert torch_compat.num_classes_of(sd) == 0
    variables = torch_compat.torch_to_flax(sd)
    assert "fc" not in variables["params"]

    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _torchvision_backbone(arch, sd)(x).numpy()
    got = np.asarray(models.build(arch, num_classes=0).apply(variables, jnp.asarray(x.permute(0, 2, 3, 1).numpy())))
    assert got.shape == want.shape == (2, 512 * models.ARCHS[arch].expansion)
    assert np.abs(got - want).max() <= EVAL_RTOL * np.abs(want).max()

    back = torch_compat.flax_to_torch(variables, arch)
    assert list(back) == list(sd)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in sd.items())
    _torchvision_backbone(arch, back)  # loads with strict=True


def test_backbone_cross_check_compares_the_features_and_can_fail():
    sd = _headless("resnet18")
    reports = torch_compat.cross_check(sd)
    for r in reports:
        stages = [row.stage for row in r.rows]
        assert stages[:6] == ["stem", "layer1", "layer2", "layer3", "layer4", "pooled"] and "logits" not in stages
        assert r.ok, r.table()
    broken = copy.deepcopy(torch_compat.torch_to_flax(sd))
    bn = broken["batch_stats"]["layer4"]["1"]["bn2"]
    bn["mean"], bn["var"] = bn["var"], bn["mean"]
    (report,) = torch_compat.cross_check(sd, broken, modes=("eval",))
    assert not report.ok
    assert {r.stage for r in report.rows if not r.ok} == {"layer4", "pooled"}


def test_cross_check_refuses_a_port_with_another_head():
    """A backbone port checked against its full checkpoint (or the reverse) was an internal flax
    error, or silently skipped the classifier."""
    full = reference("resnet18").state_dict()  # 10 classes
    headless = _headless("resnet18")
    other = torch_compat.torch_to_flax(reference("resnet18", num_classes=7).state_dict())
    for sd, variables, said in ((full, torch_compat.torch_to_flax(headless), "10 classes but the Flax variables "
                                 "have no classifier"),
                                (headless, torch_compat.torch_to_flax(full), "no classifier (a backbone) but the "
                                 "Flax variables have 10 classes"),
                                (full, other, "10 classes but the Flax variables have 7 classes")):
        with pytest.raises(ConversionError, match=re.escape(said) + ".*--backbone-only"):
            torch_compat.cross_check(sd, variables, modes=("eval",))


def test_model_without_classifier_returns_the_pooled_features():
    model = models.resnet50(num_classes=0)
    x = jnp.ones((2, 32, 32, 3))
    variables = model.init(jax.random.key(0), x)
    out, state = model.apply(variables, x, mutable=["intermediates"])
    assert out.shape == (2, 2048)
    np.testing.assert_array_equal(out, state["intermediates"]["pooled"][0])
    tv = torchvision.models.resnet50()
    tv.fc = torch.nn.Identity()
    n_params = sum(a.size for a in jax.tree.leaves(variables["params"]))
    assert n_params == sum(p.numel() for p in tv.parameters())
    for bad in (-1, 2.5, True):
        with pytest.raises(ConfigError, match=r"`num_classes` \(=.*\) must be an int >= 0"):
            models.resnet18(num_classes=bad).init(jax.random.key(0), x)


def test_fold_batchnorm_of_a_backbone():
    variables = torch_compat.torch_to_flax(_headless("resnet18"))
    folded = models.fold_batchnorm(variables, "resnet18")
    assert "fc" not in folded["params"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 32, 3)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = models.resnet18(num_classes=0).apply(variables, x)
        got = models.build_folded("resnet18", num_classes=0).apply(folded, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def test_a_head_that_is_not_torchvision_fc_names_the_way_out():
    model = torchvision.models.resnet18()
    model.fc = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(512, 5))  # transfer-learning tutorials
    sd = dict(model.state_dict())
    sd["projection_head.0.weight"] = torch.zeros(128, 512)  # as self-supervised checkpoints keep beside it
    with pytest.raises(ConversionError, match=r"2 missing: fc.weight; fc.bias.*The backbone .* fits.*--backbone-only"):
        torch_compat.torch_to_flax(sd)
    with pytest.raises(ConversionError, match=r"not torchvision's nn.Linear `fc` \(found fc.1.bias, fc.1.weight\)"):
        torch_compat.num_classes_of(sd)
    kept = torch_compat.backbone_state_dict(sd)
    assert list(kept) == [k for k in sd if k.split(".")[0] in BACKBONE]
    assert all(kept[k] is sd[k] for k in kept)  # selected, not copied
    variables = torch_compat.torch_to_flax(kept)
    assert "fc" not in variables["params"]
    with pytest.raises(ConversionError, match=r"no ResNet backbone keys.*found features.\* \(16 keys\), classifier.\* \(6 keys\)"):
        torch_compat.backbone_state_dict(torchvision.models.vgg11().state_dict())


def test_a_sequential_of_the_resnets_children_gets_torchvisions_names():
    """The classic feature extractor: `nn.Sequential(*list(resnet.children())[:-1])`."""
    ref = reference("resnet18")
    sd = torch.nn.Sequential(*list(ref.children())[:-1]).state_dict()
    with pytest.raises(ConversionError, match=r"children in an nn.Sequential.*--backbone-only"):
        torch_compat.detect_arch(sd)
    renamed = torch_compat.backbone_state_dict(sd)
    assert list(renamed) == list(_headless("resnet18"))
    assert all(renamed[k] is v for k, v in zip(renamed, sd.values()))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = torch.nn.Sequential(*list(ref.children())[:-1])(x).flatten(1).numpy()
    with jax.default_matmul_precision("highest"):
        got = models.resnet18(num_classes=0).apply(torch_compat.torch_to_flax(renamed),
                                                   jnp.asarray(x.permute(0, 2, 3, 1).numpy()))
    assert np.abs(np.asarray(got) - want).max() <= EVAL_RTOL * np.abs(want).max()


def _moco(path):
    """A MoCo v2 training checkpoint: two encoders with MLP heads, a queue, under DataParallel."""
    torch.manual_seed(0)
    encoders = {}
    for name in ("encoder_q", "encoder_k"):
        m = torchvision.models.resnet18()
        m.fc = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
        encoders[name] = m.state_dict()
    sd = {f"module.{name}.{k}": v for name, e in encoders.items() for k, v in e.items()}
    sd["module.queue"], sd["module.queue_ptr"] = torch.randn(128, 64), torch.zeros(1, dtype=torch.long)
    torch.save({"epoch": 200, "arch": "resnet18", "state_dict": sd, "optimizer": {}}, path)
    return encoders


def test_prefix_selects_a_resnet_inside_a_bigger_checkpoint(tmp_path):
    path = tmp_path / "moco.pth.tar"
    encoders = _moco(path)
    whole = torch_compat.load_state_dict(path)
    with pytest.raises(ConversionError, match=r"holds ResNets under 'encoder_k.', 'encoder_q.': select one with prefix"):
        torch_compat.detect_arch(whole)
    for prefix in ("encoder_q.", "encoder_q", "module.encoder_q."):
        sd = torch_compat.load_state_dict(path, prefix=prefix)
        assert list(sd) == list(encoders["encoder_q"])
        assert all(torch.equal(sd[k], v) for k, v in encoders["encoder_q"].items())
    with pytest.raises(CheckpointError, match=r"'.*moco.pth.tar' has no keys under the prefix 'decoder.'.*"
                                              r"encoder_k.\* \(124 keys\), encoder_q.\* \(124 keys\), queue"):
        torch_compat.load_state_dict(path, prefix="decoder")
    with pytest.raises(CheckpointError, match="must name a submodule"):
        torch_compat.load_state_dict(path, prefix=".")
    nested = {f"backbone.{k}": v for k, v in _headless("resnet18").items()}
    with pytest.raises(ConversionError, match=r"its ResNet is under 'backbone.': select it with prefix='backbone.'"):
        torch_compat.detect_arch(nested)


def test_a_detectors_backbone_ports_with_its_prefix(tmp_path):
    """torchvision's Faster R-CNN keeps its ResNet-50 (no fc, IntermediateLayerGetter) under
    `backbone.body.`, beside the FPN and the heads."""
    torch.manual_seed(0)
    detector = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None)
    path = tmp_path / "frcnn.pth"
    torch.save(detector.state_dict(), path)
    with pytest.raises(ConversionError, match=r"its ResNet is under 'backbone.body.'.*--prefix backbone.body."):
        torch_compat.detect_arch(torch_compat.load_state_dict(path))
    sd = torch_compat.load_state_dict(path, prefix="backbone.body")
    body = detector.backbone.body.state_dict()
    assert list(sd) == list(body) and all(torch.equal(sd[k], v) for k, v in body.items())
    assert torch_compat.detect_arch(sd) == "resnet50" and torch_compat.num_classes_of(sd) == 0
    (report,) = torch_compat.cross_check(sd, modes=("eval",))
    assert report.ok, report.table()


def test_prefix_hints_name_the_whole_prefix_from_the_checkpoints_top(tmp_path, capsys):
    """Regression: `--prefix backbone` on a detector (ResNet at `backbone.body.`) said to select
    prefix='body.', which the file does not have; on DINO's layout `--prefix teacher` said
    'backbone.', and `--prefix backbone.` then said 'teacher.': a loop. `--backbone-only` alone
    gave no hint at all."""
    resnet = _headless("resnet18")
    det = tmp_path / "det.pth"  # torchvision detection's layout: backbone.body (ResNet), backbone.fpn, rpn, ...
    torch.save({**{f"backbone.body.{k}": v for k, v in resnet.items()},
                "backbone.fpn.inner_blocks.0.0.weight": torch.zeros(4, 64, 1, 1),
                "rpn.head.conv.0.0.weight": torch.zeros(4, 4, 3, 3)}, det)
    dino = tmp_path / "dino.pth"
    torch.save({"teacher": {f"backbone.{k}": v for k, v in resnet.items()},
                "student": {f"backbone.{k}": v for k, v in resnet.items()}, "epoch": 3}, dino)
    # A reference script's EMA copy of a detector: `model_ema.` + AveragedModel's `module.`, which
    # the selection strips; the hint said `model_ema.backbone.body.`, which the file does not have.
    ema = tmp_path / "ema.pth"
    torch.save({**{f"model_ema.module.backbone.body.{k}": v for k, v in resnet.items()},
                "model_ema.module.backbone.fpn.w": torch.zeros(4, 64, 1, 1), "model_ema.n_averaged": torch.tensor(3),
                **{f"model.backbone.body.{k}": v for k, v in resnet.items()}}, ema)
    hint = "its ResNet is under '{0}': select it with prefix='{0}' (CLI --prefix {0})"

    selected = torch_compat.load_state_dict(det, prefix="backbone")
    with pytest.raises(ConversionError, match=re.escape(hint.format("backbone.body."))):
        torch_compat.torch_to_flax(selected)
    with pytest.raises(ConversionError, match=re.escape(hint.format("backbone.body."))):
        torch_compat.backbone_state_dict(torch_compat.load_state_dict(det))
    torch.save(selected, tmp_path / "selected.pth")  # still a state dict that loads weights-only
    assert list(torch.load(tmp_path / "selected.pth", weights_only=True)) == list(selected)

    for path, flags, whole in ((det, ["--prefix", "backbone"], "backbone.body."),
                               (det, ["--backbone-only"], "backbone.body."),
                               (dino, ["--prefix", "teacher"], "teacher.backbone."),
                               (dino, ["--prefix", "backbone."], "teacher.backbone."),
                               (dino, [], "teacher."),
                               (ema, ["--prefix", "model_ema"], "model_ema.module.backbone.body.")):
        out = tmp_path / "out.safetensors"
        assert main(["port", str(path), *flags, "--out", str(out)]) == 2, flags
        assert f"prefix='{whole}' (CLI --prefix {whole})" in capsys.readouterr().err, (path.name, flags)
        if whole != "teacher.":  # the advice, followed, ports
            assert main(["port", str(path), "--prefix", whole, "--out", str(out)]) == 0, (path.name, flags)
    capsys.readouterr()


def test_cli_ports_mocos_query_encoder_and_exports_the_backbone(tmp_path, capsys):
    path = tmp_path / "moco.pth.tar"
    encoders = _moco(path)
    out = tmp_path / "q.safetensors"
    assert main(["port", str(path), "--out", str(out)]) == 2
    assert "--prefix encoder_q." in capsys.readouterr().err
    assert main(["port", str(path), "--prefix", "encoder_q", "--out", str(out)]) == 2
    assert "--backbone-only" in capsys.readouterr().err
    assert not out.exists()

    assert main(["port", str(path), "--prefix", "encoder_q", "--backbone-only", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "backbone only: kept 120 tensors, dropped 4 (fc.* (4 keys))" in printed
    assert "no classifier (a backbone: outputs 512 pooled features)" in printed
    assert f"next: jaxport verify {path} {out} --prefix encoder_q --backbone-only" in printed
    assert main(["verify", str(path), str(out), "--prefix", "encoder_q", "--backbone-only"]) == 0
    assert "verify: PASS" in capsys.readouterr().out

    pt = tmp_path / "q_backbone.pt"
    assert main(["export", str(out), "--out", str(pt)]) == 0
    assert "model.fc = torch.nn.Identity()" in capsys.readouterr().out
    back = torch.load(pt, weights_only=True)
    want = {k: v for k, v in encoders["encoder_q"].items() if not k.startswith("fc.")}
    _torchvision_backbone("resnet18", back)
    assert list(back) == list(want) and all(torch.equal(back[k], v) for k, v in want.items())


def test_train_init_from_a_backbone_initialises_the_classifier():
    fresh = models.resnet18(num_classes=3).init(jax.random.key(1), jnp.ones((1, 32, 32, 3)))
    fresh = jax.tree.map(np.asarray, fresh)
    backbone = torch_compat.torch_to_flax(_headless("resnet18"))
    said = []
    out = fit_head(backbone, fresh, said.append)
    assert said == ["--init: the weights are a backbone without a classifier: initialising fc (3 outputs)"]
    np.testing.assert_array_equal(out["params"]["fc"]["kernel"], fresh["params"]["fc"]["kernel"])
    np.testing.assert_array_equal(out["params"]["conv1"]["kernel"], backbone["params"]["conv1"]["kernel"])
