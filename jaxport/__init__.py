"""jaxport: PyTorch vision work moved to JAX, with proof that nothing changed on the way.

The JAX side; the PyTorch side lives in `torch_compat`. Importing jaxport or any of its
modules imports no torch. torch is imported lazily, only where it is needed: by the CLI's
`port`, `verify`, `export` and `env`, and in training when `--init` names a torch checkpoint
(through `torch_compat`) or `--data` an ImageFolder (`train.image_folder`: torch's DataLoader
and torchvision's transforms).
"""
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

__version__ = "0.1.0"
