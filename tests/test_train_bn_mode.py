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


def test_frozen_keeps_the_batchnorms_whole_and_eval_their_statistics_through_a_resume(tmp_path, init):
    path, start = init
    layers = {k.rsplit("/", 1)[0].replace("batch_stats/", "") for k in start if k.startswith("batch_stats/")}
    norm = {k for k in start if k.startswith("params/") and k.rsplit("/", 1)[0].replace("params/", "") in layers}
    assert len(layers) == 20 and len(norm) == 40  # ResNet-18: 20 BatchNorms, a scale and a bias each
    params = {k for k in start if k.startswith("params/")}

    def changed(got, before):
        return {k for k in params if not np.array_equal(got[k], before[k])}

    out = train(_cfg(tmp_path, path, "frozen"), log=lambda m: None)
    frozen = flatten(jax.device_get(out["state"].variables))
    assert int(out["state"].step) == 2 and frozen.keys() == start.keys()
    for k in start:
        if k.startswith("batch_stats/") or k in norm:
            np.testing.assert_array_equal(frozen[k], start[k], err_msg=k)  # not one bit moved
    assert changed(frozen, start) == params - norm

    # --resume in eval mode continues, says so, and trains the scales and biases too
    said = []
    out = train(_cfg(tmp_path, path, "eval", max_steps=3, resume=True), log=said.append)
    assert any("changed settings: --bn-mode eval (was frozen)" in m for m in said), said
    evaled = flatten(jax.device_get(out["state"].variables))
    for k in start:
        if k.startswith("batch_stats/"):
            np.testing.assert_array_equal(evaled[k], start[k], err_msg=k)
    assert changed(evaled, frozen) == params


def test_train_mode_still_refuses_one_value_per_channel(tmp_path, init):
    """What --bn-mode eval and frozen allow above: train-mode BatchNorm over one value per
    channel (torch refuses it) is refused before compiling."""
    with pytest.raises(ConfigError, match=r"train-mode BatchNorm would see one value per channel"):
        train(_cfg(tmp_path, init[0], "train"), log=lambda m: None)
