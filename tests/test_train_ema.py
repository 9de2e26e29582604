"""`jaxport.train`'s model EMA against torch's `AveragedModel` with torchvision's `ema_avg`.

torchvision's `references/classification/train.py` (`ExponentialMovingAverage`, and `main`'s
decay) is copied below as it stands. The EMA of a ResNet-18 whose weights torch's SGD changes
between updates is compared leaf for leaf: float64 within 1e-12 of the tensor's scale, the
integer `num_batches_tracked` counters and `n_averaged` exactly, warm-up restarts included.
"""
import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision

from jaxport import ConfigError
from jaxport.train import EMA, TrainConfig, ema_decay, init_ema, restart_ema, update_ema
from torch_compat import flax_to_torch, torch_to_flax
from tests.helpers import reference, rel_errors


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):  # torchvision's, verbatim
    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def torchvision_decay(model_ema_decay, model_ema_steps, world_size_x_batch_size, epochs):
    adjust = world_size_x_batch_size * model_ema_steps / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    return 1.0 - alpha


@pytest.mark.parametrize("args", [(0.99998, 32, 1024, 600), (0.99998, 32, 64, 8), (0.999, 4, 32, 4),
                                  (0.9, 32, 64, 8), (1.0, 1, 1, 1), (0.0, 1, 8, 3), (0.5, 3, 7, 11)])
def test_ema_decay_is_torchvision_s(args):
    assert ema_decay(*args) == torchvision_decay(*args)  # the same double arithmetic, bit for bit


@pytest.mark.parametrize("args, flag", [
    ((1.5, 32, 64, 8), "--model-ema-decay"), ((-0.1, 32, 64, 8), "--model-ema-decay"),
    ((float("nan"), 32, 64, 8), "--model-ema-decay"), (("0.9", 32, 64, 8), "--model-ema-decay"),
    ((0.9, 0, 64, 8), "--model-ema-steps"), ((0.9, 2.0, 64, 8), "--model-ema-steps"),
    ((0.9, True, 64, 8), "--model-ema-steps"), ((0.9, 32, 0, 8), "--batch-size"), ((0.9, 32, 64, 0), "--epochs")])
def test_ema_decay_refuses_bad_settings(args, flag):
    with pytest.raises(ConfigError, match=f"`{flag}` \\(="):
        ema_decay(*args)


def _torch_sd(variables, arch="resnet18"):
    return {k: v.numpy() for k, v in flax_to_torch(jax.device_get(variables), arch).items()}


def test_update_matches_torch_averaged_model(x64):
    """Updates after SGD steps, as torchvision's loop makes them, with a warm-up restart after
    the first two (each then a copy) and none after."""
    arch = "resnet18"
    tmodel = torchvision.models.resnet18(num_classes=10).double()
    tmodel.load_state_dict(copy.deepcopy(reference(arch).state_dict()))  # the cached model stays as it is
    decay = ema_decay(0.999, steps=4, global_batch=32, epochs=4)  # 0.968: updates that move the average
    tema = ExponentialMovingAverage(tmodel, decay=decay)
    ema = init_ema(torch_to_flax(tmodel.state_dict(), arch))
    update = jax.jit(update_ema, static_argnames="decay")
    opt = torch.optim.SGD(tmodel.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    tmodel.train()
    for i in range(6):
        for _ in range(2):  # the weights and running statistics move between updates
            x = torch.tensor(rng.standard_normal((4, 3, 32, 32)))
            loss = torch.nn.functional.cross_entropy(tmodel(x), torch.tensor(rng.integers(0, 10, 4)))
            opt.zero_grad()
            loss.backward()
            opt.step()
        tema.update_parameters(tmodel)
        ema = update(ema, torch_to_flax(tmodel.state_dict(), arch), decay=decay)
        if i < 2:  # torchvision's warm-up epochs
            tema.n_averaged.fill_(0)
            ema = restart_ema(ema)
        assert int(ema.n_averaged) == int(tema.n_averaged)
        got, want = _torch_sd(ema.variables), {k: v.numpy() for k, v in tema.module.state_dict().items()}
        assert got.keys() == want.keys() and all(got[k].dtype == want[k].dtype for k in want)
        assert max(rel_errors(got, want).values()) <= 1e-12, i
        counters = [k for k in want if k.endswith("num_batches_tracked")]
        assert {k: int(got[k]) for k in counters} == {k: int(want[k]) for k in counters}, i
        if i <= 2:  # a copy: exactly the model's
            model_sd = tmodel.state_dict()
            assert all(np.array_equal(got[k], model_sd[k].numpy()) for k in want), i
    # The average lags the model: the test would pass for an EMA that copied every time otherwise.
    assert not np.allclose(got["conv1.weight"], tmodel.state_dict()["conv1.weight"].numpy())


def test_update_keeps_dtypes_and_copies_first():
    variables = {"params": {"w": jnp.array([1.0, 2.0], jnp.float32)},
                 "batch_stats": {"num_batches_tracked": jnp.array(9, jnp.int32)}}
    ema = init_ema(variables)
    assert isinstance(ema, EMA) and int(ema.n_averaged) == 0
    poisoned = ema.replace(variables=jax.tree.map(lambda x: jnp.full_like(x, -1), ema.variables))
    new = {"params": {"w": jnp.array([3.0, 5.0], jnp.float32)},
           "batch_stats": {"num_batches_tracked": jnp.array(10, jnp.int32)}}
    first = update_ema(poisoned, new, 0.9)  # n_averaged 0: the model's variables, whatever was held
    assert jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), first.variables, new) == jax.tree.map(
        lambda _: True, new)
    second = jax.jit(update_ema, static_argnames="decay")(first, variables, decay=0.75)
    w, n = second.variables["params"]["w"], second.variables["batch_stats"]["num_batches_tracked"]
    assert (w.dtype, n.dtype, int(second.n_averaged)) == (jnp.float32, jnp.int32, 2)
    np.testing.assert_array_equal(w, np.float32(0.75) * np.float32([3, 5]) + np.float32(0.25) * np.float32([1, 2]))
    assert int(n) == 9  # 0.75 * 10 + 0.25 * 9 = 9.75, truncated as torch's copy_ into int64 does
    assert int(restart_ema(second).n_averaged) == 0


@pytest.mark.parametrize("other, match", [
    ({"params": {"w": jnp.zeros(1)}}, r"`variables`\['params'\]\['w'\] is float32\[1\], the EMA's is float32\[2\]"),
    ({"params": {"w": jnp.zeros(2, jnp.bfloat16)}}, r"is bfloat16\[2\], the EMA's is float32\[2\]"),
    ({"params": {"v": jnp.zeros(2)}}, "not of the EMA's structure")])
def test_update_refuses_other_variables(other, match):
    ema = init_ema({"params": {"w": jnp.zeros(2)}})
    with pytest.raises(ConfigError, match=match):
        update_ema(ema, other, 0.9)


@pytest.mark.parametrize("decay", [1.5, -0.5, float("nan"), "0.9"])
def test_update_refuses_bad_decay(decay):
    with pytest.raises(ConfigError, match=r"`decay` \(="):
        update_ema(init_ema({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)}, decay)


@pytest.mark.parametrize("decay", [0.99998, ema_decay(0.99998, 32, 64, 8), 0.5])
def test_float32_update_is_torch_s(decay):
    """float32 leaves: `decay` and `1 - decay` (in double) each rounded to float32, each product
    and the sum rounded, as torch does: eager, bit for bit (`1 - float32(decay)` was a float32 ulp
    off in a quarter of them for 0.99998). Jitted, XLA:CPU fuses a product and the sum into one
    FMA, which rounds once where torch rounds twice: an ulp of a product and one of the sum off,
    at most."""
    rng = np.random.default_rng(1)
    avg, new = (rng.standard_normal(100_000).astype(np.float32) for _ in range(2))
    ema = EMA({"w": jnp.asarray(avg)}, jnp.ones((), jnp.int32))
    want = (decay * torch.tensor(avg) + (1 - decay) * torch.tensor(new)).numpy()
    eager = update_ema(ema, {"w": jnp.asarray(new)}, decay=decay).variables["w"]
    np.testing.assert_array_equal(np.asarray(eager), want)
    jitted = jax.jit(update_ema, static_argnames="decay")(ema, {"w": jnp.asarray(new)}, decay=decay).variables["w"]
    # The product's rounding that FMA skips (half an ulp of it, not of the sum where the sum
    # cancels) and the two roundings of the sum: an ulp of each, at most.
    products = np.maximum(np.abs(np.float32(decay) * avg), np.abs(np.float32(1 - decay) * new))
    assert np.all(np.abs(np.asarray(jitted) - want) <= np.spacing(products) + np.spacing(np.abs(want)))


@pytest.mark.slow
def test_jaxport_train_model_ema_is_torchvisions_through_a_resume(tmp_path, capsys):
    """`jaxport train --model-ema` (in this process, over its 8 devices), stopped mid-epoch by
    --max-steps and resumed: its final EMA is torch's `ExponentialMovingAverage` fed the run's
    own weights (every step checkpointed) on torchvision's schedule: an update after each
    `i % --model-ema-steps == 0` step of an epoch, `n_averaged` reset in the warm-up epoch.
    float32, compared within 1e-6 of each tensor's scale (jit's FMA, `update_ema`); counters
    exactly. metrics.jsonl holds the EMA's evaluation; `jaxport export --ema` loads strictly.
    A 2-class folder of 80 images (4 steps an epoch at batch 16, not a multiple of the 3 steps
    between updates) keeps it to the compilations."""
    from jaxport import load_variables
    from jaxport._cli import main
    from jaxport.train import _checkpoint
    from tests.helpers import write_images

    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 40)  # 72 train / 8 val
    work = tmp_path / "w"
    flags = ["train", "--workdir", str(work), "--data", str(tmp_path / "data"), "--workers", "0", "--image-size", "16",
             "--batch-size", "16", "--epochs", "3", "--checkpoint-every", "1", "--keep-checkpoints", "100",
             "--no-progress", "--lr-warmup-epochs", "1", "--model-ema", "--model-ema-steps", "3",
             "--model-ema-decay", "0.99"]
    assert main(flags + ["--max-steps", "6"]) == 0, capsys.readouterr().err
    # Dropping --model-ema on resume is refused before any work (and adding it, `_check_optimizer_state`).
    assert main([f for f in flags if f != "--model-ema"] + ["--resume"]) == 2
    assert "--resume: the run in" in capsys.readouterr().err
    assert main(flags + ["--resume"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "resuming from step 6\n" in err and "| EMA val loss " in err, err

    steps_per_epoch, decay = 4, ema_decay(0.99, steps=3, global_batch=16, epochs=3)
    mngr = _checkpoint.manager(str(work), reader=True)
    try:
        assert sorted(mngr.all_steps()) == list(range(1, 13))
        # Only the steps an update follows are read (a read is ~1 s of orbax; the loop skips the rest).
        states = {s: _checkpoint._read_as_saved(mngr, s)[0] for s in range(1, 13) if (s - 1) % steps_per_epoch % 3 == 0}
        saved_ema, _ = _checkpoint._read_as_saved(mngr, 12, "ema")
    finally:
        mngr.close()
    tmodel = torchvision.models.resnet18(num_classes=2)
    tema = None
    for gstep in range(1, 13):
        epoch, i = divmod(gstep - 1, steps_per_epoch)
        if i % 3:  # i restarts each epoch: updates after steps 1, 4, 5, 8, 9, 12
            continue
        variables = {"params": states[gstep]["params"], "batch_stats": states[gstep]["batch_stats"]}
        tmodel.load_state_dict(flax_to_torch(variables, "resnet18"))
        if tema is None:
            tema = ExponentialMovingAverage(tmodel, decay=decay)
        tema.update_parameters(tmodel)
        if epoch < 1:
            tema.n_averaged.fill_(0)
    want = {k: v.numpy() for k, v in tema.module.state_dict().items()}
    final = load_variables(str(work / "variables_ema.safetensors"))
    got = _torch_sd(final)
    assert max(rel_errors(got, want).values()) <= 1e-6
    counters = [k for k in want if k.endswith("num_batches_tracked")]
    assert all(int(got[k]) == int(want[k]) for k in counters)
    assert int(saved_ema["n_averaged"]) == int(tema.n_averaged) == 4  # epochs 2 and 3, 2 updates each
    assert _torch_sd(saved_ema["variables"]).keys() == got.keys()
    assert all(np.array_equal(v, got[k]) for k, v in _torch_sd(saved_ema["variables"]).items())
    # The average is not the weights: the plain final file is the last step's.
    plain = _torch_sd(load_variables(str(work / "variables.safetensors")))
    assert not np.allclose(plain["conv1.weight"], got["conv1.weight"])

    rows = [json.loads(line) for line in open(work / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert all(0 <= r["val_acc_ema"] <= 1 and np.isfinite(r["val_loss_ema"]) for r in rows)

    out = tmp_path / "ema.pt"
    assert main(["export", str(work), "--ema", "--out", str(out)]) == 0
    assert "read: step 12 (its --model-ema average)" in capsys.readouterr().out
    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(torch.load(out), strict=True)
    assert all(np.array_equal(v.numpy(), got[k]) for k, v in model.state_dict().items())


def test_a_resume_adding_or_dropping_model_ema_is_refused():
    """The EMA of the steps already trained would be missing (added) or left stale (dropped).
    Checkpoints from before the flag trained without it, and resume without it silently."""
    from jaxport.train import _loop

    now = _loop._settings(TrainConfig(workdir="w"))
    old = {k: v for k, v in now.items() if not k.startswith("model_ema")}  # recorded before the flag
    _loop._check_optimizer_state(old, now, "w")
    assert _loop._changes(old, now) == ""
    with pytest.raises(ConfigError, match=r"^--resume: `--model-ema` cannot be added to the run in w, trained without "
                                          r"it: .*; resume without --model-ema, or start a new --workdir"):
        _loop._check_optimizer_state(old, now | {"model_ema": True}, "w")
    with pytest.raises(ConfigError, match=r"^--resume: the run in w was trained with --model-ema: resume with "
                                          r"--model-ema \(its EMA continues\), or start a new --workdir without it"):
        _loop._check_optimizer_state(now | {"model_ema": True}, now, "w")
    ema = now | {"model_ema": True}
    assert _loop._changes(ema, ema | {"model_ema_steps": 4, "model_ema_decay": 0.999}) == (
        " with changed settings: --model-ema-steps 4 (was 32), --model-ema-decay 0.999 (was 0.99998)")


def test_export_ema_of_a_workdir_without_one_is_refused(tmp_path, capsys):
    from jaxport._cli import main
    from jaxport.train import _checkpoint

    mngr = _checkpoint.manager(str(tmp_path / "w"))
    try:
        _checkpoint.save(mngr, 3, {"step": np.int32(3), "params": {"w": np.ones(2, np.float32)}, "batch_stats": {}},
                         {"arch": "resnet18"})
    finally:
        mngr.close()
    assert main(["export", str(tmp_path / "w"), "--ema", "--out", str(tmp_path / "m.pt")]) == 2
    assert capsys.readouterr().err == (f"jaxport: error: checkpoint step 3 in {tmp_path / 'w' / 'checkpoints'} holds "
                                       "no EMA: its run was trained without --model-ema\n")
    (tmp_path / "v.safetensors").write_bytes(b"")
    assert main(["export", str(tmp_path / "v.safetensors"), "--ema", "--out", str(tmp_path / "m.pt")]) == 2
    assert "`--ema` (the average of a `jaxport train --model-ema` run) takes a workdir" in capsys.readouterr().err
    assert not (tmp_path / "m.pt").exists()
