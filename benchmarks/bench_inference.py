"""Flax ResNet-50 inference throughput against torchvision eager, measured in the same run.

One process builds a calibrated torchvision ResNet-50 (`reference_model`, eval mode), ports it
with `torch_to_flax`, and for each batch size times, interleaved (the order reverses every
repeat) and after a warm-up/compile call:

- torch eager: `model(x)` under `torch.inference_mode()`, `torch.set_num_threads(T)` for each T
  of `--torch-threads` (default: the number of cores, as XLA's CPU thread pool); on CUDA one
  eager case (threads do not matter there), channels_last, and `torch.compile(model)` beside it
  (`--torch-variants`);
- jax: `jax.jit(model.apply, compiler_options=jaxport.compiler_options())(variables, x)`
  (variables as arguments; the options are `{}` off CPU);
- jax-const: the variables closed over, so XLA sees them as constants;
- jax-folded: `build_folded("resnet50")` with `fold_batchnorm(variables, "resnet50")` as
  arguments (conv with bias, no BatchNorm).

It prints medians, images/s, the speed-up `torch time / jax time` against torch with as many
threads as XLA uses (x-same) and against the fastest torch setting of the run (x-best: on a
shared machine torch's OpenMP threads spin-wait and 1 thread can beat 2), and the error of every variant's logits against torch's (max |diff| / max
|torch logit|; the tests hold this under 1e-4).

Usage:
  PYTHONPATH=. python benchmarks/bench_inference.py [--batch 8 32] [--repeats 5 3]
      [--torch-threads 2 1] [--variants jax jax-const jax-folded] [--xla-flags "--xla_cpu_use_onednn=true"]
      [--device cuda --dtype bfloat16 --batch 8 32 256]   # GPU: torch eager + torch.compile
      [--torch-variants eager compile] [--channels-last]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _argtypes import positive_int, usable_cores  # noqa: E402

GOAL = 1.3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[8, 32])
    p.add_argument("--repeats", type=positive_int, nargs="+", default=[5, 3], help="per batch size (last one repeats)")
    p.add_argument("--size", type=positive_int, default=224)
    p.add_argument("--torch-threads", type=positive_int, nargs="+", default=None,
                   help="default: the cores this process may use (as XLA's pool), and 1")
    p.add_argument("--xla-flags", default=None, help="set XLA_FLAGS before jax is imported")
    p.add_argument("--variants", nargs="+", default=["jax", "jax-folded"], choices=["jax", "jax-const", "jax-folded"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="jax: the matching backend")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--torch-variants", nargs="+", default=None, choices=["eager", "compile"],
                   help="default: eager on CPU, eager and compile on CUDA")
    p.add_argument("--channels-last", action="store_true", help="torch in channels_last (always on CUDA)")
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    torch_variants = a.torch_variants or (["eager", "compile"] if gpu else ["eager"])
    channels_last = a.channels_last or gpu
    if a.xla_flags is not None:
        os.environ["XLA_FLAGS"] = a.xla_flags

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import jaxport
    import torch_compat
    from jaxport import models

    if gpu and not (torch.cuda.is_available() and jax.default_backend() == "gpu"):
        p.error(f"--device cuda: torch sees {'a' if torch.cuda.is_available() else 'no'} CUDA device and jax runs on "
                f"{jax.default_backend()}; both need the GPU (or use --device cpu)")
    cores = usable_cores()
    threads = a.torch_threads or sorted({cores, 1}, reverse=True)
    jax_device = jax.devices("gpu" if a.device == "cuda" else a.device)[0]
    tdtype, jdtype = {"float32": (torch.float32, jnp.float32), "bfloat16": (torch.bfloat16, jnp.bfloat16)}[a.dtype]
    # jaxport.compiler_options(): on CPU, XLA's own convolutions instead of YNNPACK's.
    opts = jaxport.compiler_options(jax_device.platform)
    print(f"jax {jax.__version__} ({jax_device.platform}), torch {torch.__version__}, {cores} cores, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')!r}, "
          f"dtype {a.dtype}, device {a.device}, jit compiler_options={opts}")

    ref = torch_compat.reference_model("resnet50").to(device=a.device, dtype=tdtype)
    sd = {k: v.cpu() for k, v in ref.state_dict().items()}
    if channels_last:
        ref = ref.to(memory_format=torch.channels_last)
    torch_models = {"eager": ref, "compile": torch.compile(ref) if "compile" in torch_variants else None}
    cast = lambda t: jax.device_put(jnp.asarray(t, jdtype if jnp.issubdtype(t.dtype, jnp.floating) else t.dtype), jax_device)
    ported = torch_compat.torch_to_flax(sd)
    variables = jax.tree.map(cast, ported)
    folded = jax.tree.map(cast, models.fold_batchnorm(ported, "resnet50"))
    model, folded_model = models.resnet50(), models.build_folded("resnet50")
    apply_args = jax.jit(model.apply, compiler_options=opts)
    apply_const = jax.jit(lambda x: model.apply(variables, x), compiler_options=opts)
    apply_folded = jax.jit(folded_model.apply, compiler_options=opts)

    def torch_run(x, n, variant="eager"):
        if n is not None:
            torch.set_num_threads(n)
        with torch.inference_mode():
            y = torch_models[variant](x)
        if gpu:
            torch.cuda.synchronize()
        return y

    def torch_name(variant, n):
        label = "torch eager" if variant == "eager" else "torch.compile"
        return label if n is None else f"{label} ({n} thr)"

    for i, batch in enumerate(a.batch):
        repeats = a.repeats[min(i, len(a.repeats) - 1)]
        x = np.random.default_rng(batch).standard_normal((batch, a.size, a.size, 3), dtype=np.float32)
        xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).to(device=a.device, dtype=tdtype)
        if channels_last:
            xt = xt.contiguous(memory_format=torch.channels_last)
        xj = jax.device_put(jnp.asarray(x, jdtype), jax_device)
        cases = {torch_name(v, n): (lambda n=n, v=v: torch_run(xt, n, v))
                 for v in torch_variants for n in ([None] if gpu else threads)}
        jax_cases = {
            "jax": lambda: apply_args(variables, xj).block_until_ready(),
            "jax-const": lambda: apply_const(xj).block_until_ready(),
            "jax-folded": lambda: apply_folded(folded, xj).block_until_ready(),
        }
        cases.update({k: v for k, v in jax_cases.items() if k in a.variants})
        first, outputs = {}, {}
        for name, fn in cases.items():  # warm-up; jit compiles here
            t = time.perf_counter()
            outputs[name] = np.asarray(torch.as_tensor(fn()).float().cpu() if name.startswith("torch") else
                                       np.asarray(fn(), np.float32))
            first[name] = time.perf_counter() - t
        times = {name: [] for name in cases}
        order = list(cases)
        for r in range(repeats):
            for name in (order if r % 2 == 0 else order[::-1]):
                t = time.perf_counter()
                cases[name]()
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base_name = torch_name(torch_variants[0], None if gpu else (cores if cores in threads else threads[0]))
        best = min((n for n in cases if n.startswith("torch")), key=med.get)
        base, expected = med[base_name], outputs[base_name]
        scale = float(np.abs(expected).max())
        print(f"\nbatch {batch}, {a.size}px, {repeats} repeats (median). x-same: {base_name} time / time;"
              f" x-best: fastest torch ({best}) time / time; goal >= {GOAL}x")
        for name in cases:
            err = float(np.abs(outputs[name] - expected).max()) / scale
            goal = (f"  goal: {'met' if base / med[name] >= GOAL else 'MISSED'} (same), "
                    f"{'met' if med[best] / med[name] >= GOAL else 'MISSED'} (best)") if name.startswith("jax") else ""
            print(f"  {name:20s} {med[name] * 1e3:8.1f} ms {batch / med[name]:6.1f} img/s  x-same {base / med[name]:5.2f}"
                  f"  x-best {med[best] / med[name]:5.2f}  err {err:.1e}  (1st call {first[name]:.1f} s){goal}", flush=True)


if __name__ == "__main__":
    main()
