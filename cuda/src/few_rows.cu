// ---- products of a few rows -----------------------------------------------------------------
// out[m, n] = sum_k a[m, k] * b[k, n] (`nn`: b stored [K, N]) or sum_k a[m, k] * b[n, k] (`nt`:
// b stored [N, K]) for the `rows` <= MT rows of a, 16-bit operands and output, f32 sums rounded
// once. The weight b is read once, 16 bytes a thread at a time (8 bytes in `nn` at MT 16), so a
// product of one to sixteen rows (a decoding step's) runs at the memory's rate rather than a
// tiled product's. The caller guarantees: n and k multiples of 8, a and b 16-byte aligned.

#define FR_THREADS 512
#define FR_WARPS (FR_THREADS / 32)

// The two 16-bit values of a 32-bit word as f32, low half first.
__device__ __forceinline__ void unpack2(bf16_t, u32 w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void unpack2(f16_t, u32 w, float& lo, float& hi) {
    f16_t l, h;
    l.x = (u16)(w & 0xffffu);
    h.x = (u16)(w >> 16);
    lo = to_f(l);
    hi = to_f(h);
}

// `WORDS` 32-bit words (2 * WORDS values) from `p` (aligned to 4 * WORDS bytes) as f32.
template <typename T, int WORDS>
__device__ __forceinline__ void load_f32(const T* p, float* f) {
    u32 w[WORDS];
    if constexpr (WORDS == 4) {
        const uint4 q = *(const uint4*)p;
        w[0] = q.x; w[1] = q.y; w[2] = q.z; w[3] = q.w;
    } else {
        const uint2 q = *(const uint2*)p;
        w[0] = q.x; w[1] = q.y;
    }
#pragma unroll
    for (int i = 0; i < WORDS; ++i) unpack2(T(), w[i], f[2 * i], f[2 * i + 1]);
}

// `nn`: a block owns 2 * COLS columns; lane = row lane (16) x column thread (2), each thread
// COLS consecutive columns, the block's 16 warps rows 16 apart; the rows' sums meet in
// shared memory.
template <typename T, int MT, int COLS>
__device__ __forceinline__ void few_rows_nn(const T* __restrict__ a, const T* __restrict__ b,
                                            T* __restrict__ out, int rows, i64 k, i64 n) {
    constexpr int TN = 2 * COLS;
    constexpr int UNROLL = 4;
    __shared__ float part[FR_WARPS][MT][TN];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kl = lane >> 1, ct = lane & 1;
    const i64 col = (i64)blockIdx.x * TN + ct * COLS;
    const i64 step = (i64)FR_WARPS * 16;
    float acc[MT][COLS];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[m][c] = 0.f;
    if (col < n) {
        for (i64 r = (i64)warp * 16 + kl; r < k; r += UNROLL * step) {
            float w[UNROLL][COLS];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const i64 rr = r + u * step;
                if (rr < k) {
                    load_f32<T, COLS / 2>(b + rr * n + col, w[u]);
                } else {
#pragma unroll
                    for (int c = 0; c < COLS; ++c) w[u][c] = 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const i64 rr = r + u * step;
                if (rr < k) {
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        if (m < rows) {
                            const float x = ld(a + (i64)m * k + rr);
#pragma unroll
                            for (int c = 0; c < COLS; ++c) acc[m][c] = fmaf(x, w[u][c], acc[m][c]);
                        }
                    }
                }
            }
        }
    }
    // The warp's 16 row lanes summed (lane bits 1 to 4).
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            float v = acc[m][c];
            for (int o = 2; o < 32; o <<= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
            acc[m][c] = v;
        }
    if (kl == 0) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int c = 0; c < COLS; ++c) part[warp][m][ct * COLS + c] = acc[m][c];
    }
    __syncthreads();
    for (int t = threadIdx.x; t < MT * TN; t += FR_THREADS) {
        const int m = t / TN, c = t % TN;
        const i64 o = (i64)blockIdx.x * TN + c;
        if (m < rows && o < n) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < FR_WARPS; ++w) s += part[w][m][c];
            st(out + (i64)m * n + o, s);
        }
    }
}

// `nt`: a warp owns two columns (two rows of b), its lanes 8 values of k apart; the sums meet
// by warp shuffles.
template <typename T, int MT>
__device__ __forceinline__ void few_rows_nt(const T* __restrict__ a, const T* __restrict__ b,
                                            T* __restrict__ out, int rows, i64 k, i64 n) {
    const int lane = threadIdx.x & 31;
    const i64 c0 = ((i64)blockIdx.x * FR_WARPS + (threadIdx.x >> 5)) * 2;
    if (c0 >= n) return;
    // n is even: both columns exist.
    float acc[2][MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[0][m] = acc[1][m] = 0.f;
    const T* b0 = b + c0 * k;
    const T* b1 = b0 + k;
#pragma unroll 2
    for (i64 kk = (i64)lane * 8; kk < k; kk += 256) {
        float w0[8], w1[8];
        load_f32<T, 4>(b0 + kk, w0);
        load_f32<T, 4>(b1 + kk, w1);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (m < rows) {
                float x[8];
                load_f32<T, 4>(a + (i64)m * k + kk, x);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    acc[0][m] = fmaf(x[i], w0[i], acc[0][m]);
                    acc[1][m] = fmaf(x[i], w1[i], acc[1][m]);
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const float s0 = warp_sum(acc[0][m]), s1 = warp_sum(acc[1][m]);
        if (lane == 0 && m < rows) {
            st(out + (i64)m * n + c0, s0);
            st(out + (i64)m * n + c0 + 1, s1);
        }
    }
}

#define FEW_ROWS(T, DT, MT, COLS)                                                              \
    extern "C" __global__ void __launch_bounds__(FR_THREADS) few_rows_nn_##DT##_##MT(         \
        const T* a, const T* b, T* out, int rows, i64 k, i64 n) {                              \
        few_rows_nn<T, MT, COLS>(a, b, out, rows, k, n);                                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(FR_THREADS) few_rows_nt_##DT##_##MT(         \
        const T* a, const T* b, T* out, int rows, i64 k, i64 n) {                              \
        few_rows_nt<T, MT>(a, b, out, rows, k, n);                                             \
    }

FEW_ROWS(bf16_t, bf16, 1, 8)
FEW_ROWS(bf16_t, bf16, 2, 8)
FEW_ROWS(bf16_t, bf16, 4, 8)
FEW_ROWS(bf16_t, bf16, 8, 8)
FEW_ROWS(bf16_t, bf16, 16, 4)
FEW_ROWS(f16_t, f16, 1, 8)
FEW_ROWS(f16_t, f16, 2, 8)
FEW_ROWS(f16_t, f16, 4, 8)
FEW_ROWS(f16_t, f16, 8, 8)
FEW_ROWS(f16_t, f16, 16, 4)
