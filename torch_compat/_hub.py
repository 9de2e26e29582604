"""Checkpoints named by URL or by torchvision's weights name, downloaded once into torch's cache.

`download_checkpoint("ResNet50_Weights.IMAGENET1K_V2")` is the file torchvision's
`resnet50(weights=...)` loads: the same URL, the same place (`torch.hub.get_dir()/checkpoints`,
so a file torchvision downloaded before is found there and not fetched again), and the same
SHA-256 check against the digest prefix in the file's name. The download is torch.hub's own
(`download_url_to_file`: a temporary file renamed into place once complete and checked, so an
interrupted or corrupted download leaves nothing behind). Loading the file stays
`load_state_dict`'s: weights-only, whatever its origin.
"""
from __future__ import annotations

import http.client
import os
import re
import urllib.error
import urllib.parse
from pathlib import Path
from typing import Callable

from jaxport._args import closest, names_a_download
from jaxport._errors import CheckpointError, ConfigError

# torchvision names its downloads `<name>-<first 8 hex digits of the SHA-256>.pth`; torch.hub's
# HASH_REGEX takes any run of hex digits there, which would also "check" `model-abc.pth`.
_HASH = re.compile(r"-([a-f0-9]{8,})\.")


def resnet_weights() -> dict[str, str]:
    """Every torchvision weights name of the ResNet family ('ResNet50_Weights.IMAGENET1K_V2',
    and '...DEFAULT' for each) -> its URL. Imports torchvision."""
    from torchvision.models import get_model_weights

    from jaxport.models import ARCHS

    names = {}
    for arch in ARCHS:
        enum = get_model_weights(arch)
        for w in enum:
            names[f"{enum.__name__}.{w.name}"] = w.url
        names[f"{enum.__name__}.DEFAULT"] = enum.DEFAULT.url
    return names


def _weights_url(name: str) -> str:
    known = resnet_weights()
    if name in known:
        return known[name]
    enum = name.split(".", 1)[0].lower()
    same_enum = [k for k in known if k.lower().startswith(enum + ".")]
    members = [k.split(".", 1)[1] for k in same_enum]
    # The one meant, within its enum only: across enums, a near spelling would offer ResNet-18's
    # weights for ViT's.
    guess = closest(name, same_enum)
    if members:
        enum = same_enum[0].split(".", 1)[0]
        what = f"{enum} has {', '.join(members)}"
    else:
        listed = ", ".join(k for k in known if not k.endswith(".DEFAULT"))
        what = (f"jaxport ports torchvision's ResNet family, whose weights are {listed}, and <Enum>.DEFAULT for "
                "each")
    hint = f"; did you mean {guess}?" if guess else ""
    raise ConfigError(f"'{name}' is not a file, and not torchvision weights that jaxport ports: {what}{hint}")


def download_checkpoint(name_or_url: str, *, progress: bool = True,
                        log: Callable[[str], None] = print) -> Path:
    """The local file of a checkpoint named by an http(s) URL or a torchvision weights name.

    Args:
      name_or_url: 'ResNet50_Weights.IMAGENET1K_V2' (any ResNet-family weights of torchvision,
        '.DEFAULT' included) or a URL such as 'https://download.pytorch.org/models/resnet18-f37072fd.pth'.
      progress: a progress bar on stderr while downloading.
      log: where the one line saying what was downloaded (or found) goes.

    Returns:
      `torch.hub.get_dir()/checkpoints/<the URL's file name>` (set TORCH_HOME to move it),
      downloaded first if it is not there. A file name ending in `-<8 or more hex digits>.<ext>`
      (torchvision's) must match the download's SHA-256; a mismatch keeps nothing.

    Raises:
      ConfigError: not a URL and not a known weights name (the error lists the names), or not a str.
      CheckpointError: a path, which no download names: one that does not exist (said as
        `load_state_dict` says it), or an existing file (load it as it is); or the download failed
        (offline, HTTP error, checksum) or the cache is not writable, and nothing partial is kept.
    """
    if not isinstance(name_or_url, str):
        raise ConfigError(f"`name_or_url` (={name_or_url!r}) must be a str: an http(s) URL or a torchvision weights "
                          "name such as 'ResNet50_Weights.IMAGENET1K_V2'")
    if not names_a_download(name_or_url):  # a caller may pass any argument that is not an existing file
        if os.path.lexists(name_or_url):
            raise CheckpointError(f"'{name_or_url}' is a local file, not a download: load it as it is "
                                  "(torch_compat.load_state_dict)")
        raise CheckpointError(f"checkpoint '{name_or_url}' does not exist, and is not an http(s) URL or a torchvision "
                              "weights name such as 'ResNet50_Weights.IMAGENET1K_V2'; check the path")
    import torch.hub

    is_url = name_or_url.startswith(("http://", "https://"))
    url = name_or_url if is_url else _weights_url(name_or_url)
    filename = os.path.basename(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    if not filename:
        raise ConfigError(f"the URL '{url}' names no file (its path ends in '/'); give the URL of the checkpoint file")
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    dst = cache / filename
    origin = url if is_url else f"{name_or_url} ({url})"
    if dst.is_file():
        log(f"using {dst}, downloaded before from {origin}")
        return dst
    digest = _HASH.search(filename)
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create torch's download cache '{cache}' ({e.strerror}); set TORCH_HOME to a "
                              "writable directory, or download the file yourself and pass its path") from None
    log(f"downloading {origin} to {dst}")
    try:
        torch.hub.download_url_to_file(url, str(dst), hash_prefix=digest.group(1) if digest else None,
                                       progress=progress)
    except urllib.error.HTTPError as e:
        raise CheckpointError(f"cannot download '{url}': HTTP {e.code} {e.reason}; check the "
                              f"{'URL' if is_url else 'weights name'}") from None
    except urllib.error.URLError as e:  # no network, no such host, refused
        raise CheckpointError(f"cannot download '{url}' ({e.reason}); is this machine offline? Download it where "
                              f"the network is reachable and pass the file's path, or copy it to {dst}") from None
    except RuntimeError as e:
        if "invalid hash value" not in str(e):
            raise
        raise CheckpointError(f"the download of '{url}' is not the file its name promises ({e}); nothing was kept: "
                              "try again (a proxy or a broken connection can alter a download)") from None
    except (OSError, http.client.HTTPException) as e:  # a dropped connection, a full disk
        raise CheckpointError(f"cannot download '{url}' to '{dst}' ({type(e).__name__}: {e}); nothing was kept: "
                              "try again, or set TORCH_HOME to a directory with space") from None
    return dst


def weights_metadata(name: str, num_classes: int | None = None) -> dict[str, str]:
    """What torchvision records of the weights `name` beside their file, as string metadata for
    a port's header (`jaxport.save_variables(..., metadata=...)`; `jaxport port NAME` writes it),
    so that a program with no torchvision can name the classes and preprocess as the weights
    were evaluated:

    - `weights`: the member, `.DEFAULT` resolved ('ResNet50_Weights.DEFAULT' is
      'ResNet50_Weights.IMAGENET1K_V2');
    - `categories`: a JSON list of the class names, in output order;
    - `preprocess`: JSON of the evaluation transform (`weights.transforms()`): `resize_size`,
      `crop_size`, `interpolation`, `antialias`, `mean`, `std`. It differs between weights of
      one architecture: IMAGENET1K_V2 resizes to 232 px, V1 to 256;
    - `metrics`: JSON of their published accuracy (`{"ImageNet-1K": {"acc@1": ..., "acc@5": ...}}`);
    - `recipe`: the URL of their training recipe.

    With `num_classes` (the port's classifier size, 0 for a backbone), `categories` and
    `metrics` are left out unless the weights name that many classes: they would describe no
    output of the port (a `--backbone-only` port, or a file at their URL that is not theirs).

    Raises:
      ConfigError: not a weights name of the ResNet family, listing the names (as `download_checkpoint`).
    """
    import json

    from torchvision.models import get_weight

    _weights_url(name)  # refuses another family's weights or a misspelling, with the names
    w = get_weight(name)
    t = w.transforms()
    preprocess = {"resize_size": list(t.resize_size), "crop_size": list(t.crop_size),
                  "interpolation": t.interpolation.value, "antialias": t.antialias,
                  "mean": list(t.mean), "std": list(t.std)}
    meta = {"weights": f"{type(w).__name__}.{w.name}", "categories": json.dumps(w.meta["categories"]),
            "preprocess": json.dumps(preprocess), "metrics": json.dumps(w.meta.get("_metrics", {}))}
    if w.meta.get("recipe"):
        meta["recipe"] = w.meta["recipe"]
    if num_classes is not None and num_classes != len(w.meta["categories"]):
        del meta["categories"], meta["metrics"]
    return meta
