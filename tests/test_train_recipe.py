"""torchvision's classification recipe (`--opt`, `--lr-scheduler`, warm-up, `--norm-weight-decay`,
`--bias-weight-decay`, `--clip-grad-norm`) against torch, built in each test exactly as `references/classification/train.py`
builds it: the learning rates of a whole run, the weight decay groups of three architectures,
and optimizer steps in float64. Then one `jaxport train` run with a recipe, and its `--resume`.
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torchvision
from torchvision.ops._utils import split_normalization_params

from jaxport._cli import main
from jaxport._errors import ConfigError
from jaxport.models import build
from jaxport.train import TrainConfig
from jaxport.train import _loop, _recipe
from tests.helpers import write_images
from torch_compat import table

L = torch.optim.lr_scheduler


def _cfg(**kw) -> TrainConfig:
    """A TrainConfig with the recipe `kw`, checked and named as `train` takes it."""
    cfg = TrainConfig(workdir="w", **kw)
    _recipe.check(cfg)
    return _loop._plain(cfg)


def _torch_scheduler(cfg: TrainConfig, opt: torch.optim.Optimizer):
    """torchvision's train.py: the main scheduler, then the warm-up, joined by SequentialLR."""
    name = cfg.lr_scheduler.lower()
    if name == "steplr":
        main_lr_scheduler = L.StepLR(opt, step_size=cfg.lr_step_size, gamma=cfg.lr_gamma)
    elif name == "cosineannealinglr":
        main_lr_scheduler = L.CosineAnnealingLR(opt, T_max=cfg.epochs - cfg.lr_warmup_epochs, eta_min=cfg.lr_min)
    else:
        assert name == "exponentiallr"
        main_lr_scheduler = L.ExponentialLR(opt, gamma=cfg.lr_gamma)
    if cfg.lr_warmup_epochs <= 0:
        return main_lr_scheduler
    if cfg.lr_warmup_method == "linear":
        warmup = L.LinearLR(opt, start_factor=cfg.lr_warmup_decay, total_iters=cfg.lr_warmup_epochs)
    else:
        assert cfg.lr_warmup_method == "constant"
        warmup = L.ConstantLR(opt, factor=cfg.lr_warmup_decay, total_iters=cfg.lr_warmup_epochs)
    return L.SequentialLR(opt, schedulers=[warmup, main_lr_scheduler], milestones=[cfg.lr_warmup_epochs])


def _torch_lrs(cfg: TrainConfig, steps_per_epoch: int) -> np.ndarray:
    """The lr of each training step of a whole run in torch: `param_groups[0]["lr"]` at each
    `optimizer.step()`, the scheduler stepped after each epoch (as train.py does)."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    sched = _torch_scheduler(cfg, opt)
    lrs = []
    for _ in range(cfg.epochs):
        for _ in range(steps_per_epoch):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
        sched.step()
    return np.array(lrs)


RECIPES = [
    dict(lr_scheduler="cosineannealinglr", epochs=7),
    dict(lr_scheduler="cosineannealinglr", epochs=7, lr_min=1e-3, lr_warmup_epochs=2, lr_warmup_method="linear"),
    # 0.0123 and an eta_min: torch restarts the cosine at its closed form, 0.012300000000000002
    dict(lr_scheduler="cosineannealinglr", epochs=6, lr=0.0123, lr_min=1e-3, lr_warmup_epochs=1,
         lr_warmup_method="constant"),
    dict(lr_scheduler="cosineannealinglr", epochs=5, lr_warmup_epochs=4, lr_warmup_method="linear",
         lr_warmup_decay=0.25),
    dict(lr_scheduler="steplr", epochs=9, lr_step_size=2, lr_gamma=0.5),
    dict(lr_scheduler="steplr", epochs=9, lr_step_size=3, lr_warmup_epochs=2, lr_warmup_method="linear",
         lr_warmup_decay=0.1),
    # 0.1 * 0.1 * (1 / 0.1): ConstantLR returns an ulp above the lr
    dict(lr_scheduler="steplr", epochs=8, lr_step_size=1, lr_gamma=0.7, lr_warmup_epochs=3,
         lr_warmup_method="constant", lr_warmup_decay=0.1),
    dict(lr_scheduler="exponentiallr", epochs=8, lr_gamma=0.8),
    dict(lr_scheduler="exponentiallr", epochs=8, lr_gamma=0.9, lr_warmup_epochs=2, lr_warmup_method="constant"),
    dict(lr_scheduler="exponentiallr", epochs=6, lr_gamma=0.95, lr_warmup_epochs=1, lr_warmup_method="linear",
         lr_warmup_decay=0.5),
]


@pytest.mark.parametrize("steps_per_epoch", [3])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
def test_every_steps_lr_is_torchs_over_a_whole_run(recipe, steps_per_epoch):
    """The lr the optimizer applies at each step (plain SGD on a unit gradient: the update is
    `-lr`), over every step of the run, equals the lr torch's scheduler set for that step."""
    cfg = _cfg(**{"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, **recipe})
    want = _torch_lrs(cfg, steps_per_epoch)
    tx = _recipe.optimizer(cfg, steps_per_epoch)
    params = {"w": jnp.ones(())}

    @jax.jit
    def run(state):
        def step(state, _):
            u, state = tx.update(params, state, params)  # the gradient: 1
            return state, -u["w"]
        return jax.lax.scan(step, state, length=len(want))[1]

    got = np.asarray(run(tx.init(params)))
    # float32: the lr is torch's Python float rounded once (2**-24 relative), times a gradient of 1
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    # and the schedule itself, in float64, is torch's float exactly: what metrics.jsonl reports
    epochs = [_recipe.epoch_lr(cfg, e) for e in range(cfg.epochs)]
    np.testing.assert_array_equal(epochs, want[::steps_per_epoch])


@pytest.mark.parametrize("arch", ["resnet18", "resnet50", "resnext50_32x4d"])
def test_norm_labels_are_torchvisions_split_normalization_params(arch):
    """The parameters `--norm-weight-decay` applies to are the ones torchvision's
    `split_normalization_params` puts in its first group, by their torch names (the converter's
    table maps each Flax leaf to its torch key)."""
    model = getattr(torchvision.models, arch)(num_classes=10)
    norm, other = split_normalization_params(model)
    name = {id(p): n for n, p in model.named_parameters()}
    want_norm, want_other = {name[id(p)] for p in norm}, {name[id(p)] for p in other}
    assert want_norm and want_other

    shapes = jax.eval_shape(build(arch, num_classes=10).init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    labels = _recipe.norm_labels(shapes["params"])
    torch_key = {e.flax_key: e.torch_key for e in table(arch, 10)}
    got = {"norm": set(), "other": set()}
    for path, label in jax.tree_util.tree_leaves_with_path(labels):
        got[label].add(torch_key["/".join(("params", *(p.key for p in path)))])
    assert got["norm"] == want_norm
    assert got["other"] == want_other


def _set_weight_decay(model, weight_decay, norm_weight_decay=None, custom_keys_weight_decay=None):
    """torchvision's `references/classification/utils.py` `set_weight_decay` (not in the
    package), as train.py calls it since --bias-weight-decay: the param groups, "other", "norm"
    and one per custom key, each with its weight decay; a custom key is matched first."""
    norm_classes = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,
                    torch.nn.modules.instancenorm._InstanceNorm, torch.nn.LocalResponseNorm)
    params = {"other": [], "norm": []}
    params_weight_decay = {"other": weight_decay, "norm": norm_weight_decay}
    custom_keys = []
    for key, wd in custom_keys_weight_decay or []:
        params[key] = []
        params_weight_decay[key] = wd
        custom_keys.append(key)

    def _add_params(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_custom_key = False
            for key in custom_keys:
                target_name = f"{prefix}.{name}" if prefix != "" and "." in key else name
                if key == target_name:
                    params[key].append(p)
                    is_custom_key = True
                    break
            if not is_custom_key:
                if norm_weight_decay is not None and isinstance(module, norm_classes):
                    params["norm"].append(p)
                else:
                    params["other"].append(p)
        for child_name, child_module in module.named_children():
            _add_params(child_module, prefix=f"{prefix}.{child_name}" if prefix != "" else child_name)

    _add_params(model)
    return [{"params": params[k], "weight_decay": params_weight_decay[k], "name": k} for k in params if params[k]]


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
@pytest.mark.parametrize("norm, bias", [(True, False), (False, True), (True, True)])
def test_group_labels_are_torchvisions_set_weight_decay(arch, norm, bias):
    """The groups of `--norm-weight-decay` and `--bias-weight-decay` are the ones torchvision's
    `set_weight_decay` makes, by torch name; every BatchNorm's bias goes with the biases."""
    model = getattr(torchvision.models, arch)(num_classes=10)
    groups = _set_weight_decay(model, 1e-4, 0.0 if norm else None, [("bias", 0.0)] if bias else None)
    name = {id(p): n for n, p in model.named_parameters()}
    want = {g["name"]: {name[id(p)] for p in g["params"]} for g in groups}
    assert set(want) == {"other", *["norm"] * norm, *["bias"] * bias}

    shapes = jax.eval_shape(build(arch, num_classes=10).init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    labels = _recipe.group_labels(shapes["params"], norm=norm, bias=bias)
    torch_key = {e.flax_key: e.torch_key for e in table(arch, 10)}
    got: dict = {}
    for path, label in jax.tree_util.tree_leaves_with_path(labels):
        got.setdefault(label, set()).add(torch_key["/".join(("params", *(p.key for p in path)))])
    assert got == want


class _Tiny(torch.nn.Module):
    """A ResNet's kinds of parameters: a conv, a BatchNorm, a classifier with a bias."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 5)


# torch name -> Flax path and the axes torch's layout is permuted by (torch_compat's rules)
_FLAX = {"conv1.weight": (("conv1", "kernel"), (2, 3, 1, 0)), "bn1.weight": (("bn1", "scale"), None),
         "bn1.bias": (("bn1", "bias"), None), "fc.weight": (("fc", "kernel"), (1, 0)), "fc.bias": (("fc", "bias"), None)}


def _to_flax(tensors: dict) -> dict:
    tree: dict = {}
    for name, value in tensors.items():
        (module, leaf), perm = _FLAX[name]
        tree.setdefault(module, {})[leaf] = np.transpose(value, perm) if perm else value
    return tree


def _torch_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torchvision's train.py: before --bias-weight-decay (`split_normalization_params`), and since."""
    if cfg.bias_weight_decay is not None:
        parameters = _set_weight_decay(model, cfg.weight_decay, cfg.norm_weight_decay,
                                       [("bias", cfg.bias_weight_decay)])
    elif cfg.norm_weight_decay is None:
        parameters = model.parameters()
    else:
        param_groups = split_normalization_params(model)
        wd_groups = [cfg.norm_weight_decay, cfg.weight_decay]
        parameters = [{"params": p, "weight_decay": w} for p, w in zip(param_groups, wd_groups) if p]
    opt_name = cfg.opt.lower()
    if opt_name.startswith("sgd"):
        return torch.optim.SGD(parameters, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               nesterov="nesterov" in opt_name)
    if opt_name == "rmsprop":
        return torch.optim.RMSprop(parameters, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                                   eps=0.0316, alpha=0.9)
    assert opt_name == "adamw"
    return torch.optim.AdamW(parameters, lr=cfg.lr, weight_decay=cfg.weight_decay)


@pytest.mark.parametrize("recipe", [
    dict(opt="sgd-nesterov", lr=0.1, weight_decay=1e-2, norm_weight_decay=0.0, clip_grad_norm=0.5),
    dict(opt="adamw", lr=0.01, weight_decay=0.05, norm_weight_decay=0.0, clip_grad_norm=0.5),
    dict(opt="sgd", lr=0.1, weight_decay=1e-2, norm_weight_decay=1e-3),
    dict(opt="sgd", lr=0.1, weight_decay=1e-2, norm_weight_decay=1e-3, bias_weight_decay=0.0),
    dict(opt="adamw", lr=0.01, weight_decay=0.05, bias_weight_decay=0.2),
    dict(opt="RMSprop", lr=0.01, momentum=0.9, weight_decay=1e-2, norm_weight_decay=0.0, clip_grad_norm=0.5),
    dict(opt="rmsprop", lr=0.01, momentum=0.0, weight_decay=1e-2, bias_weight_decay=1e-3),
])
def test_optimizer_steps_are_torchs_with_param_groups_and_clipping(x64, recipe):
    """Three steps (one per epoch: a linear warm-up, then a StepLR) in float64: the weights
    equal torch's, its param groups built and its gradients clipped as train.py does."""
    cfg = _cfg(epochs=3, lr_scheduler="steplr", lr_step_size=1, lr_gamma=0.5, lr_warmup_epochs=1,
               lr_warmup_method="linear", lr_warmup_decay=0.1, **recipe)
    model = _Tiny().double()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(p.shape)))
    params = _to_flax({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    grads = [{n: rng.standard_normal(p.shape) for n, p in model.named_parameters()} for _ in range(3)]

    opt = _torch_optimizer(cfg, model)
    sched = _torch_scheduler(cfg, opt)
    for g in grads:
        for n, p in model.named_parameters():
            p.grad = torch.from_numpy(g[n].copy())  # (clip_grad_norm_ scales it in place)
        if cfg.clip_grad_norm is not None:  # the gradients' norm is ~7: every step is clipped
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        opt.step()
        sched.step()
    want = _to_flax({n: p.detach().numpy() for n, p in model.named_parameters()})

    tx = _recipe.optimizer(cfg, steps_per_epoch=1)
    p = jax.tree.map(jnp.asarray, params)
    state, update = tx.init(p), jax.jit(tx.update)
    for g in grads:
        u, state = update(jax.tree.map(jnp.asarray, _to_flax(g)), state, p)
        p = optax.apply_updates(p, u)
    assert p["bn1"]["scale"].dtype == jnp.float64
    # float64: the same operations in another order, ~1e-16 per operation
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=0), jax.tree.map(np.asarray, p), want)
    # and each setting matters here: without the norm or bias group (or the clip), the weights differ
    groups = [dict(**{k: None}) for k in ("norm_weight_decay", "bias_weight_decay") if getattr(cfg, k) is not None]
    for changed in (*groups, dict(clip_grad_norm=None if cfg.clip_grad_norm else 0.5)):
        other = _recipe.optimizer(dataclasses.replace(cfg, **changed), steps_per_epoch=1)
        q, s, step = jax.tree.map(jnp.asarray, params), other.init(p), jax.jit(other.update)
        for g in grads:
            u, s = step(jax.tree.map(jnp.asarray, _to_flax(g)), s, q)
            q = optax.apply_updates(q, u)
        assert not all(np.allclose(a, b, rtol=1e-10, atol=0) for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(want)))


def test_clipping_keeps_the_optimizer_state_as_it_is():
    """Clipping keeps no state, so a resumed run can turn it on or off (after a divergence)."""
    params = {"bn1": {"scale": jnp.ones(3), "bias": jnp.zeros(3)}, "fc": {"kernel": jnp.ones((3, 2))}}
    for recipe in (dict(), dict(opt="adamw"), dict(opt="rmsprop"), dict(norm_weight_decay=0.0), dict(bias_weight_decay=0.0)):
        plain = _recipe.optimizer(_cfg(**recipe), 5).init(params)
        clipped = _recipe.optimizer(_cfg(clip_grad_norm=1.0, **recipe), 5).init(params)
        assert jax.tree.structure(plain) == jax.tree.structure(clipped)


SGD = {"epochs": 8, "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "sync_bn": False, "bn_stats": "mean",
       "label_smoothing": 0.0, "dtype": "float32"}  # what checkpoints recorded before the recipe's settings
NOW = dict(_loop._settings(_cfg()))


@pytest.mark.parametrize("change, said", [
    (dict(opt="sgd-nesterov"), "--opt sgd-nesterov (was sgd)"),  # the same momentum buffer
    (dict(lr_scheduler="steplr"), "--lr-scheduler steplr (was cosineannealinglr)"),
    (dict(lr_gamma=0.5), "--lr-gamma 0.5 (was 0.1)"),
    (dict(lr_warmup_epochs=2, lr_warmup_method="linear"), "--lr-warmup-epochs 2 (was 0), --lr-warmup-method linear "
                                                          "(was constant)"),
    (dict(clip_grad_norm=1.0), "--clip-grad-norm 1.0 (was off)"),
    (dict(weight_decay=1e-4), "--weight-decay 0.0001 (was 0.0005)"),
])
def test_a_resume_says_each_recipe_change(change, said):
    assert _loop._changes(SGD, NOW | change, trains=True) == f" with changed settings: {said}"
    _loop._check_optimizer_state(SGD, NOW | change, "w")


def test_a_checkpoint_from_before_the_recipe_resumes_silently():
    """Checkpoints that do not record the recipe's settings trained with its defaults."""
    assert _loop._changes(SGD, NOW) == ""
    _loop._check_optimizer_state(SGD, NOW, "w")
    assert _loop._changes(SGD, NOW | {"epochs": 9}) == (" with changed settings: --epochs 9 (was 8) (the cosine "
                                                         "schedule now ends at the new --epochs)")
    # another scheduler does not depend on --epochs
    assert _loop._changes(SGD | {"lr_scheduler": "steplr"}, NOW | {"epochs": 9, "lr_scheduler": "steplr"}) == (
        " with changed settings: --epochs 9 (was 8)")
    # AdamW keeps its decay step at 0 (and has no momentum): both may change
    adamw = NOW | {"opt": "adamw"}
    _loop._check_optimizer_state(adamw, adamw | {"weight_decay": 0.0, "momentum": 0.0}, "w")
    _loop._check_optimizer_state(adamw | {"norm_weight_decay": 0.0}, adamw | {"norm_weight_decay": 1e-5}, "w")
    _loop._check_optimizer_state(adamw | {"bias_weight_decay": 0.0}, adamw | {"bias_weight_decay": 1e-5}, "w")
    _loop._check_optimizer_state(NOW | {"bias_weight_decay": 1e-5}, NOW | {"bias_weight_decay": 1e-4}, "w")
    assert _loop._changes(NOW | {"bias_weight_decay": 1e-5}, NOW | {"bias_weight_decay": 1e-4}) == (
        " with changed settings: --bias-weight-decay 0.0001 (was 1e-05)")


@pytest.mark.parametrize("saved, now, message", [
    (SGD, NOW | {"opt": "adamw"}, "--resume: `--opt` (=adamw) cannot continue the run in w, trained with --opt sgd: "
                                  "SGD, AdamW and RMSprop keep different optimizer states (a momentum buffer; two "
                                  "moment estimates; a squared-gradient average), so the checkpoint cannot be "
                                  "restored; resume with --opt sgd, or start a new --workdir (--init w starts it from "
                                  "these weights)"),
    (SGD, NOW | {"opt": "rmsprop"}, "--resume: `--opt` (=rmsprop) cannot continue the run in w, trained with --opt "
                                    "sgd: SGD, AdamW and RMSprop keep different optimizer states"),
    (NOW | {"opt": "rmsprop"}, NOW | {"opt": "rmsprop", "momentum": 0.0}, "--resume: `--momentum` (=0.0) cannot "
                                                                         "continue the run in w, trained with "
                                                                         "--momentum 0.9: changing it to or from 0"),
    (SGD, NOW | {"norm_weight_decay": 0.0}, "--resume: `--norm-weight-decay` (=0.0) cannot continue the run in w, "
                                            "trained without it: a --norm-weight-decay keeps the BatchNorm "
                                            "parameters' optimizer state apart from the others' (torch's param "
                                            "groups), so the checkpoint cannot be restored; resume without "
                                            "--norm-weight-decay, or start a new --workdir"),
    (NOW | {"norm_weight_decay": 0.0}, NOW | {"norm_weight_decay": 0.0, "bias_weight_decay": 0.0},
     "--resume: `--bias-weight-decay` (=0.0) cannot continue the run in w, trained without it: a --bias-weight-decay "
     "keeps the biases' optimizer state apart from the others' (torch's param groups), so the checkpoint cannot be "
     "restored; resume without --bias-weight-decay, or start a new --workdir"),
    (NOW | {"bias_weight_decay": 1e-5}, NOW | {"bias_weight_decay": 0.0},
     "--resume: `--bias-weight-decay` (=0.0) cannot continue the run in w, trained with --bias-weight-decay 1e-05: "
     "changing it to or from 0 changes what the optimizer keeps"),
    (NOW | {"norm_weight_decay": 0.0}, NOW, "--resume: `--norm-weight-decay` (=not given) cannot continue the run in "
                                            "w, trained with --norm-weight-decay 0.0: a --norm-weight-decay keeps"),
    (NOW | {"norm_weight_decay": 0.0}, NOW | {"norm_weight_decay": 1e-5},
     "--resume: `--norm-weight-decay` (=1e-05) cannot continue the run in w, trained with --norm-weight-decay 0.0: "
     "changing it to or from 0 changes what the optimizer keeps (its state), so the checkpoint cannot be restored; "
     "resume with a --norm-weight-decay that is 0, or start a new --workdir"),
    (SGD, NOW | {"weight_decay": 0.0}, "--resume: `--weight-decay` (=0.0) cannot continue the run in w, trained "
                                       "with --weight-decay 0.0005: changing it to or from 0"),
])
def test_a_resume_into_another_optimizer_state_is_refused_naming_the_flag(saved, now, message):
    with pytest.raises(ConfigError) as e:
        _loop._check_optimizer_state(saved, now, "w")
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.slow
def test_jaxport_train_with_a_recipe_reports_torchs_lr_and_resumes(tmp_path, capsys):
    """`jaxport train` (in this process, over its 8 devices) with torchvision's flags: each
    epoch's lr in metrics.jsonl is torch's, a --resume with another --opt is refused before any
    work, and one with another --lr-gamma and no --clip-grad-norm restores and says so. A
    2-class folder of 40 images (2 steps an epoch) keeps it to the compilations."""
    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 20)  # 36 train / 4 val
    work = tmp_path / "w"
    recipe = ["--opt", "AdamW", "--lr", "1e-3", "--wd", "0.05", "--lr-scheduler", "steplr", "--lr-step-size", "1",
              "--lr-gamma", "0.1", "--lr-warmup-epochs", "1", "--lr-warmup-method", "linear", "--norm-weight-decay",
              "0", "--clip-grad-norm", "1"]
    flags = ["train", "--workdir", str(work), "--data", str(tmp_path / "data"), "--workers", "0", "--image-size", "16",
             "--batch-size", "16", "--epochs", "2", "--checkpoint-every", "1000", "--no-progress"]
    assert main(flags + recipe) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in open(work / "metrics.jsonl")]
    cfg = _cfg(opt="adamw", lr=1e-3, epochs=2, lr_scheduler="steplr", lr_step_size=1, lr_gamma=0.1,
               lr_warmup_epochs=1, lr_warmup_method="linear")
    assert [r["lr"] for r in rows] == list(_torch_lrs(cfg, 1))  # 1e-05, 0.001: the warm-up, then StepLR restarted
    capsys.readouterr()

    assert main(flags + recipe + ["--resume", "--opt", "sgd"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxport: error: --resume: `--opt` (=sgd) cannot continue the run in {work}, trained with "
                          "--opt adamw: ") and "resume with --opt adamw" in err and err.count("\n") == 1, err

    assert main(flags + recipe[:-2] + ["--resume", "--lr-gamma", "0.5"]) == 0
    err = capsys.readouterr().err
    assert ("resuming from step 4 with changed settings: --lr-gamma 0.5 (was 0.1), no --clip-grad-norm (was 1.0)\n"
            in err), err
