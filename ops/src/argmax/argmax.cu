// Arg-max over each row (one block per row, grid-stride over rows): each thread keeps the
// first index of its largest value above -inf, warps and then the block combine (larger value,
// or equal value and smaller index); a row with no value above -inf gives index 0. 16- and
// 32-bit floats compare in f32 (exact), f64 in f64.
#define NONE 0x7fffffffffffffffLL

__device__ __forceinline__ double ld(const double* p) { return *p; }

template <typename W>
__device__ __forceinline__ void better(W& v, i64& i, W v2, i64 i2) {
    if (v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

template <typename W>
__device__ __forceinline__ void warp_best(W& v, i64& i) {
    for (int o = 16; o > 0; o >>= 1) {
        W v2 = __shfl_xor_sync(FULL_MASK, v, o);
        i64 i2 = __shfl_xor_sync(FULL_MASK, i, o);
        better(v, i, v2, i2);
    }
}

template <typename T, typename W>
__device__ __forceinline__ void argmax_rows(const T* x, i64* y, i64 rows, i64 n, W* shv, i64* shi) {
    const W lowest = (W)NEG_INF;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        W v = lowest;
        i64 i = NONE;
#pragma unroll 4
        for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
            W e = ld(xr + j);
            if (e > v) {  // strictly larger: the thread's first such index (j ascends)
                v = e;
                i = j;
            }
        }
        warp_best(v, i);
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
        __syncthreads();
        if (lane == 0) {
            shv[warp] = v;
            shi[warp] = i;
        }
        __syncthreads();
        if (warp == 0) {
            v = lane < warps ? shv[lane] : lowest;
            i = lane < warps ? shi[lane] : NONE;
            warp_best(v, i);
            if (lane == 0) y[row] = i == NONE ? 0 : i;
        }
    }
}

#define ARGMAX(T, W, N)                                                                  \
    extern "C" __global__ void argmax_##N(const T* x, i64* y, i64 rows, i64 n) {       \
        __shared__ W shv[32];                                                            \
        __shared__ i64 shi[32];                                                          \
        argmax_rows<T, W>(x, y, rows, n, shv, shi);                                      \
    }
ARGMAX(float, float, f32)
ARGMAX(bf16_t, float, bf16)
ARGMAX(f16_t, float, f16)
ARGMAX(double, double, f64)
