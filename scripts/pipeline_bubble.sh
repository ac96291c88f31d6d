#!/usr/bin/env bash
# Pipeline bubble per schedule: runs `train` under oflaunch (CPU backend, one compute thread
# per rank) for GPipe, 1F1B and interleaved 1F1B and prints a markdown table of the measured
# bubble (mean over ranks and steps of the schedule's time a rank did not compute) next to
# the theory. Usage: scripts/pipeline_bubble.sh [pp] [micro-batch counts...]
# With OXIFLOW_BIN_DIR (a folder holding oflaunch and train, e.g. on a machine without cargo)
# nothing is built. Combinations `train` refuses (e.g. layers not a multiple of pp x v) are
# listed as refused.
set -euo pipefail
cd "$(dirname "$0")/.."
PP=${1:-2}
shift || true
MBS=${*:-4 8}
if [ -n "${OXIFLOW_BIN_DIR:-}" ]; then
  LAUNCH=$OXIFLOW_BIN_DIR/oflaunch TRAIN=$OXIFLOW_BIN_DIR/train
else
  cargo build --release -q -p oxiflow-launcher --bin oflaunch
  cargo build --release -q --example train
  R=${CARGO_TARGET_DIR:-target}/release
  LAUNCH=$R/oflaunch TRAIN=$R/examples/train
fi
MODEL="--layers 8 --width 128 --heads 4 --seq-len 64 --batch-size 32 --steps 6 --gen-tokens 0 --log-every 100 --seed 1"
REPS=${REPS:-3}
echo "| pp | micro-batches | schedule | virtual stages | measured (median of $REPS runs) | theory | tokens/s (median) |"
echo "|---|---|---|---|---|---|---|"
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for m in $MBS; do
  for s in "gpipe 1" "1f1b 1" "interleaved 2" "interleaved 4"; do
    set -- $s
    bubbles=(); rates=(); theory=
    for _ in $(seq "$REPS"); do
      if ! out=$(RAYON_NUM_THREADS=1 "$LAUNCH" --nproc-per-node "$PP" --backend cpu "$TRAIN" \
        $MODEL --pp "$PP" --micro-batches "$m" --schedule "$1" --virtual-stages "$2" 2>&1); then
        echo "| $PP | $m | $1 | $2 | refused: $(grep -o 'error.*' <<<"$out" | head -1) | | |"
        continue 2
      fi
      b=$(grep -o 'measured [0-9.]*% theory [0-9.]*%' <<<"$out")
      bubbles+=("$(cut -d' ' -f2 <<<"$b" | tr -d %)")
      theory=$(cut -d' ' -f4 <<<"$b")
      rates+=("$(grep -o 'final loss.*' <<<"$out" | grep -o 'tokens/s [0-9]*' | cut -d' ' -f2)")
    done
    echo "| $PP | $m | $1 | $2 | $(printf '%s\n' "${bubbles[@]}" | median)% | $theory | $(printf '%s\n' "${rates[@]}" | median) |"
  done
done
