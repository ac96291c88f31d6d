# Sourced from the repository root by the scripts that run on the GPU machine from the carried
# working tree (run_there.sh, run_tensor_there.sh, run_cpu_there.sh): the environment of every
# process they start, OUT (default /tmp/oxiflow-gpu) made, B the staged binaries' folder.
# NVLink multicast must stay off on these machines, in every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/oxiflow-gpu}
mkdir -p "$OUT"
B=$PWD/.carry/bin
