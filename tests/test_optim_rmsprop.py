"""`torch_compat.optim.rmsprop` against `torch.optim.RMSprop`, update for update."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxport._errors import ConfigError
from torch_compat.optim import rmsprop

SETTINGS = [
    {},  # torch's defaults
    dict(momentum=0.9),
    dict(alpha=0.9, eps=0.0316, momentum=0.9, weight_decay=1e-5),  # torchvision's --opt rmsprop
    dict(weight_decay=1e-2, momentum=0.5, centered=True),
    dict(centered=True, maximize=True),
]


def _steps(dtype, settings, lr=0.01, steps=5, schedule=False):
    rng = np.random.default_rng(0)
    p0 = {"w": rng.standard_normal((4, 5)).astype(dtype), "b": rng.standard_normal(5).astype(dtype)}
    grads = [{k: rng.standard_normal(v.shape).astype(dtype) for k, v in p0.items()} for _ in range(steps)]
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in p0.items()}
    opt = torch.optim.RMSprop(list(tensors.values()), lr=lr, **settings)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    lr_arg = optax.piecewise_constant_schedule(lr, {2: 0.5, 4: 0.5}) if schedule else lr
    tx = rmsprop(lr_arg, **settings)
    p = jax.tree.map(jnp.asarray, p0)
    state, update = tx.init(p), jax.jit(tx.update)
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.from_numpy(g[k].copy())
        opt.step()
        if sched is not None:
            sched.step()
        u, state = update(jax.tree.map(jnp.asarray, g), state, p)
        p = optax.apply_updates(p, u)
    return {k: np.asarray(v) for k, v in p.items()}, {k: t.detach().numpy() for k, t in tensors.items()}


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()) or "defaults")
@pytest.mark.parametrize("dtype, rtol", [(np.float64, 1e-13), (np.float32, 2e-5)])
def test_five_steps_are_torchs(x64, settings, dtype, rtol):
    got, want = _steps(dtype, settings)
    for k in want:
        assert got[k].dtype == want[k].dtype
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=0)
    # every setting moves the weights: the comparison can tell them apart
    if settings:
        other, _ = _steps(dtype, {})
        assert not np.allclose(other["w"], want["w"], rtol=rtol, atol=0)


def test_a_schedule_is_torchs_scheduler(x64):
    got, want = _steps(np.float64, dict(momentum=0.9), schedule=True)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-13, atol=0)


def test_inject_hyperparams_changes_the_lr_as_torchs_param_groups(x64):
    params = {"w": jnp.ones(3, jnp.float64)}
    tx = optax.inject_hyperparams(rmsprop)(0.1, momentum=0.9)
    state = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.05)
    u, _ = tx.update({"w": jnp.full(3, 2.0, jnp.float64)}, state, params)
    t = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.RMSprop([t], lr=0.1, momentum=0.9)
    opt.param_groups[0]["lr"] = 0.05
    t.grad = torch.full((3,), 2.0, dtype=torch.float64)
    opt.step()
    np.testing.assert_allclose(np.asarray(params["w"] + u["w"]), t.detach().numpy(), rtol=1e-14)


@pytest.mark.parametrize("kwargs, message", [
    (dict(learning_rate=-0.1), r"`learning_rate` \(=-0.1\) must be"),
    (dict(learning_rate=0.1, alpha=-0.5), r"`alpha` \(=-0.5\) must be"),
    (dict(learning_rate=0.1, eps=-1e-8), r"`eps` \(=-1e-08\) must be"),
    (dict(learning_rate=0.1, momentum=float("nan")), r"`momentum` \(=nan\) must be"),
])
def test_what_torch_refuses_is_refused_naming_the_argument(kwargs, message):
    for name, value in kwargs.items():  # torch refuses the same (NaN: torch trains to NaN)
        if name != "learning_rate" and value == value:
            with pytest.raises(ValueError):
                torch.optim.RMSprop([torch.zeros(1, requires_grad=True)], lr=0.1, **{name: value})
    with pytest.raises(ConfigError, match=message):
        rmsprop(**kwargs)


def test_low_precision_parameters_are_refused_naming_the_leaf():
    with pytest.raises(ConfigError, match=r"parameter \['w'\] has dtype bfloat16: rmsprop reproduces "
                                          r"torch.optim.RMSprop for float32 and float64 parameters"):
        rmsprop(0.1).init({"w": jnp.ones(2, jnp.bfloat16)})
