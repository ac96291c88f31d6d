#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: the compiled step on one GPU.
#   SUITE=1  tests/gpu_compile.rs (compiled = eager, f32, 12 steps; replays as one CUDA graph)
#   then interleaved_there.sh for the micro-batches of $SIZES (default "8"): gpt_bench eager
#   and --compile beside gpt2_bench.py --compile, $ROUNDS rounds (default 2), a table of
#   medians last (ratios from this command).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/compiled}
mkdir -p "$OUT"
if [ "${SUITE:-1}" = 1 ]; then
  OXIFLOW_TEST_BINS=bin timeout 400 bin/gpu_compile --nocapture > "$OUT/gpu_compile.log" 2>&1
  echo "gpu_compile exit code: $?"
  grep -E "gpu_compile:|test result|panicked" "$OUT/gpu_compile.log" | cut -c1-400 | tail -12
fi
SIZES=${SIZES:-8} ROUNDS=${ROUNDS:-2} OUT="$OUT/timing" ./interleaved_there.sh
