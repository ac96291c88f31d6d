#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh: GPT-2 124M on one GPU, our
# eager and compiled steps beside torch.compile (gpt2_bench.py --compile), interleaved: for
# each micro-batch of $SIZES (default "8 16 32"), $ROUNDS rounds (default 2) of ours eager,
# ours compiled, torch.compile, so a drift of the GPU touches all alike. $EXTRA adds
# "tag=path" binaries of gpt_bench (e.g. an older build) to each round, $VARIANTS "tag=flags"
# runs of ours with more flags (commas between flags, e.g. "gelu=--recompute,gelu"; a first
# "bin:PATH" runs that binary instead of bin/gpt_bench). NPROC=2: data
# parallel on two GPUs (ours --dp 2, torch.compile DDP under torchrun); MODEL=350m: GPT-2
# medium (24 layers, width 1024, 16 heads); COMPILED=0 leaves our compiled step out. Table of
# medians last.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/interleaved}
SIZES=${SIZES:-8 16 32}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-20}
NPROC=${NPROC:-1}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NPROC - 1)))}
case "${MODEL:-124m}" in
  350m) OURS_DIMS=(--layers 24 --width 1024 --heads 16); TORCH_DIMS=(--n-layer 24 --n-embd 1024 --n-head 16) ;;
  *) OURS_DIMS=(); TORCH_DIMS=() ;;
esac
DP=(); TORCH=(python3)
if [ "$NPROC" -gt 1 ]; then
  DP=(--dp "$NPROC"); TORCH=(torchrun --standalone --nproc-per-node "$NPROC")
fi
mkdir -p "$OUT"
nvidia-smi -L
ours() { # tag binary micro-batch round [flags...]
  timeout 300 bin/oflaunch --nproc-per-node "$NPROC" --backend nccl "$2" --precision bf16-mixed \
    --micro-batch "$3" --warmup 4 --steps "$STEPS" "${OURS_DIMS[@]}" "${DP[@]}" "${@:5}" --tag "$1" \
    > "$OUT/$1-$3-$4.log" 2>&1 \
    || echo "$1 mb $3 round $4 failed: $(tail -2 "$OUT/$1-$3-$4.log")"
}
for b in $SIZES; do
  for r in $(seq "$ROUNDS"); do
    ours oxiflow bin/gpt_bench "$b" "$r"
    [ "${COMPILED:-1}" = 1 ] && ours oxiflow-compiled bin/gpt_bench "$b" "$r" --compile
    for x in ${EXTRA:-}; do ours "${x%%=*}" "${x#*=}" "$b" "$r"; done
    for v in ${VARIANTS:-}; do
      flags=${v#*=} binary=bin/gpt_bench
      case "$flags" in bin:*) binary=${flags%%,*}; binary=${binary#bin:}; flags=${flags#*,} ;; esac
      # shellcheck disable=SC2086
      ours "${v%%=*}" "$binary" "$b" "$r" ${flags//,/ }
    done
    timeout 300 "${TORCH[@]}" gpt2_bench.py --micro-batch "$b" --steps "$STEPS" "${TORCH_DIMS[@]}" \
      --compile --tag compile \
      > "$OUT/compile-$b-$r.log" 2>&1 || echo "torch.compile mb $b round $r failed"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*.log")):
    for line in open(f, errors="replace"):
        # One line per run: rank 0's (oflaunch prefixes each rank's lines).
        if "RESULT {" in line and ("[rank " not in line or "[rank 0]" in line):
            r = json.loads(line[line.index("RESULT {") + 7:])
            runs[(r["tag"], r["micro_batch"])].append(r)
print("| run | micro-batch | ms/step each | median | tokens/s | MFU | peak GiB | torch.compile / this |")
print("|---|---|---|---|---|---|---|---|")
for (tag, b), rs in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    ms = statistics.median(r["ms_per_step"] for r in rs)
    tc = runs.get(("compile", b))
    vs = f'{statistics.median(r["ms_per_step"] for r in tc) / ms:.3f}' if tc else "-"
    each = ", ".join(f'{r["ms_per_step"]:.2f}' for r in rs)
    mfu = statistics.median(r["mfu"] for r in rs)
    peak = max(r["peak_mem_GiB"] for r in rs)
    print(f"| {tag} | {b} | {each} | {ms:.2f} | {b * rs[0]['seq'] * 1000 / ms:,.0f} | {100 * mfu:.1f}% | {peak} | {vs} |")
PY
