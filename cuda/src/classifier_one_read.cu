// The fused classifier reading each row once, with the results of the two-pass `classifier` of
// fused.cu; its own source, so NVRTC builds it beside the fused kernels, not after them.
// For rows of nv = ld / N 16-byte vectors (ld a multiple of N, logits and dx 16-byte aligned),
// with B = blockDim.x, thread t holds vectors t, t + B, ..., t + (V - 1) B of its block's row
// in registers; vectors from V B on (a row wider than the registers hold) are copied once into
// dynamic shared memory (slot q - V B, only ever touched by the thread that copied it),
// asynchronously on sm_80 and later. Each thread keeps a running max and sum (one rescale per
// vector); the block takes the max of the maxima and the sum of the sums rescaled to it, and
// the gradient and the loss come from the held values. A thread whose values so far are all
// -inf sums relative to 0, so -inf logits contribute 0 and a NaN logit makes its row's loss
// NaN. An ignored row reads nothing; the next row's target is read a row ahead.
__device__ __forceinline__ void copy16_async(uint4* smem, const uint4* gmem) {
#if __CUDA_ARCH__ >= 800
    const u32 sa = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(sa), "l"(__cvta_generic_to_global(gmem)));
#else
    *smem = *gmem;
#endif
}
__device__ __forceinline__ void copy16_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
template <typename T>
__device__ __forceinline__ void cls_stats(const Vec16<T>& u, int j0, int v, float& m, float& s) {
    const int N = 16 / sizeof(T);
    float vm = NEG_INF;
#pragma unroll
    for (int e = 0; e < N; ++e)
        if (j0 + e < v) vm = fmaxf(vm, to_f(u.e[e]));
    if (vm > m) { s *= expf(m - vm); m = vm; }
    const float base = m == NEG_INF ? 0.f : m;
#pragma unroll
    for (int e = 0; e < N; ++e)
        if (j0 + e < v) s += expf(to_f(u.e[e]) - base);
}
// (softmax - onehot(tc)) dloss over the vector starting at column j0 (0 past v); the loss
// lse - logit is written by the thread holding column tc.
template <typename T>
__device__ __forceinline__ void cls_grad(Vec16<T>& u, int j0, int v, int tc, float M, float inv, float lse,
                                         float dloss, float* loss_row) {
    const int N = 16 / sizeof(T);
#pragma unroll
    for (int e = 0; e < N; ++e) {
        const int j = j0 + e;
        const float x = to_f(u.e[e]);
        float gr = 0.f;
        if (j < v) gr = (expf(x - M) * inv - (j == tc ? 1.f : 0.f)) * dloss;
        if (j == tc) *loss_row = lse - x;
        u.e[e] = from_f<T>(gr);
    }
}
template <typename T, int V>
__device__ void classifier_regs(i64 rows, int v, int ld, float dloss, int strict, const T* logits, T* dx, const i64* targets, float* loss) {
    extern __shared__ uint4 cls_tail[];
    const int N = 16 / sizeof(T);
    const int nv = ld / N, B = blockDim.x, t = threadIdx.x, held = V * B;
    i64 tgt = blockIdx.x < rows ? targets[blockIdx.x] : 0;
    for (i64 rr = blockIdx.x; rr < rows; rr += gridDim.x) {
        const uint4* x = (const uint4*)(logits + rr * ld);
        uint4* d = (uint4*)(dx + rr * ld);
        const i64 next = rr + gridDim.x < rows ? targets[rr + gridDim.x] : 0;
        if (tgt < 0 || tgt >= v) {
            const float bad = strict ? __int_as_float(0x7fc00000) : 0.f;
            for (int q = t; q < nv; q += B) {
                Vec16<T> u;
#pragma unroll
                for (int e = 0; e < N; ++e) u.e[e] = from_f<T>(q * N + e < v ? bad : 0.f);
                d[q] = u.u;
            }
            if (t == 0) loss[rr] = bad;
            tgt = next;
            continue;
        }
        const int tc = (int)tgt;
        for (int q = held + t; q < nv; q += B) copy16_async(cls_tail + (q - held), x + q);
        Vec16<T> r[V];
#pragma unroll
        for (int k = 0; k < V; ++k)
            if (t + k * B < nv) r[k].u = x[t + k * B];
        float m = NEG_INF, s = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k)
            if (t + k * B < nv) cls_stats(r[k], (t + k * B) * N, v, m, s);
        copy16_wait();
        for (int q = held + t; q < nv; q += B) {
            Vec16<T> u;
            u.u = cls_tail[q - held];
            cls_stats(u, q * N, v, m, s);
        }
        const float M = block_max(m);
        const float S = block_sum(M == NEG_INF ? s : s * expf(m - M));
        const float lse = M + logf(S), inv = 1.f / S;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int q = t + k * B;
            if (q < nv) {
                cls_grad(r[k], q * N, v, tc, M, inv, lse, dloss, loss + rr);
                d[q] = r[k].u;
            }
        }
        for (int q = held + t; q < nv; q += B) {
            Vec16<T> u;
            u.u = cls_tail[q - held];
            cls_grad(u, q * N, v, tc, M, inv, lse, dloss, loss + rr);
            d[q] = u.u;
        }
        tgt = next;
    }
}

// V vectors a thread, blocks of at most 1024 threads (at V = 8, 64 registers a thread).
#define CLS_ONE_READ(T, N, V) \
extern "C" __global__ void __launch_bounds__(1024) classifier_reg##V##_##N(i64 rows, int v, int ld, float dloss, int strict, const T* logits, T* dx, const i64* targets, float* loss) { classifier_regs<T, V>(rows, v, ld, dloss, strict, logits, dx, targets, loss); }
#define CLS_ONE_READ_TYPE(T, N) CLS_ONE_READ(T, N, 1) CLS_ONE_READ(T, N, 2) CLS_ONE_READ(T, N, 4) CLS_ONE_READ(T, N, 8)

CLS_ONE_READ_TYPE(float, f32)
CLS_ONE_READ_TYPE(bf16_t, bf16)
CLS_ONE_READ_TYPE(f16_t, f16)
