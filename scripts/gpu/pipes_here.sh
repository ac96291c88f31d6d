#!/usr/bin/env bash
# Builds what pipes_there.sh runs (oflaunch, train, the gpu_pipeline test) on this CUDA-less
# machine (cudarc loads CUDA at run time) and stages them, stripped, with pipes_there.sh and
# twin_gpt.py in DEST (default .carry/pipes, git-ignored) for the device tool's `carry`.
# Usage: scripts/gpu/pipes_here.sh [DEST]; then on the device: bash DEST/pipes_there.sh
# The library's own CUDA kernels are compiled here for sm_90 and embedded in the binaries
# (OXIFLOW_PREBUILD_ARCHS, OXIFLOW_NVRTC_LIB: see prebuilt_kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/prebuilt_kernels.sh
. scripts/gpu/stage_launcher.sh
DEST=${1:-.carry/pipes}
stage_launcher "$DEST" train
exe=$(scripts/gpu/test_executable.sh oxiflow gpu_pipeline)
cp "$exe" "$DEST/bin/gpu_pipeline"
strip "$DEST"/bin/*
cp scripts/gpu/pipes_there.sh scripts/gpu/twin_gpt.py "$DEST/"
du -sh "$DEST"
ls -la "$DEST/bin"
