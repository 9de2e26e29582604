"""Gradient accumulation (`make_train_step(accum_steps=)`, `jaxport train --grad-accum-steps`):
torch's accumulation loop step for step, the device-count independence of SyncBatchNorm kept,
the one-pass step wherever BatchNorm takes no batch statistics, less memory, and the refusals.

The torch reference is the loop users write: `optimizer.zero_grad()`, then for each of the
`k` chunks of the batch `(cross_entropy(model(chunk), labels) / k).backward()`, then
`optimizer.step()`; chunk `j` is the batch's rows `j, j + k, ...` (`x[j::k]`), as the step
takes them.
"""
import functools

import jax
import numpy as np
import pytest
import torch
import torchvision

from jaxport._errors import ConfigError
from jaxport.models import ResNet, build
from jaxport.train import TrainConfig, _loop, _memory, _step, create_state, make_mesh, make_train_step, shard_batch, train
from torch_compat import flax_to_torch, optim, torch_to_flax
from tests.helpers import rel_errors, write_images
from tests.test_train_parity import CLIP, OPTIMIZERS

NUM_CLASSES = 10


def _torch_accumulated(tmodel, topt, batches, k, clip=None):
    """torch's accumulation loop: the state_dict after it, and each step's loss (its chunks'
    `loss / k` summed)."""
    losses = []
    for x, y in batches:
        topt.zero_grad()
        xt, yt = torch.tensor(x.transpose(0, 3, 1, 2)), torch.tensor(y)
        total = 0.0
        for j in range(k):
            loss = torch.nn.functional.cross_entropy(tmodel(xt[j::k]), yt[j::k]) / k
            loss.backward()
            total += loss.item()
        if clip is not None:
            assert torch.nn.utils.clip_grad_norm_(tmodel.parameters(), clip) > clip  # clipping acts
        topt.step()
        losses.append(total)
    return {name: v.detach().numpy() for name, v in tmodel.state_dict().items()}, losses


@pytest.mark.parametrize("opt, k, rolled", [("sgd", 2, False), ("sgd-clip", 4, True)])
def test_accumulated_steps_equal_torchs_accumulation_loop_in_float64(x64, monkeypatch, opt, k, rolled):
    """Two steps of batch 8 in `k` passes each: every weight, running statistic and
    `num_batches_tracked` (one count per pass) as torch's. Clipping acts on the accumulated
    gradient, as torch's `clip_grad_norm_` before `step()`. `rolled`: the passes as the `lax.scan`
    every platform but XLA:CPU runs (XLA:CPU unrolls them)."""
    if rolled:
        monkeypatch.setattr(_step, "_UNROLLED_PLATFORMS", frozenset())
    torch.manual_seed(0)
    tmodel = torchvision.models.resnet18(num_classes=NUM_CLASSES, zero_init_residual=True).double()
    rng = np.random.default_rng(0)
    with torch.no_grad():  # calibrated BatchNorm: running statistics away from their 0 / 1 init
        tmodel.train()
        for _ in range(2):
            tmodel(torch.tensor(rng.standard_normal((4, 3, 32, 32))))
    variables = torch_to_flax(tmodel.state_dict(), "resnet18")
    batches = [(rng.standard_normal((8, 32, 32, 3)), rng.integers(0, NUM_CLASSES, 8)) for _ in range(2)]
    make_torch_opt, make_tx = OPTIMIZERS[opt]
    want, want_losses = _torch_accumulated(tmodel, make_torch_opt(tmodel.parameters()), batches, k,
                                           CLIP if opt.endswith("-clip") else None)

    mesh = make_mesh(jax.devices()[:1])
    tx = make_tx()
    state = create_state(variables, tx, mesh)
    step = make_train_step(build("resnet18", num_classes=NUM_CLASSES, param_dtype=np.float64), tx, mesh, accum_steps=k)
    losses = []
    for x, y in batches:
        state, metrics = step(state, *shard_batch(mesh, x, y))
        losses.append(float(metrics["loss"]))
    got = {name: v.numpy() for name, v in flax_to_torch(jax.device_get(state.variables), "resnet18").items()}
    errors = rel_errors({name: got[name] for name in want}, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-8, (worst, errors[worst])
    assert got["bn1.num_batches_tracked"] == want["bn1.num_batches_tracked"] == 2 + 2 * k
    # The reported loss is the whole batch's mean, as the chunks' `loss / k` sum to.
    np.testing.assert_allclose(losses, want_losses, rtol=1e-10)


# Half of ResNet-18's depth (one basic block a stage), as tests/test_train_step.py's device-count runs.
def _small(sync_bn=False):
    return ResNet(block="basic", layers=(1, 1, 1, 1), num_classes=NUM_CLASSES, zero_init_residual=True,
                  bn_axis_name="data" if sync_bn else None)


@functools.lru_cache
def _small_variables():
    # Jitted: eagerly, threefry's sampler compiled once per parameter shape (~25 s under load).
    return jax.device_get(jax.jit(_small().init)(jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32)))


def _run_small(devices, k, sync_bn=False, steps=2, batch=16, **options):
    mesh = make_mesh(jax.devices("cpu")[:devices])
    variables = jax.tree.map(lambda v: np.asarray(v, np.float64) if v.dtype == np.float32 else v, _small_variables())
    tx = optim.sgd(0.05, momentum=0.9, weight_decay=1e-4)
    state = create_state(variables, tx, mesh)
    step = make_train_step(_small(sync_bn), tx, mesh, accum_steps=k, **options)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, *shard_batch(mesh, rng.standard_normal((batch, 16, 16, 3)),
                                                  rng.integers(0, NUM_CLASSES, batch)))
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.variables), losses


def _max_rel(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - y)) / max(np.max(np.abs(y)), 1e-30)), a, b)))


def test_accumulation_keeps_sync_bn_independent_of_the_device_count(x64):
    """Pass `j` is the global batch's rows `j (mod k)` on any number of devices, so with
    SyncBatchNorm 4 devices (2 images each per pass) train the weights and statistics of 1."""
    one, loss1 = _run_small(1, 2, sync_bn=True)
    four, loss4 = _run_small(4, 2, sync_bn=True)
    np.testing.assert_allclose(loss4, loss1, rtol=1e-12)
    assert _max_rel(four, one) < 1e-10


def test_without_batch_statistics_accumulation_is_the_one_pass_step(x64):
    """With BatchNorm in eval mode nothing depends on how the batch is split: 4 passes train the
    weights of one, on 2 devices, and with MixUp (which mixes the whole global batch first)."""
    options = dict(batchnorm="eval", mixup_alpha=0.2, seed=3)
    whole, loss1 = _run_small(2, 1, **options)
    passes, loss4 = _run_small(2, 4, **options)
    np.testing.assert_allclose(loss4, loss1, rtol=1e-12)
    assert _max_rel(passes, whole) < 1e-12


@pytest.mark.parametrize("rolled", [True, False])
def test_accumulation_holds_one_passs_activations(monkeypatch, rolled):
    """XLA's memory analysis of the step: 4 passes over 32 images per device need about what one
    pass over 8 does (ResNet-18's half-depth at 64 px: 90 MiB, where one pass over 32 needs 136).
    Scanned (`rolled`, as off XLA:CPU), 93 MiB: of the 24 images more, only the inputs stay.
    Unrolled (XLA:CPU), 115 MiB: the gradients' accumulator (19 MiB) too. Regression: unrolled,
    XLA:CPU interleaved the passes layer by layer and needed 161 MiB, more than one pass over 32."""
    if rolled:
        monkeypatch.setattr(_step, "_UNROLLED_PLATFORMS", frozenset())
    mesh = make_mesh(jax.devices("cpu")[:1])
    tx = optim.sgd(0.05, momentum=0.9)
    state = create_state(_small_variables(), tx, mesh)
    need = {(k, b): _memory.step_bytes(make_train_step(_small(), tx, mesh, donate=False, accum_steps=k), state, mesh,
                                       b, 64) for k, b in ((1, 8), (1, 32), (4, 32))}
    accumulator = 0 if rolled else sum(leaf.nbytes for leaf in jax.tree.leaves(_small_variables()["params"]))
    assert need[4, 32] - need[1, 8] < accumulator + 0.2 * (need[1, 32] - need[1, 8]), need


def test_the_step_refuses_passes_that_do_not_split_the_batch():
    mesh = make_mesh(jax.devices("cpu")[:1])
    tx = optim.sgd(0.1)
    for bad in (0, 2.5, "2", True):
        with pytest.raises(ConfigError, match=rf"`accum_steps` \(={bad!r}\) must be an integer >= 1"):
            make_train_step(_small(), tx, mesh, accum_steps=bad)
    state = create_state(_small_variables(), tx, mesh)
    step = make_train_step(_small(), tx, mesh, accum_steps=4)
    x, y = np.zeros((6, 16, 16, 3), np.float32), np.zeros(6, np.int32)
    with pytest.raises(ConfigError, match=r"`accum_steps` \(=4\) must divide the images per device \(=6\): each pass "
                                          r"takes an equal chunk of them; use one of \[1, 2, 3, 6\]"):
        step(state, *shard_batch(mesh, x, y))


def test_train_accumulates_evaluates_in_passes_and_says_so(tmp_path, monkeypatch):
    """`jaxport train --grad-accum-steps 2`: the start line names the passes, BatchNorm counts
    one update per pass, the evaluation runs at one pass's batch (what the passes fit in
    memory), and a resume with another count says so."""
    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 10, size=(20, 24))  # 18 training images: one step of 16 an epoch
    evaluated, real = [], _loop._evaluate
    monkeypatch.setattr(_loop, "_evaluate", lambda *a, **kw: evaluated.append(a[3]) or real(*a, **kw))
    said = []
    cfg = dict(workdir=str(tmp_path / "w"), data=str(tmp_path / "data"), batch_size=16, image_size=16, devices=2,
               workers=0, progress=False)
    out = train(TrainConfig(grad_accum_steps=2, epochs=1, **cfg), log=said.append)
    assert any("global batch 16 (8 per device, in 2 passes of 4 accumulated into each update)" in m for m in said), said
    assert int(jax.device_get(out["state"].batch_stats["bn1"]["num_batches_tracked"])) == 2
    assert evaluated == [8], evaluated
    said.clear()
    out = train(TrainConfig(grad_accum_steps=4, epochs=2, resume=True, **cfg), log=said.append)
    assert any("--grad-accum-steps 4 (was 2)" in m for m in said), said
    assert int(jax.device_get(out["state"].batch_stats["bn1"]["num_batches_tracked"])) == 2 + 4
    assert evaluated == [8, 4], evaluated


@pytest.mark.parametrize("batch, k, image_size, message", [
    (24, 5, 16, "`--grad-accum-steps` (=5) must divide the images per device (`--batch-size` 24 over 2 device(s): "
                "12) into equal passes; use --grad-accum-steps 2 or 3 or 4 or 6, or --batch-size 20 or 30 "
                "(multiples of 10)"),
    # 16 px: layer4's maps are 1x1, so a pass of one image per device is no train-mode BatchNorm
    (16, 8, 16, "`--grad-accum-steps` (=8) splits the 8 images per device into passes of 1, and at `--image-size` "
                "(=16) layer4's maps are 1x1: train-mode BatchNorm would see one value per channel in each pass, "
                "which torch refuses (every output would be the bias); use --grad-accum-steps 4, or --sync-bn"),
])
def test_train_refuses_passes_that_do_not_fit_the_batch(tmp_path, batch, k, image_size, message):
    with pytest.raises(ConfigError) as err:
        train(TrainConfig(workdir=str(tmp_path / "w"), batch_size=batch, grad_accum_steps=k, image_size=image_size,
                          devices=2, progress=False))
    assert str(err.value) == message


def test_batch_size_auto_searches_one_pass_and_multiplies(tmp_path, monkeypatch):
    """`--batch-size auto --grad-accum-steps 2`: the largest pass per device that fits (here
    the cap: the 1438 digits over 2 devices and 2 passes), times the passes. (XLA's figures
    with passes are tested above; here they are any that fit.)"""
    said, sizes = [], []

    class Picked(Exception):
        pass

    real, calls = _loop.create_state, []

    def stop_at_second(*args, **kwargs):  # the first builds auto's probe state, the second the run's
        calls.append(1)
        if len(calls) == 2:
            raise Picked
        return real(*args, **kwargs)

    monkeypatch.setattr(_loop, "create_state", stop_at_second)
    monkeypatch.setattr(_memory, "step_bytes", lambda step, state, mesh, b, size: sizes.append(b) or 1)
    with pytest.raises(Picked):
        train(TrainConfig(workdir=str(tmp_path / "w"), batch_size="auto", grad_accum_steps=2, image_size=8,
                          devices=2, memory_limit_bytes=2**40, progress=False), log=said.append)
    assert sizes == [4, 512], sizes  # the step compiled for 2 passes of the smallest (2) and of the cap (256)
    assert any(m.startswith("--batch-size auto: 256 per device and pass (x --grad-accum-steps 2: 512 per device), the "
                            "most it picks") for m in said), said


def test_the_out_of_memory_advice_names_more_passes_for_the_same_batch(monkeypatch):
    """After a RESOURCE_EXHAUSTED the advice names the fewest --grad-accum-steps whose step fits
    (keeping --batch-size), beside a smaller batch. The figures: 1 MiB per image of a pass and
    64 MiB of weights (XLA's falling with the passes is tested above)."""
    mib = 1 << 20
    built = []

    def make(model, tx, mesh, *, donate=True, accum_steps=1, **options):
        built.append(accum_steps)
        return accum_steps  # the step, as the fake figures below read it

    monkeypatch.setattr(_loop, "make_train_step", make)
    monkeypatch.setattr(_memory, "step_bytes", lambda k, state, mesh, b, size: (64 + b // k) * mib)
    model = _small()
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                             jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 32, 32, 3))))
    mesh = make_mesh(jax.devices("cpu")[:2])
    for k, limit, advice in [
        # 32 per device failed (96 MiB); 3 passes of 10.7 do not split 32, 4 of 8 (72 MiB) fit 75
        (1, 75, "use --grad-accum-steps 4 (the same --batch-size in passes of 8 per device), or --batch-size 22 "
                "(11 per device), which XLA's memory analysis predicts fit (the failed one: 96 MiB per device)"),
        # already in 2 passes of 16 (80 MiB): 8 passes of 4 are the fewest that fit 68; or 2 passes of 4
        (2, 68, "use --grad-accum-steps 8 (the same --batch-size in passes of 4 per device), or --batch-size 16 (8 per "
                "device in 2 passes), which XLA's memory analysis predicts fit (the failed one: 80 MiB per device)"),
        # no count fits 64 MiB and below, no batch either
        (1, 64, "a batch of 2 per device needs 66 MiB, more than the 64 MiB available; use a smaller --image-size or "
                "model"),
    ]:
        cfg = TrainConfig(workdir="w", image_size=32, grad_accum_steps=k, memory_limit_bytes=limit * mib)
        err = str(_loop._oom_error(model, optim.sgd(0.1), variables, mesh, cfg, 64, 2))
        per = "32 per device" + (f", {k} passes of {32 // k}" if k > 1 else "")
        assert err == f"out of device memory (RESOURCE_EXHAUSTED) at `--batch-size` (=64, {per}); {advice}", err
