#!/usr/bin/env bash
# GPU benchmark in one call (under 8 minutes on one H100/H200): Llama ~1B (Llama 3.2 1B's
# shape) and GPT-2 350M / 774M at sequence 2048 in bf16 (fp32 master parameters and AdamW),
# the batch swept up to the largest that fits; MFU (PaLM's 6N + 12LTD model flops over the
# chip's bf16 peak), tokens/s, compiled memory, px.train_step / a hand-written jax.jit step,
# and the attention kernel the compiled program runs (the check that cuDNN's fused kernel is
# the one running); then Llama ~1B's bf16 step against the same step under px.Float8(),
# alternating in one run (both MFUs over the bf16 peak, and the time ratio). Rows appended
# to benchmarks/RESULTS.md (date, versions, device).
#
#   benchmarks/gpu.sh                  # on a GPU machine
#   benchmarks/gpu.sh --tiny           # anywhere (CPU: tiny GPT and Llama; what the tests run)
#   benchmarks/gpu.sh --models llama_1b --remat dots --results /tmp/RESULTS.md
#
# The checkout is used in place (PYTHONPATH); nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
args=()
for arg in "$@"; do
  if [[ "$arg" == "--tiny" ]]; then
    args+=(--models gpt_tiny,llama_tiny --max-batch 2 --steps 2 --warmup 1 --budget 300 --explain
           --float8 llama_tiny
           --comm-max-bytes 4K --comm-ops all_reduce)
  else
    args+=("$arg")
  fi
done
exec timeout "${PARALLAX_GPU_BENCH_TIMEOUT:-470}" "$PYTHON" benchmarks/gpu.py "${args[@]}"
