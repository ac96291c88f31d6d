#!/usr/bin/env bash
# Runs on the GPU machine from a folder holding bin/ (gpt_bench builds, oflaunch, optionally
# the gpu_tensor suite) and gpt2_bench.py: OxiFlow's GPT-2 124M step next to the PyTorch anchor
# in the same run. Logs under $OUT; the RESULT lines and a table last.
# Usage: gpt_bench_there.sh [micro-batch]
# (env: VARIANTS="bin:precision[:driver] ...", PROFILE_BIN (variants to profile), STEPS, COMPILE=1, SUITE=1)
set -uo pipefail
cd "$(dirname "$0")"
. ./device_env.sh
device_cuda_env
device_out gpt-bench
B=${1:-16}
STEPS=${STEPS:-8}
VARIANTS=${VARIANTS:-"gpt_bench:tf32 gpt_bench:bf16-mixed"}
nvidia-smi -L | tee "$OUT/gpu.txt"
if [ "${SUITE:-0}" = 1 ] && [ -x bin/gpu_tensor ]; then
  timeout 300 bin/gpu_tensor > "$OUT/gpu_tensor.log" 2>&1
  echo "gpu_tensor suite exit code: $?" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/gpu_tensor.log"
fi
# A variant is bin:precision, or bin:precision:driver for device blocks from the driver's allocator.
for v in $VARIANTS; do
  IFS=: read -r bin mm mem <<< "$v"
  extra=""
  case " ${PROFILE_BIN:-} " in *" $v "*) extra="--profile 2" ;; esac
  [ "$mem" = driver ] && extra="$extra --nccl-memory off"
  tag="$bin${mem:+-$mem}"
  timeout 240 bin/oflaunch --nproc-per-node 1 --backend nccl bin/"$bin" --precision "$mm" \
    --micro-batch "$B" --warmup 2 --steps "$STEPS" --tag "$tag" $extra > "$OUT/$tag-$mm.log" 2>&1
  echo "$tag $mm exit code: $?"
  grep -h "RESULT\|PROFILE\|rror" "$OUT/$tag-$mm.log" | head -30
done
timeout 240 python3 gpt2_bench.py --micro-batch "$B" --tag eager > "$OUT/torch-eager.log" 2>&1
grep -h RESULT "$OUT/torch-eager.log" || tail -5 "$OUT/torch-eager.log"
if [ "${COMPILE:-0}" = 1 ]; then
  timeout 300 python3 gpt2_bench.py --micro-batch "$B" --compile --tag compile > "$OUT/torch-compile.log" 2>&1
  grep -h RESULT "$OUT/torch-compile.log" || tail -5 "$OUT/torch-compile.log"
fi
python3 - "$OUT" <<'EOF'
import sys
from result_logs import results
rows = results(sys.argv[1])
torch = {r["tag"]: r["tokens_per_s"] for r in rows if "impl" not in r}
print("| run | micro-batch | ms/step | tokens/s | MFU | peak GiB | vs torch eager | vs torch compile |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    name = r["tag"] if "impl" not in r else f'{r["tag"]} {r["precision"]}'
    tok = r["tokens_per_s"]
    ratio = lambda k: f'{tok / torch[k]:.3f}' if k in torch else "-"
    print(f'| {name} | {r["micro_batch"]} | {r["ms_per_step"]} | {tok:,.0f} | {100 * r["mfu"]:.1f}% | {r["peak_mem_GiB"]} | {ratio("eager")} | {ratio("compile")} |')
EOF
