#!/usr/bin/env bash
# Builds the compiled step's GPU check on this (CUDA-less) machine and stages it in
# .carry/compile (git-ignored) for the device tool's `carry`; on the device:
#   OXIFLOW_TEST_BINS=.carry/compile/bin .carry/compile/bin/gpu_compile --nocapture
# (tests/gpu_compile.rs: `train --device cuda --compile` against eager on 1 and 2 GPUs).
# The library's own CUDA kernels are compiled here for sm_90 and embedded in the binaries
# (OXIFLOW_PREBUILD_ARCHS, OXIFLOW_NVRTC_LIB: see prebuilt_kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/prebuilt_kernels.sh
DEST=.carry/compile
rm -rf "$DEST" && mkdir -p "$DEST/bin"
cargo build --release -p oxiflow-launcher --bin oflaunch
cargo build --release --example train
cp target/release/oflaunch target/release/examples/train "$DEST/bin/"
cp "$(scripts/gpu/test_executable.sh oxiflow gpu_compile)" "$DEST/bin/gpu_compile"
strip "$DEST"/bin/*
du -sh "$DEST"
