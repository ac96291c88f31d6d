// Element types and per-element math shared by source.cu and the generated fused element-wise
// kernels (fused_elementwise.rs): one definition of each element-wise function on the device.
// Storage types f32, f64, i64, and the 16-bit floats bf16 and f16, which load and store 16 bits
// and compute in f32 (`Acc<T>::type`, the compute type of a storage type T).
typedef long long i64;
#define MAXD 8

// The bf16 bits of f, round to nearest even (NaN stays NaN).
__device__ __forceinline__ unsigned short bf16_bits(float f) {
    unsigned b = __float_as_uint(f);
    return (b & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((b >> 16) | 0x40u)
                                           : (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
// The IEEE binary16 bits of f, round to nearest even (overflow to infinity, NaN stays NaN).
__device__ __forceinline__ unsigned short f16_bits(float f) {
    unsigned x = __float_as_uint(f);
    unsigned sign = (x >> 16) & 0x8000u;
    unsigned ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);   // >= 65520: infinity
    if (ax < 0x38800000u) {                                           // below 2^-14: subnormal
        if (ax < 0x33000000u) return (unsigned short)sign;            // below 2^-25: zero
        unsigned e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        unsigned shift = 126 - e;                                      // 14..24
        unsigned q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (unsigned short)(sign | q);
    }
    unsigned r = ax - 0x38000000u;                                     // rebias 127 -> 15
    unsigned q = r >> 13, rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;
    return (unsigned short)(sign | q);
}
__device__ __forceinline__ float f16_float(unsigned short h) {
    unsigned sign = ((unsigned)h & 0x8000u) << 16, e = ((unsigned)h >> 10) & 0x1fu, m = (unsigned)h & 0x3ffu;
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-08f;                  // m * 2^-24
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}
// f64 -> f32 rounded to odd (toward zero, last bit set when inexact): rounding that once more
// to 16 bits rounds the f64 value once.
__device__ __forceinline__ float f32_odd(double d) {
    float r = __double2float_rz(d);
    if ((double)r != d && (__float_as_uint(r) & 0x7f800000u) != 0x7f800000u) r = __uint_as_float(__float_as_uint(r) | 1u);
    return r;
}

// 16-bit storage types: conversions from every scalar round once to nearest even; reads
// widen to f32 (exact).
#define HALF_TYPE(NAME, BITS, WIDEN) \
struct NAME { \
    unsigned short b; \
    __device__ NAME() {} \
    __device__ NAME(float f) : b(BITS(f)) {} \
    __device__ NAME(double d) : b(BITS(f32_odd(d))) {} \
    __device__ NAME(int v) : b(BITS((float)v)) {} \
    __device__ NAME(i64 v) : b(BITS(f32_odd((double)v))) {} \
    __device__ operator float() const { return WIDEN; } \
};
HALF_TYPE(bf16, bf16_bits, __uint_as_float((unsigned)b << 16))
HALF_TYPE(f16, f16_bits, f16_float(b))
// The type a kernel computes a storage type in.
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<bf16> { typedef float type; };
template <> struct Acc<f16> { typedef float type; };
#define ACC typedef typename Acc<T>::type C;

struct Nd {
    int ndim; int pad;
    i64 shape[MAXD];
    i64 s0[MAXD];
    i64 s1[MAXD];
};

__device__ __forceinline__ float  m_exp(float x)  { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float  m_log(float x)  { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float  m_tanh(float x)  { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float  m_sqrt(float x)  { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float  m_pow(float x, float c)   { return powf(x, c); }
__device__ __forceinline__ double m_pow(double x, double c) { return pow(x, c); }
__device__ __forceinline__ float  m_lowest(float)  { return -3.402823466e+38f; }
__device__ __forceinline__ double m_lowest(double) { return -1.7976931348623157e+308; }
__device__ __forceinline__ i64    m_lowest(i64)    { return (i64)0x8000000000000000LL; }
__device__ __forceinline__ float  m_highest(float)  { return 3.402823466e+38f; }
__device__ __forceinline__ double m_highest(double) { return 1.7976931348623157e+308; }
__device__ __forceinline__ i64    m_highest(i64)    { return (i64)0x7fffffffffffffffLL; }
__device__ __forceinline__ float  m_nan(float)  { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double m_nan(double) { return __longlong_as_double(0x7ff8000000000000LL); }
__device__ __forceinline__ i64    m_nan(i64)    { return 0; }
__device__ __forceinline__ float  m_inf(float)  { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double m_inf(double) { return __longlong_as_double(0x7ff0000000000000LL); }

template <typename T> __device__ T un_f(int op, T x) {
    const T zero = (T)0, one = (T)1;
    switch (op) {
        case 0: return -x;
        case 1: return x > zero ? x : zero;
        case 2: return gelu_of(x);
        case 3: return m_exp(x);
        case 4: return m_log(x);
        case 5: return m_tanh(x);
        case 6: return one / (one + m_exp(-x));
        case 7: return m_sqrt(x);
        case 8: return x < zero ? -x : x;
        default: return x * x;
    }
}
__device__ i64 un_i(int op, i64 x) {
    switch (op) {
        case 0: return (i64)(0ULL - (unsigned long long)x);
        case 1: return x > 0 ? x : 0;
        case 8: return x < 0 ? (i64)(0ULL - (unsigned long long)x) : x;
        default: return (i64)((unsigned long long)x * (unsigned long long)x);
    }
}
// dx from dy and what the forward saved: x, or for exp, tanh and sigmoid (3, 5, 6) y.
template <typename T> __device__ T unb_f(int op, T g, T x) {
    const T zero = (T)0, one = (T)1, half = (T)0.5, two = (T)2;
    switch (op) {
        case 0: return -g;
        case 1: return x > zero ? g : zero;
        case 2: return gelu_grad(g, x);
        case 3: return g * x;
        case 4: return g / x;
        case 5: return g * (one - x * x);
        case 6: return g * x * (one - x);
        case 7: return g * half / m_sqrt(x);
        case 8: return x > zero ? g : (x < zero ? -g : zero);
        default: return g * two * x;
    }
}

#define GRID_LOOP(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)
