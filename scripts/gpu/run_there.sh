#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the GPU suites and benchmarks from .carry/bin,
# DTensor alongside, logs and a merged table under $OUT. Usage: scripts/gpu/run_there.sh [worlds]
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/carry_env.sh
WORLDS=${1:-"2 4"}
SIZES=${SIZES:-1,4,16,64,256,1024}
{ nvidia-smi -L; nvidia-smi topo -m; } > "$OUT/gpus.txt" 2>&1
# 1. The GPU suite WITHOUT LD_LIBRARY_PATH: cuda_libs must find CUDA 13 and NCCL by itself.
env -u LD_LIBRARY_PATH "$B/gpu_nccl" 2>&1 | tee "$OUT/gpu_nccl.log"
suite=${PIPESTATUS[0]}
# 2. Benchmarks (the CUDA 13 folder on the path as well, as for any CUDA program there).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
#    The table: gpu_boxing_bench (Tensor::to_global + bare collective) and DTensor per world;
#    nccl_bench gives the raw-NCCL column (the library called directly, no OxiFlow code).
for w in $WORLDS; do
  "$B/gpu_boxing_bench" --worlds "$w" --sizes-mib "$SIZES" --out "$OUT/boxing_w$w.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "gpu_boxing_bench world $w exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
  "$B/nccl_bench" --world "$w" --sizes-mib "$SIZES" --out "$OUT/nccl_bench_w$w.json" 2>&1 | tee -a "$OUT/nccl_bench.log"
  python3 -m torch.distributed.run --standalone --nproc-per-node "$w" scripts/gpu/dtensor_bench.py \
    --sizes-mib "$SIZES" --out "$OUT/dtensor_w$w.json" 2>&1 | grep -v "^W.*OMP_NUM_THREADS\|^\*\*\*\*" | tee -a "$OUT/bench.log"
done
python3 scripts/gpu/report.py "$OUT"/boxing_w*.json "$OUT"/nccl_bench_w*.json "$OUT"/dtensor_w*.json > "$OUT/report.md"
cat "$OUT/report.md"
echo "gpu suite exit code: $suite"
exit "$suite"
