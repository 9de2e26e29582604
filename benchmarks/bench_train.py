"""ResNet-50 training-step throughput: jaxport (jit + shard_map, torch-equivalent SGD) vs torch.

CPU (default): float32, torchvision + torch.optim.SGD eager in the same run, batch 16 at
128 px and batch 32 at 224 px. GPU (`--gpu`): bfloat16 compute on one device against torch
eager and torch.compile, channels_last, autocast bf16.

    python benchmarks/bench_train.py                      # CPU figures
    python benchmarks/bench_train.py --arch resnet18 --classes 10 --configs 64x32
        # `jaxport train`'s default model and batch (the digits at 32 px)
    python benchmarks/bench_train.py --configs 32x128 --accum-steps 4
        # gradient accumulation: 4 passes of 8 a step, against torch's accumulation loop
    python benchmarks/bench_train.py --malloc keep        # both sides with glibc keeping freed memory
    python benchmarks/bench_train.py --gpu --configs 256x224  # on a GPU machine
    python benchmarks/bench_train.py --gpu --configs 256x224 --custom-vjps true --skip-torch
        # the hand-written VJPs on the GPU, with its 1x1 convs as lax.conv: never run there
        # (with the 1x1 convs as dots, as the model had them before, jax 0.11.2 aborted compiling)

Prints one line per configuration and writes JSON to --out if given. `jax_compile_s` is the
first step's time less a timed step's (the first step compiles); `device` is jax's device kind;
`*_faults_per_step` are the process's minor page faults over the timed steps, per step.

Why the faults are counted: XLA:CPU allocates each execution's temporary buffer (745 MB for
ResNet-50's step at 16 x 128 px) with `posix_memalign` and frees it at the end; glibc serves
any request over 32 MiB with a fresh `mmap` and returns it with `munmap`, so every step faults
all of it in again, zero-filled (~190k faults, ~0.5 s of system time a step on a 2-core VM).
torch's eager step frees and re-allocates its activations the same way (at 32 x 224 px ~1.8
million faults a step, more than jax's ~1.1 million).
`--malloc keep` re-runs the script with glibc's allocator told to keep freed memory for reuse
(`MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<1 TiB>`: one arena, no mmap,
no trimming), for both frameworks alike, at the price of a process that never gives memory
back. It took torch's faults to zero, and jax's only in part (benchmarks/README.md, section 4).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _argtypes import batch_x_size, positive_int, usable_cores  # noqa: E402
from jaxport.models import ARCHS  # noqa: E402


# One arena (the 745 MB request of an XLA worker thread would otherwise take its own mmap),
# never mmap, never trim: freed memory stays in the heap for the next step's requests.
_KEEP_FREED = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def _malloc_in_effect() -> str:
    # What this process runs under (after --malloc keep's re-run), not what was asked for.
    return "keep" if all(os.environ.get(k) == v for k, v in _KEEP_FREED.items()) else "system"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", type=batch_x_size, default=None, help="BATCHxSIZE, e.g. 16x128 32x224")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=positive_int, default=1, help="untimed steps first (the first one compiles)")
    p.add_argument("--gpu", action="store_true", help="bf16 on the accelerator; torch eager + compiled")
    p.add_argument("--threads", type=positive_int, default=usable_cores(),
                   help="torch intra-op threads (CPU; default: the cores this process may use, as XLA's pool)")
    p.add_argument("--custom-vjps", choices=["auto", "true", "false"], default="auto",
                   help="the model's custom_vjps: auto (None, the default: on XLA:CPU only), true, false; "
                        "the 1x1 convs are dots on XLA:CPU only, whatever this says")
    p.add_argument("--arch", default="resnet50", choices=ARCHS, metavar="ARCH",
                   help="any of jaxport.models' architectures (default resnet50)")
    p.add_argument("--classes", type=positive_int, default=1000, help="classifier size (default 1000)")
    p.add_argument("--accum-steps", type=positive_int, default=1,
                   help="passes per step (make_train_step(accum_steps=)); torch runs its accumulation loop: "
                        "(loss / N).backward() per chunk, then step() (default 1)")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--malloc", choices=["system", "keep"], default="system",
                   help="glibc's allocator as the system sets it, or told to keep freed memory (both frameworks; "
                        "Linux with glibc only; see the docstring)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.configs = args.configs or ([(256, 224)] if args.gpu else [(16, 128), (32, 224)])
    for batch, _ in args.configs:
        if batch % args.accum_steps:
            p.error(f"--accum-steps {args.accum_steps} must divide every --configs batch (got {batch})")
    if args.malloc == "keep" and _malloc_in_effect() != "keep":
        if platform.libc_ver()[0] != "glibc":
            p.error("--malloc keep: needs Linux with glibc (its MALLOC_* settings)")
        # glibc reads these once, as the process starts: run this script again under them.
        env = {**os.environ, **_KEEP_FREED}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.gpu:
        import jax

        if jax.default_backend() != "gpu":  # the jax row would be a CPU bf16 figure, unlabelled
            p.error(f"--gpu: jax runs on {jax.default_backend()}, not a GPU (is jax's CUDA plugin installed?)")
    return args


def bench_jax(batch, size, steps, warmup, bf16, custom_vjps=None, arch="resnet50", classes=1000, accum=1):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxport.models import build
    from jaxport.train import create_state, make_mesh, make_train_step, shard_batch
    from jaxport.train._optim import sgd

    mesh = make_mesh(jax.devices()[:1])
    model = build(arch, num_classes=classes, dtype=jnp.bfloat16 if bf16 else None, custom_vjps=custom_vjps)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, size, size, 3)))
    tx = sgd(0.1, momentum=0.9, weight_decay=1e-4)
    state = create_state(variables, tx, mesh)
    step = make_train_step(model, tx, mesh, accum_steps=accum)
    rng = np.random.default_rng(0)
    x, y = shard_batch(mesh, rng.standard_normal((batch, size, size, 3)).astype(np.float32),
                       rng.integers(0, classes, batch).astype(np.int32))
    t = time.perf_counter()
    state, m = step(state, x, y)
    jax.block_until_ready(m)
    first_s = time.perf_counter() - t  # the compile and one step
    for _ in range(warmup - 1):
        state, m = step(state, x, y)
    jax.block_until_ready(m)
    faults, t = _faults(), time.perf_counter()
    for _ in range(steps):
        state, m = step(state, x, y)
    jax.block_until_ready((state, m))
    elapsed = time.perf_counter() - t
    return batch * steps / elapsed, max(0.0, first_s - elapsed / steps), (_faults() - faults) / steps


def bench_torch(batch, size, steps, warmup, gpu, compiled, arch="resnet50", classes=1000, accum=1):
    import torch
    import torchvision

    dev = "cuda" if gpu else "cpu"
    model = getattr(torchvision.models, arch)(num_classes=classes).to(dev).train()
    if gpu:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(batch, 3, size, size, device=dev)
    if gpu:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        for j in range(accum):  # the chunks make_train_step(accum_steps=) takes: rows j, j + accum, ...
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=gpu):
                loss = torch.nn.functional.cross_entropy(model(x[j::accum]), y[j::accum]) / accum
            loss.backward()
        opt.step()
        return loss

    fn = torch.compile(step) if compiled else step
    for _ in range(warmup + (2 if compiled else 0)):
        fn()
    if gpu:
        torch.cuda.synchronize()
    faults, t = _faults(), time.perf_counter()
    for _ in range(steps):
        fn()
    if gpu:
        torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t), (_faults() - faults) / steps


def main():
    args = _parse()
    configs = args.configs
    import jax
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for batch, size in configs:
        custom_vjps = {"auto": None, "true": True, "false": False}[args.custom_vjps]
        jax_ips, compile_s, jax_faults = bench_jax(batch, size, args.steps, args.warmup, args.gpu, custom_vjps,
                                                   args.arch, args.classes, args.accum_steps)
        row = {"device": jax.devices()[0].device_kind, "arch": args.arch, "batch": batch, "size": size,
               "accum_steps": args.accum_steps, "custom_vjps": args.custom_vjps, "jax_img_s": jax_ips,
               "jax_compile_s": compile_s, "malloc": _malloc_in_effect(), "jax_faults_per_step": round(jax_faults)}
        # Printed before torch runs: torch.compile's compile can outlast a GPU lease's time limit.
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if not args.skip_torch:
            row["torch_eager_img_s"], torch_faults = bench_torch(batch, size, args.steps, args.warmup, args.gpu,
                                                                 False, args.arch, args.classes, args.accum_steps)
            row["torch_faults_per_step"] = round(torch_faults)
            if args.gpu:
                row["torch_compiled_img_s"], _ = bench_torch(batch, size, args.steps, args.warmup, True, True,
                                                             args.arch, args.classes, args.accum_steps)
            row["speedup_vs_eager"] = jax_ips / row["torch_eager_img_s"]
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
