"""Starting weights for `--init`: anything torch_compat or jaxport can load."""
from __future__ import annotations

import os
import sys
from typing import Callable

import jax
import numpy as np

from .._args import names_a_download
from .._errors import CheckpointError, ConfigError, ConversionError
from .._io import holds_variables, load_with_metadata


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def load_init(path: str, arch: str, trusted: bool = False, say: Callable[[str], None] = print) -> dict:
    """Flax variables from a `jaxport train` workdir, a jaxport variables file (.safetensors)
    or a torch checkpoint (torch_compat's safe loader: `.pt`/`.pth`/`.bin`, or a `.safetensors`
    file of torch keys such as the hubs publish), as numpy. A torchvision weights name
    ('ResNet50_Weights.IMAGENET1K_V2') or an http(s) URL is downloaded first, once, into torch's
    cache (`torch_compat.download_checkpoint`; `say` reports it).

    `trusted` allows a full unpickle of a torch checkpoint (`--trusted`), as `jaxport port`.

    Raises:
      CheckpointError: the file is missing or unreadable, or holds another architecture.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"`--init` (={path!r}) must be a path: a torch checkpoint, a .safetensors file or a workdir")
    path = os.fspath(path)  # a pathlib.Path failed at `path.endswith` below
    if names_a_download(path):
        import torch_compat

        path = os.fspath(torch_compat.download_checkpoint(path, progress=sys.stderr.isatty(), log=say))
    if not os.path.exists(path):
        raise CheckpointError(f"`--init` (={path}) does not exist")
    if os.path.isdir(path):
        from ._checkpoint import checkpoint_dir, load_workdir

        if not os.path.isdir(checkpoint_dir(path)):
            raise CheckpointError(f"`--init` (={path}) is a directory but not a `jaxport train` workdir (no "
                                  "checkpoints/ inside); pass a workdir, a torch checkpoint or a .safetensors file")
        variables, found = load_workdir(path)
    elif _is_safetensors(path) and holds_variables(path):  # by content: `port --out` takes any name
        variables, metadata = load_with_metadata(path)
        found = metadata.get("arch")
    else:
        # The torch side: loading a torch checkpoint needs torch, via torch_compat only.
        import torch_compat

        # safe unless trusted: weights-only, wrappers unwrapped; safetensors need no pickle at all
        state_dict = torch_compat.load_state_dict(path, trusted=trusted, check_crc=True)
        try:
            found = torch_compat.detect_arch(state_dict)
            # converted only once the arch is right (else the ConfigError below says so)
            variables = torch_compat.torch_to_flax(state_dict, arch) if found == arch else None
        except ConversionError as e:
            raise ConversionError(f"`--init` (={path}): {e}. To start from part of a checkpoint, port that part "
                                  "first (jaxport port CHECKPOINT --prefix ... / --backbone-only) and pass the "
                                  "port to --init") from None
    if found is not None and found != arch:
        raise ConfigError(f"`--init` (={path}) holds {found} weights but `--arch` is {arch}; use --arch {found}")
    return jax.tree.map(np.asarray, variables)


def _is_safetensors(path: str) -> bool:
    """A safetensors file starts with its header's length (8 bytes), then the JSON header."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False  # the loader that reads it says why
    return len(head) == 9 and head[8:9] == b"{"


def fit_head(variables: dict, fresh: dict, log: Callable[[str], None] = print, arch: str | None = None) -> dict:
    """`variables` with the classifier (`fc`) taken from `fresh` when its number of classes
    differs or `variables` is a backbone without one; every other tensor must be `fresh`'s, in
    the same shape. One line to `log` says which head the run starts with.

    Raises:
      CheckpointError: another set of tensors or shapes (a different architecture: a variables
        file that does not record its own, given with another `--arch`).
    """
    if "params" not in variables or "conv1" not in variables["params"]:
        found = sorted(variables.get("params", variables))[:6]
        raise CheckpointError(f"--init weights hold no ResNet parameters (found: {found}); "
                              "pass a torchvision ResNet checkpoint, jaxport variables or a workdir")
    out = {"params": dict(variables["params"]), "batch_stats": variables.get("batch_stats", {})}
    new = np.shape(fresh["params"]["fc"]["kernel"])
    # Said once the weights are known to fit: a misfit's error would otherwise follow a line
    # announcing a head that is never used.
    if "fc" not in out["params"]:
        said = f"--init: the weights are a backbone without a classifier: initialising fc ({new[1]} outputs)"
        out["params"]["fc"] = fresh["params"]["fc"]
    elif (old := np.shape(out["params"]["fc"]["kernel"])) != new and old[:1] == new[:1]:
        # the same features, another number of classes
        said = (f"--init: classifier head has {old[1]} classes, the data {new[1]}: re-initialising fc "
                f"({old[1]} -> {new[1]} outputs)")
        out["params"]["fc"] = fresh["params"]["fc"]
    else:  # without a line, a user could not tell a kept head from a silently re-initialised one
        said = f"--init: every weight taken, the classifier's included ({new[1]} classes, as the data has)"
    want, got = dict(_flat(fresh)), dict(_flat(out))
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    reshaped = [k for k in want if k in got and np.shape(got[k]) != np.shape(want[k])]
    if missing or unexpected or reshaped:
        shown = {"missing": ["/".join(k) for k in missing], "unexpected": ["/".join(k) for k in unexpected],
                 "of another shape": [f"{'/'.join(k)}: {np.shape(got[k])} in the file, {np.shape(want[k])} in the "
                                      "model" for k in reshaped]}
        parts = [f"{len(items)} {label} ({', '.join(items[:3])}{', ...' if len(items) > 3 else ''})"
                 for label, items in shown.items() if items]
        model = f"a {arch}" if arch else "the model"
        raise CheckpointError(f"--init weights do not fit {model}: {'; '.join(parts)}; they are another "
                              "architecture's: pass the --arch they were trained with")
    # Half-precision weights (a `port` kept them so) become the run's float32 master weights:
    # said, since `variables.safetensors` then holds another dtype than the file given.
    cast = sorted({str(np.asarray(got[k]).dtype) for k in want
                   # (jnp's issubdtype: numpy's calls ml_dtypes' bfloat16 not floating)
                   if jax.numpy.issubdtype(np.asarray(got[k]).dtype, jax.numpy.floating)
                   and np.asarray(got[k]).dtype != np.asarray(want[k]).dtype})
    if cast:
        said += f"; {'/'.join(cast)} weights upcast to the run's {np.asarray(want[('params', 'fc', 'kernel')]).dtype}"
    log(said)
    return jax.tree.map(lambda a, f: np.asarray(a).astype(np.asarray(f).dtype), out, fresh)
