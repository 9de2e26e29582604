"""torch.optim equivalents as optax transformations and schedules.

`sgd` and `adamw` reproduce `torch.optim.SGD` / `torch.optim.AdamW` update for update;
`step_lr`, `multistep_lr`, `cosine_annealing_lr` and `linear_warmup` reproduce torch's
`StepLR`, `MultiStepLR`, `CosineAnnealingLR` and `LinearLR` values exactly. They are pure optax
(implemented in `jaxport.train._optim`, so the JAX training loop needs no torch).
"""
from jaxport.train._optim import adamw as adamw
from jaxport.train._optim import cosine_annealing_lr as cosine_annealing_lr
from jaxport.train._optim import linear_warmup as linear_warmup
from jaxport.train._optim import multistep_lr as multistep_lr
from jaxport.train._optim import per_epoch as per_epoch
from jaxport.train._optim import sgd as sgd
from jaxport.train._optim import step_lr as step_lr
