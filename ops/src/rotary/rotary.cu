// The rotary embedding by tables, grid-stride over the elements of x [rows, D] (rows = B T H,
// row r at position t = (r / H) % T of the tables [T, D]): pairs (i, i + D/2) rotate as
// [x1 c1 - x2 s1, x2 c2 + x1 s2], or transposed (inv) as [x1 c1 + x2 s2, x2 c2 - x1 s1].
// 16- and 32-bit floats compute in f32 through the prelude's `ld`/`st`, f64 in f64. 32-bit
// index arithmetic: the caller launches none over 2^31 elements.
typedef unsigned int u32_t;
#define GRID_LOOP(i, n) \
    for (u32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (u32_t)(n); i += gridDim.x * blockDim.x)

template <typename T, typename W>
__device__ __forceinline__ W load(const T* p) { return (W)ld(p); }
template <>
__device__ __forceinline__ double load<double, double>(const double* p) { return *p; }
template <typename T, typename W>
__device__ __forceinline__ void store(T* p, W v) { st(p, (float)v); }
template <>
__device__ __forceinline__ void store<double, double>(double* p, double v) { *p = v; }

template <typename T, typename W>
__device__ __forceinline__ void rotate(const T* x, const T* c, const T* s, T* y, i64 n, i64 t, i64 h, i64 d,
                                       int inv) {
    const u32_t D = d, HALF = d / 2, H = h, TT = t;
    GRID_LOOP(i, n) {
        const u32_t k = i % D, row = i / D, at = ((row / H) % TT) * D;
        const bool first = k < HALF;
        const u32_t other = first ? i + HALF : i - HALF;
        const W xv = load<T, W>(x + i), xo = load<T, W>(x + other), cv = load<T, W>(c + at + k);
        // The partner's sine: its own half's (forward) or the other half's (transposed).
        const W sv = load<T, W>(s + at + (inv ? (first ? k + HALF : k - HALF) : k));
        const W sign = (first != (bool)inv) ? (W)-1 : (W)1;
        store<T, W>(y + i, xv * cv + sign * xo * sv);
    }
}

#define ROTARY(T, W, N) \
    extern "C" __global__ void rotary_tables_##N(const T* x, const T* c, const T* s, T* y, i64 n, i64 t, i64 h, \
                                                 i64 d, int inv) { \
        rotate<T, W>(x, c, s, y, n, t, h, d, inv); \
    }
ROTARY(float, float, f32)
ROTARY(bf16_t, float, bf16)
ROTARY(f16_t, float, f16)
ROTARY(double, double, f64)
