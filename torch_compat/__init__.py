"""torch_compat: the PyTorch side of jaxport.

Safe checkpoint loading, torchvision state_dict <-> Flax conversion, cross-checks, and
torch-equivalent optimizers. Importing it imports torch and torchvision; importing `jaxport`
imports neither (see its docstring for the commands that import torch lazily).
"""
from ._convert import backbone_state_dict as backbone_state_dict
from ._convert import cast_floating as cast_floating
from ._convert import detect_arch as detect_arch
from ._convert import flax_to_torch as flax_to_torch
from ._convert import num_classes_of as num_classes_of
from ._convert import table as table
from ._convert import torch_to_flax as torch_to_flax
from ._crosscheck import CrossCheckReport as CrossCheckReport
from ._crosscheck import StageError as StageError
from ._crosscheck import cross_check as cross_check
from ._reference import reference_model as reference_model
from ._cuda_tag import saving_as_cuda as saving_as_cuda
from ._default import default_checkpoint as default_checkpoint
from ._load import load_state_dict as load_state_dict
from ._load import weights_only_is_safe as weights_only_is_safe
from . import optim as optim  # `import torch_compat` then `torch_compat.optim.sgd(...)`, as the README does
