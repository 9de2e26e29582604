"""`jaxport env`: the versions that matter, the devices, and known-bad combinations."""
from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import platform
import re
import sys

from packaging.requirements import Requirement
from packaging.version import Version

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "ml_dtypes",
            "safetensors", "torch", "torchvision", "pillow")
_PLUGIN = re.compile(r"^jax[-_]cuda\d+[-_](plugin|pjrt)$")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _base(v: str) -> Version:
    return Version(Version(v).base_version)


def report() -> tuple[list[tuple[str, str]], list[str]]:
    """(rows of (name, value), warnings). Never raises: a broken install is what it reports."""
    rows: list[tuple[str, str]] = [("python", f"{platform.python_version()} ({sys.executable})"),
                                   ("platform", platform.platform())]
    warnings: list[str] = []
    versions = {p: _version(p) for p in PACKAGES}
    plugins = sorted(d.metadata["Name"] for d in md.distributions() if _PLUGIN.match(d.metadata["Name"] or ""))
    for p in PACKAGES:
        rows.append((p, versions[p] or "not installed"))
    for p in plugins:
        rows.append((p, _version(p) or "?"))

    jax_v, jaxlib_v = versions["jax"], versions["jaxlib"]
    if jax_v and jaxlib_v:
        # jax accepts jaxlib from its minimum up to its own version, never newer.
        if _base(jaxlib_v) > _base(jax_v):
            warnings.append(f"jaxlib {jaxlib_v} is newer than jax {jax_v}; install matching versions: "
                            f"pip install 'jax=={jaxlib_v}' 'jaxlib=={jaxlib_v}'")
        for req in md.requires("jax") or []:
            r = Requirement(req)
            if r.name == "jaxlib" and not r.marker and r.specifier and not r.specifier.contains(_base(jaxlib_v)):
                warnings.append(f"jax {jax_v} needs jaxlib{r.specifier}, found {jaxlib_v}")
    for p in plugins:
        pv = _version(p)
        if pv and jaxlib_v and _base(pv) != _base(jaxlib_v):
            warnings.append(f"{p} {pv} does not match jaxlib {jaxlib_v}; the GPU backend will fail to load: "
                            f"pip install '{p}=={jaxlib_v}'")

    try:
        import jax

        devices = jax.devices()
        rows.append(("jax devices", f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()})"))
    except Exception as e:  # a broken jaxlib/plugin is a finding, not a crash
        # Some failures carry no message: with JAX_PLATFORMS=cuda and no GPU, jax skips the only
        # backend asked for and fails its own `assert` (AssertionError('')).
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if not str(e).strip() and os.environ.get("JAX_PLATFORMS"):
            first += (f" (JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} is set and none of the backends it names "
                      "could start on this machine; unset it to let jax choose, or set JAX_PLATFORMS=cpu)")
        warnings.append(f"jax failed to initialise its devices: {first}")

    torch_v, tv_v = versions["torch"], versions["torchvision"]
    if torch_v and tv_v:
        for req in md.requires("torchvision") or []:
            r = Requirement(req)
            if r.name == "torch" and r.specifier and not r.specifier.contains(_base(torch_v), prereleases=True):
                # (constraints.txt, the tested pair, exists only in a checkout of jaxport.)
                warnings.append(f"torchvision {tv_v} was built for torch{r.specifier}, found torch {torch_v}: "
                                f"install a torch it was built for, pip install 'torch{r.specifier}', or upgrade "
                                "the pair together, pip install -U torch torchvision")
    for mod in ("torch", "torchvision"):
        if versions[mod]:
            try:
                importlib.import_module(mod)
            except Exception as e:
                last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                warnings.append(f"`import {mod}` fails: {last}")
    try:
        import torch

        rows.append(("torch devices", f"cuda x {torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"))
        from torch_compat._load import weights_only_is_safe

        safe, why = weights_only_is_safe()
        if not safe:
            warnings.append(why)
    except Exception:
        pass
    return rows, warnings
