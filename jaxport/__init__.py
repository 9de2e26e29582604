"""jaxport: PyTorch vision work moved to JAX, with proof that nothing changed on the way.

The JAX side; the PyTorch side lives in `torch_compat`. Importing jaxport or any of its
modules imports no torch. torch is imported lazily, only where it is needed: by the CLI's
`port`, `verify`, `export` and `env`, and in training when `--init` names a torch checkpoint
(through `torch_compat`) or `--data` an ImageFolder (`train.image_folder`: torch's DataLoader
and torchvision's transforms).

The names below are loaded on first use (PEP 562), so that `import jaxport._cli`, the
command line's entry point, imports no jax: the CLI installs its Ctrl-C and SIGTERM handling
before the second or so that importing jax takes, and a signal then ends it with one line.
"""
from __future__ import annotations

import typing as _typing

from ._lazy import attach as _attach

__version__ = "0.1.0"

# public name -> (module, attribute or None for the module itself)
_LAZY = {
    "models": (".models", None),
    "ops": (".ops", None),
    "CheckpointError": ("._errors", "CheckpointError"),
    "ConfigError": ("._errors", "ConfigError"),
    "ConversionError": ("._errors", "ConversionError"),
    "JaxportError": ("._errors", "JaxportError"),
    "load_variables": ("._io", "load_variables"),
    "read_metadata": ("._io", "read_metadata"),
    "save_variables": ("._io", "save_variables"),
    "compiler_options": ("._xla", "compiler_options"),
}
__all__ = [  # literal, for the tools that read it; tests/test_layering.py checks it against _LAZY
    "CheckpointError", "ConfigError", "ConversionError", "JaxportError", "compiler_options",
    "load_variables", "models", "ops", "read_metadata", "save_variables",
]

if _typing.TYPE_CHECKING:  # what static tools see; at run time `__getattr__` below imports on use
    from . import models as models
    from . import ops as ops
    from ._errors import CheckpointError as CheckpointError
    from ._errors import ConfigError as ConfigError
    from ._errors import ConversionError as ConversionError
    from ._errors import JaxportError as JaxportError
    from ._io import load_variables as load_variables
    from ._io import read_metadata as read_metadata
    from ._io import save_variables as save_variables
    from ._xla import compiler_options as compiler_options


__getattr__, __dir__ = _attach(__name__, _LAZY, [*__all__, "__version__"])
