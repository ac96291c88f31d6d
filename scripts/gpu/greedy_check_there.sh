#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: greedy generation from the
# Hugging Face fixtures (hf_fixtures: random weights saved by transformers) on one GPU, all in
# f64 (--precision f64: the device default is bf16-mixed),
# through the fixed cache's compiled step and its CUDA graph, against transformers' greedy ids
# in hf_fixtures/reference.json (the prompts 5,17,3 and 1,2,3,4,5,6,7; 9,9,9 beside the first
# in its batch). Prints a line per model, "same" or "DIFFERENT"; logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/greedy}
mkdir -p "$OUT"
for m in ${MODELS:-llama qwen2 mistral gpt2}; do
  log="$OUT/greedy-$m.log"
  timeout 180 bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --from-hf "hf_fixtures/$m" \
    --prompt-ids "5,17,3;9,9,9;1,2,3,4,5,6,7" --gen-tokens 24 --temperature 0 --precision f64 \
    > "$log" 2>&1
  python3 - "$m" "$log" <<'PY'
import json, re, sys
m, log = sys.argv[1], sys.argv[2]
want = json.load(open("hf_fixtures/reference.json"))["models"][m]["greedy"]
got = [list(map(int, g.split(","))) for g in re.findall(r"generated ids: ([0-9,]+)", open(log).read())]
ok = len(got) == 3 and [got[0], got[2]] == want
print(f"{m:8s} {'same' if ok else 'DIFFERENT'} {got if not ok else ''}")
PY
done
