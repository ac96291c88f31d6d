#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh (bin/oflaunch, bin/gpt_bench,
# gpt2_bench.py): the GPT-2 shapes of $SHAPES ("124m:8 124m:16 124m:32 350m:8 350m:16
# 1.5b:8", size:micro-batch) on one GPU, ours in each of $MODES ("eager", "compile":
# `gpt_bench` [--compile], bf16-mixed, AdamW, clipping) beside torch.compile (`gpt2_bench.py
# --compile`) in the same command, each run's process peak sampled by nvidia-smi (sampled.sh:
# what an out-of-memory error sees). One table per shape last (median_table.py): speed and
# process memory against torch.compile.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/memory}
STEPS=${STEPS:-10}
SHAPES=${SHAPES:-"124m:8 124m:16 124m:32 350m:8 350m:16 1.5b:8"}
MODES=${MODES:-eager}
mkdir -p "$OUT"
nvidia-smi -L
. ./sampled.sh
# layers, heads, width of each GPT-2 size.
size_of() {
  case $1 in
    124m) echo "12 12 768" ;;
    350m) echo "24 16 1024" ;;
    774m) echo "36 20 1280" ;;
    1.5b) echo "48 25 1600" ;;
    *) echo "unknown size $1" >&2; return 1 ;;
  esac
}
for s in $SHAPES; do
  size=${s%%:*} mb=${s##*:}
  read -r l h w < <(size_of "$size") || continue
  for mode in $MODES; do
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    sampled "$OUT/ours-$mode-$s.log" timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl \
      bin/gpt_bench --layers "$l" --heads "$h" --width "$w" --micro-batch "$mb" \
      --precision bf16-mixed --warmup 3 --steps "$STEPS" "${flag[@]}" --tag "oxiflow-$mode-$s"
  done
  sampled "$OUT/torch-$s.log" timeout 400 python3 gpt2_bench.py --n-layer "$l" --n-head "$h" \
    --n-embd "$w" --micro-batch "$mb" --warmup 3 --steps "$STEPS" --compile \
    --tag "torch-compile-$s"
done
for s in $SHAPES; do
  echo "GPT-2 $s"
  python3 median_table.py "$OUT" "torch-compile-$s" $(printf "oxiflow-%s-$s " $MODES) \
    "torch-compile-$s"
done
