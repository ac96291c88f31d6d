// OxiFlow CUDA kernels (compiled once per process with NVRTC; see kernels.rs).
// Templates are instantiated per dtype (kernels.rs's `Template::dtypes` lists which): f32, f64,
// i64, and the 16-bit floats bf16 and f16, which load and store 16 bits and compute in f32
// (`Acc<T>::type`, the compute type of a storage type T).
// (elementwise_math.cuh, prepended, defines the element types and the per-element math.)

template <typename T> __device__ void unary_t(i64 n, int op, const T* x, T* y) { ACC GRID_LOOP(i, n) y[i] = (T)un_f<C>(op, (C)x[i]); }
template <typename T> __device__ void unary_bw_t(i64 n, int op, const T* g, const T* x, T* y) { ACC GRID_LOOP(i, n) y[i] = (T)unb_f<C>(op, (C)g[i], (C)x[i]); }
template <typename T> __device__ void scalar_t(i64 n, int op, double cd, const T* x, T* y) {
    ACC
    C c = (C)cd;
    GRID_LOOP(i, n) {
        C v = x[i];
        switch (op) {
            case 0: y[i] = (T)(v + c); break;
            case 1: y[i] = (T)(v * c); break;
            case 2: y[i] = (T)(c - v); break;
            case 3: y[i] = (T)(c / v); break;
            default: y[i] = (T)m_pow(v, c); break;
        }
    }
}
__device__ void scalar_i(i64 n, int op, double cd, const i64* x, i64* y) {
    unsigned long long c = (unsigned long long)(i64)cd;
    GRID_LOOP(i, n) {
        unsigned long long v = (unsigned long long)x[i];
        y[i] = op == 0 ? (i64)(v + c) : op == 1 ? (i64)(v * c) : (i64)(c - v);
    }
}

// Broadcasting binary op: output contiguous of `p.shape`, inputs read through strides s0/s1.
template <typename T> __device__ void binary_t(i64 n, int op, Nd p, const T* a, const T* b, T* y) {
    ACC
    GRID_LOOP(i, n) {
        i64 rem = i, ia = 0, ib = 0;
        for (int d = p.ndim - 1; d >= 0; --d) {
            i64 c = rem % p.shape[d]; rem /= p.shape[d];
            ia += c * p.s0[d]; ib += c * p.s1[d];
        }
        C u = a[ia], v = b[ib];
        y[i] = (T)(op == 0 ? u + v : op == 1 ? u - v : op == 2 ? u * v : u / v);
    }
}

// Strided copy of a box: element i (row-major over p.shape) goes from src[src_off + idx.s0]
// to dst[dst_off + idx.s1]; op 0 copies, 1/2/3 reduce (sum/max/min) into dst.
template <typename T> __device__ void copy_nd_t(i64 n, int op, Nd p, const T* src, i64 src_off, T* dst, i64 dst_off) {
    ACC
    GRID_LOOP(i, n) {
        i64 rem = i, is = src_off, id = dst_off;
        for (int d = p.ndim - 1; d >= 0; --d) {
            i64 c = rem % p.shape[d]; rem /= p.shape[d];
            is += c * p.s0[d]; id += c * p.s1[d];
        }
        T v = src[is];
        if (op == 0) dst[id] = v;
        else if (op == 1) dst[id] = (T)((C)dst[id] + (C)v);
        else if (op == 2) { T o = dst[id]; dst[id] = (C)v > (C)o ? v : o; }
        else { T o = dst[id]; dst[id] = (C)v < (C)o ? v : o; }
    }
}

// `batch` x `rows` runs of `run` elements: src runs `ss` apart within a batch and `bs` apart
// across batches, dst runs `ds` / `bd` apart (a box whose inner dims are contiguous on both
// sides, or a series of equal boxes: the packs and unpacks of boxing). threadIdx.x walks a
// run, threadIdx.y a row, blockIdx.z a batch, all grid-stride.
#define ROWS_LOOP(b, r, c) \
    for (i64 b = blockIdx.z; b < batch; b += gridDim.z) \
    for (i64 r = (i64)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.y * blockDim.y) \
    for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < run; c += (i64)gridDim.x * blockDim.x)
template <typename T> __device__ void copy_rows_t(i64 batch, i64 rows, i64 run, int op, const T* s, i64 so, i64 bs, i64 ss, T* d, i64 dof, i64 bd, i64 ds) {
    typedef typename Acc<T>::type A;
    ROWS_LOOP(b, r, c) {
        T v = s[so + b * bs + r * ss + c];
        T* o = d + dof + b * bd + r * ds + c;
        if (op == 0) *o = v;
        else if (op == 1) *o = (T)((A)*o + (A)v);
        else if (op == 2) *o = (A)v > (A)*o ? v : *o;
        else *o = (A)v < (A)*o ? v : *o;
    }
}

// The plain copy of copy_rows_t in 16-byte units (every offset, stride and run a multiple of 16
// bytes; the caller checks).
extern "C" __global__ void copy_rows_v16(i64 batch, i64 rows, i64 run, const uint4* s, i64 so, i64 bs, i64 ss, uint4* d, i64 dof, i64 bd, i64 ds) {
    ROWS_LOOP(b, r, c) d[dof + b * bd + r * ds + c] = s[so + b * bs + r * ss + c];
}

// V values of T moved by one aligned load or store (V * sizeof(T) a power of two, at most 16).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T e[V]; };
// Whether `p` may be read or written as `Pack`s.
template <typename P> __device__ __forceinline__ bool packs(const void* p) { return (size_t)p % sizeof(P) == 0; }

// 16 bytes a thread where `y` is 16-byte aligned (the launch's grid counts 16-byte vectors),
// the tail and an unaligned `y` value by value.
template <typename T> __device__ void fill_t(i64 n, T v, T* y) {
    constexpr int V = 16 / sizeof(T);
    typedef Pack<T, V> P;
    i64 nv = 0;
    if (packs<P>(y)) {
        nv = n / V;
        P pv;
#pragma unroll
        for (int j = 0; j < V; ++j) pv.e[j] = v;
        GRID_LOOP(i, nv) ((P*)y)[i] = pv;
    }
    GRID_LOOP(i, n - nv * V) y[nv * V + i] = v;
}

// Row reduction of a contiguous [rows, len] array: one block per row (grid-stride over rows);
// mode 0 sums, 1 takes the max, 2 the min.
template <typename T> __device__ T combine_t(int mode, T a, T b) {
    return mode == 1 ? (b > a ? b : a) : mode == 2 ? (b < a ? b : a) : a + b;
}

// Block-wide reductions for the row kernels (one block per row, blockDim a multiple of 32, at
// most 1024): every thread gets the result. `sh` holds 32 values of T.
template <typename T> __device__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename T> __device__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) { T u = __shfl_xor_sync(0xffffffffu, v, o); v = u > v ? u : v; }
    return v;
}
// Sum (MAX false) or maximum (MAX true) of v over the block.
template <bool MAX, typename T> __device__ T block_reduce(T v, T* sh) {
    v = MAX ? warp_max(v) : warp_sum(v);
    int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[w] = v;
    __syncthreads();
    v = (int)(threadIdx.x & 31) < nw ? sh[threadIdx.x & 31] : (MAX ? m_lowest((T)0) : (T)0);
    return MAX ? warp_max(v) : warp_sum(v);
}
template <typename T> __device__ T block_sum(T v, T* sh) { return block_reduce<false>(v, sh); }
template <typename T> __device__ T block_max(T v, T* sh) { return block_reduce<true>(v, sh); }
#define ROW_SHARED(T) __shared__ double sh_raw[32]; T* sh = (T*)sh_raw;
#define BLOCK_ROWS(r, rows) for (i64 r = blockIdx.x; r < (rows); r += gridDim.x)
#define THREAD_COLS(j, n) for (i64 j = threadIdx.x; j < (n); j += blockDim.x)

template <typename T> __device__ void reduce_rows_t(i64 rows, i64 len, int mode, double scale, const T* x, T* y) {
    ACC
    __shared__ C sh[256];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        C acc = mode == 1 ? m_lowest((C)0) : mode == 2 ? m_highest((C)0) : (C)0;
        const T* row = x + r * len;
        for (i64 j = threadIdx.x; j < len; j += blockDim.x) acc = combine_t(mode, acc, (C)row[j]);
        sh[threadIdx.x] = acc;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) sh[threadIdx.x] = combine_t(mode, sh[threadIdx.x], sh[threadIdx.x + s]);
            __syncthreads();
        }
        if (threadIdx.x == 0) y[r] = (T)(scale == 1.0 ? sh[0] : (C)(sh[0] * (C)scale));
        __syncthreads();
    }
}

// Softmax family over a dim of size n: lanes are (outer, inner) pairs, stride `inner`. With
// inner 1 (rows) one block per row, else one thread per lane. Launched with `per_row`.
template <typename T> __device__ void softmax_t(i64 lanes, i64 n, i64 inner, int log_, const T* x, T* y) {
    ACC
    if (inner == 1) {
        ROW_SHARED(C)
        BLOCK_ROWS(l, lanes) {
            const T* xr = x + l * n; T* yr = y + l * n;
            C m = m_lowest((C)0);
            THREAD_COLS(j, n) { C v = xr[j]; m = v > m ? v : m; }
            m = block_max(m, sh);
            if (m == m_lowest((C)0)) m = (C)0;
            C s = (C)0;
            THREAD_COLS(j, n) s += m_exp(xr[j] - m);
            s = block_sum(s, sh);
            if (log_) { C ls = m_log(s) + m; THREAD_COLS(j, n) yr[j] = xr[j] - ls; }
            else { C inv = (C)1 / s; THREAD_COLS(j, n) yr[j] = m_exp(xr[j] - m) * inv; }
        }
        return;
    }
    GRID_LOOP(l, lanes) {
        i64 base = (l / inner) * n * inner + (l % inner);
        C m = m_lowest((C)0);
        for (i64 j = 0; j < n; ++j) { C v = x[base + j * inner]; m = v > m ? v : m; }
        if (m == m_lowest((C)0)) m = (C)0;
        C s = (C)0;
        for (i64 j = 0; j < n; ++j) s += m_exp(x[base + j * inner] - m);
        if (log_) { C ls = m_log(s) + m; for (i64 j = 0; j < n; ++j) y[base + j * inner] = x[base + j * inner] - ls; }
        else { C inv = (C)1 / s; for (i64 j = 0; j < n; ++j) y[base + j * inner] = m_exp(x[base + j * inner] - m) * inv; }
    }
}
template <typename T> __device__ void softmax_bw_t(i64 lanes, i64 n, i64 inner, int log_, const T* yv, const T* g, T* dx) {
    ACC
    if (inner == 1) {
        ROW_SHARED(C)
        BLOCK_ROWS(l, lanes) {
            const T* yr = yv + l * n; const T* gr = g + l * n; T* dr = dx + l * n;
            C s = (C)0;
            if (log_) {
                THREAD_COLS(j, n) s += gr[j];
                s = block_sum(s, sh);
                THREAD_COLS(j, n) dr[j] = gr[j] - m_exp(yr[j]) * s;
            } else {
                THREAD_COLS(j, n) s += gr[j] * yr[j];
                s = block_sum(s, sh);
                THREAD_COLS(j, n) dr[j] = yr[j] * (gr[j] - s);
            }
        }
        return;
    }
    GRID_LOOP(l, lanes) {
        i64 base = (l / inner) * n * inner + (l % inner);
        C s = (C)0;
        if (log_) {
            for (i64 j = 0; j < n; ++j) s += g[base + j * inner];
            for (i64 j = 0; j < n; ++j) { i64 q = base + j * inner; dx[q] = g[q] - m_exp(yv[q]) * s; }
        } else {
            for (i64 j = 0; j < n; ++j) { i64 q = base + j * inner; s += g[q] * yv[q]; }
            for (i64 j = 0; j < n; ++j) { i64 q = base + j * inner; dx[q] = yv[q] * (g[q] - s); }
        }
    }
}

// LayerNorm over the last dim h of `rows` rows, one block per row; also each row's mean and
// 1/std in the compute type (saved for the backward).
template <typename T> __device__ void layer_norm_t(i64 rows, i64 h, double epsd, const T* x, const T* w, const T* b, T* y, typename Acc<T>::type* mo, typename Acc<T>::type* ro) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        const T* xr = x + r * h; T* yr = y + r * h;
        C n = (C)(h > 0 ? h : 1), eps = (C)epsd, mean = (C)0, var = (C)0;
        THREAD_COLS(j, h) mean += xr[j];
        mean = block_sum(mean, sh) / n;
        THREAD_COLS(j, h) var += (xr[j] - mean) * (xr[j] - mean);
        var = block_sum(var, sh);
        C rstd = (C)1 / m_sqrt(var / n + eps);
        THREAD_COLS(j, h) yr[j] = (xr[j] - mean) * rstd * w[j] + b[j];
        if (threadIdx.x == 0) { mo[r] = mean; ro[r] = rstd; }
    }
}
// dx from dy and the forward's per-row mean and 1/std (compute type).
template <typename T> __device__ void layer_norm_bw_t(i64 rows, i64 h, const T* x, const T* w, const T* g, const typename Acc<T>::type* mi, const typename Acc<T>::type* ri, T* dx) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        const T* xr = x + r * h; const T* gr = g + r * h; T* dr = dx + r * h;
        C n = (C)(h > 0 ? h : 1), mean = mi[r], rstd = ri[r];
        C sg = (C)0, sgx = (C)0;
        THREAD_COLS(j, h) { C gv = gr[j] * w[j]; sg += gv; sgx += gv * (xr[j] - mean) * rstd; }
        sg = block_sum(sg, sh);
        sgx = block_sum(sgx, sh);
        C mg = sg / n, mgx = sgx / n;
        THREAD_COLS(j, h) { C xh = (xr[j] - mean) * rstd; dr[j] = rstd * (gr[j] * w[j] - mg - xh * mgx); }
    }
}

// log-sum-exp of row `r` of c columns, computed by the whole block.
template <typename T, typename C> __device__ C block_lse(const T* r, i64 c, C* sh) {
    C m = m_lowest((C)0);
    THREAD_COLS(j, c) m = (C)r[j] > m ? (C)r[j] : m;
    m = block_max(m, sh);
    if (m == m_lowest((C)0)) m = (C)0;
    C s = (C)0;
    THREAD_COLS(j, c) s += m_exp((C)r[j] - m);
    return m_log(block_sum(s, sh)) + m;
}
// Out-of-range labels give NaN (the CPU kernel's typed error cannot be raised without a sync).
// One block per row.
template <typename T> __device__ void cross_entropy_t(i64 rows, i64 c, const T* x, const i64* lab, T* y) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        i64 t = lab[r];
        const T* xr = x + r * c;
        C lse = block_lse(xr, c, sh);
        if (threadIdx.x == 0) y[r] = (t < 0 || t >= c) ? m_nan((C)0) : lse - xr[t];
    }
}
template <typename T> __device__ void cross_entropy_bw_t(i64 rows, i64 c, const T* x, const i64* lab, const T* g, T* dx) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        i64 t = lab[r];
        const T* xr = x + r * c; T* dr = dx + r * c;
        C s = block_lse(xr, c, sh), gv = g[r];
        bool ok = t >= 0 && t < c;
        THREAD_COLS(j, c) dr[j] = ok ? m_exp(xr[j] - s) * gv - (j == t ? gv : (C)0) : m_nan((C)0);
    }
}

// Vocabulary-parallel cross-entropy on one class shard: a [rows, c] piece whose first column is
// global `start`; global columns from `classes` on are padding (outside the softmax, gradient
// 0). The per-row log-sum-exp, loss and incoming gradient are in the compute type C. Labels
// outside 0..classes give NaN (the CPU kernels' typed error cannot be raised without a sync).
__device__ __forceinline__ i64 class_columns(i64 c, i64 start, i64 classes) {
    i64 v = classes - start;
    return v < 0 ? 0 : v > c ? c : v;
}
// Per row, the log-sum-exp of the class columns in one pass over the row: each thread keeps a
// running max and the sum of exponentials relative to it, and the block combines them; -inf
// where the shard holds no class. One block per row.
template <typename T> __device__ void vp_lse_t(i64 rows, i64 c, i64 start, i64 classes, const T* x, typename Acc<T>::type* y) {
    ACC
    ROW_SHARED(C)
    i64 n = class_columns(c, start, classes);
    BLOCK_ROWS(r, rows) {
        const T* xr = x + r * c;
        C m = m_lowest((C)0), s = (C)0;
        THREAD_COLS(j, n) {
            C v = xr[j];
            if (v > m) { s = s * m_exp(m - v) + (C)1; m = v; } else s += m_exp(v - m);
        }
        C mb = block_max(m, sh);
        C sb = block_sum(s > (C)0 ? s * m_exp(m - mb) : (C)0, sh);
        if (threadIdx.x == 0) y[r] = sb > (C)0 ? mb + m_log(sb) : -m_inf((C)0);
    }
}
// Per row: lse where the shard starts at column 0 (else 0), minus the label's logit where the
// shard holds its column (a partial sum over the class shards).
template <typename T> __device__ void vp_loss_t(i64 rows, i64 c, i64 start, i64 classes, const T* x, const i64* lab, const typename Acc<T>::type* lse, typename Acc<T>::type* y) {
    ACC
    GRID_LOOP(r, rows) {
        i64 t = lab[r], j = t - start;
        C v = (j >= 0 && j < c) ? (C)x[r * c + j] : (C)0;
        y[r] = (t < 0 || t >= classes) ? m_nan((C)0) : (start == 0 ? lse[r] : (C)0) - v;
    }
}
// dx = dy (exp(x - lse) - onehot(label)) in the class columns, 0 in the padding. One block per
// row.
template <typename T> __device__ void vp_bw_t(i64 rows, i64 c, i64 start, i64 classes, const T* x, const i64* lab, const typename Acc<T>::type* lse, const typename Acc<T>::type* g, T* dx) {
    ACC
    i64 n = class_columns(c, start, classes);
    BLOCK_ROWS(r, rows) {
        i64 t = lab[r], tj = t - start;
        bool ok = t >= 0 && t < classes;
        C s = lse[r], gv = g[r];
        const T* xr = x + r * c; T* dr = dx + r * c;
        THREAD_COLS(j, c) {
            C d = j >= n ? (C)0 : !ok ? m_nan((C)0) : m_exp((C)xr[j] - s) * gv - (j == tj ? gv : (C)0);
            dr[j] = (T)d;
        }
    }
}

// Reads along a dim at indices: output element l = (o, j, i) of [outer, nidx, inner] reads
// x[o, id - start, i] of x [outer, nx, inner], id = idx[l] (per_elem: torch.gather) or idx[j]
// (index-select, embedding). Ids of other ranks' positions read 0; ids outside 0..total read
// NaN (0 for i64): the CPU kernel's typed error cannot be raised without a sync.
template <typename T> __device__ void take_t(i64 n, i64 nidx, i64 inner, i64 nx, i64 start, i64 total, int per_elem, const T* x, const i64* idx, T* y) {
    GRID_LOOP(l, n) {
        i64 j = (l / inner) % nidx, o = l / (inner * nidx), i = l % inner;
        i64 id = per_elem ? idx[l] : idx[j], r = id - start;
        y[l] = (id < 0 || id >= total) ? (T)m_nan((typename Acc<T>::type)0) : (r >= 0 && r < nx) ? x[(o * nx + r) * inner + i] : (T)0;
    }
}
// The scatter-add of take_t's gradient: src element l adds into y[o, id - start, i] of
// y [outer, ny, inner] when id is this rank's (y zeroed by the caller).
template <typename T> __device__ void put_t(i64 n, i64 nidx, i64 inner, i64 ny, i64 start, i64 total, int per_elem, const i64* idx, const T* src, T* y) {
    GRID_LOOP(l, n) {
        i64 j = (l / inner) % nidx, o = l / (inner * nidx), i = l % inner;
        i64 id = per_elem ? idx[l] : idx[j], r = id - start;
        if (id >= 0 && id < total && r >= 0 && r < ny) atomicAdd(&y[(o * ny + r) * inner + i], src[l]);
    }
}

// Element-wise selection on contiguous arrays of one shape: y = c != 0 ? a : b.
template <typename T> __device__ void where_t(i64 n, const double* c, const T* a, const T* b, T* y) {
    GRID_LOOP(i, n) y[i] = c[i] != 0.0 ? a[i] : b[i];
}
// Triangular mask of [.., rows, cols] pieces whose corner is global (r0, c0): keeps
// col - row >= k (upper) or <= k (lower), zeros elsewhere.
template <typename T> __device__ void triangular_t(i64 n, i64 rows, i64 cols, i64 r0, i64 c0, i64 k, int upper, const T* x, T* y) {
    GRID_LOOP(i, n) {
        i64 d = (c0 + i % cols) - (r0 + (i / cols) % rows);
        y[i] = (upper ? d >= k : d <= k) ? x[i] : (T)0;
    }
}
// Rotary embedding: the last dim (d, even) holds pairs (j, j + d/2) rotated by
// pos * base^(-2j/d), pos = pos0 + the index along the sequence dim (t long, `inner`
// elements apart); sign -1 rotates back.
template <typename T> __device__ void rotary_t(i64 n, i64 d, i64 t, i64 inner, i64 pos0, double base, double sign, const T* x, T* y) {
    ACC
    GRID_LOOP(l, n) {
        i64 j = l % d, h = d / 2, i = j % h;
        double pos = (double)(pos0 + (l / inner) % t);
        double a = pos * pow(base, -2.0 * (double)i / (double)d);
        C s = (C)(sign * sin(a)), c = (C)cos(a);
        y[l] = j < h ? x[l] * c - x[l + h] * s : x[l - h] * s + x[l] * c;
    }
}

// Plain matmul for i64 (cuBLAS covers f32/f64): y[b, m, n] = sum_k a[b, m, k] x[b, k, n].
__device__ void matmul_i(i64 batch, i64 m, i64 k, i64 n, i64 sb, const i64* a, const i64* b, i64* y) {
    GRID_LOOP(i, batch * m * n) {
        i64 bi = i / (m * n), r = (i / n) % m, c = i % n;
        const i64* ar = a + bi * m * k + r * k; const i64* bc = b + bi * sb + c;
        unsigned long long acc = 0;
        for (i64 j = 0; j < k; ++j) acc += (unsigned long long)ar[j] * (unsigned long long)bc[j * n];
        y[i] = (i64)acc;
    }
}

// V values a thread, V the count whose wider side is 16 bytes, where both pointers are aligned
// to their packs (the launch's grid counts packs); the tail and unaligned pointers value by
// value. Each value converts as `(D)x[i]` either way.
template <typename S, typename D> __device__ void cast_t(i64 n, const S* x, D* y) {
    constexpr int V = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
    typedef Pack<S, V> PS;
    typedef Pack<D, V> PD;
    i64 nv = 0;
    if (packs<PS>(x) && packs<PD>(y)) {
        nv = n / V;
        GRID_LOOP(i, nv) {
            PS a = ((const PS*)x)[i];
            PD b;
#pragma unroll
            for (int j = 0; j < V; ++j) b.e[j] = (D)a.e[j];
            ((PD*)y)[i] = b;
        }
    }
    GRID_LOOP(i, n - nv * V) y[nv * V + i] = (D)x[nv * V + i];
}

// Philox4x32-10 counter-based RNG, bit for bit as tensor/src/rng.rs: counter x under key
// (k0, k1), in place.
__device__ __forceinline__ void philox4(unsigned x[4], unsigned a, unsigned b) {
    for (int r = 0; r < 10; ++r) {
        unsigned long long p0 = 0xD2511F53ULL * x[0], p1 = 0xCD9E8D57ULL * x[2];
        unsigned n0 = (unsigned)(p1 >> 32) ^ x[1] ^ a, n2 = (unsigned)(p0 >> 32) ^ x[3] ^ b;
        x[1] = (unsigned)p1; x[3] = (unsigned)p0; x[0] = n0; x[2] = n2;
        a += 0x9E3779B9u; b += 0xBB67AE85u;
    }
}

// Block `i` of counter (c0 + i, c1, c2, c3) under key (k0, k1) writes 4 u32 words.
__device__ void philox_u32(i64 nblocks, unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0, unsigned k1, unsigned* out) {
    GRID_LOOP(i, nblocks) {
        unsigned long long base = ((unsigned long long)c1 << 32 | c0) + (unsigned long long)i;
        unsigned x[4] = {(unsigned)base, (unsigned)(base >> 32), c2, c3};
        philox4(x, k0, k1);
        out[4 * i] = x[0]; out[4 * i + 1] = x[1]; out[4 * i + 2] = x[2]; out[4 * i + 3] = x[3];
    }
}

// Uniform in [0, 1) with 53 bits from Philox words, as rng::uniform.
__device__ __forceinline__ double uniform53(const unsigned x[4]) {
    unsigned long long bits = ((unsigned long long)x[0] << 21) ^ (unsigned long long)(x[1] >> 11);
    return (double)(bits & ((1ULL << 53) - 1)) * (1.0 / 9007199254740992.0);
}

// Global row-major index of element `l` of a region: extents p.shape, global strides p.s0,
// region start `base`.
__device__ __forceinline__ i64 region_index(i64 l, i64 base, const Nd& p) {
    i64 rem = l, g = base;
    for (int d = p.ndim - 1; d >= 0; --d) {
        i64 c = rem % p.shape[d]; rem /= p.shape[d];
        g += c * p.s0[d];
    }
    return g;
}

// Creation ops on the device, as tensor/src/creation.rs computes them on the host: element `l`
// of a region (extents p.shape, global strides p.s0) of a tensor, from its global row-major
// index g = base + sum(coord * s0): kind 0 full (a), 1 arange (a + b g), 2 uniform and
// 3 normal (Philox of counter (g, g >> 32, 0, 0) under key (k0, k1); rng::uniform, rng::normal).
template <typename T> __device__ void create_t(i64 n, int kind, double a, double b, unsigned k0, unsigned k1, i64 base, Nd p, T* y) {
    GRID_LOOP(l, n) {
        i64 g = region_index(l, base, p);
        double v;
        if (kind == 0) v = a;
        else if (kind == 1) v = a + b * (double)g;
        else {
            unsigned long long u = (unsigned long long)g;
            unsigned x[4] = {(unsigned)u, (unsigned)(u >> 32), 0u, 0u};
            philox4(x, k0, k1);
            if (kind == 2) {
                v = uniform53(x);
            } else {
                double u1 = ((double)x[0] + 1.0) / 4294967296.0;
                double u2 = (double)x[1] / 4294967296.0;
                v = sqrt(-2.0 * log(u1)) * cos(2.0 * 3.141592653589793 * u2);
            }
        }
        // 16-bit values are the f32 values rounded once, as the host makes them.
        y[l] = (T)(typename Acc<T>::type)v;
    }
}

// Dropout of a contiguous piece (a region of the global tensor, as create_t): element l is
// kept, times `scale`, when rng::uniform(seed, global index) >= pd (seed = (k0, k1)), else 0.
template <typename T> __device__ void dropout_t(i64 n, double pd, double scale, unsigned k0, unsigned k1, i64 base, Nd p, const T* x, T* y) {
    ACC
    GRID_LOOP(l, n) {
        unsigned long long u = (unsigned long long)region_index(l, base, p);
        unsigned w[4] = {(unsigned)u, (unsigned)(u >> 32), 0u, 0u};
        philox4(w, k0, k1);
        y[l] = uniform53(w) >= pd ? x[l] * (C)scale : (C)0;
    }
}

// Attention probabilities from [rows, s] scores (rows = B * H * t): softmax of scores * scale
// per row; with `causal` row r (query r % t) covers columns 0..=r % t and the rest become 0.
// One block per row.
template <typename T> __device__ void attn_softmax_t(i64 rows, i64 t, i64 s, double scale, int causal, const T* x, T* y) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        const T* xr = x + r * s; T* yr = y + r * s;
        i64 live = causal ? (r % t) + 1 : s;
        if (live > s) live = s;
        C sc = (C)scale, m = m_lowest((C)0);
        THREAD_COLS(j, live) { C v = xr[j] * sc; m = v > m ? v : m; }
        m = block_max(m, sh);
        if (m == m_lowest((C)0)) m = (C)0;
        C sum = (C)0;
        THREAD_COLS(j, live) sum += m_exp(xr[j] * sc - m);
        C inv = (C)1 / block_sum(sum, sh);
        THREAD_COLS(j, live) yr[j] = m_exp(xr[j] * sc - m) * inv;
        for (i64 j = live + threadIdx.x; j < s; j += blockDim.x) yr[j] = (C)0;
    }
}

// Fused attention's composed path, one block per row of `s` raw scores q . k of a
// [rows = H T, s] batch entry (query i = r % t; with `causal` keys 0..=i only): the scaled,
// masked softmax in place and the row's log-sum-exp (-inf for a row without keys).
template <typename T> __device__ void flash_rows_t(i64 rows, i64 t, i64 s, double scale, int causal, T* x, typename Acc<T>::type* lse) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        T* xr = x + r * s;
        i64 live = causal ? (r % t) + 1 : s;
        if (live > s) live = s;
        C sc = (C)scale, m = m_lowest((C)0);
        THREAD_COLS(j, live) { C v = (C)xr[j] * sc; m = v > m ? v : m; }
        m = block_max(m, sh);
        if (m == m_lowest((C)0)) m = (C)0;
        C sum = (C)0;
        THREAD_COLS(j, live) sum += m_exp((C)xr[j] * sc - m);
        sum = block_sum(sum, sh);
        C inv = (C)1 / sum;
        THREAD_COLS(j, live) xr[j] = m_exp((C)xr[j] * sc - m) * inv;
        for (i64 j = live + threadIdx.x; j < s; j += blockDim.x) xr[j] = (C)0;
        if (threadIdx.x == 0) lse[r] = m + m_log(sum);
    }
}
// Its backward on one row: from raw scores x, the gradient of the probabilities g and the row's
// log-sum-exp, P = exp(scale x - lse) (masked 0) into x and dS = P (g - sum P g) scale into g.
template <typename T> __device__ void flash_rows_bw_t(i64 rows, i64 t, i64 s, double scale, int causal, T* x, T* g, const typename Acc<T>::type* lse) {
    ACC
    ROW_SHARED(C)
    BLOCK_ROWS(r, rows) {
        T* xr = x + r * s; T* gr = g + r * s;
        i64 live = causal ? (r % t) + 1 : s;
        if (live > s) live = s;
        C sc = (C)scale, l = lse[r], acc = (C)0;
        THREAD_COLS(j, live) { C p = m_exp((C)xr[j] * sc - l); xr[j] = p; acc += p * (C)gr[j]; }
        C c = block_sum(acc, sh);
        THREAD_COLS(j, live) gr[j] = (C)xr[j] * ((C)gr[j] - c) * sc;
        for (i64 j = live + threadIdx.x; j < s; j += blockDim.x) { xr[j] = (C)0; gr[j] = (C)0; }
    }
}

// f32 -> bf16 bits, round to nearest even (NaN stays NaN).
extern "C" __global__ void f32_to_bf16(i64 n, const unsigned* x, unsigned short* y) {
    GRID_LOOP(i, n) {
        unsigned b = x[i];
        y[i] = (b & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((b >> 16) | 0x40u)
                                               : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
}

// Fused AdamW pieces, element-wise over n: part 0 a x + b y (first moment), part 1
// a x + b y^2 (second moment), part 2 a x - (b y) / (sqrt(c z) + d) (the decayed, updated value).
template <typename T> __device__ void adam_t(i64 n, int part, double a, double b, double c, double d, const T* x, const T* y, const T* z, T* o) {
    ACC
    C ta = (C)a, tb = (C)b, tc = (C)c, td = (C)d;
    if (part == 0) { GRID_LOOP(i, n) o[i] = x[i] * ta + y[i] * tb; }
    else if (part == 1) { GRID_LOOP(i, n) { C g = y[i]; o[i] = x[i] * ta + (g * g) * tb; } }
    else { GRID_LOOP(i, n) o[i] = x[i] * ta - (y[i] * tb) / (m_sqrt(z[i] * tc) + td); }
}

// Column sums of a [rows, cols] array in chunks of `chunk` rows: y[g, c] = scale * sum of
// x[r, c] over the rows r of chunk g (adjacent threads read adjacent columns).
template <typename T> __device__ void reduce_cols_t(i64 rows, i64 cols, i64 chunk, double scale, const T* x, T* y) {
    ACC
    i64 groups = (rows + chunk - 1) / chunk;
    GRID_LOOP(i, groups * cols) {
        i64 g = i / cols, c = i % cols, r0 = g * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
        C acc = (C)0;
        for (i64 r = r0; r < r1; ++r) acc += x[r * cols + c];
        y[i] = scale == 1.0 ? acc : (C)(acc * (C)scale);
    }
}

// Sum, max or min over the middle dim of x [outer, len, inner] into y [outer, inner] (times
// scale): one thread per output, the threads of a block reading consecutive columns of each
// row. For a short reduced dim beside a long inner one, where a block per output row would
// leave most of its threads idle.
template <typename T> __device__ void reduce_mid_t(i64 outer, i64 len, i64 inner, int mode, double scale, const T* x, T* y) {
    ACC
    GRID_LOOP(i, outer * inner) {
        const T* p = x + (i / inner) * len * inner + i % inner;
        C acc = mode == 1 ? m_lowest((C)0) : mode == 2 ? m_highest((C)0) : (C)0;
        for (i64 j = 0; j < len; ++j) acc = combine_t(mode, acc, (C)p[j * inner]);
        y[i] = (T)(scale == 1.0 ? acc : (C)(acc * (C)scale));
    }
}

// attn_softmax_t on f32 that also writes each probability's bf16 copy to yh (the copy a bf16
// matrix product reads next).
extern "C" __global__ void attn_softmax_with_bf16_copy(i64 rows, i64 t, i64 s, double scale, int causal, const float* x, float* y, unsigned short* yh) {
    ROW_SHARED(float)
    BLOCK_ROWS(r, rows) {
        const float* xr = x + r * s; float* yr = y + r * s; unsigned short* hr = yh + r * s;
        i64 live = causal ? (r % t) + 1 : s;
        if (live > s) live = s;
        float sc = (float)scale, m = m_lowest(0.0f);
        THREAD_COLS(j, live) { float v = xr[j] * sc; m = v > m ? v : m; }
        m = block_max(m, sh);
        if (m == m_lowest(0.0f)) m = 0.0f;
        float sum = 0.0f;
        THREAD_COLS(j, live) sum += m_exp(xr[j] * sc - m);
        float inv = 1.0f / block_sum(sum, sh);
        THREAD_COLS(j, live) { float v = m_exp(xr[j] * sc - m) * inv; yr[j] = v; hr[j] = bf16_bits(v); }
        for (i64 j = live + threadIdx.x; j < s; j += blockDim.x) { yr[j] = 0.0f; hr[j] = 0; }
    }
}
// softmax_bw_t on f32 rows (inner 1, not log) that also writes each gradient's bf16 copy to dh.
extern "C" __global__ void softmax_bw_rows_bf16(i64 lanes, i64 n, const float* yv, const float* g, float* dx, unsigned short* dh) {
    ROW_SHARED(float)
    BLOCK_ROWS(l, lanes) {
        const float* yr = yv + l * n; const float* gr = g + l * n; float* dr = dx + l * n; unsigned short* hr = dh + l * n;
        float s = 0.0f;
        THREAD_COLS(j, n) s += gr[j] * yr[j];
        s = block_sum(s, sh);
        THREAD_COLS(j, n) { float v = yr[j] * (gr[j] - s); dr[j] = v; hr[j] = bf16_bits(v); }
    }
}

#define INST(NAME, T) \
extern "C" __global__ void unary_bw_##NAME(i64 n, int op, const T* g, const T* x, T* y) { unary_bw_t<T>(n, op, g, x, y); } \
extern "C" __global__ void softmax_##NAME(i64 l, i64 n, i64 inner, int lg, const T* x, T* y) { softmax_t<T>(l, n, inner, lg, x, y); } \
extern "C" __global__ void softmax_bw_##NAME(i64 l, i64 n, i64 inner, int lg, const T* yv, const T* g, T* dx) { softmax_bw_t<T>(l, n, inner, lg, yv, g, dx); } \
extern "C" __global__ void layer_norm_##NAME(i64 r, i64 h, double e, const T* x, const T* w, const T* b, T* y, Acc<T>::type* mo, Acc<T>::type* ro) { layer_norm_t<T>(r, h, e, x, w, b, y, mo, ro); } \
extern "C" __global__ void layer_norm_bw_##NAME(i64 r, i64 h, const T* x, const T* w, const T* g, const Acc<T>::type* mi, const Acc<T>::type* ri, T* dx) { layer_norm_bw_t<T>(r, h, x, w, g, mi, ri, dx); } \
extern "C" __global__ void cross_entropy_##NAME(i64 r, i64 c, const T* x, const i64* l, T* y) { cross_entropy_t<T>(r, c, x, l, y); } \
extern "C" __global__ void cross_entropy_bw_##NAME(i64 r, i64 c, const T* x, const i64* l, const T* g, T* dx) { cross_entropy_bw_t<T>(r, c, x, l, g, dx); } \
extern "C" __global__ void vp_lse_##NAME(i64 r, i64 c, i64 st, i64 cl, const T* x, Acc<T>::type* y) { vp_lse_t<T>(r, c, st, cl, x, y); } \
extern "C" __global__ void vp_loss_##NAME(i64 r, i64 c, i64 st, i64 cl, const T* x, const i64* l, const Acc<T>::type* s, Acc<T>::type* y) { vp_loss_t<T>(r, c, st, cl, x, l, s, y); } \
extern "C" __global__ void vp_bw_##NAME(i64 r, i64 c, i64 st, i64 cl, const T* x, const i64* l, const Acc<T>::type* s, const Acc<T>::type* g, T* dx) { vp_bw_t<T>(r, c, st, cl, x, l, s, g, dx); } \
extern "C" __global__ void rotary_##NAME(i64 n, i64 d, i64 t, i64 in, i64 p0, double b, double sg, const T* x, T* y) { rotary_t<T>(n, d, t, in, p0, b, sg, x, y); } \
extern "C" __global__ void unary_##NAME(i64 n, int op, const T* x, T* y) { unary_t<T>(n, op, x, y); } \
extern "C" __global__ void scalar_##NAME(i64 n, int op, double c, const T* x, T* y) { scalar_t<T>(n, op, c, x, y); } \
extern "C" __global__ void dropout_##NAME(i64 n, double pd, double sc, unsigned k0, unsigned k1, i64 base, Nd p, const T* x, T* y) { dropout_t<T>(n, pd, sc, k0, k1, base, p, x, y); } \
extern "C" __global__ void attn_softmax_##NAME(i64 r, i64 t, i64 s, double sc, int causal, const T* x, T* y) { attn_softmax_t<T>(r, t, s, sc, causal, x, y); } \
extern "C" __global__ void flash_rows_##NAME(i64 r, i64 t, i64 s, double sc, int causal, T* x, Acc<T>::type* l) { flash_rows_t<T>(r, t, s, sc, causal, x, l); } \
extern "C" __global__ void flash_rows_bw_##NAME(i64 r, i64 t, i64 s, double sc, int causal, T* x, T* g, const Acc<T>::type* l) { flash_rows_bw_t<T>(r, t, s, sc, causal, x, g, l); } \
extern "C" __global__ void adam_##NAME(i64 n, int part, double a, double b, double c, double d, const T* x, const T* y, const T* z, T* o) { adam_t<T>(n, part, a, b, c, d, x, y, z, o); }

// The atomic scatter-add exists for f32 and f64 (16-bit scatter-adds run on an f32 copy).
#define INST_PUT(NAME, T) \
extern "C" __global__ void put_##NAME(i64 n, i64 ni, i64 in, i64 ny, i64 st, i64 tot, int pe, const i64* idx, const T* s, T* y) { put_t<T>(n, ni, in, ny, st, tot, pe, idx, s, y); }

#define INST_ALL(NAME, T) \
extern "C" __global__ void binary_##NAME(i64 n, int op, Nd p, const T* a, const T* b, T* y) { binary_t<T>(n, op, p, a, b, y); } \
extern "C" __global__ void copy_nd_##NAME(i64 n, int op, Nd p, const T* s, i64 so, T* d, i64 dof) { copy_nd_t<T>(n, op, p, s, so, d, dof); } \
extern "C" __global__ void copy_rows_##NAME(i64 batch, i64 rows, i64 run, int op, const T* s, i64 so, i64 bs, i64 ss, T* d, i64 dof, i64 bd, i64 ds) { copy_rows_t<T>(batch, rows, run, op, s, so, bs, ss, d, dof, bd, ds); } \
extern "C" __global__ void fill_##NAME(i64 n, T v, T* y) { fill_t<T>(n, v, y); } \
extern "C" __global__ void create_##NAME(i64 n, int kind, double a, double b, unsigned k0, unsigned k1, i64 base, Nd p, T* y) { create_t<T>(n, kind, a, b, k0, k1, base, p, y); } \
extern "C" __global__ void reduce_rows_##NAME(i64 rows, i64 len, int mx, double sc, const T* x, T* y) { reduce_rows_t<T>(rows, len, mx, sc, x, y); } \
extern "C" __global__ void reduce_cols_##NAME(i64 rows, i64 cols, i64 ch, double sc, const T* x, T* y) { reduce_cols_t<T>(rows, cols, ch, sc, x, y); } \
extern "C" __global__ void reduce_mid_##NAME(i64 o, i64 l, i64 in, int mx, double sc, const T* x, T* y) { reduce_mid_t<T>(o, l, in, mx, sc, x, y); } \
extern "C" __global__ void where_##NAME(i64 n, const double* c, const T* a, const T* b, T* y) { where_t<T>(n, c, a, b, y); } \
extern "C" __global__ void triangular_##NAME(i64 n, i64 r, i64 c, i64 r0, i64 c0, i64 k, int up, const T* x, T* y) { triangular_t<T>(n, r, c, r0, c0, k, up, x, y); } \
extern "C" __global__ void take_##NAME(i64 n, i64 ni, i64 in, i64 nx, i64 st, i64 tot, int pe, const T* x, const i64* idx, T* y) { take_t<T>(n, ni, in, nx, st, tot, pe, x, idx, y); }

// The source compiles in five parts (`PARTS` of kernels.rs), one per float type and the rest, on parallel
// threads (`OXI_PART` is defined before it); the kernels above are small and in every part.
#if OXI_PART == 1
INST(f32, float)
INST_ALL(f32, float)
INST_PUT(f32, float)
#elif OXI_PART == 2
INST(f64, double)
INST_ALL(f64, double)
INST_PUT(f64, double)
#elif OXI_PART == 3
INST(bf16, bf16)
INST_ALL(bf16, bf16)
#elif OXI_PART == 4
INST(f16, f16)
INST_ALL(f16, f16)
#else
INST_ALL(i64, i64)
extern "C" __global__ void unary_i64(i64 n, int op, const i64* x, i64* y) { GRID_LOOP(i, n) y[i] = un_i(op, x[i]); }
extern "C" __global__ void scalar_i64(i64 n, int op, double c, const i64* x, i64* y) { scalar_i(n, op, c, x, y); }
extern "C" __global__ void matmul_i64(i64 bt, i64 m, i64 k, i64 n, i64 sb, const i64* a, const i64* b, i64* y) { matmul_i(bt, m, k, n, sb, a, b, y); }
extern "C" __global__ void philox(i64 nb, unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0, unsigned k1, unsigned* out) { philox_u32(nb, c0, c1, c2, c3, k0, k1, out); }
#define CAST(SN, S, DN, D) extern "C" __global__ void cast_##SN##_##DN(i64 n, const S* x, D* y) { cast_t<S, D>(n, x, y); }
CAST(f32, float, f64, double)
CAST(f32, float, i64, i64)
CAST(f32, float, bf16, bf16)
CAST(f32, float, f16, f16)
CAST(f64, double, f32, float)
CAST(f64, double, i64, i64)
CAST(f64, double, bf16, bf16)
CAST(f64, double, f16, f16)
CAST(i64, i64, f32, float)
CAST(i64, i64, f64, double)
CAST(i64, i64, bf16, bf16)
CAST(i64, i64, f16, f16)
CAST(bf16, bf16, f32, float)
CAST(bf16, bf16, f64, double)
CAST(bf16, bf16, i64, i64)
CAST(bf16, bf16, f16, f16)
CAST(f16, f16, f32, float)
CAST(f16, f16, f64, double)
CAST(f16, f16, i64, i64)
CAST(f16, f16, bf16, bf16)
#endif
