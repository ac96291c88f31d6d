#!/usr/bin/env bash
# Builds the GPU binaries on this (CUDA-less) machine and stages them in .carry/ (git-ignored)
# for the device tool's `carry`. cudarc loads CUDA at run time, so no CUDA is needed here.
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.carry
rm -rf "$CARRY" && mkdir -p "$CARRY/bin"
cargo build --release -p oxiflow-collectives --bin nccl_bench
cp target/release/nccl_bench "$CARRY/bin/"
exe=$(cargo test --release -p oxiflow-collectives --test gpu_nccl --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu_nccl":
        print(m["executable"])')
cp "$exe" "$CARRY/bin/gpu_nccl"
strip "$CARRY"/bin/*
du -sh "$CARRY"
ls -la "$CARRY/bin"
