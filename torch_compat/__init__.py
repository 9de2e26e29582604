"""torch_compat: the PyTorch side of jaxport.

Safe checkpoint loading, torchvision state_dict <-> Flax conversion, cross-checks, and
torch-equivalent optimizers. Importing it imports torch; torchvision (about 1.4 s more, most of
it torch._dynamo, which torchvision.ops pulls in) is imported on first use of the names that
build torchvision models: `cross_check`, `reference_model`, `default_checkpoint` and the
cross-check's report types. Loading, converting and exporting need none of it. Importing
`jaxport` imports neither torch nor torchvision (see its docstring for the commands that import
torch lazily).
"""
import typing as _typing

from jaxport._lazy import attach as _attach

from ._convert import backbone_state_dict as backbone_state_dict
from ._convert import cast_floating as cast_floating
from ._convert import detect_arch as detect_arch
from ._convert import flax_to_torch as flax_to_torch
from ._convert import num_classes_of as num_classes_of
from ._convert import table as table
from ._convert import torch_to_flax as torch_to_flax
from ._cuda_tag import saving_as_cuda as saving_as_cuda
from ._hub import download_checkpoint as download_checkpoint
from ._hub import weights_metadata as weights_metadata
from ._load import load_state_dict as load_state_dict
from ._load import weights_only_is_safe as weights_only_is_safe
from . import optim as optim  # `import torch_compat` then `torch_compat.optim.sgd(...)`, as the README does

# The names whose modules import torchvision: public name -> (module, attribute), loaded on use.
_LAZY = {
    "CrossCheckReport": ("._crosscheck", "CrossCheckReport"),
    "StageError": ("._crosscheck", "StageError"),
    "cross_check": ("._crosscheck", "cross_check"),
    "reference_model": ("._reference", "reference_model"),
    "default_checkpoint": ("._default", "default_checkpoint"),
}
__all__ = [  # literal, for the tools that read it; tests/test_layering.py checks it
    "CrossCheckReport", "StageError", "backbone_state_dict", "cast_floating", "cross_check", "default_checkpoint",
    "detect_arch", "download_checkpoint", "flax_to_torch", "load_state_dict", "num_classes_of", "optim",
    "reference_model", "saving_as_cuda", "table", "torch_to_flax", "weights_metadata", "weights_only_is_safe",
]

if _typing.TYPE_CHECKING:  # what static tools see; at run time `__getattr__` below imports on use
    from ._crosscheck import CrossCheckReport as CrossCheckReport
    from ._crosscheck import StageError as StageError
    from ._crosscheck import cross_check as cross_check
    from ._default import default_checkpoint as default_checkpoint
    from ._reference import reference_model as reference_model

__getattr__, __dir__ = _attach(__name__, _LAZY, __all__)
