// ---- multi-tensor sum of squares ---------------------------------------------------------
// Each tensor of a list (f32, bf16, f16 or f64 elements) summed in f64, in a fixed order:
// `sum_squares_blocks` gives block b of tensor t (grid (blocks, tensors)) the grid-stride
// elements b*256+j, b*256+j+blocks*256, ... and writes its block's sum (a fixed tree over the
// 256 threads) to partial[t * blocks + b]; `sum_squares_finish` adds each tensor's partials in
// block order and the tensors' sums in tensor order. A square is rounded to f32 (f64 for f64
// data), as AdamW's second moment squares a gradient, so one that overflows makes the sum
// infinite. `zeroed` sums x * 0 instead (NaN exactly when x is NaN or infinite).
struct SumEntry { unsigned long long ptr; i64 n; int dtype; int pad; };

#define SUM_THREADS 256
__device__ __forceinline__ double sum_load(const SumEntry& e, i64 i) {
    switch (e.dtype) {
        case 0: return (double)((const float*)e.ptr)[i];
        case 1: return (double)to_f(((const bf16_t*)e.ptr)[i]);
        case 2: return (double)to_f(((const f16_t*)e.ptr)[i]);
        default: return ((const double*)e.ptr)[i];
    }
}

extern "C" __global__ void sum_squares_blocks(const SumEntry* list, int zeroed, double* partial) {
    __shared__ double s[SUM_THREADS];
    const SumEntry e = list[blockIdx.y];
    double acc = 0.0;
    const i64 stride = (i64)gridDim.x * SUM_THREADS;
    for (i64 i = (i64)blockIdx.x * SUM_THREADS + threadIdx.x; i < e.n; i += stride) {
        const double x = sum_load(e, i);
        if (zeroed) acc += x * 0.0;
        else if (e.dtype == 3) acc += x * x;
        else { const float f = (float)x; acc += (double)(f * f); }
    }
    s[threadIdx.x] = acc;
    __syncthreads();
    for (int o = SUM_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) s[threadIdx.x] += s[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[(i64)blockIdx.y * gridDim.x + blockIdx.x] = s[0];
}

extern "C" __global__ void sum_squares_finish(const double* partial, int blocks, int tensors, double* each, double* total) {
    for (int t = threadIdx.x; t < tensors; t += blockDim.x) {
        double a = 0.0;
        for (int b = 0; b < blocks; ++b) a += partial[(i64)t * blocks + b];
        each[t] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0.0;
        for (int t = 0; t < tensors; ++t) a += each[t];
        *total = a;
    }
}
