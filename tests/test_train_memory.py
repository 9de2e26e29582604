"""Device memory: `--batch-size auto` through `train`, and RESOURCE_EXHAUSTED as one clear error.

The memory figures are XLA's compiled memory analysis on CPU (the same code path as on a GPU;
only the limit differs). Out-of-memory during training is simulated by a step that raises the
runtime error XLA raises, since a CPU host does not run out at these sizes.
"""
import math
import re

import jax
import numpy as np
import pytest

from jaxport import _cli
from jaxport.train import TrainConfig, _loop, _memory, train
from tests.helpers import write_images

OOM_TEXT = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.50GiB."


def test_batch_size_auto_trains_with_the_largest_batch_allowed(tmp_path):
    messages = []
    out = train(TrainConfig(workdir=str(tmp_path), batch_size="auto", image_size=8, devices=2, max_steps=1,
                            memory_limit_bytes=2**40, progress=False), log=messages.append)
    # With memory to spare the cap wins: 256 per device (the training set holds 1438 images).
    assert any("--batch-size auto: 256 per device, the most it picks" in m for m in messages), messages
    assert any("global batch 512 (256 per device)" in m for m in messages), messages
    assert int(out["state"].step) == 1


def _raising_step(monkeypatch):
    real = _loop.make_train_step

    def make(model, tx, mesh, *, donate=True, **options):
        step = real(model, tx, mesh, donate=donate, **options)
        if not donate:  # the memory analysis behind the suggestion compiles the real step
            return step

        def oom(*args):
            raise jax.errors.JaxRuntimeError(OOM_TEXT)

        return oom

    monkeypatch.setattr(_loop, "make_train_step", make)


def test_resource_exhausted_is_one_line_naming_a_batch_that_fits(tmp_path, monkeypatch, capsys):
    _raising_step(monkeypatch)
    # 40 px: layer4's maps are 2x2, so even one image per device is a valid step to suggest.
    cmd = ["train", "--workdir", str(tmp_path), "--image-size", "40", "--batch-size", "32", "--no-progress"]
    assert _cli.main(cmd) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # At small sizes the parameters dominate and XLA's figure barely moves with the batch, so
    # which smaller batch is named varies; that it is smaller, and on the one error line, does not.
    # The same batch in more passes (--grad-accum-steps) is named first when one fits.
    found = re.fullmatch(r"jaxport: error: out of device memory \(RESOURCE_EXHAUSTED\) at `--batch-size` \(=32, 4 per "
                         r"device\); use (?:--grad-accum-steps ([24]) \(the same --batch-size in passes of ([12]) per "
                         r"device\), or )?--batch-size (\d+) \((\d) per device\), which XLA's memory analysis predicts "
                         r"fits? \(the failed one: \d+ MiB per device\)", err[-1])
    assert found and int(found[3]) == 8 * int(found[4]) and int(found[4]) < 4, err
    assert found[1] is None or int(found[1]) * int(found[2]) == 4, err
    assert not any("Traceback" in line or "12.50GiB" in line for line in err), err


def test_resource_exhausted_when_one_image_per_device_is_too_much(tmp_path, monkeypatch):
    _raising_step(monkeypatch)
    monkeypatch.setattr(_memory, "device_memory_bytes", lambda: 1000)
    # At 8 px layer4's maps are 1x1: one image per device is no valid step for per-device
    # BatchNorm (torch refuses it), so the smallest batch tried and named is 2 per device.
    with pytest.raises(_memory.OutOfMemoryError, match=r"at `--batch-size` \(=16, 2 per device\); a batch of 2 per "
                                                        r"device needs \d+ MiB, more than the 0 MiB available"):
        train(TrainConfig(workdir=str(tmp_path), image_size=8, batch_size=16, progress=False))


@pytest.mark.parametrize("err, expected", [
    (jax.errors.JaxRuntimeError(OOM_TEXT), True),
    (jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes differ"), False),
    (_memory.OutOfMemoryError("a batch of 1 per device needs 5 MiB"), False),  # already translated
])
def test_is_out_of_memory(err, expected):
    assert _memory.is_out_of_memory(err) is expected


def test_memory_probes_skip_llvms_optimisation_and_give_the_optimised_programs_figures(monkeypatch):
    """`--batch-size auto` compiles several batch sizes only to read XLA's memory analysis. On
    CPU those compilations skip LLVM's optimisation (~30% faster); buffers are assigned before
    code generation, so the figure must be the one of the program that then runs."""
    import jax.numpy as jnp

    from jaxport.models import build
    from jaxport.train._optim import sgd
    from jaxport.train._step import create_state, make_mesh, make_train_step

    mesh = make_mesh(jax.devices()[:2])
    model = build("resnet18", num_classes=10)
    tx = sgd(0.1, momentum=0.9)
    state = create_state(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 3))), tx, mesh)
    step = make_train_step(model, tx, mesh, donate=False)

    seen = []
    real = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kwargs):
        seen.append(compiler_options)
        return real(self, compiler_options=compiler_options, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    probed = _memory.step_bytes(step, state, mesh, 3, 16)
    monkeypatch.setattr(_memory, "_probe_options", lambda mesh: None)  # as jit compiles the step that runs
    optimised = _memory.step_bytes(step, state, mesh, 3, 16)
    assert seen == [{"xla_backend_optimization_level": 0}, None]
    assert probed == optimised


def _curves(n):
    """Growing memory figures (bytes) for batches 0..n: affine; flat, then steeper twice, as
    XLA's are (fixed buffers dominate the first batches); convex, concave, lumpy, and one jump."""
    b = np.arange(n + 1)
    return {"affine": 10_000 + 300 * b,
            "flat-then-steep": 10_000 + 130 * np.maximum(0, b - 3) + 130 * np.maximum(0, b - 80),
            "convex": 10_000 + 3 * b ** 2,
            "concave": 10_000 + (3_000 * np.sqrt(b)).astype(int),
            "lumpy": 10_000 + 300 * b + np.maximum.accumulate(np.random.default_rng(0).integers(0, 5_000, n + 1)),
            "jump": 10_000 + b + 50_000 * (b > n // 3)}


@pytest.mark.parametrize("lo, hi", [(1, 256), (2, 256), (2, 179), (1, 12), (3, 40), (2, 2)])
def test_the_batch_search_is_exact_and_asks_few_sizes(lo, hi):
    """The largest fitting size for any growing figure, asking at most 3 log2 of the sizes + 2:
    each one asked is a compilation of seconds."""
    sizes = _memory.candidate_sizes(lo, hi)
    bound = 3 * math.ceil(math.log2(len(sizes))) + 2 if len(sizes) > 1 else 1
    for name, curve in _curves(hi).items():
        for limit in np.unique(np.linspace(curve[lo], curve[hi] * 1.01, 40).astype(int)):
            asked = []
            got = _memory._largest_fitting(lambda b: asked.append(b) or int(curve[b]), sizes, int(limit))
            assert got == max(b for b in sizes if curve[b] <= limit), (name, limit)
            assert len(set(asked)) <= bound, (name, limit, asked)
    assert _memory._largest_fitting(lambda b: 100, sizes, 99) is None


def test_batch_size_auto_compiles_few_sizes_where_memory_is_flat_then_steep(monkeypatch):
    """XLA's figure for ResNet-18 at 16 px is the same for batches 2 and 3 (fixed buffers), then
    grows. The affine prediction from those two said 256, and stepping down from it compiled 13
    sizes, ~5 s each, before settling on 80 per device (up to 17 on this curve)."""
    curve = _curves(256)["flat-then-steep"]
    asked = []

    def step_bytes(step, state, mesh, b, image_size):
        asked.append(b)
        return int(curve[b])

    monkeypatch.setattr(_memory, "step_bytes", step_bytes)
    sizes = _memory.candidate_sizes(2, 256)
    for want, bigger in zip(sizes[1:], sizes[2:]):  # (2 needs what 3 needs)
        asked.clear()
        limit = int(curve[want] + curve[bigger]) // 2
        assert _memory.largest_batch(None, None, None, 16, limit, min_per_device=2, log=lambda m: None) == want
        assert len(set(asked)) <= 7, (want, asked)


def test_batch_size_auto_leaves_room_for_the_model_ema(tmp_path, monkeypatch):
    """--model-ema keeps a copy of the variables on every device beside the step's buffers: the
    batch was picked as if that memory were free (found once the run was out of memory)."""
    import torch
    import torchvision

    from jaxport.models import build

    limits = []

    class Picked(Exception):
        pass

    def capture(step, state, mesh, image_size, limit_bytes, **kwargs):
        limits.append(limit_bytes)
        raise Picked  # the limit is what this test is about: no probe need compile

    monkeypatch.setattr(_memory, "largest_batch", capture)
    limit, said = 1 << 30, []
    for ema in (False, True):
        with pytest.raises(Picked):
            train(TrainConfig(workdir=str(tmp_path / str(ema)), batch_size="auto", image_size=8, devices=2,
                              memory_limit_bytes=limit, model_ema=ema, progress=False), log=said.append)
    # The average's bytes: every tensor of torchvision's resnet18 for 10 classes, 4 bytes an
    # element (the float32 weights and buffers; num_batches_tracked, int64 there, is int32 here).
    sd = torchvision.models.resnet18(num_classes=10).state_dict()
    assert {v.dtype for v in sd.values()} == {torch.float32, torch.int64}
    want = sum(v.numel() * 4 for v in sd.values())
    variables = jax.eval_shape(build("resnet18", num_classes=10).init, jax.random.key(0), np.zeros((1, 8, 8, 3)))
    assert _memory.tree_bytes(variables) == want
    assert limits == [limit, limit - want], (limits, want)
    assert f"--batch-size auto: leaving {want / 2**20:.0f} MiB per device for --model-ema's average" in said, said
    with pytest.raises(_memory.OutOfMemoryError, match=r"--model-ema's average needs 43 MiB per device, and 40 MiB "
                                                        r"is available: nothing is left for the training step"):
        train(TrainConfig(workdir=str(tmp_path / "small"), batch_size="auto", image_size=8, devices=2,
                          memory_limit_bytes=40 << 20, model_ema=True, progress=False))


def test_the_out_of_memory_advice_leaves_room_for_the_model_ema(monkeypatch):
    """The batch named after a RESOURCE_EXHAUSTED counts --model-ema's average as auto does."""
    from jaxport.models import build
    from jaxport.train import make_mesh
    from jaxport.train._optim import sgd

    limits = []
    monkeypatch.setattr(_memory, "step_bytes", lambda *args: 1 << 40)  # the failed batch: no compile
    monkeypatch.setattr(_memory, "largest_batch", lambda *args, **kw: limits.append(args[4]) or 2)
    shapes = jax.eval_shape(build("resnet18", num_classes=10).init, jax.random.key(0), np.zeros((1, 8, 8, 3)))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    for ema in (False, True):
        cfg = TrainConfig(workdir="w", image_size=8, memory_limit_bytes=1 << 30, model_ema=ema)
        err = _loop._oom_error(build("resnet18", num_classes=10), sgd(0.1), variables, make_mesh(jax.devices()[:2]),
                               cfg, 16, 2)
        assert "use --batch-size 4 (2 per device)" in str(err), err
    assert limits == [1 << 30, (1 << 30) - _memory.tree_bytes(variables)], limits


def _eval_figures(num_classes: int, image_size: int, val_crop: int, devices: int, sizes) -> dict[int, int]:
    """What `--batch-size auto` should count for the evaluation at each per-device batch of
    `sizes`: its bytes at `val_crop`, plus the optimizer state kept beside it, compiled here
    from a model, optimizer and mesh built as `train` builds them (SGD with momentum)."""
    from jaxport.models import build
    from jaxport.train import create_state, make_eval_step, make_mesh
    from jaxport.train._optim import sgd

    model, mesh = build("resnet18", num_classes=num_classes), make_mesh(jax.devices()[:devices])
    variables = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, image_size, image_size, 3)))
    state = create_state(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), variables), sgd(0.1, 0.9), mesh)
    evaluate, kept = make_eval_step(model, mesh), _memory.tree_bytes(state.opt_state)
    return {b: _memory.eval_bytes(evaluate, state.variables, mesh, b, val_crop) + kept for b in sizes}


def test_batch_size_auto_fits_the_evaluation_at_a_larger_held_out_crop(tmp_path, monkeypatch):
    """torchvision's ResNet-50 recipe trains at 176 px and evaluates at 224: a batch picked for
    the training step alone could run out of memory in the first evaluation. Where the held-out
    crop is larger, the evaluation's figure counts too; where it is not, it is not compiled."""
    for c in ("a", "b"):
        write_images(tmp_path / "data" / c, 10, size=(20, 24))  # 18 training images, 2 held out
    eval_bytes = _eval_figures(2, 8, 448, 2, (6, 7))
    # A limit where 6 per device fits both, 7 fits the step alone, as do all 9 (the cap: 18
    # images over 2 devices; the second run shows it): the evaluation at 448 px must decide.
    limit = (eval_bytes[6] + eval_bytes[7]) // 2

    class Picked(Exception):
        pass

    picked, asked, real_largest, real_eval = [], [], _memory.largest_batch, _memory.eval_bytes

    def largest(*args, **kwargs):
        picked.append(real_largest(*args, **kwargs))
        raise Picked  # the pick is what this test is about: no training step need compile

    monkeypatch.setattr(_memory, "largest_batch", largest)
    monkeypatch.setattr(_memory, "eval_bytes", lambda *args: asked.append(args[4]) or real_eval(*args))
    said = []
    base = dict(data=str(tmp_path / "data"), batch_size="auto", image_size=8, devices=2, workers=0,
                memory_limit_bytes=limit, progress=False)
    with pytest.raises(Picked):
        train(TrainConfig(workdir=str(tmp_path / "w1"), val_crop_size=448, **base), log=said.append)
    assert picked == [6] and set(asked) == {448}, (picked, asked)
    assert any(m.startswith(f"--batch-size auto: 6 per device ({eval_bytes[6] / 2**20:.0f} MiB of")
               and m.endswith("; the evaluation at --val-crop-size 448 needs more than the training step)")
               for m in said), said
    asked.clear()
    with pytest.raises(Picked):  # the held-out crop is the training crop's: the step decides alone
        train(TrainConfig(workdir=str(tmp_path / "w2"), **base), log=said.append)
    assert picked[-1] == 9 and not asked, (picked, asked)  # the cap: the step alone fits all 9


def test_the_out_of_memory_advice_counts_the_evaluation_at_a_larger_held_out_crop(monkeypatch):
    """A RESOURCE_EXHAUSTED in the evaluation at a larger --val-crop-size: the batch named
    must fit the evaluation too, not the training step alone."""
    from jaxport.models import build
    from jaxport.train import make_mesh
    from jaxport.train._optim import sgd

    mib = 1 << 20
    monkeypatch.setattr(_memory, "step_bytes", lambda *args: args[3] * mib)  # 1 MiB an image per device
    monkeypatch.setattr(_memory, "eval_bytes", lambda *args: args[3] * 40 * mib)  # 40 MiB an image per device
    model = build("resnet18", num_classes=10)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 8, 8, 3)))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    kept = _memory.tree_bytes(variables["params"])  # SGD with momentum: one buffer per parameter
    for crop, want, passes in ((96, (300 * mib - kept) // (40 * mib), 2), (8, 7, None)):
        cfg = TrainConfig(workdir="w", image_size=8, val_crop_size=crop, memory_limit_bytes=300 * mib)
        err = _loop._oom_error(model, sgd(0.1, 0.9), variables, make_mesh(jax.devices()[:2]), cfg, 16, 2)
        # 8 per device failed; at 96 px the evaluation decides, at 8 px nothing but the cap (7)
        assert f"--batch-size {2 * want} ({want} per device)" in str(err), (crop, want, err)
        # The same batch in 2 passes evaluates 4 images per device at a time (160 MiB): it fits. At
        # 8 px the evaluation is not counted, and the (flat, here) step never fits in more passes.
        more = f"use --grad-accum-steps {passes} (the same --batch-size in passes of 4 per device), or --batch-size"
        assert (more in str(err)) == (passes is not None), (crop, err)
