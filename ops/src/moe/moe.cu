// Mixture-of-experts kernels: rows gathered into expert order and scattered back (moved as
// 2-, 4- or 8-byte units, whatever the float type), each row's top-k experts by probability,
// and the routes each expert got.
#define GRID_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// out[j] = x[rows[j]] for the r rows listed, rows of c units.
template <typename U>
__device__ __forceinline__ void gather_rows(const U* x, const int* rows, U* out, i64 r, i64 c) {
    GRID_LOOP(i, r * c) {
        i64 j = i / c;
        out[i] = x[(i64)rows[j] * c + (i - j * c)];
    }
}

// y[rows[j]] = src[j] for the r rows listed (each destination row listed once).
template <typename U>
__device__ __forceinline__ void scatter_rows(const U* src, const int* rows, U* y, i64 r, i64 c) {
    GRID_LOOP(i, r * c) {
        i64 j = i / c;
        y[(i64)rows[j] * c + (i - j * c)] = src[i];
    }
}

#define ROWS(U, N) \
    extern "C" __global__ void gather_rows_##N(const U* x, const int* rows, U* out, i64 r, i64 c) { \
        gather_rows(x, rows, out, r, c); \
    } \
    extern "C" __global__ void scatter_rows_##N(const U* src, const int* rows, U* y, i64 r, i64 c) { \
        scatter_rows(src, rows, y, r, c); \
    }
ROWS(unsigned short, b2)
ROWS(unsigned int, b4)
ROWS(unsigned long long, b8)

// Whether (v, i) goes before (best, b) in the order: larger first, NaN last, the lower expert
// first among equals (candidates come in ascending i, so equal values keep the earlier one).
template <typename T>
__device__ __forceinline__ bool before(T v, T best, int b) {
    if (b < 0) return true;
    if (isnan(v)) return false;
    return isnan(best) || v > best;
}

// Each of m rows of e probabilities: its k experts in the order above, as i64 ids [m, k].
template <typename T>
__device__ __forceinline__ void topk(const T* p, long long* ids, i64 m, int e, int k) {
    GRID_LOOP(row, m) {
        const T* r = p + row * e;
        long long* out = ids + row * k;
        for (int j = 0; j < k; ++j) {
            int b = -1;
            T best = 0;
            for (int i = 0; i < e; ++i) {
                bool taken = false;
                for (int q = 0; q < j; ++q) taken |= out[q] == i;
                if (!taken && before(r[i], best, b)) {
                    b = i;
                    best = r[i];
                }
            }
            out[j] = b;
        }
    }
}

// counts[x] = how many of the n ids are x, for each of e experts: a block of COUNT_THREADS
// threads per expert, striding over the ids, their counts summed in shared memory (integers:
// the same total in any order).
#define COUNT_THREADS 256
template <typename T>
__device__ __forceinline__ void count_routes(const long long* ids, i64 n, T* counts, int e) {
    __shared__ long long part[COUNT_THREADS];
    for (int x = blockIdx.x; x < e; x += gridDim.x) {
        long long c = 0;
        for (i64 i = threadIdx.x; i < n; i += blockDim.x) c += ids[i] == x;
        part[threadIdx.x] = c;
        __syncthreads();
        for (int s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
            __syncthreads();
        }
        if (threadIdx.x == 0) counts[x] = (T)part[0];
        __syncthreads();
    }
}

#define TOPK(T, N) \
    extern "C" __global__ void router_topk_##N(const T* p, long long* ids, i64 m, int e, int k) { \
        topk(p, ids, m, e, k); \
    } \
    extern "C" __global__ void count_routes_##N(const long long* ids, i64 n, T* counts, int e) { \
        count_routes(ids, n, counts, e); \
    }
TOPK(float, f32)
TOPK(double, f64)
