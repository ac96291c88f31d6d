#!/usr/bin/env bash
# Runs on the GPU machine from a folder holding bin/ (staged by engine_here.sh) and the anchors
# (gpt2_bench.py, attention_anchor.py): the engine's device checks in one command, on GPU 0.
#   SUITE=1   the gpu_tensor suite (every op, fused op, 16-bit case and boxing against the CPU)
#   OPS=1     the ops crate's CUDA suites (SwiGLU, RMSNorm, sum of squares against f64 references)
#   HF=1      a Llama fixture trained 3 steps on CPU ranks (PP2, f64) and saved with --save-hf,
#             loaded in transformers: its f64 loss against `train --eval-only`'s on the save
#   LLAMA=1   the Llama-3.2-1B shape beside llama_bench.py (llama_there.sh)
#   CURVE=1   the README's GPT for $CURVE_STEPS steps on one GPU, f32 against bf16-mixed
#   ATTN=1    the attention op beside torch's SDPA (attention_there.sh)
#   SIZES="8 16 32"  gpt_bench beside gpt2_bench.py eager (and --compile with COMPILE=1)
#   COMPILE_TIME="12 12 24 48"  `train --compile` on GPT-2 124M's shape at each depth in turn
#             (micro-batch 8, bf16-mixed), the first with empty kernel caches: the compiled line
#             (capture, which runs one eager step, and the passes) and the process's wall time,
#             beside torch.compile's warm-up (gpt2_bench.py --compile, 12 layers)
# Logs under $OUT; the tables last.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/engine}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpu.txt"
if [ "${SUITE:-1}" = 1 ]; then
  timeout ${SUITE_TIMEOUT:-300} bin/gpu_tensor > "$OUT/gpu_tensor.log" 2>&1
  echo "gpu_tensor suite exit code: $?" | tee -a "$OUT/summary.txt"
  grep -E "^gpu_tensor:|test result|FAILED|panicked" "$OUT/gpu_tensor.log" | tail -40
fi
if [ "${OPS:-0}" = 1 ]; then
  for t in bin/ops_*; do
    timeout 120 "$t" > "$OUT/$(basename "$t").log" 2>&1
    echo "$(basename "$t") exit code: $?" | tee -a "$OUT/summary.txt"
    grep -E "test result|FAILED|panicked|skipped" "$OUT/$(basename "$t").log" | tail -5
  done
fi
if [ "${HF:-0}" = 1 ]; then
  H="$OUT/hf" && rm -rf "$H" && mkdir -p "$H"
  common=(--from-hf hf_fixtures/llama --data hf_fixtures/tokens.bin --seq-len 16 --dtype f64)
  timeout 120 bin/oflaunch --nproc-per-node 2 --backend cpu bin/train "${common[@]}" \
    --batch-size 4 --gen-tokens 0 --steps 3 --pp 2 --save-hf "$H/saved" > "$H/train.log" 2>&1
  echo "train --save-hf exit code: $?"
  timeout 60 bin/train --from-hf "$H/saved" --data hf_fixtures/tokens.bin --seq-len 16 \
    --dtype f64 --eval-only --batch-size 3 > "$H/eval.log" 2>&1
  loss=$(grep -o "eval loss [0-9.eE+-]*" "$H/eval.log" | head -1 | cut -d' ' -f3)
  echo "train --eval-only on the save: ${loss:-none} ($(tail -1 "$H/eval.log"))"
  timeout 120 python3 hf_check_save.py "$H/saved" --data hf_fixtures/tokens.bin --seq-len 16 \
    ${loss:+--expect "$loss"} 2>&1 | tee "$H/check.log" | tail -4
  echo "hf_check_save exit code: ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
fi
if [ "${LLAMA:-0}" = 1 ]; then
  OUT="$OUT/llama" ./llama_there.sh
fi
if [ "${CURVE:-0}" = 1 ]; then
  for p in f32 bf16-mixed; do
    timeout 240 bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --device cuda \
      --precision "$p" --steps "${CURVE_STEPS:-300}" --log-every 50 > "$OUT/curve-$p.log" 2>&1
    echo "curve $p exit code: $?"
    grep -E "final loss|rror" "$OUT/curve-$p.log" | tail -3
  done
  python3 - "$OUT" <<'PY'
import re, sys
f = {}
for p in ("f32", "bf16-mixed"):
    for line in open(f"{sys.argv[1]}/curve-{p}.log", errors="replace"):
        m = re.search(r"final loss ([0-9.eE+-]+)", line)
        if m: f[p] = float(m.group(1))
if len(f) == 2:
    print(f"| curve | f32 final {f['f32']:.5f} | bf16-mixed final {f['bf16-mixed']:.5f} | relative {abs(f['bf16-mixed'] - f['f32']) / f['f32']:.4f} |")
PY
fi
if [ "${ATTN:-0}" = 1 ] && [ -x attention_there.sh ]; then
  OUT="$OUT/attn" ./attention_there.sh
fi
if [ -n "${SIZES:-}" ]; then
  OUT="$OUT/sizes" COMPILE=${COMPILE:-0} STEPS=${STEPS:-10} ./gpt_sizes_there.sh "$SIZES"
fi
if [ -n "${COMPILE_TIME:-}" ]; then
  # Fresh kernel and driver caches: the first run compiles every kernel, the later ones load
  # them from the cache.
  export OXIFLOW_KERNEL_CACHE="$OUT/kernel-cache" CUDA_CACHE_PATH="$OUT/jit-cache"
  rm -rf "$OXIFLOW_KERNEL_CACHE" "$CUDA_CACHE_PATH"
  i=0
  for L in $COMPILE_TIME; do
    i=$((i + 1))
    start=$(date +%s%N)
    timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --device cuda \
      --precision bf16-mixed --compile --layers "$L" --width 768 --heads 12 --seq-len 1024 \
      --batch-size 8 --tokenizer gpt2 --clip-grad 1.0 --steps 4 --log-every 1 \
      > "$OUT/compile-$i-$L.log" 2>&1
    code=$?
    echo "train --compile, $L layers, exit code: $code, $(( ($(date +%s%N) - start) / 1000000 )) ms in all" \
      | tee -a "$OUT/compile-$i-$L.log"
    grep -h "rror" "$OUT/compile-$i-$L.log" | head -3
  done
  timeout 300 python3 gpt2_bench.py --compile --micro-batch 8 --warmup 1 --steps 2 \
    --tag compile-time > "$OUT/torch-compile-time.log" 2>&1
  echo "gpt2_bench.py --compile exit code: $?"
  python3 - "$OUT" $COMPILE_TIME <<'PY'
import json, re, sys
out, depths = sys.argv[1], sys.argv[2:]
print("| run | layers | kernel cache | ops -> kernels | arena bytes | eager peak bytes | compile time | process wall |")
print("|---|---|---|---|---|---|---|---|")
for i, L in enumerate(depths, 1):
    m = wall = None
    for line in open(f"{out}/compile-{i}-{L}.log", errors="replace"):
        m = m or re.search(r"compiled: (\d+) ops -> (\d+) kernels, arena (\d+) bytes \(eager peak (\S+) bytes\), compile time (\d+) ms", line)
        w = re.search(r"exit code: \S+ (\d+) ms in all", line)
        wall = w.group(1) if w else wall
    cache = "empty" if i == 1 else "warm"
    if m:
        print(f"| oxiflow train --compile | {L} | {cache} | {m.group(1)} -> {m.group(2)} | {int(m.group(3)):,} | {m.group(4)} | {m.group(5)} ms | {wall} ms |")
    else:
        print(f"| oxiflow train --compile | {L} | {cache} | failed (see {out}/compile-{i}-{L}.log) ||||||")
for line in open(f"{out}/torch-compile-time.log", errors="replace"):
    if line.startswith("RESULT "):
        r = json.loads(line[7:])
        print(f"| torch.compile warm-up (compile + 1 step) | 12 | its own | - | - | - | {r.get('warmup_s')} s | - |")
PY
fi
