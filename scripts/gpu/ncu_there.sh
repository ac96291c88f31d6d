#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: every kernel of about one
# gpt_bench step (GPT-2 124M, bf16-mixed, micro-batch $B) under Nsight Compute, one metric (the
# kernel's duration), then the kernels by total time (names shortened) and by op family.
# (env: B, SKIP launches skipped first, COUNT launches profiled, ARGS extra gpt_bench args)
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
timeout 500 "$NCU" --target-processes all --metrics gpu__time_duration.sum --csv \
  --launch-skip "${SKIP:-3000}" --launch-count "${COUNT:-900}" \
  bin/oflaunch --nproc-per-node 1 --backend nccl bin/gpt_bench --precision bf16-mixed \
  --micro-batch "${B:-8}" --warmup 4 --steps 2 ${ARGS:-} > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu exit code: $?"
tail -3 "$OUT/ncu.err"
python3 ncu_table.py "$OUT/ncu.csv"
