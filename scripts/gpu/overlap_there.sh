#!/usr/bin/env bash
# Runs on a 2-GPU machine from a folder holding bin/ (oflaunch, gpt_bench, train) and
# trace_overlap.py: GPT-2 124M (bf16-mixed, micro-batch 8 per GPU) on 1 GPU and on DP2 with
# gradient buckets on (--bucket-mb 25) and off (0), ms/step and scaling (1-GPU step time over
# DP2 step time: 1.0 is perfect), then one traced DP2 run summarised as the share of its
# all-reduce time that ran under compute kernels. Logs under $OUT.
# Usage: overlap_there.sh [micro-batch]   (env: STEPS, BUCKET_MB)
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
bench() { # tag nproc extra...
  local tag=$1 n=$2; shift 2
  timeout 300 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/gpt_bench --dp "$n" \
    --precision bf16-mixed --micro-batch "$B" --warmup 3 --steps "$STEPS" --tag "$tag" "$@" \
    > "$OUT/$tag.log" 2>&1
  echo "$tag exit code: $?"
  grep -h "rror" "$OUT/$tag.log" | head -5
}
bench one 1
bench dp2-buckets 2 --bucket-mb "$BUCKET_MB"
bench dp2-nobuckets 2 --bucket-mb 0
# One traced DP2 run: a short one, since every op and collective is recorded.
rm -rf "$OUT/trace"
timeout 300 bin/oflaunch --nproc-per-node 2 --backend nccl --trace "$OUT/trace" bin/gpt_bench --dp 2 \
  --precision bf16-mixed --micro-batch "$B" --warmup 2 --steps 2 --tag traced --bucket-mb "$BUCKET_MB" \
  > "$OUT/traced.log" 2>&1
echo "traced exit code: $?"
python3 - "$OUT" <<'PY'
import json, sys
rows = {}
for tag in ["one", "dp2-buckets", "dp2-nobuckets"]:
    try:
        for line in open(f"{sys.argv[1]}/{tag}.log", errors="replace"):
            if "RESULT {" in line and ("[rank 0]" in line or "[rank" not in line):
                rows[tag] = json.loads(line[line.index("RESULT {") + 7:])
                break
    except OSError:
        pass
one = rows.get("one", {}).get("ms_per_step")
print("| run | GPUs | micro-batch per GPU | ms/step | tokens/s per GPU | scaling (1-GPU ms / ms) |")
print("|---|---|---|---|---|---|")
for tag, r in rows.items():
    scale = f'{one / r["ms_per_step"]:.3f}' if one else "-"
    print(f'| {tag} | {r.get("dp", 1)} | {r["micro_batch"]} | {r["ms_per_step"]} | {r["tokens_per_s"]:,.0f} | {scale} |')
PY
python3 trace_overlap.py "$OUT/trace/trace.json" --rank 0 || tail -5 "$OUT/traced.log"
