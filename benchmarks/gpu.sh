#!/usr/bin/env bash
# The GPU rows of issues 2, 3 and 4 in one prepared run, for a lent H100/H200 (the `device`
# tool's `run`, whose device time is scarce: ~15 min a task, start-up included).
#
#   bash benchmarks/gpu.sh            # on the GPU machine, in the repository root
#
# It uses the machine's own python3 (its image has jax, flax, optax, orbax, torch, torchvision:
# nothing is installed) and writes one log per benchmark under $OUT (or /tmp/gpu-bench). Each
# step has its own time limit, so one hang cannot eat the whole lease: they add up to 580 s
# before the last (accumulation) step, 640 s with it (torch.compile's compiles are most of it).
# Budget the call with timeout_s=600 and give the machine back after. On an H200 (2026-11-30,
# 23:37 UTC) it took 247 s after a start-up of about 30 s; figures in benchmarks/README.md. The
# steps run in order of what is least known: the training rows first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-bench}
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# jax and torch share the GPU in one process: jax must not take 75% of it up front.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
py=${PYTHON:-python3}

failed=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ "$rc" = 0 ] || failed+=("$name (exit $rc)")
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.log"
# Without a GPU every step below would run on the CPU until its limit (390 s of the budget).
backend=$("$py" -c "import jax; print(jax.default_backend())" 2>&1 | tail -1)
if [ "$backend" != gpu ]; then
  echo "gpu.sh: jax's default backend is '$backend', not gpu: nothing measured" | tee -a "$out/gpu.log" >&2
  exit 1
fi
step env 30 "$py" -m jaxport env
# The training runs' workdirs are new each time: a rerun on a warm machine was refused by
# `jaxport train` (the last run's files were there) and copied that run's metrics as new ones.
work=$(mktemp -d /tmp/gpu-train.XXXXXX)
# Issue 4: bf16 training step, batch 256 at 224 px; goal >= 3,000 img/s on one H100. jax's figure
# is printed before torch's eager and compiled runs.
step train 180 "$py" benchmarks/bench_train.py --gpu --configs 256x224 --steps 20 --warmup 2 \
  --out "$out/train.json"
# Issue 4 end to end: the CLI's default digits run in bf16 (0.969 held-out on an H200, 0.964 on
# the CPU in float32), then --batch-size auto's memory prediction for a few steps.
step train-cli 120 "$py" -m jaxport train --workdir "$work/cli" --dtype bfloat16 --no-progress
cp "$work/cli/metrics.jsonl" "$out/train-cli-metrics.jsonl" 2>/dev/null
step train-auto 90 "$py" -m jaxport train --workdir "$work/auto" --dtype bfloat16 --batch-size auto \
  --max-steps 3 --no-progress
rm -rf "$work"
# Issue 2: bf16 inference against torch eager and torch.compile (channels_last). Only the plain
# jax variant: each jit compile autotunes cuDNN's convolutions, and the folded variant would
# double those compiles inside this step's limit. 43-73 s on an H200.
step inference 100 "$py" benchmarks/bench_inference.py --device cuda --dtype bfloat16 \
  --batch 8 32 256 --repeats 20 20 10 --variants jax
# Issue 3: the ops table, jax on the GPU against torch on CUDA. 20-27 s on an H200.
step ops 60 "$py" benchmarks/bench_ops.py --torch-device cuda
# Gradient accumulation's scanned passes (the form every platform but XLA:CPU runs, never timed
# on a GPU yet): the same batch in 4 passes of 64, jax alone. Last, since its 60 s go beyond the
# 580 s the steps above may take (they took 247 s on the H200).
step train-accum 60 "$py" benchmarks/bench_train.py --gpu --configs 256x224 --accum-steps 4 --steps 10 \
  --warmup 2 --skip-torch --out "$out/train-accum.json"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu.sh: failed: ${failed[*]}" >&2
  exit 1
fi
