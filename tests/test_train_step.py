"""The data-parallel step on 8 simulated CPU devices: device-count independence with SyncBN,
identical replicas with per-device BN, and the batch-divisibility check."""
import functools

import jax
import numpy as np
import pytest

from jaxport._errors import ConfigError
from jaxport.models import ResNet
from jaxport.train import check_batch_size, create_state, make_mesh, make_train_step, shard_batch
from torch_compat import optim

BATCH, SIZE, STEPS = 16, 16, 2
# The device-count runs use ResNet-18's blocks at half its depth (one basic block a stage): the
# stem, an identity and three projection shortcuts, every BatchNorm synced or not, and the head,
# as in ResNet-18, for about half the compile time of each of the five steps compiled here
# (1 and 8 devices, float32 and float64, per-device BN). Depth adds nothing these checks see.
LAYERS = (1, 1, 1, 1)


def _model(sync_bn):
    return ResNet(block="basic", layers=LAYERS, num_classes=10, zero_init_residual=True,
                  bn_axis_name="data" if sync_bn else None)


def _sgd():
    return optim.sgd(0.05, momentum=0.9, weight_decay=1e-4)


@functools.lru_cache
def _initial_variables(seed):
    # One initialisation (float32 parameters, the model's param_dtype) for every run, cast to
    # the run's dtype: initialising again under `jax.enable_x64` compiled each of init's eager
    # ops a second time. The two models differ only in `bn_axis_name`, which init does not read.
    return jax.device_get(_model(False).init(jax.random.key(seed), np.zeros((1, SIZE, SIZE, 3), np.float32)))


@functools.lru_cache  # the 8-device SyncBN run serves two tests
def _train(num_devices, sync_bn, seed=0, steps=STEPS, dtype=np.float32):
    # The CPU devices by name: on a GPU host jax.devices() is the one GPU, and "1 against 8
    # devices" would silently compare one device with itself.
    mesh = make_mesh(jax.devices("cpu")[:num_devices])
    assert mesh.devices.size == num_devices, "tests/conftest.py sets JAX_NUM_CPU_DEVICES=8"
    model = _model(sync_bn)
    variables = jax.tree.map(lambda v: v.astype(dtype), _initial_variables(seed))
    tx = _sgd()
    state = create_state(variables, tx, mesh)
    step = make_train_step(model, tx, mesh)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        x = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(dtype)
        y = rng.integers(0, 10, BATCH)
        state, metrics = step(state, *shard_batch(mesh, x, y))
        losses.append(float(metrics["loss"]))
    return state, losses


def _max_rel(a, b):
    return max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y))) / max(np.max(np.abs(np.asarray(y, np.float64))), 1e-30)),
        a, b)))


def test_sync_bn_same_weights_on_1_and_8_devices():
    one, loss1 = _train(1, sync_bn=True)
    eight, loss8 = _train(8, sync_bn=True)
    np.testing.assert_allclose(loss1, loss8, rtol=1e-5)
    # float32 rounding only: reductions are split differently over devices.
    assert _max_rel(jax.device_get(eight.variables), jax.device_get(one.variables)) < 1e-4
    assert int(eight.step) == STEPS


def test_sync_bn_device_count_independence_is_exact_in_float64(x64):
    """Beyond a couple of float32 steps the two runs drift apart (rounding in differently split
    sums flips ReLUs; the README says so); in float64 they stay equal over more steps."""
    one, _ = _train(1, sync_bn=True, steps=4, dtype=np.float64)
    eight, _ = _train(8, sync_bn=True, steps=4, dtype=np.float64)
    assert jax.tree.leaves(eight.params)[0].dtype == np.float64
    assert _max_rel(jax.device_get(eight.variables), jax.device_get(one.variables)) < 1e-10


def test_per_device_bn_keeps_replicas_identical():
    state, _ = _train(8, sync_bn=False)
    for leaf in jax.tree.leaves(state.variables) + jax.tree.leaves(state.opt_state):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == 8
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])
    synced, _ = _train(8, sync_bn=True)
    # per-device statistics are a different computation from SyncBN (2 examples per device)
    assert _max_rel(jax.device_get(state.batch_stats), jax.device_get(synced.batch_stats)) > 1e-3


def test_step_compiles_once():
    mesh = make_mesh()
    # The model, optimizer and shapes of `_train(8, sync_bn=False)`: the same program, so the
    # compilation cache (tests/conftest.py) can serve it instead of compiling it again.
    model, variables, tx = _model(False), _initial_variables(0), _sgd()
    state = create_state(variables, tx, mesh)
    step = make_train_step(model, tx, mesh)
    # 2 images per device: at 16 px layer4's maps are 1x1, and BatchNorm needs two values.
    x, y = np.zeros((16, 16, 16, 3), np.float32), np.zeros(16, np.int32)
    for _ in range(3):
        state, _ = step(state, *shard_batch(mesh, x, y))
    assert step._cache_size() == 1


@pytest.mark.parametrize("batch,devices,fix", [(30, 8, "use 32 or 24"), (3, 8, "use 8"), (100, 3, "use 102 or 99")])
def test_batch_not_divisible_is_refused(batch, devices, fix):
    with pytest.raises(ConfigError) as err:
        check_batch_size(batch, devices)
    assert str(err.value) == f"`batch_size` (={batch}) must be divisible by the number of devices (={devices}); {fix}"
    check_batch_size(32, 8)


def test_labels_outside_the_classes_make_the_loss_nan_where_torch_raises():
    """Label -1 trained silently as the last class (optax indexes from the end), and a label of
    num_classes gave a NaN loss whose gradient still updated the weights as if nothing was
    wrong. torch raises IndexError for both; a jitted step cannot raise, so the loss is NaN."""
    import jax.numpy as jnp
    import torch

    from jaxport.train import cross_entropy, make_eval_step

    logits = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    good = np.array([0, 4, 2, 1])
    want = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(good), reduction="none").numpy()
    np.testing.assert_allclose(cross_entropy(jnp.asarray(logits), jnp.asarray(good)), want, rtol=1e-6)
    for bad in (-1, 5, -100):  # (torch skips -100, its default `ignore_index`; jaxport has none)
        labels = np.array([0, bad, 2, 1])
        if bad != -100:
            with pytest.raises(IndexError):
                torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(labels), reduction="none")
        got = np.asarray(cross_entropy(jnp.asarray(logits), jnp.asarray(labels)))
        assert np.isnan(got[1]) and np.allclose(got[[0, 2, 3]], want[[0, 2, 3]], rtol=1e-6), (bad, got)

    mesh = make_mesh(jax.devices("cpu")[:2])
    model, variables = _model(False), _initial_variables(0)
    tx = optim.sgd(0.1)
    x, y = np.zeros((4, 16, 16, 3), np.float32), np.array([0, -1, 3, 9], np.int32)
    state = create_state(variables, tx, mesh)
    after, metrics = make_train_step(model, tx, mesh)(state, *shard_batch(mesh, x, y))
    assert np.isnan(float(metrics["loss"]))
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(jax.device_get(after.params)))
    ones = np.ones(4, np.float32)
    got = make_eval_step(model, mesh)(variables, *shard_batch(mesh, x, y, ones))
    assert np.isnan(float(got["loss_sum"])) and float(got["count"]) == 4


def test_a_state_the_step_has_consumed_is_refused():
    """jaxlib crashed the process (SIGSEGV) when a donated state sharded over 2+ CPU devices
    was passed to the step again: a plain mistake in a user's loop."""
    mesh = make_mesh(jax.devices("cpu")[:2])
    model, variables = _model(False), _initial_variables(0)
    tx = optim.sgd(0.1)
    batch = shard_batch(mesh, np.zeros((4, 16, 16, 3), np.float32), np.zeros(4, np.int32))
    step = make_train_step(model, tx, mesh)
    state = create_state(variables, tx, mesh)
    new, _ = step(state, *batch)
    with pytest.raises(ConfigError, match=r"`state` was consumed by an earlier call of this step .*pass the state "
                                          r"that call returned, or .*donate=False"):
        step(state, *batch)
    new, _ = step(new, *batch)  # the returned state goes on
    assert int(new.step) == 2
    assert step.lower(new, *batch) is not None  # the jitted step's methods stay reachable
    keep = make_train_step(model, tx, mesh, donate=False)
    state = create_state(variables, tx, mesh)
    keep(state, *batch)
    assert int(keep(state, *batch)[0].step) == 1


def test_the_step_builders_name_what_is_wrong_with_their_arguments():
    """Each was a raw error naming none of the arguments: jax's "Resource axis: data of
    P('data',) is not found in mesh", an AttributeError on `bn_axis_name`, KeyError: 'params', an
    empty Mesh(), and "use 4.0 or 2.0" for a batch of 2.5."""
    from jax.sharding import Mesh

    from jaxport import models
    from jaxport.train import make_eval_step

    model, variables = _model(False), _initial_variables(0)
    tx = optim.sgd(0.1)
    other = Mesh(np.asarray(jax.devices("cpu")[:2]), ("batch",))
    for call in (lambda: make_train_step(model, tx, other), lambda: make_eval_step(model, other),
                 lambda: create_state(variables, tx, other)):
        with pytest.raises(ConfigError, match=r"`mesh` \(axes \('batch',\)\) must be a jax Mesh with an axis named "
                                              r"'data'.*make_mesh\(devices\)"):
            call()
    mesh = make_mesh(jax.devices("cpu")[:2])
    with pytest.raises(ConfigError, match=r"`model` \(=<function resnet18.*\) must be a Flax module instance"):
        make_train_step(models.resnet18, tx, mesh)
    with pytest.raises(ConfigError, match=r"`variables` \(holding \['bn1', 'conv1', 'fc', 'layer1', 'layer2'\]\) "
                                          r"must be Flax variables"):
        create_state(variables["params"], tx, mesh)
    import torch  # a torch optimizer, as a migrating script holds one: was "'SGD' object has no attribute 'init'"

    with pytest.raises(ConfigError, match=r"`tx` \(=torch.optim.sgd.SGD\) must be an optax GradientTransformation, "
                                          r"e.g. torch_compat.optim.sgd"):
        create_state(variables, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), mesh)
    with pytest.raises(ConfigError, match=r"`devices` \(=\[\]\) is empty"):
        make_mesh([])
    for bad in (2.5, 4.0, "8", 0):
        with pytest.raises(ConfigError, match=rf"`batch_size` \(={bad!r}\) must be an integer >= 1"):
            check_batch_size(bad, 2)
    check_batch_size(np.int64(4), 2)
