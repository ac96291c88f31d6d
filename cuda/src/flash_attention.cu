// Flash attention without cuDNN (the fallback): online softmax over key tiles in shared memory,
// f32 arithmetic for every I/O type, never a [B, H, T, T] array. Four warps per block; in the
// forward and dQ kernels each warp owns RPW query rows and its lanes split the key columns of a
// tile (scores) and then the head dim (accumulators); in the dK/dV kernel each warp owns RPW key
// rows and its lanes split the query rows of a tile. No atomics: every kernel is deterministic.
// DPL = head-dim elements per lane (head dim <= 32 DPL; 2, 4 or 8).
#define WARPS 4
#define RPW 4
#define BR (WARPS * RPW)
#define CPL 2  // tile columns per lane: tiles hold at most 64 rows

struct Dims { int B, H, T, D, tile, causal; float scale; int pad; };

// Rows t0 .. t0 + valid of view v (times mul) into dst with row pitch `pitch`; rows valid .. cap
// are zero. Called by the whole block.
template <typename T>
__device__ void load_tile(float* dst, int pitch, const View& v, int b, int h, int t0, int valid, int cap, int D, float mul) {
    for (int i = threadIdx.x; i < cap * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        dst[r * pitch + d] = r < valid ? ld(vrow<const T>(v, b, h, t0 + r) + d * v.s3) * mul : 0.f;
    }
}

// One past the last key a block of query rows q0 .. q0 + BR attends to (causal: its last row).
__device__ __forceinline__ int keys_end(const Dims& z, int q0) {
    return z.causal ? min(q0 + BR, z.T) : z.T;
}

// The key tile k0 .. k0 + bc of K (row pitch Dp) and V (row pitch vpitch) into shared memory,
// between barriers. Called by the whole block.
template <typename T>
__device__ void load_key_tile(float* Ks, float* Vs, int vpitch, const View& k, const View& v, int b, int h, int k0, int bc, int Bc, int D) {
    __syncthreads();
    load_tile<T>(Ks, D + 1, k, b, h, k0, bc, Bc, D, 1.f);
    load_tile<T>(Vs, vpitch, v, b, h, k0, bc, Bc, D, 1.f);
    __syncthreads();
}

// acc[dd] += sum over the tile's columns c < n of w_c * M[c * pitch + lane + 32 dd] (d < D),
// where lane c % 32 holds w_c in w[c / 32]: a warp's weighted sum of tile rows, in column order.
template <int DPL>
__device__ __forceinline__ void accumulate_tile_rows(float (&acc)[DPL], const float (&w)[CPL], const float* M, int pitch, int n, int D, int lane) {
#pragma unroll
    for (int jj = 0; jj < CPL; ++jj) {
#pragma unroll 2
        for (int src = 0; src < 32; ++src) {
            const int c = src + 32 * jj;
            if (c >= n) break;
            const float wc = __shfl_sync(FULL_MASK, w[jj], src);
#pragma unroll
            for (int dd = 0; dd < DPL; ++dd) {
                int d = lane + 32 * dd;
                if (d < D) acc[dd] = fmaf(wc, M[c * pitch + d], acc[dd]);
            }
        }
    }
}

// row[d] = acc[dd] * mul for the lane's head-dim elements d = lane + 32 dd < D.
template <typename T, int DPL>
__device__ __forceinline__ void store_row(T* row, i64 stride, const float (&acc)[DPL], float mul, int D, int lane) {
#pragma unroll
    for (int dd = 0; dd < DPL; ++dd) {
        int d = lane + 32 * dd;
        if (d < D) st(row + d * stride, acc[dd] * mul);
    }
}

// (q . k, g . v) over D elements: a backward score and its dP.
__device__ __forceinline__ float2 score_and_dp(const float* qr, const float* kr, const float* gr, const float* vr, int D) {
    float s = 0.f, dp = 0.f;
    for (int d = 0; d < D; ++d) { s = fmaf(qr[d], kr[d], s); dp = fmaf(gr[d], vr[d], dp); }
    return make_float2(s, dp);
}

template <typename T, int DPL>
__device__ void flash_fwd(const Dims& z, const View& q, const View& k, const View& v, const View& o, float* lse) {
    extern __shared__ float sm[];
    const int D = z.D, Bc = z.tile, Dp = D + 1;
    float* Qs = sm;
    float* Ks = Qs + BR * D;
    float* Vs = Ks + Bc * Dp;
    const int bh = blockIdx.x, b = bh / z.H, h = bh % z.H;
    const int q0 = blockIdx.y * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    load_tile<T>(Qs, D, q, b, h, q0, min(BR, z.T - q0), BR, D, z.scale);
    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        m[r] = NEG_INF; l[r] = 0.f;
#pragma unroll
        for (int dd = 0; dd < DPL; ++dd) acc[r][dd] = 0.f;
    }
    const int k_end = keys_end(z, q0);
    for (int k0 = 0; k0 < k_end; k0 += Bc) {
        const int bc = min(Bc, k_end - k0);
        load_key_tile<T>(Ks, Vs, D, k, v, b, h, k0, bc, Bc, D);
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int rl = warp * RPW + r, t = q0 + rl;
            if (t >= z.T) continue;
            const float* qr = Qs + rl * D;
            float s[CPL];
            float tmax = NEG_INF;
#pragma unroll
            for (int jj = 0; jj < CPL; ++jj) {
                int c = lane + 32 * jj;
                float x = NEG_INF;
                if (c < bc && (!z.causal || k0 + c <= t)) {
                    const float* kr = Ks + c * Dp;
                    float a = 0.f;
                    for (int d = 0; d < D; ++d) a = fmaf(qr[d], kr[d], a);
                    x = a;
                }
                s[jj] = x;
                tmax = fmaxf(tmax, x);
            }
            tmax = warp_max(tmax);
            if (tmax == NEG_INF) continue;
            const float mnew = fmaxf(m[r], tmax);
            const float alpha = expf(m[r] - mnew);
            float psum = 0.f;
#pragma unroll
            for (int jj = 0; jj < CPL; ++jj) {
                s[jj] = s[jj] == NEG_INF ? 0.f : expf(s[jj] - mnew);
                psum += s[jj];
            }
            psum = warp_sum(psum);
            l[r] = l[r] * alpha + psum;
            m[r] = mnew;
#pragma unroll
            for (int dd = 0; dd < DPL; ++dd) acc[r][dd] *= alpha;
            accumulate_tile_rows<DPL>(acc[r], s, Vs, D, bc, D, lane);
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int t = q0 + warp * RPW + r;
        if (t >= z.T) continue;
        store_row<T, DPL>(vrow<T>(o, b, h, t), o.s3, acc[r], 1.f / l[r], D, lane);
        if (lane == 0) lse[((i64)b * z.H + h) * z.T + t] = m[r] + logf(l[r]);
    }
}

// dsum[row] = sum_d dO[row, d] O[row, d], one warp per row.
template <typename T>
__device__ void flash_dsum(const Dims& z, const View& o, const View& d_o, float* dsum) {
    const i64 rows = (i64)z.B * z.H * z.T;
    const int lane = threadIdx.x & 31;
    for (i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < rows;
         row += ((i64)gridDim.x * blockDim.x) >> 5) {
        int t = (int)(row % z.T), bh = (int)(row / z.T), b = bh / z.H, h = bh % z.H;
        const T* orow = vrow<const T>(o, b, h, t);
        const T* grow = vrow<const T>(d_o, b, h, t);
        float a = 0.f;
        for (int d = lane; d < z.D; d += 32) a += ld(orow + d * o.s3) * ld(grow + d * d_o.s3);
        a = warp_sum(a);
        if (lane == 0) dsum[row] = a;
    }
}

// dK and dV of BR key rows per block, looping over query tiles.
template <typename T, int DPL>
__device__ void flash_dkdv(const Dims& z, const View& q, const View& k, const View& v, const View& d_o,
                           const float* lse, const float* dsum, const View& dk, const View& dv) {
    extern __shared__ float sm[];
    const int D = z.D, Bq = z.tile, Dp = D + 1;
    float* Kb = sm;
    float* Vb = Kb + BR * D;
    float* Qs = Vb + BR * D;
    float* Gs = Qs + Bq * Dp;
    float* Ls = Gs + Bq * Dp;
    float* Ss = Ls + Bq;
    const int bh = blockIdx.x, b = bh / z.H, h = bh % z.H;
    const int k0 = blockIdx.y * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    load_tile<T>(Kb, D, k, b, h, k0, min(BR, z.T - k0), BR, D, 1.f);
    load_tile<T>(Vb, D, v, b, h, k0, min(BR, z.T - k0), BR, D, 1.f);
    float gk[RPW][DPL], gv[RPW][DPL];
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int dd = 0; dd < DPL; ++dd) { gk[r][dd] = 0.f; gv[r][dd] = 0.f; }
    const float* lrow = lse + ((i64)b * z.H + h) * z.T;
    const float* srow = dsum + ((i64)b * z.H + h) * z.T;
    for (int qs0 = z.causal ? k0 : 0; qs0 < z.T; qs0 += Bq) {
        const int bq = min(Bq, z.T - qs0);
        __syncthreads();
        load_tile<T>(Qs, Dp, q, b, h, qs0, bq, Bq, D, 1.f);
        load_tile<T>(Gs, Dp, d_o, b, h, qs0, bq, Bq, D, 1.f);
        for (int i = threadIdx.x; i < Bq; i += blockDim.x) {
            Ls[i] = i < bq ? lrow[qs0 + i] : 0.f;
            Ss[i] = i < bq ? srow[qs0 + i] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int rl = warp * RPW + r, j = k0 + rl;
            if (j >= z.T) continue;
            const float* kr = Kb + rl * D;
            const float* vr = Vb + rl * D;
            float p[CPL], ds[CPL];
#pragma unroll
            for (int jj = 0; jj < CPL; ++jj) {
                int c = lane + 32 * jj;
                p[jj] = 0.f; ds[jj] = 0.f;
                if (c < bq && (!z.causal || qs0 + c >= j)) {
                    const float2 sd = score_and_dp(Qs + c * Dp, kr, Gs + c * Dp, vr, D);
                    p[jj] = expf(sd.x * z.scale - Ls[c]);
                    ds[jj] = p[jj] * (sd.y - Ss[c]);
                }
            }
            accumulate_tile_rows<DPL>(gv[r], p, Gs, Dp, bq, D, lane);
            accumulate_tile_rows<DPL>(gk[r], ds, Qs, Dp, bq, D, lane);
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int j = k0 + warp * RPW + r;
        if (j >= z.T) continue;
        store_row<T, DPL>(vrow<T>(dk, b, h, j), dk.s3, gk[r], z.scale, D, lane);
        store_row<T, DPL>(vrow<T>(dv, b, h, j), dv.s3, gv[r], 1.f, D, lane);
    }
}

// dQ of BR query rows per block, looping over key tiles.
template <typename T, int DPL>
__device__ void flash_dq(const Dims& z, const View& q, const View& k, const View& v, const View& d_o,
                         const float* lse, const float* dsum, const View& dq) {
    extern __shared__ float sm[];
    const int D = z.D, Bc = z.tile, Dp = D + 1;
    float* Qs = sm;
    float* Gs = Qs + BR * D;
    float* Ks = Gs + BR * D;
    float* Vs = Ks + Bc * Dp;
    const int bh = blockIdx.x, b = bh / z.H, h = bh % z.H;
    const int q0 = blockIdx.y * BR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    load_tile<T>(Qs, D, q, b, h, q0, min(BR, z.T - q0), BR, D, 1.f);
    load_tile<T>(Gs, D, d_o, b, h, q0, min(BR, z.T - q0), BR, D, 1.f);
    float acc[RPW][DPL], lr[RPW], sr[RPW];
    const float* lrow = lse + ((i64)b * z.H + h) * z.T;
    const float* srow = dsum + ((i64)b * z.H + h) * z.T;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int t = q0 + warp * RPW + r;
        lr[r] = t < z.T ? lrow[t] : 0.f;
        sr[r] = t < z.T ? srow[t] : 0.f;
#pragma unroll
        for (int dd = 0; dd < DPL; ++dd) acc[r][dd] = 0.f;
    }
    const int k_end = keys_end(z, q0);
    for (int k0 = 0; k0 < k_end; k0 += Bc) {
        const int bc = min(Bc, k_end - k0);
        load_key_tile<T>(Ks, Vs, Dp, k, v, b, h, k0, bc, Bc, D);
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
            const int rl = warp * RPW + r, t = q0 + rl;
            if (t >= z.T) continue;
            const float* qr = Qs + rl * D;
            const float* gr = Gs + rl * D;
            float ds[CPL];
#pragma unroll
            for (int jj = 0; jj < CPL; ++jj) {
                int c = lane + 32 * jj;
                ds[jj] = 0.f;
                if (c < bc && (!z.causal || k0 + c <= t)) {
                    const float2 sd = score_and_dp(qr, Ks + c * Dp, gr, Vs + c * Dp, D);
                    ds[jj] = expf(sd.x * z.scale - lr[r]) * (sd.y - sr[r]);
                }
            }
            accumulate_tile_rows<DPL>(acc[r], ds, Ks, Dp, bc, D, lane);
        }
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
        const int t = q0 + warp * RPW + r;
        if (t >= z.T) continue;
        store_row<T, DPL>(vrow<T>(dq, b, h, t), dq.s3, acc[r], z.scale, D, lane);
    }
}

#define FLASH_DPL(T, N, P) \
extern "C" __global__ void __launch_bounds__(128) flash_fwd_##N##_##P(Dims z, View q, View k, View v, View o, float* lse) { flash_fwd<T, P>(z, q, k, v, o, lse); } \
extern "C" __global__ void __launch_bounds__(128) flash_dkdv_##N##_##P(Dims z, View q, View k, View v, View d_o, const float* lse, const float* dsum, View dk, View dv) { flash_dkdv<T, P>(z, q, k, v, d_o, lse, dsum, dk, dv); } \
extern "C" __global__ void __launch_bounds__(128) flash_dq_##N##_##P(Dims z, View q, View k, View v, View d_o, const float* lse, const float* dsum, View dq) { flash_dq<T, P>(z, q, k, v, d_o, lse, dsum, dq); }

#define FLASH_TYPE(T, N) \
FLASH_DPL(T, N, 2) FLASH_DPL(T, N, 4) FLASH_DPL(T, N, 8) \
extern "C" __global__ void flash_dsum_##N(Dims z, View o, View d_o, float* dsum) { flash_dsum<T>(z, o, d_o, dsum); }

// The instantiation line for one type is appended at run time (one module per type).
