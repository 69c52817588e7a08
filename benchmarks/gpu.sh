#!/usr/bin/env bash
# GPU benchmark in one call (under 8 minutes on one H100/H200): MFU of GPT gpt2_124m and
# gpt2_350m in bf16 through px.train_step and a hand-written jax.jit step, px.explain's
# predicted step time against the measured one, and `parallax bench comm` on the devices
# present; rows appended to benchmarks/RESULTS.md (date, versions, device).
#
#   benchmarks/gpu.sh                  # on a GPU machine
#   benchmarks/gpu.sh --tiny           # anywhere (CPU: GPT tiny, a few steps; what the tests run)
#   benchmarks/gpu.sh --results /tmp/RESULTS.md --steps 20
#
# The checkout is used in place (PYTHONPATH); nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
args=()
for arg in "$@"; do
  if [[ "$arg" == "--tiny" ]]; then
    args+=(--models tiny --steps 2 --warmup 1 --comm-max-bytes 4K --comm-ops all_reduce)
  else
    args+=("$arg")
  fi
done
exec timeout "${PARALLAX_GPU_BENCH_TIMEOUT:-470}" "$PYTHON" benchmarks/gpu.py "${args[@]}"
