// Decoding over a preallocated key/value cache whose position is a device value.
// 16-bit and f32 elements compute in f32, f64 in f64.

__device__ __forceinline__ double ld(const double* p) { return *p; }
__device__ __forceinline__ double to_f(double v) { return v; }
__device__ __forceinline__ void st(double* p, double v) { *p = v; }
__device__ __forceinline__ float wexp(float x) { return expf(x); }
__device__ __forceinline__ double wexp(double x) { return exp(x); }
template <typename W> __device__ __forceinline__ W wsum(W x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    return x;
}

// rotary_at: x [B, T, H, D] -> y; pair (i, i + D/2) of row (b, t, h) rotates by
// (pos + t) * freq[i], the angle and its sine and cosine in f64. One thread per pair.
template <typename T, typename W>
__device__ __forceinline__ void rotary_at_pairs(const T* x, const double* freq, const i64* pos,
                                                T* y, i64 pairs, i64 t_len, i64 h, i64 d) {
    const i64 half = d / 2, p0 = *pos;
    for (i64 l = blockIdx.x * (i64)blockDim.x + threadIdx.x; l < pairs;
         l += (i64)gridDim.x * blockDim.x) {
        const i64 i = l % half, row = l / half, t = (row / h) % t_len;
        double s, c;
        sincos((double)(p0 + t) * freq[i], &s, &c);
        const W sw = (W)s, cw = (W)c;
        const T* xr = x + row * d;
        T* yr = y + row * d;
        const W a = (W)ld(xr + i), b = (W)ld(xr + i + half);
        st(yr + i, a * cw - b * sw);
        st(yr + i + half, a * sw + b * cw);
    }
}

#define ROTARY_AT(T, W, N)                                                                     \
    extern "C" __global__ void rotary_at_##N(const T* x, const double* freq, const i64* pos,   \
                                             T* y, i64 pairs, i64 t_len, i64 h, i64 d) {       \
        rotary_at_pairs<T, W>(x, freq, pos, y, pairs, t_len, h, d);                            \
    }
ROTARY_AT(float, float, f32)
ROTARY_AT(bf16_t, float, bf16)
ROTARY_AT(f16_t, float, f16)
ROTARY_AT(double, double, f64)

// rotary_qkv_at: qkv [B, T, G, R + 2, D] -> q [B, T, G R, D], k, v [B, T, G, D]; head j of
// group gi in row (b, t) is query head gi*R + j (j < R, rotated), the key (j = R, rotated) or
// the value (j = R + 1, copied). One thread per pair (i, i + D/2) of an input head.
template <typename T, typename W>
__device__ __forceinline__ void rotary_qkv_pairs(const T* x, const double* freq, const i64* pos,
                                                 T* q, T* k, T* v, i64 pairs, i64 t_len, i64 g,
                                                 i64 r, i64 d) {
    const i64 half = d / 2, p0 = *pos, heads = g * (r + 2);
    for (i64 l = blockIdx.x * (i64)blockDim.x + threadIdx.x; l < pairs;
         l += (i64)gridDim.x * blockDim.x) {
        const i64 i = l % half, head = l / half, row = head / heads, at = head % heads;
        const i64 gi = at / (r + 2), j = at % (r + 2), t = row % t_len;
        const T* xr = x + head * d;
        if (j == r + 1) {
            T* yr = v + (row * g + gi) * d;
            yr[i] = xr[i];
            yr[i + half] = xr[i + half];
            continue;
        }
        T* yr = j < r ? q + ((row * g + gi) * r + j) * d : k + (row * g + gi) * d;
        double s, c;
        sincos((double)(p0 + t) * freq[i], &s, &c);
        const W sw = (W)s, cw = (W)c;
        const W a = (W)ld(xr + i), b = (W)ld(xr + i + half);
        st(yr + i, a * cw - b * sw);
        st(yr + i + half, a * sw + b * cw);
    }
}

#define ROTARY_QKV_AT(T, W, N)                                                                 \
    extern "C" __global__ void rotary_qkv_at_##N(const T* x, const double* freq, const i64* pos, \
                                                 T* q, T* k, T* v, i64 pairs, i64 t_len, i64 g, \
                                                 i64 r, i64 d) {                               \
        rotary_qkv_pairs<T, W>(x, freq, pos, q, k, v, pairs, t_len, g, r, d);                  \
    }
ROTARY_QKV_AT(float, float, f32)
ROTARY_QKV_AT(bf16_t, float, bf16)
ROTARY_QKV_AT(f16_t, float, f16)
ROTARY_QKV_AT(double, double, f64)

// decode_attention: a block per (head, sequence), WARPS warps. Warp w scores keys
// w*32 + lane, then steps of WARPS*32: each lane dots one whole key with the block's query (kept
// in shared memory), reading the key in 16-byte pieces where the rows allow it; the warp's
// largest score rescales its running max, sum and weighted values (D / 32 elements a lane), and
// the warp's 32 values, weighted by the lanes' scores (shuffled), accumulate in flight together.
// The warps' results then combine. Keys 0..pos-1 come from the cache (row stride G*D), key pos
// is the new one. A position past the cache's P is taken as P (the host-side op checks the
// position it writes). 16 warps for f32 arithmetic, 8 for f64.
#define DA_MAXE 8
#define DA_VEC_BYTES 16

// The dot product of the query `sq` (D values in shared memory) with key row `kr`: 16-byte
// loads when `vec`, else one element at a time.
template <typename T, typename W>
__device__ __forceinline__ W key_dot(const T* kr, const W* sq, int d, bool vec) {
    W dot = (W)0;
    if (vec) {
        constexpr int per = DA_VEC_BYTES / sizeof(T);
        const uint4* kv = (const uint4*)kr;
        const int pieces = d / per;
#pragma unroll 8
        for (int v = 0; v < pieces; v++) {
            union { uint4 u; T t[per]; } piece;
            piece.u = kv[v];
#pragma unroll
            for (int i = 0; i < per; i++) dot += sq[v * per + i] * (W)to_f(piece.t[i]);
        }
    } else {
#pragma unroll 8
        for (int c = 0; c < d; c++) dot += sq[c] * (W)ld(kr + c);
    }
    return dot;
}

template <typename T, typename W, int DA_WARPS>
__device__ __forceinline__ void decode_heads(const T* q, const T* kc, const T* vc, const T* kn,
                                             const T* vn, const i64* pos, T* y, i64 p_len,
                                             int h, int g, int d, W scale) {
    extern __shared__ unsigned char smem[];
    W* sq = (W*)smem;                // [d]
    W* sacc = sq + d;                // [DA_WARPS][d]
    W* sm = sacc + DA_WARPS * d;     // [DA_WARPS]
    W* sl = sm + DA_WARPS;           // [DA_WARPS]
    const int hi = blockIdx.x, bi = blockIdx.y, gi = hi / (h / g);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 p = *pos;
    p = p < 0 ? 0 : (p > p_len ? p_len : p);
    const T* qr = q + ((i64)bi * h + hi) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) sq[c] = (W)ld(qr + c);
    const i64 stride = (i64)g * d;
    const T* kbase = kc + (i64)bi * p_len * stride + (i64)gi * d;
    const T* vbase = vc + (i64)bi * p_len * stride + (i64)gi * d;
    const T* knew = kn + ((i64)bi * g + gi) * d;
    const T* vnew = vn + ((i64)bi * g + gi) * d;
    const bool vec = (d * sizeof(T)) % DA_VEC_BYTES == 0 &&
                     (((unsigned long long)kbase | (unsigned long long)knew) % DA_VEC_BYTES) == 0;
    W acc[DA_MAXE];
#pragma unroll
    for (int e = 0; e < DA_MAXE; e++) acc[e] = (W)0;
    __syncthreads();
    W m = (W)NEG_INF, l = (W)0;
    for (i64 j0 = (i64)warp * 32; j0 <= p; j0 += DA_WARPS * 32) {
        const i64 j = j0 + lane;
        W s = (W)NEG_INF;
        if (j <= p) s = key_dot<T, W>(j < p ? kbase + j * stride : knew, sq, d, vec) * scale;
        W cm = s;
        for (int o = 16; o > 0; o >>= 1) {
            const W other = __shfl_xor_sync(FULL_MASK, cm, o);
            cm = other > cm ? other : cm;
        }
        const W mn = cm > m ? cm : m;  // lane 0's key j0 <= p: mn is finite
        const W corr = wexp(m - mn), w = j <= p ? wexp(s - mn) : (W)0;
        l = l * corr + wsum(w);
#pragma unroll
        for (int e = 0; e < DA_MAXE; e++) acc[e] *= corr;
        const int n = p - j0 + 1 < 32 ? (int)(p - j0 + 1) : 32;
#pragma unroll 16
        for (int k = 0; k < 32; k++) {
            const W wk = __shfl_sync(FULL_MASK, w, k);
            if (k < n) {
                const i64 jk = j0 + k;
                const T* vr = jk < p ? vbase + jk * stride : vnew;
#pragma unroll
                for (int e = 0; e < DA_MAXE; e++) {
                    const int c = lane + 32 * e;
                    if (c < d) acc[e] += wk * (W)ld(vr + c);
                }
            }
        }
        m = mn;
    }
#pragma unroll
    for (int e = 0; e < DA_MAXE; e++) {
        const int c = lane + 32 * e;
        if (c < d) sacc[warp * d + c] = acc[e];
    }
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    __syncthreads();
    T* yr = y + ((i64)bi * h + hi) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        W mx = (W)NEG_INF;
        for (int w = 0; w < DA_WARPS; w++) mx = sm[w] > mx ? sm[w] : mx;
        W total = (W)0, o = (W)0;
        for (int w = 0; w < DA_WARPS; w++) {
            if (sm[w] == (W)NEG_INF) continue;
            const W f = wexp(sm[w] - mx);
            total += sl[w] * f;
            o += sacc[w * d + c] * f;
        }
        st(yr + c, o / total);
    }
}

#define DECODE_ATTENTION(T, W, N, WARPS)                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
    decode_attention_##N(const T* q, const T* kc, const T* vc, const T* kn, const T* vn,       \
                         const i64* pos, T* y, i64 p_len, int h, int g, int d, W scale) {      \
        decode_heads<T, W, WARPS>(q, kc, vc, kn, vn, pos, y, p_len, h, g, d, scale);          \
    }
DECODE_ATTENTION(float, float, f32, 16)
DECODE_ATTENTION(bf16_t, float, bf16, 16)
DECODE_ATTENTION(f16_t, float, f16, 16)
DECODE_ATTENTION(double, double, f64, 8)

// write_rows: rows [O, t, I] into a cache [O, P, I] at positions at..at+t. `all`: every
// element of the output (from the cache or the rows); else only the rows' (the output is the
// cache's own memory). Elements moved as E, an unsigned type of the element's width.
template <typename E>
__device__ __forceinline__ void write_rows_elems(const E* cache, const E* rows, E* out, i64 outer,
                                                 i64 len, i64 t, i64 inner, i64 at, int all) {
    const i64 step = (i64)gridDim.x * blockDim.x;
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (all) {
        const i64 n = outer * len * inner;
        for (i64 l = first; l < n; l += step) {
            const i64 o = l / (len * inner), r = l % (len * inner), p = r / inner;
            out[l] = (p >= at && p < at + t) ? rows[(o * t + p - at) * inner + r % inner] : cache[l];
        }
    } else {
        const i64 n = outer * t * inner;
        for (i64 l = first; l < n; l += step) {
            const i64 o = l / (t * inner), r = l % (t * inner);
            out[o * len * inner + at * inner + r] = rows[l];
        }
    }
}

#define WRITE_ROWS(E, N)                                                                       \
    extern "C" __global__ void write_rows_##N(const E* cache, const E* rows, E* out, i64 outer, \
                                              i64 len, i64 t, i64 inner, i64 at, int all) {    \
        write_rows_elems<E>(cache, rows, out, outer, len, t, inner, at, all);                  \
    }
WRITE_ROWS(unsigned short, b2)
WRITE_ROWS(unsigned int, b4)
WRITE_ROWS(unsigned long long, b8)

// write_rows_table: the rows of up to ROWS_TABLE caches of one geometry into the caches' own
// memory in one launch: table entry c writes rows[c] [O, t, I] into out[c] [O, P, I] at
// positions at..at+t.
#define ROWS_TABLE 64
struct RowsTable { unsigned long long rows[ROWS_TABLE]; unsigned long long out[ROWS_TABLE]; };

template <typename E>
__device__ __forceinline__ void write_rows_listed(const RowsTable& tab, int count, i64 outer,
                                                  i64 len, i64 t, i64 inner, i64 at) {
    const i64 per = outer * t * inner, n = per * count;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 l = blockIdx.x * (i64)blockDim.x + threadIdx.x; l < n; l += step) {
        const i64 c = l / per, r = l % per, o = r / (t * inner);
        ((E*)tab.out[c])[o * len * inner + at * inner + r % (t * inner)] = ((const E*)tab.rows[c])[r];
    }
}

#define WRITE_ROWS_TABLE(E, N)                                                                 \
    extern "C" __global__ void write_rows_table_##N(const RowsTable tab, int count, i64 outer,  \
                                                    i64 len, i64 t, i64 inner, i64 at) {       \
        write_rows_listed<E>(tab, count, outer, len, t, inner, at);                            \
    }
WRITE_ROWS_TABLE(unsigned short, b2)
WRITE_ROWS_TABLE(unsigned int, b4)
WRITE_ROWS_TABLE(unsigned long long, b8)
