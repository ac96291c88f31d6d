# Sourced by the scripts that run on the GPU machine, from the folder they were staged in (after
# their `cd` to it); staged beside them by engine_here.sh and two_gpu_here.sh.
# device_cuda_env: NVLink multicast off in every process started (it must stay off on these
# machines), Python unbuffered, the CUDA 13 and driver libraries found first.
device_cuda_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
# device_out NAME: OUT (default /tmp/NAME) made.
device_out() {
  OUT=${OUT:-/tmp/$1}
  mkdir -p "$OUT"
}
# device_bench NAME: device_out NAME, the GPUs listed, sampled.sh's `sampled` defined, and the
# knobs of a benchmark run in rounds beside torch's: MB (micro-batch, default 4), STEPS (10),
# ROUNDS (1), TORCH_MODES ("eager compile").
device_bench() {
  device_out "$1"
  MB=${MB:-4}
  STEPS=${STEPS:-10}
  ROUNDS=${ROUNDS:-1}
  TORCH_MODES=${TORCH_MODES:-eager compile}
  nvidia-smi -L
  . ./sampled.sh
}
