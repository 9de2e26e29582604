"""The benchmark scripts still run against the code they measure.

Nothing here times anything or checks a ratio (the figures live in benchmarks/README.md): each
script runs at a smoke size, in a subprocess, and must print the rows its README section
quotes. Without this a change to the library could break a script unnoticed until the next
measuring session.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GLIBC = platform.libc_ver()[0] == "glibc"

CASES = {
    "bench_ops.py": (["--shapes", "4x64", "--repeats", "1"],
                     ["| rank  ", "| topk_mask (per-row k)", "| logsumexp  ", "vs torch dbl sort"]),
    "bench_port.py": (["--archs", "resnet18", "--repeats", "1"],
                      ["load_state_dict(mmap=True) + torch_to_flax", "goal <= 1.5x: ", "goal <= 2.5x: "]),
    "bench_inference.py": (["--batch", "1", "--repeats", "1", "--size", "32", "--torch-threads", "1"],
                           ["torch eager (1 thr)", "x-same", "jax-folded"]),
    # in 2 passes of 2 (jax's accumulating step, and torch's loop over chunks); with glibc, run
    # again by itself under the allocator settings of --malloc keep
    "bench_train.py": (["--arch", "resnet18", "--classes", "10", "--configs", "4x32", "--accum-steps", "2", "--steps",
                        "1", "--warmup", "1", "--threads", "1", *(["--malloc", "keep"] if GLIBC else [])],
                       ['"accum_steps": 2', '"speedup_vs_eager": ', '"torch_faults_per_step": ',
                        '"malloc": "keep"' if GLIBC else '"malloc": "system"']),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_at_smoke_size(tmp_path, script):
    args, rows = CASES[script]
    # One device: the training benchmark takes every device jax sees, and the suite's 8
    # simulated ones would split its batch of 2. TMPDIR: what a script leaves behind shows.
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_NUM_CPU_DEVICES": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    missing = [row for row in rows if row not in proc.stdout]
    assert not missing, f"{script} printed none of {missing}:\n{proc.stdout[-3000:]}"
    # (torch makes its inductor cache directory there on its own)
    assert [n for n in os.listdir(tmp_path) if not n.startswith("torchinductor_")] == [], "left in TMPDIR"


@pytest.mark.parametrize("script, args, said", [
    ("bench_train.py", ["--warmup", "0"], "argument --warmup: expected a whole number >= 1, got 0"),
    ("bench_train.py", ["--configs", "16"], "argument --configs: expected BATCHxSIZE such as 16x128, got '16'"),
    ("bench_train.py", ["--gpu"], "--gpu: jax runs on cpu, not a GPU"),
    ("bench_train.py", ["--configs", "16x128", "--accum-steps", "3"],
     "--accum-steps 3 must divide every --configs batch (got 16)"),
    ("bench_inference.py", ["--variants", "jax-fold"], "argument --variants: invalid choice: 'jax-fold'"),
    ("bench_inference.py", ["--device", "cuda"], "--device cuda: torch sees no CUDA device and jax runs on cpu"),
    ("bench_port.py", ["--repeats", "0"], "argument --repeats: expected a whole number >= 1, got 0"),
    ("bench_ops.py", ["--shapes", "4x3"], "argument --shapes: expected ROWSxCOLS with ROWS >= 1 and COLS >= 4"),
])
def test_a_bad_option_is_a_usage_error_before_any_work(tmp_path, script, args, said):
    """Counts of 0 and malformed shapes were tracebacks (`StatisticsError: no median for empty
    data`, `UnboundLocalError`, `high <= 0`), most after minutes of building and compiling; an
    unknown --variants name timed nothing and exited 0; --gpu without a GPU timed the CPU."""
    if "cuda" in args and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout == "", proc.stdout
