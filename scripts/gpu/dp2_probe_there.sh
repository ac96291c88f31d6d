#!/usr/bin/env bash
# Runs on a 2-GPU machine from a folder holding bin/ (oflaunch, gpt_bench): where DP2's step
# time over one GPU goes (GPT-2 124M, bf16-mixed, micro-batch 8 per GPU), as medians over
# REPEATS rounds of: one GPU; two independent one-GPU runs at once (interference without
# communication); DP2 with 10/25/100 MiB buckets and with one bucket at the end (1000 MiB: no
# overlap); 25 MiB buckets moving bf16; NCCL held to 4 and 8 channels (a slower all-reduce:
# how much of it the step sees); and the compiled step with 25 MiB buckets and one bucket.
# ONLY (a regex of tags) runs a subset. With TORCH=1 (and gpt2_bench.py beside), also torch's
# scaling at the same shape: eager and torch.compile on one GPU, then DDP under torchrun (tags
# torch1, torch2, torch1-compile, torch2-compile). Logs under $OUT; prints one line a variant:
# median ms, each run, scaling (one GPU / it); torch's rows after.
set -uo pipefail
cd "$(dirname "$0")"
. ./device_env.sh
device_cuda_env
device_out dp2
STEPS=${STEPS:-20}
REPEATS=${REPEATS:-2}
ONLY=${ONLY:-.}
gb() { # tag nproc flags...
  local tag=$1 n=$2
  shift 2
  [[ $tag == one || $tag =~ $ONLY ]] || return 0
  timeout 300 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/gpt_bench --dp "$n" \
    --precision bf16-mixed --micro-batch 8 --warmup 3 --steps "$STEPS" --tag "$tag" "$@" \
    > "$OUT/$tag@$r.log" 2>&1
}
for r in $(seq 1 "$REPEATS"); do
  gb one 1
  gb one-compiled 1 --compile
  CUDA_VISIBLE_DEVICES=0 gb pair-a 1 &
  CUDA_VISIBLE_DEVICES=1 gb pair-b 1 &
  wait
  for mb in 10 25 100 1000; do gb "b$mb" 2 --bucket-mb "$mb"; done
  gb b25-bf16 2 --bucket-mb 25 --reduce-dtype bf16
  NCCL_MAX_NCHANNELS=4 gb b25-ch4 2 --bucket-mb 25
  NCCL_MAX_NCHANNELS=8 gb b25-ch8 2 --bucket-mb 25
  gb b25-compiled 2 --bucket-mb 25 --compile
  gb b1000-compiled 2 --bucket-mb 1000 --compile
  if [ "${TORCH:-0}" = 1 ]; then
    for c in "" --compile; do
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 gpt2_bench.py --micro-batch 8 --steps "$STEPS" \
        $c --tag "torch1$c" > "$OUT/torch1$c@$r.log" 2>&1
      timeout 300 torchrun --standalone --nproc-per-node 2 gpt2_bench.py --micro-batch 8 \
        --steps "$STEPS" $c --tag "torch2$c" > "$OUT/torch2$c@$r.log" 2>&1
    done
  fi
done
grep -h "rror" "$OUT"/*.log | head -5
python3 - "$OUT" <<'PY'
import statistics, sys
from result_logs import rank0_rounds
runs = {t: [r["ms_per_step"] for r in rs] for t, rs in rank0_rounds(sys.argv[1]).items()}
def show(tags, one):
    for tag in tags:
        m = statistics.median(runs[tag])
        print(f"{tag:16s} {m:7.2f} ms  each {runs[tag]}  scaling {one / m:.3f}")
ours = sorted(t for t in runs if not t.startswith("torch"))
show(ours, statistics.median(runs.get("one", [float("nan")])))
for c in ["", "--compile"]:
    if f"torch1{c}" in runs:
        show([t for t in (f"torch1{c}", f"torch2{c}") if t in runs], statistics.median(runs[f"torch1{c}"]))
PY
