"""torch_compat: the PyTorch side of jaxport.

Safe checkpoint loading, torchvision state_dict <-> Flax conversion, cross-checks, and
torch-equivalent optimizers. Only this package imports torch.
"""
from ._convert import detect_arch as detect_arch
from ._convert import flax_to_torch as flax_to_torch
from ._convert import num_classes_of as num_classes_of
from ._convert import table as table
from ._convert import torch_to_flax as torch_to_flax
from ._crosscheck import CrossCheckReport as CrossCheckReport
from ._crosscheck import StageError as StageError
from ._crosscheck import cross_check as cross_check
from ._reference import reference_model as reference_model
