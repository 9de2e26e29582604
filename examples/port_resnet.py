"""Port a torchvision ResNet checkpoint to Flax, compare logits with torch, make a prediction.

    python examples/port_resnet.py [CHECKPOINT] [--out resnet.safetensors] [--prefix encoder_q]
        [--backbone-only]

CHECKPOINT is a file, or torchvision's pretrained weights by name or URL
(`ResNet50_Weights.IMAGENET1K_V2`, downloaded once into torch's cache): with those, the
prediction is a real one. With no CHECKPOINT it uses jaxport's embedded default (a ResNet-50
saved like a GPU DataParallel training run). No pretrained weights can be downloaded here, so
the default's "prediction" is that of a randomly initialised (but BatchNorm-calibrated) network:
the point is that torch and JAX make the same one. The photo is a real one that ships with
scikit-learn.
"""
import argparse
import json
import os
import sys

import jax
import numpy as np
import torch
import torchvision
from PIL import Image
from sklearn.datasets import load_sample_image
from torchvision import transforms

import jaxport
import torch_compat


def _is_port(path: str) -> bool:
    """Whether `path` holds variables written by `jaxport.save_variables` (or `jaxport port`)."""
    try:
        return jaxport.read_metadata(path).get("format") == "jaxport.variables"
    except jaxport.JaxportError:  # not a safetensors file
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?")
    parser.add_argument("--out", default="ported.safetensors")
    parser.add_argument("--force", action="store_true", help="replace an existing --out that is not an earlier port")
    parser.add_argument("--prefix", default=None,
                        help="the ResNet is stored inside a bigger model under this key prefix (MoCo's encoder_q); "
                             "the loading errors name it when they see one")
    parser.add_argument("--backbone-only", action="store_true",
                        help="keep conv1, bn1 and layer1..4 only, dropping any other head (MoCo's MLP fc): the "
                             "conversion errors say when it is needed; the backbone is ported, then checked with "
                             "`jaxport verify` (this example compares class predictions)")
    args = parser.parse_args()
    path = args.checkpoint or torch_compat.default_checkpoint()
    named = not os.path.exists(path) and not path.startswith(("http://", "https://"))  # a weights name, if any
    if not os.path.exists(path):  # torchvision's pretrained weights by name or URL; else says it does not exist
        path = str(torch_compat.download_checkpoint(path))
    # save_variables refuses a directory, a device or a FIFO, but cannot know what was read:
    # writing over the checkpoint itself would destroy it.
    if os.path.exists(args.out) and os.path.exists(path) and os.path.samefile(args.out, path):
        parser.error(f"--out (={args.out}) is the checkpoint itself; name another file")
    # As `jaxport port --out`: an earlier port is replaced (a re-run), any other file only with
    # --force (the default name in the current directory replaced whatever had that name).
    if os.path.isfile(args.out) and not args.force and not _is_port(args.out):
        parser.error(f"--out (={args.out}) already exists and is not an earlier port; nothing was written: name "
                     "another file, or pass --force to replace it")

    # 1. Load safely (weights-only unpickler; `module.`/`_orig_mod.` stripped) and convert.
    state_dict = torch_compat.load_state_dict(path, prefix=args.prefix)
    if args.backbone_only:
        state_dict = torch_compat.backbone_state_dict(state_dict)
    arch = torch_compat.detect_arch(state_dict)
    variables = torch_compat.torch_to_flax(state_dict, arch)
    # torchvision's weights by name: what it keeps beside them (class names, evaluation
    # transform, accuracy) goes into the port's header, as `jaxport port NAME` writes it.
    num_classes = torch_compat.num_classes_of(state_dict)
    meta = torch_compat.weights_metadata(args.checkpoint, num_classes) if named else None
    jaxport.save_variables(args.out, variables, arch=arch, metadata=meta)
    variables = jaxport.load_variables(args.out)  # what a JAX-only program would do
    if not num_classes:
        sys.exit(f"port_resnet.py: '{path}' is a {arch} backbone without a classifier (ported to {args.out}); "
                 "this example compares class predictions: check a backbone with `jaxport verify`")
    print(f"{path}: {arch}, {num_classes} classes -> {args.out}")

    # 2. One real photo, torchvision's ImageNet evaluation preprocessing.
    preprocess = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    ])
    image = preprocess(Image.fromarray(load_sample_image("china.jpg")))[None]  # NCHW

    # 3. The same image through torchvision and through the Flax port (NHWC).
    torch_model = getattr(torchvision.models, arch)(num_classes=num_classes)
    torch_model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        torch_logits = torch_model.eval()(image.float()).numpy()
    flax_model = jaxport.models.build(arch, num_classes=num_classes)
    with jax.default_matmul_precision("highest"):
        jax_logits = np.asarray(jax.jit(flax_model.apply)(variables, image.permute(0, 2, 3, 1).numpy()))
    rel = np.abs(jax_logits - torch_logits).max() / np.abs(torch_logits).max()
    print(f"max |jax - torch| / max |torch| on the logits: {rel:.2e}")

    # 4. The prediction, by both, named by the port's header where it records the class names (a
    # port of torchvision's weights by name), else by ImageNet's for 1000 classes.
    header = jaxport.read_metadata(args.out)
    if "categories" in header:
        categories = json.loads(header["categories"])
        print(f"class names: the port's metadata ({header['weights']})")
    else:
        categories = torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["categories"]
    names = categories if num_classes == len(categories) else [f"class {i}" for i in range(num_classes)]
    top_torch = np.argsort(-torch_logits[0])[:5]
    top_jax = np.argsort(-jax_logits[0])[:5]
    print("top-5 (torch):", ", ".join(names[i] for i in top_torch))
    print("top-5 (jax):  ", ", ".join(names[i] for i in top_jax))
    same = list(top_torch) == list(top_jax)
    print("same prediction:", same)
    return 0 if rel < 1e-4 and same else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except jaxport.JaxportError as e:  # bad input: one line, as the CLI prints it
        sys.exit(f"port_resnet.py: error: {e}")
    except OSError as e:  # --out cannot be written (a file where a directory should be, a read-only or full disk)
        sys.exit(f"port_resnet.py: error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}")
