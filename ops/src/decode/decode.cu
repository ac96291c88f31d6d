// Decoding over a preallocated key/value cache whose position is a device value.
// 16-bit and f32 elements compute in f32, f64 in f64.

__device__ __forceinline__ double ld(const double* p) { return *p; }
__device__ __forceinline__ double to_f(double v) { return v; }
__device__ __forceinline__ void st(double* p, double v) { *p = v; }
__device__ __forceinline__ float wexp(float x) { return expf(x); }
__device__ __forceinline__ double wexp(double x) { return exp(x); }
__device__ __forceinline__ float wlog(float x) { return logf(x); }
__device__ __forceinline__ double wlog(double x) { return log(x); }
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

// One query head's softmax (its D values `sq` in shared memory) over n = p + with_new keys: key
// j < p is the cache's row j (kbase + j * stride, likewise vbase), key p the new one (knew,
// vnew). Each warp's running max, sum and weighted values land in sm, sl and sacc.
template <typename T, typename W, int DA_WARPS>
__device__ __forceinline__ void attend_keys(const W* sq, const T* kbase, const T* vbase,
                                            const T* knew, const T* vnew, i64 stride, i64 p,
                                            bool with_new, int d, W scale, W* sacc, W* sm,
                                            W* sl) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool vec = (d * sizeof(T)) % DA_VEC_BYTES == 0 &&
                     (((unsigned long long)kbase | (unsigned long long)knew) % DA_VEC_BYTES) == 0;
    const i64 n = p + (with_new ? 1 : 0);
    W acc[DA_MAXE];
#pragma unroll
    for (int e = 0; e < DA_MAXE; e++) acc[e] = (W)0;
    W m = (W)NEG_INF, l = (W)0;
    for (i64 j0 = (i64)warp * 32; j0 < n; j0 += DA_WARPS * 32) {
        const i64 j = j0 + lane;
        W s = (W)NEG_INF;
        if (j < n) s = key_dot<T, W>(j < p ? kbase + j * stride : knew, sq, d, vec) * scale;
        W cm = s;
        for (int o = 16; o > 0; o >>= 1) {
            const W other = __shfl_xor_sync(FULL_MASK, cm, o);
            cm = other > cm ? other : cm;
        }
        const W mn = cm > m ? cm : m;  // lane 0's key j0 < n: mn is finite
        const W corr = wexp(m - mn), w = j < n ? wexp(s - mn) : (W)0;
        l = l * corr + wsum(w);
#pragma unroll
        for (int e = 0; e < DA_MAXE; e++) acc[e] *= corr;
        const int cnt = n - j0 < 32 ? (int)(n - j0) : 32;
#pragma unroll 16
        for (int k = 0; k < 32; k++) {
            const W wk = __shfl_sync(FULL_MASK, w, k);
            if (k < cnt) {
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
}

// The warps' states (from attend_keys) merged for value column c: the largest maximum `mx`,
// the weights' sum `total` and column c's weighted value `o`, both rescaled to `mx` (0 and 0
// when no warp saw a key).
template <typename W, int DA_WARPS>
__device__ __forceinline__ void merge_warps(const W* sacc, const W* sm, const W* sl, int d,
                                            int c, W& mx, W& total, W& o) {
    mx = (W)NEG_INF;
    for (int w = 0; w < DA_WARPS; w++) mx = sm[w] > mx ? sm[w] : mx;
    total = (W)0;
    o = (W)0;
    for (int w = 0; w < DA_WARPS; w++) {
        if (sm[w] == (W)NEG_INF) continue;
        const W f = wexp(sm[w] - mx);
        total += sl[w] * f;
        o += sacc[w * d + c] * f;
    }
}

// The shared memory of one head's block: the query [d], then attend_keys' per-warp state.
template <typename T, typename W, int DA_WARPS>
__device__ __forceinline__ W* load_query(const T* qr, int d) {
    extern __shared__ unsigned char smem[];
    W* sq = (W*)smem;
    for (int c = threadIdx.x; c < d; c += blockDim.x) sq[c] = (W)ld(qr + c);
    __syncthreads();
    return sq;
}

template <typename T, typename W, int DA_WARPS>
__device__ __forceinline__ void decode_heads(const T* q, const T* kc, const T* vc, const T* kn,
                                             const T* vn, const i64* pos, T* y, i64 p_len,
                                             int h, int g, int d, W scale) {
    const int hi = blockIdx.x, bi = blockIdx.y, gi = hi / (h / g);
    W* sq = load_query<T, W, DA_WARPS>(q + ((i64)bi * h + hi) * d, d);
    W *sacc = sq + d, *sm = sacc + DA_WARPS * d, *sl = sm + DA_WARPS;
    i64 p = *pos;
    p = p < 0 ? 0 : (p > p_len ? p_len : p);
    const i64 stride = (i64)g * d;
    const i64 at = (i64)bi * p_len * stride + (i64)gi * d, at_new = ((i64)bi * g + gi) * d;
    attend_keys<T, W, DA_WARPS>(sq, kc + at, vc + at, kn + at_new, vn + at_new, stride, p, true,
                                d, scale, sacc, sm, sl);
    T* yr = y + ((i64)bi * h + hi) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        W mx, total, o;
        merge_warps<W, DA_WARPS>(sacc, sm, sl, d, c, mx, total, o);
        st(yr + c, o / total);
    }
}

// decode_attention_parts: a block per (head, sequence, local block of the cache). The cache
// piece [B, nl * per, G, D] holds blocks first_block.. of `blocks` blocks of `per` positions;
// block c attends over its positions before the position (clamped to blocks * per) and, where
// it holds the position (the last block past the cache), the new key and value. o [B, nl, H, D]
// gets the block's normalised values, lse [B, nl, H] the log-sum-exp of its scores (0 and -inf
// for a block without keys).
template <typename T, typename W, int DA_WARPS>
__device__ __forceinline__ void decode_blocks(const T* q, const T* kc, const T* vc, const T* kn,
                                              const T* vn, const i64* pos, W* o, W* lse,
                                              i64 per, int nl, i64 first_block, i64 blocks,
                                              int h, int g, int d, W scale) {
    const int hi = blockIdx.x, bi = blockIdx.y, cl = blockIdx.z, gi = hi / (h / g);
    W* sq = load_query<T, W, DA_WARPS>(q + ((i64)bi * h + hi) * d, d);
    W *sacc = sq + d, *sm = sacc + DA_WARPS * d, *sl = sm + DA_WARPS;
    i64 p = *pos;
    p = p < 0 ? 0 : (p > blocks * per ? blocks * per : p);
    const i64 block = first_block + cl, owner = p / per < blocks ? p / per : blocks - 1;
    i64 cached = p - block * per;
    cached = cached < 0 ? 0 : (cached > per ? per : cached);
    const i64 stride = (i64)g * d;
    const i64 at = ((i64)bi * nl + cl) * per * stride + (i64)gi * d;
    const i64 at_new = ((i64)bi * g + gi) * d;
    attend_keys<T, W, DA_WARPS>(sq, kc + at, vc + at, kn + at_new, vn + at_new, stride, cached,
                                block == owner, d, scale, sacc, sm, sl);
    const i64 row = ((i64)bi * nl + cl) * h + hi;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        W mx, total, acc;
        merge_warps<W, DA_WARPS>(sacc, sm, sl, d, c, mx, total, acc);
        o[row * d + c] = total > (W)0 ? acc / total : (W)0;
        if (c == 0) lse[row] = total > (W)0 ? mx + wlog(total) : (W)NEG_INF;
    }
}

#define DECODE_BLOCKS(T, W, N, WARPS)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * WARPS)                                   \
    decode_attention_parts_##N(const T* q, const T* kc, const T* vc, const T* kn,              \
                               const T* vn, const i64* pos, W* o, W* lse, i64 per, int nl,    \
                               i64 first_block, i64 blocks, int h, int g, int d, W scale) {   \
        decode_blocks<T, W, WARPS>(q, kc, vc, kn, vn, pos, o, lse, per, nl, first_block,     \
                                   blocks, h, g, d, scale);                                   \
    }
DECODE_BLOCKS(float, float, f32, 16)
DECODE_BLOCKS(bf16_t, float, bf16, 16)
DECODE_BLOCKS(f16_t, float, f16, 16)
DECODE_BLOCKS(double, double, f64, 8)

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

// write_rows: rows from..from+count of rows [O, t, I] into a cache [O, P, I] at positions
// at..at+count. `all`: every element of the output (from the cache or the rows); else only the
// rows' (the output is the cache's own memory). Elements moved as E, an unsigned type of the
// element's width.
template <typename E>
__device__ __forceinline__ void write_rows_elems(const E* cache, const E* rows, E* out, i64 outer,
                                                 i64 len, i64 t, i64 inner, i64 at, i64 from,
                                                 i64 count, int all) {
    const i64 step = (i64)gridDim.x * blockDim.x;
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (all) {
        const i64 n = outer * len * inner;
        for (i64 l = first; l < n; l += step) {
            const i64 o = l / (len * inner), r = l % (len * inner), p = r / inner;
            out[l] = (p >= at && p < at + count)
                         ? rows[(o * t + from + p - at) * inner + r % inner]
                         : cache[l];
        }
    } else {
        const i64 n = outer * count * inner;
        for (i64 l = first; l < n; l += step) {
            const i64 o = l / (count * inner), r = l % (count * inner);
            out[o * len * inner + at * inner + r] = rows[(o * t + from) * inner + r];
        }
    }
}

#define WRITE_ROWS(E, N)                                                                       \
    extern "C" __global__ void write_rows_##N(const E* cache, const E* rows, E* out, i64 outer, \
                                              i64 len, i64 t, i64 inner, i64 at, i64 from,     \
                                              i64 count, int all) {                            \
        write_rows_elems<E>(cache, rows, out, outer, len, t, inner, at, from, count, all);     \
    }
WRITE_ROWS(unsigned short, b2)
WRITE_ROWS(unsigned int, b4)
WRITE_ROWS(unsigned long long, b8)

// write_rows_table: the rows of up to ROWS_TABLE caches of one geometry into the caches' own
// memory in one launch: table entry c writes rows from..from+count of rows[c] [O, t, I] into
// out[c] [O, P, I] at positions at..at+count.
#define ROWS_TABLE 64
struct RowsTable { unsigned long long rows[ROWS_TABLE]; unsigned long long out[ROWS_TABLE]; };

template <typename E>
__device__ __forceinline__ void write_rows_listed(const RowsTable& tab, int caches, i64 outer,
                                                  i64 len, i64 t, i64 inner, i64 at, i64 from,
                                                  i64 count) {
    const i64 span = count * inner, per = outer * span, n = per * caches;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 l = blockIdx.x * (i64)blockDim.x + threadIdx.x; l < n; l += step) {
        const i64 c = l / per, r = l % per, o = r / span, e = r % span;
        ((E*)tab.out[c])[o * len * inner + at * inner + e] =
            ((const E*)tab.rows[c])[(o * t + from) * inner + e];
    }
}

#define WRITE_ROWS_TABLE(E, N)                                                                 \
    extern "C" __global__ void write_rows_table_##N(const RowsTable tab, int caches, i64 outer, \
                                                    i64 len, i64 t, i64 inner, i64 at,         \
                                                    i64 from, i64 count) {                     \
        write_rows_listed<E>(tab, caches, outer, len, t, inner, at, from, count);              \
    }
WRITE_ROWS_TABLE(unsigned short, b2)
WRITE_ROWS_TABLE(unsigned int, b4)
WRITE_ROWS_TABLE(unsigned long long, b8)
