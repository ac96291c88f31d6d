#!/usr/bin/env bash
# Runs on the GPU machine's many CPU cores (no GPU involved): the CPU collectives benchmark
# next to Open MPI (mpi4py) and gloo (torch.distributed) in the same run, and the dispatch
# overhead benchmark. Usage: scripts/gpu/run_cpu_there.sh [ranks] [max-bytes]
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/carry_env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RANKS=${1:-2,4}
MAX=${2:-67108864}
echo "cores: $(nproc)" | tee "$OUT/cpu_bench.md"
timeout "${T_CPU:-240}" "$B/collectives_bench" --ranks "$RANKS" --min 1048576 --max "$MAX" --anchors mpi,gloo 2>&1 | tee -a "$OUT/cpu_bench.md"
timeout 60 "$B/dispatch_bench" 2>&1 | tee "$OUT/dispatch_bench.md"
