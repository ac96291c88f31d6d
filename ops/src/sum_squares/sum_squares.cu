// ---- multi-tensor sum of squares ---------------------------------------------------------
// Each tensor of a list (f32, bf16, f16 or f64 elements) summed in f64, in a fixed order.
// Tensor t owns `blocks` consecutive blocks of the 1-d grid from block `first`; its block k
// reads the elements k*256+j, k*256+j+blocks*256, ... (four strides at a time into four
// accumulators, added in a fixed order), and writes its block's sum (a fixed tree over the 256
// threads) to partial[first + k]; `sum_squares_finish` adds each tensor's partials in block
// order and the tensors' sums in tensor order. A square is rounded to f32 (f64 for f64 data),
// as AdamW's second moment squares a gradient, so one that overflows makes the sum infinite.
// `zeroed` sums x * 0 instead (NaN exactly when x is NaN or infinite).
struct SumEntry { unsigned long long ptr; i64 n; int dtype; int blocks; i64 first; };

#define SUM_THREADS 256
__device__ __forceinline__ double sum_term(float v, int zeroed) { return zeroed ? (double)v * 0.0 : (double)(v * v); }
__device__ __forceinline__ double sum_term(double v, int zeroed) { return zeroed ? v * 0.0 : v * v; }
__device__ __forceinline__ double sum_term(bf16_t v, int zeroed) { return sum_term(to_f(v), zeroed); }
__device__ __forceinline__ double sum_term(f16_t v, int zeroed) { return sum_term(to_f(v), zeroed); }

template <typename T>
__device__ double sum_block(const SumEntry& e, i64 k, int zeroed) {
    const T* x = (const T*)e.ptr;
    const i64 stride = (i64)e.blocks * SUM_THREADS;
    i64 i = k * SUM_THREADS + threadIdx.x;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (; i + 3 * stride < e.n; i += 4 * stride) {
        a0 += sum_term(x[i], zeroed);
        a1 += sum_term(x[i + stride], zeroed);
        a2 += sum_term(x[i + 2 * stride], zeroed);
        a3 += sum_term(x[i + 3 * stride], zeroed);
    }
    for (; i < e.n; i += stride) a0 += sum_term(x[i], zeroed);
    return (a0 + a1) + (a2 + a3);
}

extern "C" __global__ void sum_squares_blocks(const SumEntry* list, int tensors, int zeroed, double* partial) {
    __shared__ double s[SUM_THREADS];
    const i64 b = blockIdx.x;
    // This block's tensor: the last one whose first block is at most b.
    int lo = 0, hi = tensors - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (list[mid].first <= b) lo = mid; else hi = mid - 1;
    }
    const SumEntry e = list[lo];
    const i64 k = b - e.first;
    double acc;
    switch (e.dtype) {
        case 0: acc = sum_block<float>(e, k, zeroed); break;
        case 1: acc = sum_block<bf16_t>(e, k, zeroed); break;
        case 2: acc = sum_block<f16_t>(e, k, zeroed); break;
        default: acc = sum_block<double>(e, k, zeroed); break;
    }
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int o = SUM_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[b] = s[0];
}

extern "C" __global__ void sum_squares_finish(const SumEntry* list, int tensors, const double* partial, double* each, double* total) {
    for (int t = threadIdx.x; t < tensors; t += blockDim.x) {
        const SumEntry e = list[t];
        double a = 0.0;
        for (int k = 0; k < e.blocks; ++k) a += partial[e.first + k];
        each[t] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0.0;
        for (int t = 0; t < tensors; ++t) a += each[t];
        *total = a;
    }
}
