// Shared by the fused sources (`fused.cu`, `classifier_one_read.cu`) after `device_types.cuh`:
// the 16-byte vector of element type T and block-wide reductions.
template <typename T> union Vec16 {
    uint4 u;
    T e[16 / sizeof(T)];
};

// Sum (MAX false) or maximum (MAX true) of x over the block (blockDim.x a multiple of 32, at
// most 1024); every thread gets it.
template <bool MAX> __device__ float block_reduce(float x) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    x = MAX ? warp_max(x) : warp_sum(x);
    __syncthreads();
    if (lane == 0) part[warp] = x;
    __syncthreads();
    x = lane < nw ? part[lane] : (MAX ? NEG_INF : 0.f);
    return MAX ? warp_max(x) : warp_sum(x);
}
__device__ float block_sum(float x) { return block_reduce<false>(x); }
__device__ float block_max(float x) { return block_reduce<true>(x); }
