#!/usr/bin/env bash
# Builds and stages what two_gpu_there.sh runs (oflaunch, train, gpt_bench, the gpu_tensor suite; the overlap,
# pipeline and twin scripts) in .carry/two (git-ignored) for the device tool's `carry`; on a
# 2-GPU device: `bash .carry/two/two_gpu_there.sh`.
# The library's own CUDA kernels are compiled here for sm_90 and embedded in the binaries
# (OXIFLOW_PREBUILD_ARCHS, OXIFLOW_NVRTC_LIB: see prebuilt_kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/prebuilt_kernels.sh
. scripts/gpu/stage_launcher.sh
DEST=.carry/two
stage_launcher "$DEST" train gpt_bench
cp "$(scripts/gpu/test_executable.sh oxiflow-cuda gpu_tensor)" "$DEST/bin/gpu_tensor"
strip "$DEST"/bin/*
cp scripts/gpu/two_gpu_there.sh scripts/gpu/overlap_there.sh scripts/gpu/device_env.sh scripts/gpu/trace_overlap.py scripts/gpu/trace_breakdown.py \
  scripts/gpu/pipes_there.sh scripts/gpu/twin_gpt.py "$DEST/"
du -sh "$DEST"
