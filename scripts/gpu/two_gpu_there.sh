#!/usr/bin/env bash
# Runs on a 2-GPU machine from the folder two_gpu_here.sh staged, in one command, the parts
# named in $PARTS (default "suite overlap curves twins"):
#  suite    the gpu_tensor suite with both GPUs visible (its world-2 cases included);
#  overlap  overlap_there.sh: GPT-2 124M on 1 GPU and DP2 in $VARIANTS, scaling, and the share
#           of a traced DP2 step's all-reduce time that ran under compute kernels;
#  curves   bf16-mixed on 2 GPUs tracks one GPU: the README's GPT for $CURVE_STEPS steps on 1
#           GPU, DP2 and TP2, beside the same one-GPU run in 2 accumulation parts (the same
#           step, rounded differently: the size of bf16 rounding's drift), the largest relative
#           gap of the logged losses and the gap at the first logged step;
#  twins    pipes_there.sh with SUITE=0 over $LAYOUTS for $MODEL: our layouts beside their
#           PyTorch twins.
# Logs under $OUT; each part's table last in its part.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/two-gpu}
PARTS=${PARTS:-"suite overlap curves twins"}
mkdir -p "$OUT"
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has suite; then
  t=$(date +%s)
  timeout "${SUITE_TIMEOUT:-300}" bin/gpu_tensor > "$OUT/gpu_tensor.log" 2>&1
  echo "gpu_tensor suite (2 GPUs visible) exit code: $? ($(( $(date +%s) - t )) s)"
  grep -E "^gpu_tensor:|test result|FAILED|panicked" "$OUT/gpu_tensor.log" | tail -30 | cut -c1-240
fi
if has overlap; then
  OUT="$OUT/overlap" ./overlap_there.sh 8 2>&1 | grep -v "^GPU "
fi
if has curves; then
  CURVE_STEPS=${CURVE_STEPS:-300}
  for run in "one 1" "one-acc2 1 --grad-accum 2" "dp2 2 --dp 2" "tp2 2 --tp 2"; do
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
print("| bf16-mixed, README GPT | logged steps | final loss | gap at the first logged step | largest relative gap to 1 GPU |")
print("|---|---|---|---|---|")
for tag in ["one", "one-acc2", "dp2", "tp2"]:
    c = curve(tag)
    common = sorted(set(c) & set(one))
    gap = max((abs(c[s] - one[s]) / abs(one[s]) for s in common), default=float("nan"))
    first = abs(c[common[0]] - one[common[0]]) / abs(one[common[0]]) if common else float("nan")
    last = c[max(c)] if c else float("nan")
    print(f"| {tag} | {len(c)} | {last:.5f} | {first:.2e} | {gap:.2e} |")
print("one-acc2 is the same one-GPU step in 2 accumulation parts: its gap is what bf16 rounding alone gives.")
PY
fi
if has twins; then
  MODEL=${MODEL:-124m}
  OUT="$OUT/twins-$MODEL" MODEL=$MODEL SUITE=0 LAYOUTS=${LAYOUTS:-"dp2 zero2 zero3 tp2 tp2sp 1f1b interleaved"} \
    bash pipes_there.sh 2>&1 | grep -v "^GPU "
fi
