"""Port a torch ResNet, fine-tune it data-parallel in JAX on the embedded digits, export it
back to torch, and show torch and JAX agree on its predictions.

    python examples/finetune_ported_resnet.py                     # about 2 minutes on 2 CPU cores
    python examples/finetune_ported_resnet.py --checkpoint resnet18-f37072fd.pth  # real ImageNet weights
    python examples/finetune_ported_resnet.py --checkpoint r.pth --bn-mode frozen  # BatchNorm as FrozenBatchNorm2d
    python examples/finetune_ported_resnet.py --image-size 16 --max-steps 4       # smoke run (tests)

Runs on every local device (set JAX_NUM_CPU_DEVICES=8 before starting to simulate 8 on a CPU).
Nothing is downloaded: without --checkpoint the torch model is torchvision's resnet18 at its
seeded initialisation, saved as a torch user would save it. Exits 1 if torch and JAX disagree
on any held-out prediction.
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxport import JaxportError  # noqa: E402
from jaxport.models import build  # noqa: E402
from jaxport.train import TrainConfig, digits, load_workdir, train  # noqa: E402
from torch_compat import detect_arch, flax_to_torch, load_state_dict  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a torchvision resnet18 state_dict to start from (default: seeded init)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bn-mode", default="train", choices=["train", "eval", "frozen"],
                   help="BatchNorm while fine-tuning: train (model.train()), eval (bn.eval(): running statistics kept, "
                        "scales and biases trained) or frozen (FrozenBatchNorm2d) (default: train)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    p.add_argument("--workdir", default=None, help="where the run and model.pt go (default: a new temp dir)")
    args = p.parse_args()
    settings = dict(arch="resnet18", epochs=args.epochs, image_size=args.image_size, batch_size=64, lr=args.lr,
                    bn_mode=args.bn_mode, max_steps=args.max_steps, progress=sys.stderr.isatty())
    # train() checks its settings, but only after step 1 wrote a 47 MB torch checkpoint: a bad
    # flag left it behind. They are checked before anything is written.
    TrainConfig(workdir=os.path.join(args.workdir or tempfile.gettempdir(), "run"), **settings).validate()
    ckpt = args.checkpoint
    if ckpt is not None and not os.path.isfile(ckpt):
        p.error(f"--checkpoint (={ckpt}) is not a file; pass a torchvision resnet18 state_dict, or leave it out")
    if args.checkpoint is not None and (found := detect_arch(load_state_dict(ckpt))) != "resnet18":
        p.error(f"--checkpoint (={ckpt}) holds {found} weights; this example fine-tunes a resnet18 "
                f"(for other architectures use `jaxport train --arch {found} --init {ckpt}`)")
    work = args.workdir or tempfile.mkdtemp(prefix="jaxport-finetune-")
    run = os.path.join(work, "run")
    if os.path.isdir(run) and os.listdir(run):  # train() would suggest --resume, which this script does not have
        p.error(f"--workdir (={work}) already holds a run in {run}; choose a new directory (nothing was changed)")
    os.makedirs(work, exist_ok=True)  # a --workdir that does not exist yet is made, not a torch.save error

    # 1. A torch model with an ImageNet-style head of 1000 classes, saved as a torch user would.
    if ckpt is None:
        torch.manual_seed(0)
        ckpt = os.path.join(work, "torch_resnet18.pt")
        torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), ckpt)

    # 2. Fine-tune in JAX, data-parallel over all devices; `init` ports the torch checkpoint and
    #    re-initialises the 1000-class head for the 10 digit classes (a message says so).
    result = train(TrainConfig(workdir=run, init=ckpt, **settings))
    if "val_acc" in result:
        print(f"JAX fine-tuned for {result['step']} steps: held-out accuracy {result['val_acc']:.4f}")

    # 3. Export back to a torch state_dict (what `jaxport export WORKDIR --out model.pt` writes);
    #    torchvision loads it with strict=True.
    variables, arch = load_workdir(run)
    out = os.path.join(work, "model.pt")
    torch.save(flax_to_torch(variables, arch), out)
    back = torchvision.models.resnet18(num_classes=10)
    back.load_state_dict(torch.load(out, weights_only=True), strict=True)

    # 4. The same held-out digits through torch (NCHW) and JAX (NHWC), both in eval mode.
    val = digits(args.image_size).val
    x, y = val.load(np.arange(val.num_examples), 0)
    jax_logits = np.asarray(build(arch, num_classes=10).apply(variables, x))
    with torch.no_grad():
        torch_logits = back.eval()(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    jax_pred, torch_pred = jax_logits.argmax(-1), torch_logits.argmax(-1)
    agree = float(np.mean(jax_pred == torch_pred))
    diff = float(np.max(np.abs(jax_logits - torch_logits)) / np.max(np.abs(torch_logits)))
    print(f"torch accuracy {np.mean(torch_pred == y):.4f}, JAX accuracy {np.mean(jax_pred == y):.4f}; "
          f"predictions agree on {agree:.2%} of {len(y)} held-out images (logits differ by at most "
          f"{diff:.1e} of their scale); exported to {out}")
    return 0 if agree == 1.0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except JaxportError as e:  # bad input: one line, as the CLI prints it
        sys.exit(f"finetune_ported_resnet.py: error: {e}")
    except OSError as e:  # --workdir cannot be written (read-only, full disk)
        sys.exit(f"finetune_ported_resnet.py: error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}")
