#!/usr/bin/env bash
# Runs on a 2-GPU machine from the folder engine_here.sh staged: context and expert parallelism
# on CUDA, the parts named in $PARTS (default "kernels curves experts speed"):
#  kernels  ops_context_parallel_cuda, ops_moe_cuda, ops_rotary_cuda and ops_decode_cuda: the
#           CUDA kernels against the CPU ones in f64 (one GPU);
#  generate a small Llama trained on one GPU, then greedy and sampled generation from its
#           checkpoint on one GPU and under --cp 2 (the KV cache's positions split over the two
#           GPUs, each decoding step compiled): the ids side by side;
#  curves   a small Llama under `train --device cuda`: one GPU beside CP2 by ring and by
#           all-to-all and compiled CP2 by ring, in f32 and bf16-mixed, the largest relative gap of the logged losses;
#  experts  the Hugging Face fixtures Mixtral and Qwen2-MoE trained in f32 (load-balancing
#           coefficient 0.5) on one GPU and under --dp 2 --ep 2 (routed rows exchanged over
#           NCCL), the largest relative gap of the logged losses;
#  speed    the Llama-3.2-1B shape at seq $SEQ, micro-batch 1, bf16-mixed: ours on one GPU and
#           CP2 (gpt_bench --cp 2), beside llama_cp_bench.py (transformers + torch's
#           context_parallel, DDP) on one and two GPUs ($CPS), eager and --compile ($MODES
#           names which of ours, eager and compile run); each run's peak
#           process memory on GPU 0 by nvidia-smi, tokens/s and MFU per GPU; then a traced CP2
#           step: the share of the ring's exchanges (all_to_all_v) under compute kernels.
# Logs under $OUT; each part's table last in its part.
set -uo pipefail
cd "$(dirname "$0")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cp}
PARTS=${PARTS:-"kernels generate curves experts speed"}
SEQ=${SEQ:-16384}
STEPS=${STEPS:-4}
CPS=${CPS:-"1 2"}
MODES=${MODES:-"ours eager compile"}
mkdir -p "$OUT"
has() { [[ " $PARTS " == *" $1 "* ]]; }
. ./sampled.sh
if has kernels; then
  for t in context_parallel_cuda moe_cuda rotary_cuda decode_cuda; do
    s=$(date +%s)
    CUDA_VISIBLE_DEVICES=0 timeout 300 bin/ops_$t > "$OUT/kernels-$t.log" 2>&1
    echo "ops_$t exit code: $? ($(( $(date +%s) - s )) s)"
    grep -E "test result|FAILED|panicked|skipped" "$OUT/kernels-$t.log" | tail -8 | cut -c1-300
  done
fi
if has generate; then
  LLAMA="--model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --ffn-width 96 --rope-theta 500"
  timeout 180 bin/oflaunch --nproc-per-node 1 --backend nccl bin/train --device cuda $LLAMA \
    --seq-len 64 --batch-size 8 --steps 40 --seed 3 --gen-tokens 0 --precision f32 \
    --save "$OUT/gen-ckpt" > "$OUT/generate-train.log" 2>&1
  echo "generate: training exit code: $?"
  for sampling in "greedy --temperature 0" "sampled --temperature 0.8 --top-k 20"; do
    read -r kind how <<< "$sampling"
    for run in "one 1" "cp2 2 --cp 2"; do
      read -r tag n layout <<< "$run"
      timeout 180 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/train --device cuda \
        --resume "$OUT/gen-ckpt" --seed 3 --precision f32 --gen-tokens 40 \
        --prompt-ids "5,17,3,9,2;4,4,8,1,30;7,3,11,2,9,40,41" $how $layout \
        > "$OUT/generate-$kind-$tag.log" 2>&1
      echo "generate $kind $tag exit code: $?"
      grep -E "generation:|rror" "$OUT/generate-$kind-$tag.log" | head -3 | cut -c1-400
      grep "generated ids" "$OUT/generate-$kind-$tag.log" | sed "s/^/  $tag: /" | cut -c1-200
    done
  done
  for kind in greedy sampled; do
    a=$(grep "generated ids" "$OUT/generate-$kind-one.log")
    b=$(grep "generated ids" "$OUT/generate-$kind-cp2.log")
    verdict=DIFFER
    [ -n "$a" ] && [ "$a" = "$b" ] && verdict=EQUAL
    echo "generate $kind: one GPU and CP2 ids $verdict"
  done
fi
if has curves; then
  LLAMA="--model llama --layers 2 --width 64 --heads 4 --kv-heads 2 --ffn-width 96 --rope-theta 500"
  for prec in f32 bf16-mixed; do
    for run in "one 1" "ring 2 --cp 2" "alltoall 2 --cp 2 --cp-attention alltoall" \
      "ring-compiled 2 --cp 2 --compile"; do
      set -- $run
      tag=$1 n=$2; shift 2
      timeout 180 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/train --device cuda $LLAMA \
        --seq-len 64 --batch-size 8 --steps 30 --seed 3 --log-every 1 --gen-tokens 0 \
        --precision "$prec" "$@" > "$OUT/curve-$prec-$tag.log" 2>&1
      echo "curve $prec $tag exit code: $?"
    done
  done
fi
if has experts; then
  for model in mixtral qwen2_moe; do
    mkdir -p "$OUT/$model" && cp hf_fixtures/$model/* "$OUT/$model/"
    python3 - "$OUT/$model/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["router_aux_loss_coef"] = 0.5
json.dump(c, open(sys.argv[1], "w"))
PY
    for run in "one 1" "ep2 2 --dp 2 --ep 2" "ep2-compiled 2 --dp 2 --ep 2 --compile"; do
      set -- $run
      tag=$1 n=$2; shift 2
      timeout 180 bin/oflaunch --nproc-per-node "$n" --backend nccl bin/train --device cuda \
        --from-hf "$OUT/$model" --data hf_fixtures/tokens.bin --seq-len 16 --batch-size 4 \
        --precision f32 --gen-tokens 0 --steps 10 --log-every 1 --lr 0.003 "$@" \
        > "$OUT/experts-$model-$tag.log" 2>&1
      echo "experts $model $tag exit code: $?"
      grep -iE "error" "$OUT/experts-$model-$tag.log" | head -3 | cut -c1-300
    done
  done
fi
if has curves || has experts; then
  python3 - "$OUT" <<'PY'
import os, re, sys
def curve(f):
    out = {}
    for l in open(f, errors="replace"):
        m = re.match(r"(?:\[rank 0\])?\s*step (\d+) loss ([-\d.eE+naif]+)", l.strip())
        if m:
            out[int(m.group(1))] = float(m.group(2))
    return out
print("| run | layout | steps | first loss | last loss | max relative gap to one GPU |")
print("|---|---|---|---|---|---|")
runs = [(f"curve-{p}", ["one", "ring", "alltoall", "ring-compiled"]) for p in ["f32", "bf16-mixed"]]
runs += [(f"experts-{m}", ["one", "ep2", "ep2-compiled"]) for m in ["mixtral", "qwen2_moe"]]
for prec, tags in runs:
    if not os.path.exists(f"{sys.argv[1]}/{prec}-one.log"):
        continue
    one = curve(f"{sys.argv[1]}/{prec}-one.log")
    for tag in tags:
        c = curve(f"{sys.argv[1]}/{prec}-{tag}.log")
        common = sorted(set(c) & set(one))
        if not common:
            print(f"| {prec} | {tag} | 0 | | | failed |"); continue
        gap = max(abs(c[s] - one[s]) / abs(one[s]) for s in common)
        print(f"| {prec} | {tag} | {len(common)} | {c[common[0]]:.6f} | {c[common[-1]]:.6f} | {gap:.2e} |")
PY
fi
if has speed; then
  SHAPE="--arch llama --layers 16 --width 2048 --heads 32 --kv-heads 8 --ffn-width 8192 --vocab 128256 --tie-embeddings"
  for n in $CPS; do
    if [[ " $MODES " == *" ours "* ]]; then
      sampled "$OUT/ours-cp$n.log" timeout 300 bin/oflaunch --nproc-per-node "$n" --backend nccl \
        bin/gpt_bench $SHAPE --cp "$n" --seq "$SEQ" --micro-batch 1 --warmup 2 --steps "$STEPS" \
        --precision bf16-mixed --tag "oxiflow-cp$n"
    fi
    for m in $MODES; do
      [ "$m" = ours ] && continue
      c=$([ "$m" = compile ] && echo --compile)
      sampled "$OUT/torch-cp$n-$m.log" timeout 400 torchrun --standalone --nproc-per-node "$n" \
        llama_cp_bench.py --seq "$SEQ" --micro-batch 1 --warmup 2 --steps "$STEPS" $c \
        --tag "torch-cp$n-$m"
    done
  done
  python3 - "$OUT" <<'PY'
import glob, sys
from result_logs import last_result_and_peak
print("| run | seq | ms/step | tokens/s per GPU | MFU | own peak GiB | process peak GiB (GPU 0, nvidia-smi) |")
print("|---|---|---|---|---|---|---|")
for f in sorted(glob.glob(sys.argv[1] + "/ours-*.log") + glob.glob(sys.argv[1] + "/torch-*.log")):
    r, smi = last_result_and_peak(f)
    s = f"{smi / 1024:.2f}" if smi else "-"
    tag = f.split("/")[-1][:-4]
    if not r:
        print(f"| {tag} | | failed | | | | {s} |"); continue
    print(f"| {r['tag']} | {r['seq']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r.get('peak_mem_GiB', float('nan')):.2f} | {s} |")
PY
  if [ "${TRACE:-1}" = 1 ]; then
    # One traced CP2 run: the share of the ring's exchange time that ran under compute kernels.
    rm -rf "$OUT/trace"
    timeout 300 bin/oflaunch --nproc-per-node 2 --backend nccl --trace "$OUT/trace" bin/gpt_bench \
      $SHAPE --cp 2 --seq "$SEQ" --micro-batch 1 --warmup 1 --steps 1 --precision bf16-mixed \
      --tag traced > "$OUT/traced.log" 2>&1
    echo "traced exit code: $?"
    python3 trace_overlap.py "$OUT/trace/trace.json" --rank 0 --op all_to_all_v || tail -5 "$OUT/traced.log"
  fi
fi
