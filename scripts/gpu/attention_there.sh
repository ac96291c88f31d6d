#!/usr/bin/env bash
# Runs on the GPU machine from a folder holding attention_bench (here or in bin/) and
# attention_anchor.py: OxiFlow's fused attention op (through dispatch and autograd) beside
# torch's SDPA on the cuDNN backend, both at B 16, H 12, T 1024, D 64, causal, bf16, in the
# same run. Logs under $OUT; one table last: forward and forward+backward TFLOP/s of each with
# OxiFlow / torch, and the largest ‖out − ref‖/‖ref‖ of each against its f64 reference.
# (env: BENCH_ARGS for attention_bench, REPS for both, BENCH_TIMEOUT, ANCHOR_TIMEOUT)
set -uo pipefail
cd "$(dirname "$0")"
. ./device_env.sh
device_cuda_env
device_out attention
REPS=${REPS:-20}
BENCH=./attention_bench
[ -x "$BENCH" ] || BENCH=bin/attention_bench
nvidia-smi -L | tee "$OUT/gpu.txt"
timeout ${BENCH_TIMEOUT:-300} "$BENCH" --reps "$REPS" ${BENCH_ARGS:-} > "$OUT/oxiflow.log" 2>&1
echo "attention_bench exit code: $?" | tee -a "$OUT/oxiflow.log"
timeout ${ANCHOR_TIMEOUT:-120} python3 attention_anchor.py --reps "$REPS" > "$OUT/anchor.log" 2>&1
echo "attention_anchor exit code: $?" | tee -a "$OUT/anchor.log"
cat "$OUT/oxiflow.log"
cat "$OUT/anchor.log"
python3 - "$OUT" <<'EOF'
import sys

def rows(path):
    """The TFLOP/s of the fwd and fwd+bwd timing rows and the largest error of the check rows."""
    rate, err, shape = {}, None, "-"
    for line in open(path, errors="replace"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0].endswith((" fwd", " fwd+bwd")) and "TFLOP/s" in cells[4]:
            rate[cells[0].rsplit(" ", 1)[1]] = float(cells[4].split()[0])
            shape = cells[2]
        elif len(cells) >= 6 and cells[5] in ("pass", "FAIL"):
            err = max(err or 0.0, float(cells[3]))
    return rate, err, shape

ox, ox_err, shape = rows(sys.argv[1] + "/oxiflow.log")
th, th_err, _ = rows(sys.argv[1] + "/anchor.log")
fmt = lambda x: "-" if x is None else f"{x:.1f}"
print()
print(f"| attention, bf16, {shape} | OxiFlow op TFLOP/s | torch SDPA cuDNN TFLOP/s | OxiFlow / torch |")
print("|---|---|---|---|")
for k in ["fwd", "fwd+bwd"]:
    a, b = ox.get(k), th.get(k)
    ratio = f"{a / b:.3f}" if a and b else "-"
    print(f"| {k} | {fmt(a)} | {fmt(b)} | {ratio} |")
e = lambda x: "-" if x is None else f"{x:.2e}"
print(f"| max ‖out − ref‖/‖ref‖ vs f64 | {e(ox_err)} | {e(th_err)} | |")
EOF
