#!/usr/bin/env bash
# Runs on a 2-GPU machine (no Rust there) from a folder holding bin/ (oflaunch, train, the
# gpu_pipeline test) and twin_gpt.py, as staged by pipes_here.sh: (1) the pipeline suite:
# NCCL curves vs the CPU backend's for PP2 GPipe/1F1B/interleaved, PP2 ZeRO-1 + recompute, DP2,
# TP2, and the refused device worlds; (2) the PyTorch twins; a short table last. Logs under $OUT.
# Usage: pipes_there.sh   (env: MODELS=124m,350m LAYOUTS=... BATCH=16 STEPS=8 T_SUITE T_TWINS)
set -uo pipefail
cd "$(dirname "$0")"
# NVLink multicast must stay off on these machines, in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
OUT=${OUT:-/tmp/pipes}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
status=0
t0=$(date +%s)
OXIFLOW_TEST_BINS=$PWD/bin OXIFLOW_TIMEOUT=60 timeout "${T_SUITE:-170}" \
  bin/gpu_pipeline --nocapture --test-threads 1 > "$OUT/gpu_pipeline.log" 2>&1
suite=$?
grep -h "gpu_pipeline\|test result\|panicked" "$OUT/gpu_pipeline.log" | cut -c1-400
echo "gpu_pipeline exit code: $suite ($(( $(date +%s) - t0 )) s)"
[ "$suite" = 0 ] || status=1
t1=$(date +%s)
timeout "${T_TWINS:-110}" python3 -m torch.distributed.run --standalone --nproc-per-node 2 twin_gpt.py \
  --models "${MODELS:-124m,350m}" --layouts "${LAYOUTS:-ddp,fsdp,fsdp-keep,tp,tp-sp,pp-1f1b,pp-interleaved}" \
  --batch "${BATCH:-16}" --steps "${STEPS:-8}" --warmup 3 > "$OUT/twins.log" 2>&1
twins=$?
grep -h "Error\|error" "$OUT/twins.log" | grep -v "^W" | head -8 | cut -c1-300
echo "twins exit code: $twins ($(( $(date +%s) - t1 )) s)"
[ "$twins" = 0 ] || status=1
python3 - "$OUT/twins.log" <<'EOF'
import json, sys
rows = [json.loads(l[l.index("RESULT {") + 7:]) for l in open(sys.argv[1], errors="replace") if "RESULT {" in l]
print("| model | layout | ms/step | tokens/s per GPU | MFU | peak GiB per GPU | loss |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print(f'| {r["model"]} | {r["layout"]} | error: {r["error"][:120]} |||||')
        continue
    print(f'| {r["model"]} | {r["layout"]} | {r["ms_per_step"]} | {r["tokens_per_s_per_gpu"]:,} | '
          f'{100 * r["mfu"]:.1f}% | {r["peak_mem_GiB"]} | {r["final_loss"]} |')
EOF
echo "pipes_there: exit status $status"
exit $status
