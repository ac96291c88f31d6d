// Fused kernels of the raw layer: residual add + LayerNorm forward and backward, the
// multi-tensor AdamW step, the two-pass fused classifier (loss and logit gradient, in place or
// not; the one-read kernels are in classifier_one_read.cu), and 16-byte vectorised element-wise
// kernels. Every computation is in f32; 16-bit values are rounded once.

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// ---- residual add + LayerNorm -------------------------------------------------------------
// Per row of c columns: r = x + a (a may be null: r = x; r is rounded to T and written when
// r_out is not null), y = (r - mean) rstd w + b, mean and rstd saved (f32). One block per row
// (grid-stride); the row is cached in shared memory as f32. `vec`: 16-byte accesses.
template <typename T>
__device__ void ln_fwd(i64 rows, int c, float eps, int vec, const T* x, const T* a, const T* w, const T* bias,
                       T* r_out, T* y, float* mean_out, float* rstd_out) {
    extern __shared__ float row[];
    const int N = 16 / sizeof(T);
    for (i64 rr = blockIdx.x; rr < rows; rr += gridDim.x) {
        const T* xr = x + rr * c;
        const T* ar = a ? a + rr * c : 0;
        T* ro = r_out ? r_out + rr * c : 0;
        float s = 0.f;
        if (vec) {
            for (int v = threadIdx.x; v < c / N; v += blockDim.x) {
                Vec16<T> vx, va, vr;
                vx.u = ((const uint4*)xr)[v];
                if (ar) va.u = ((const uint4*)ar)[v];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float f = to_f(vx.e[j]);
                    if (ar) { vr.e[j] = from_f<T>(f + to_f(va.e[j])); f = to_f(vr.e[j]); }
                    row[v * N + j] = f;
                    s += f;
                }
                if (ro) ((uint4*)ro)[v] = vr.u;
            }
        } else {
            for (int j = threadIdx.x; j < c; j += blockDim.x) {
                float f = to_f(xr[j]);
                if (ar) {
                    T t = from_f<T>(f + to_f(ar[j]));
                    f = to_f(t);
                    if (ro) ro[j] = t;
                }
                row[j] = f;
                s += f;
            }
        }
        const float mean = block_sum(s) / (float)c;
        float q = 0.f;
        for (int j = threadIdx.x; j < c; j += blockDim.x) { float d = row[j] - mean; q += d * d; }
        const float rstd = 1.f / sqrtf(block_sum(q) / (float)c + eps);
        T* yr = y + rr * c;
        if (vec) {
            for (int v = threadIdx.x; v < c / N; v += blockDim.x) {
                Vec16<T> vw, vb, vy;
                vw.u = ((const uint4*)w)[v];
                vb.u = ((const uint4*)bias)[v];
#pragma unroll
                for (int j = 0; j < N; ++j)
                    vy.e[j] = from_f<T>((row[v * N + j] - mean) * rstd * to_f(vw.e[j]) + to_f(vb.e[j]));
                ((uint4*)yr)[v] = vy.u;
            }
        } else {
            for (int j = threadIdx.x; j < c; j += blockDim.x)
                st(yr + j, (row[j] - mean) * rstd * to_f(w[j]) + to_f(bias[j]));
        }
        if (threadIdx.x == 0) { mean_out[rr] = mean; rstd_out[rr] = rstd; }
        __syncthreads();
    }
}

// dr = rstd (g - mean(g) - xhat mean(g xhat)) + dres with g = dy w, xhat = (r - mean) rstd;
// per-block partial sums of dy xhat and dy over its rows go to part_w/part_b [gridDim.x, c].
template <typename T>
__device__ void ln_bwd(i64 rows, int c, const T* dy, const T* r, const float* mean, const float* rstd,
                       const T* w, const T* dres, T* dr, float* part_w, float* part_b) {
    extern __shared__ float acc[];
    float* aw = acc;
    float* ab = acc + c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) { aw[j] = 0.f; ab[j] = 0.f; }
    for (i64 rr = blockIdx.x; rr < rows; rr += gridDim.x) {
        const T* dyr = dy + rr * c;
        const T* xr = r + rr * c;
        const float m = mean[rr], s = rstd[rr];
        float sg = 0.f, sgx = 0.f;
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            float g = to_f(dyr[j]) * to_f(w[j]);
            float xh = (to_f(xr[j]) - m) * s;
            sg += g;
            sgx += g * xh;
        }
        const float mg = block_sum(sg) / (float)c;
        const float mgx = block_sum(sgx) / (float)c;
        T* out = dr + rr * c;
        const T* rin = dres ? dres + rr * c : 0;
        for (int j = threadIdx.x; j < c; j += blockDim.x) {
            float d = to_f(dyr[j]);
            float xh = (to_f(xr[j]) - m) * s;
            float v = s * (d * to_f(w[j]) - mg - xh * mgx);
            if (rin) v += to_f(rin[j]);
            st(out + j, v);
            aw[j] += d * xh;
            ab[j] += d;
        }
    }
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        part_w[(i64)blockIdx.x * c + j] = aw[j];
        part_b[(i64)blockIdx.x * c + j] = ab[j];
    }
}

// dw[j] (+)= sum_g part_w[g, j], db likewise, in a fixed order: blocks of 32 columns x 16
// lanes over the groups, then the 16 partial sums added in lane order; dw and db of type T.
template <typename T>
__device__ void ln_bwd_reduce(int groups, int c, int accumulate, const float* part_w, const float* part_b, T* dw, T* db) {
    __shared__ float sw[16][33], sb[16][33];
    const int tx = threadIdx.x, ty = threadIdx.y, j = blockIdx.x * 32 + tx;
    float aw = 0.f, ab = 0.f;
    if (j < c)
        for (int g = ty; g < groups; g += 16) { aw += part_w[(i64)g * c + j]; ab += part_b[(i64)g * c + j]; }
    sw[ty][tx] = aw;
    sb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && j < c) {
        float tw = 0.f, tb = 0.f;
        for (int y = 0; y < 16; ++y) { tw += sw[y][tx]; tb += sb[y][tx]; }
        st(dw + j, accumulate ? to_f(dw[j]) + tw : tw);
        st(db + j, accumulate ? to_f(db[j]) + tb : tb);
    }
}

// ---- LayerNorm forward, one warp per row ------------------------------------------------
// The same computation as ln_fwd for rows of at most 32 * V 16-byte vectors (c a multiple of
// the vector width, every address 16-byte aligned): a warp holds its row in registers (lane l
// has vectors l, l + 32, ...), its sums are warp shuffles, and no warp waits for another.
template <typename T, int V>
__device__ void ln_fwd_warp(i64 rows, int c, float eps, const T* x, const T* a, const T* w, const T* bias,
                            T* r_out, T* y, float* mean_out, float* rstd_out) {
    const int N = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, nv = c / N;
    const i64 first = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 step = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 rr = first; rr < rows; rr += step) {
        float v[V][N];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int vi = lane + k * 32;
            if (vi < nv) {
                Vec16<T> vx, va, vr;
                vx.u = ((const uint4*)(x + rr * c))[vi];
                if (a) va.u = ((const uint4*)(a + rr * c))[vi];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float f = to_f(vx.e[j]);
                    if (a) { vr.e[j] = from_f<T>(f + to_f(va.e[j])); f = to_f(vr.e[j]); }
                    v[k][j] = f;
                    s += f;
                }
                if (a && r_out) ((uint4*)(r_out + rr * c))[vi] = vr.u;
            }
        }
        const float mean = warp_sum(s) / (float)c;
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k)
            if (lane + k * 32 < nv)
#pragma unroll
                for (int j = 0; j < N; ++j) { const float d = v[k][j] - mean; q += d * d; }
        const float rstd = 1.f / sqrtf(warp_sum(q) / (float)c + eps);
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int vi = lane + k * 32;
            if (vi < nv) {
                Vec16<T> vw, vb, vy;
                vw.u = ((const uint4*)w)[vi];
                vb.u = ((const uint4*)bias)[vi];
#pragma unroll
                for (int j = 0; j < N; ++j)
                    vy.e[j] = from_f<T>((v[k][j] - mean) * rstd * to_f(vw.e[j]) + to_f(vb.e[j]));
                ((uint4*)(y + rr * c))[vi] = vy.u;
            }
        }
        if (lane == 0) { mean_out[rr] = mean; rstd_out[rr] = rstd; }
    }
}

// ---- LayerNorm backward, one warp per row -----------------------------------------------
// The math of ln_bwd for rows of at most 32 * V 16-byte vectors (c a multiple of the vector
// width, every address 16-byte aligned): warp q of the grid takes rows q, q + warps, ...; lane
// l holds vectors l, l + 32, ... of its row in registers, its row sums are warp shuffles, and
// its columns' sums of dy xhat and dy stay in registers across its rows. The block's warps add
// theirs into shared memory in warp order, and the block's sums go to part_w/part_b
// [gridDim.x, c] for ln_bwd_reduce: a fixed order (deterministic).
template <typename T, int V>
__device__ void ln_bwd_warp(i64 rows, int c, const T* dy, const T* r, const float* mean, const float* rstd,
                            const T* w, const T* dres, T* dr, float* part_w, float* part_b) {
    extern __shared__ float acc[];
    float* aw = acc;
    float* ab = acc + c;
    const int N = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nv = c / N;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    float sw[V][N], sb[V][N];
#pragma unroll
    for (int k = 0; k < V; ++k)
#pragma unroll
        for (int j = 0; j < N; ++j) { sw[k][j] = 0.f; sb[k][j] = 0.f; }
    for (i64 rr = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; rr < rows; rr += warps) {
        const float m = mean[rr], s = rstd[rr];
        float d[V][N], xh[V][N];
        float sg = 0.f, sgx = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int vi = lane + k * 32;
            if (vi < nv) {
                Vec16<T> vd, vx, vw;
                vd.u = ((const uint4*)(dy + rr * c))[vi];
                vx.u = ((const uint4*)(r + rr * c))[vi];
                vw.u = ((const uint4*)w)[vi];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    d[k][j] = to_f(vd.e[j]);
                    xh[k][j] = (to_f(vx.e[j]) - m) * s;
                    const float g = d[k][j] * to_f(vw.e[j]);
                    sg += g;
                    sgx += g * xh[k][j];
                }
            }
        }
        const float mg = warp_sum(sg) / (float)c;
        const float mgx = warp_sum(sgx) / (float)c;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int vi = lane + k * 32;
            if (vi < nv) {
                Vec16<T> vw, vres, vo;
                vw.u = ((const uint4*)w)[vi];
                if (dres) vres.u = ((const uint4*)(dres + rr * c))[vi];
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    float v = s * (d[k][j] * to_f(vw.e[j]) - mg - xh[k][j] * mgx);
                    if (dres) v += to_f(vres.e[j]);
                    vo.e[j] = from_f<T>(v);
                    sw[k][j] += d[k][j] * xh[k][j];
                    sb[k][j] += d[k][j];
                }
                ((uint4*)(dr + rr * c))[vi] = vo.u;
            }
        }
    }
    const int nw = blockDim.x >> 5;
    for (int q = 0; q < nw; ++q) {
        if (warp == q) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const int vi = lane + k * 32;
                if (vi < nv)
#pragma unroll
                    for (int j = 0; j < N; ++j) {
                        const int col = vi * N + j;
                        aw[col] = q == 0 ? sw[k][j] : aw[col] + sw[k][j];
                        ab[col] = q == 0 ? sb[k][j] : ab[col] + sb[k][j];
                    }
            }
        }
        __syncthreads();
    }
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        part_w[(i64)blockIdx.x * c + j] = aw[j];
        part_b[(i64)blockIdx.x * c + j] = ab[j];
    }
}

// ---- multi-tensor AdamW -------------------------------------------------------------------
// One launch over a device array of tensors; blockIdx.y picks the tensor. Per element, exactly
// the three passes of ElementwiseOp::Adam in f32:
//   m = m a1 + g b1;  v = v a2 + (g g) b2;  p = p decay - (m step) / (sqrt(v inv_bc2) + eps)
// with g scaled by grad_scale when it is not 1, and the bf16 copy of p written when asked. The
// new p, m and v go to param_out, m_out and v_out (which may be param, m and v themselves).
// With `clip_ratio` (a device f64 r, computed with nothing read on the host), c = min(r, 1)
// (NaN for a NaN r: a non-finite norm's clip factor) and b1, b2 are (float)(b1d c) and
// (float)(b2d c c): the host's folding of c, in the same f64 operations; with `skip_nan`, a
// NaN r leaves every tensor as it was (its outputs get the inputs' values).
struct AdamTensor {
    unsigned long long param, grad, m, v, param_out, m_out, v_out, param_bf16;
    i64 n;
    float decay;
    int grad_bf16;
};
struct AdamCoef {
    float a1, b1, a2, b2, step, inv_bc2, eps, grad_scale;
    double b1d, b2d;
    unsigned long long clip_ratio;
    int skip_nan;
};

extern "C" __global__ void adamw_multi(const AdamTensor* tensors, AdamCoef k) {
    const AdamTensor t = tensors[blockIdx.y];
    const float* p = (const float*)t.param;
    const float* m = (const float*)t.m;
    const float* v = (const float*)t.v;
    float* po = (float*)t.param_out;
    float* mo = (float*)t.m_out;
    float* vo = (float*)t.v_out;
    bf16_t* p16 = (bf16_t*)t.param_bf16;
    float b1 = k.b1, b2 = k.b2;
    bool keep = false;
    if (k.clip_ratio) {
        const double r = *(const double*)k.clip_ratio;
        const double c = r != r ? r : fmin(r, 1.0);
        b1 = (float)(k.b1d * c);
        b2 = (float)(k.b2d * c * c);
        keep = k.skip_nan && r != r;
    }
    GRID_STRIDE(i, t.n) {
        if (keep) {
            const float pi = p[i];
            mo[i] = m[i];
            vo[i] = v[i];
            po[i] = pi;
            if (p16) p16[i] = from_f<bf16_t>(pi);
            continue;
        }
        float g = t.grad_bf16 ? to_f(((const bf16_t*)t.grad)[i]) : ((const float*)t.grad)[i];
        if (k.grad_scale != 1.f) g = g * k.grad_scale;
        const float mi = m[i] * k.a1 + g * b1;
        const float vi = v[i] * k.a2 + (g * g) * b2;
        const float pi = p[i] * t.decay - (mi * k.step) / (sqrtf(vi * k.inv_bc2) + k.eps);
        mo[i] = mi;
        vo[i] = vi;
        po[i] = pi;
        if (p16) p16[i] = from_f<bf16_t>(pi);
    }
}

// ---- fused classifier ---------------------------------------------------------------------
// Per row of v logits (row stride ld >= v): loss = logsumexp - logit[target] (f32), and
// (softmax - onehot(target)) * dloss written to dx (row stride ld; dx may be the logits
// themselves); columns v..ld get 0. A target outside 0..v ignores the row (loss 0, gradient 0),
// or with `strict` gives it NaN (loss and gradient). One block per row: one pass for the
// running max and sum (online softmax), one pass writing the gradient; 16-byte accesses when
// `vec`. A running max of -inf has a sum of 0 (or NaN after a NaN logit): -inf logits
// contribute 0 and a NaN logit makes the row's loss NaN.
__device__ __forceinline__ void online(float& m, float& s, float x) {
    if (x > m) { s = s * expf(m - x) + 1.f; m = x; }
    else if (x != NEG_INF) s += expf(x - m);
}
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) { s += s2; return; }
    if (m == NEG_INF) { m = m2; s = s * 0.f + s2; return; }
    const float M = fmaxf(m, m2);
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}
template <typename T>
__device__ void classifier(i64 rows, int v, int ld, float dloss, int vec, int strict, const T* logits, T* dx, const i64* targets, float* loss) {
    __shared__ float pm[32], ps[32];
    const int N = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 rr = blockIdx.x; rr < rows; rr += gridDim.x) {
        const T* x = logits + rr * ld;
        T* d = dx + rr * ld;
        const i64 tgt = targets[rr];
        float m = NEG_INF, s = 0.f;
        if (vec) {
            for (int q = threadIdx.x; q < ld / N; q += blockDim.x) {
                Vec16<T> u;
                u.u = ((const uint4*)x)[q];
#pragma unroll
                for (int e = 0; e < N; ++e) if (q * N + e < v) online(m, s, to_f(u.e[e]));
            }
        } else {
            for (int j = threadIdx.x; j < v; j += blockDim.x) online(m, s, to_f(x[j]));
        }
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
            merge(m, s, m2, s2);
        }
        __syncthreads();
        if (lane == 0) { pm[warp] = m; ps[warp] = s; }
        __syncthreads();
        m = NEG_INF; s = 0.f;
        for (int w = 0; w < nw; ++w) merge(m, s, pm[w], ps[w]);
        const float lse = m + logf(s);
        const bool ignore = tgt < 0 || tgt >= v;
        const float bad = strict ? __int_as_float(0x7fc00000) : 0.f;
        if (threadIdx.x == 0) loss[rr] = ignore ? bad : lse - to_f(x[tgt]);
        __syncthreads();
        const float inv = 1.f / s;
        if (vec) {
            for (int q = threadIdx.x; q < ld / N; q += blockDim.x) {
                Vec16<T> u;
                u.u = ((const uint4*)x)[q];
#pragma unroll
                for (int e = 0; e < N; ++e) {
                    const int j = q * N + e;
                    float gr = ignore && j < v ? bad : 0.f;
                    if (!ignore && j < v) gr = (expf(to_f(u.e[e]) - m) * inv - (j == tgt ? 1.f : 0.f)) * dloss;
                    u.e[e] = from_f<T>(gr);
                }
                ((uint4*)d)[q] = u.u;
            }
        } else {
            for (int j = threadIdx.x; j < ld; j += blockDim.x) {
                float gr = ignore && j < v ? bad : 0.f;
                if (!ignore && j < v) gr = (expf(to_f(x[j]) - m) * inv - (j == tgt ? 1.f : 0.f)) * dloss;
                st(d + j, gr);
            }
        }
        __syncthreads();
    }
}

// ---- row scaling ---------------------------------------------------------------------------
// y[r, j] = x[r, j] s[r] over rows of c columns (s f32), rounded once; 16-byte accesses when
// `vec` (c a multiple of the vector width, so no vector crosses a row).
template <typename T>
__device__ void row_scale(i64 rows, int c, int vec, const T* x, const float* s, T* y) {
    const int N = 16 / sizeof(T);
    if (vec) {
        GRID_STRIDE(i, rows * c / N) {
            const float k = s[i * N / c];
            Vec16<T> u;
            u.u = ((const uint4*)x)[i];
#pragma unroll
            for (int j = 0; j < N; ++j) u.e[j] = from_f<T>(to_f(u.e[j]) * k);
            ((uint4*)y)[i] = u.u;
        }
    } else {
        GRID_STRIDE(i, rows * c) st(y + i, to_f(x[i]) * s[i / c]);
    }
}

// ---- vectorised element-wise --------------------------------------------------------------
// op 0: y = a + b; 1: y = a b; 2: y = a c; 3: y = gelu(a); 4: y = a gelu'(b) (a = dy, b = x).
__device__ __forceinline__ float ew_f(int op, float a, float b, float c) {
    switch (op) {
        case 0: return a + b;
        case 1: return a * b;
        case 2: return a * c;
        case 3: return gelu_of(a);
        default: return gelu_grad(a, b);
    }
}
template <typename T>
__device__ void ew(i64 n, int op, float c, int vec, const T* a, const T* b, T* y) {
    const int N = 16 / sizeof(T);
    const bool two = op == 0 || op == 1 || op == 4;
    const i64 nv = vec ? n / N : 0;
    GRID_STRIDE(i, nv) {
        Vec16<T> va, vb, vy;
        va.u = ((const uint4*)a)[i];
        if (two) vb.u = ((const uint4*)b)[i];
#pragma unroll
        for (int j = 0; j < N; ++j) vy.e[j] = from_f<T>(ew_f(op, to_f(va.e[j]), two ? to_f(vb.e[j]) : 0.f, c));
        ((uint4*)y)[i] = vy.u;
    }
    GRID_STRIDE(i, n - nv * N) {
        const i64 q = nv * N + i;
        st(y + q, ew_f(op, to_f(a[q]), two ? to_f(b[q]) : 0.f, c));
    }
}

#define LN_WARP(T, N, V) \
extern "C" __global__ void ln_fwd_warp##V##_##N(i64 rows, int c, float eps, const T* x, const T* a, const T* w, const T* b, T* r, T* y, float* mean, float* rstd) { ln_fwd_warp<T, V>(rows, c, eps, x, a, w, b, r, y, mean, rstd); } \
extern "C" __global__ void ln_bwd_warp##V##_##N(i64 rows, int c, const T* dy, const T* r, const float* mean, const float* rstd, const T* w, const T* dres, T* dr, float* pw, float* pb) { ln_bwd_warp<T, V>(rows, c, dy, r, mean, rstd, w, dres, dr, pw, pb); }

#define FUSED_TYPE(T, N) \
extern "C" __global__ void ln_fwd_##N(i64 rows, int c, float eps, int vec, const T* x, const T* a, const T* w, const T* b, T* r, T* y, float* mean, float* rstd) { ln_fwd<T>(rows, c, eps, vec, x, a, w, b, r, y, mean, rstd); } \
extern "C" __global__ void ln_bwd_##N(i64 rows, int c, const T* dy, const T* r, const float* mean, const float* rstd, const T* w, const T* dres, T* dr, float* pw, float* pb) { ln_bwd<T>(rows, c, dy, r, mean, rstd, w, dres, dr, pw, pb); } \
extern "C" __global__ void ln_bwd_reduce_##N(int g, int c, int acc, const float* pw, const float* pb, T* dw, T* db) { ln_bwd_reduce<T>(g, c, acc, pw, pb, dw, db); } \
extern "C" __global__ void classifier_##N(i64 rows, int v, int ld, float dloss, int vec, int strict, const T* logits, T* dx, const i64* targets, float* loss) { classifier<T>(rows, v, ld, dloss, vec, strict, logits, dx, targets, loss); } \
extern "C" __global__ void row_scale_##N(i64 rows, int c, int vec, const T* x, const float* s, T* y) { row_scale<T>(rows, c, vec, x, s, y); } \
extern "C" __global__ void ew_##N(i64 n, int op, float c, int vec, const T* a, const T* b, T* y) { ew<T>(n, op, c, vec, a, b, y); } \
LN_WARP(T, N, 1) LN_WARP(T, N, 2) LN_WARP(T, N, 3) LN_WARP(T, N, 4) LN_WARP(T, N, 6) LN_WARP(T, N, 8)

FUSED_TYPE(float, f32)
FUSED_TYPE(bf16_t, bf16)
FUSED_TYPE(f16_t, f16)
