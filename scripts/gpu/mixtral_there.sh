#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh (bin/oflaunch, bin/gpt_bench,
# mixtral_bench.py, llama_bench.py): a Mixtral-shaped model (16 layers, width 1024, 16 heads,
# 8 KV heads, 8 SwiGLU experts of FFN 3584 routed top-2, vocabulary 32000, untied, seq 2048,
# micro-batch $MB (4), bf16-mixed, AdamW, clipping at 1.0) on one GPU: ours (`gpt_bench --arch
# llama --experts 8`, eager) beside transformers' MixtralForCausalLM in $TORCH_MODES (eager and
# compile),
# $ROUNDS rounds (default 1). Process peaks by nvidia-smi (sampled.sh). Logs under $OUT; a table
# of medians last (median_table.py). With PROFILE=1, first ours alone under `oflaunch --trace`
# with `gpt_bench --profile 2`: the device time of each op (a sync around each) and, from the
# timeline, the compute stream's busy share of a step, its top kernels and its longest gaps.
# With GPUS=2: two GPUs, ours in each of $LAYOUTS ("ep2": --dp 2 --ep 2, the experts split;
# "dp2": --dp 2, every expert on both) beside transformers' Mixtral under torchrun with
# DistributedDataParallel (the same global batch: $MB sequences a GPU); memory is GPU 0's.
set -uo pipefail
cd "$(dirname "$0")"
GPUS=${GPUS:-1}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}
. ./device_env.sh
device_bench mixtral
SHAPE=(--arch llama --layers 16 --width 1024 --heads 16 --kv-heads 8 --ffn-width 3584
  --experts 8 --top-k 2 --vocab 32000 --seq 2048 --micro-batch "$MB" --precision bf16-mixed)
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl --trace "$OUT/trace" \
    bin/gpt_bench "${SHAPE[@]}" --warmup 3 --steps 3 --profile 2 --tag oxiflow-profile \
    > "$OUT/profile.log" 2>&1
  echo "profile exit code: $?"
  grep -E "PROFILE|oxiflow-profile" "$OUT/profile.log" | cut -c1-200
  python3 trace_breakdown.py "$OUT/trace/trace.json" --top 25 --gaps 12 | cut -c1-200
  rm -rf "$OUT/trace"
fi
if [ "$GPUS" = 1 ]; then
  LAYOUTS=eager; TORCH=(python3)
else
  LAYOUTS=${LAYOUTS:-ep2 dp2}; TORCH=(torchrun --standalone --nproc-per-node "$GPUS")
fi
for r in $(seq "$ROUNDS"); do
  for layout in $LAYOUTS; do
    case $layout in
      ep*) flags=(--dp "$GPUS" --ep "${layout#ep}") ;;
      dp*) flags=(--dp "$GPUS") ;;
      *) flags=() ;;
    esac
    sampled "$OUT/ours-$layout-$r.log" timeout 300 bin/oflaunch --nproc-per-node "$GPUS" \
      --backend nccl bin/gpt_bench "${SHAPE[@]}" "${flags[@]}" --warmup 4 --steps "$STEPS" \
      --tag "oxiflow-$layout"
  done
  for mode in $TORCH_MODES; do
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    sampled "$OUT/torch-$mode-$r.log" timeout 400 "${TORCH[@]}" mixtral_bench.py \
      --micro-batch "$MB" --steps "$STEPS" "${flag[@]}" --tag "torch-$mode"
  done
done
python3 median_table.py "$OUT" torch-compile $(printf "oxiflow-%s " $LAYOUTS) \
  $(printf "torch-%s " $TORCH_MODES)
