// Shared prelude of the raw layer's NVRTC sources (no CUDA headers): element types, f32
// loads and stores of bf16/f16/f32 (round to nearest even), strided views, warp reductions.
typedef long long i64;
typedef unsigned short u16;
typedef unsigned int u32;

struct bf16_t { u16 x; };
struct f16_t { u16 x; };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16_t v) { return __uint_as_float(((u32)v.x) << 16); }
__device__ __forceinline__ float to_f(f16_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
}
template <typename T> __device__ __forceinline__ T from_f(float f);
template <> __device__ __forceinline__ float from_f<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16_t from_f<bf16_t>(float f) {
    u32 u = __float_as_uint(f);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.x = (u16)((u >> 16) | 0x40u); return r; }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.x = (u16)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ f16_t from_f<f16_t>(float f) {
    f16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.x) : "f"(f));
    return r;
}

template <typename T> __device__ __forceinline__ float ld(const T* p) { return to_f(*p); }
template <typename T> __device__ __forceinline__ void st(T* p, float v) { *p = from_f<T>(v); }

// A strided [B, H, T, D] view (strides in elements).
struct View { unsigned long long ptr; i64 s0, s1, s2, s3; };
template <typename T> __device__ __forceinline__ T* vptr(const View& v) { return (T*)v.ptr; }
template <typename T> __device__ __forceinline__ T* vrow(const View& v, int b, int h, int t) {
    return vptr<T>(v) + (i64)b * v.s0 + (i64)h * v.s1 + (i64)t * v.s2;
}

#define FULL_MASK 0xffffffffu
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
    return x;
}
#define NEG_INF __int_as_float(0xff800000)
