"""One data-parallel training step: `jax.jit` + `jax.shard_map` over a 1-D `data` mesh.

Semantics (torch's DistributedDataParallel / DataParallel, one replica per device):

* parameters and optimizer state are replicated; the global batch is split along axis 0;
* the loss is the mean cross-entropy over the *global* batch (optionally label-smoothed, as
  torch's `CrossEntropyLoss(label_smoothing=...)`): each device takes the mean over its
  share, and the gradients are averaged with `pmean("data")` (equal shares, so the mean of
  means is the global mean);
* BatchNorm uses per-device batch statistics (DDP without SyncBatchNorm) unless the model was
  built with `bn_axis_name="data"` (SyncBatchNorm: statistics averaged over the mesh, so the
  result does not depend on the number of devices);
* per-device running statistics are made the same on every device after each step: by
  default (`running_stats="mean"`) averaged with `pmean`, which uses every device's data;
  with `running_stats="first"` device 0's update, broadcast to the others, as
  `nn.DataParallel` keeps replica 0's buffers and DDP broadcasts rank 0's. The two train the
  same weights, but evaluation (running statistics) differs. `num_batches_tracked` is the same
  on every device and is left as is.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._args import is_int, is_real, one_of
from .._errors import ConfigError
from .._xla import compiler_options
from . import _mix
from ._recipe import norm_labels

AXIS = "data"


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; a pytree, checkpointed as a whole."""

    step: jax.Array
    params: Any
    batch_stats: Any
    opt_state: Any

    @property
    def variables(self) -> dict:
        return {"params": self.params, "batch_stats": self.batch_stats}


def make_mesh(devices: list | None = None) -> Mesh:
    """A 1-D mesh named `data` over `devices` (default: every device of every process)."""
    if devices is None:
        return jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(AxisType.Auto,))
    devices = np.asarray(devices)
    if devices.size == 0:  # an empty Mesh() was returned, and failed later without naming this
        raise ConfigError("`devices` (=[]) is empty; pass some of jax.devices(), or None for all of them")
    return Mesh(devices, (AXIS,), axis_types=(AxisType.Auto,))


def _check_mesh_and_model(mesh: Mesh, model: Any = None) -> None:
    """A user-built mesh with another axis name failed in jax ("Resource axis: data of
    P('data',) is not found in mesh"); a model constructor instead of a model, with an
    AttributeError on `bn_axis_name`."""
    if not isinstance(mesh, Mesh) or AXIS not in mesh.axis_names:
        found = f"axes {mesh.axis_names}" if isinstance(mesh, Mesh) else type(mesh).__name__
        raise ConfigError(f"`mesh` ({found}) must be a jax Mesh with an axis named {AXIS!r}, which the batch is split "
                          "along; build it with jaxport.train.make_mesh(devices)")
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(f"`model` (={model!r}) must be a Flax module instance, e.g. models.resnet18(num_classes=10) "
                          "or models.build(arch, num_classes=...), not the function that builds one")


def check_batch_size(batch_size: int, num_devices: int, name: str = "batch_size") -> None:
    """Refuse a global batch that does not split evenly over the devices, naming valid sizes.

    Raises:
      ConfigError: e.g. "`batch_size` (=30) must be divisible by the number of devices (=8);
        use 32 or 24".
    """
    if not is_int(batch_size) or batch_size < 1:  # 2.5 was answered "use 4.0 or 2.0"
        raise ConfigError(f"`{name}` (={batch_size!r}) must be an integer >= 1")
    if batch_size % num_devices:
        down, up = batch_size // num_devices * num_devices, (batch_size // num_devices + 1) * num_devices
        fix = f"use {up} or {down}" if down else f"use {up}"
        raise ConfigError(
            f"`{name}` (={batch_size}) must be divisible by the number of devices (={num_devices}); {fix}"
        )


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Put host arrays on every device of `mesh` (works across processes: each holds the value)."""
    sharding = NamedSharding(mesh, P())

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree.map(put, tree)


def shard_batch(mesh: Mesh, *local: np.ndarray) -> tuple[jax.Array, ...]:
    """Global arrays split along axis 0 from this process's share of the batch.

    With one process `local` is the whole batch; with several, each process passes its
    consecutive slice (process `i` holds rows `[i * n, (i + 1) * n)`).
    """
    sharding = NamedSharding(mesh, P(AXIS))
    local = tuple(np.asarray(x) for x in local)
    # Checked here: jax's IndivisibleError for a batch that does not split named no fix.
    here = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    for i, x in enumerate(local):
        if x.ndim == 0:
            raise ConfigError(f"array {i} passed to shard_batch is a scalar; pass batches with the examples on axis 0")
        check_batch_size(len(x), here, name=f"shard_batch: array {i}'s examples (shape {x.shape}, this process)")
    return tuple(jax.make_array_from_process_local_data(sharding, x) for x in local)


def create_state(variables: dict, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """A replicated TrainState at step 0 from Flax variables `{"params", "batch_stats"}`."""
    if not isinstance(variables, Mapping) or "params" not in variables:  # was a bare KeyError: 'params'
        found = sorted(variables)[:5] if isinstance(variables, Mapping) else type(variables).__name__
        raise ConfigError(f"`variables` (holding {found}) must be Flax variables {{'params': ..., 'batch_stats': "
                          "...}}, as model.init or torch_compat.torch_to_flax return them")
    _check_mesh_and_model(mesh)
    if not isinstance(tx, optax.GradientTransformation):  # a torch.optim.SGD: "'SGD' object has no attribute 'init'"
        raise ConfigError(f"`tx` (={type(tx).__module__}.{type(tx).__name__}) must be an optax "
                          "GradientTransformation, e.g. torch_compat.optim.sgd(0.1, momentum=0.9) for "
                          "torch.optim.SGD(params, lr=0.1, momentum=0.9)")
    params = jax.tree.map(np.asarray, variables["params"])
    batch_stats = jax.tree.map(np.asarray, variables.get("batch_stats", {}))
    opt_state = jax.jit(tx.init)(params)
    state = TrainState(step=np.zeros((), np.int32), params=params, batch_stats=batch_stats,
                       opt_state=jax.tree.map(np.asarray, opt_state))
    return replicate(state, mesh)


def check_label_smoothing(value, name: str = "label_smoothing") -> float:
    """`value` as a float if it is a number from 0 to 1 (torch's range), else a ConfigError."""
    # `not 0 <= x <= 1` also refuses NaN, which fails every comparison.
    if not (is_real(value) and 0 <= value <= 1):
        raise ConfigError(f"`{name}` (={value!r}) must be a number from 0 to 1, as torch's CrossEntropyLoss takes: "
                          "the weight of the uniform target, e.g. 0.1; 0 for plain cross-entropy")
    return float(value)


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Per-example `torch.nn.functional.cross_entropy(..., reduction="none", label_smoothing=ls)`,
    in >= float32, for class indices or (as torch too) class probabilities.

    `labels` of a floating dtype and the logits' shape are probabilities (MixUp's and CutMix's
    soft targets, `_mix`): the loss is torch's `-sum(logp * t)` over the classes with `t =
    labels * (1 - ls) + ls / num_classes`. A row of them that is not finite (`_mix` makes the rows
    of out-of-range labels NaN) gives that example a NaN loss and no gradient, where torch's
    gradient would be NaN too. A logit of -inf with a target of 0 makes the loss NaN, as in torch.

    With `ls = label_smoothing` and `logp = log_softmax(logits)`, the loss is torch's
    `(1 - ls) * -logp[label] + ls * mean(-logp)` over the classes (the cross-entropy against
    `(1 - ls) * one_hot + ls / num_classes`, as `optax.smooth_labels`). A label outside
    `[0, num_classes)` gives that example a NaN loss, where torch raises IndexError (a jitted
    step cannot raise on values): -1 would otherwise index the last class and train on it
    silently, and torch's `ignore_index` (-100) is not a convention here. With `ls > 0` a
    logit of -inf makes the loss +inf, as in torch (the uniform target puts weight on it).

    Raises:
      ConfigError: `label_smoothing` is not a number from 0 to 1.
    """
    ls = check_label_smoothing(label_smoothing)
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    if jnp.issubdtype(labels.dtype, jnp.floating) and labels.shape == logits.shape:
        valid = jnp.all(jnp.isfinite(labels), axis=-1)
        target = jnp.where(valid[..., None], labels, 0).astype(dtype)
        if ls:
            target = target * (1 - ls) + ls / logits.shape[-1]
        loss = -jnp.sum(jax.nn.log_softmax(logits.astype(dtype), axis=-1) * target, axis=-1)
        return jnp.where(valid, loss, jnp.nan)
    valid = (labels >= 0) & (labels < logits.shape[-1])
    safe = jnp.where(valid, labels, 0)
    if ls == 0:  # optax's fused form: the losses and gradients every run without smoothing had
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(dtype), safe)
    else:
        logp = jax.nn.log_softmax(logits.astype(dtype), axis=-1)
        nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
        loss = (1 - ls) * nll + ls * -jnp.mean(logp, axis=-1)
    return jnp.where(valid, loss, jnp.nan)


RUNNING_STATS = ("mean", "first")  # `make_train_step(running_stats=...)`, `jaxport train --bn-stats`
# `make_train_step(batchnorm=...)`, `jaxport train --bn-mode`: torch's `model.train()`; the
# BatchNorm layers put back in eval mode (`bn.eval()` for each, the usual fine-tuning with small
# batches); and torchvision's FrozenBatchNorm2d (eval mode, and scale and bias fixed too).
BATCHNORM_MODES = ("train", "eval", "frozen")


def _agree_running_stats(batch_stats, how: str):
    """Every device's running statistics made one: their mean, or device 0's (`how="first"`)."""
    first = jax.lax.axis_index(AXIS) == 0

    def agree(path, x):
        if path[-1].key == "num_batches_tracked":
            return x
        if how == "mean":
            return jax.lax.pmean(x, AXIS)
        # A sum of device 0's value and zeros is device 0's value exactly (a NaN or inf on
        # another device is not added: `where` drops it), and costs what `pmean` costs.
        return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), AXIS)

    return jax.tree_util.tree_map_with_path(agree, batch_stats)


def _options(mesh: Mesh) -> dict[str, str]:
    return compiler_options(mesh.devices.flat[0].platform)


def _check_batch(images, labels, mask=None) -> None:
    """Refuse, while tracing, labels (or a mask) that are not one per image. Inside `shard_map`
    each device would broadcast its share against its images: 16 images with 8 labels trained
    without an error, on labels each repeated twice."""
    n = images.shape[:1]
    if labels.shape != n:
        raise ConfigError(f"`labels` (shape {labels.shape}) must hold one class index per image: shape {n} for "
                          f"`images` of shape {images.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ConfigError(f"`labels` (dtype {labels.dtype}) must be integer class indices; pass labels.astype(np.int32)")
    if mask is not None and mask.shape != n:
        raise ConfigError(f"`mask` (shape {mask.shape}) must hold one weight per image: shape {n} for `images` of "
                          f"shape {images.shape}")


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh, *,
                    donate: bool = True, running_stats: str = "mean", label_smoothing: float = 0.0,
                    mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0, seed: int = 0,
                    batchnorm: str = "train", accum_steps: int = 1) -> Callable:
    """`step(state, images, labels) -> (state, metrics)`, jitted and sharded over `mesh`.

    `images` (NHWC) and `labels` are global arrays split along `data` (see `shard_batch`); the
    global batch must divide the device count. `metrics` holds the global mean `loss` and the
    number of `correct` predictions, replicated; a label outside `[0, num_classes)` makes the
    loss NaN (see `cross_entropy`), and its example adds nothing to the gradient. (Leaving the
    whole state unchanged instead costs copies of the weights on every step: 35M -> 48-62M
    elements copied per ResNet-50 step with a `lax.cond` or selects.) Whether BatchNorm is
    synchronised is the model's `bn_axis_name` (`"data"` for SyncBatchNorm, None for
    per-device statistics).

    `label_smoothing` (from 0 to 1) smooths the training loss as torch's
    `CrossEntropyLoss(label_smoothing=...)` does (see `cross_entropy`); `metrics["loss"]` is
    then the smoothed loss, the one the gradients are of. `make_eval_step`'s loss stays the
    plain cross-entropy.

    `running_stats` says which running statistics (BatchNorm's `mean` and `var`) every device
    keeps after a step with per-device BatchNorm over 2+ devices: `"mean"` (the default) their
    average over the devices; `"first"` device 0's update, as torch's `nn.DataParallel` (replica
    0's buffers) and DDP (`broadcast_buffers=True`: rank 0's) keep them. Only evaluation, which
    uses the running statistics, tells them apart; the loss and the weights are the same. With
    SyncBatchNorm (`bn_axis_name="data"`) or on one device every device's update is the same
    already, and the choice changes nothing.

    `mixup_alpha`, `cutmix_alpha` (0: off) mix each global batch as torchvision's train.py
    `--mixup-alpha`, `--cutmix-alpha` do (`_mix`): one of the two (uniformly, if both are > 0)
    with one draw per step from `_mix.step_key(seed, state.step)`, the batch rolled by one over
    all devices, so the step does not depend on the device or process count. The loss is then
    against the soft targets, and `correct` counts predictions equal to their argmax (torchvision's
    `utils.accuracy` with 2-D targets).

    `batchnorm` says how the BatchNorm layers train: `"train"` (the default) as torch's
    `model.train()`, normalising with each batch's statistics and updating the running ones;
    `"eval"` as `bn.eval()` on every BatchNorm of a model in train mode, the usual fine-tuning of
    pretrained weights with few images per device: the running statistics normalise and stay as
    they are, and the scales and biases still train; `"frozen"` as torchvision's
    `FrozenBatchNorm2d`: eval mode, and the scales and biases are fixed too. A frozen layer's
    scale and bias are buffers in torch, not parameters: they take no part in `tx` (no update,
    no weight decay, and a zero gradient, so a clip's global norm, `torch_compat.optim.
    clip_grad_norm`'s as torch's `clip_grad_norm_`, measures the others alone), though `tx`
    keeps state for them. With "eval" or "frozen", `running_stats` and the
    model's `bn_axis_name` change nothing, and one image per device is enough at any size.

    `accum_steps` (1: off) accumulates the gradients of that many passes before the one update,
    as a torch loop that calls `(loss / accum_steps).backward()` on each chunk of its batch and
    then `optimizer.step()`: the same global batch, the same loss and one update per call, with
    the activations of a chunk alone in memory (a `lax.scan` over the chunks; on XLA:CPU, whose
    convolution gradients run ~100x slower inside a loop, the chunks are unrolled instead, each
    made to wait for the one before; both also hold an accumulator of the gradients). Each
    device's share is split into `accum_steps` chunks of every `accum_steps`-th image (chunk `j`
    holds its images `j, j + k, ...`), so chunk `j` over all devices is the same images whatever
    the device count, and `--sync-bn`'s result still does not depend on it. Train-mode
    BatchNorm normalises each chunk with the chunk's statistics and updates the running ones
    once per chunk, as torch does (`num_batches_tracked` counts every chunk); this is the one
    difference from a single pass, and none with `batchnorm="eval"` or `"frozen"`. MixUp and
    CutMix mix the whole global batch first. The per-device batch must divide by `accum_steps`
    (refused when tracing, with the sizes that do).

    Gradient clipping, param groups and frozen parameters belong in `tx` (see
    `torch_compat.optim`). What this step does not take, another loss (class weights), is a
    step of your own: `model.apply` inside `jax.shard_map`, gradients `pmean`-ed over "data",
    as here.

    With `donate` (the default) a call consumes `state`: its buffers become the new state's,
    and passing it again is refused; `donate=False` keeps it, at the cost of a second copy of
    the weights and optimizer state in memory.
    """
    _check_mesh_and_model(mesh, model)
    if model.bn_axis_name not in (None, AXIS):
        raise ConfigError(f"`bn_axis_name` (={model.bn_axis_name!r}) must be None or {AXIS!r} for this mesh")
    one_of("running_stats", running_stats, RUNNING_STATS)
    one_of("batchnorm", batchnorm, BATCHNORM_MODES)
    label_smoothing = check_label_smoothing(label_smoothing)
    mixup_alpha = _mix.check_alpha(mixup_alpha, "mixup_alpha")
    cutmix_alpha = _mix.check_alpha(cutmix_alpha, "cutmix_alpha")
    if (mixup_alpha or cutmix_alpha) and not (is_int(seed) and 0 <= seed < 2**63):
        raise ConfigError(f"`seed` (={seed!r}) must be an integer from 0 to 2**63 - 1")
    if not (is_int(accum_steps) and accum_steps >= 1):
        raise ConfigError(f"`accum_steps` (={accum_steps!r}) must be an integer >= 1 (1: one pass, no accumulation)")
    accum_steps = int(accum_steps)
    platform = mesh.devices.flat[0].platform

    def local_step(state: TrainState, images, labels):
        if mixup_alpha or cutmix_alpha:
            images, labels = _mix.mix(_mix.step_key(seed, state.step), images, labels, model.num_classes, mixup_alpha,
                                      cutmix_alpha, axis_name=AXIS)

        def loss_and_grads(batch_stats, images, labels):
            def loss_fn(params):
                variables = {"params": params, "batch_stats": batch_stats}
                if batchnorm == "train":
                    logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
                    new_stats = updates["batch_stats"]
                else:  # a ResNet's `train` switches its BatchNorm layers alone
                    logits, new_stats = model.apply(variables, images, train=False), batch_stats
                loss = jnp.mean(cross_entropy(logits, labels, label_smoothing))
                return loss, (new_stats, logits)

            (loss, (new_stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            target = jnp.argmax(labels, -1) if labels.ndim > 1 else labels
            return loss, new_stats, grads, jnp.sum(jnp.argmax(logits, -1) == target)

        if accum_steps == 1:
            loss, batch_stats, grads, correct = loss_and_grads(state.batch_stats, images, labels)
        else:
            loss, batch_stats, grads, correct = _accumulate(loss_and_grads, state.batch_stats, state.params, images,
                                                            labels, accum_steps, unroll=platform in _UNROLLED_PLATFORMS)
        # Over one device a mean is the identity, but XLA:CPU still copies every gradient
        # through an all-reduce (~15 ms of ResNet-50's 16 x 128 px step): skip it there.
        if mesh.shape[AXIS] > 1:
            grads = jax.lax.pmean(grads, AXIS)
            if model.bn_axis_name is None and batchnorm == "train":
                batch_stats = _agree_running_stats(batch_stats, running_stats)
        if batchnorm == "frozen":
            grads = _zero_norms(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        if batchnorm == "frozen":
            updates = _zero_norms(updates)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": jax.lax.pmean(loss, AXIS), "correct": jax.lax.psum(correct, AXIS)}
        new = state.replace(step=state.step + 1, params=params, batch_stats=batch_stats, opt_state=opt_state)
        return new, metrics

    sharded = jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(P(), P()),
                            check_vma=False)

    def step(state: TrainState, images, labels):
        _check_batch(images, labels)
        return sharded(state, images, labels)

    jitted = jax.jit(step, donate_argnums=(0,) if donate else (), compiler_options=_options(mesh))
    return _Donating(jitted) if donate else jitted


# Platforms whose passes are unrolled rather than a `lax.scan`. XLA:CPU (jaxlib 0.10.2) runs a
# convolution's kernel gradient ~100x slower inside a while loop than outside one (a 3x3 conv of
# 8 x 32 x 32 x 64, 4 passes: 3.3 s against 29 ms unrolled; the input gradient 79 against 18 ms):
# a ResNet-18 step in 4 scanned passes took 3.4 s where one pass took 0.18 s, and unrolled takes
# 0.23 s. Unrolled as written, XLA:CPU interleaved the passes layer by layer and kept all their
# activations (ResNet-18's half-depth, 4 passes over 32 images of 64 px: 84.5 MiB of temporaries
# against 59.3 for one pass over 32 and 14.8 over 8); optimization barriers did not change it
# (XLA:CPU removes them before scheduling). With each pass's images made to depend on the
# gradients before it (`_zero_after`), the passes run one after another: 38.2 MiB, one pass
# over 8 plus the gradients' accumulator. (Scanned, the analysis says 16.8.)
_UNROLLED_PLATFORMS = frozenset({"cpu"})


def divisors(n: int) -> list[int]:
    """The pass counts that split `n` images into equal passes, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _accumulate(loss_and_grads: Callable, batch_stats, params, images, labels, k: int, unroll: bool = False):
    """`loss_and_grads` over `k` chunks of this device's share, in a `lax.scan` (one chunk's
    activations live at a time) or, with `unroll`, one after another in the program: the
    chunks' mean loss and mean gradients, the running statistics after the last chunk, and the
    summed correct count. Chunk `j` holds the share's images `j, j + k, ...`: the shares are
    consecutive rows of the global batch and each a multiple of `k`, so chunk `j` over all
    devices is the global batch's rows `j (mod k)`."""
    n = images.shape[0]
    if n % k:
        raise ConfigError(f"`accum_steps` (={k}) must divide the images per device (={n}): each pass takes an equal "
                          f"chunk of them; use one of {divisors(n)}, or a per-device batch that is a multiple of {k}")

    def chunks(x):  # (n, ...) -> (k, n / k, ...): chunk j = rows j, j + k, ...
        return jnp.swapaxes(x.reshape(n // k, k, *x.shape[1:]), 0, 1)

    def one(carry, batch):
        stats, total = carry
        loss, stats, grads, correct = loss_and_grads(stats, *batch)
        return (stats, jax.tree.map(jnp.add, total, grads)), (loss, correct)

    carry, xs = (batch_stats, jax.tree.map(jnp.zeros_like, params)), (chunks(images), chunks(labels))
    if unroll:
        # XLA:CPU schedules independent work breadth first: the passes' stems, then their first
        # blocks, ..., every pass's activations live at once (4 passes over 32 images needed
        # more than one pass over all 32). Optimization barriers are gone before it schedules.
        # A zero computed from the gradients so far, added to the next pass's images, makes each
        # pass wait for the one before, which frees its activations: see `_UNROLLED_PLATFORMS`.
        outputs = []
        for j in range(k):
            batch = (xs[0][j], xs[1][j])
            if j:
                batch = (batch[0] + _zero_after(carry[1]).astype(batch[0].dtype), batch[1])
            carry, out = one(carry, batch)
            outputs.append(out)
        (batch_stats, total), (losses, correct) = carry, jax.tree.map(lambda *o: jnp.stack(o), *outputs)
    else:
        (batch_stats, total), (losses, correct) = jax.lax.scan(one, carry, xs)
    # The mean over equal chunks of their means is the mean over the share, as without chunks.
    return jnp.mean(losses), batch_stats, jax.tree.map(lambda g: g / k, total), jnp.sum(correct)


def _zero_after(tree) -> jax.Array:
    """A scalar 0 that XLA computes only once every leaf of `tree` is: their first elements,
    summed and multiplied by 0 (XLA does not fold `x * 0` for floats, as x may be NaN; a
    NaN or inf is taken as 0 first, so that it stays in the gradients it belongs to)."""
    first = sum(leaf.ravel()[0].astype(jnp.float32) for leaf in jax.tree.leaves(tree))
    return jnp.where(jnp.isfinite(first), first, 0.0) * 0.0


def _zero_norms(tree):
    """`tree` (shaped as the params) with zeros for every BatchNorm's scale and bias: the
    parameters `--norm-weight-decay` groups (`_recipe.norm_labels`)."""
    return jax.tree.map(lambda x, label: jnp.zeros_like(x) if label == "norm" else x, tree, norm_labels(tree))


class _Donating:
    """A donating step that refuses a state it has already consumed. jaxlib 0.10 crashes the
    process (SIGSEGV) when a donated array sharded over 2+ CPU devices is passed again, and on
    one device raises a bare "Buffer has been deleted or donated"."""

    def __init__(self, jitted: Callable):
        self._jitted = jitted

    def __call__(self, state: TrainState, images, labels):
        step = getattr(state, "step", None)
        if isinstance(step, jax.Array) and step.is_deleted():
            raise ConfigError("`state` was consumed by an earlier call of this step (make_train_step donates it, so its "
                              "buffers hold the next state): pass the state that call returned, or build the step "
                              "with make_train_step(..., donate=False) to keep every state")
        return self._jitted(state, images, labels)

    def __getattr__(self, name: str):  # `lower`, `trace`, ... of the jitted step
        return getattr(self._jitted, name)


def make_eval_step(model: nn.Module, mesh: Mesh) -> Callable:
    """`evaluate(variables, images, labels, mask) -> {"loss_sum", "correct", "correct5", "count"}`
    (eval mode): `correct5` counts labels among the 5 largest logits (all of them with fewer
    classes), torchvision's Acc@5.

    `mask` (1 for real examples, 0 for padding) lets the last, partial batch be padded to a
    multiple of the device count.
    """
    _check_mesh_and_model(mesh, model)

    def local(variables, images, labels, mask):
        logits = model.apply(variables, images, train=False)
        loss = cross_entropy(logits, labels)
        hit = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        top5 = jax.lax.top_k(logits, min(5, logits.shape[-1]))[1]
        hit5 = jnp.any(top5 == labels[:, None], -1).astype(jnp.float32)
        return {
            "loss_sum": jax.lax.psum(jnp.sum(loss * mask), AXIS),
            "correct": jax.lax.psum(jnp.sum(hit * mask), AXIS),
            "correct5": jax.lax.psum(jnp.sum(hit5 * mask), AXIS),
            "count": jax.lax.psum(jnp.sum(mask), AXIS),
        }

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)), out_specs=P(),
                            check_vma=False)

    def evaluate(variables, images, labels, mask):
        _check_batch(images, labels, mask)
        return sharded(variables, images, labels, mask)

    return jax.jit(evaluate, compiler_options=_options(mesh))
