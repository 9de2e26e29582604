"""Edge cases of torch_compat.optim against torch.optim, beyond tests/test_optim.py.

Every case runs torch's optimizer or scheduler on the same parameters and gradients in the same
test. float64 (`jax.enable_x64`) where the two are meant to agree exactly: 1e-12 relative for
optimizers (same float64 operations in another order), 1e-15 for schedules (the same Python-float
recursion). Low-precision parameters: per-dtype tolerances, written down at the test.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxport._errors import ConfigError
from tests.helpers import torch_lrs
from torch_compat import optim

L = torch.optim.lr_scheduler
SHAPES = {"w": (4, 3), "b": (3,)}


def _data(steps, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


def _torch_run(make_opt, params, grads, dtype=torch.float64, no_grad=(), on_step=None):
    """torch's optimizer over `grads`; parameters named in `no_grad` keep `.grad = None`."""
    tp = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in params.items()}
    opt = make_opt(tp)
    for i, g in enumerate(grads):
        if on_step:
            on_step(opt, i)
        for k, p in tp.items():
            p.grad = None if k in no_grad else torch.tensor(g[k], dtype=dtype)
        opt.step()
    return {k: p.detach().double().numpy() for k, p in tp.items()}


def _optax_run(tx, params, grads, dtype=jnp.float64, on_step=None):
    p = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    state = tx.init(p)
    update = jax.jit(tx.update)
    for i, g in enumerate(grads):
        if on_step:
            state = on_step(state, i)
        u, state = update(jax.tree.map(lambda a: jnp.asarray(a, dtype), g), state, p)
        p = optax.apply_updates(p, u)
    assert all(v.dtype == dtype for v in p.values())
    return {k: np.asarray(v).astype(np.float64) for k, v in p.items()}


def _assert_same(got, want, rtol=1e-12, atol=1e-14):
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


def _compare(make_torch, tx, steps=10, **kw):
    params, grads = _data(steps)
    want = _torch_run(make_torch, params, grads, **kw)
    with jax.enable_x64(True):
        got = _optax_run(tx, params, grads)
    _assert_same(got, want)


# --- optimizers: hyper-parameters at the edges --------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(momentum=0.9, dampening=1.0),  # buffer frozen at the first gradient
    dict(momentum=0.9, dampening=-0.5, weight_decay=0.1),  # torch takes a negative dampening
    dict(momentum=0.0, dampening=0.5, weight_decay=0.1),  # no momentum: dampening ignored
    dict(momentum=1.0),
    dict(momentum=0.5, dampening=0.3, weight_decay=0.1, maximize=True),
    dict(momentum=1.5, nesterov=True),
])
def test_sgd_edge_hyperparameters_match_torch(kw):
    _compare(lambda tp: torch.optim.SGD(list(tp.values()), lr=0.1, **kw), optim.sgd(0.1, **kw))


@pytest.mark.parametrize("kw", [
    dict(betas=(0.0, 0.0)), dict(betas=(0.0, 0.999)), dict(betas=(0.9, 0.0)),
    dict(eps=1e-300), dict(eps=0.0), dict(weight_decay=0.0), dict(weight_decay=0.5, maximize=True),
])
def test_adamw_edge_hyperparameters_match_torch(kw):
    _compare(lambda tp: torch.optim.AdamW(list(tp.values()), lr=0.01, **kw), optim.adamw(0.01, **kw))


@pytest.mark.parametrize("make_torch, tx", [
    (lambda tp: torch.optim.SGD(list(tp.values()), lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.1),
     optim.sgd(0.1, momentum=0.9, dampening=0.2, weight_decay=0.1)),
    (lambda tp: torch.optim.AdamW(list(tp.values()), lr=0.01), optim.adamw(0.01)),
])
def test_zero_gradients_match_torch(make_torch, tx):
    """A zero (not None) gradient: torch still decays and applies momentum, as here."""
    params, grads = _data(6)
    grads = [jax.tree.map(np.zeros_like, g) if i % 2 else g for i, g in enumerate(grads)]
    want = _torch_run(make_torch, params, grads)
    with jax.enable_x64(True):
        _assert_same(_optax_run(tx, params, grads), want)


# --- optax.inject_hyperparams: torch's `param_groups[0]["lr"] = ...` -----------------------------

def _set_lr_at_step_4(opt, i):
    if i == 4:
        for group in opt.param_groups:
            group["lr"] = group["lr"] / 10


def _inject_lr_at_step_4(state, i):
    if i == 4:
        state.hyperparams["learning_rate"] = state.hyperparams["learning_rate"] / 10
    return state


@pytest.mark.parametrize("kw", [
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, dampening=0.3, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.0, dampening=0.5, weight_decay=1e-2),  # an array momentum of 0: no buffer, as torch
    dict(),
])
def test_sgd_under_inject_hyperparams_matches_torch_changing_its_lr(kw):
    """Regression: `optax.inject_hyperparams(sgd)` (the optax way to read or change the lr while
    training, torch's `param_groups[0]["lr"] = ...`) raised ConfigError: it passes the
    hyper-parameters as arrays, traced under jit, and sgd accepted Python numbers only (and
    chose its chain with `if momentum:`, which a traced value cannot answer)."""
    params, grads = _data(10)
    want = _torch_run(lambda tp: torch.optim.SGD(list(tp.values()), lr=0.1, **kw), params, grads,
                      on_step=_set_lr_at_step_4)
    with jax.enable_x64(True):
        tx = optax.inject_hyperparams(optim.sgd)(0.1, **kw)
        got = _optax_run(tx, params, grads, on_step=_inject_lr_at_step_4)
    _assert_same(got, want)


@pytest.mark.parametrize("momenta", [
    [0.0] * 3 + [0.9] * 5,  # torch starts its buffer at the first step with momentum: buf = g
    [0.9] * 3 + [0.0] * 2 + [0.9] * 3,  # torch keeps the buffer through the steps without momentum
    [0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9],
])
@pytest.mark.parametrize("dampening", [0.0, 0.3])
def test_sgd_under_inject_hyperparams_matches_torch_changing_its_momentum(momenta, dampening):
    """Regression: the buffer was overwritten with the gradient at steps with momentum 0, and
    only step 0 counted as a first step, so momentum set back later gave 0.9 g_prev + g (4.3x
    off torch's parameters after 8 steps for 0 -> 0.9)."""
    def set_momentum(opt, i):
        opt.param_groups[0]["momentum"] = momenta[i]

    def inject_momentum(state, i):
        state.hyperparams["momentum"] = jnp.asarray(momenta[i], state.hyperparams["momentum"].dtype)
        return state

    params, grads = _data(len(momenta))
    want = _torch_run(lambda tp: torch.optim.SGD(list(tp.values()), lr=0.1, momentum=momenta[0], dampening=dampening),
                      params, grads, on_step=set_momentum)
    with jax.enable_x64(True):
        tx = optax.inject_hyperparams(optim.sgd)(0.1, momentum=momenta[0], dampening=dampening)
        got = _optax_run(tx, params, grads, on_step=inject_momentum)
    _assert_same(got, want)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.99999), (0.99, 0.999999), (0.0, 0.999)])
def test_adamw_float32_updates_are_as_accurate_as_torchs(betas):
    """optax's float32 bias correction rounds beta2 first: `1 - 0.99999**t` came out 0.14% large,
    and the updates 6.8e-4 relative off the float64 ones (6.6e-3 for beta2 = 0.999999), where
    torch's float32 updates are ~2e-7 off. Both are compared with torch's float64 run."""
    params, grads = _data(3, seed=1)
    params = {k: np.zeros_like(v) for k, v in params.items()}  # the parameters are the displacement
    make = lambda tp: torch.optim.AdamW(list(tp.values()), lr=1.0, betas=betas, weight_decay=0.0)  # noqa: E731
    exact = _torch_run(make, params, grads)
    torch32 = _torch_run(make, params, grads, dtype=torch.float32)
    ours = _optax_run(optim.adamw(1.0, betas=betas, weight_decay=0.0), params, grads, dtype=jnp.float32)
    for k in exact:  # errors relative to the displacement's scale (an element may be near 0)
        scale = np.max(np.abs(exact[k]))
        torch_err, our_err = (np.max(np.abs(run[k] - exact[k])) / scale for run in (torch32, ours))
        assert torch_err < 1e-6 and our_err < 1e-6, (k, torch_err, our_err)


def test_adamw_under_inject_hyperparams_matches_torch_changing_its_lr():
    params, grads = _data(10)
    want = _torch_run(lambda tp: torch.optim.AdamW(list(tp.values()), lr=0.01, weight_decay=0.1), params, grads,
                      on_step=_set_lr_at_step_4)
    with jax.enable_x64(True):
        tx = optax.inject_hyperparams(optim.adamw)(0.01, weight_decay=0.1)
        got = _optax_run(tx, params, grads, on_step=_inject_lr_at_step_4)
    _assert_same(got, want)


def test_inject_hyperparams_with_bfloat16_parameters():
    """optax keeps the injected hyper-parameters in the parameters' dtype: bfloat16 here, which
    the checks read as well (a bfloat16 scalar is not a numpy float)."""
    p = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = optax.inject_hyperparams(optim.sgd)(0.1, momentum=0.9, weight_decay=1e-4)
    state = tx.init(p)
    assert state.hyperparams["learning_rate"].dtype == jnp.bfloat16
    u, state = jax.jit(tx.update)(p, state, p)
    # float32, which optax.apply_updates rounds once into the parameter's dtype (as torch rounds)
    assert u["w"].dtype == jnp.float32 and optax.apply_updates(p, u)["w"].dtype == jnp.bfloat16
    with pytest.raises(ConfigError, match="`momentum` \\(=-1.0\\) must be a finite number >= 0"):
        optim.sgd(0.1, momentum=jnp.asarray(-1.0, jnp.bfloat16))


def test_array_hyperparameters_are_checked_when_concrete():
    with jax.enable_x64(True):
        _compare(lambda tp: torch.optim.SGD(list(tp.values()), lr=0.1, momentum=0.9),
                 optim.sgd(jnp.asarray(0.1), momentum=np.asarray(0.9)))
    for call, message in [
        (lambda: optim.sgd(jnp.asarray(-0.1)), "`learning_rate` (=np.float32(-0.1)) must be a finite number >= 0"),
        (lambda: optim.sgd(jnp.asarray([0.1, 0.2])), "`learning_rate` (=Array([0.1, 0.2]"),
        (lambda: optim.sgd(0.1, momentum=jnp.asarray(float("nan"))), "`momentum` (=np.float32(nan)) must be a finite number >= 0"),
        (lambda: optim.sgd(0.1, momentum=jnp.asarray(0.0), nesterov=True), "nesterov momentum needs `momentum` > 0"),
        (lambda: optim.adamw(weight_decay=np.asarray(-1.0)), "`weight_decay` (=np.float64(-1.0)) must be a finite number >= 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value)


# --- torch's param groups and frozen parameters, the optax way ------------------------------------

def test_param_groups_as_multi_transform_match_torch():
    """torch's param groups (here: no weight decay on biases, a smaller lr for them, as
    fine-tuning recipes do) are `optax.multi_transform` with one optimizer per group."""
    params, grads = _data(10)
    want = _torch_run(lambda tp: torch.optim.SGD(
        [{"params": [tp["w"]]}, {"params": [tp["b"]], "weight_decay": 0.0, "lr": 0.01}],
        lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True), params, grads)
    labels = {"w": "decay", "b": "no_decay"}
    with jax.enable_x64(True):
        tx = optax.multi_transform({"decay": optim.sgd(0.1, momentum=0.9, weight_decay=1e-2, nesterov=True),
                                    "no_decay": optim.sgd(0.01, momentum=0.9, nesterov=True)}, labels)
        got = _optax_run(tx, params, grads)
    _assert_same(got, want)
    want = _torch_run(lambda tp: torch.optim.AdamW(
        [{"params": [tp["w"]]}, {"params": [tp["b"]], "weight_decay": 0.0}], lr=0.01, weight_decay=0.1), params, grads)
    with jax.enable_x64(True):
        tx = optax.multi_transform({"decay": optim.adamw(0.01, weight_decay=0.1),
                                    "no_decay": optim.adamw(0.01, weight_decay=0.0)}, labels)
        _assert_same(_optax_run(tx, params, grads), want)


@pytest.mark.parametrize("make_torch, make_tx", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
     lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.1)),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), lambda: optim.adamw(0.01, weight_decay=0.1)),
])
def test_frozen_parameters_as_set_to_zero_match_torch_none_grad(make_torch, make_tx):
    """torch skips a parameter whose `.grad` is None (no decay, no momentum); a zero gradient in
    JAX still decays it. `optax.multi_transform` with `optax.set_to_zero()` for the frozen
    ones reproduces torch; the plain optimizer does not (the documented difference)."""
    params, grads = _data(6)
    want = _torch_run(lambda tp: make_torch(list(tp.values())), params, grads, no_grad=("b",))
    np.testing.assert_array_equal(want["b"], params["b"])
    zero_b = [dict(g, b=np.zeros_like(g["b"])) for g in grads]
    with jax.enable_x64(True):
        tx = optax.multi_transform({"train": make_tx(), "frozen": optax.set_to_zero()}, {"w": "train", "b": "frozen"})
        _assert_same(_optax_run(tx, params, zero_b), want)
        plain = _optax_run(make_tx(), params, zero_b)
    np.testing.assert_allclose(plain["w"], want["w"], rtol=1e-12)
    assert not np.allclose(plain["b"], want["b"])


# --- torch's clip_grad_norm_ ----------------------------------------------------------------------

def _torch_clipped_run(params, grads, max_norm, norm_type, no_grad=()):
    """torch's SGD (momentum, decay) with `clip_grad_norm_` over the parameters before each step."""
    tp = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    opt = torch.optim.SGD(list(tp.values()), lr=0.1, momentum=0.9, weight_decay=0.01)
    for g in grads:
        for k, p in tp.items():
            p.grad = None if k in no_grad else torch.tensor(g[k], dtype=torch.float64)
        torch.nn.utils.clip_grad_norm_(list(tp.values()), max_norm, norm_type)
        opt.step()
    return {k: p.detach().numpy() for k, p in tp.items()}


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])  # clipping every step; never
def test_clip_grad_norm_matches_torch(max_norm, norm_type):
    """`optax.clip_by_global_norm` scales by max_norm / norm, torch by max_norm / (norm + 1e-6):
    ~1e-7 relative apart here on every clipped step, beyond float64 parity (checked below, so
    the comparison can tell them apart)."""
    params, grads = _data(10)
    want = _torch_clipped_run(params, grads, max_norm, norm_type)
    with jax.enable_x64(True):
        got = _optax_run(optax.chain(optim.clip_grad_norm(max_norm, norm_type),
                                     optim.sgd(0.1, momentum=0.9, weight_decay=0.01)), params, grads)
        _assert_same(got, want)
        if max_norm < 1 and norm_type == 2.0:
            optax_clip = _optax_run(optax.chain(optax.clip_by_global_norm(max_norm),
                                                optim.sgd(0.1, momentum=0.9, weight_decay=0.01)), params, grads)
            assert not np.allclose(optax_clip["w"], want["w"], rtol=1e-10, atol=0)


def test_clip_grad_norm_with_frozen_parameters_as_documented_matches_torch():
    """torch leaves a frozen parameter (`.grad` None) out of the norm. Chained before a
    `multi_transform` that freezes it, the clip counted its gradient: every step off torch. The
    documented recipe zeroes it first."""
    params, grads = _data(6)
    want = _torch_clipped_run(params, grads, 0.5, 2.0, no_grad=("b",))
    frozen = optax.multi_transform({"train": optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
                                    "frozen": optax.set_to_zero()}, {"w": "train", "b": "frozen"})
    with jax.enable_x64(True):
        recipe = optax.chain(optax.masked(optax.set_to_zero(), {"w": False, "b": True}), optim.clip_grad_norm(0.5),
                             frozen)
        _assert_same(_optax_run(recipe, params, grads), want)
        naive = _optax_run(optax.chain(optim.clip_grad_norm(0.5), frozen), params, grads)
    assert not np.allclose(naive["w"], want["w"], rtol=1e-6)
    np.testing.assert_array_equal(want["b"], params["b"])


@pytest.mark.parametrize("kw, message", [
    (dict(max_norm=-1.0), "`max_norm` (=-1.0) must be a finite number >= 0"),
    (dict(max_norm=float("nan")), "`max_norm` (=nan) must be a finite number >= 0"),
    (dict(max_norm=1.0, norm_type=0), "`norm_type` (=0) must be a number > 0"),
    (dict(max_norm=1.0, norm_type="fro"), "`norm_type` (='fro') must be a number > 0"),
])
def test_clip_grad_norm_refuses_bad_arguments_naming_them(kw, message):
    with pytest.raises(ConfigError) as e:
        optim.clip_grad_norm(**kw)
    assert message in str(e.value)


# --- low-precision parameters --------------------------------------------------------------------

@pytest.mark.parametrize("tdtype, jdtype, tol", [
    # bfloat16 has 8 significant bits (2^-8 = 0.004 relative per rounding); torch rounds after
    # every operation, XLA fuses them and rounds less often, so a few ulps apart after 5 steps.
    (torch.bfloat16, jnp.bfloat16, 0.05),
    (torch.float16, jnp.float16, 0.01),
    (torch.float32, jnp.float32, 1e-5),
])
@pytest.mark.parametrize("make_torch, tx", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2),
     optim.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), optim.sgd(0.1, momentum=0.9, nesterov=True)),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), optim.adamw(0.01, weight_decay=0.1)),
])
def test_low_precision_parameters_keep_their_dtype_and_track_torch(tdtype, jdtype, tol, make_torch, tx):
    """As torch, the update and its state are in the parameter's dtype (no float32 master copy)."""
    params, grads = _data(5)
    want = _torch_run(lambda tp: make_torch(list(tp.values())), params, grads, dtype=tdtype)
    got = _optax_run(tx, params, grads, dtype=jdtype)
    state = tx.init(jax.tree.map(lambda a: jnp.asarray(a, jdtype), params))
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {jnp.dtype(jdtype)}
    _assert_same(got, want, rtol=tol, atol=tol)


# --- schedules -----------------------------------------------------------------------------------



def _ours(sched, n):
    with jax.enable_x64(True):
        return np.asarray(jax.jit(jax.vmap(sched))(jnp.arange(n)))


@pytest.mark.parametrize("make_torch, make_ours, lr", [
    (lambda o: L.MultiStepLR(o, [0, 3], 0.5), lambda lr: optim.multistep_lr(lr, [0, 3], 0.5), 0.1),  # fires at once
    (lambda o: L.MultiStepLR(o, [6, 2, 6, 2, 2], 0.5), lambda lr: optim.multistep_lr(lr, [6, 2, 6, 2, 2], 0.5), 0.1),
    (lambda o: L.MultiStepLR(o, [-1, 3], 0.5), lambda lr: optim.multistep_lr(lr, [-1, 3], 0.5), 0.1),
    (lambda o: L.MultiStepLR(o, [], 0.5), lambda lr: optim.multistep_lr(lr, [], 0.5), 0.1),
    (lambda o: L.MultiStepLR(o, {4, 2}, -1.0), lambda lr: optim.multistep_lr(lr, {4, 2}, -1.0), 0.1),
    (lambda o: L.StepLR(o, 2, 2.0), lambda lr: optim.step_lr(lr, 2, 2.0), 0.1),
    (lambda o: L.StepLR(o, 2, -0.5), lambda lr: optim.step_lr(lr, 2, -0.5), 0.1),
    (lambda o: L.StepLR(o, 2, 0.0), lambda lr: optim.step_lr(lr, 2, 0.0), 0.1),
    (lambda o: L.StepLR(o, 2, 0.5), lambda lr: optim.step_lr(lr, 2, 0.5), 0.0),
    (lambda o: L.CosineAnnealingLR(o, 1), lambda lr: optim.cosine_annealing_lr(lr, 1), 0.1),
    (lambda o: L.CosineAnnealingLR(o, 2), lambda lr: optim.cosine_annealing_lr(lr, 2), 0.1),
    (lambda o: L.CosineAnnealingLR(o, 3, 0.05), lambda lr: optim.cosine_annealing_lr(lr, 3, 0.05), 0.1),
    (lambda o: L.CosineAnnealingLR(o, 5, 0.5), lambda lr: optim.cosine_annealing_lr(lr, 5, 0.5), 0.1),  # eta_min > lr
    (lambda o: L.CosineAnnealingLR(o, 5), lambda lr: optim.cosine_annealing_lr(lr, 5), 0.0),
    (lambda o: L.LinearLR(o, 0.5, 1.0, 4), lambda lr: optim.linear_warmup(lr, total_iters=4, start_factor=0.5, end_factor=1.0), 0.1),
    (lambda o: L.LinearLR(o, 1.0, 0.5, 4), lambda lr: optim.linear_warmup(lr, total_iters=4, start_factor=1.0, end_factor=0.5), 0.1),  # a decay
    (lambda o: L.LinearLR(o, 0.01, 0.0, 6), lambda lr: optim.linear_warmup(lr, total_iters=6, start_factor=0.01, end_factor=0.0), 0.1),
    (lambda o: L.LinearLR(o, 0.3, 0.7, 1), lambda lr: optim.linear_warmup(lr, total_iters=1, start_factor=0.3, end_factor=0.7), 0.1),
])
def test_schedule_edge_cases_match_torch(make_torch, make_ours, lr):
    """Past T_max the cosine rises again in torch's recursion, as here (60 steps)."""
    np.testing.assert_allclose(_ours(make_ours(lr), 60), torch_lrs(make_torch, 60, lr), rtol=1e-15, atol=0)


@pytest.mark.parametrize("warmup", [1, 3, 5])
@pytest.mark.parametrize("make_torch, make_ours", [
    (lambda o: L.CosineAnnealingLR(o, 10), lambda: optim.cosine_annealing_lr(0.1, 10)),
    (lambda o: L.MultiStepLR(o, [4, 8], 0.1), lambda: optim.multistep_lr(0.1, [4, 8], 0.1)),
    (lambda o: L.StepLR(o, 3, 0.5), lambda: optim.step_lr(0.1, 3, 0.5)),
    (lambda o: L.ExponentialLR(o, 0.8), lambda: optim.exponential_lr(0.1, 0.8)),
])
@pytest.mark.parametrize("make_torch_warmup, make_warmup", [
    (lambda o, n: L.LinearLR(o, 0.1, 1.0, n), lambda n: optim.linear_warmup(0.1, total_iters=n, start_factor=0.1)),
    (lambda o, n: L.ConstantLR(o, 0.1, n), lambda n: optim.constant_lr(0.1, factor=0.1, total_iters=n)),
])
def test_join_schedules_is_sequential_lr(warmup, make_torch, make_ours, make_torch_warmup, make_warmup):
    """torch's SequentialLR restarts the second scheduler at step 0 at the milestone (the lr
    there is the second schedule's start, not the warm-up's end); `optax.join_schedules` does
    the same, with the milestone as its boundary."""
    want = torch_lrs(lambda o: L.SequentialLR(o, [make_torch_warmup(o, warmup), make_torch(o)], [warmup]), 40)
    got = _ours(optax.join_schedules([make_warmup(warmup), make_ours()], [warmup]), 40)
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_constant_lr_returns_to_the_lr_as_torch_bit_for_bit():
    """torch ends ConstantLR by multiplying `lr * factor` by `1 / factor`: 0.1 * 0.1 * 10 is
    0.10000000000000002, not 0.1 (an ulp, which a tolerance would let through)."""
    want = torch_lrs(lambda o: L.ConstantLR(o, factor=0.1, total_iters=3), 8)
    assert want[-1] != 0.1
    np.testing.assert_array_equal(_ours(optim.constant_lr(0.1, factor=0.1, total_iters=3), 8), want)


def test_per_epoch_sgd_run_matches_torch_stepping_its_scheduler_each_epoch():
    steps_per_epoch = 3
    params, grads = _data(4 * steps_per_epoch)
    holder = {}

    def make(tp):
        holder["opt"] = torch.optim.SGD(list(tp.values()), lr=0.1, momentum=0.9)
        holder["sched"] = L.MultiStepLR(holder["opt"], [1, 3], 0.1)
        return holder["opt"]

    def epoch_end(opt, i):
        if i and i % steps_per_epoch == 0:
            holder["sched"].step()

    want = _torch_run(make, params, grads, on_step=epoch_end)
    with jax.enable_x64(True):
        tx = optim.sgd(optim.per_epoch(optim.multistep_lr(0.1, [1, 3], 0.1), steps_per_epoch), momentum=0.9)
        _assert_same(_optax_run(tx, params, grads), want)


# --- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make_torch, call, message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
     lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True), "nesterov momentum needs `momentum` > 0 and `dampening` == 0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, nesterov=True), lambda: optim.sgd(0.1, nesterov=True), "set nesterov=False"),
    (lambda p: torch.optim.AdamW(p, betas=(0.9, 1.0)), lambda: optim.adamw(betas=(0.9, 1.0)), "`betas` (=(0.9, 1.0)) must both be in [0, 1)"),
    (lambda p: torch.optim.AdamW(p, betas=(float("nan"), 0.9)), lambda: optim.adamw(betas=(float("nan"), 0.9)), "must both be in [0, 1)"),
    (lambda p: torch.optim.AdamW(p, eps=float("nan")), lambda: optim.adamw(eps=float("nan")), "`eps` (=nan)"),
    (lambda p: L.LinearLR(torch.optim.SGD(p, lr=0.1), 0.0), lambda: optim.linear_warmup(0.1, total_iters=5, start_factor=0.0), "`start_factor` (=0.0) must be in (0, 1]"),
    (lambda p: L.LinearLR(torch.optim.SGD(p, lr=0.1), 0.5, 1.5), lambda: optim.linear_warmup(0.1, total_iters=5, start_factor=0.5, end_factor=1.5), "`end_factor` (=1.5) in [0, 1]"),
    (lambda p: L.ConstantLR(torch.optim.SGD(p, lr=0.1), 1.5), lambda: optim.constant_lr(0.1, factor=1.5), "`factor` (=1.5) must be in (0, 1]"),
])
def test_refuses_what_torch_refuses_with_the_argument_named(make_torch, call, message):
    with pytest.raises(ValueError):
        make_torch([torch.zeros(1, requires_grad=True)])
    with pytest.raises(ConfigError) as e:
        call()
    assert message in str(e.value)


@pytest.mark.parametrize("call, message", [
    # torch takes these and trains to NaN, or fails at its first step with ZeroDivisionError.
    (lambda: optim.sgd(0.1, momentum=float("nan")), "`momentum` (=nan) must be a finite number >= 0"),
    (lambda: optim.sgd(0.1, momentum=0.9, dampening=float("inf")), "`dampening` (=inf) must be a finite number"),
    (lambda: optim.step_lr(0.1, 0), "`step_size` (=0) must be a whole number >= 1"),
    (lambda: optim.cosine_annealing_lr(0.1, 0), "`t_max` (=0) must be a whole number >= 1"),
    # torch takes a factor of 0, then divides by it at total_iters (ZeroDivisionError)
    (lambda: optim.constant_lr(0.1, factor=0.0), "`factor` (=0.0) must be in (0, 1]"),
    # torch's AMSGrad maximum is over the uncorrected second moment, optax's over the corrected one
    (lambda: optim.adamw(amsgrad=True), "`amsgrad` (=True) is not supported"),
])
def test_refuses_what_torch_takes_but_cannot_train_with(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert message in str(e.value)


def test_adamw_with_a_cosine_schedule_matches_torch():
    """The scheduled lr scales the decoupled weight decay too, at the same step, as torch's."""
    holder = {}

    def make(tp):
        holder["opt"] = torch.optim.AdamW(list(tp.values()), lr=0.01, weight_decay=0.1)
        holder["sched"] = L.CosineAnnealingLR(holder["opt"], 4, eta_min=1e-3)
        return holder["opt"]

    params, grads = _data(10)
    want = _torch_run(make, params, grads, on_step=lambda opt, i: i and holder["sched"].step())
    with jax.enable_x64(True):
        got = _optax_run(optim.adamw(optim.cosine_annealing_lr(0.01, 4, 1e-3), weight_decay=0.1), params, grads)
    _assert_same(got, want)


LOW_SHAPES = {"w": (8, 16), "b": (64,)}  # sizes multiples of 64: see below


class _OneCycleBeta1:
    """`opt` under OneCycleLR with a constant lr (div_factor 1, final_div_factor 1) and beta1
    cycled from 0.95 to 0.5 and back over 200 steps (torch's cycle_momentum)."""

    def __init__(self, opt):
        self.opt, self.state = opt, opt.state
        self.sched = L.OneCycleLR(opt, 0.01, total_steps=200, div_factor=1.0, final_div_factor=1.0,
                                  base_momentum=0.5)

    def step(self):
        self.opt.step()
        if self.sched.last_epoch < 200:
            self.sched.step()


def _low_precision_runs(make_torch, tx, tdtype, jdtype, torch_state, our_state, steps=200, constant=False,
                        shapes=LOW_SHAPES, scales=(1.0, 1.0)):
    """200 steps in torch and here on the same low-precision parameters and gradients (normal,
    of std `scales`); returns {name: (ours, torch's)} for the parameters and the named optimizer
    buffers, as float64."""
    rng = np.random.default_rng(3)
    # float32, which both sides round to the dtype once: jax (without x64) takes float64 through
    # float32 first, which rounds a few values differently from torch's direct cast.
    normal = lambda s, scale: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    params = {k: normal(s, scales[0]) for k, s in shapes.items()}
    grads = [{k: np.ones(s, np.float32) if constant else normal(s, scales[1]) for k, s in shapes.items()}
             for _ in range(steps)]
    tp = {k: torch.tensor(v).to(tdtype).requires_grad_() for k, v in params.items()}
    opt = make_torch(list(tp.values()))
    for g in grads:
        for k, p in tp.items():
            p.grad = torch.tensor(g[k]).to(tdtype)
        opt.step()
    p = jax.tree.map(lambda a: jnp.asarray(a, jdtype), params)
    state = tx.init(p)
    update = jax.jit(tx.update)
    for g in grads:
        u, state = update(jax.tree.map(lambda a: jnp.asarray(a, jdtype), g), state, p)
        p = optax.apply_updates(p, u)
    out = {}
    for k, t in tp.items():
        assert p[k].dtype == jdtype
        out[k] = (np.asarray(p[k], np.float64), t.detach().double().numpy())
        for tname, oname in zip(torch_state, our_state):
            ours = optax.tree_utils.tree_get(state, oname)[k]
            assert ours.dtype == jdtype
            out[f"{k}.{tname}"] = (np.asarray(ours, np.float64), opt.state[t][tname].double().numpy())
    return out


SGD_LOW = [dict(momentum=0.9), dict(momentum=0.9, dampening=0.1, weight_decay=1e-2),
           dict(momentum=0.9, nesterov=True, weight_decay=1e-3)]
LOW_DTYPES = [(torch.bfloat16, jnp.bfloat16), (torch.float16, jnp.float16)]


@pytest.mark.parametrize("tdtype, jdtype", LOW_DTYPES)
@pytest.mark.parametrize("kw", SGD_LOW)
def test_low_precision_sgd_momentum_of_a_constant_gradient_is_torchs_bit_for_bit(tdtype, jdtype, kw):
    """Regression: momentum multiplied in bfloat16 (0.9 -> 0.8984), so the buffer of a constant
    gradient 1 settled at 9.56 after 200 steps where torch's reaches 9.75 (exact: 10). torch
    computes each op in float32 and rounds once (`add`'s alpha rounded to the dtype first), as
    here now: equal bit for bit, parameters and buffers. (torch's CPU loop rounds twice on the
    last `size % 32` elements of a tensor; the sizes here are multiples of 64.)"""
    got = _low_precision_runs(lambda ps: torch.optim.SGD(ps, lr=0.1, **kw), optim.sgd(0.1, **kw), tdtype, jdtype,
                              ["momentum_buffer"], ["trace"], constant=True)
    for name, (ours, want) in got.items():
        np.testing.assert_array_equal(ours, want, err_msg=name)


@pytest.mark.parametrize("tdtype, jdtype", LOW_DTYPES)
@pytest.mark.parametrize("make_torch, tx, torch_state, our_state, lr", [
    *[(lambda ps, kw=kw: torch.optim.SGD(ps, lr=0.01, **kw), optim.sgd(0.01, **kw), ["momentum_buffer"], ["trace"], 0.01)
      for kw in SGD_LOW],
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), optim.adamw(0.01, weight_decay=0.1),
     ["exp_avg", "exp_avg_sq"], ["mu", "nu"], 0.01),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-3),
     optim.adamw(0.01, betas=(0.8, 0.99), eps=1e-3), ["exp_avg", "exp_avg_sq"], ["mu", "nu"], 0.01),
    # beta1 cycled as torch's OneCycleLR does (lr held: cycle 0.01 to 0.01), over the 200 steps
    (lambda ps: _OneCycleBeta1(torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
     optim.adamw(0.01, betas=(optim.one_cycle_momentum(200, base_momentum=0.5), 0.999), weight_decay=0.1),
     ["exp_avg", "exp_avg_sq"], ["mu", "nu"], 0.01),
])
@pytest.mark.parametrize("constant", [True, False])
def test_low_precision_random_gradients_follow_torch_within_an_ulp_or_so(tdtype, jdtype, make_torch, tx, torch_state,
                                                                          our_state, lr, constant):
    """200 steps of random (or constant) gradients: SGD equal to torch's bit for bit; AdamW nearly
    so. Where AdamW is not: its bias corrections are float32 here (torch's are Python floats) and
    `1 - lr * wd` too; once an element is an ulp off it stays a few ulps off. So: at most 10% of
    the elements differ, each by at most 4 ulps (2^-6 relative in bfloat16, 2^-9 in float16) of
    torch's value. Before, momentum and the betas were rounded to the
    parameters' dtype (beta2 = 0.99 -> 0.9922 in bfloat16): the buffers drifted by percents."""
    got = _low_precision_runs(make_torch, tx, tdtype, jdtype, torch_state, our_state, constant=constant)
    ulp = float(jnp.finfo(jdtype).eps)
    for name, (ours, want) in got.items():
        if torch_state == ["momentum_buffer"]:  # SGD: every element (see the next test)
            np.testing.assert_array_equal(ours, want, err_msg=name)
        differ = ours != want
        assert differ.mean() <= 0.1, (name, differ.sum())
        np.testing.assert_allclose(ours, want, rtol=4 * ulp, atol=4 * ulp * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("tdtype, jdtype", LOW_DTYPES)
@pytest.mark.parametrize("kw", SGD_LOW)
def test_low_precision_sgd_is_torchs_bit_for_bit_where_parameters_cross_zero(tdtype, jdtype, kw):
    """Regression: the update was rounded to the parameter's dtype, then `p + u` rounded again:
    exact only where a step moves a parameter by less than its own size. With weights of 0.05
    and steps of lr 0.1 times gradients of 0.1 (a ResNet's at lr 0.1) ~7% of the elements crossed
    0 or came near it and landed an ulp away from torch's (1,347 of 20,000 in float16 in one
    step). Now every element, parameters and buffers, over 20 steps."""
    got = _low_precision_runs(lambda ps: torch.optim.SGD(ps, lr=0.1, **kw), optim.sgd(0.1, **kw), tdtype, jdtype,
                              ["momentum_buffer"], ["trace"], steps=20, shapes={"w": (64, 64)}, scales=(0.05, 0.1))
    for name, (ours, want) in got.items():
        np.testing.assert_array_equal(ours, want, err_msg=name)


@pytest.mark.parametrize("make", [lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.adamw(0.01)])
def test_integer_parameters_and_float0_gradients_are_refused_naming_the_leaf(make):
    """Regression: an integer leaf was updated and truncated silently (a step counter kept in the
    parameters, say); torch refuses integer tensors as parameters. A float0 gradient (jax.grad
    with allow_int=True) failed inside optax with an error naming no leaf."""
    with pytest.raises(RuntimeError, match="floating point"):
        torch.optim.SGD([torch.zeros(2, dtype=torch.int32, requires_grad=True)], lr=0.1)
    params = {"w": jnp.ones(3), "count": jnp.zeros([], jnp.int32)}
    with pytest.raises(ConfigError, match=r"parameter \['count'\] has dtype int32: .*optax.set_to_zero"):
        make().init(params)
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)
    state = make().init({"w": params["w"]})
    with pytest.raises(ConfigError, match=r"gradient \['count'\] has dtype float0"):
        make().update(grads, state, params)
    tx = optax.multi_transform({"train": make(), "fixed": optax.set_to_zero()}, {"w": "train", "count": "fixed"})
    u, _ = tx.update({"w": grads["w"], "count": jnp.zeros([], jnp.int32)}, tx.init(params), params)  # the fix the errors name
    assert optax.apply_updates(params, u)["count"] == 0


@pytest.mark.parametrize("make_torch, make_ours", [
    (lambda o: L.StepLR(o, 2**31, 0.5), lambda: optim.step_lr(0.1, 2**31, 0.5)),
    # 2**31 steps per epoch: torch's per-epoch scheduler is not stepped within these 10 steps
    (lambda o: L.MultiStepLR(o, [], 0.5), lambda: optim.per_epoch(optim.step_lr(0.1, 1, 0.5), 2**31)),
    (lambda o: L.MultiStepLR(o, [4, 2**31, 2**40], 0.5), lambda: optim.multistep_lr(0.1, [4, 2**31, 2**40], 0.5)),
])
def test_steps_past_int32_work_in_the_jitted_update(make_torch, make_ours):
    """Regression: a step size, steps per epoch or milestone >= 2**31 failed at the first jitted
    update with an int32 OverflowError deep inside jax. optax's int32 count never reaches them:
    the lr is torch's for every count it can take."""
    want = torch_lrs(make_torch, 10)
    sched = make_ours()
    got = np.asarray(jax.jit(jax.vmap(sched))(jnp.arange(10, dtype=jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=2e-7)
    tx = optim.sgd(sched)
    p = {"w": jnp.ones(2)}
    u, _ = jax.jit(tx.update)(p, tx.init(p), p)
    np.testing.assert_allclose(u["w"], -want[0], rtol=2e-7)


def test_cosine_t_max_past_its_limit_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"`t_max` \(=2147483648\) must be at most 10,000,000"):
        optim.cosine_annealing_lr(0.1, 2**31)


@pytest.mark.parametrize("make_torch, make_ours", [
    (lambda o: L.StepLR(o, 2, 0.5), lambda: optim.step_lr(0.1, 2, 0.5)),
    (lambda o: L.MultiStepLR(o, [2, 5], 0.5), lambda: optim.multistep_lr(0.1, [2, 5], 0.5)),
    (lambda o: L.CosineAnnealingLR(o, 7), lambda: optim.cosine_annealing_lr(0.1, 7)),
    (lambda o: L.LinearLR(o, 0.25, 1.0, 4), lambda: optim.linear_warmup(0.1, total_iters=4, start_factor=0.25)),
])
def test_schedules_take_a_whole_float_step_and_refuse_a_fractional_one(make_torch, make_ours):
    """Regression: `sched(3.0)` failed with "Indexer must have integer type". torch's scheduler
    counts its steps in ints; a whole float step is that int, a fractional one never a step."""
    want = torch_lrs(make_torch, 12)
    sched = make_ours()
    with jax.enable_x64(True):
        got = [float(sched(float(i))) for i in range(12)]
        traced = np.asarray(jax.jit(jax.vmap(sched))(jnp.arange(12, dtype=jnp.float64)))
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    np.testing.assert_allclose(traced, want, rtol=1e-15, atol=0)
    with pytest.raises(ConfigError, match=r"step `count` \(=2.5\) must be a whole number"):
        sched(2.5)


@pytest.mark.parametrize("make_torch, make_ours", [
    (lambda o: L.StepLR(o, 1, 1e10), lambda: optim.step_lr(1.0, 1, 1e10)),
    (lambda o: L.StepLR(o, 2, -1e100), lambda: optim.step_lr(1.0, 2, -1e100)),
    (lambda o: L.StepLR(o, 1, 2.0), lambda: optim.step_lr(1.0, 1, 2.0)),
    (lambda o: L.ExponentialLR(o, 2.0), lambda: optim.exponential_lr(1.0, 2.0)),
    (lambda o: L.MultiStepLR(o, list(range(1, 40)), 1e10), lambda: optim.multistep_lr(1.0, list(range(1, 40)), 1e10)),
])
def test_growing_schedules_overflow_to_inf_as_torch(make_torch, make_ours):
    """Regression: StepLR with gamma > 1 held its last finite value where torch's lr overflows to
    inf (and alternates +-inf with a negative gamma)."""
    n = 1100
    want = torch_lrs(make_torch, n, lr=1.0)
    assert np.isinf(want[-1])
    got = _ours(make_ours(), n)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
