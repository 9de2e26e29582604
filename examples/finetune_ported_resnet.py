"""Port a torch ResNet, fine-tune it data-parallel in JAX on the embedded digits, export it
back to torch, and show torch and JAX agree on its predictions.

    python examples/finetune_ported_resnet.py [--epochs 3] [--image-size 32]

Runs on every local device (set JAX_NUM_CPU_DEVICES=8 before starting to simulate 8 on a CPU).
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxport.models import build  # noqa: E402
from jaxport.train import TrainConfig, digits, load_workdir, train  # noqa: E402
from torch_compat import flax_to_torch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--image-size", type=int, default=32)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="jaxport-finetune-")

    # 1. A torch model (ImageNet-style head of 1000 classes), saved as a torch user would.
    torch.manual_seed(0)
    tmodel = torchvision.models.resnet18(num_classes=1000)
    ckpt = os.path.join(work, "torch_resnet18.pt")
    torch.save(tmodel.state_dict(), ckpt)

    # 2. Fine-tune in JAX, data-parallel over all devices; the 1000-class head is re-initialised
    #    for the 10 digit classes (a message says so).
    result = train(TrainConfig(workdir=os.path.join(work, "run"), init=ckpt, arch="resnet18", epochs=args.epochs,
                               image_size=args.image_size, batch_size=64, lr=0.05))
    print(f"JAX fine-tuned: held-out accuracy {result['val_acc']:.4f}")

    # 3. Export back to a torch state_dict; torchvision loads it with strict=True.
    variables, arch = load_workdir(os.path.join(work, "run"))
    out = os.path.join(work, "model.pt")
    torch.save(flax_to_torch(variables, arch), out)
    back = torchvision.models.resnet18(num_classes=10)
    back.load_state_dict(torch.load(out, weights_only=True), strict=True)

    # 4. Same predictions on the held-out digits in torch (NCHW) and JAX (NHWC).
    val = digits(args.image_size).val
    x, y = val.load(np.arange(val.num_examples), 0)
    jax_pred = np.asarray(build(arch, num_classes=10).apply(variables, x)).argmax(-1)
    with torch.no_grad():
        torch_pred = back.eval()(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy().argmax(-1)
    agree = float(np.mean(jax_pred == torch_pred))
    print(f"torch accuracy {np.mean(torch_pred == y):.4f}, JAX accuracy {np.mean(jax_pred == y):.4f}, "
          f"predictions agree on {agree:.2%} of {len(y)} images; exported to {out}")
    return 0 if agree == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
