// Shared by the fused sources (`fused.cu`, `classifier_one_read.cu`) after `device_types.cuh`:
// the 16-byte vector of element type T and block-wide reductions.
template <typename T> union Vec16 {
    uint4 u;
    T e[16 / sizeof(T)];
};

// Sum of x over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float x) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = warp_sum(x);
    __syncthreads();
    if (lane == 0) part[warp] = x;
    __syncthreads();
    x = lane < nw ? part[lane] : 0.f;
    return warp_sum(x);
}
__device__ float block_max(float x) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = warp_max(x);
    __syncthreads();
    if (lane == 0) part[warp] = x;
    __syncthreads();
    x = lane < nw ? part[lane] : NEG_INF;
    return warp_max(x);
}
