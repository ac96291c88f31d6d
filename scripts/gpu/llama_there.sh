#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh (bin/oflaunch, bin/gpt_bench,
# llama_bench.py): the Llama-3.2-1B shape (16 layers, width 2048, 32 heads, 8 KV heads, FFN
# 8192, vocabulary 128256, tied, rope theta 500000, seq 2048, micro-batch $MB (4), bf16-mixed,
# AdamW, clipping at 1.0) on one GPU: ours (`gpt_bench --arch llama`, eager and --compile)
# beside llama_bench.py eager and --compile, $ROUNDS rounds (default 1) interleaved. Each run's
# peak device memory as nvidia-smi sees it (what an out-of-memory error sees: the GPU's used
# memory sampled every 100 ms, only that process running) beside the program's own count.
# Logs under $OUT; a table of medians last.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/llama}
MB=${MB:-4}
STEPS=${STEPS:-10}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT"
nvidia-smi -L
. ./sampled.sh
DIMS=(--layers 16 --width 2048 --heads 32)
for r in $(seq "$ROUNDS"); do
  for mode in eager compile; do
    flag=(); [ "$mode" = compile ] && flag=(--compile)
    sampled "$OUT/ours-$mode-$r.log" timeout 300 bin/oflaunch --nproc-per-node 1 --backend nccl \
      bin/gpt_bench --arch llama "${DIMS[@]}" --kv-heads 8 --ffn-width 8192 --vocab 128256 \
      --tie-embeddings --seq 2048 --micro-batch "$MB" --warmup 4 --steps "$STEPS" \
      --precision bf16-mixed "${flag[@]}" --tag "oxiflow-$mode"
    sampled "$OUT/torch-$mode-$r.log" timeout 400 python3 llama_bench.py --micro-batch "$MB" \
      --steps "$STEPS" "${flag[@]}" --tag "torch-$mode"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
runs = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.log")):
    r, smi = None, None
    for line in open(f, errors="replace"):
        if "RESULT {" in line:
            r = json.loads(line[line.index("RESULT {") + 7:])
        if line.startswith("SMI_PEAK_MIB "):
            smi = float(line.split()[1] or "nan")
    if r:
        r["smi_GiB"] = smi / 1024 if smi else float("nan")
        runs.setdefault(r["tag"], []).append(r)
def med(tag, k):
    v = [x.get(k) for x in runs.get(tag, []) if isinstance(x.get(k), (int, float))]
    return statistics.median(v) if v else float("nan")
print("| run | ms/step | tokens/s | MFU | own peak GiB | process peak GiB (nvidia-smi) | vs torch.compile | mem vs torch.compile |")
print("|---|---|---|---|---|---|---|---|")
for tag in ["oxiflow-eager", "oxiflow-compile", "torch-eager", "torch-compile"]:
    if tag not in runs:
        print(f"| {tag} | failed |||||||"); continue
    ms, tok = med(tag, "ms_per_step"), med(tag, "tokens_per_s")
    own = med(tag, "peak_mem_GiB")
    smi = med(tag, "smi_GiB")
    tc_tok, tc_smi = med("torch-compile", "tokens_per_s"), med("torch-compile", "smi_GiB")
    print(f"| {tag} | {ms:.2f} | {tok:,.0f} | {100 * med(tag, 'mfu'):.1f}% | {own:.2f} | {smi:.2f} | {tok / tc_tok:.3f} | {smi / tc_smi:.2f} |")
PY
