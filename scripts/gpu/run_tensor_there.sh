#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the CUDA tensor suite and `oflaunch train` on cuda vs
# cpu placements next to PyTorch DDP (the boxing benchmarks are in run_there.sh).
# Usage: scripts/gpu/run_tensor_there.sh [worlds] [steps]   (binaries from build_here.sh)
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/carry_env.sh
WORLDS=${1:-"2 4"}
STEPS=${2:-200}
status=0
# 1. The tensor suite WITHOUT LD_LIBRARY_PATH: cuda_libs must find CUDA 13 by itself.
timeout "${T_SUITE:-300}" env -u LD_LIBRARY_PATH "$B/gpu_tensor" 2>&1 | tee "$OUT/gpu_tensor.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# 2. train: NCCL + cuda placement vs CPU backend + cpu placement (same flags), then DDP.
for w in $WORLDS; do
  common="--steps $STEPS --log-every 10"
  timeout "${T_TRAIN:-120}" "$B/oflaunch" --nproc-per-node "$w" --backend nccl "$B/train" --device cuda $common > "$OUT/train_cuda_w$w.log" 2>&1 || status=1
  timeout "${T_TRAIN:-120}" "$B/oflaunch" --nproc-per-node "$w" --backend cpu "$B/train" --device cpu $common > "$OUT/train_cpu_w$w.log" 2>&1 || status=1
  timeout "${T_TRAIN:-120}" python3 -m torch.distributed.run --standalone --nproc-per-node "$w" scripts/gpu/ddp_mlp.py --steps "$STEPS" \
    2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*\*" > "$OUT/ddp_w$w.log" || status=1
  python3 - "$OUT/train_cuda_w$w.log" "$OUT/train_cpu_w$w.log" "$OUT/ddp_w$w.log" "$w" <<'PY' 2>&1 | tee -a "$OUT/train_summary.txt"
import re, sys
cu, cp, dd, w = sys.argv[1:5]
def losses(p):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+) loss ([-\d.eE+naif]+)", open(p).read())}
def sps(p, pat=r"steps/s ([\d.]+)"):
    m = re.search(pat, open(p).read()); return m.group(1) if m else "?"
a, b = losses(cu), losses(cp)
worst = max((abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in b if k in a), default=float("nan"))
ok = len(a) == len(b) and len(b) > 0 and worst <= 1e-4
steady = sps(dd, r"steady ([\d.]+)")
print(f"train w{w}: {len(a)} logged steps, max rel loss diff cuda vs cpu {worst:.2e} ({'OK' if ok else 'FAIL'}); "
      f"steps/s oxiflow cuda {sps(cu)} | oxiflow cpu {sps(cp)} | torch DDP {sps(dd)} (ddp steady {steady})")
for p in (cu, cp, dd):
    tail = open(p).read().strip().splitlines()[-2:]
    print("   ", p.split("/")[-1], "|", " / ".join(tail))
sys.exit(0 if ok else 1)
PY
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
echo "run_tensor_there: exit status $status"
exit $status
