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
. scripts/gpu/stage_launcher.sh
DEST=.carry/compile
stage_launcher "$DEST" train
cp "$(scripts/gpu/test_executable.sh oxiflow gpu_compile)" "$DEST/bin/gpu_compile"
strip "$DEST"/bin/*
du -sh "$DEST"
