"""Data-parallel training of jaxport's Flax ResNets, step for step equal to torch.

One step is `jax.jit` + `jax.shard_map` over a 1-D `data` mesh of every device (parameters
replicated, the global batch split, gradients averaged with `pmean`); BatchNorm statistics are
per device or synchronised (`bn_axis_name="data"`). The training loop (`train`) adds data
loading, orbax checkpoints with exact resume, metrics and plots; `jaxport train` is its CLI.
"""
from ._step import AXIS as AXIS
from ._step import TrainState as TrainState
from ._step import check_batch_size as check_batch_size
from ._step import create_state as create_state
from ._step import cross_entropy as cross_entropy
from ._step import make_eval_step as make_eval_step
from ._step import make_mesh as make_mesh
from ._step import make_train_step as make_train_step
from ._step import replicate as replicate
from ._step import shard_batch as shard_batch
from ._checkpoint import load_workdir as load_workdir
from ._data import digits as digits
from ._data import image_folder as image_folder
from ._loop import Interrupted as Interrupted
from ._loop import TrainConfig as TrainConfig
from ._loop import train as train
from .._errors import DivergedError as DivergedError
from ._memory import OutOfMemoryError as OutOfMemoryError
from ._memory import largest_batch as largest_batch
from ._memory import step_bytes as step_bytes
