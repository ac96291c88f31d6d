// Context attention's glue around the fused attention calls, grid-stride over elements. Rows
// are [B, T, H, E] (row-major) unless named otherwise; the log-sum-exps are f32 [B, H, T].
// 16- and 32-bit floats load and store through the library's prelude (`ld`/`st`); every
// accumulator is f32. Index arithmetic is 32-bit (a 64-bit division costs tens of
// instructions): the caller launches no kernel over 2^32 elements or more.
typedef unsigned int u32_t;
#define GRID_LOOP(i, n) \
    for (u32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (u32_t)(n); i += gridDim.x * blockDim.x)

// dst [B, rows, G rep, E] <- rows row0 .. row0 + rows of src [B, src_t, G, E], each head written
// rep times (head j of dst is head j / rep of src).
template <typename T>
__device__ __forceinline__ void gather_rows(const T* src, T* dst, i64 b, i64 rows, i64 src_t, i64 row0, i64 g,
                                            i64 rep, i64 e) {
    const u32_t E = e, GR = g * rep, R = rows, P = rep;
    GRID_LOOP(i, b * rows * g * rep * e) {
        const u32_t x = i % E, r1 = i / E, hh = r1 % GR, r2 = r1 / GR, j = r2 % R, bi = r2 / R;
        dst[i] = src[(((i64)bi * src_t + row0 + j) * g + hh / P) * e + x];
    }
}

// A partial result (o_p [B, n, H, E] of T, lse_p [B, H, n]) folded into the running output
// (acc f32 [B, t, H, E] at rows row0 ..) by the running log-sum-exps lacc [B, H, t], which this
// kernel reads and `cp_merge_lse` then updates.
template <typename T>
__device__ __forceinline__ void merge(const T* op, const float* lp, float* acc, const float* lacc, i64 b, i64 n,
                                      i64 t, i64 row0, i64 h, i64 e) {
    const u32_t E = e, H = h, N = n;
    GRID_LOOP(i, b * n * h * e) {
        const u32_t r1 = i / E, hh = r1 % H, r2 = r1 / H, r = r2 % N, bi = r2 / N;
        const float lo = lacc[((i64)bi * h + hh) * t + row0 + r], l2 = lp[((i64)bi * h + hh) * n + r];
        const float m = fmaxf(lo, l2);
        if (m == NEG_INF) continue;
        const float wo = expf(lo - m), w2 = expf(l2 - m), inv = 1.0f / (wo + w2);
        float* a = acc + (((i64)bi * t + row0 + r) * h + hh) * e + (i % E);
        *a = (*a * wo + ld(op + i) * w2) * inv;
    }
}

// dst f32 [B, dst_t, G, E] at rows row0 .. += src [B, rows, G rep, E] summed over each head's rep
// copies.
template <typename T>
__device__ __forceinline__ void add_groups(const T* src, float* dst, i64 b, i64 rows, i64 dst_t, i64 row0, i64 g,
                                           i64 rep, i64 e) {
    const u32_t E = e, G = g, R = rows;
    GRID_LOOP(i, b * rows * g * e) {
        const u32_t x = i % E, r1 = i / E, gg = r1 % G, r2 = r1 / G, j = r2 % R, bi = r2 / R;
        const T* s = src + (((i64)bi * rows + j) * g * rep + (i64)gg * rep) * e + x;
        float sum = 0.f;
        for (i64 r = 0; r < rep; ++r) sum += ld(s + r * e);
        dst[(((i64)bi * dst_t + row0 + j) * g + gg) * e + x] += sum;
    }
}

template <typename T>
__device__ __forceinline__ void store(const float* src, T* dst, i64 n) {
    GRID_LOOP(i, n) { st(dst + i, src[i]); }
}

#define CP_KERNELS(T, N) \
    extern "C" __global__ void cp_gather_rows_##N(const T* src, T* dst, i64 b, i64 rows, i64 src_t, i64 row0, \
                                                  i64 g, i64 rep, i64 e) { \
        gather_rows(src, dst, b, rows, src_t, row0, g, rep, e); \
    } \
    extern "C" __global__ void cp_merge_##N(const T* op, const float* lp, float* acc, const float* lacc, i64 b, \
                                            i64 n, i64 t, i64 row0, i64 h, i64 e) { \
        merge(op, lp, acc, lacc, b, n, t, row0, h, e); \
    } \
    extern "C" __global__ void cp_add_groups_##N(const T* src, float* dst, i64 b, i64 rows, i64 dst_t, i64 row0, \
                                                 i64 g, i64 rep, i64 e) { \
        add_groups(src, dst, b, rows, dst_t, row0, g, rep, e); \
    } \
    extern "C" __global__ void cp_store_##N(const float* src, T* dst, i64 n) { store(src, dst, n); }
CP_KERNELS(float, f32)
CP_KERNELS(bf16_t, bf16)
CP_KERNELS(f16_t, f16)

// lacc [B H, t] at rows row0 .. <- log(exp(lacc) + exp(lp)) with lp [B H, n].
extern "C" __global__ void cp_merge_lse(const float* lp, float* lacc, i64 bh, i64 n, i64 t, i64 row0) {
    const u32_t N = n;
    GRID_LOOP(i, bh * n) {
        const u32_t r = i % N, q = i / N;
        float* a = lacc + (i64)q * t + row0 + r;
        const float lo = *a, l2 = lp[i], m = fmaxf(lo, l2);
        if (m != NEG_INF) *a = m + logf(expf(lo - m) + expf(l2 - m));
    }
}

// dst [B H, n] <- rows row0 .. row0 + n of src [B H, t].
extern "C" __global__ void cp_lse_rows(const float* src, float* dst, i64 bh, i64 n, i64 t, i64 row0) {
    const u32_t N = n;
    GRID_LOOP(i, bh * n) { dst[i] = src[(i64)(i / N) * t + row0 + i % N]; }
}

extern "C" __global__ void cp_fill(float* p, float v, i64 n) {
    GRID_LOOP(i, n) { p[i] = v; }
}
