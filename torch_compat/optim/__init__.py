"""torch.optim equivalents as optax transformations and schedules.

`sgd`, `adamw` and `rmsprop` reproduce `torch.optim.SGD` / `AdamW` / `RMSprop` update for update, and
`clip_grad_norm` torch's `clip_grad_norm_`;
`step_lr`, `multistep_lr`, `exponential_lr`, `cosine_annealing_lr`, `linear_warmup`,
`constant_lr` and `one_cycle_lr` reproduce torch's `StepLR`, `MultiStepLR`, `ExponentialLR`,
`CosineAnnealingLR`, `LinearLR`, `ConstantLR` and `OneCycleLR` values exactly (and
`one_cycle_momentum` the momentum, or Adam's beta1, OneCycleLR cycles); `reduce_lr_on_plateau` decides as torch's
`ReduceLROnPlateau`, on the host, once per epoch. They are pure optax (implemented in
`jaxport.train._optim`, so the JAX training loop needs no torch).

torch idioms, the optax way (each checked against torch in tests/test_optim_probe.py):

* param groups (e.g. no weight decay on biases): `optax.multi_transform({"decay": sgd(...),
  "no_decay": sgd(..., weight_decay=0)}, labels)`;
* frozen parameters (`.grad` None: torch skips them): `optax.set_to_zero()` for their label;
  the plain optimizer sees a zero gradient and still decays them;
* `param_groups[0]["lr"] = ...` while training: `optax.inject_hyperparams(sgd)(...)`, then set
  `state.hyperparams["learning_rate"]`;
* `scheduler.step()` per epoch: `per_epoch(schedule, steps_per_epoch)`;
* `SequentialLR([warm-up, decay], [n])`: `optax.join_schedules([linear_warmup(...), decay], [n])`
  or with `constant_lr(...)` (the decay restarts at its step 0 at the milestone, as in torch;
  torch sets a cosine's step 0 there by its closed form, an ulp off the lr with an `eta_min`);
* `clip_grad_norm_(model.parameters(), max_norm)` before `opt.step()`: `optax.chain(
  clip_grad_norm(max_norm), sgd(...))`; with frozen parameters, zero their gradients before the
  clip (see `clip_grad_norm`), as torch leaves them out of the norm.
"""
from jaxport.train._optim import adamw as adamw
from jaxport.train._optim import clip_grad_norm as clip_grad_norm
from jaxport.train._optim import constant_lr as constant_lr
from jaxport.train._optim import cosine_annealing_lr as cosine_annealing_lr
from jaxport.train._optim import exponential_lr as exponential_lr
from jaxport.train._optim import linear_warmup as linear_warmup
from jaxport.train._optim import multistep_lr as multistep_lr
from jaxport.train._optim import one_cycle_lr as one_cycle_lr
from jaxport.train._optim import one_cycle_momentum as one_cycle_momentum
from jaxport.train._optim import PlateauState as PlateauState
from jaxport.train._optim import ReduceLROnPlateau as ReduceLROnPlateau
from jaxport.train._optim import per_epoch as per_epoch
from jaxport.train._optim import reduce_lr_on_plateau as reduce_lr_on_plateau
from jaxport.train._optim import rmsprop as rmsprop
from jaxport.train._optim import sgd as sgd
from jaxport.train._optim import step_lr as step_lr
