// Decoding over a preallocated key/value cache whose position is a device value.
// 16-bit and f32 elements compute in f32, f64 in f64.

__device__ __forceinline__ double ld(const double* p) { return *p; }
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

// decode_attention: a block per (head, sequence), WARPS warps; warp w takes keys w*KEYS.. in
// steps of WARPS*KEYS, KEYS at a time (their loads in flight together), keeping a running max,
// sum and weighted values (D / 32 elements a lane); the warps' results then combine. Keys
// 0..pos-1 come from the cache (row stride G*D), key pos is the new one. A position past the
// cache's P is taken as P (the host-side op checks the position it writes). 16 warps with 8
// keys in flight for f32 arithmetic; f64's registers allow 8 warps with 4.
#define DA_MAXE 8
template <typename T, typename W, int DA_WARPS, int DA_KEYS>
__device__ __forceinline__ void decode_heads(const T* q, const T* kc, const T* vc, const T* kn,
                                             const T* vn, const i64* pos, T* y, i64 p_len,
                                             int h, int g, int d, W scale) {
    extern __shared__ unsigned char smem[];
    W* sacc = (W*)smem;              // [DA_WARPS][d]
    W* sm = sacc + DA_WARPS * d;     // [DA_WARPS]
    W* sl = sm + DA_WARPS;           // [DA_WARPS]
    const int hi = blockIdx.x, bi = blockIdx.y, gi = hi / (h / g);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    i64 p = *pos;
    p = p < 0 ? 0 : (p > p_len ? p_len : p);
    const T* qr = q + ((i64)bi * h + hi) * d;
    W qv[DA_MAXE], acc[DA_MAXE];
#pragma unroll
    for (int e = 0; e < DA_MAXE; e++) {
        const int c = lane + 32 * e;
        qv[e] = c < d ? (W)ld(qr + c) : (W)0;
        acc[e] = (W)0;
    }
    const i64 stride = (i64)g * d;
    const T* kbase = kc + (i64)bi * p_len * stride + (i64)gi * d;
    const T* vbase = vc + (i64)bi * p_len * stride + (i64)gi * d;
    const T* knew = kn + ((i64)bi * g + gi) * d;
    const T* vnew = vn + ((i64)bi * g + gi) * d;
    W m = (W)NEG_INF, l = (W)0;
    for (i64 j0 = (i64)warp * DA_KEYS; j0 <= p; j0 += DA_WARPS * DA_KEYS) {
        W s[DA_KEYS];
#pragma unroll
        for (int u = 0; u < DA_KEYS; u++) {
            const i64 j = j0 + u;
            W dot = (W)0;
            if (j <= p) {
                const T* kr = j < p ? kbase + j * stride : knew;
#pragma unroll
                for (int e = 0; e < DA_MAXE; e++) {
                    const int c = lane + 32 * e;
                    if (c < d) dot += qv[e] * (W)ld(kr + c);
                }
            }
            s[u] = dot;
        }
#pragma unroll
        for (int u = 0; u < DA_KEYS; u++) s[u] = wsum(s[u]) * scale;
#pragma unroll
        for (int u = 0; u < DA_KEYS; u++) {
            const i64 j = j0 + u;
            if (j > p) break;
            const W mn = s[u] > m ? s[u] : m;
            const W corr = wexp(m - mn), w = wexp(s[u] - mn);
            l = l * corr + w;
            const T* vr = j < p ? vbase + j * stride : vnew;
#pragma unroll
            for (int e = 0; e < DA_MAXE; e++) {
                const int c = lane + 32 * e;
                if (c < d) acc[e] = acc[e] * corr + w * (W)ld(vr + c);
            }
            m = mn;
        }
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

#define DECODE_ATTENTION(T, W, N, WARPS, KEYS)                                                 \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                   \
    decode_attention_##N(const T* q, const T* kc, const T* vc, const T* kn, const T* vn,       \
                         const i64* pos, T* y, i64 p_len, int h, int g, int d, W scale) {      \
        decode_heads<T, W, WARPS, KEYS>(q, kc, vc, kn, vn, pos, y, p_len, h, g, d, scale);    \
    }
DECODE_ATTENTION(float, float, f32, 16, 8)
DECODE_ATTENTION(bf16_t, float, bf16, 16, 8)
DECODE_ATTENTION(f16_t, float, f16, 16, 8)
DECODE_ATTENTION(double, double, f64, 8, 4)

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
