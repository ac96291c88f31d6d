#!/usr/bin/env bash
# Builds the engine's GPU binaries on this (CUDA-less) machine and stages them with the device
# scripts and the PyTorch anchors in .carry/engine (git-ignored) for the device tool's `carry`;
# on the device: `.carry/engine/engine_there.sh` (see its header for what it runs).
# The library's own CUDA kernels are compiled here for sm_90 and embedded in the binaries
# (OXIFLOW_PREBUILD_ARCHS, OXIFLOW_NVRTC_LIB: see prebuilt_kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/prebuilt_kernels.sh
. scripts/gpu/stage_launcher.sh
DEST=.carry/engine
ANCHORS=${ANCHORS:-../shared/anchors}
stage_launcher "$DEST" train gpt_bench
cargo build --release -p oxiflow-cuda --bins
cargo build --release -p oxiflow-ops --bin attention_bench
for b in gpu_kernels_check attention_bench; do
  [ -x "target/release/$b" ] && cp "target/release/$b" "$DEST/bin/"
done
cp "$(scripts/gpu/test_executable.sh oxiflow-cuda gpu_tensor)" "$DEST/bin/gpu_tensor"
cp "$(scripts/gpu/test_executable.sh oxiflow gpu_compile)" "$DEST/bin/gpu_compile"
for t in swiglu_cuda sum_squares_cuda rms_norm_cuda argmax_cuda moe_cuda decode_cuda context_parallel_cuda rotary_cuda; do
  cp "$(scripts/gpu/test_executable.sh oxiflow-ops "$t")" "$DEST/bin/ops_$t"
done
strip "$DEST"/bin/*
cp scripts/gpu/*_there.sh scripts/gpu/sampled.sh scripts/gpu/device_env.sh scripts/gpu/*.py scripts/gpu/*.c "$ANCHORS/gpt2_bench.py" "$ANCHORS/llama_bench.py" "$DEST/"
cp scripts/hf_fixtures.py scripts/hf_check_save.py "$DEST/"
cp -r tests/fixtures/hf "$DEST/hf_fixtures"
du -sh "$DEST"
