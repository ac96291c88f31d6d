#!/usr/bin/env bash
# Runs on a 2-GPU machine (no Rust there) from the folder pipes_here.sh staged (bin/ with
# oflaunch, train and the gpu_pipeline test; twin_gpt.py), in one command under 9 minutes:
#  1. the gpu_pipeline suite: NCCL curves vs the CPU backend's (--precision f32, 30 steps, at
#     most 1e-5 relative) for PP2 GPipe, 1F1B, interleaved, PP2 ZeRO-1 + full recompute, DP2
#     and TP2; and the refused device worlds (stages on one GPU, more ranks than GPUs);
#  2. GPT-2 $MODEL (124m: 12 x 768, 12 heads; 350m: 24 x 1024, 16 heads; T 1024, GPT-2
#     vocabulary 50257 in a table padded to 50304 on both sides, batch 16 in 4
#     micro-batches, bf16-mixed, AdamW, clip 1.0): our PP2 1F1B and interleaved (2 chunks per
#     stage) next to torch.distributed.pipelining's Schedule1F1B and ScheduleInterleaved1F1B
#     (twin_gpt.py), tokens/s per GPU over the steps after the warm-up and peak memory per GPU
#     (each program's own count, and nvidia-smi's largest use per GPU during the run), and for
#     our pipelines the measured bubble beside the schedule's theory;
#  3. a short table last. Logs under $OUT (default /tmp/pipes).
# Usage: bash pipes_there.sh   (env: STEPS=12 WARMUP=3 T_SUITE=210 T_RUN=75 SUITE=1,
#   LAYOUTS="1f1b interleaved", any of 1f1b interleaved dp2 zero2 zero3 tp2 tp2sp, MODEL=124m)
set -uo pipefail
cd "$(dirname "$0")"
# NVLink multicast must stay off on these machines, in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/pipes}
STEPS=${STEPS:-12}
WARMUP=${WARMUP:-3}
T_RUN=${T_RUN:-75}
LAYOUTS=${LAYOUTS:-"1f1b interleaved"}
MODEL=${MODEL:-124m}
case $MODEL in
  124m) DIMS=(--layers 12 --width 768 --heads 12) ;;
  350m) DIMS=(--layers 24 --width 1024 --heads 16) ;;
  *) echo "pipes_there: unknown MODEL $MODEL (124m or 350m)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi -L | tee "$OUT/gpus.txt"
status=0

# 1. The suite (SUITE=0 skips it).
if [ "${SUITE:-1}" = 1 ]; then
  t=$(date +%s)
  OXIFLOW_TEST_BINS=$PWD/bin OXIFLOW_TIMEOUT=60 timeout "${T_SUITE:-210}" \
    bin/gpu_pipeline --nocapture --test-threads 1 > "$OUT/gpu_pipeline.log" 2>&1
  suite=$?
  grep -h "^gpu_pipeline\|^test \|test result\|panicked" "$OUT/gpu_pipeline.log" | cut -c1-300
  echo "gpu_pipeline exit code: $suite ($(( $(date +%s) - t )) s)"
  [ "$suite" = 0 ] || status=1
fi

# 2. Throughput and memory, ours then the twins, one run at a time, nvidia-smi sampling the
#    memory use of each GPU meanwhile (OUT/<tag>.mem).
measure() { # tag command...
  local tag=$1; shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/$tag.mem" 2>/dev/null &
  local smi=$!
  local t=$(date +%s)
  timeout "$T_RUN" "$@" > "$OUT/$tag.log" 2>&1
  local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  echo "$tag exit code: $rc ($(( $(date +%s) - t )) s)"
  [ "$rc" = 0 ] || { status=1; grep -h "rror" "$OUT/$tag.log" | grep -v "^W" | tail -4 | cut -c1-300; }
}
GPT2=("${DIMS[@]}" --seq-len 1024 --tokenizer gpt2 --batch-size 16
      --precision bf16-mixed --device cuda --optimizer adamw --lr 6e-4
      --weight-decay 0.1 --clip-grad 1.0 --steps "$STEPS" --log-every 1 --gen-tokens 0)
# A layout: our flags | the twin's layout.
layout_of() {
  case $1 in
    1f1b) echo "--pp 2 --micro-batches 4 --schedule 1f1b|pp-1f1b" ;;
    interleaved) echo "--pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2|pp-interleaved" ;;
    dp2) echo "--dp 2|ddp" ;;
    zero2) echo "--dp 2 --zero 2|fsdp-keep" ;;
    zero3) echo "--dp 2 --zero 3|fsdp" ;;
    tp2) echo "--tp 2|tp" ;;
    tp2sp) echo "--tp 2 --sp|tp-sp" ;;
    *) echo "pipes_there: unknown layout $1" >&2; return 1 ;;
  esac
}
for layout in $LAYOUTS; do
  spec=$(layout_of "$layout") || { status=1; continue; }
  IFS='|' read -r ours twin <<< "$spec"
  # shellcheck disable=SC2086
  measure "ours-$layout" bin/oflaunch --nproc-per-node 2 --backend nccl bin/train "${GPT2[@]}" $ours
  measure "torch-$layout" python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    twin_gpt.py --models "$MODEL" --layouts "$twin" --batch 16 --seq 1024 --vocab 50257 \
    --micro-batches 4 --chunks 2 --warmup "$WARMUP" --steps $(( STEPS - WARMUP )) --tag twin
done

# 3. The table.
python3 - "$OUT" "$WARMUP" "$MODEL" $LAYOUTS <<'EOF'
import json, re, sys
out, warm, model, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
tokens_per_step = 16 * 1024
# MFU: (6 N + 12 L d T) FLOPs per token over the card's dense bf16 peak (H100/H200 SXM: 989
# TFLOP/s), N the parameters without the position table (vocabulary table 50304 wide).
L, d = {"124m": (12, 768), "350m": (24, 1024)}[model]
T, V = 1024, 50304
n_mfu = V * d + L * (12 * d * d + 13 * d) + 2 * d
flops_tok = 6 * n_mfu + 12 * L * d * T
def mfu(tok_per_gpu):
    return f"{100 * tok_per_gpu * flops_tok / 989e12:.1f}%"

def smi(tag):
    peak = {}
    try:
        for line in open(f"{out}/{tag}.mem"):
            i, used = (x.strip() for x in line.split(","))
            peak[i] = max(peak.get(i, 0), int(used))
    except (OSError, ValueError):
        pass
    return " / ".join(f"{peak[i] / 1024:.2f}" for i in sorted(peak)) or "-"

def ours(tag):
    text = open(f"{out}/{tag}.log", errors="replace").read()
    # Step n's tokens/s counts from the start of step 1: n steps took n x tokens / rate.
    at = {int(n): int(n) * tokens_per_step / float(r)
          for n, r in re.findall(r"step (\d+) loss \S+ lr \S+ grad-norm \S+ tokens/s (\d+)", text)
          if float(r) > 0}
    last = max(at, default=0)
    if last <= warm or warm not in at:
        return None
    tps = (last - warm) * tokens_per_step / (at[last] - at[warm])
    dev = re.search(r"step peak host .* device (\d+) B", text)
    loss = re.findall(r"step \d+ loss (\S+)", text)
    bub = re.search(r"bubble: measured (\S+)% theory (\S+)%", text)
    return {"bubble": f"{bub.group(1)}% (theory {bub.group(2)}%)" if bub else "-","tok": tps / 2, "ms": 1000 * (at[last] - at[warm]) / (last - warm),
            "own": f"{int(dev.group(1)) / 2**30:.2f} (rank 0)" if dev else "-",
            "loss": loss[-1] if loss else "-"}

def twin(tag):
    for line in open(f"{out}/{tag}.log", errors="replace"):
        if "RESULT {" in line:
            r = json.loads(line[line.index("RESULT {") + 7:])
            if "error" in r:
                return None
            return {"tok": r["tokens_per_s_per_gpu"], "ms": r["ms_per_step"],
                    "own": f'{r["peak_mem_GiB"]:.2f} (max of ranks)', "loss": r["final_loss"],
                    "bubble": "-"}
    return None

print()
print(f"GPT-2 {model} on 2 GPUs, batch 16 x 1024 (pipelines: 4 micro-batches), bf16-mixed, after "
      f"{warm} warm-up steps:")
print("| run | tokens/s per GPU | MFU | ms/step | vs twin | peak GiB (own count) | nvidia-smi GiB GPU0 / GPU1 | bubble | last loss |")
print("|---|---|---|---|---|---|---|---|---|")
for layout in layouts:
    rows = []
    for tag, read in [(f"ours-{layout}", ours), (f"torch-{layout}", twin)]:
        try:
            rows.append((tag, read(tag)))
        except OSError:
            rows.append((tag, None))
    base = rows[1][1]
    for tag, r in rows:
        if r is None:
            print(f"| {tag} | failed (see {out}/{tag}.log) |||||||")
            continue
        ratio = f'{r["tok"] / base["tok"]:.2f}x' if base and tag.startswith("ours") else "-"
        print(f'| {tag} | {r["tok"]:,.0f} | {mfu(r["tok"])} | {r["ms"]:.1f} | {ratio} | {r["own"]} | {smi(tag)} | {r["bubble"]} | {r["loss"]} |')
EOF
echo "pipes_there: exit status $status ($(( $(date +%s) - start )) s in all)"
exit $status
