"""Speed of jaxport.ops against torch's double sort, jnp's double argsort and logsumexp.

Run: python benchmarks/bench_ops.py [--repeats N] [--quick | --shapes 32x8732 ...] [--torch-device auto|cpu|cuda]
                                   [--ops rank topk_mask logsumexp] [--dispatch async|sync]

Every jax function is jit-compiled and warmed up, timed with block_until_ready, and reported
as the median of several runs. torch runs with as many threads as XLA:CPU uses (all the cores
this process may run on) and, because torch's OpenMP threads slow down badly when another
process shares the cores, also with 1 thread: each torch reference is the faster of the two,
so ratios are never flattered by a contended torch. Ratios are (reference time) / (jaxport
time), measured in the same run, so > 1 means jaxport is faster. `rank[xla]` / `topk_mask[xla]` are the
pure-XLA kernels that other backends use, shown on CPU for comparison.

On a GPU machine jax runs on its default backend (the GPU) and torch, by default, on CUDA too
(`--torch-device auto`): the table is then GPU against GPU, each torch call timed up to
`torch.cuda.synchronize()`.

`--dispatch sync` sets jax's `jax_cpu_enable_async_dispatch=False` before the backend starts:
each jax call then runs in the calling thread instead of being handed to jax's dispatch
thread and waited for. On this project's 2-core VMs that hand-off costs ~40-50 us per
standalone call (a 0.1 ms logsumexp, or a 6 us `jnp.sum` of 8192 floats, pays it in full);
the option shows the ops' time without it. It is jax's runtime setting, applies to every jax
function in the table (jax.nn.logsumexp included), and only to CPU.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from jaxport.ops import logsumexp, rank, topk_mask  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _argtypes import positive_int, rows_x_cols, usable_cores  # noqa: E402

SHAPES = [(32, 8732), (256, 8732), (1024, 32768)]
OPS = ("rank", "topk_mask", "logsumexp")


def _median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn` in ms, after a warm-up call.

    Sub-millisecond calls are repeated until about 0.3 s has been timed (at most 1000 calls): a
    median of 5 calls of 0.1 ms swung by +-40% between runs. Multi-second calls get 3 runs.
    Both are judged by a call after the warm-up: the warm-up's time includes jit's compile,
    and a fast op that compiled for over 2 s was cut to 3 timed calls.
    """
    fn()  # warm-up (compiles jax functions)
    t0 = time.perf_counter()
    fn()
    second = time.perf_counter() - t0
    if second > 2.0:
        repeats = min(repeats, 3)
    else:
        repeats = max(repeats, min(1000, int(0.3 / max(second, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _torch_ms(fn, repeats: int, threads: int, device: str = "cpu") -> float:
    """The faster of torch with `threads` threads and with 1 thread (see the module doc).

    On CUDA, the time until the GPU has finished (threads do not matter there).
    """
    if device == "cuda":
        def synced():
            fn()
            torch.cuda.synchronize()
        return _median_ms(synced, repeats)
    best = float("inf")
    for n in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n)
        best = min(best, _median_ms(fn, repeats))
    torch.set_num_threads(threads)
    return best


def _jax(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


def memory_bandwidth_gbs(repeats: int) -> float:
    """Read bandwidth: a jit-compiled sum over a 512 MiB float32 array (much larger than cache)."""
    x = jnp.ones((1 << 27,), jnp.float32)
    total = jax.jit(jnp.sum)
    ms = _median_ms(_jax(total, x), repeats)
    return x.nbytes / (ms * 1e-3) / 1e9


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--quick", action="store_true", help="only the smallest shape")
    parser.add_argument("--shapes", nargs="+", type=rows_x_cols, default=None, metavar="ROWSxCOLS",
                        help="other shapes than the issue's three, e.g. 4x64 (the smoke test's)")
    parser.add_argument("--torch-device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cuda when jax runs on a GPU and torch sees one, else cpu")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, help="which ops to time")
    parser.add_argument("--dispatch", default="async", choices=["async", "sync"],
                        help="jax CPU dispatch: async (jax's default) or sync (see the module doc)")
    args = parser.parse_args()
    # Read when the CPU backend is created, so before the first jax.devices() below.
    jax.config.update("jax_cpu_enable_async_dispatch", args.dispatch == "async")
    tdev = args.torch_device
    if tdev == "auto":
        tdev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    if tdev == "cuda" and not torch.cuda.is_available():
        parser.error("--torch-device cuda: this torch sees no CUDA device; use --torch-device cpu")
    threads = usable_cores()
    torch.set_num_threads(threads)
    dev = jax.devices()[0]
    bw = memory_bandwidth_gbs(args.repeats)
    where = cpu_model() if dev.platform == "cpu" else dev.device_kind
    print(f"# jax {jax.__version__} on {dev.platform} ({where}), torch {torch.__version__}, "
          f"torch on {tdev}" + (f" ({torch.cuda.get_device_name()})" if tdev == "cuda" else "") + ", "
          + (f"threads: xla={threads}, torch=best of {{{threads}, 1}}, " if tdev == "cpu" else "")
          + f"median of >= {args.repeats} calls "
          f"(sub-ms calls: ~0.3 s of calls), jax dispatch: {args.dispatch}")
    print(f"# measured memory read bandwidth: {bw:.1f} GB/s (jit sum over 512 MiB float32); "
          f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"| {'op':<26} | {'shape':<13} | {'time ms':>9} | {'vs torch dbl sort':>17} | "
          f"{'vs jax.nn.lse':>13} | {'vs torch.lse':>12} | {'GB/s':>6} |")
    print("|" + "|".join("-" * w for w in (28, 15, 11, 19, 15, 14, 8)) + "|")

    def row(op, shape, ms, vs_sort="", vs_jlse="", vs_tlse="", gbs=""):
        print(f"| {op:<26} | {str(shape):<13} | {ms:>9.2f} | {vs_sort:>17} | {vs_jlse:>13} | "
              f"{vs_tlse:>12} | {gbs:>6} |", flush=True)

    rng = np.random.default_rng(0)
    shapes = args.shapes or SHAPES
    for shape in shapes[:1] if args.quick else shapes:
        xn = rng.standard_normal(shape).astype(np.float32)
        kn = rng.integers(0, shape[1] // 4, shape[0]).astype(np.int32)
        xt, kt = torch.from_numpy(xn).to(tdev), torch.from_numpy(kn)[:, None].to(tdev)
        x, k = jnp.asarray(xn), jnp.asarray(kn)

        if "rank" in args.ops:
            t_dbl = _torch_ms(lambda: xt.sort(dim=-1, stable=True).indices.argsort(dim=-1), args.repeats, threads, tdev)
            row("torch double sort (rank)", shape, t_dbl, "1.00x")
        if "topk_mask" in args.ops:
            t_dbl_topk = _torch_ms(lambda: xt.sort(dim=-1, descending=True, stable=True).indices.argsort(dim=-1) < kt,
                                   args.repeats, threads, tdev)
            row("torch double sort < k", shape, t_dbl_topk, "1.00x")
        if "rank" in args.ops:
            naive = jax.jit(lambda x: jnp.argsort(jnp.argsort(x, axis=-1, stable=True), axis=-1, stable=True))
            t = _median_ms(_jax(naive, x), args.repeats)
            row("jnp.argsort(jnp.argsort)", shape, t, f"{t_dbl / t:.2f}x")
            for name, fn in [("rank", jax.jit(rank)),
                             ("rank[xla]", jax.jit(lambda x: rank(x, method="xla")))]:
                t = _median_ms(_jax(fn, x), args.repeats)
                row(name, shape, t, f"{t_dbl / t:.2f}x")
        if "topk_mask" in args.ops:
            for name, fn in [("topk_mask (per-row k)", jax.jit(topk_mask)),
                             ("topk_mask[xla] (per-row k)", jax.jit(lambda x, k: topk_mask(x, k, method="xla")))]:
                t = _median_ms(_jax(fn, x, k), args.repeats)
                row(name, shape, t, f"{t_dbl_topk / t:.2f}x")
        if "logsumexp" in args.ops:
            t_tlse = _torch_ms(lambda: torch.logsumexp(xt, dim=-1), args.repeats, threads, tdev)
            t_jlse = _median_ms(_jax(jax.jit(lambda x: jax.nn.logsumexp(x, axis=-1)), x), args.repeats)
            t = _median_ms(_jax(jax.jit(lambda x: logsumexp(x, axis=-1)), x), args.repeats)
            gbs = lambda ms: f"{xn.nbytes / (ms * 1e-3) / 1e9:.2f}"  # noqa: E731
            row("torch.logsumexp", shape, t_tlse, "", f"{t_jlse / t_tlse:.2f}x", "1.00x", gbs(t_tlse))
            row("jax.nn.logsumexp", shape, t_jlse, "", "1.00x", f"{t_tlse / t_jlse:.2f}x", gbs(t_jlse))
            row("logsumexp", shape, t, "", f"{t_jlse / t:.2f}x", f"{t_tlse / t:.2f}x", gbs(t))


if __name__ == "__main__":
    main()
