#!/usr/bin/env bash
# Sourced by the *_here.sh scripts before they build device binaries: the library's own CUDA
# kernels are compiled at build time for the device machines' architecture and embedded in the
# binaries (cuda/build.rs), so a process with an empty kernel cache compiles only a compiled
# step's generated kernels. OXIFLOW_PREBUILD_ARCHS defaults to sm_90 (H100/H200; set it empty
# to build without); OXIFLOW_NVRTC_LIB, unless set, is this machine's NVRTC when found in a
# Python environment's nvidia/cu13/lib (else the build searches CUDA_HOME, LD_LIBRARY_PATH, the
# CUDA folders and the Python wheels itself, and fails when it finds no NVRTC).
: "${OXIFLOW_PREBUILD_ARCHS=sm_90}"
export OXIFLOW_PREBUILD_ARCHS
if [ -n "$OXIFLOW_PREBUILD_ARCHS" ] && [ -z "${OXIFLOW_NVRTC_LIB:-}" ]; then
  for d in /tmp/nvrtc/*/nvidia/cu13/lib /tmp/*/lib/python3*/site-packages/nvidia/cu13/lib \
    "$HOME"/.local/lib/python3*/site-packages/nvidia/cu13/lib \
    /usr/local/lib/python3*/dist-packages/nvidia/cu13/lib; do
    if [ -e "$d/libnvrtc.so.13" ]; then
      export OXIFLOW_NVRTC_LIB="$d/libnvrtc.so.13"
      break
    fi
  done
fi
echo "prebuilt kernels: OXIFLOW_PREBUILD_ARCHS=${OXIFLOW_PREBUILD_ARCHS:-<none>} OXIFLOW_NVRTC_LIB=${OXIFLOW_NVRTC_LIB:-<searched by the build>}" >&2
