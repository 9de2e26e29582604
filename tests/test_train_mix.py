"""`--mixup-alpha` and `--cutmix-alpha` against torchvision's `v2.MixUp` and `v2.CutMix`.

Each comparison controls torchvision's randomness, so that both sides mix with the same draw:
the transform's `_dist` (its Beta) is replaced by one that returns the test's `lam`, and
`torch.randint` (CutMix's box centre) by one that returns the test's centre. Then:

* the mixed images and soft targets equal torchvision's (float64 images: 1e-15; torchvision makes
  integer labels' targets float32, so those are compared within 1e-7);
* the soft-target cross-entropy equals `F.cross_entropy(logits, probs, label_smoothing=ls)`
  (float64, 1e-12), gradients included;
* two SGD steps of ResNet-18 in float64 with jaxport's own draws equal torch's steps on the batch
  torchvision mixes with those draws, through `CrossEntropyLoss(label_smoothing=0.1)` (1e-8, as
  test_train_parity.py);
* the mixed step gives the same weights on 1 and 8 devices (SyncBatchNorm, float64), and the
  mixing inside `shard_map` equals the mixing of the whole batch;
* `train` runs with both, resumes exactly, and reports a changed alpha; bad values are refused.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision
from jax.sharding import PartitionSpec as P
from torchvision.transforms import v2

from jaxport._cli import main
from jaxport._errors import ConfigError
from jaxport.models import build
from jaxport.train import TrainConfig, create_state, cross_entropy, make_mesh, make_train_step, shard_batch, train
from jaxport.train import _loop, _mix
from torch_compat import flax_to_torch, optim, torch_to_flax
from tests.helpers import rel_errors

N, C, H, W = 6, 5, 6, 8  # a non-square image: a swap of height and width fails


def _batch(dtype=np.float64, n=N):
    rng = np.random.default_rng(1)
    images = rng.standard_normal((n, 3, H, W)).astype(dtype)  # torch's NCHW
    labels = rng.permutation(np.arange(n) % C)  # every class, neighbours mostly different
    return images, labels


class _Fixed:
    """A stand-in for the transform's `Beta` that draws `lam`."""

    def __init__(self, lam):
        self.lam = lam

    def sample(self, shape=()):
        return torch.tensor([self.lam], dtype=torch.float64)


def _controlled(transform, monkeypatch, lam, r_x=None, r_y=None):
    transform._dist = _Fixed(lam)
    if r_x is not None:
        def randint(high, size):  # CutMix draws randint(W), then randint(H)
            assert high in (W, H) and W != H
            return torch.tensor([r_x if high == W else r_y])
        monkeypatch.setattr(torch, "randint", randint)
    return transform


def _nhwc(x):
    return jnp.asarray(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-15), (np.float32, 1e-6)])
@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 0.97, 1.0])
def test_mixup_equals_torchvisions(x64, monkeypatch, lam, dtype, tol):
    images, labels = _batch(dtype)
    want_x, want_y = _controlled(v2.MixUp(alpha=0.2, num_classes=C), monkeypatch, lam)(
        torch.tensor(images), torch.tensor(labels))
    got_x, got_y = jax.jit(_mix.mixup, static_argnums=2)(_nhwc(images), jnp.asarray(labels), C, lam)
    assert got_x.dtype == dtype
    np.testing.assert_allclose(np.asarray(got_x).transpose(0, 3, 1, 2), want_x.numpy(), rtol=0, atol=tol)
    np.testing.assert_allclose(np.asarray(got_y), want_y.numpy(), rtol=0, atol=1e-7)  # torch's float32 targets
    assert not np.allclose(want_x.numpy(), images) or lam == 1.0  # the case mixes something


# (lam, r_x, r_y): boxes clipped at each side, lam 0 (a box of half the image each way, clipped),
# and lam near 1 (half sides int(0.05 * 8) = 0: an empty box, lam_adjusted 1)
BOXES = [(0.4, 7, 1), (0.0, 0, 5), (0.9, 3, 2), (0.99, 4, 3), (0.5, 7, 5), (0.2, 4, 3)]


@pytest.mark.parametrize("lam, r_x, r_y", BOXES)
def test_cutmix_box_images_and_targets_equal_torchvisions(x64, monkeypatch, lam, r_x, r_y):
    images, labels = _batch()
    cut = _controlled(v2.CutMix(alpha=1.0, num_classes=C), monkeypatch, lam, r_x, r_y)
    params = cut.make_params([torch.tensor(images)])
    box, lam_adjusted = _mix.cutmix_box(lam, r_x, r_y, H, W)
    assert tuple(int(b) for b in box) == params["box"]
    assert float(lam_adjusted) == params["lam_adjusted"]  # the same double: 1 - area / (W * H)
    want_x, want_y = cut(torch.tensor(images), torch.tensor(labels))
    got_x, got_y = jax.jit(_mix.cutmix, static_argnums=2)(_nhwc(images), jnp.asarray(labels), C, box)
    np.testing.assert_array_equal(np.asarray(got_x).transpose(0, 3, 1, 2), want_x.numpy())  # pixels copied
    np.testing.assert_allclose(np.asarray(got_y), want_y.numpy(), rtol=0, atol=1e-7)


def _near_half_side_boundaries(size):
    """float32 `lam` where `0.5 * sqrt(1 - lam) * size` is (near) a whole number c, for every c:
    `1 - (2c / size)^2` rounded to float32, and two neighbours either side."""
    exact = (1 - (2 * np.arange(size // 2 + 1) / size) ** 2).astype(np.float32)
    return np.concatenate([exact + k * np.spacing(exact) for k in (-2, -1, 0, 1, 2)])


@pytest.mark.parametrize("alpha", [0.2, 1.0])
@pytest.mark.parametrize("height, width", [(176, 224), (7, 33)])
def test_cutmix_box_of_float32_draws_equals_torchvisions(monkeypatch, alpha, height, width):
    """The training step draws `lam` in float32 (no x64) and torchvision computes the box from
    it in float64 (`float(sample)`): the boxes agree for jax's own Beta draws, for every `lam`
    near a half side's boundary and for `lam` below 2^-25, where float32's `1 - lam` is 1.
    Computed in float32, 1.6% of alpha 0.2's boxes were one pixel wider each way."""
    draws = jax.random.beta(jax.random.key(0), alpha, alpha, (3000,))
    tiny = np.float32([0, 1e-40, 1e-30, 2.0 ** -54, np.nextafter(np.float32(2.0 ** -54), 1), 1e-12, 1e-9, 2.0 ** -25,
                       1e-7, 0.75, 1])
    lams = np.concatenate([np.asarray(draws), _near_half_side_boundaries(width), _near_half_side_boundaries(height),
                           tiny])
    lams = lams[(lams >= 0) & (lams <= 1)]
    assert lams.dtype == np.float32 and (lams < 2.0 ** -25).sum() >= (50 if alpha == 0.2 else 7)
    r_x, r_y = width // 2, height // 2  # centred: the box is never clipped, each half side counts twice
    boxes, _ = jax.jit(jax.vmap(lambda lam: _mix.cutmix_box(lam, r_x, r_y, height, width)))(lams)
    got = np.stack([np.asarray(b) for b in boxes], axis=1)
    cut = v2.CutMix(alpha=alpha, num_classes=C)
    monkeypatch.setattr(torch, "randint", lambda high, size: torch.tensor([r_x if high == width else r_y]))
    image = [torch.zeros(1, 3, height, width)]
    want = []
    for lam in lams.tolist():  # float32 values, as Python floats: torchvision's `float(sample)`
        cut._dist = _Fixed(lam)
        want.append(cut.make_params(image)["box"])
    differ = np.flatnonzero((got != np.array(want)).any(axis=1))
    assert not differ.size, [(float(lams[i]), tuple(got[i]), want[i]) for i in differ[:5]]


def test_float32_mixing_gives_torchvisions_targets_bit_for_bit(monkeypatch):
    """The training step mixes float32 batches without x64; torchvision mixes them with its
    float32 draw as a Python float. The targets of both and CutMix's images are the same floats:
    CutMix's targets were weighted by float32's `1 - area / (W * H)` and one minus that, where
    torch rounds its float64 `lam_adjusted` (694 of 1200 boxes differed). MixUp's images differ
    by rounding only (XLA:CPU's fused multiply-adds: `_mix._blend`)."""
    height, width = 11, 13
    rng = np.random.default_rng(1)
    images = rng.standard_normal((N, 3, height, width)).astype(np.float32)
    labels = rng.permutation(np.arange(N) % C)
    x, y = jnp.asarray(images.transpose(0, 2, 3, 1)), jnp.asarray(labels)
    mixup, cutmix = jax.jit(_mix.mixup, static_argnums=2), jax.jit(_mix.cutmix, static_argnums=2)
    centre = {}
    monkeypatch.setattr(torch, "randint", lambda high, size: torch.tensor([centre["x" if high == width else "y"]]))
    lams = np.asarray(jax.random.uniform(jax.random.key(0), (60,)))
    assert lams.dtype == np.float32
    for lam in lams.tolist():
        mix = v2.MixUp(alpha=1.0, num_classes=C)
        mix._dist = _Fixed(lam)
        want_x, want_y = mix(torch.tensor(images), torch.tensor(labels))
        got_x, got_y = mixup(x, y, C, np.float32(lam))
        np.testing.assert_allclose(np.asarray(got_x).transpose(0, 3, 1, 2), want_x.numpy(), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got_y), want_y.numpy(), err_msg=lam)
        for centre["x"], centre["y"] in [(3, 4), (0, 10), (12, 0), (6, 5)]:
            cut = v2.CutMix(alpha=1.0, num_classes=C)
            cut._dist = _Fixed(lam)
            want_x, want_y = cut(torch.tensor(images), torch.tensor(labels))
            box, _ = _mix.cutmix_box(np.float32(lam), centre["x"], centre["y"], height, width)
            got_x, got_y = cutmix(x, y, C, box)
            np.testing.assert_array_equal(np.asarray(got_x).transpose(0, 3, 1, 2), want_x.numpy())
            np.testing.assert_array_equal(np.asarray(got_y), want_y.numpy(), err_msg=(lam, centre))


def test_draws_follow_torchvisions_distributions():
    """`draw` over 4000 keys: the choice is uniform, each transform's lam has its own alpha's
    Beta variance (1 / (4 (2 alpha + 1))), the centre is uniform over the image."""
    keys = jax.random.split(jax.random.key(0), 4000)
    d = jax.jit(jax.vmap(lambda k: _mix.draw(k, H, W, 0.2, 1.0)))(keys)
    cut, lam = np.asarray(d["cutmix"]), np.asarray(d["lam"])
    assert abs(cut.mean() - 0.5) < 0.03
    for chosen, alpha in ((True, 1.0), (False, 0.2)):
        values = lam[cut == chosen]
        assert abs(values.mean() - 0.5) < 0.03
        assert abs(values.var() - 1 / (4 * (2 * alpha + 1))) < 0.02, (alpha, values.var())
    assert set(np.asarray(d["r_x"])) == set(range(W)) and set(np.asarray(d["r_y"])) == set(range(H))
    cut_only, mixup_only = jax.jit(jax.vmap(lambda k: (_mix.draw(k, H, W, 0.0, 1.0)["cutmix"],
                                                       _mix.draw(k, H, W, 0.2, 0.0)["cutmix"])))(keys[:10])
    assert np.asarray(cut_only).all() and not np.asarray(mixup_only).any()


def test_mixing_inside_shard_map_is_the_whole_batchs(x64):
    """Over 8 devices (`axis_name`), 2 images each, the roll crosses the devices: the result is
    the whole batch's."""
    images, labels = _batch(n=16)
    x, y = _nhwc(images), jnp.asarray(labels)
    key = _mix.step_key(3, 5)
    mesh = make_mesh(jax.devices("cpu")[:8])
    # the whole-batch references, one per function above
    refs = [_mix.mixup(x, y, C, 0.3), _mix.cutmix(x, y, C, (2, 1, 7, 4)), _mix.mix(key, x, y, C, 0.2, 1.0)]
    assert not np.allclose(refs[2][0], x)  # the draw mixes something
    fs = [lambda x, y: _mix.mixup(x, y, C, 0.3, axis_name="data"),
          lambda x, y: _mix.cutmix(x, y, C, (2, 1, 7, 4), axis_name="data"),
          lambda x, y: _mix.mix(key, x, y, C, 0.2, 1.0, axis_name="data")]
    for f, (want_x, want_y) in zip(fs, refs):
        got_x, got_y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))(x, y)
        # (eager and compiled arithmetic may round differently: 1e-15 of values ~1)
        np.testing.assert_allclose(got_x, want_x, rtol=0, atol=1e-14)
        np.testing.assert_allclose(got_y, want_y, rtol=0, atol=1e-14)


def _torch_soft(logits, probs, weights, ls):
    t = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(probs), reduction="none", label_smoothing=ls)
    (loss * torch.tensor(weights)).sum().backward()
    return loss.detach().numpy(), t.grad.numpy()


@pytest.mark.parametrize("ls", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("jit", [False, True])
def test_soft_target_cross_entropy_equals_torchs(x64, ls, jit):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((N, C)) * 4
    logits[0, 2] += 60  # a confident row
    probs = rng.dirichlet(np.ones(C), N)
    probs[1] = np.eye(C)[3]  # a one-hot row, and a mixed pair of two classes
    probs[2] = 0.3 * np.eye(C)[1] + 0.7 * np.eye(C)[4]
    weights = rng.standard_normal(N)
    want, want_grad = _torch_soft(logits, probs, weights, ls)
    f = jax.jit(cross_entropy, static_argnums=2) if jit else cross_entropy
    got = f(jnp.asarray(logits), jnp.asarray(probs), ls)
    grad = jax.grad(lambda z: jnp.sum(f(z, jnp.asarray(probs), ls) * weights))(jnp.asarray(logits))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-12)
    # a one-hot row is the integer label's loss
    np.testing.assert_allclose(got[1], cross_entropy(jnp.asarray(logits), jnp.arange(N) * 0 + 3, ls)[1], rtol=1e-14)


def test_an_out_of_range_label_makes_its_pair_nan_without_a_gradient(x64):
    """torch's one_hot raises; a jitted step cannot: the example and the one mixed with it
    (the next) get a NaN loss and no gradient; the others are torch's."""
    images, labels = _batch()
    labels[2] = C
    _, targets = _mix.mixup(_nhwc(images), jnp.asarray(labels), C, 0.3)
    logits = np.random.default_rng(0).standard_normal((N, C))
    loss = np.asarray(cross_entropy(jnp.asarray(logits), targets))
    assert np.isnan(loss[[2, 3]]).all() and np.isfinite(np.delete(loss, [2, 3])).all()
    grad = jax.grad(lambda z: jnp.nansum(cross_entropy(z, targets)))(jnp.asarray(logits))
    grad = np.asarray(grad)
    assert np.isfinite(grad).all() and not grad[[2, 3]].any() and grad[[0, 1, 4, 5]].all()


# --- the step, against torch and across device counts ------------------------------------------

BATCH, SIZE, LS, MIXUP, CUTMIX = 8, 16, 0.1, 0.2, 1.0


def _seed_with_both() -> int:
    """A seed whose steps 0 and 1 draw MixUp once and CutMix once, with a box that is neither
    empty nor the whole image (so each transform's own code is exercised)."""
    for seed in range(100):
        d = [_draw(seed, s) for s in (0, 1)]
        if {bool(x["cutmix"]) for x in d} == {True, False}:
            cut = next(x for x in d if x["cutmix"])
            box, lam = _mix.cutmix_box(cut["lam"], cut["r_x"], cut["r_y"], SIZE, SIZE)
            if 0.1 < float(lam) < 0.9:
                return seed
    raise AssertionError("no seed in 0-99 draws both")


def _draw(seed, step):
    return jax.device_get(_mix.draw(_mix.step_key(seed, step), SIZE, SIZE, MIXUP, CUTMIX))


@functools.lru_cache
def _reference():
    torch.manual_seed(0)
    tmodel = torchvision.models.resnet18(num_classes=C, zero_init_residual=True).double()
    rng = np.random.default_rng(0)
    with torch.no_grad():  # calibrated BatchNorm: torch's 0/1 statistics would hide a swap
        tmodel.train()
        for _ in range(2):
            tmodel(torch.tensor(rng.standard_normal((BATCH, 3, SIZE, SIZE))))
    batches = [(rng.standard_normal((BATCH, 3, SIZE, SIZE)), rng.permutation(np.arange(BATCH) % C)) for _ in range(2)]
    return tmodel.state_dict(), batches


@functools.lru_cache
def _step(num_devices, seed):
    mesh = make_mesh(jax.devices("cpu")[:num_devices])
    assert mesh.devices.size == num_devices, "tests/conftest.py sets JAX_NUM_CPU_DEVICES=8"
    model = build("resnet18", num_classes=C, param_dtype=np.float64, bn_axis_name="data")  # SyncBatchNorm
    tx = optim.sgd(0.05, momentum=0.9, weight_decay=1e-4)
    return mesh, tx, make_train_step(model, tx, mesh, label_smoothing=LS, mixup_alpha=MIXUP, cutmix_alpha=CUTMIX,
                                     seed=seed)


def _train_jax(num_devices, seed):
    state_dict, batches = _reference()
    mesh, tx, step = _step(num_devices, seed)
    state = create_state(torch_to_flax(state_dict, "resnet18"), tx, mesh)
    correct = []
    for x, y in batches:
        state, m = step(state, *shard_batch(mesh, x.transpose(0, 2, 3, 1), y))
        correct.append(int(m["correct"]))
    return {k: v.numpy() for k, v in flax_to_torch(jax.device_get(state.variables), "resnet18").items()}, correct


def _train_torch(seed):
    """torchvision's train.py: the collate_fn's transform (the one jaxport's draw chose, with its
    draw), then CrossEntropyLoss(label_smoothing) on the soft targets. The labels go in one-hot
    in float64: torchvision's one_hot(...).float() would round the targets to float32."""
    state_dict, batches = _reference()
    tmodel = torchvision.models.resnet18(num_classes=C).double()
    tmodel.load_state_dict(state_dict)
    tmodel.train()
    opt = torch.optim.SGD(tmodel.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=LS)
    correct = []
    for s, (x, y) in enumerate(batches):
        d = _draw(seed, s)
        transform = v2.CutMix(alpha=CUTMIX, num_classes=C) if d["cutmix"] else v2.MixUp(alpha=MIXUP, num_classes=C)
        transform._dist = _Fixed(float(d["lam"]))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "randint", _centre(int(d["r_x"]), int(d["r_y"])))
            image, target = transform(torch.tensor(x), torch.nn.functional.one_hot(torch.tensor(y), C).double())
        output = tmodel(image)
        opt.zero_grad()
        criterion(output, target).backward()
        opt.step()
        correct.append(int((output.argmax(1) == target.max(dim=1)[1]).sum()))  # utils.accuracy with 2-D targets
    return {k: v.detach().numpy() for k, v in tmodel.state_dict().items()}, correct


def _centre(r_x, r_y):
    calls = iter([r_x, r_y])  # CutMix draws randint(W), then randint(H) (square here: by order)

    def randint(high, size):
        assert high == SIZE
        return torch.tensor([next(calls)])
    return randint


def test_two_mixed_steps_equal_torchs_float64(x64):
    seed = _seed_with_both()
    got, got_correct = _train_jax(1, seed)
    want, want_correct = _train_torch(seed)
    errors = rel_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-8, (worst, errors[worst])
    assert got_correct == want_correct


def test_mixed_steps_are_the_same_on_1_and_8_devices(x64):
    """One image per device: a roll within each device's share would leave the batch unmixed."""
    seed = _seed_with_both()
    one, correct1 = _train_jax(1, seed)
    eight, correct8 = _train_jax(8, seed)
    errors = rel_errors(eight, one)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-10, (worst, errors[worst])
    assert correct1 == correct8


# --- the loop and the flags ----------------------------------------------------------------------

def _run(workdir, **kw):
    lines = []
    cfg = TrainConfig(**{"workdir": str(workdir), "image_size": 16, "batch_size": 16, "epochs": 1, "progress": False,
                         "devices": 2, "mixup_alpha": 0.2, "cutmix_alpha": 1.0, **kw})
    result = train(cfg, log=lines.append)
    return jax.device_get(result["state"].params), "\n".join(lines)


@pytest.mark.slow
def test_train_mixes_resumes_exactly_and_reports_a_changed_alpha(tmp_path):
    straight, _ = _run(tmp_path / "a", max_steps=2)
    _run(tmp_path / "b", max_steps=1)
    resumed, said = _run(tmp_path / "b", max_steps=2, resume=True)
    assert "resuming from step 1\n" in said + "\n", said
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)  # the draws come from (seed, step)
    _, said = _run(tmp_path / "b", max_steps=2, resume=True, cutmix_alpha=0.5)  # (nothing left to train)
    assert "resuming from step 2 with changed settings: --cutmix-alpha 0.5 (was 1.0)" in said, said


def test_checkpoints_from_before_mixing_resume_without_it():
    saved = {k: v for k, v in _loop._settings(TrainConfig(workdir="w")).items() if "alpha" not in k}
    now = _loop._settings(TrainConfig(workdir="w"))
    assert _loop._changes(saved, now) == ""
    assert _loop._changes(saved, now | {"mixup_alpha": 0.2}) == " with changed settings: --mixup-alpha 0.2 (was 0.0)"


@pytest.mark.parametrize("flag", ["mixup_alpha", "cutmix_alpha"])
@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.2", True, None])
def test_a_bad_alpha_is_refused_before_any_work(tmp_path, flag, bad):
    name = "--" + flag.replace("_", "-")
    what = "MixUp" if flag == "mixup_alpha" else "CutMix"
    shown = repr(bad) if isinstance(bad, (str, bool)) or bad is None else str(bad)
    message = (f"`{name}` (={shown}) must be a finite number >= 0: the alpha of {what}'s Beta(alpha, alpha), as "
               f"torchvision's train.py takes it, e.g. {0.2 if what == 'MixUp' else 1.0}; 0 for no {what}")
    with pytest.raises(ConfigError) as e:
        train(TrainConfig(workdir=str(tmp_path / "w"), **{flag: bad}))
    assert str(e.value) == message
    assert not (tmp_path / "w").exists()
    with pytest.raises(ConfigError, match=f"^`{flag}` "):
        make_train_step(build("resnet18", num_classes=3), optim.sgd(0.1), make_mesh(jax.devices("cpu")[:1]),
                        **{flag: bad})


@pytest.mark.parametrize("text, message", [
    ("x", "`--mixup-alpha` (='x') must be a number, e.g. --mixup-alpha 0.2"),
    ("0,2", "`--mixup-alpha` (='0,2') must be a number; use --mixup-alpha 0.2"),
    ("-1", "`--mixup-alpha` (=-1.0) must be a finite number >= 0: the alpha of MixUp's Beta(alpha, alpha)"),
])
def test_the_flags_refuse_a_bad_value_in_one_line(capsys, tmp_path, text, message):
    try:
        code = main(["train", "--workdir", str(tmp_path / "w"), "--no-progress", "--mixup-alpha", text])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("jaxport: error: " + message) and err.count("\n") == 1, err
    try:
        code = main(["train", "--workdir", str(tmp_path / "w"), "--no-progress", "--cutmix-alpha", "nan"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "`--cutmix-alpha` (=nan) must be a finite number >= 0" in err, err
