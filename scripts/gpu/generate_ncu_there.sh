#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: the kernels of Llama-1B-shaped
# decoding steps (batch $B, greedy, launch by launch: OXIFLOW_CUDA_GRAPH=0, the graph's own
# kernels) under Nsight Compute, one metric (each kernel's duration), $COUNT launches after the
# first $SKIP; then the kernels by total time, per decoding step (the arg-max kernels counted as
# steps).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} OXIFLOW_CUDA_GRAPH=0
OUT=${OUT:-/tmp/genncu}; mkdir -p "$OUT"
MODEL=/tmp/llama1b-hf
[ -e "$MODEL/config.json" ] || python3 llama1b_hf.py "$MODEL"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
prompts=$(python3 -c "
import random; random.seed(1)
print(';'.join(','.join(str(random.randrange(1, 128000)) for _ in range(128)) for _ in range(${B:-1})))")
timeout 400 "$NCU" --target-processes all \
  --metrics gpu__time_duration.sum --csv --launch-skip "${SKIP:-2500}" --launch-count "${COUNT:-900}" \
  bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --from-hf "$MODEL" \
  --prompt-ids "$prompts" --temperature 0 --gen-tokens "${NEW:-40}" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "batch ${B:-1}: ncu exit code $?"
python3 ncu_table.py "$OUT/ncu.csv" --per argmax --top 22
