#!/usr/bin/env bash
# Runs on a 2-GPU machine from the folder two_gpu_here.sh staged, in one command:
#  1. overlap_there.sh: GPT-2 124M on 1 GPU and DP2 with gradient buckets on and off, scaling,
#     and the share of a traced DP2 step's all-reduce time that ran under compute kernels;
#  2. bf16-mixed on 2 GPUs tracks one GPU: the README's GPT for $CURVE_STEPS steps on 1 GPU,
#     DP2 and TP2, the largest relative gap of the logged losses;
#  3. pipes_there.sh with SUITE=0 over $LAYOUTS: our layouts beside their PyTorch twins.
# Logs under $OUT; each part's table last in its part.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/two-gpu}
mkdir -p "$OUT"
OUT="$OUT/overlap" ./overlap_there.sh 8 2>&1 | grep -v "^GPU "
CURVE_STEPS=${CURVE_STEPS:-300}
for run in "one 1" "dp2 2 --dp 2" "tp2 2 --tp 2"; do
  set -- $run
  tag=$1 n=$2; shift 2
  timeout 120 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/train --device cuda \
    --precision bf16-mixed --steps "$CURVE_STEPS" --log-every 10 "$@" > "$OUT/curve-$tag.log" 2>&1
  echo "curve $tag exit code: $?"
done
python3 - "$OUT" <<'PY'
import re, sys
def curve(tag):
    pts = {}
    for line in open(f"{sys.argv[1]}/curve-{tag}.log", errors="replace"):
        m = re.search(r"step (\d+) loss ([0-9.eE+-]+)", line)
        if m and ("[rank 0]" in line or "[rank" not in line):
            pts[int(m.group(1))] = float(m.group(2))
    return pts
one = curve("one")
print("| bf16-mixed, README GPT | steps | final loss | largest relative gap to 1 GPU |")
print("|---|---|---|---|")
for tag in ["one", "dp2", "tp2"]:
    c = curve(tag)
    common = sorted(set(c) & set(one))
    gap = max((abs(c[s] - one[s]) / abs(one[s]) for s in common), default=float("nan"))
    last = c[max(c)] if c else float("nan")
    print(f"| {tag} | {len(c)} logged | {last:.5f} | {gap:.2e} |")
PY
OUT="$OUT/twins" SUITE=0 LAYOUTS=${LAYOUTS:-"dp2 zero2 zero3 tp2 tp2sp"} bash pipes_there.sh 2>&1 | grep -v "^GPU "
