#!/usr/bin/env bash
# Runs on the GPU machine from a folder staged by engine_here.sh (bin/oflaunch, bin/gpt_bench,
# llama_bench.py, llama_checkpointed.py): the Llama-3.2-1B shape (16 layers, width 2048, 32
# heads, 8 KV heads, FFN 8192, vocabulary 128256, tied, bf16-mixed, AdamW, clipping) at long
# sequences on one GPU, micro-batch 1, for each seq in $SEQS: ours (`gpt_bench --arch llama`,
# --recompute none and full) beside llama_bench.py --compile without and with transformers'
# gradient checkpointing (llama_checkpointed.py), each run's peak device memory as nvidia-smi
# sees it beside the program's own count. Logs under $OUT; a table of the runs last.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${OUT:-/tmp/long}
SEQS=${SEQS:-"16384 32768"}
STEPS=${STEPS:-4}
mkdir -p "$OUT"
nvidia-smi -L
. ./sampled.sh
for S in $SEQS; do
  for rc in none full; do
    sampled "$OUT/ours-$S-$rc.log" timeout 240 bin/oflaunch --nproc-per-node 1 --backend nccl \
      bin/gpt_bench --arch llama --layers 16 --width 2048 --heads 32 --kv-heads 8 \
      --ffn-width 8192 --vocab 128256 --tie-embeddings --seq "$S" --micro-batch 1 --warmup 2 \
      --steps "$STEPS" --precision bf16-mixed --recompute "$rc" --tag "oxiflow-$S-recompute-$rc"
  done
  sampled "$OUT/torch-$S-compile.log" timeout 300 python3 llama_bench.py --seq "$S" \
    --micro-batch 1 --warmup 2 --steps "$STEPS" --compile --tag "torch-$S-compile"
  sampled "$OUT/torch-$S-compile-ckpt.log" timeout 300 python3 llama_checkpointed.py --seq "$S" \
    --micro-batch 1 --warmup 2 --steps "$STEPS" --compile --tag "torch-$S-compile-checkpointed"
done
python3 - "$OUT" <<'PY'
import glob, json, sys
rows = []
for f in sorted(glob.glob(sys.argv[1] + "/*.log")):
    r, smi = None, None
    for line in open(f, errors="replace"):
        if "RESULT {" in line:
            r = json.loads(line[line.index("RESULT {") + 7:])
        if line.startswith("SMI_PEAK_MIB "):
            smi = float(line.split()[1] or "nan") if len(line.split()) > 1 else None
    tag = f.split("/")[-1][:-4]
    rows.append((tag, r, smi))
print("| run | seq | ms/step | tokens/s | MFU | own peak GiB | process peak GiB (nvidia-smi) |")
print("|---|---|---|---|---|---|---|")
for tag, r, smi in rows:
    s = f"{smi / 1024:.2f}" if smi else "-"
    if not r:
        print(f"| {tag} | | failed | | | | {s} |"); continue
    print(f"| {r['tag']} | {r['seq']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r.get('peak_mem_GiB', float('nan')):.2f} | {s} |")
PY
