#!/usr/bin/env bash
# Runs on a 2-GPU machine from a folder holding bin/ (oflaunch, gpt_bench, train) and
# trace_overlap.py: GPT-2 124M (bf16-mixed, micro-batch 8 per GPU) on 1 GPU, then DP2 in each
# of $VARIANTS, REPEATS times, then 1 GPU again (the 1-GPU runs bracket the DP2 ones; scaling is
# the median 1-GPU step time over the variant's median: 1.0 is perfect), then one traced DP2 run summarised
# as the share of its all-reduce time that ran under compute kernels. Logs under $OUT.
# Usage: overlap_there.sh [micro-batch]   (env: STEPS, BUCKET_MB, REPEATS, VARIANTS: space-separated
#   tag=flags items, flags joined by commas, an item's NAME=value flags set in its environment;
#   default "dp2-buckets=--bucket-mb,25 dp2-nobuckets=--bucket-mb,0")
set -uo pipefail
cd "$(dirname "$0")"
. ./device_env.sh
device_cuda_env
device_out overlap
B=${1:-8}
STEPS=${STEPS:-10}
BUCKET_MB=${BUCKET_MB:-25}
nvidia-smi -L | tee "$OUT/gpu.txt"
bench() { # tag nproc extra... (extra NAME=value items go to the environment)
  local tag=$1 n=$2; shift 2
  local envs=() args=()
  for x in "$@"; do
    case $x in [A-Z]*=*) envs+=("$x") ;; *) args+=("$x") ;; esac
  done
  set -- "${args[@]}"
  timeout 300 env "${envs[@]}" bin/oflaunch --nproc-per-node "$n" --backend nccl bin/gpt_bench --dp "$n" \
    --precision bf16-mixed --micro-batch "$B" --warmup 3 --steps "$STEPS" --tag "$tag" "$@" \
    > "$OUT/$tag.log" 2>&1
  echo "$tag exit code: $?"
  grep -h "rror" "$OUT/$tag.log" | head -5
}
VARIANTS=${VARIANTS:-"dp2-buckets=--bucket-mb,$BUCKET_MB dp2-nobuckets=--bucket-mb,0"}
# REPEATS rounds, each 1 GPU then every variant: the table takes each run's median over the
# rounds, so a drift of the GPUs' clocks between runs does not decide a ratio.
REPEATS=${REPEATS:-1}
for r in $(seq 1 "$REPEATS"); do
  bench "one@$r" 1
  for v in $VARIANTS; do
    IFS=, read -r -a flags <<< "${v#*=}"
    bench "${v%%=*}@$r" 2 "${flags[@]}"
  done
done
bench "one@$((REPEATS + 1))" 1
# One traced DP2 run: a short one, since every op and collective is recorded.
rm -rf "$OUT/trace"
timeout 300 bin/oflaunch --nproc-per-node 2 --backend nccl --trace "$OUT/trace" bin/gpt_bench --dp 2 \
  --precision bf16-mixed --micro-batch "$B" --warmup 2 --steps 2 --tag traced --bucket-mb "$BUCKET_MB" \
  > "$OUT/traced.log" 2>&1
echo "traced exit code: $?"
python3 - "$OUT" <<'PY'
import statistics, sys
from result_logs import rank0_rounds
runs = rank0_rounds(sys.argv[1])
med = {t: statistics.median(r["ms_per_step"] for r in rs) for t, rs in runs.items()}
one = med.get("one")
print("| run | GPUs | micro-batch per GPU | buckets MiB | reduce dtype | runs | ms/step (median) | ms/step (each) | tokens/s per GPU | peak GiB | scaling (1-GPU median / median) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for tag in ["one"] + sorted(t for t in runs if t != "one"):
    if tag not in runs:
        continue
    r = runs[tag][0]
    ms = med[tag]
    each = ", ".join(f'{x["ms_per_step"]}' for x in runs[tag])
    tok = r["micro_batch"] * r["seq"] * 1000.0 / ms
    scale = f"{one / ms:.3f}" if one else "-"
    print(f'| {tag} | {r.get("dp", 1)} | {r["micro_batch"]} | {r.get("bucket_mb", "-")} | {r.get("reduce_dtype", "-")} | {len(runs[tag])} | {ms:.2f} | {each} | {tok:,.0f} | {r.get("peak_mem_GiB", "-")} | {scale} |')
PY
python3 trace_overlap.py "$OUT/trace/trace.json" --rank 0 || tail -5 "$OUT/traced.log"
