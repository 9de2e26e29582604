"""Port cost against `torch.load`, measured in the same run: time, peak memory, read-back.

For each architecture a calibrated torchvision model (`reference_model`) is saved with
`torch.save(model.state_dict(), path)` into a temporary directory, and ported once with
`jaxport.save_variables`. Then, interleaving the cases in every repeat (the order alternates)
and taking medians, it times:

- `torch.load(path, weights_only=True)`: the reference;
- load + convert: `load_state_dict(path, mmap=True)` + `torch_to_flax(sd, arch)`;
- read back: `jaxport.load_variables(out)`, lazily (memory maps, nothing read), with every
  page touched (one byte per 4 KiB page, so the whole file is resident), and summed (every
  array reduced, compared with `torch.load` + the same sums).

Peak memory runs each case in a fresh subprocess: after the imports, the kernel's peak-RSS
mark is reset (`echo 5 > /proc/self/clear_refs`), the case runs, and `VmHWM - VmRSS(before)` is
the peak it added. RSS counts the file pages the process maps and touches (mmap) as well as
the copies it makes, so this is the conservative figure; `RssAnon`/`RssFile` after the case
show the split. Everything reads from a warm page cache (the file was just written).

Usage: PYTHONPATH=. python benchmarks/bench_port.py [--archs resnet50 resnet152] [--repeats 7]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import jaxport
import torch_compat
from jaxport.models import ARCHS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # as when run as a script
from _argtypes import positive_int, usable_cores  # noqa: E402

GOALS = {"port": 1.5, "peak": 2.5, "read": 0.3}
PAGE = 4096


def _status() -> dict[str, int]:
    """kB figures from /proc/self/status."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0])
    return out


def _touch(variables) -> int:
    """Read one byte of every page of every array: makes a memory-mapped file resident."""
    n = 0
    for a in jaxport._io.flatten(variables).values():
        b = np.asarray(a).reshape(-1).view(np.uint8)
        n += int(b[::PAGE].sum())
    return n


def _sum_all(arrays) -> float:
    """Reduce every array with numpy (torch tensors viewed as numpy), so both sides sum alike."""
    return float(sum(float(np.asarray(a).sum()) for a in arrays))


# --- the cases, shared by the timing loop and the memory subprocesses ---------------------------

def case_torch_load(pth: str, arch: str, out: str):
    return torch.load(pth, map_location="cpu", weights_only=True)


def case_port(pth: str, arch: str, out: str):
    sd = torch_compat.load_state_dict(pth, mmap=True)
    return torch_compat.torch_to_flax(sd, arch)


def case_read_lazy(pth: str, arch: str, out: str):
    return jaxport.load_variables(out)


def case_read_touched(pth: str, arch: str, out: str):
    v = jaxport.load_variables(out)
    _touch(v)
    return v


def case_read_summed(pth: str, arch: str, out: str):
    v = jaxport.load_variables(out)
    _sum_all(jaxport._io.flatten(v).values())
    return v


def case_torch_load_summed(pth: str, arch: str, out: str):
    sd = torch.load(pth, map_location="cpu", weights_only=True)
    _sum_all(t.numpy() for t in sd.values())
    return sd


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def _memory_child(case: str, pth: str, arch: str, out: str) -> None:
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status()
    result = CASES[case](pth, arch, out)
    after = _status()
    print(json.dumps({"peak_kb": after["VmHWM"] - before["VmRSS"],
                      "anon_kb": after.get("RssAnon", 0) - before.get("RssAnon", 0),
                      "file_kb": after.get("RssFile", 0) - before.get("RssFile", 0)}))
    del result


def _peak(case: str, pth: str, arch: str, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, __file__, "--_child", case, pth, arch, out],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- driver -----------------------------------------------------------------------------------

def _time(fn, *args) -> float:
    gc.collect()
    t = time.perf_counter()
    result = fn(*args)
    dt = time.perf_counter() - t
    del result
    return dt


def bench(arch: str, tmp: Path, repeats: int) -> dict:
    model = torch_compat.reference_model(arch, image_size=32, calibration_batches=1, batch_size=2)
    pth, out = str(tmp / f"{arch}.pth"), str(tmp / f"{arch}.safetensors")
    torch.save(model.state_dict(), pth)
    del model
    jaxport.save_variables(out, case_port(pth, arch, out), arch=arch)
    size = os.path.getsize(pth)
    args = (pth, arch, out)
    order = ["torch_load", "port", "read_lazy", "read_touched", "read_summed", "torch_load_summed"]
    for name in order:  # warm-up: page cache, imports, allocator
        _time(CASES[name], *args)
    times: dict[str, list[float]] = {name: [] for name in order}
    for r in range(repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            times[name].append(_time(CASES[name], *args))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    peaks = {name: _peak(name, *args) for name in ("torch_load", "port", "read_lazy", "read_touched")}
    return {"arch": arch, "size_mb": size / 2**20, "med_s": med, "peaks": peaks}


def report(res: dict) -> list[str]:
    m, ref, size_kb = res["med_s"], res["med_s"]["torch_load"], res["size_mb"] * 1024
    lines = [f"{res['arch']}: checkpoint {res['size_mb']:.1f} MiB; torch.load(weights_only=True) "
             f"{ref * 1e3:.1f} ms (median)"]

    def row(label, t, base=ref, goal=None):
        mark = "" if goal is None else f"  goal <= {goal}x: {'met' if t / base <= goal else 'MISSED'}"
        lines.append(f"  {label:<42} {t * 1e3:8.1f} ms  {t / base:6.2f}x{mark}")

    row("load_state_dict(mmap=True) + torch_to_flax", m["port"], goal=GOALS["port"])
    row("load_variables (lazy)", m["read_lazy"], goal=GOALS["read"])
    row("load_variables + touch every page", m["read_touched"], goal=GOALS["read"])
    row("load_variables + sum every array", m["read_summed"], base=m["torch_load_summed"])
    lines.append(f"    (vs torch.load + sum every tensor: {m['torch_load_summed'] * 1e3:.1f} ms)")
    lines.append("  peak RSS added (fresh process; anon / file-backed resident after):")
    for name, p in res["peaks"].items():
        goal = f"  goal <= {GOALS['peak']}x: {'met' if p['peak_kb'] / size_kb <= GOALS['peak'] else 'MISSED'}" \
            if name == "port" else ""
        lines.append(f"  {name:<42} {p['peak_kb'] / 1024:8.1f} MiB  {p['peak_kb'] / size_kb:6.2f}x size"
                     f"  ({p['anon_kb'] / 1024:.0f} / {p['file_kb'] / 1024:.0f} MiB){goal}")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["resnet50", "resnet152"], choices=ARCHS, metavar="ARCH")
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--_child", nargs=4, metavar=("CASE", "PTH", "ARCH", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        return _memory_child(*a._child)
    torch.set_num_threads(usable_cores())
    print(f"torch {torch.__version__}, numpy {np.__version__}, {usable_cores()} CPUs, repeats={a.repeats}")
    with tempfile.TemporaryDirectory(prefix="jaxport-bench-") as tmp:
        for arch in a.archs:
            t = time.perf_counter()
            res = bench(arch, Path(tmp), a.repeats)
            print("\n".join(report(res)) + f"\n  ({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
