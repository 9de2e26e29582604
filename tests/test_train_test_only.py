"""`jaxport train --test-only`: torchvision's evaluation of existing weights, nothing trained or written."""
import json
import os
import re

import pytest
import torch
import torchvision

from jaxport._cli import main
from jaxport._errors import ConfigError
from jaxport.train import TrainConfig, train
from jaxport.train import _data

# 1438 training digits / 128 = 11 steps: one epoch, evaluated, with the EMA updated every step
# (its decay, scaled as torchvision scales it: 1 - 0.001 * 128 = 0.872).
RUN = dict(image_size=16, batch_size=128, epochs=1, lr=0.2, model_ema=True, model_ema_steps=1, model_ema_decay=0.999,
           progress=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("test-only") / "w"
    train(TrainConfig(workdir=str(work), **RUN), log=lambda m: None)
    return work


def _files(workdir) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in workdir.rglob("*")}


@pytest.mark.xdist_group("test_only")
def test_the_workdirs_checkpoint_and_its_ema_evaluate_as_the_run_did_and_nothing_is_written(run, capsys):
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    before = _files(run)
    for ema, key in ((False, "val_acc"), (True, "val_acc_ema")):
        messages = []
        got = train(TrainConfig(workdir=str(run), resume=True, test_only=True, **{**RUN, "model_ema": ema}),
                    log=messages.append)
        assert (got["val_acc"], got["val_loss"]) == (row[key], row[key.replace("acc", "loss")])
        assert re.fullmatch(rf"--test-only: (the --model-ema average of )?checkpoint step 11 in \S+ on 359 held-out "
                            rf"images of 10 classes: val loss {row[key.replace('acc', 'loss')]:.4f} acc {row[key]:.4f} "
                            rf"\(top-5 {got['val_acc5']:.4f}\)", messages[-1]), messages
        assert got["val_acc"] <= got["val_acc5"] <= 1
    assert _files(run) == before
    # the command line: one result line on stdout
    assert main(["train", "--workdir", str(run), "--resume", "--test-only", "--image-size", "16", "--batch-size", "128",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(rf"val accuracy {row['val_acc']:.4f} \(top-5 [01]\.\d{{4}}\), val loss {row['val_loss']:.4f} "
                        rf"\(checkpoint step 11 in {re.escape(str(run))}\)\n", out), out


@pytest.mark.xdist_group("test_only")
def test_init_weights_exported_to_torch_evaluate_as_torchvision_evaluates_them(run, tmp_path, capsys):
    """The run exported as a torch state_dict, given to --init: jaxport's held-out accuracy and
    loss are torchvision's own on the same images. No --workdir is needed."""
    assert main(["export", str(run), "--out", str(tmp_path / "model.pt")]) == 0
    got = train(TrainConfig(workdir=None, init=str(tmp_path / "model.pt"), test_only=True, **RUN), log=lambda m: None)
    capsys.readouterr()
    assert main(["train", "--init", str(tmp_path / "model.pt"), "--test-only", "--image-size", "16", "--batch-size",
                 "128"]) == 0
    assert capsys.readouterr().out == (f"val accuracy {got['val_acc']:.4f} (top-5 {got['val_acc5']:.4f}), val loss "
                                       f"{got['val_loss']:.4f} (--init {tmp_path / 'model.pt'})\n")
    assert os.listdir(tmp_path) == ["model.pt"]
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    model.eval()
    val = _data.digits(16, seed=0).val
    images, labels = val.load(list(range(val.num_examples)), 0)
    with torch.no_grad():
        logits = model(torch.from_numpy(images).permute(0, 3, 1, 2))
    loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels).long()).item()
    acc = (logits.argmax(1).numpy() == labels).mean()
    acc5 = (logits.topk(5, 1).indices.numpy() == labels[:, None]).any(1).mean()  # train.py's utils.accuracy
    assert got["val_acc"] == pytest.approx(acc, abs=0.5 / val.num_examples)  # the same predictions
    assert got["val_acc5"] == pytest.approx(acc5, abs=0.5 / val.num_examples)
    assert acc5 > acc  # a top-5 that is not the top-1 again
    assert got["val_loss"] == pytest.approx(loss, rel=1e-4)


@pytest.mark.xdist_group("test_only")
def test_weights_that_do_not_fit_the_data_or_the_arch_are_refused(run, tmp_path):
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "imagenet.pt")  # 1000 classes
    cfg = dict(image_size=16, test_only=True, progress=False)
    with pytest.raises(ConfigError, match=re.escape(
            f"--test-only: --init {tmp_path / 'imagenet.pt'} has a classifier of 1000 classes, and --data has 10 "
            "classes; it evaluates weights as they are: give weights trained on these classes, or train (without "
            "--test-only) to fit a new classifier")):
        train(TrainConfig(workdir=str(tmp_path / "w"), init=str(tmp_path / "imagenet.pt"), **cfg), log=lambda m: None)
    with pytest.raises(ConfigError, match=r"--test-only --resume: checkpoint step 11 in \S+ is a resnet18, not "
                                          r"`--arch` resnet34; use --arch resnet18"):
        train(TrainConfig(workdir=str(run), resume=True, arch="resnet34", **cfg), log=lambda m: None)


@pytest.mark.parametrize("changes, message", [
    ({}, "`--test-only` evaluates existing weights: give --init CHECKPOINT (a torch checkpoint, ported variables or "
         "a workdir) or --resume (the latest checkpoint in --workdir)"),
    ({"init": "x.pt", "batch_size": "auto"}, "`--batch-size` (=auto) measures a training step; --test-only evaluates "
                                             "only: give a number, e.g. 64 (the default)"),
])
def test_test_only_without_weights_or_with_an_auto_batch_is_refused(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(TrainConfig(workdir=str(tmp_path / "w"), test_only=True, **changes))
    assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("flags", [["--test-only"], ["--test-only", "--resume"], ["--init", "x.pt"],
                                   ["--test-only", "--resume", "--init", "x.pt"]])
def test_only_test_only_of_init_weights_goes_without_a_workdir(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("jaxport: error: the following arguments are required: --workdir; see "
                                       "`jaxport train --help`\n")
