#!/usr/bin/env bash
# Generation probe (Llama-1B shape, greedy, one 128-token prompt): ours with and without the
# device graph (the step breakdown line), then a traced run of 32 tokens summarised by
# trace_breakdown.py (the compute stream's busy and idle time, ops by time, longest gaps).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/genprobe}; mkdir -p "$OUT"
MODEL=/tmp/llama1b-hf
[ -e "$MODEL/config.json" ] || python3 llama1b_hf.py "$MODEL"
prompts=$(python3 -c "
import random; random.seed(1)
print(';'.join(','.join(str(random.randrange(1, 128000)) for _ in range(128)) for _ in range(${B:-1})))")
gen() { timeout 200 bin/oflaunch --nproc-per-node 1 --backend nccl "$@" bin/train --from-hf "$MODEL" \
  --prompt-ids "$prompts" --temperature 0 --gen-tokens ${NEW:-256} 2>&1 | grep -o "generation: .*"; }
echo "graph:"; gen
echo "no graph:"; OXIFLOW_CUDA_GRAPH=0 gen
rm -rf "$OUT/trace"
NEW=32 gen --trace "$OUT/trace" > /dev/null
python3 generate_trace.py "$OUT/trace/trace.json" --top 18 2>&1 | tail -80
rm -rf "$OUT/trace"
