"""jaxport: PyTorch vision work moved to JAX, with proof that nothing changed on the way.

The JAX side. It never imports torch; the PyTorch side lives in `torch_compat`.
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
