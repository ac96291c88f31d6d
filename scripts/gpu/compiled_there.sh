#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: the compiled step on one GPU.
#   SUITE=1  tests/gpu_compile.rs (compiled = eager, f32, 12 steps; replays as one CUDA graph)
#   then, for each micro-batch of $SIZES (default "8"): gpt_bench eager and --compile,
#   alternated $ROUNDS times (default 2), beside gpt2_bench.py eager (EAGER=1) and
#   --compile (TORCH_COMPILE=1, default; $TORCH_ROUNDS runs, default 1); a table of medians
#   last (ratios from this command).
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/compiled}
SIZES=${SIZES:-8}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-20}
mkdir -p "$OUT"
nvidia-smi -L
if [ "${SUITE:-1}" = 1 ]; then
  OXIFLOW_TEST_BINS=bin timeout 400 bin/gpu_compile --nocapture > "$OUT/gpu_compile.log" 2>&1
  echo "gpu_compile exit code: $?"
  grep -E "gpu_compile:|test result|panicked" "$OUT/gpu_compile.log" | cut -c1-400 | tail -12
fi
for b in $SIZES; do
  for r in $(seq "$ROUNDS"); do
    for c in "" --compile; do
      log="$OUT/ox$c-$b-$r.log"
      timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl bin/gpt_bench --precision bf16-mixed \
        --micro-batch "$b" --warmup 4 --steps "$STEPS" $c --tag "oxiflow${c:+-compiled}" > "$log" 2>&1
      echo "gpt_bench$c mb $b round $r exit code: $?"
      grep -h "compiled\|COMPILED\|MEMORY\|rror" "$log" | cut -c1-300 | head -6
    done
  done
  if [ "${EAGER:-0}" = 1 ]; then
    timeout 200 python3 gpt2_bench.py --micro-batch "$b" --steps "$STEPS" --tag eager > "$OUT/torch-eager-$b.log" 2>&1
  fi
  for r in $(seq "${TORCH_ROUNDS:-1}"); do
    [ "${TORCH_COMPILE:-1}" = 1 ] || break
    timeout 300 python3 gpt2_bench.py --micro-batch "$b" --steps "$STEPS" --compile --tag compile > "$OUT/torch-compile-$b-$r.log" 2>&1
    grep -h RESULT "$OUT/torch-compile-$b-$r.log" | cut -c1-200 || tail -3 "$OUT/torch-compile-$b-$r.log"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*.log")):
    for line in open(f, errors="replace"):
        if "RESULT {" in line:
            r = json.loads(line[line.index("RESULT {") + 7:])
            runs[(r["tag"], r["micro_batch"])].append(r)
print("| run | micro-batch | runs | ms/step (median) | each | tokens/s | MFU | peak GiB | vs torch.compile | vs eager (ours) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (tag, b), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ms = statistics.median(r["ms_per_step"] for r in rs)
    tok = b * rs[0]["seq"] * 1000 / ms
    mfu = statistics.median(r["mfu"] for r in rs)
    peak = max(r["peak_mem_GiB"] for r in rs)
    tc = runs.get(("compile", b))
    ours = runs.get(("oxiflow", b))
    vs_tc = f'{statistics.median(r["ms_per_step"] for r in tc) / ms:.3f}' if tc and tag != "compile" else "-"
    vs_e = f'{statistics.median(r["ms_per_step"] for r in ours) / ms:.3f}' if ours and tag.startswith("oxiflow") else "-"
    each = " / ".join(f'{r["ms_per_step"]}' for r in rs)
    print(f"| {tag} | {b} | {len(rs)} | {ms:.2f} | {each} | {tok:,.0f} | {100 * mfu:.1f}% | {peak} | {vs_tc} | {vs_e} |")
PY
