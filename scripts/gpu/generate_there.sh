#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: generation with the
# Llama-3.2-1B shape (random weights saved by transformers, bf16 on disk; ours at
# --precision bf16-mixed), greedy, 128-token prompts, 256 new tokens, at batch $BATCHES
# (default "1 16"; NOGRAPH=1 adds ours with OXIFLOW_CUDA_GRAPH=0): `train --from-hf
# --gen-warmup $WARMUP` (default
# 1: the request once untimed, as torch's timed generate follows a warm-up one) beside
# `llama_bench.py --generate` (transformers' generate with a static cache) in $MODES (default
# "eager compile"), in the same command. $OURS_ARGS: more flags for ours. Each run's nvidia-smi peak. Logs under $OUT; a table
# last.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/generate}
BATCHES=${BATCHES:-1 16}
NEW=${NEW:-256}
MODEL=${MODEL:-/tmp/llama1b-hf}
MODES=${MODES:-eager compile}
WARMUP=${WARMUP:-1}
mkdir -p "$OUT"
. ./sampled.sh
[ -e "$MODEL/config.json" ] || python3 llama1b_hf.py "$MODEL"
# A short run first fills the on-disk cache of the ops' kernels (NVRTC), as the warm-up
# generate torch runs before its timed one compiles and caches its own.
timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --from-hf "$MODEL" \
  --prompt-ids 1,2,3 --gen-tokens 4 --temperature 0 > "$OUT/warm-up.log" 2>&1
for b in $BATCHES; do
  prompts=$(python3 -c "
import random; random.seed($b)
print(';'.join(','.join(str(random.randrange(1, 128000)) for _ in range(128)) for _ in range($b)))")
  ours=(bin/train --from-hf "$MODEL" --prompt-ids "$prompts" --gen-tokens "$NEW" --temperature 0
    --gen-warmup "$WARMUP" ${OURS_ARGS:-})
  sampled "$OUT/ours-b$b.log" timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl "${ours[@]}"
  if [ "${NOGRAPH:-0}" = 1 ]; then
    OXIFLOW_CUDA_GRAPH=0 sampled "$OUT/ours-nograph-b$b.log" timeout 300 bin/oflaunch \
      --nproc-per-node 1 --backend nccl "${ours[@]}"
  fi
  for mode in $MODES; do
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    sampled "$OUT/torch-$mode-b$b.log" timeout 300 python3 llama_bench.py --generate --batch "$b" \
      --new "$NEW" "${flag[@]}" --tag "torch-$mode"
  done
done
echo
# Ours: cold (every one-time cost in) and warm (without compiling the step and capturing its
# graph, as the warm-up run leaves torch's); torch: its timed run after a warm-up.
printf '%-6s %-16s %12s %12s %10s\n' batch run new_tok/s warm_tok/s smi_MiB
for b in $BATCHES; do
  for run in ours ours-nograph; do
    f="$OUT/$run-b$b.log"
    [ -e "$f" ] || continue
    cold=$(grep -o '([0-9.]* new tokens/s' "$f" | tr -d '(' | cut -d' ' -f1)
    warm=$(grep -o '[0-9.]* new tokens/s without' "$f" | cut -d' ' -f1)
    printf '%-6s %-16s %12s %12s %10s\n' "$b" "$run" "${cold:-FAIL}" "${warm:--}" "$(grep -o 'SMI_PEAK_MIB [0-9]*' "$f" | cut -d' ' -f2)"
  done
  for mode in $MODES; do
    r=$(grep -o '"new_tokens_per_s": [0-9]*' "$OUT/torch-$mode-b$b.log" | cut -d' ' -f2)
    printf '%-6s %-16s %12s %12s %10s\n' "$b" "torch-$mode" "${r:-FAIL}" "${r:-FAIL}" "$(grep -o 'SMI_PEAK_MIB [0-9]*' "$OUT/torch-$mode-b$b.log" | cut -d' ' -f2)"
  done
done
grep -h "decoding steps" "$OUT"/ours*-b*.log | sed 's/.*decoding steps/decoding steps/' | sort | uniq -c
