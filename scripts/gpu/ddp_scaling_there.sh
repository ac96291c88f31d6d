#!/usr/bin/env bash
# Runs on a 2-GPU machine from a folder holding bin/ and gpt2_bench.py: DP2 scaling at GPT-2
# 124M micro-batch 8 per GPU, torch (eager and torch.compile; DDP under torchrun) beside ours
# (gpt_bench --dp 2, 25 MiB buckets), each one GPU then two. Logs under $OUT; prints each
# run's RESULT line.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/ddp}
mkdir -p "$OUT"
STEPS=${STEPS:-30}
for c in "" --compile; do
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 gpt2_bench.py --micro-batch 8 --steps "$STEPS" $c \
    --tag "torch1$c" > "$OUT/torch1$c.log" 2>&1
  timeout 300 torchrun --standalone --nproc-per-node 2 gpt2_bench.py --micro-batch 8 \
    --steps "$STEPS" $c --tag "torch2$c" > "$OUT/torch2$c.log" 2>&1
done
for n in 1 2; do
  timeout 300 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/gpt_bench --dp "$n" \
    --precision bf16-mixed --micro-batch 8 --warmup 3 --steps "$STEPS" --bucket-mb 25 \
    --tag "ours$n" > "$OUT/ours$n.log" 2>&1
done
for f in "$OUT"/*.log; do
  echo "== $(basename "$f")"
  grep -h "RESULT" "$f" | head -1 | cut -c1-300
done
