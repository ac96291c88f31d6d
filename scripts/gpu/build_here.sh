#!/usr/bin/env bash
# Builds the GPU binaries on this (CUDA-less) machine and stages them in .carry/ (git-ignored)
# for the device tool's `carry`. cudarc loads CUDA at run time, so no CUDA is needed here.
# The library's own CUDA kernels are compiled here for sm_90 and embedded in the binaries
# (OXIFLOW_PREBUILD_ARCHS, OXIFLOW_NVRTC_LIB: see prebuilt_kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/prebuilt_kernels.sh
CARRY=.carry
rm -rf "$CARRY" && mkdir -p "$CARRY/bin"
cargo build --release -p oxiflow-collectives --bin nccl_bench --bin collectives_bench
cargo build --release -p oxiflow-tensor --bin dispatch_bench
cargo build --release -p oxiflow-cuda --bin gpu_boxing_bench
cargo build --release -p oxiflow-ops --bin attention_bench
cargo build --release -p oxiflow-launcher --bin oflaunch
cargo build --release --example train
cp target/release/nccl_bench target/release/gpu_boxing_bench target/release/oflaunch "$CARRY/bin/"
cp target/release/collectives_bench target/release/dispatch_bench target/release/attention_bench "$CARRY/bin/"
cp target/release/examples/train "$CARRY/bin/"
# Test executables: gpu_nccl (collectives), gpu_tensor (cuda), trace_timeline (run with
# OXIFLOW_TEST_BINS=.carry/bin so it uses the staged oflaunch and train).
for spec in "oxiflow-collectives gpu_nccl" "oxiflow-cuda gpu_tensor" "oxiflow trace_timeline"; do
  set -- $spec
  exe=$(scripts/gpu/test_executable.sh "$1" "$2")
  cp "$exe" "$CARRY/bin/$2"
done
strip "$CARRY"/bin/*
du -sh "$CARRY"
ls -la "$CARRY/bin"
