"""torchvision ResNet state_dict <-> Flax variables, as a declarative table.

The table lists every torch module of an architecture with its kind and shape; one rule per
kind says where each of its tensors goes in the Flax variables and how its layout changes.
Both directions read the same table, then a strict merge reports every missing, unexpected and
wrong-shape key at once. Keys are never guessed by trying renames.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np
import torch

from jaxport._cpus import host_pool, on_host_pool
from jaxport._errors import ConversionError
from jaxport._io import flatten
from jaxport.models import ARCHS, ResNetSpec, check_arch

from ._load import applied_prefix, describe_keys

# torch tensor name -> (Flax collection, Flax leaf name, axis permutation torch -> Flax or None)
_OIHW_TO_HWIO = (2, 3, 1, 0)
RULES: dict[str, dict[str, tuple[str, str, tuple[int, ...] | None]]] = {
    "conv": {"weight": ("params", "kernel", _OIHW_TO_HWIO)},
    "bn": {
        "weight": ("params", "scale", None),
        "bias": ("params", "bias", None),
        "running_mean": ("batch_stats", "mean", None),
        "running_var": ("batch_stats", "var", None),
        "num_batches_tracked": ("batch_stats", "num_batches_tracked", None),
    },
    "linear": {"weight": ("params", "kernel", (1, 0)), "bias": ("params", "bias", None)},
}
# Absent from checkpoints written by torch < 0.4.1; not a weight, so it defaults to 0 rather
# than failing the strict merge.
_OPTIONAL = {"num_batches_tracked"}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One torch tensor of an architecture: its key, Flax location, shape and layout change."""

    torch_key: str
    collection: str
    flax_path: tuple[str, ...]
    torch_shape: tuple[int, ...]
    perm: tuple[int, ...] | None

    @property
    def flax_key(self) -> str:
        return "/".join((self.collection, *self.flax_path))


def _modules(spec: ResNetSpec, num_classes: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(torch module name, kind, weight shape) for every module with tensors, in torch order."""
    yield "conv1", "conv", (64, 3, 7, 7)
    yield "bn1", "bn", (64,)
    inplanes, exp = 64, spec.expansion
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), spec.layers)):
        for b in range(n):
            p = f"layer{i + 1}.{b}"
            if spec.block == "basic":
                convs = [(inplanes if b == 0 else planes, planes, 3, 1), (planes, planes, 3, 1)]
            else:
                width = int(planes * (spec.width_per_group / 64.0)) * spec.groups
                convs = [
                    (inplanes if b == 0 else planes * exp, width, 1, 1),
                    (width, width, 3, spec.groups),
                    (width, planes * exp, 1, 1),
                ]
            for j, (cin, cout, k, groups) in enumerate(convs, start=1):
                yield f"{p}.conv{j}", "conv", (cout, cin // groups, k, k)
                yield f"{p}.bn{j}", "bn", (cout,)
            # torchvision adds a projection when the block changes stride or width.
            if b == 0 and (i > 0 or inplanes != planes * exp):
                yield f"{p}.downsample.0", "conv", (planes * exp, inplanes, 1, 1)
                yield f"{p}.downsample.1", "bn", (planes * exp,)
        inplanes = planes * exp
    if num_classes:  # 0: a backbone, saved with `model.fc = nn.Identity()`
        yield "fc", "linear", (num_classes, 512 * exp)


# The modules of a ResNet before its classifier: what a backbone (feature extractor) holds.
BACKBONE_MODULES = ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4")
# `nn.Sequential(*list(resnet.children())[:-1])`, the classic feature extractor, numbers
# torchvision's children in their fixed order: conv1, bn1, relu, maxpool, layer1..layer4, avgpool.
_SEQUENTIAL_CHILDREN = {"0": "conv1", "1": "bn1", "4": "layer1", "5": "layer2", "6": "layer3", "7": "layer4"}


def table(arch: str, num_classes: int = 1000) -> list[Entry]:
    """Every tensor of torchvision's `arch` state_dict, in its order, with its Flax location.

    `num_classes=0` is the backbone alone (no `fc`), as saved by a model whose classifier was
    replaced with `nn.Identity()`.
    """
    spec = _spec(arch)
    entries = []
    for module, kind, shape in _modules(spec, num_classes):
        for name, (collection, leaf, perm) in RULES[kind].items():
            if kind == "bn":
                tshape = () if name == "num_batches_tracked" else shape
            elif kind == "linear" and name == "bias":
                tshape = shape[:1]
            else:
                tshape = shape
            entries.append(Entry(f"{module}.{name}", collection, (*module.split("."), leaf), tshape, perm))
    return entries


def _spec(arch: str) -> ResNetSpec:
    return ARCHS[check_arch(arch, ConversionError)]


def _require_state_dict(state_dict: Any) -> None:
    """A state_dict is a mapping of names to tensors; name what was passed instead, and the fix."""
    if isinstance(state_dict, Mapping):
        return
    if isinstance(state_dict, torch.nn.Module):
        fix = "pass the model's weights, model.state_dict()"
    elif isinstance(state_dict, (str, bytes)) or hasattr(state_dict, "__fspath__"):
        fix = "read the file first: torch_compat.load_state_dict(path)"
    else:
        fix = "pass a dict of torch tensors, e.g. model.state_dict() or torch_compat.load_state_dict(path)"
    raise ConversionError(f"`state_dict` is {type(state_dict).__module__}.{type(state_dict).__qualname__}, "
                          f"not a mapping of names to tensors: {fix}")


# --- architecture detection -------------------------------------------------------------------


def detect_arch(state_dict: Mapping[str, Any]) -> str:
    """The torchvision architecture a ResNet state_dict belongs to, from key names and shapes.

    Blocks per stage come from the `layerN.M.` keys, the block type from `conv3`, and the
    ResNeXt/wide options from the 3x3 conv's shape: its output width is
    `width_per_group * groups` and its input channels per group `width / groups`.

    Options that leave no trace in the weights cannot be detected: a ResNet-50 built with
    `replace_stride_with_dilation` has ResNet-50's tensors, so it is "resnet50", and its port is
    the same. Build the Flax model with the options the torch model was built with
    (`models.resnet50(replace_stride_with_dilation=(False, True, True))`); without them its
    logits differ, exactly as those of torchvision's `resnet50()` loading the same weights do.
    Cross-check the model so built with the same option: `cross_check(...,
    replace_stride_with_dilation=(False, True, True))`.

    Raises:
      ConversionError: the keys are not a ResNet's, or the ResNet is not one of torchvision's
        named architectures (the message gives what was found).
    """
    _require_state_dict(state_dict)
    keys = set(state_dict)
    if "conv1.weight" not in keys or "layer1.0.conv1.weight" not in keys:
        if _is_sequential_children(keys):
            hint = ("; these are torchvision ResNet's children in an nn.Sequential (0 = conv1, 1 = bn1, 4..7 = "
                    "layer1..layer4): rename them with torch_compat.backbone_state_dict (CLI --backbone-only)")
        else:
            hint = _nested_hint(state_dict)
        raise ConversionError(
            "the state_dict does not look like a torchvision ResNet: expected keys such as "
            f"'conv1.weight' and 'layer1.0.conv1.weight', found {describe_keys(keys)}{hint}"
        )
    found = _found_spec(state_dict)
    for name, spec in ARCHS.items():
        if spec == found:
            return name
    raise ConversionError(
        f"the state_dict is a ResNet with block={found.block!r}, layers={list(found.layers)}, "
        f"groups={found.groups}, width_per_group={found.width_per_group}, which is none of "
        f"torchvision's named architectures ({', '.join(ARCHS)})"
    )


def _nested_hint(state_dict: Mapping[str, Any]) -> str:
    """'; its ResNet is under ...: select it with prefix=...' for the ResNets nested in
    `state_dict`, or ''. The prefix is the whole one from the checkpoint's top: what
    `load_state_dict` already selected comes first (`backbone.` + `body.`), since `prefix` is
    applied to the file, not to this dict; naming the rest alone sent users round in a loop."""
    keys = set(state_dict)
    above = applied_prefix(state_dict)
    nested = [above + p for p in _prefixes(keys)
              if f"{p}conv1.weight" in keys and f"{p}layer1.0.conv1.weight" in keys]
    if len(nested) == 1:
        return f"; its ResNet is under '{nested[0]}': select it with prefix={nested[0]!r} (CLI --prefix {nested[0]})"
    if nested:  # e.g. MoCo's query and key encoders
        return (f"; it holds ResNets under {', '.join(repr(p) for p in nested)}: select one with prefix "
                f"(CLI e.g. --prefix {nested[-1]})")
    return ""


def _found_spec(state_dict: Mapping[str, Any]) -> ResNetSpec:
    layers = []
    for i in range(1, 5):
        blocks = {k.split(".")[1] for k in state_dict if k.startswith(f"layer{i}.")}
        layers.append(sum(1 for b in blocks if b.isdigit()))
    block = "bottleneck" if "layer1.0.conv3.weight" in state_dict else "basic"
    groups, width_per_group = 1, 64
    w = state_dict.get("layer1.0.conv2.weight")
    if block == "bottleneck" and w is not None and len(w.shape) == 4 and w.shape[1]:
        width = int(w.shape[0])
        groups = max(width // int(w.shape[1]), 1)
        width_per_group = width // groups
    return ResNetSpec(block, tuple(layers), groups, width_per_group)


def _prefixes(keys) -> list[str]:
    """Every dotted prefix of the keys (`a.`, `a.b.`, ...), shortest first."""
    found = {k[: i + 1] for k in keys for i, c in enumerate(k) if c == "."}
    return sorted(found, key=lambda p: (p.count("."), p))


def _is_sequential_children(keys) -> bool:
    """Keys of `nn.Sequential(*list(resnet.children())[:-1])`: numbered children, conv1 first."""
    keys = set(keys)
    return ("0.weight" in keys and "4.0.conv1.weight" in keys
            and all(k.split(".", 1)[0] in _SEQUENTIAL_CHILDREN and "." in k for k in keys))


def _looks_like(state_dict: Mapping[str, Any]) -> str | None:
    try:
        return detect_arch(state_dict)
    except ConversionError:
        return None


# --- strict merge -----------------------------------------------------------------------------


def _check(
    arch: str,
    entries: list[Entry],
    found_shapes: Mapping[str, tuple[int, ...]],
    key_of: str,
    looks_like: Callable[[], str | None],
    what: str,
    above: str = "",
) -> None:
    """Raise one ConversionError listing every missing, unexpected and wrong-shape key.

    `looks_like` says which architecture the weights are; it is only called to word the error.
    """
    expected = {getattr(e, key_of): e for e in entries}
    missing = [k for k, e in expected.items() if k not in found_shapes and e.torch_key.rsplit(".", 1)[1] not in _OPTIONAL]
    unexpected = [k for k in found_shapes if k not in expected]
    wrong, transposed = [], []
    for k, shape in found_shapes.items():
        e = expected.get(k)
        if e is None:
            continue
        want = e.torch_shape if key_of == "torch_key" else _permuted(e.torch_shape, e.perm)
        if tuple(shape) != tuple(want):
            wrong.append(f"{k}: got {tuple(shape)}, expected {tuple(want)}")
            if len(want) == 2 and tuple(shape) == tuple(want)[::-1]:
                transposed.append(k)
    if not (missing or unexpected or wrong):
        return
    parts = [f"{what} do not fit {arch}"]
    looks_like = looks_like()
    if looks_like and looks_like != arch:
        parts[0] += f": these weights look like {looks_like}, not {arch} (pass arch={looks_like!r} or --arch {looks_like})"
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            shown = "; ".join(items[:8]) + (f"; ... ({len(items) - 8} more)" if len(items) > 8 else "")
            parts.append(f"{len(items)} {label}: {shown}")
    misfits = missing + unexpected + [w.split(":", 1)[0] for w in wrong]
    outside = key_of == "torch_key" and not any(k.split(".", 1)[0] in BACKBONE_MODULES for k in misfits)
    if transposed and misfits == transposed:
        # A Linear weight saved in the other framework's order: --backbone-only would drop it.
        one = len(transposed) == 1
        parts.append(f"{' and '.join(transposed)} {'is' if one else 'are'} the transpose of what fits (torch's Linear "
                     f"weight is (out, in), Flax's Dense kernel (in, out)): transpose {'it' if one else 'them'} "
                     "(`.T`) and convert again")
    elif outside and "fc.weight" in found_shapes and not any(k.split(".", 1)[0] == "fc" for k in misfits):
        # The backbone and torchvision's `fc` both fit: the extra keys are modules beside them, which
        # --backbone-only would not keep any more than it keeps `fc`.
        parts.append(_beside_the_head(arch, unexpected, above))
    elif outside:
        # The backbone fits; what does not is outside it: a head that is not torchvision's one
        # Linear `fc` (e.g. `fc = Sequential(Dropout, Linear)`), a projection head: name the way out.
        parts.append("The backbone (conv1, bn1, layer1..layer4) fits; what does not is outside it. To port the "
                     "backbone alone (a model with num_classes=0 that returns the pooled features), drop the "
                     "rest with torch_compat.backbone_state_dict (CLI --backbone-only)")
    raise ConversionError(". ".join(parts))


def _beside_the_head(arch: str, unexpected: list[str], above: str = "") -> str:
    """The way out when a full ResNet (backbone and `fc`) comes with extra, unexpected keys,
    naming every group of them to remove (other ResNets under their prefixes, other modules).
    `above` is the prefix the state_dict was already selected with, which a prefix to give starts with."""
    nested: list[str] = []
    for p in _prefixes(unexpected):  # shortest first: a ResNet inside another is part of it
        if (f"{p}conv1.weight" in unexpected and f"{p}layer1.0.conv1.weight" in unexpected
                and not p.startswith(tuple(nested))):
            nested.append(p)
    rest = [k for k in unexpected if not k.startswith(tuple(nested))]
    groups = nested + sorted({k.split(".", 1)[0] + ("." if "." in k else "") for k in rest})
    remove = (f"remove them from the state_dict, e.g. {{k: v for k, v in state_dict.items() if not "
              f"k.startswith({tuple(groups)!r})}}")
    if nested:  # e.g. a teacher or EMA copy stored beside the model
        what = (f"another ResNet under {nested[0]!r}" if len(nested) == 1
                else f"other ResNets under {', '.join(map(repr, nested))}")
        if rest:
            what += f", and other keys ({describe_keys(rest)})"
        return (f"The backbone and the classifier fc fit; the unexpected keys hold {what}: to port "
                f"{'that one' if len(nested) == 1 else 'one of them'}, select it with prefix={above + nested[0]!r} "
                f"(CLI --prefix {above + nested[0]}); to port this one, {remove}")
    return (f"The backbone and the classifier fc fit; the unexpected keys ({describe_keys(unexpected)}) are no part of "
            f"torchvision's {arch}: {remove} (CLI: re-save the checkpoint without them) and port again; "
            "--backbone-only would drop fc as well")


def _num_classes(shapes: Mapping[str, tuple[int, ...]], fc_key: str, axis: int) -> int | None:
    """The classifier size: the classes axis of the `fc` weight; 0 when nothing is under `fc`
    (a backbone); None when `fc` is there but is not one 2-D weight (not torchvision's head)."""
    sep = "." if "." in fc_key else "/"
    module = fc_key.rsplit(sep, 1)[0] + sep
    fc = shapes.get(fc_key)
    if fc is not None and len(fc) == 2:
        # A weight saved transposed, (512, 1000) beside a (1000,) bias, was read as a 512-class
        # head that then misfit everywhere ("fc.weight: expected (512, 512)"); the bias tells
        # the classes, so the error names the weight's real misfit: expected (1000, 512).
        bias = shapes.get(module + "bias")
        if bias is not None and len(bias) == 1 and bias[0] != fc[axis] and bias[0] == fc[1 - axis]:
            return int(bias[0])
        return int(fc[axis])
    return None if any(k.startswith(module) for k in shapes) else 0


def _table_classes(num_classes: int | None) -> int:
    # A malformed `fc` is checked as a 1000-class head, so the strict merge names what is wrong.
    return 1000 if num_classes is None else num_classes


def _permuted(shape: tuple[int, ...], perm: tuple[int, ...] | None) -> tuple[int, ...]:
    return shape if perm is None else tuple(shape[p] for p in perm)


def check_state_dict(state_dict: Mapping[str, Any], arch: str, *, dtype: Any = None) -> list[Entry]:
    """The conversion table for `state_dict` as `arch`, after checking every key and shape
    (shapes only: nothing is copied). `dtype` is the dtype the weights will be cast to, as in
    `torch_to_flax`: float8 weights pass when it is given (the cast to it is exact).

    Raises:
      ConversionError: listing every missing, unexpected and wrong-shape key, and the
        architecture the weights look like when it is not `arch`; values that are not torch
        tensors, or meta tensors (a shape without data).
    """
    _require_state_dict(state_dict)
    _spec(arch)
    not_tensors = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        k = not_tensors[0]
        raise ConversionError(
            f"state_dict[{k!r}] is {type(state_dict[k]).__module__}.{type(state_dict[k]).__qualname__}, not a "
            f"torch.Tensor ({len(not_tensors)} such values): a state_dict maps names to torch tensors; read a file "
            "with torch_compat.load_state_dict(path), or convert arrays with torch.from_numpy")
    nested = [k for k, v in state_dict.items() if v.is_nested]
    if nested:  # before the shapes: a nested tensor has none (torch raises an internal error)
        raise ConversionError(f"state_dict[{nested[0]!r}] is a nested tensor (torch.nested, a list of tensors of "
                              f"different shapes; {len(nested)} such values): a ResNet's weights are dense tensors; "
                              "save the model's own torch.save(model.state_dict(), path)")
    shapes = {k: _torch_load_shape(k, v) for k, v in state_dict.items()}
    entries = table(arch, _table_classes(_num_classes(shapes, "fc.weight", 0)))
    _check(arch, entries, shapes, "torch_key", lambda: _looks_like(state_dict), "the state_dict's weights",
           above=applied_prefix(state_dict))
    meta = [k for k, v in state_dict.items() if v.is_meta]
    if meta:  # every caller would copy the data (conversion, torchvision's load_state_dict)
        raise ConversionError(f"{len(meta)} tensors of the state_dict ({', '.join(meta[:3])}"
                              f"{', ...' if len(meta) > 3 else ''}) are meta tensors, with a shape but no data: "
                              "materialise the model's weights before converting them")
    _check_torch_dtypes(state_dict, entries, cast=_torch_dtype(dtype))
    return entries


def _torch_load_shape(key: str, t: torch.Tensor) -> tuple[int, ...]:
    """The shape torch's `load_state_dict` sees: a one-element 1-D counter (as torch 0.3 saved
    scalars, or an `np.atleast_1d` round trip) loads into the 0-d `num_batches_tracked`, so it
    fits here too (it ports as the 0-d counter)."""
    shape = tuple(t.shape)
    return () if shape == (1,) and key.rsplit(".", 1)[-1] in _OPTIONAL else shape


# Weights keep their dtype through the port, so only dtypes a Flax ResNet computes in pass.
_FLOAT_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                 torch.float64: "float64"}
_INT32 = np.iinfo(np.int32)


def _check_torch_dtypes(state_dict: Mapping[str, Any], entries: list[Entry], cast: torch.dtype | None = None) -> None:
    """Refuse tensors the port would corrupt or could not compute with, naming every key.

    Quantized, sparse and float8 tensors have no numpy form (torch's `.numpy()` fails deep
    inside the copy); integer or complex weights would convert silently and compute nonsense.
    `num_batches_tracked` is an integer counter that becomes int32 (jax's default integer); saved as a
    float holding a whole number, it ports as that number, as torch's `load_state_dict` copies it.
    With a `cast` (a floating dtype), float8 weights pass: `_cast` turns them into it exactly.
    """
    bad = []
    for e in entries:
        t = state_dict.get(e.torch_key)
        if t is None:
            continue
        if e.flax_path[-1] == "num_batches_tracked":
            # A floating counter holding a whole number (`{k: v.half() for k, v in sd.items()}` casts it too)
            # is what torch's load_state_dict copies into its int64 buffer: it ports as that integer.
            if (t.layout != torch.strided or t.is_complex() or t.dtype == torch.bool
                    or (t.is_floating_point() and not (t.numel() == 1 and float(t).is_integer()))):
                bad.append((e.torch_key, t, "an integer counter"))
            elif t.numel() == 1 and not _INT32.min <= int(t) <= _INT32.max:
                raise ConversionError(
                    f"state_dict[{e.torch_key!r}] is {int(t)}, which does not fit int32, the dtype it becomes "
                    "(jax's default integer), so the round trip could not be exact; the counter only matters "
                    "to BatchNorm with momentum=None (torchvision's ResNets use 0.1): reset it, e.g. "
                    f"state_dict[{e.torch_key!r}].zero_(), and port again")
        elif t.layout != torch.strided or t.is_quantized or (
                t.dtype not in _FLOAT_DTYPES and not (cast is not None and t.is_floating_point())):
            bad.append((e.torch_key, t, "float16, bfloat16, float32 or float64"))
    if not bad:
        return
    key, t, want = bad[0]
    if t.is_quantized:
        fix = "dequantize the model first (tensor.dequantize(), or convert the float model before quantizing it)"
    elif t.layout != torch.strided:
        fix = f"make them dense first (tensor.to_dense()); {t.layout} tensors cannot be ported"
    elif want == "an integer counter":
        fix = "save num_batches_tracked as torch's int64 counter"
    elif t.is_floating_point():  # float8: a cast makes it computable
        fix = ("pass a floating `dtype` to cast them to, e.g. dtype='float32' (CLI --dtype float32), or cast "
               "them first (tensor.float())")
    else:
        fix = "cast the weights to float32 first (tensor.float()) if the values are meant as weights"
    raise ConversionError(f"state_dict[{key!r}] is {t.dtype}{'' if t.layout == torch.strided else f' ({t.layout})'}, "
                          f"expected {want}{_others(bad, 'tensors')}: {fix}")


def _others(bad: list[tuple], noun: str) -> str:
    """' (N such tensors: a, b, ...)' when more than the first key named is wrong."""
    if len(bad) < 2:
        return ""
    return f" ({len(bad)} such {noun}: {', '.join(b[0] for b in bad[:4])}{', ...' if len(bad) > 4 else ''})"


def check_variables(variables: Mapping[str, Any], arch: str) -> list[Entry]:
    """As `check_state_dict`, for Flax variables (`{"params": ..., "batch_stats": ...}`)."""
    return _check_flat_variables(flatten(variables), arch)


def _check_flat_variables(flat: Mapping[str, Any], arch: str) -> list[Entry]:
    _spec(arch)
    shapes = {k: tuple(np.shape(v)) for k, v in flat.items()}
    entries = table(arch, _table_classes(_num_classes(shapes, "params/fc/kernel", 1)))
    _check(arch, entries, shapes, "flax_key", lambda: variables_look_like(flat), "the Flax variables")
    bad = []
    for e in entries:
        if e.flax_key not in flat:
            continue
        value = flat[e.flax_key]
        dtype = np.dtype(value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype)  # no host copy
        counter = e.flax_path[-1] == "num_batches_tracked"
        if np.issubdtype(dtype, np.integer) if counter else dtype.name in _FLOAT_DTYPES.values():
            continue
        bad.append((e.flax_key, dtype.name, "an integer" if counter else "float16, bfloat16, float32 or float64"))
    if bad:
        key, dtype, want = bad[0]
        raise ConversionError(f"the Flax variable {key!r} is {dtype}, expected {want}{_others(bad, 'arrays')}: "
                              "these are not a ResNet's variables as jaxport writes them; port the checkpoint again")
    return entries


@dataclasses.dataclass(frozen=True)
class _Shaped:
    shape: tuple[int, ...]


def variables_look_like(flat: Mapping[str, Any]) -> str | None:
    """The architecture Flax variables belong to, from their kernels' torch names and shapes."""
    kernels = {}
    for key, value in flat.items():
        parts = key.split("/")
        shape = tuple(np.shape(value))
        if parts[0] == "params" and parts[-1] == "kernel" and len(shape) in (2, 4):
            torch_shape = shape[::-1] if len(shape) == 2 else _permuted(shape, (3, 2, 0, 1))  # HWIO -> OIHW
            kernels[".".join(parts[1:-1]) + ".weight"] = _Shaped(torch_shape)
    return _looks_like(kernels)


# --- tensors <-> arrays, keeping dtypes -------------------------------------------------------


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU copy-free view of a tensor as numpy; bfloat16 becomes ml_dtypes.bfloat16 bits."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # A lazily negated or conjugated view (`torch._neg_view`, `.conj()`) has no numpy form
    # ("Can't call numpy() on Tensor that has negative bit set"): materialise it.
    t = t.resolve_neg().resolve_conj()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# Slices of the moving axis (torch's output channels) copied per block by `_transpose_into`.
# Each block reads _BLOCK_ROWS rows at once and writes runs of _BLOCK_ROWS contiguous elements,
# so the rows it reads stay in L1 until every element of their cache lines is used. Measured on
# ResNet-50's convs (2 cores): 32-64 rows fastest; numpy's unblocked transposed copy was 3x
# slower, and torch's blocked 2-D `copy_` plus a second pass for 3x3 kernels ~1.2x slower.
_BLOCK_ROWS = 32
# Tensors bigger than this are converted on the thread pool (numpy releases the GIL while it
# copies); smaller ones cost less than the hand-off.
_PARALLEL_MIN_BYTES = 1 << 16
# torch's `copy_` takes its blocked 2-D transpose only from this many elements (360 x 360).
_TORCH_TRANSPOSE_MIN = 360 * 360


def _empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """`np.empty(shape, dtype)`, in memory from torch's allocator.

    numpy asks the kernel to back every array of 4 MiB or more with transparent huge pages
    (`madvise(MADV_HUGEPAGE)`). Where the kernel's THP defrag setting is `madvise` (its default),
    the first write to such memory can wait while the kernel compacts memory to find a huge
    page. A one-shot conversion writes only fresh memory: `torch_to_flax` of wide_resnet101_2
    took 2.2 s in a new process, against 0.3 s with the advice off and 0.23 s for later calls
    (2-core Xeon VM, 2026-12-07). torch's allocator gives no such advice. (numpy's own switch,
    `np._core.multiarray._set_madvise_hugepage`, is private and process-wide.)
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return torch.empty(nbytes, dtype=torch.uint8).numpy().view(dtype).reshape(shape)


def _bits(a: np.ndarray) -> np.ndarray:
    """bfloat16 as its int16 bits (numpy and torch copy those as plain integers); other dtypes as
    they are."""
    return a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a


def _transpose_into(out: np.ndarray, a: np.ndarray, perm: tuple[int, ...] | None) -> None:
    """`out[...] = a.transpose(perm)` (`a` itself for None), bit for bit, in a fraction of numpy's time.

    In the converter's layouts (OIHW <-> HWIO, a linear's (O, I) <-> (I, O)) one axis moves
    between the first and the last place. numpy copies a transposed array element by element,
    reading with the stride of a whole row: a cache miss per element. Copying `_BLOCK_ROWS`
    slices of the moving axis at a time keeps the rows read in cache instead; a linear or 1x1
    kernel is one 2-D transpose, which torch's `copy_` does with a cache-blocked kernel, ~20%
    faster. bfloat16 is copied as its int16 bits. `out` is C-contiguous; `a` is only read (it
    may be a jax array's read-only buffer).
    """
    a, out = _bits(a), _bits(out)
    last = a.ndim - 1
    if perm is None or a.ndim < 2 or (perm[-1] != 0 and perm[0] != last):
        np.copyto(out, a if perm is None else a.transpose(perm))
        return
    moving = 0 if perm[-1] == 0 else last  # the axis that goes to the other end
    n = a.shape[moving]
    if sum(a.shape[i] > 1 for i in perm if i != moving) <= 1 and a.size >= _TORCH_TRANSPOSE_MIN \
            and a.flags.c_contiguous:
        with warnings.catch_warnings():  # torch only reads it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            source = torch.from_numpy(a.reshape(n, -1) if moving == 0 else a.reshape(-1, n))
        torch.from_numpy(out.reshape(source.shape[::-1])).copy_(source.t())
    elif moving == 0:
        for lo in range(0, n, _BLOCK_ROWS):
            out[..., lo : lo + _BLOCK_ROWS] = a[lo : lo + _BLOCK_ROWS].transpose(perm)
    else:
        for lo in range(0, n, _BLOCK_ROWS):
            out[lo : lo + _BLOCK_ROWS] = a[..., lo : lo + _BLOCK_ROWS].transpose(perm)


def _permuted_copy(t: torch.Tensor, perm: tuple[int, ...] | None) -> np.ndarray:
    """`np.ascontiguousarray(_to_numpy(t).transpose(perm))` (a copy for None), in memory from
    torch's allocator (`_empty`)."""
    a = _to_numpy(t.detach().cpu())
    out = _empty(_permuted(a.shape, perm), a.dtype)
    _transpose_into(out, a, perm)
    return out


def _torch_dtype_of(dtype: np.dtype) -> torch.dtype:
    if dtype == ml_dtypes.bfloat16:
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype)).dtype  # TypeError for a dtype torch lacks, as before


def _unpermuted_copy(a: np.ndarray, perm: tuple[int, ...] | None) -> torch.Tensor:
    """A new torch tensor of `a.transpose(argsort(perm))` (`a` itself for None): the inverse of
    `_permuted_copy`."""
    inverse = None if perm is None else tuple(int(i) for i in np.argsort(perm))
    out = torch.empty(_permuted(a.shape, inverse), dtype=_torch_dtype_of(a.dtype))
    _transpose_into(_to_numpy(out), a, inverse)
    return out


def _convert_tensor(e: Entry, t: torch.Tensor | None) -> np.ndarray:
    if t is None:  # optional counter, absent from very old checkpoints
        return np.zeros((), np.int32)
    if e.flax_path[-1] == "num_batches_tracked" and t.dim() == 1:
        t = t.reshape(())  # one element, checked: what torch's load_state_dict copies (`_torch_load_shape`)
    if e.flax_path[-1] == "num_batches_tracked" and t.is_floating_point():
        t = t.to(torch.int64)  # a whole number (checked), as torch loads it; float8 has no numpy form
    a = _permuted_copy(t, e.perm)
    return a.astype(np.int32) if e.flax_path[-1] == "num_batches_tracked" else a


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _convert_all(entries: list[Entry], convert: Callable[[Entry], Any],
                 sizes: Mapping[str, int]) -> Iterator[tuple[Entry, Any]]:
    """`(e, convert(e))` for every entry, in order. The copies of big tensors (`sizes`: bytes by
    torch key) overlap on a thread pool: a transposed copy is bound by cache misses, not by memory
    bandwidth, so two cores convert ResNet-50 ~1.6x faster than one."""
    big = [e for e in entries if sizes.get(e.torch_key, 0) >= _PARALLEL_MIN_BYTES]
    big.sort(key=lambda e: -sizes[e.torch_key])  # largest first balances the threads
    # Called from one of the pool's own threads, it converts inline: waiting there for the
    # pool's other threads could deadlock (each of them waiting the same way).
    pooled = len(big) > 1 and not on_host_pool()
    futures = {e.torch_key: host_pool().submit(convert, e) for e in big} if pooled else {}
    try:
        for e in entries:
            f = futures.get(e.torch_key)
            yield e, (f.result() if f is not None else convert(e))
    finally:  # e.g. Ctrl-C, or a failed copy: the copies not yet started are dropped
        for f in futures.values():
            f.cancel()


# --- public API -------------------------------------------------------------------------------


def torch_to_flax(state_dict: Mapping[str, torch.Tensor], arch: str | None = None, *,
                  dtype: Any = None) -> dict[str, dict]:
    """Flax variables `{"params": ..., "batch_stats": ...}` for a torchvision ResNet state_dict.

    The inverse of `flax_to_torch`: conv weights OIHW -> HWIO, linear weights transposed,
    BatchNorm weight/bias -> params scale/bias and running_mean/var/num_batches_tracked ->
    batch_stats mean/var/num_batches_tracked. With `dtype=None` values are copied, never
    rounded: dtypes are kept (float16 stays float16; bfloat16 becomes `ml_dtypes.bfloat16`, which
    numpy lacks and jax reads natively; float64 stays float64). `num_batches_tracked` becomes
    int32 (jax's default integer).

    Args:
      state_dict: torch key -> tensor, without wrapper prefixes (see `load_state_dict`).
      arch: a torchvision ResNet name; None detects it with `detect_arch`. `num_classes` is
        always taken from `fc.weight`, so fine-tuned heads port; a state_dict with nothing under
        `fc.` is a backbone (`num_classes=0`, see `backbone_state_dict`).
      dtype: None keeps every tensor's dtype. A floating dtype, as a name (``"float32"``,
        ``"float16"``, ``"bfloat16"``, ``"float64"``), a numpy/jax/ml_dtypes type
        (``np.float32``, ``jnp.bfloat16``) or a ``torch.dtype``, casts every floating tensor to
        it, with the result equal bit for bit to torch's ``tensor.to(dtype)`` (round to nearest
        even): ``torch_to_flax(sd, dtype="float32")`` upcasts a half-precision checkpoint
        exactly, ``dtype="bfloat16"`` halves a float32 one. `num_batches_tracked` is not cast.

    Returns:
      Nested dicts of numpy arrays whose paths mirror torch's (`params/layer1/0/conv1/kernel`).

    Raises:
      ConversionError: listing every missing, unexpected and wrong-shape key, and the
        architecture the weights look like when it is not `arch`; `dtype` is not one of the
        floating dtypes above; or a value is beyond float16's range when casting to float16.

    Example:
      >>> import torchvision
      >>> variables = torch_to_flax(torchvision.models.resnet18().state_dict())
      >>> variables["params"]["conv1"]["kernel"].shape
      (7, 7, 3, 64)
      >>> half = torch_to_flax(torchvision.models.resnet18().state_dict(), dtype="bfloat16")
      >>> half["params"]["fc"]["kernel"].dtype
      dtype(bfloat16)
    """
    cast = _torch_dtype(dtype)  # checked before any work
    arch = detect_arch(state_dict) if arch is None else arch  # both check `state_dict`'s type
    entries = check_state_dict(state_dict, arch, dtype=cast)
    # A cast happens one tensor at a time, inside the copy: never a second copy of every weight.
    def convert(e: Entry):
        return _convert_tensor(e, _cast(e.torch_key, state_dict.get(e.torch_key), cast))

    sizes = {e.torch_key: _nbytes(state_dict[e.torch_key]) for e in entries if e.torch_key in state_dict}
    out: dict[str, dict] = {"params": {}, "batch_stats": {}}
    for e, a in _convert_all(entries, convert, sizes):
        node = out[e.collection]
        for name in e.flax_path[:-1]:
            node = node.setdefault(name, {})
        node[e.flax_path[-1]] = a
    return out


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    """`torch_to_flax`'s `dtype` as a torch floating dtype; None keeps the dtypes."""
    if dtype is None:
        return None
    choices = ", ".join(repr(n) for n in _FLOAT_DTYPES.values())
    if dtype is float or (isinstance(dtype, str) and dtype.strip().lower() == "float"):
        # numpy reads it as float64, a torch user as float32 (`torch.float`); "double" is float64
        # to both, as "half" is float16
        raise ConversionError(f"`dtype` (={dtype!r}) is ambiguous: numpy reads it as float64, torch's `float` is "
                              f"float32; name the width, one of {choices} (None keeps the dtypes)")
    if isinstance(dtype, torch.dtype):
        name = _FLOAT_DTYPES.get(dtype)
    else:
        try:
            name = np.dtype(dtype).name
        except (TypeError, ValueError, SyntaxError):  # numpy's errors for odd objects (a dict, "i4,i4" ...)
            name = None
    for torch_dtype, float_name in _FLOAT_DTYPES.items():
        if name == float_name:
            return torch_dtype
    raise ConversionError(f"`dtype` (={dtype!r}) must be None (keep each tensor's dtype) or a floating dtype: "
                          f"one of {choices}, e.g. dtype='float32' (None keeps the dtypes)")


def cast_floating(state_dict: Mapping[str, torch.Tensor], dtype: Any) -> dict[str, torch.Tensor]:
    """The state_dict with every floating tensor cast to `dtype` by torch (`tensor.to(dtype)`): the
    torch weights `torch_to_flax(state_dict, dtype=dtype)` equals, e.g. to cross-check that port.
    `dtype` as in `torch_to_flax`; None returns the tensors as they are."""
    cast = _torch_dtype(dtype)
    return {k: _cast(k, v, cast) for k, v in state_dict.items()}


class OutOfRangeError(ConversionError):
    """A cast would turn a finite value into inf: `beyond` says which value of which tensor."""

    def __init__(self, message: str, beyond: str):
        super().__init__(message)
        self.beyond = beyond


def _cast(key: str, t: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None or not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
        return t
    if key.rsplit(".", 1)[-1] in _OPTIONAL:  # a counter saved as floats is not cast: it ports as an integer
        return t
    t = t.detach()  # a Parameter (keep_vars=True): no autograd graph, no warning from float() below
    out = t.to(dtype)
    # A narrower range turns big finite values into inf (torch does so silently): refuse that.
    if torch.finfo(dtype).max < torch.finfo(t.dtype).max and not torch.equal(torch.isfinite(out), torch.isfinite(t)):
        big = float(t[torch.isfinite(t) & ~torch.isfinite(out)].abs().max())
        keep = f"keep the dtype ({_FLOAT_DTYPES.get(t.dtype, t.dtype)}: `dtype=None`, CLI --dtype keep)"
        fix = (f"cast to bfloat16 instead (it keeps float32's range), or {keep}"
               if dtype == torch.float16 and big <= torch.finfo(torch.bfloat16).max else keep)
        beyond = (f"state_dict[{key!r}] holds {big:g}, beyond {_FLOAT_DTYPES[dtype]}'s range "
                  f"(max {torch.finfo(dtype).max:g})")
        raise OutOfRangeError(f"{beyond}, so the cast to `dtype` (CLI --dtype) would make it inf: {fix}", beyond)
    return out


def flax_to_torch(variables: Mapping[str, Any], arch: str | None = None) -> "OrderedDict[str, torch.Tensor]":
    """A torchvision state_dict (loadable with `strict=True`) from Flax ResNet variables.

    Bit-exact inverse of `torch_to_flax`: dtypes are kept and `num_batches_tracked` comes back
    as torch's int64 (0 when the variables carry none).

    Args:
      variables: `{"params": ..., "batch_stats": ...}` of a `jaxport.models` ResNet (numpy or
        jax arrays).
      arch: the torchvision architecture name; None detects it from the kernels' shapes, as
        `torch_to_flax` does from a state_dict's.

    Raises:
      ConversionError: listing every missing, unexpected and wrong-shape variable; or `arch` is
        None and the variables look like no ResNet.
    """
    if not isinstance(variables, Mapping):
        raise ConversionError(f"`variables` is {type(variables).__module__}.{type(variables).__qualname__}, not "
                              "Flax variables: pass {'params': ..., 'batch_stats': ...}, e.g. jaxport.load_variables(path)")
    flat = flatten(variables)
    if arch is None:  # was "`arch` (=None) is not a known architecture"
        arch = variables_look_like(flat)
        if arch is None:
            raise ConversionError("`arch` is None and the variables' kernels look like no torchvision ResNet; pass "
                                  f"arch= (one of {', '.join(ARCHS)})")
    entries = _check_flat_variables(flat, arch)

    def convert(e: Entry) -> torch.Tensor:
        a = flat.get(e.flax_key)
        if a is None:
            return torch.tensor(0, dtype=torch.int64)
        t = _unpermuted_copy(np.asarray(a), e.perm)
        return t.to(torch.int64) if e.flax_path[-1] == "num_batches_tracked" else t

    sizes = {e.torch_key: int(getattr(flat.get(e.flax_key), "nbytes", 0)) for e in entries}
    return OrderedDict((e.torch_key, t) for e, t in _convert_all(entries, convert, sizes))


def num_classes_of(state_dict: Mapping[str, Any]) -> int:
    """The classifier size of a ResNet state_dict (rows of `fc.weight`); 0 for a backbone, whose
    state_dict holds nothing under `fc.`.

    Raises:
      ConversionError: there are `fc.` keys but no 2-D `fc.weight` (a head that is not
        torchvision's `nn.Linear`).
    """
    num_classes = _num_classes({k: tuple(v.shape) for k, v in state_dict.items()}, "fc.weight", 0)
    if num_classes is not None:
        return num_classes
    found = ", ".join(sorted(k for k in state_dict if k.startswith("fc."))[:4])
    raise ConversionError(f"the state_dict's classifier is not torchvision's nn.Linear `fc` (found {found}), so its "
                          "number of classes is unknown; drop it with torch_compat.backbone_state_dict "
                          "(CLI --backbone-only) to port the backbone alone")


#: What torchvision's segmentation models (DeepLabV3, FCN) build their ResNet backbone with.
SEGMENTATION_DILATION = (False, True, True)


def segmentation_dilation(state_dict: Mapping[str, Any]) -> tuple[bool, bool, bool] | None:
    """`SEGMENTATION_DILATION` when `state_dict` is the backbone of a torchvision segmentation
    model, else None: the `replace_stride_with_dilation` to run (and cross-check) it with.

    `load_state_dict(path, prefix="backbone")` of a DeepLabV3 or FCN checkpoint (`backbone.*`
    beside `classifier.*` and `aux_classifier.*`) selects a ResNet whose tensors are exactly
    resnet50's or resnet101's, so it ports as that; but torchvision builds those backbones with
    `replace_stride_with_dilation=[False, True, True]`, which leaves no trace in the weights
    (see `detect_arch`), and a model built without it computes other features. The selection
    says what it came from, so this needs the state_dict `load_state_dict` returned, before
    `backbone_state_dict` or any copy.
    """
    # The selection's own prefix ends in `backbone.` (a reference script's `model.backbone.` too),
    # and the `classifier` beside it is a conv head (DeepLabHead, FCNHead: 4-D weights), not the
    # Linear of a `self.backbone = resnet50(); self.classifier = nn.Linear(...)` classifier.
    prefix = applied_prefix(state_dict)
    if (not (prefix == "backbone." or prefix.endswith(".backbone.")) or "layer4.0.conv1.weight" not in state_dict
            or getattr(state_dict, "beside", {}).get("classifier", 0) != 4):
        return None
    # torchvision's segmentation backbones; BasicBlock refuses dilation
    return SEGMENTATION_DILATION if _looks_like(state_dict) in ("resnet50", "resnet101") else None


def dilation_note(state_dict: Mapping[str, Any]) -> str | None:
    """A note when `state_dict` is the backbone of a torchvision segmentation model (see
    `segmentation_dilation`), or None: the model to run it with, and how to cross-check that model."""
    if segmentation_dilation(state_dict) is None:
        return None
    arch = _looks_like(state_dict)
    return (f"the weights are ported exactly, but they are a torchvision segmentation model's backbone "
            f"(classifier.* beside backbone.*: DeepLabV3 / FCN), which torchvision builds dilated: run them with "
            f"jaxport.models.{arch}(num_classes=0, replace_stride_with_dilation=(False, True, True)), and "
            "cross-check that model: cross_check(..., replace_stride_with_dilation=(False, True, True)) (CLI "
            "--dilation F,T,T, which verify and port --verify use by default for such a checkpoint)")


def backbone_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The backbone's tensors alone: `conv1`, `bn1`, `layer1`..`layer4`, in their order.

    Everything else is dropped: the classifier `fc` whatever its form, and what self-supervised
    and detection checkpoints keep beside a backbone (projection heads, prototypes, queues).
    A state_dict of `nn.Sequential(*list(resnet.children())[:-1])` (keys `0.weight`,
    `1.running_mean`, `4.0.conv1.weight`, ...) gets torchvision's names back: those children
    come in a fixed order (conv1, bn1, relu, maxpool, layer1..layer4, avgpool).
    The result ports as a ResNet with `num_classes=0`, whose output is the pooled features, and
    goes back to torch as a model with `fc = nn.Identity()`.

    Raises:
      ConversionError: no key belongs to the backbone (the message summarises the keys found).

    Example:
      >>> import torchvision
      >>> sd = backbone_state_dict(torchvision.models.resnet18().state_dict())
      >>> "fc.weight" in sd, num_classes_of(sd)
      (False, 0)
    """
    if _is_sequential_children(state_dict):
        return {f"{_SEQUENTIAL_CHILDREN[k.split('.', 1)[0]]}.{k.split('.', 1)[1]}": v for k, v in state_dict.items()}
    out = {k: v for k, v in state_dict.items() if k.split(".", 1)[0] in BACKBONE_MODULES}
    if not out:
        raise ConversionError(f"the state_dict holds no ResNet backbone keys (conv1, bn1, layer1..layer4); found "
                              f"{describe_keys(state_dict)}{_nested_hint(state_dict)}")
    return out
