#!/usr/bin/env bash
# Runs on the GPU machine from a folder holding the binaries' folders (staged by engine_here.sh):
# `train --compile` on GPT-2 124M's shape (micro-batch 8, bf16-mixed), with the kernel cache and
# the driver's JIT cache both empty on every run, the binaries of each variant alternating
# round by round, then once with both caches warm, then `gpt_bench --compile` cold with the
# first variant's kernel-build timeline, and torch.compile's warm-up beside them.
#   VARIANTS="new=bin old=bin-old"   tag=folder of each variant's train (and gpt_bench for the
#                                    first; oflaunch from bin/ where a folder has none)
#   ROUNDS=3                         cold runs of each variant
# Logs under $OUT; the table last.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/cold}
VARIANTS=${VARIANTS:-new=bin}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpu.txt"
TRAIN_ARGS=(--device cuda --precision bf16-mixed --compile --layers 12 --width 768 --heads 12
  --seq-len 1024 --batch-size 8 --tokenizer gpt2 --clip-grad 1.0 --steps 4 --log-every 1)
run_train() { # tag folder log cache-dir
  export OXIFLOW_KERNEL_CACHE="$4/kernel" CUDA_CACHE_PATH="$4/jit"
  local start launcher=$2/oflaunch; start=$(date +%s%N)
  [ -x "$launcher" ] || launcher=bin/oflaunch
  timeout 300 "$launcher" --nproc-per-node 1 --backend nccl "$2/train" "${TRAIN_ARGS[@]}" > "$3" 2>&1
  echo "exit code: $? wall $(( ($(date +%s%N) - start) / 1000000 )) ms" >> "$3"
}
for r in $(seq 1 "$ROUNDS"); do
  for v in $VARIANTS; do
    tag=${v%%=*} dir=${v#*=}
    cache="$OUT/cache-$tag-$r"
    rm -rf "$cache"
    run_train "$tag" "$dir" "$OUT/cold-$tag-$r.log" "$cache"
    tail -1 "$OUT/cold-$tag-$r.log"
  done
done
first=${VARIANTS%% *}
ftag=${first%%=*} fdir=${first#*=}
run_train "$ftag" "$fdir" "$OUT/warm-$ftag.log" "$OUT/cache-$ftag-1"
cache="$OUT/cache-bench"
rm -rf "$cache"
OXIFLOW_KERNEL_CACHE="$cache/kernel" CUDA_CACHE_PATH="$cache/jit" timeout 300 \
  "$fdir/oflaunch" --nproc-per-node 1 --backend nccl "$fdir/gpt_bench" --compile --micro-batch 8 \
  --warmup 3 --steps 5 > "$OUT/bench-timeline.log" 2>&1
echo "gpt_bench --compile exit code: $?"
grep -E "TIMELINE|KERNEL BUILD|compiled|device graph" "$OUT/bench-timeline.log"
if [ -f gpt2_bench.py ]; then
  timeout 300 python3 gpt2_bench.py --compile --micro-batch 8 --warmup 1 --steps 2 \
    --tag compile-time > "$OUT/torch-compile-time.log" 2>&1
  echo "gpt2_bench.py --compile exit code: $?"
fi
python3 - "$OUT" "$ROUNDS" $VARIANTS <<'PY'
import glob, json, re, sys
out, rounds, variants = sys.argv[1], int(sys.argv[2]), [v.split("=")[0] for v in sys.argv[3:]]
def parse(path):
    c = g = w = None
    for line in open(path, errors="replace"):
        m = re.search(r"compile time (\d+) ms", line)
        if m and "compiled:" in line: c = int(m.group(1))
        m = re.search(r"captured and instantiated in (\d+) ms", line)
        if m: g = int(m.group(1))
        m = re.search(r"exit code: (\S+) wall (\d+) ms", line)
        if m: w = (m.group(1), int(m.group(2)))
    return c, g, w
print("| variant | caches | compile time (ms) | graph capture (ms) | compile + graph (ms) | process wall (ms) | exit |")
print("|---|---|---|---|---|---|---|")
rows = [(v, "empty", f"{out}/cold-{v}-{r}.log") for r in range(1, rounds + 1) for v in variants]
rows.append((variants[0], "warm", f"{out}/warm-{variants[0]}.log"))
for v, caches, path in rows:
    c, g, w = parse(path)
    both = c + g if c is not None and g is not None else None
    print(f"| {v} | {caches} | {c} | {g} | {both} | {w[1] if w else None} | {w[0] if w else None} |")
for line in open(f"{out}/torch-compile-time.log", errors="replace") if glob.glob(f"{out}/torch-compile-time.log") else []:
    if line.startswith("RESULT "):
        r = json.loads(line[7:])
        print(f"| torch.compile warm-up (compile + 1 step) | its own | {r.get('warmup_s')} s | | | | |")
PY
