"""`jaxport.train` over a chosen number of simulated devices: settings checked at the boundary.

The library takes any Python value for a `TrainConfig` field; these are the values that used to
fail deep inside numpy or jax (an "internal error" from the CLI), or ran with a silently
different meaning (1.5 checkpoints, `devices=16` on 8 devices training on 8).
"""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxport._errors import ConfigError
from jaxport.train import TrainConfig, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("field, value, match", [
    ("epochs", 2.5, r"`--epochs` \(=2.5\) must be an integer >= 1"),  # named `t_max` inside the schedule
    ("epochs", True, r"`--epochs` \(=True\) must be an integer >= 1"),
    ("image_size", 16.0, r"`--image-size` \(=16.0\) must be an integer >= 1"),  # a TypeError in jax
    ("max_steps", 2.5, r"`--max-steps` \(=2.5\) must be an integer >= 1"),  # a TypeError in range()
    ("checkpoint_every", 1.5, r"`--checkpoint-every` \(=1.5\) must be an integer >= 1"),  # ran, saving every 3
    ("keep_checkpoints", 1.5, r"`--keep-checkpoints` \(=1.5\) must be an integer >= 1"),  # ran
    ("devices", True, r"`devices` \(=True\) must be an integer >= 1"),  # ran on 1 device
    ("workers", 1.5, r"`--workers` \(=1.5\) must be an integer >= 0"),  # ran
    ("batch_size", True, r"`--batch-size` \(=True\) must be a positive integer or 'auto'"),  # "use 8"
    ("seed", -1, r"`--seed` \(=-1\) must be an integer from 0 to 2\*\*63 - 1"),  # numpy's ValueError
    ("seed", 2**64, r"`--seed` \(=18446744073709551616\) must be an integer from 0 to 2\*\*63 - 1"),  # OverflowError
    ("seed", 1.5, r"`--seed` \(=1.5\) must be an integer"),  # a TypeError in jax.random.key
    ("lr", "0.1", r"`--lr` \(='0.1'\) must be a finite number > 0"),  # TypeError: must be real number, not str
    ("momentum", "0.9", r"`--momentum` \(='0.9'\) must be a finite number >= 0"),
    ("sync_bn", "no", r"`--sync-bn` \(='no'\) must be True or False"),  # ran with SyncBatchNorm
    ("bn_stats", None, r"`--bn-stats` \(=None\) must be one of mean, first$"),
    ("label_smoothing", "0.1", r"`--label-smoothing` \(='0.1'\) must be a number from 0 to 1"),
    ("label_smoothing", True, r"`--label-smoothing` \(=True\) must be a number from 0 to 1"),
    ("resume", "yes", r"`--resume` \(='yes'\) must be True or False"),
    # "No such file or directory: ''" once the model was built; None a TypeError
    ("workdir", "", r"`--workdir` \(=''\) must be a directory path, new or existing"),
    ("workdir", None, r"`--workdir` \(=None\) must be a directory path"),
    ("data", 5, r"`--data` \(=5\) must be a path, or None"),  # `os.path.isdir(5)`: file descriptor 5
    ("init", 5, r"`--init` \(=5\) must be a path, or None"),
])
def test_settings_of_the_wrong_type_are_refused_by_name_before_any_work(tmp_path, field, value, match):
    with pytest.raises(ConfigError, match=match):
        train(TrainConfig(**{"workdir": str(tmp_path / "w"), "image_size": 16, "max_steps": 1, field: value}))
    assert not (tmp_path / "w").exists()


def test_a_config_that_is_not_a_train_config_is_named():
    with pytest.raises(ConfigError, match=r"`cfg` \(a dict\) must be a TrainConfig: train\(TrainConfig\(workdir=...\)\)"):
        train({"workdir": "w"})  # AttributeError: 'dict' object has no attribute 'coordinator'


def test_more_devices_than_jax_sees_is_refused_not_silently_fewer(tmp_path):
    # `jax.devices()[:16]` on 8 devices is 8 devices: the run trained, on half what was asked.
    n = jax.device_count()
    with pytest.raises(ConfigError, match=rf"`devices` \(={2 * n}\) is more than the {n} device\(s\) jax sees; "
                                          rf"use at most {n}"):
        train(TrainConfig(workdir=str(tmp_path / "w"), image_size=16, batch_size=2 * n, max_steps=1,
                          devices=2 * n, progress=False))
    assert not (tmp_path / "w").exists()


def test_a_negative_seed_on_the_command_line_is_one_line_not_an_internal_error(tmp_path):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "jaxport", "train", "--workdir", str(tmp_path / "w"), "--seed", "-1",
                           "--image-size", "16", "--max-steps", "1", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "jaxport: error: `--seed` (=-1) must be an integer from 0 to 2**63 - 1\n", proc.stderr
    assert not (tmp_path / "w").exists()  # it used to leave an empty checkpoints/ behind


@pytest.mark.parametrize("labels, mask, match", [
    # Each device broadcast its 1 label against its 2 images: trained without an error.
    (np.zeros(8, np.int32), None, r"`labels` \(shape \(8,\)\) must hold one class index per image: shape \(16,\)"),
    (np.zeros((16, 1), np.int32), None, r"`labels` \(shape \(16, 1\)\) must hold one class index per image"),
    (np.zeros(16, np.float32), None, r"`labels` \(dtype float32\) must be integer class indices; pass "
                                     r"labels.astype\(np.int32\)"),
    (np.zeros(8, np.int32), np.ones(16, np.float32), r"`labels` \(shape \(8,\)\) must hold one class index"),
    (np.zeros(16, np.int32), np.ones(8, np.float32), r"`mask` \(shape \(8,\)\) must hold one weight per image"),
])
def test_labels_or_mask_not_one_per_image_are_refused_by_the_steps(labels, mask, match):
    from jaxport.models import build
    from jaxport.train import create_state, make_eval_step, make_mesh, make_train_step, shard_batch
    from torch_compat import optim

    mesh = make_mesh(jax.devices("cpu")[:8])
    model = build("resnet18", num_classes=10)
    variables = model.init(jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32))
    tx = optim.sgd(0.1)
    state = create_state(variables, tx, mesh)
    images = np.zeros((16, 16, 16, 3), np.float32)
    with pytest.raises(ConfigError, match=match):
        if mask is None:
            make_train_step(model, tx, mesh)(state, *shard_batch(mesh, images, labels))
        else:
            make_eval_step(model, mesh)(state.variables, *shard_batch(mesh, images, labels, mask))


@pytest.mark.slow
def test_resuming_on_another_device_count_says_so(tmp_path):
    """A run resumes on any device count (the checkpoint is replicated). With per-device
    BatchNorm that changes what each device normalises over, which the resume line said
    nothing of (only `jaxport train`'s next line showed the new count)."""
    cfg = TrainConfig(workdir=str(tmp_path), image_size=16, batch_size=16, epochs=1, max_steps=1, progress=False,
                      checkpoint_every=1000, devices=4)
    train(cfg, log=lambda m: None)
    said = []
    result = train(TrainConfig(**{**cfg.__dict__, "resume": True, "max_steps": 2, "devices": 2}), log=said.append)
    assert int(result["state"].step) == 2
    assert said[0] == ("resuming from step 1 with changed settings: 2 device(s) (was 4: per-device BatchNorm now "
                       "normalises over 8 images, was 4)"), said


def test_init_may_be_a_pathlib_path(tmp_path):
    """`TrainConfig(init=Path(...))` of a file failed with "'PosixPath' object has no attribute
    'endswith'" (a workdir or a str worked)."""
    from pathlib import Path

    import torch
    import torchvision

    from jaxport._io import save_variables
    from jaxport.models import build
    from jaxport.train._init import load_init

    variables = jax.tree.map(np.asarray, build("resnet18", num_classes=10).init(
        jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32)))
    save_variables(str(tmp_path / "v.safetensors"), variables, arch="resnet18")
    got = load_init(Path(tmp_path / "v.safetensors"), "resnet18")
    jax.tree.map(np.testing.assert_array_equal, got, variables)
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), tmp_path / "r18.pt")
    assert load_init(Path(tmp_path / "r18.pt"), "resnet18")["params"]["fc"]["kernel"].shape == (512, 10)


def test_shard_batch_that_does_not_split_names_the_array_and_the_fix():
    """jax's IndivisibleError for 6 examples over 8 devices named no fix."""
    from jaxport.train import _step

    mesh = _step.make_mesh()
    n = mesh.devices.size
    assert [a.shape for a in _step.shard_batch(mesh, np.zeros((n, 2)), np.zeros(n))] == [(n, 2), (n,)]
    with pytest.raises(ConfigError, match=rf"shard_batch: array 1's examples \(shape \({n + 2},\), this process\)` "
                                          rf"\(={n + 2}\) must be divisible by the number of devices \(={n}\); "
                                          rf"use {2 * n} or {n}"):
        _step.shard_batch(mesh, np.zeros((n, 2)), np.zeros(n + 2))
