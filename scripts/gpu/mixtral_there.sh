#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh (bin/oflaunch, bin/gpt_bench,
# mixtral_bench.py, llama_bench.py): a Mixtral-shaped model (16 layers, width 1024, 16 heads,
# 8 KV heads, 8 SwiGLU experts of FFN 3584 routed top-2, vocabulary 32000, untied, seq 2048,
# micro-batch $MB (4), bf16-mixed, AdamW, clipping at 1.0) on one GPU: ours (`gpt_bench --arch
# llama --experts 8`, eager) beside transformers' MixtralForCausalLM in $TORCH_MODES (eager and
# compile),
# $ROUNDS rounds (default 1). Process peaks by nvidia-smi (sampled.sh). Logs under $OUT; a table
# of medians last (median_table.py).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/mixtral}
MB=${MB:-4}
STEPS=${STEPS:-10}
ROUNDS=${ROUNDS:-1}
TORCH_MODES=${TORCH_MODES:-eager compile}
mkdir -p "$OUT"
nvidia-smi -L
. ./sampled.sh
for r in $(seq "$ROUNDS"); do
  sampled "$OUT/ours-eager-$r.log" timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl \
    bin/gpt_bench --arch llama --layers 16 --width 1024 --heads 16 --kv-heads 8 \
    --ffn-width 3584 --experts 8 --top-k 2 --vocab 32000 --seq 2048 --micro-batch "$MB" \
    --warmup 4 --steps "$STEPS" --precision bf16-mixed --tag oxiflow-eager
  for mode in $TORCH_MODES; do
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    sampled "$OUT/torch-$mode-$r.log" timeout 400 python3 mixtral_bench.py --micro-batch "$MB" \
      --steps "$STEPS" "${flag[@]}" --tag "torch-$mode"
  done
done
python3 median_table.py "$OUT" torch-compile oxiflow-eager torch-eager torch-compile
