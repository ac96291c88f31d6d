#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: the kernels of Llama-1B-shaped
# decoding steps (batch $B, greedy, launch by launch: OXIFLOW_CUDA_GRAPH=0, the graph's own
# kernels) under Nsight Compute, one metric (each kernel's duration), $COUNT launches after the
# first $SKIP; then the kernels by total time, per decoding step (the arg-max kernels counted as
# steps).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} OXIFLOW_CUDA_GRAPH=0
OUT=${OUT:-/tmp/genncu}; mkdir -p "$OUT"
MODEL=/tmp/llama1b-hf
[ -e "$MODEL/config.json" ] || python3 llama1b_hf.py "$MODEL"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
prompts=$(python3 -c "
import random; random.seed(1)
print(';'.join(','.join(str(random.randrange(1, 128000)) for _ in range(128)) for _ in range(${B:-1})))")
for v in ${VARIANTS:-graph-kernels}; do
  timeout 400 "$NCU" --target-processes all \
    --metrics gpu__time_duration.sum --csv --launch-skip "${SKIP:-2500}" --launch-count "${COUNT:-1200}" \
    bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --from-hf "$MODEL" \
    --prompt-ids "$prompts" --temperature 0 --gen-tokens "${NEW:-40}" > "$OUT/$v.csv" 2> "$OUT/$v.err"
  echo "== $v (batch ${B:-1}): ncu exit code $?"
  python3 - "$OUT/$v.csv" <<'PY'
import csv, sys
from collections import defaultdict
rows = []
lines = [l for l in open(sys.argv[1], errors="replace") if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        unit = r.get("Metric Unit", "nsecond")
        v = float(r["Metric Value"].replace(",", ""))
        v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
        rows.append((r["Kernel Name"], v))
steps = max(1, sum(1 for n, _ in rows if n.startswith("argmax")))
tot = sum(v for _, v in rows)
print(f"{len(rows)} kernels over {steps} steps: {tot / steps:.1f} us a step, {len(rows) / steps:.0f} kernels a step")
by = defaultdict(lambda: [0.0, 0])
for n, v in rows:
    k = n.split("(")[0][:90]
    by[k][0] += v
    by[k][1] += 1
for k, (t, c) in sorted(by.items(), key=lambda x: -x[1][0])[:22]:
    print(f"  {t / steps:8.1f} us/step {c / steps:6.1f}x {t / c:8.1f} us  {k}")
PY
done
