#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: where one GPT-2 124M step
# (bf16-mixed, micro-batch $B, default 8) spends its GPU time, ours beside PyTorch's.
#   ours: `gpt_bench` traced (`oflaunch --trace`), summarised by trace_breakdown.py (the
#         compute stream's busy and idle time, ops by total time, the longest idle gaps)
#   torch: torch_kernel_profile.py eager and --compile (torch.profiler: busy time, kernels)
# Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/profile}
B=${B:-8}
mkdir -p "$OUT"
rm -rf "$OUT/trace"
timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl --trace "$OUT/trace" bin/gpt_bench \
  --precision bf16-mixed --micro-batch "$B" --warmup 2 --steps 3 --tag traced > "$OUT/traced.log" 2>&1
echo "traced exit code: $?"
grep RESULT "$OUT/traced.log" | cut -c1-200
python3 trace_breakdown.py "$OUT/trace/trace.json" --rank 0 --top 30 --gaps 15 || tail -5 "$OUT/traced.log"
rm -rf "$OUT/trace"
for c in "" --compile; do
  timeout 300 python3 torch_kernel_profile.py $c --micro-batch "$B" --top 30 > "$OUT/torch$c.log" 2>&1
  echo "torch_kernel_profile $c exit code: $?"
  cat "$OUT/torch$c.log" | grep -v Warning | tail -32
done
