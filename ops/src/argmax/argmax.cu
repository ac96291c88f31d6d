// Arg-max over each row (one block per row, grid-stride over rows): each thread keeps the
// first index of its largest value above -inf (reading 16-byte pieces where the rows allow),
// warps and then the block combine (larger value, or equal value and smaller index); a row
// with no value above -inf gives index 0. 16- and 32-bit floats compare in f32 (exact), f64
// in f64.
#define NONE 0x7fffffffffffffffLL
#define ARGMAX_FLIGHT 8

__device__ __forceinline__ double ld(const double* p) { return *p; }
__device__ __forceinline__ double to_w(double v) { return v; }
template <typename T> __device__ __forceinline__ float to_w(T v) { return to_f(v); }

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
    constexpr int per = 16 / sizeof(T);
    // Whole 16-byte pieces per row, from a 16-byte aligned start.
    const bool vec = (n * (i64)sizeof(T)) % 16 == 0 && ((unsigned long long)x) % 16 == 0;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        W v = lowest;
        i64 i = NONE;
        if (vec) {
            // 16-byte pieces, ARGMAX_FLIGHT in flight a thread: piece k holds indices k*per..
            // in order.
            const uint4* xv = (const uint4*)xr;
            const i64 pieces = n / per;
            for (i64 k0 = threadIdx.x; k0 < pieces; k0 += ARGMAX_FLIGHT * (i64)blockDim.x) {
                uint4 got[ARGMAX_FLIGHT];
#pragma unroll
                for (int f = 0; f < ARGMAX_FLIGHT; f++) {
                    const i64 k = k0 + (i64)f * blockDim.x;
                    if (k < pieces) got[f] = xv[k];
                }
#pragma unroll
                for (int f = 0; f < ARGMAX_FLIGHT; f++) {
                    const i64 k = k0 + (i64)f * blockDim.x;
                    if (k >= pieces) break;
                    union { uint4 u; T t[per]; } piece;
                    piece.u = got[f];
#pragma unroll
                    for (int e = 0; e < per; e++) {
                        const W val = to_w(piece.t[e]);
                        if (val > v) {
                            v = val;
                            i = k * per + e;
                        }
                    }
                }
            }
        } else {
#pragma unroll 8
            for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
                W e = ld(xr + j);
                if (e > v) {  // strictly larger: the thread's first such index (j ascends)
                    v = e;
                    i = j;
                }
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
    extern "C" __global__ void __launch_bounds__(1024) argmax_##N(const T* x, i64* y, i64 rows, i64 n) {       \
        __shared__ W shv[32];                                                            \
        __shared__ i64 shi[32];                                                          \
        argmax_rows<T, W>(x, y, rows, n, shv, shi);                                      \
    }
ARGMAX(float, float, f32)
ARGMAX(bf16_t, float, bf16)
ARGMAX(f16_t, float, f16)
ARGMAX(double, double, f64)
