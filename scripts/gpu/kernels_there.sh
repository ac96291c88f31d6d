#!/usr/bin/env bash
# Runs on the GPU machine from a folder holding gpu_kernels_check and attention_anchor.py:
# where cuDNN lives, the kernel checks and timings, then torch's cuDNN SDPA at the same shape.
# Logs under $OUT; the tables last.
set -uo pipefail
cd "$(dirname "$0")"
. ./device_env.sh
device_cuda_env
device_out kernels
nvidia-smi -L | tee "$OUT/gpu.txt"
find / -xdev \( -name 'libcudnn.so*' -o -name 'libcudnn_graph.so*' \) 2>/dev/null | head -20 | tee "$OUT/cudnn.txt"
timeout ${CHECK_TIMEOUT:-200} ./gpu_kernels_check ${CHECK_ARGS:-} > "$OUT/check.log" 2>&1
echo "gpu_kernels_check exit code: $?" | tee -a "$OUT/check.log"
grep -E "^(check|note|ceiling)" "$OUT/check.log" | grep -v " PASS" | head -60
timeout ${ANCHOR_TIMEOUT:-90} python3 attention_anchor.py > "$OUT/anchor.log" 2>&1
echo "attention_anchor exit code: $?" >> "$OUT/anchor.log"
sed -n '/^| check/,$p' "$OUT/check.log" | grep -v "| pass |" 
cat "$OUT/anchor.log" | tail -12
