#!/usr/bin/env bash
# Runs on a GPU machine from a folder holding two builds' binaries, bin/ (the new one) and
# old/ (gpt_bench and oflaunch of the build before a change), with gpt2_bench.py beside: the
# GPT-2 step of each build in turn, ROUNDS rounds alternating with torch.compile's, at each
# micro-batch of SIZES (124M, bf16-mixed, one GPU; MODES "eager" and/or "compile" for ours).
# Prints the medians and the ratios (old / new, torch.compile / each); the runs' lines are in
# $OUT/results.txt.
set -uo pipefail
cd "$(dirname "$0")"
. ./device_env.sh
device_cuda_env
device_out ab
STEPS=${STEPS:-30}
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-8}
MODES=${MODES:-eager}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
for r in $(seq 1 "$ROUNDS"); do
  for mb in $SIZES; do
    for b in old bin; do
      for m in $MODES; do
        flag=$([ "$m" = compile ] && echo --compile)
        timeout 300 "$b/oflaunch" --nproc-per-node 1 --backend nccl "$b/gpt_bench" --dp 1 \
          --precision bf16-mixed --micro-batch "$mb" --warmup 3 --steps "$STEPS" $flag \
          --tag "$b-$m-$mb" > "$OUT/$b-$m-$mb-$r.log" 2>&1
        grep -h RESULT "$OUT/$b-$m-$mb-$r.log" | head -1
      done
    done
    timeout 300 python3 gpt2_bench.py --micro-batch "$mb" --warmup 3 --steps "$STEPS" --compile \
      --tag "torch-compile-$mb" > "$OUT/torch-$mb-$r.log" 2>&1
    grep -h RESULT "$OUT/torch-$mb-$r.log" | head -1
  done
done > "$OUT/results.txt"
python3 - "$OUT/results.txt" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    if "RESULT {" in line:
        r = json.loads(line.split("RESULT ", 1)[1])
        runs.setdefault(r["tag"], []).append(r)
def med(tag, key="ms_per_step"):
    v = [r[key] for r in runs.get(tag, []) if r.get(key) is not None]
    return statistics.median(v) if v else float("nan")
sizes = sorted({t.rsplit("-", 1)[1] for t in runs}, key=int)
print("| micro-batch | run | ms/step | MFU | own peak GiB | process GiB | old / new | torch.compile / it |")
print("|---|---|---|---|---|---|---|---|")
for mb in sizes:
    torch = med(f"torch-compile-{mb}")
    for tag in sorted(t for t in runs if t.endswith(f"-{mb}")):
        ms = med(tag)
        new = med(tag.replace("old-", "bin-"))
        old = med(tag.replace("bin-", "old-"))
        ratio = f"{old / new:.3f}" if tag.startswith("bin-") else ""
        print(f"| {mb} | {tag} | {ms:.2f} | {med(tag, 'mfu'):.3f} | {med(tag, 'peak_mem_GiB'):.2f} | "
              f"{med(tag, 'device_used_GiB'):.2f} | {ratio} | {torch / ms:.3f} |")
PY
