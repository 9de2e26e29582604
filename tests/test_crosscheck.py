"""cross_check must pass a correct port and fail a broken one; train mode is exact in float64."""
import copy
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torchvision

import torch_compat
from jaxport._errors import ConfigError
from tests.helpers import reference


def _swap(variables, a, b):
    v = copy.deepcopy(variables)
    ca, pa, la = a
    cb, pb, lb = b
    na, nb = v[ca], v[cb]
    for p in pa:
        na = na[p]
    for p in pb:
        nb = nb[p]
    na[la], nb[lb] = np.array(nb[lb]), np.array(na[la])
    return v


@pytest.mark.parametrize("mutation", ["mean<->var", "scale<->bias", "kernel transposed", "fc bias"])
def test_cross_check_detects_broken_ports(mutation):
    sd = reference("resnet18").state_dict()
    v = torch_compat.torch_to_flax(sd)
    bn = ("layer2", "0", "bn1")
    if mutation == "mean<->var":
        v = _swap(v, ("batch_stats", bn, "mean"), ("batch_stats", bn, "var"))
    elif mutation == "scale<->bias":
        v = _swap(v, ("params", bn, "scale"), ("params", bn, "bias"))
    elif mutation == "kernel transposed":
        k = v["params"]["layer3"]["1"]["conv2"]["kernel"]
        v["params"]["layer3"]["1"]["conv2"]["kernel"] = np.ascontiguousarray(k.transpose(1, 0, 2, 3))
    else:
        v["params"]["fc"]["bias"] = v["params"]["fc"]["bias"] + 1e-3
    (report,) = torch_compat.cross_check(sd, v, modes=("eval",))
    assert not report.ok, report.table()
    assert "NO" in report.table()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_cast_port_is_checked_against_the_checkpoint_cast_the_same_way(dtype):
    """What the README and cross_check's docstring advise: a cast port is not the float32
    checkpoint (the cast rounds every weight), and passes against the checkpoint cast alike."""
    sd = reference("resnet18").state_dict()
    v = torch_compat.torch_to_flax(sd, dtype=dtype)
    (against_f32,) = torch_compat.cross_check(sd, v, modes=("eval",))
    (against_cast,) = torch_compat.cross_check(torch_compat.cast_floating(sd, dtype), v, modes=("eval",))
    assert not against_f32.ok and against_cast.ok, against_f32.table() + "\n" + against_cast.table()


def test_cross_check_reports_both_modes_and_passes_a_correct_port():
    sd = reference("resnet18").state_dict()
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    reports = torch_compat.cross_check(sd)
    assert [r.mode for r in reports] == ["eval", "train"]
    assert all(r.ok for r in reports), "\n".join(r.table() for r in reports)
    # The caller's global generator is left alone (torchvision's initialisation drew from it).
    assert torch.equal(torch.rand(3), want)


def test_cross_check_rejects_unknown_modes():
    with pytest.raises(ValueError, match="modes"):
        torch_compat.cross_check(reference("resnet18").state_dict(), modes=("test",))


def test_one_value_per_channel_in_train_mode_is_refused_up_front():
    """torch refuses train-mode BatchNorm over one value per channel; `jaxport verify
    --batch-size 1 --image-size 32` ended in an internal ValueError from torch."""
    sd = reference("resnet18").state_dict()
    with pytest.raises(ValueError, match=r"`batch_size` \(=1\) x layer4's 1x1 positions at `image_size` \(=32\)"):
        torch_compat.cross_check(sd, modes=("eval", "train"), batch_size=1, image_size=32)
    # the bound is exact: one more pixel gives layer4 2x2 positions, which torch accepts
    (report,) = torch_compat.cross_check(sd, modes=("train",), batch_size=1, image_size=33)
    assert report.ok, report.table()
    (report,) = torch_compat.cross_check(sd, modes=("eval",), batch_size=1, image_size=32)
    assert report.ok, report.table()


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_train_mode_is_exact_in_float64(arch):
    """The float32 train-mode tolerance is rounding, not semantics: in float64 the port agrees
    with torch to ~1e-12, logits and running statistics alike. x64 is process-global, so this
    runs in its own interpreter."""
    code = textwrap.dedent(f"""
        import jax
        jax.config.update("jax_enable_x64", True)
        import numpy as np, torch, torchvision, jax.numpy as jnp
        import torch_compat
        from jaxport import models
        ref = torch_compat.reference_model("{arch}", num_classes=10, dtype=torch.float64)
        x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        variables = torch_compat.torch_to_flax(ref.state_dict())
        assert variables["params"]["conv1"]["kernel"].dtype == np.float64
        ref.train()
        with torch.no_grad():
            expected = ref(x).numpy()
        got, state = models.build("{arch}", num_classes=10).apply(
            variables, jnp.asarray(x.permute(0, 2, 3, 1).numpy()), train=True, mutable=["batch_stats"])
        assert got.dtype == jnp.float64
        err = np.abs(np.asarray(got) - expected).max() / np.abs(expected).max()
        back = torch_compat.flax_to_torch({{"params": variables["params"], **state}}, "{arch}")
        stats = max((back[k] - t).abs().max().item() / t.abs().max().item()
                    for k, t in ref.state_dict().items() if k.endswith(("running_mean", "running_var")))
        print(err, stats)
        assert err < 1e-10 and stats < 1e-10, (err, stats)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("kw, message", [
    (dict(modes="eval"), "`modes` (='eval') must be a sequence of modes, e.g. ('eval',)"),
    (dict(modes=("eval",), batch_size=0), "`batch_size` (=0) must be an int >= 1"),
    (dict(modes=("eval",), batch_size=-1), "`batch_size` (=-1) must be an int >= 1"),
    (dict(modes=("eval",), image_size=0), "`image_size` (=0) must be an int >= 1"),
    (dict(modes=("eval",), rtol=-1), "`rtol` (=-1) must be a finite number > 0"),
    (dict(modes=("eval",), rtol=float("nan")), "`rtol` (=nan) must be a finite number > 0"),
    # bool is an int in Python: rtol=True compared with a tolerance of 1 and reported "ok"
    (dict(modes=("eval",), train_rtol=True), "`train_rtol` (=True) must be a finite number > 0"),
    (dict(modes=("eval",), seed=1.5), "`seed` (=1.5) must be an int in [0, 2**63)"),
    (dict(modes=("eval",), seed=2**70), f"`seed` (={2**70}) must be an int in [0, 2**63)"),
    (dict(modes=("eval",), variables=[1, 2]), "`variables` must be a mapping {'params': ..., 'batch_stats': ...}"),
])
def test_arguments_that_would_compare_nothing_are_refused(kw, message):
    """batch_size=0 passed having compared nothing; image_size=0 and batch_size=-1 were torch errors."""
    with pytest.raises(ConfigError) as e:
        torch_compat.cross_check(torchvision.models.resnet18().state_dict(), **kw)
    assert message in str(e.value)


def test_modes_as_a_generator_and_variables_without_counters():
    """A generator of modes was used up by the argument check: cross_check compared nothing and
    returned [] (read as "ok"). Variables without BatchNorm's num_batches_tracked (which the
    converter and `jaxport export` accept, defaulting it to 0) were flax's ScopeVariableNotFoundError."""
    sd = reference("resnet18").state_dict()
    variables = torch_compat.torch_to_flax(sd)
    for bn in _batchnorms(variables["batch_stats"]):
        del bn["num_batches_tracked"]
    sd = {k: (torch.zeros_like(v) if k.endswith("num_batches_tracked") else v) for k, v in sd.items()}
    reports = torch_compat.cross_check(sd, variables, modes=(m for m in ("eval", "train")), image_size=48)
    assert [r.mode for r in reports] == ["eval", "train"] and all(r.ok for r in reports), reports


def _batchnorms(tree):
    if "num_batches_tracked" in tree:
        yield tree
    for v in tree.values():
        if isinstance(v, dict):
            yield from _batchnorms(v)


def test_port_differences_names_every_changed_tensor():
    """A port is an exact copy; outputs within tolerance do not prove that (a 10% change to one
    layer3 kernel entry, 1e-5 on every logit bias both passed the cross-check)."""
    from torch_compat._crosscheck import port_differences

    sd = reference("resnet18").state_dict()
    variables = torch_compat.torch_to_flax(sd)
    assert port_differences(sd, variables, "resnet18") == []
    variables["params"]["fc"]["bias"] = variables["params"]["fc"]["bias"] + np.float32(1e-5)
    kernel = variables["params"]["layer3"]["0"]["conv1"]["kernel"].copy()
    kernel[1, 1, 5, 7] *= 1.1
    variables["params"]["layer3"]["0"]["conv1"]["kernel"] = kernel
    lines = port_differences(sd, variables, "resnet18")
    assert [line.split(":")[0] for line in lines] == ["params/layer3/0/conv1/kernel", "params/fc/bias"], lines
    assert lines[0].startswith("params/layer3/0/conv1/kernel: 1 of 294912 values differ"), lines
    assert all(r.ok for r in torch_compat.cross_check(sd, variables, modes=("eval",)))  # blind to both


# Train mode at 32 px: batch 4 leaves layer4's BatchNorms 4 values per channel (1x1 maps), where
# torch's own float32 error stays ~1e-5 of each stage's scale (batch 2 there: ~7e-3).
SMALL_TRAIN = dict(modes=("train",), batch_size=4, image_size=32)


def _inputs(batch_size, image_size, seed=0):
    """cross_check's inputs (its documented seeding), for torch references computed here."""
    return torch.randn(batch_size, 3, image_size, image_size, generator=torch.Generator().manual_seed(seed))


def _torchvision18(state_dict):
    model = torchvision.models.resnet18(num_classes=torch_compat.num_classes_of(state_dict))
    model.load_state_dict(state_dict, strict=True)
    return model


def _updated_running_vars(state_dict, x):
    """Each BatchNorm's running_var after one train-mode torch step on `x`."""
    model = _torchvision18(state_dict).train()
    with torch.no_grad():
        model(x)
    return {k: v for k, v in model.state_dict().items() if k.endswith("running_var")}


def test_train_mode_fails_a_wrong_running_var_and_reports_the_worst_batchnorm():
    """Train-mode BatchNorm normalises by the batch's own statistics, so a wrong running_var moves
    no activation: only the running-statistics rows can fail such a port. Two BatchNorms, neither
    the first nor the last, are broken so that the worst by absolute error (layer1.1.bn1, scale
    ~1.9) is not the worst relative to its scale (layer2.1.bn2, scale ~1): the row must report
    the latter, torch's own update of the same wrong variables being the reference."""
    sd = reference("resnet18").state_dict()
    variables = torch_compat.torch_to_flax(sd)
    for path, shift in ((("layer2", "1", "bn2"), 0.6), (("layer1", "1", "bn1"), 0.4)):
        bn = variables["batch_stats"]
        for p in path:
            bn = bn[p]
        bn["var"] = bn["var"] + np.float32(shift) * bn["var"].max()

    (report,) = torch_compat.cross_check(sd, variables, **SMALL_TRAIN)
    assert not report.ok, report.table()
    assert [r.stage for r in report.rows if not r.ok] == ["running_var"], report.table()

    x = _inputs(SMALL_TRAIN["batch_size"], SMALL_TRAIN["image_size"])
    want = _updated_running_vars(sd, x)
    # what a correct port of the broken variables computes
    got = _updated_running_vars(torch_compat.flax_to_torch(variables, "resnet18"), x)
    abs_err = {k: float((got[k] - w).abs().max()) for k, w in want.items()}
    rel_err = {k: abs_err[k] / float(w.abs().max()) for k, w in want.items()}
    worst = max(rel_err, key=rel_err.get)
    assert worst == "layer2.1.bn2.running_var" and max(abs_err, key=abs_err.get) == "layer1.1.bn1.running_var"
    row = {r.stage: r for r in report.rows}["running_var"]
    np.testing.assert_allclose(row.max_rel, rel_err[worst], rtol=1e-4)
    np.testing.assert_allclose(row.scale, float(want[worst].abs().max()), rtol=1e-6)
    assert row.max_rel == max(r.max_rel for r in report.rows), report.table()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_errors_are_relative_to_the_stage_scale(mode):
    """A classifier scaled by 1e4 (on both sides: a correct port) makes the logits' float32
    rounding 1e4 times larger in absolute terms, far above any tolerance, but not relative to
    the logits' scale: the port passes."""
    sd = dict(reference("resnet18").state_dict())
    sd["fc.weight"], sd["fc.bias"] = sd["fc.weight"] * 1e4, sd["fc.bias"] * 1e4
    kw = SMALL_TRAIN if mode == "train" else dict(modes=("eval",), image_size=32)
    (report,) = torch_compat.cross_check(sd, **kw)
    assert report.ok, report.table()
    logits = {r.stage: r for r in report.rows}["logits"]
    assert logits.scale > 1e3 and logits.max_abs > 10 * logits.tol, report.table()  # an absolute bound would fail


def _eval_logits(state_dict, image_size, batch_size=2):
    with torch.no_grad():
        return _torchvision18(state_dict).eval()(_inputs(batch_size, image_size)).numpy()


def test_eval_tolerance_is_1e_4_of_the_logits_scale():
    """A shift of every logit by 3e-4 of the logits' scale is a broken port at the default
    tolerance (1e-4) though within 1e-3."""
    sd = reference("resnet18").state_dict()
    scale = float(np.abs(_eval_logits(sd, 32)).max())
    variables = torch_compat.torch_to_flax(sd)
    variables["params"]["fc"]["bias"] = variables["params"]["fc"]["bias"] + np.float32(3e-4 * scale)
    (report,) = torch_compat.cross_check(sd, variables, modes=("eval",), image_size=32)
    assert report.rtol == 1e-4
    assert not report.ok and [r.stage for r in report.rows if not r.ok] == ["logits"], report.table()
    np.testing.assert_allclose(report.rows[-1].max_rel, 3e-4, rtol=1e-2)
    (loose,) = torch_compat.cross_check(sd, variables, modes=("eval",), image_size=32, rtol=1e-3)
    assert loose.ok, loose.table()


def test_eval_relative_error_is_max_abs_over_max_abs_torch():
    """`max_rel` is max |jax - torch| / max |torch|, whatever the scale: with logits ~3e-5 an
    error of 1e-6 is 3% of them, a broken port (a bound in absolute terms, or relative to
    max(scale, 1), passed it)."""
    sd = dict(reference("resnet18").state_dict())
    sd["fc.weight"], sd["fc.bias"] = sd["fc.weight"] * 1e-4, sd["fc.bias"] * 1e-4
    expected = _eval_logits(sd, 32)
    variables = torch_compat.torch_to_flax(sd)
    variables["params"]["fc"]["bias"] = variables["params"]["fc"]["bias"] + np.float32(1e-6)
    (report,) = torch_compat.cross_check(sd, variables, modes=("eval",), image_size=32)
    row = {r.stage: r for r in report.rows}["logits"]
    scale = float(np.abs(expected).max())
    assert scale < 1e-3, scale  # far from 1, so dividing by it or not differs
    np.testing.assert_allclose(row.scale, scale, rtol=1e-6)
    np.testing.assert_allclose(row.max_abs, 1e-6, rtol=1e-2)
    assert row.max_rel == row.max_abs / row.scale
    assert not row.ok and not report.ok, report.table()


@pytest.mark.parametrize("case", ["signed_zero", "same_nan", "other_nan"])
def test_port_differences_compares_bits(case):
    """A port is a copy: -0.0 for 0.0 is a difference although equal as values, and a NaN with
    the checkpoint's own bits is none although NaN != NaN."""
    from torch_compat._crosscheck import port_differences

    sd = dict(reference("resnet18").state_dict())
    bias = sd["fc.bias"].clone()
    bias[3] = float("nan") if case.endswith("nan") else 0.0
    sd["fc.bias"] = bias
    variables = torch_compat.torch_to_flax(sd)
    ported = variables["params"]["fc"]["bias"]
    assert ported.view(np.uint32)[3] == bias.numpy().view(np.uint32)[3]
    changed = ported.copy()
    if case == "signed_zero":
        changed[3] = -0.0
    elif case == "other_nan":
        changed.view(np.uint32)[3] ^= 1  # another NaN payload
    variables["params"]["fc"]["bias"] = changed
    lines = port_differences(sd, variables, "resnet18")
    if case == "same_nan":
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith("params/fc/bias: 1 of 10 values differ"), lines
