#!/usr/bin/env bash
# Runs on the GPU machine from a folder holding bin/ (oflaunch, gpt_bench) and gpt2_bench.py:
# OxiFlow's GPT-2 124M step beside the PyTorch anchor (eager and torch.compile) at several
# micro-batches, in one command, on GPU 0. Logs under $OUT; one table last, ratios per size.
# Usage: gpt_sizes_there.sh "8 16 32"   (env: PRECISIONS="bf16-mixed", STEPS, COMPILE=0|1)
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/gpt-sizes}
mkdir -p "$OUT"
SIZES=${1:-"8 16 32"}
STEPS=${STEPS:-10}
nvidia-smi -L | tee "$OUT/gpu.txt"
for b in $SIZES; do
  for p in ${PRECISIONS:-bf16-mixed}; do
    timeout 200 bin/oflaunch --nproc-per-node 1 --backend nccl bin/gpt_bench --precision "$p" \
      --micro-batch "$b" --warmup 3 --steps "$STEPS" --tag "oxiflow-$p" > "$OUT/ox-$p-$b.log" 2>&1
    echo "oxiflow $p mb $b exit code: $?"
    grep -h "RESULT\|rror\|fall" "$OUT/ox-$p-$b.log" | head -5
  done
  timeout 150 python3 gpt2_bench.py --micro-batch "$b" --steps "$STEPS" --tag eager > "$OUT/torch-eager-$b.log" 2>&1
  grep -h RESULT "$OUT/torch-eager-$b.log" || tail -3 "$OUT/torch-eager-$b.log"
  if [ "${COMPILE:-1}" = 1 ]; then
    timeout 200 python3 gpt2_bench.py --micro-batch "$b" --steps "$STEPS" --compile --tag compile > "$OUT/torch-compile-$b.log" 2>&1
    grep -h RESULT "$OUT/torch-compile-$b.log" || tail -3 "$OUT/torch-compile-$b.log"
  fi
done
python3 - "$OUT" <<'PY'
import sys
from result_logs import results
rows = results(sys.argv[1])
torch = {(r["tag"], r["micro_batch"]): r for r in rows if "impl" not in r}
print("| run | micro-batch | ms/step | tokens/s | MFU | peak GiB | vs torch eager | vs torch.compile | mem vs eager |")
print("|---|---|---|---|---|---|---|---|---|")
for r in sorted(rows, key=lambda r: (r["micro_batch"], "impl" not in r, r["tag"])):
    b, tok = r["micro_batch"], r["tokens_per_s"]
    name = r["tag"] + (f' clip {r.get("clip")}' if "impl" in r else "")
    def ratio(k):
        t = torch.get((k, b))
        return f'{tok / t["tokens_per_s"]:.3f}' if t and "impl" in r else "-"
    e = torch.get(("eager", b))
    mem = f'{r["peak_mem_GiB"] / e["peak_mem_GiB"]:.2f}' if e and "impl" in r and e.get("peak_mem_GiB") else "-"
    print(f'| {name} | {b} | {r["ms_per_step"]} | {tok:,.0f} | {100 * r["mfu"]:.1f}% | {r["peak_mem_GiB"]} | {ratio("eager")} | {ratio("compile")} | {mem} |')
PY
