#!/usr/bin/env bash
# Runs on a 2-GPU machine from a folder holding bin/ (oflaunch, gpt_bench): the untraced
# timeline of GPT-2 124M (bf16-mixed, micro-batch 8 per GPU) on one GPU and under DP2, eager and
# compiled, recorded by the CUPTI injection library cupti_timeline.c (built here with the
# machine's CUPTI), then where each device's step goes (timeline_report.py; DP2 against one GPU).
# VARIANTS picks a subset of: one dp2 one-compiled dp2-compiled torch torch-compiled (the last
# two: ../shared/anchors/gpt2_bench.py beside, same shape, on one GPU). Logs and timelines
# (timelines.tgz) under $OUT.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/timeline}
STEPS=${STEPS:-12}
VARIANTS=${VARIANTS:-one dp2 one-compiled dp2-compiled}
mkdir -p "$OUT"
hdr=$(find /usr/local/cuda* /usr/lib /opt -name cupti.h -path '*include*' 2>/dev/null | head -1)
lib=$(find /usr/local/cuda* /usr/lib /opt -name 'libcupti.so*' 2>/dev/null | head -1)
if [ -z "$hdr" ] || [ -z "$lib" ]; then
  echo "no CUPTI here (header '$hdr', library '$lib')"
  exit 1
fi
inc=$(dirname "$hdr")
pick() { grep -ohE "$1[0-9]+" "$inc"/cupti_activity*.h | sort -uV | tail -1; }
cc -O2 -shared -fPIC -o "$OUT/libcupti_timeline.so" cupti_timeline.c -I"$inc" \
  -I/usr/local/cuda-13.0/targets/x86_64-linux/include \
  -DKREC="$(pick CUpti_ActivityKernel)" -DCREC="$(pick CUpti_ActivityMemcpy)" \
  -DSREC="$(pick CUpti_ActivityMemset)" -L"$(dirname "$lib")" -lcupti -Wl,-rpath,"$(dirname "$lib")" \
  || { echo "the injection library did not build"; exit 1; }
run() { # variant nproc flags...
  local v=$1 n=$2
  shift 2
  [[ " $VARIANTS " == *" $v "* ]] || return 0
  mkdir -p "$OUT/$v"
  CUDA_INJECTION64_PATH="$OUT/libcupti_timeline.so" CUPTI_TIMELINE_DIR="$OUT/$v" \
    timeout 300 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/gpt_bench --dp "$n" \
    --precision bf16-mixed --micro-batch 8 --warmup 3 --steps "$STEPS" --tag "$v" "$@" \
    > "$OUT/$v.log" 2>&1 || echo "$v failed: $(tail -3 "$OUT/$v.log")"
  echo "$v: $(grep -ohE '"ms_per_step": *[0-9.]+' "$OUT/$v.log" | head -2 | tr '\n' ' ') \
$(wc -l "$OUT/$v"/timeline-*.txt 2>/dev/null | tail -1)"
}
CUDA_VISIBLE_DEVICES=0 run one 1
run dp2 2 --bucket-mb 25
CUDA_VISIBLE_DEVICES=0 run one-compiled 1 --compile
run dp2-compiled 2 --bucket-mb 25 --compile
torch_run() { # variant flags...
  local v=$1
  shift
  [[ " $VARIANTS " == *" $v "* ]] || return 0
  mkdir -p "$OUT/$v"
  CUDA_VISIBLE_DEVICES=0 CUDA_INJECTION64_PATH="$OUT/libcupti_timeline.so" CUPTI_TIMELINE_DIR="$OUT/$v" \
    timeout 300 python3 gpt2_bench.py --micro-batch 8 --warmup 3 --steps "$STEPS" --tag "$v" "$@" \
    > "$OUT/$v.log" 2>&1 || echo "$v failed: $(tail -3 "$OUT/$v.log")"
  echo "$v: $(grep -ohE '"ms_per_step": *[0-9.]+' "$OUT/$v.log" | head -1)"
}
torch_run torch
torch_run torch-compiled --compile
for v in $VARIANTS; do
  [ -d "$OUT/$v" ] || continue
  echo "== $v"
  case $v in
  dp2) python3 timeline_report.py "$OUT/$v" --against "$OUT/one" ;;
  dp2-compiled) python3 timeline_report.py "$OUT/$v" --against "$OUT/one-compiled" ;;
  torch*) python3 timeline_report.py "$OUT/$v" --step adam --top 12 ;;
  *) python3 timeline_report.py "$OUT/$v" --top 12 ;;
  esac
done
tar czf "$OUT/timelines.tgz" -C "$OUT" $(cd "$OUT" && ls -d $VARIANTS 2>/dev/null) 2>/dev/null
