"""`make_train_step` over 2 devices against torch run as `nn.DataParallel` runs it, in float64.

DataParallel (and DDP without SyncBatchNorm) gives each replica its shard of the batch and its
own copy of the BatchNorm buffers, so each normalises over its shard alone; the gradients are
those of the mean loss over the global batch; and the running statistics kept are replica 0's
(DDP's `broadcast_buffers=True` copies rank 0's to the others at each forward). torch runs no
replicas on a CPU, so `_torch_data_parallel` does what they do: one forward per shard with a
copy of the buffers, the parameters shared (their gradients add up), then replica 0's buffers
(`keep="first"`) or the replicas' mean (`keep="mean"`, what `running_stats="mean"` does).

torchvision's model (BatchNorm calibrated by two train-mode batches, `zero_init_residual=True`
as in test_train_parity.py, which says why) is ported with `torch_to_flax`, and both train it
on the same batches; every parameter and running statistic is compared after the steps as
`max|jax - torch| / max|torch|` per tensor, <= 1e-8 (float64 rounding, as the one-device parity).
"""
import jax
import numpy as np
import pytest
import torch
import torchvision

from jaxport._errors import ConfigError
from jaxport.models import build
from jaxport.train import create_state, make_mesh, make_train_step, shard_batch
from torch_compat import flax_to_torch, optim, torch_to_flax
from tests.helpers import rel_errors

ARCH, NUM_CLASSES, DEVICES, BATCH, SIZE, STEPS = "resnet18", 10, 2, 8, 32, 3


def _torch_data_parallel(model, x, y, keep, label_smoothing=0.0):
    """The mean cross-entropy over the global batch, each of `DEVICES` replicas normalising its
    shard; the model's buffers become replica 0's (`keep="first"`) or the replicas' mean."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    losses, replicas = [], []
    for xs, ys in zip(torch.chunk(x, DEVICES), torch.chunk(y, DEVICES)):
        own = {k: v.clone() for k, v in buffers.items()}  # BatchNorm updates these in place
        logits = torch.func.functional_call(model, (params, own), (xs,))
        losses.append(torch.nn.functional.cross_entropy(logits, ys, label_smoothing=label_smoothing))
        replicas.append(own)
    with torch.no_grad():
        for k, v in buffers.items():
            if keep == "first" or k.endswith("num_batches_tracked"):
                v.copy_(replicas[0][k])
            else:
                v.copy_(sum(r[k] for r in replicas) / DEVICES)
    return sum(losses) / DEVICES  # equal shards: the mean of the shards' means is the global mean


def _train_both(running_stats, label_smoothing=0.0):
    torch.manual_seed(0)
    tmodel = torchvision.models.resnet18(num_classes=NUM_CLASSES, zero_init_residual=True).double()
    rng = np.random.default_rng(0)
    with torch.no_grad():  # calibrate BatchNorm so running stats are not at their init
        tmodel.train()
        for _ in range(2):
            tmodel(torch.tensor(rng.standard_normal((BATCH, 3, SIZE, SIZE))))
    variables = torch_to_flax(tmodel.state_dict(), ARCH)
    # Each shard's images drawn at another scale and shift, so the replicas' statistics differ
    # by far more than rounding, and "first" and "mean" cannot both pass.
    shift = np.repeat(np.arange(DEVICES), BATCH // DEVICES)[:, None, None, None]
    batches = [((1 + shift) * rng.standard_normal((BATCH, SIZE, SIZE, 3)) + shift, rng.integers(0, NUM_CLASSES, BATCH))
               for _ in range(STEPS)]

    topt = torch.optim.SGD(tmodel.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    for x, y in batches:
        topt.zero_grad()
        _torch_data_parallel(tmodel, torch.tensor(x.transpose(0, 3, 1, 2)), torch.tensor(y), running_stats,
                             label_smoothing).backward()
        topt.step()
    want = {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}

    mesh = make_mesh(jax.devices("cpu")[:DEVICES])
    assert mesh.devices.size == DEVICES, "tests/conftest.py sets JAX_NUM_CPU_DEVICES=8"
    model = build(ARCH, num_classes=NUM_CLASSES, param_dtype=np.float64)  # bn_axis_name None: per device
    tx = optim.sgd(0.05, momentum=0.9, weight_decay=1e-4)
    state = create_state(variables, tx, mesh)
    step = make_train_step(model, tx, mesh, running_stats=running_stats, label_smoothing=label_smoothing)
    for x, y in batches:
        state, _ = step(state, *shard_batch(mesh, x, y))
    # Every device holds the same running statistics (a checkpoint or evaluation reads any one).
    for leaf in jax.tree.leaves(state.batch_stats):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])
    got = {k: v.numpy() for k, v in flax_to_torch(jax.device_get(state.variables), ARCH).items()}
    assert got.keys() == want.keys()
    return got, want


@pytest.mark.parametrize("running_stats", ["first", "mean"])
def test_running_stats_equal_torch_data_parallel_keeping_them(x64, running_stats):
    got, want = _train_both(running_stats)
    errors = rel_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-8, (worst, errors[worst])
    for k in want:
        if k.endswith("num_batches_tracked"):
            assert got[k] == want[k] == 2 + STEPS, k


def test_label_smoothing_equals_torch_cross_entropy_loss_with_it(x64):
    """`CrossEntropyLoss(label_smoothing=0.1)`, as most fine-tuning scripts use it."""
    got, want = _train_both("first", label_smoothing=0.1)
    errors = rel_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-8, (worst, errors[worst])


def test_running_stats_is_one_of_its_choices():
    model = build(ARCH, num_classes=NUM_CLASSES)
    mesh = make_mesh(jax.devices("cpu")[:DEVICES])
    tx = optim.sgd(0.1)
    with pytest.raises(ConfigError, match=r"^`running_stats` \(='frist'\) must be one of mean, first; did you mean "
                                          r"running_stats first\?$"):
        make_train_step(model, tx, mesh, running_stats="frist")
    with pytest.raises(ConfigError, match=r"^`running_stats` \(=None\) must be one of mean, first$"):
        make_train_step(model, tx, mesh, running_stats=None)
