#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh (bin/oflaunch, bin/gpt_bench,
# llama_bench.py): the Llama-3.2-1B shape (16 layers, width 2048, 32 heads, 8 KV heads, FFN
# 8192, vocabulary 128256, tied, rope theta 500000, seq 2048, micro-batch $MB (4), bf16-mixed,
# AdamW, clipping at 1.0) on one GPU: ours (`gpt_bench --arch llama`, eager and --compile)
# beside llama_bench.py in $TORCH_MODES (eager and compile), $ROUNDS rounds (default 1)
# interleaved. Each run's
# peak device memory as nvidia-smi sees it (what an out-of-memory error sees: the GPU's used
# memory sampled every 100 ms, only that process running) beside the program's own count.
# A last run of ours eager with every block cached by size (--driver-reuse-mib 0). Logs under
# $OUT; a table of medians last (median_table.py).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
. ./device_env.sh
device_bench llama
DIMS=(--layers 16 --width 2048 --heads 32)
for r in $(seq "$ROUNDS"); do
  for mode in eager compile; do
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    sampled "$OUT/ours-$mode-$r.log" timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl \
      bin/gpt_bench --arch llama "${DIMS[@]}" --kv-heads 8 --ffn-width 8192 --vocab 128256 \
      --tie-embeddings --seq 2048 --micro-batch "$MB" --warmup 4 --steps "$STEPS" \
      --precision bf16-mixed "${flag[@]}" --tag "oxiflow-$mode"
    [[ " $TORCH_MODES " == *" $mode "* ]] || continue
    sampled "$OUT/torch-$mode-$r.log" timeout 400 python3 llama_bench.py --micro-batch "$MB" \
      --steps "$STEPS" "${flag[@]}" --tag "torch-$mode"
  done
  # The allocator caching every block by size (as before blocks of 4 MiB and more went back to
  # the driver's stream-ordered pool).
  sampled "$OUT/ours-eager-bucketed-$r.log" timeout 300 bin/oflaunch --nproc-per-node 1 \
    --backend nccl bin/gpt_bench --arch llama "${DIMS[@]}" --kv-heads 8 --ffn-width 8192 \
    --vocab 128256 --tie-embeddings --seq 2048 --micro-batch "$MB" --warmup 4 --steps "$STEPS" \
    --precision bf16-mixed --driver-reuse-mib 0 --tag oxiflow-eager-bucketed-pool
done
python3 median_table.py "$OUT" torch-compile oxiflow-eager oxiflow-eager-bucketed-pool \
  oxiflow-compile torch-eager torch-compile
