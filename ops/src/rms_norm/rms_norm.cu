// RMS normalisation forward and backward, one block per row (grid-stride over rows), block
// reductions through warp shuffles. 16- and 32-bit floats load, compute in f32 and store
// through the library's prelude (`ld`/`st`); f64 computes in f64 (the overloads below).
__device__ __forceinline__ double ld(const double* p) { return *p; }
__device__ __forceinline__ void st(double* p, double v) { *p = v; }

template <typename W>
__device__ __forceinline__ W warp_total(W v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// The sum of `v` over the block, on every thread; `sh` holds 32 values.
template <typename W>
__device__ __forceinline__ W block_total(W v, W* sh) {
    v = warp_total(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    return warp_total(lane < warps ? sh[lane] : (W)0);
}

// A row of at most RMS_HELD values a thread is read once, its values and weights held in
// registers (all loads in flight together); a longer one is read twice.
#define RMS_HELD 8
template <typename T, typename W>
__device__ __forceinline__ void rms_fwd(const T* x, const T* w, T* y, i64 rows, i64 h, double eps, W* sh) {
    const bool held = h <= (i64)RMS_HELD * blockDim.x;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * h;
        T* yr = y + row * h;
        W ss = 0;
        if (held) {
            W xv[RMS_HELD], wv[RMS_HELD];
#pragma unroll
            for (int k = 0; k < RMS_HELD; k++) {
                const i64 j = threadIdx.x + (i64)k * blockDim.x;
                xv[k] = j < h ? (W)ld(xr + j) : (W)0;
                wv[k] = j < h ? (W)ld(w + j) : (W)0;
                ss += xv[k] * xv[k];
            }
            ss = block_total(ss, sh);
            const W r = (W)1 / sqrt(ss / (W)h + (W)eps);
#pragma unroll
            for (int k = 0; k < RMS_HELD; k++) {
                const i64 j = threadIdx.x + (i64)k * blockDim.x;
                if (j < h) st(yr + j, xv[k] * r * wv[k]);
            }
            continue;
        }
        for (i64 j = threadIdx.x; j < h; j += blockDim.x) {
            W v = ld(xr + j);
            ss += v * v;
        }
        ss = block_total(ss, sh);
        const W r = (W)1 / sqrt(ss / (W)h + (W)eps);
        for (i64 j = threadIdx.x; j < h; j += blockDim.x) st(yr + j, (W)ld(xr + j) * r * (W)ld(w + j));
    }
}

template <typename T, typename W>
__device__ __forceinline__ void rms_bwd(const T* x, const T* w, const T* dy, T* dx, W* terms, i64 rows, i64 h,
                                        double eps, W* sh) {
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const i64 at = row * h;
        W ss = 0, p = 0;
        for (i64 j = threadIdx.x; j < h; j += blockDim.x) {
            W v = ld(x + at + j);
            ss += v * v;
            p += (W)ld(dy + at + j) * (W)ld(w + j) * v;
        }
        ss = block_total(ss, sh);
        p = block_total(p, sh);
        const W r = (W)1 / sqrt(ss / (W)h + (W)eps);
        const W proj = p * r / (W)h;  // mean over the row of dy w xhat
        for (i64 j = threadIdx.x; j < h; j += blockDim.x) {
            const W xh = (W)ld(x + at + j) * r, d = ld(dy + at + j);
            st(dx + at + j, r * (d * (W)ld(w + j) - xh * proj));
            terms[at + j] = d * xh;
        }
    }
}

#define RMS_NORM(T, W, N)                                                                                     \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_fwd_##N(const T* x, const T* w, T* y, i64 rows, i64 h, double eps) { \
        __shared__ W sh[32];                                                                                  \
        rms_fwd<T, W>(x, w, y, rows, h, eps, sh);                                                             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_bwd_##N(const T* x, const T* w, const T* dy, T* dx, W* terms,       \
                                                i64 rows, i64 h, double eps) {                                \
        __shared__ W sh[32];                                                                                  \
        rms_bwd<T, W>(x, w, dy, dx, terms, rows, h, eps, sh);                                                 \
    }
RMS_NORM(float, float, f32)
RMS_NORM(bf16_t, float, bf16)
RMS_NORM(f16_t, float, f16)
RMS_NORM(double, double, f64)
