"""`jaxport train --bn-mode eval|frozen`: fine-tuning ported weights with BatchNorm out of train
mode, as torch's `bn.eval()` and torchvision's FrozenBatchNorm2d. The step's numbers against
torch are tests/test_train_parity.py's (`make_train_step(batchnorm=)`); here, what a run keeps,
what it allows and what a resume says.
"""
import jax
import numpy as np
import pytest
import torch

from jaxport._errors import ConfigError
from jaxport._io import flatten
from jaxport.train import TrainConfig, train
from torch_compat import reference_model, torch_to_flax


@pytest.fixture(scope="module")
def init(tmp_path_factory):
    """A torchvision ResNet-18 with calibrated BatchNorm (running statistics away from 0 and 1,
    random scales and biases), saved as a torch checkpoint, and its port."""
    state_dict = reference_model("resnet18", num_classes=10, image_size=16).state_dict()
    path = tmp_path_factory.mktemp("init") / "r18.pth"
    torch.save(state_dict, path)
    return path, flatten(jax.device_get(torch_to_flax(state_dict, "resnet18")))


def _cfg(tmp_path, init_path, mode, **changes):
    # 2 images over 2 devices: one per device, at 16 px layer4's maps are 1x1
    return TrainConfig(**{"workdir": str(tmp_path / "w"), "init": str(init_path), "image_size": 16, "batch_size": 2,
                          "devices": 2, "epochs": 1, "max_steps": 2, "checkpoint_every": 1, "bn_mode": mode,
                          "progress": False, **changes})


@pytest.mark.parametrize("mode", ["eval", "frozen"])
def test_a_run_keeps_the_running_statistics_and_frozen_the_batchnorm_parameters(tmp_path, init, mode):
    path, start = init
    messages = []
    out = train(_cfg(tmp_path, path, mode), log=messages.append)
    assert int(out["state"].step) == 2
    got = flatten(jax.device_get(out["state"].variables))
    assert got.keys() == start.keys()
    layers = {k.rsplit("/", 1)[0].replace("batch_stats/", "") for k in start if k.startswith("batch_stats/")}
    norm = {k for k in start if k.startswith("params/") and k.rsplit("/", 1)[0].replace("params/", "") in layers}
    assert len(layers) == 20 and len(norm) == 40  # ResNet-18: 20 BatchNorms, a scale and a bias each
    for k in start:
        if k.startswith("batch_stats/") or (mode == "frozen" and k in norm):
            np.testing.assert_array_equal(got[k], start[k], err_msg=k)  # not one bit moved
    trained = {k for k in start if k.startswith("params/") and not np.array_equal(got[k], start[k])}
    assert trained == ({k for k in start if k.startswith("params/")} - (norm if mode == "frozen" else set()))

    # --resume with the other mode continues and says so
    other = {"eval": "frozen", "frozen": "eval"}[mode]
    again = []
    train(_cfg(tmp_path, path, other, max_steps=3, resume=True), log=again.append)
    assert any(f"changed settings: --bn-mode {other} (was {mode})" in m for m in again), again


def test_train_mode_still_refuses_one_value_per_channel(tmp_path, init):
    """What --bn-mode eval and frozen allow above: train-mode BatchNorm over one value per
    channel (torch refuses it) is refused before compiling."""
    with pytest.raises(ConfigError, match=r"train-mode BatchNorm would see one value per channel"):
        train(_cfg(tmp_path, init[0], "train"), log=lambda m: None)
