"""torch_compat.optim against torch.optim itself: same updates, same learning rates.

Optimizers run 10 steps on random float64 parameters with gradients drawn per step, in torch
and in optax (`jax.enable_x64`); they agree to 1e-12 relative (float64 rounding of the same
operations done in a different order). Schedules are compared to torch's schedulers value for
value over many steps (1e-15 relative: the same Python-float recursion).
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

SHAPES = {"w": (4, 3), "b": (3,)}


def _run_both(make_torch, tx, steps=10, jit=True):
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(steps)]
    tparams = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = make_torch(list(tparams.values()))
    for g in grads:
        for k, p in tparams.items():
            p.grad = torch.tensor(g[k])
        opt.step()
    with jax.enable_x64(True):
        p = jax.tree.map(jnp.asarray, params)
        state = tx.init(p)
        update = jax.jit(tx.update) if jit else tx.update
        for g in grads:
            u, state = update(jax.tree.map(jnp.asarray, g), state, p)
            p = optax.apply_updates(p, u)
        assert p["w"].dtype == jnp.float64
        got = jax.tree.map(np.asarray, p)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], tparams[k].detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("momentum,dampening,weight_decay,nesterov", [
    (0.0, 0.0, 0.0, False),
    (0.0, 0.0, 1e-2, False),
    (0.9, 0.0, 1e-4, False),
    (0.9, 0.0, 1e-4, True),
    (0.9, 0.3, 5e-4, False),  # dampening: torch's first buffer is the raw gradient
])
def test_sgd_matches_torch(momentum, dampening, weight_decay, nesterov):
    kw = dict(momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
    _run_both(lambda ps: torch.optim.SGD(ps, lr=0.1, **kw), optim.sgd(0.1, **kw))


@pytest.mark.parametrize("weight_decay,betas,eps", [(1e-2, (0.9, 0.999), 1e-8), (0.1, (0.8, 0.99), 1e-3)])
def test_adamw_matches_torch(weight_decay, betas, eps):
    _run_both(lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=betas, eps=eps, weight_decay=weight_decay),
              optim.adamw(0.01, betas=betas, eps=eps, weight_decay=weight_decay))


def test_sgd_with_schedule_matches_torch_step_lr():
    class StepThenSchedule:
        # torch warns when optimizer.step is replaced after a scheduler wraps it; a wrapper
        # object steps both, in the order a training loop does.
        def __init__(self, ps):
            self.opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)

        def step(self):
            self.opt.step()
            self.sched.step()

    _run_both(StepThenSchedule, optim.sgd(optim.step_lr(0.1, 3, 0.5), momentum=0.9))




L = torch.optim.lr_scheduler


@pytest.mark.parametrize("name,make_torch,make_ours", [
    ("step", lambda o: L.StepLR(o, 7, 0.3), lambda: optim.step_lr(0.1, 7, 0.3)),
    ("multistep", lambda o: L.MultiStepLR(o, [5, 12, 12, 40], 0.5), lambda: optim.multistep_lr(0.1, [5, 12, 12, 40], 0.5)),
    ("cosine", lambda o: L.CosineAnnealingLR(o, 17), lambda: optim.cosine_annealing_lr(0.1, 17)),
    ("cosine_eta_min", lambda o: L.CosineAnnealingLR(o, 10, eta_min=1e-3), lambda: optim.cosine_annealing_lr(0.1, 10, 1e-3)),
    ("linear", lambda o: L.LinearLR(o, start_factor=0.1, total_iters=9), lambda: optim.linear_warmup(0.1, total_iters=9, start_factor=0.1)),
    ("exponential", lambda o: L.ExponentialLR(o, 0.93), lambda: optim.exponential_lr(0.1, 0.93)),
    ("constant", lambda o: L.ConstantLR(o, factor=0.1, total_iters=9), lambda: optim.constant_lr(0.1, factor=0.1, total_iters=9)),
    ("constant_default", lambda o: L.ConstantLR(o), lambda: optim.constant_lr(0.1)),
])
def test_schedules_match_torch(name, make_torch, make_ours):
    n = 100  # past T_max: torch's cosine recursion rises again; ours follows it
    want = torch_lrs(make_torch, n)
    sched = make_ours()
    with jax.enable_x64(True):
        got = np.array([sched(jnp.asarray(i)) for i in range(n)])
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


def test_per_epoch_schedule():
    sched = optim.per_epoch(optim.step_lr(1.0, 2, 0.5), steps_per_epoch=3)
    got = [float(sched(i)) for i in range(12)]
    assert got == [1.0] * 6 + [0.5] * 6


def test_bad_arguments():
    with pytest.raises(ConfigError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ConfigError, match="`momentum` \\(=-1"):
        optim.sgd(0.1, momentum=-1)
    with pytest.raises(ConfigError, match="amsgrad"):
        optim.adamw(amsgrad=True)
    with pytest.raises(ConfigError, match="t_max"):
        optim.cosine_annealing_lr(0.1, 0)


@pytest.mark.parametrize("make, torch_make, name", [
    (lambda v: optim.adamw(v), lambda p, v: torch.optim.AdamW(p, lr=v), "learning_rate"),
    (lambda v: optim.adamw(eps=v), lambda p, v: torch.optim.AdamW(p, eps=v), "eps"),
    (lambda v: optim.adamw(weight_decay=v), lambda p, v: torch.optim.AdamW(p, weight_decay=v), "weight_decay"),
    (lambda v: optim.sgd(v), lambda p, v: torch.optim.SGD(p, lr=v), "learning_rate"),
    (lambda v: optim.sgd(0.1, weight_decay=v), lambda p, v: torch.optim.SGD(p, lr=0.1, weight_decay=v), "weight_decay"),
])
def test_refuses_what_torch_refuses_and_nan(make, torch_make, name):
    """Negative values: torch's own check, run here so the two cannot drift apart. NaN/inf:
    torch takes them and trains to NaN; these refuse them up front."""
    with pytest.raises(ValueError, match="Invalid"):
        torch_make([torch.zeros(1, requires_grad=True)], -1.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=f"`{name}` \\(={bad}\\) must be a finite number >= 0"):
            make(bad)


@pytest.mark.parametrize("make_torch, make_ours", [
    (lambda o: L.StepLR(o, 12_000, 0.1), lambda: optim.step_lr(0.1, 12_000, 0.1)),
    (lambda o: L.MultiStepLR(o, [15_000, 30_000, 30_000], 0.5), lambda: optim.multistep_lr(0.1, [30_000, 15_000, 30_000], 0.5)),
    (lambda o: L.CosineAnnealingLR(o, 25_000, eta_min=1e-4), lambda: optim.cosine_annealing_lr(0.1, 25_000, 1e-4)),
    (lambda o: L.CosineAnnealingLR(o, 700), lambda: optim.cosine_annealing_lr(0.1, 700)),
    (lambda o: L.LinearLR(o, start_factor=0.01, total_iters=20_000), lambda: optim.linear_warmup(0.1, total_iters=20_000, start_factor=0.01)),
])
def test_per_step_schedules_hold_far_beyond_ten_thousand_steps(make_torch, make_ours):
    """Stepped per step, as ImageNet runs do (hundreds of thousands of steps): the schedules
    used to freeze at step 10,000 (a cosine stalled at lr/2, a StepLR of 12,000 never decayed).
    Exact everywhere, except a cosine past max(T_max, 10,000) steps (where torch's lr rises
    again): there the closed form stands in for torch's recursion, which drifts from it by
    ~1e-11 relative."""
    n = 40_001
    want = torch_lrs(make_torch, n)
    sched = make_ours()
    steps = np.r_[0:50, 9_990:10_010, 11_990:12_010, 14_990:15_010, 19_990:20_010, 24_990:25_010,
                  29_990:30_010, 39_950:n]
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps)))
    cosine = isinstance(make_torch(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)), L.CosineAnnealingLR)
    exact = steps < len(sched.table) if cosine else np.ones(len(steps), bool)
    assert exact.sum() >= 50
    np.testing.assert_allclose(got[exact], want[steps][exact], rtol=1e-15, atol=0)
    np.testing.assert_allclose(got[~exact], want[steps][~exact], rtol=1e-10, atol=1e-16)
    with jax.enable_x64(False):  # the float32 schedule a default-precision step reads
        got32 = np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(steps, jnp.int32)))
    np.testing.assert_allclose(got32, want[steps], rtol=2e-6, atol=1e-9)


def test_linear_warmup_of_zero_iterations_holds_the_start_value_as_torch():
    want = torch_lrs(lambda o: L.LinearLR(o, start_factor=0.25, total_iters=0), 5)
    with jax.enable_x64(True):
        got = [float(optim.linear_warmup(0.1, total_iters=0, start_factor=0.25)(jnp.asarray(i))) for i in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-15)


@pytest.mark.parametrize("kw", [dict(momentum=0.9, weight_decay=1e-2), dict(momentum=0.9, nesterov=True), dict()])
def test_sgd_maximize_matches_torch(kw):
    _run_both(lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True, **kw), optim.sgd(0.1, maximize=True, **kw))


def test_adamw_maximize_matches_torch():
    _run_both(lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, maximize=True),
              optim.adamw(0.01, weight_decay=0.1, maximize=True))


@pytest.mark.parametrize("call, message", [
    (lambda: optim.sgd(None), "`learning_rate` (=None) must be a finite number >= 0 or a schedule"),
    (lambda: optim.sgd("0.1"), "`learning_rate` (='0.1') must be a finite number >= 0 or a schedule"),
    (lambda: optim.adamw(betas=0.9), "`betas` (=0.9) must be two numbers"),
    (lambda: optim.adamw(betas=(0.9,)), "`betas` (=(0.9,)) must be two numbers"),
    (lambda: optim.adamw(betas=("0.9", "0.999")), "`betas` (=('0.9', '0.999')) must be two numbers"),  # was accepted
    (lambda: optim.multistep_lr(0.1, 5), "`milestones` (=5) must be a list of steps"),
    # torch compares the step with each milestone: 2.5 would silently never fire
    (lambda: optim.multistep_lr(0.1, [2.5, 4]), "`milestones` (=2.5) must be a whole number"),
    (lambda: optim.step_lr(0.1, 2.5), "`step_size` (=2.5) must be a whole number >= 1"),
    (lambda: optim.step_lr(float("nan"), 3), "`base_lr` (=nan) must be a finite number >= 0"),
    (lambda: optim.cosine_annealing_lr(-0.1, 3), "`base_lr` (=-0.1) must be a finite number >= 0"),
    (lambda: optim.linear_warmup(0.1, total_iters=-1), "`total_iters` (=-1) must be a whole number >= 0"),
    # torch's LinearLR(opt, 1.0, 0.5, 1), a decay, translated by position: was a warm-up from 0.05
    (lambda: optim.linear_warmup(0.1, 1.0, 0.5, 1), "linear_warmup takes start_factor, end_factor and total_iters "
                                                    "as keywords, as torch's LinearLR(optimizer, start_factor, "
                                                    "end_factor, total_iters) names them (got (1.0, 0.5, 1) by"),
    # These were accepted and failed at the first update (or never: a NaN gamma did not decay),
    # with errors naming no argument.
    (lambda: optim.per_epoch(optim.step_lr(0.1, 2), 2.5), "`steps_per_epoch` (=2.5) must be a whole number >= 1"),
    (lambda: optim.per_epoch(optim.step_lr(0.1, 2), None), "`steps_per_epoch` (=None) must be a whole number >= 1"),
    (lambda: optim.per_epoch(0.1, 3), "`schedule` (=0.1) must be a schedule (epoch -> lr)"),
    (lambda: optim.sgd(0.1, momentum=0.9, dampening=None), "`dampening` (=None) must be a finite number"),
    (lambda: optim.step_lr(0.1, 2, gamma=float("nan")), "`gamma` (=nan) must be a finite number"),
    (lambda: optim.multistep_lr(0.1, [2], gamma=None), "`gamma` (=None) must be a finite number"),
    (lambda: optim.cosine_annealing_lr(0.1, 5, eta_min=None), "`eta_min` (=None) must be a finite number"),
    (lambda: optim.linear_warmup(0.1, total_iters=5, start_factor=None), "`start_factor` (=None) must be a finite number"),
    (lambda: optim.exponential_lr(0.1, float("nan")), "`gamma` (=nan) must be a finite number"),
    (lambda: optim.exponential_lr(-0.1, 0.9), "`base_lr` (=-0.1) must be a finite number >= 0"),
    (lambda: optim.constant_lr(0.1, factor=None), "`factor` (=None) must be a finite number"),
    (lambda: optim.constant_lr(0.1, total_iters=2.5), "`total_iters` (=2.5) must be a whole number >= 0"),
    # torch's positional order (factor, total_iters), as linear_warmup takes them: keywords only
    (lambda: optim.constant_lr(0.1, 0.5, 4), "constant_lr takes factor and total_iters as keywords, as torch's "
                                             "ConstantLR(optimizer, factor, total_iters) names them (got (0.5, 4) by"),
    # A schedule where optax takes none: float() of a function (sgd), or a failure at the first update (adamw).
    (lambda: optim.sgd(0.1, momentum=lambda step: 0.9), "`momentum` (=<function"),
    (lambda: optim.adamw(0.1, eps=lambda step: 1e-8), "`eps` (=<function"),
    (lambda: optim.sgd(0.1, weight_decay=lambda step: 1e-4), "only `learning_rate` takes a schedule"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert message in str(e.value)


def test_per_epoch_takes_a_whole_float_and_numpy_base_lrs_as_torch():
    """per_epoch(s, 3.0) failed at the first update ("Indexer must have integer type"); a numpy
    float32 base lr was refused by the schedules though sgd takes it."""
    ours = optim.per_epoch(optim.cosine_annealing_lr(np.float32(0.1), 5), 3.0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=float(np.float32(0.1)))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 5)
    for epoch in range(8):
        for step in range(3):
            assert float(ours(epoch * 3 + step)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6, abs=1e-9)
        opt.step()
        sched.step()


ONE_CYCLE = [  # torch's OneCycleLR arguments (its defaults: cos, pct_start 0.3, momentum 0.85-0.95)
    dict(total_steps=100),
    dict(total_steps=97, anneal_strategy="linear", pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
    dict(total_steps=50, three_phase=True, base_momentum=0.8, max_momentum=0.9),
    dict(total_steps=61, three_phase=True, anneal_strategy="linear", pct_start=0.45),
    dict(epochs=7, steps_per_epoch=13, pct_start=0.0),
    dict(total_steps=10, pct_start=0.95),
    dict(total_steps=1),
]
_LR_ONLY = ("base_momentum", "max_momentum")
_MOMENTUM_ONLY = ("div_factor", "final_div_factor")


@pytest.mark.parametrize("kw", ONE_CYCLE)
def test_one_cycle_lr_and_momentum_are_torchs_at_every_step(kw):
    """Every step of the cycle, and the one past its end that torch still computes (it raises
    on the next), in float64 (exact) and float32 (torch's values rounded once)."""
    total = kw.get("total_steps") or kw["epochs"] * kw["steps_per_epoch"]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    sched = L.OneCycleLR(opt, 0.4, **kw)
    want_lr, want_m = [], []
    for _ in range(total + 1):
        want_lr.append(opt.param_groups[0]["lr"])
        want_m.append(opt.param_groups[0]["momentum"])
        opt.step()
        if len(want_lr) <= total:
            sched.step()
    lr = optim.one_cycle_lr(0.4, **{k: v for k, v in kw.items() if k not in _LR_ONLY})
    momentum = optim.one_cycle_momentum(**{k: v for k, v in kw.items() if k not in _MOMENTUM_ONLY})
    assert list(lr.table) == want_lr and list(momentum.table) == want_m
    steps = jnp.arange(total + 3)  # past the end the last value holds (torch raises)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(jax.jit(jax.vmap(lr))(steps), want_lr + [want_lr[-1]] * 2)
        np.testing.assert_array_equal(jax.jit(jax.vmap(momentum))(steps), want_m + [want_m[-1]] * 2)
    np.testing.assert_array_equal(jax.jit(jax.vmap(lr))(steps), np.float32(want_lr + [want_lr[-1]] * 2))


def test_sgd_with_one_cycle_lr_and_momentum_steps_as_torch():
    """torch's OneCycleLR with its default momentum cycling, beside SGD with nesterov and weight
    decay: 10 float64 steps, with optax.inject_hyperparams feeding both schedules."""
    class OneCycle:
        def __init__(self, ps):
            self.opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True)
            self.sched = L.OneCycleLR(self.opt, 0.3, total_steps=10, pct_start=0.4)

        def step(self):
            self.opt.step()
            self.sched.step()

    tx = optax.inject_hyperparams(optim.sgd)(learning_rate=optim.one_cycle_lr(0.3, 10, pct_start=0.4),
                                             momentum=optim.one_cycle_momentum(10, pct_start=0.4),
                                             weight_decay=1e-2, nesterov=True)
    _run_both(OneCycle, tx)


class _AdamWOneCycle:
    """torch's AdamW under OneCycleLR, which cycles Adam's beta1 by default (`cycle_momentum`),
    stepped as a training loop does."""

    def __init__(self, ps, three_phase=False):
        self.opt = torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
        self.sched = L.OneCycleLR(self.opt, 0.05, total_steps=10, pct_start=0.4, base_momentum=0.5,
                                  max_momentum=0.95, three_phase=three_phase)
        self.betas = []

    def step(self):
        self.betas.append(self.opt.param_groups[0]["betas"])
        self.opt.step()
        if self.sched.last_epoch < 10:  # torch raises past total_steps; the schedule then holds
            self.sched.step()


@pytest.mark.parametrize("three_phase", [False, True])
def test_adamw_with_one_cycle_lr_and_beta1_steps_as_torch(three_phase):
    """Regression: adamw took beta1 as a number only, so torch's OneCycleLR with Adam (which
    cycles beta1, not a momentum) could not be reproduced. A beta1 schedule now steps as torch's:
    10 float64 steps, with beta1 swung from 0.95 to 0.5 and back, so the bias correction
    `1 - beta1**t` must use each step's beta1 as torch's does to agree."""
    made = []
    kw = dict(pct_start=0.4, three_phase=three_phase)
    tx = optim.adamw(optim.one_cycle_lr(0.05, 10, **kw),
                     betas=(optim.one_cycle_momentum(10, base_momentum=0.5, max_momentum=0.95, **kw), 0.99),
                     weight_decay=0.1)
    _run_both(lambda ps: made.append(_AdamWOneCycle(ps, three_phase)) or made[-1], tx)
    assert len({b[0] for b in made[0].betas}) > 3  # torch's beta1 did cycle


def test_adamw_beta1_schedule_out_of_range_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"`betas\[0\]`, a beta1 schedule, must stay in \[0, 1\), as torch's "
                                          r"Adam requires; it reaches 1.2 at step 0 \(e.g. one_cycle_momentum's"):
        optim.adamw(betas=(optim.one_cycle_momentum(10, max_momentum=1.2), 0.999))
    with pytest.raises(ConfigError, match=r"`betas` .* must be two numbers .* beta1 perhaps a schedule"):
        optim.adamw(betas=(0.9, optim.one_cycle_momentum(10)))


@pytest.mark.parametrize("call, message", [
    (lambda: optim.one_cycle_lr(0.1), "give `total_steps`, or `epochs` and `steps_per_epoch`"),
    (lambda: optim.one_cycle_lr(0.1, epochs=3), "give `total_steps`, or `epochs` and `steps_per_epoch`"),
    (lambda: optim.one_cycle_lr(0.1, 0), r"`total_steps` \(=0\) must be a whole number >= 1"),
    (lambda: optim.one_cycle_lr(0.1, 10, pct_start=1.5), r"`pct_start` \(=1.5\) must be from 0 to 1"),
    (lambda: optim.one_cycle_lr(0.1, 10, anneal_strategy="cosine"), r"`anneal_strategy` \(='cosine'\) must be "
                                                                     "'cos' or 'linear'"),
    (lambda: optim.one_cycle_lr(0.1, 10, div_factor=0), r"`div_factor` \(=0.0\) and `final_div_factor`"),
    (lambda: optim.one_cycle_lr(-0.1, 10), r"`max_lr` \(=-0.1\) must be a finite number >= 0"),
    (lambda: optim.one_cycle_lr(0.1, 10, pct_start=0.1), r"`pct_start` \(=0.1\) over 10 steps makes a phase of the "
                                                         "one-cycle lr schedule end where it starts"),
    # torch computes steps 0..9, then divides by zero in the scheduler.step() after the last
    (lambda: optim.one_cycle_momentum(10, pct_start=1.0), r"`pct_start` \(=1.0\) over 10 steps makes a phase of the "
                                                          "one-cycle momentum schedule end where it starts"),
    (lambda: optim.one_cycle_momentum(10, max_momentum=float("nan")), r"`max_momentum` \(=nan\) must be a finite"),
    (lambda: optim.one_cycle_momentum(20_000_000), r"length \(20,000,000 steps\) must be at most 10,000,000"),
])
def test_one_cycle_refuses_what_torch_refuses_by_name(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


PLATEAU = [  # torch's ReduceLROnPlateau arguments; the metrics fall, stall, rise and stall again
    dict(),
    dict(patience=2, factor=0.5),
    dict(patience=1, cooldown=2, factor=0.3, min_lr=0.004),
    dict(mode="max", patience=1, threshold=0.05),
    dict(mode="max", threshold_mode="abs", threshold=0.02, patience=0),
    dict(threshold_mode="abs", threshold=0.1, patience=1, eps=0.02),
    dict(patience=0, factor=0.0),
    dict(threshold=0.0, patience=1),  # an equal metric is no improvement
]


@pytest.mark.parametrize("kw", PLATEAU)
def test_reduce_lr_on_plateau_decides_as_torch_at_every_epoch(kw):
    rng = np.random.default_rng(3)
    metrics = list(np.concatenate([np.linspace(1.0, 0.5, 8), np.full(6, 0.5), 0.5 + rng.normal(0, 0.01, 12),
                                   np.linspace(0.5, 0.9, 5), [np.nan, 0.2, 0.2], np.full(30, 0.2)]))
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sched = L.ReduceLROnPlateau(opt, **kw)
    plateau = optim.reduce_lr_on_plateau(0.1, **kw)
    state, lrs = plateau.init(), []
    for i, m in enumerate(metrics):
        # the metric as a training loop has it: a float, or a numpy, jax or torch scalar (float32)
        m = [float, np.float64, jnp.asarray, torch.tensor][i % 4](m)
        sched.step(m)
        state = plateau.step(state, m)
        assert (state.lr, state.best, state.num_bad_epochs, state.cooldown_counter, state.last_epoch) == (
            opt.param_groups[0]["lr"], sched.best, sched.num_bad_epochs, sched.cooldown_counter,
            sched.last_epoch), i
        lrs.append(state.lr)
    assert len(set(lrs)) > 1 or kw.get("factor") == 0.0 and lrs[-1] == 0.0, lrs  # the cases reduce at least once


def test_reduce_lr_on_plateau_drives_sgd_as_torch():
    """Six "epochs" of two float64 SGD steps, the lr set from the state after each epoch, as
    torch's scheduler sets its param group."""
    metrics = [1.0, 0.9, 0.9, 0.9, 0.95, 0.9]

    class Plateau:
        def __init__(self, ps):
            self.opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
            self.sched, self.steps = L.ReduceLROnPlateau(self.opt, patience=1, factor=0.5), 0

        def step(self):
            self.opt.step()
            self.steps += 1
            if self.steps % 2 == 0:
                self.sched.step(metrics[self.steps // 2 - 1])
                torch_lrs.append(self.opt.param_groups[0]["lr"])

    plateau = optim.reduce_lr_on_plateau(0.1, patience=1, factor=0.5)
    tx = optax.inject_hyperparams(optim.sgd)(learning_rate=plateau.init().lr, momentum=0.9)
    lrs, torch_lrs = [], []

    def init(params):  # the optimizer, and the lr set after every second update as the loop above does
        return {"inner": tx.init(params), "steps": 0, "sched": plateau.init()}

    def update(updates, state, params=None):
        u, inner = tx.update(updates, state["inner"], params)
        steps, s = state["steps"] + 1, state["sched"]
        if steps % 2 == 0:
            s = plateau.step(s, metrics[steps // 2 - 1])
            inner.hyperparams["learning_rate"] = jnp.asarray(s.lr, inner.hyperparams["learning_rate"].dtype)
            lrs.append(s.lr)
        return u, {"inner": inner, "steps": steps, "sched": s}

    _run_both(Plateau, optax.GradientTransformation(init, update), steps=12, jit=False)
    assert lrs == torch_lrs == [0.1, 0.1, 0.1, 0.05, 0.05, 0.025], (lrs, torch_lrs)


@pytest.mark.parametrize("call, message", [
    (lambda: optim.reduce_lr_on_plateau(0.1, factor=1.0), r"`factor` \(=1.0\) must be < 1"),
    (lambda: optim.ReduceLROnPlateau(0.1, "min", 1.5, 10, 1e-4, "rel", 0, 0.0, 1e-8), r"`factor` \(=1.5\) must be < 1"),
    (lambda: optim.reduce_lr_on_plateau(0.1, mode="minimum"), r"`mode` \(='minimum'\) must be 'min'"),
    (lambda: optim.reduce_lr_on_plateau(0.1, threshold_mode="relative"), r"`threshold_mode` \(='relative'\) must be"),
    (lambda: optim.reduce_lr_on_plateau(0.1, patience=-1), r"`patience` \(=-1\) must be a whole number >= 0"),
    (lambda: optim.reduce_lr_on_plateau(0.1, min_lr=float("nan")), r"`min_lr` \(=nan\) must be a finite number"),
    (lambda: optim.reduce_lr_on_plateau(0.1).step(optim.reduce_lr_on_plateau(0.1).init(), "low"),
     r"`metric` \(='low'\) must be a number or a 0-d array"),
])
def test_reduce_lr_on_plateau_refuses_by_name(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
