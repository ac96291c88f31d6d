#!/usr/bin/env bash
# Runs on a 2-GPU machine from a folder holding bin/ (oflaunch, gpt_bench, train) and
# trace_overlap.py: GPT-2 124M (bf16-mixed, micro-batch 8 per GPU) on 1 GPU, then DP2 in each
# of $VARIANTS, then 1 GPU again (the two 1-GPU runs bracket the DP2 ones; scaling is the mean
# 1-GPU step time over the DP2 step time: 1.0 is perfect), then one traced DP2 run summarised
# as the share of its all-reduce time that ran under compute kernels. Logs under $OUT.
# Usage: overlap_there.sh [micro-batch]   (env: STEPS, BUCKET_MB, VARIANTS: space-separated
#   tag=flags items, flags joined by commas, an item's NAME=value flags set in its environment;
#   default "dp2-buckets=--bucket-mb,25 dp2-nobuckets=--bucket-mb,0")
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/overlap}
mkdir -p "$OUT"
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
bench one 1
for v in $VARIANTS; do
  IFS=, read -r -a flags <<< "${v#*=}"
  bench "${v%%=*}" 2 "${flags[@]}"
done
bench one-again 1
# One traced DP2 run: a short one, since every op and collective is recorded.
rm -rf "$OUT/trace"
timeout 300 bin/oflaunch --nproc-per-node 2 --backend nccl --trace "$OUT/trace" bin/gpt_bench --dp 2 \
  --precision bf16-mixed --micro-batch "$B" --warmup 2 --steps 2 --tag traced --bucket-mb "$BUCKET_MB" \
  > "$OUT/traced.log" 2>&1
echo "traced exit code: $?"
python3 - "$OUT" <<'PY'
import json, sys
rows = {}
import glob, os
tags = ["one", "one-again"] + sorted(
    os.path.basename(p)[:-4] for p in glob.glob(f"{sys.argv[1]}/dp2*.log"))
for tag in tags:
    try:
        for line in open(f"{sys.argv[1]}/{tag}.log", errors="replace"):
            if "RESULT {" in line and ("[rank 0]" in line or "[rank" not in line):
                rows[tag] = json.loads(line[line.index("RESULT {") + 7:])
                break
    except OSError:
        pass
ones = [rows[t]["ms_per_step"] for t in ("one", "one-again") if t in rows]
one = sum(ones) / len(ones) if ones else None
print("| run | GPUs | micro-batch per GPU | buckets MiB | reduce dtype | ms/step | tokens/s per GPU | peak GiB | scaling (mean 1-GPU ms / ms) |")
print("|---|---|---|---|---|---|---|---|---|")
for tag, r in rows.items():
    scale = f'{one / r["ms_per_step"]:.3f}' if one else "-"
    print(f'| {tag} | {r.get("dp", 1)} | {r["micro_batch"]} | {r.get("bucket_mb", "-")} | {r.get("reduce_dtype", "-")} | {r["ms_per_step"]} | {r["tokens_per_s"]:,.0f} | {r.get("peak_mem_GiB", "-")} | {scale} |')
PY
python3 trace_overlap.py "$OUT/trace/trace.json" --rank 0 || tail -5 "$OUT/traced.log"
