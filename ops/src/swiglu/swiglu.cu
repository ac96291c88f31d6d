// SwiGLU forward and backward, grid-stride over n elements. 16- and 32-bit floats load, compute
// in f32 and store through the library's prelude (`ld`/`st`); f64 computes in f64.
#define GRID_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

template <typename T>
__device__ __forceinline__ void swiglu_fwd(const T* g, const T* u, T* y, i64 n) {
    GRID_LOOP(i, n) {
        float a = ld(g + i);
        st(y + i, a * sigmoid_f(a) * ld(u + i));
    }
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd(const T* g, const T* u, const T* dy, T* dg, T* du, i64 n) {
    GRID_LOOP(i, n) {
        float a = ld(g + i), b = ld(u + i), d = ld(dy + i);
        float s = sigmoid_f(a);
        st(dg + i, d * b * (s * (1.0f + a * (1.0f - s))));
        st(du + i, d * (a * s));
    }
}

// Packed: x of n (gate, up) pairs -> y of n.
template <typename T>
__device__ __forceinline__ void swiglu_pairs_fwd(const T* x, T* y, i64 n) {
    GRID_LOOP(i, n) {
        float a = ld(x + 2 * i);
        st(y + i, a * sigmoid_f(a) * ld(x + 2 * i + 1));
    }
}

#define SWIGLU(T, N) \
    extern "C" __global__ void swiglu_fwd_##N(const T* g, const T* u, T* y, i64 n) { swiglu_fwd(g, u, y, n); } \
    extern "C" __global__ void swiglu_pairs_##N(const T* x, T* y, i64 n) { swiglu_pairs_fwd(x, y, n); } \
    extern "C" __global__ void swiglu_bwd_##N(const T* g, const T* u, const T* dy, T* dg, T* du, i64 n) { \
        swiglu_bwd(g, u, dy, dg, du, n); \
    }
SWIGLU(float, f32)
SWIGLU(bf16_t, bf16)
SWIGLU(f16_t, f16)

extern "C" __global__ void swiglu_fwd_f64(const double* g, const double* u, double* y, i64 n) {
    GRID_LOOP(i, n) {
        double a = g[i];
        y[i] = a * sigmoid_d(a) * u[i];
    }
}

extern "C" __global__ void swiglu_bwd_f64(const double* g, const double* u, const double* dy, double* dg,
                                          double* du, i64 n) {
    GRID_LOOP(i, n) {
        double a = g[i], b = u[i], d = dy[i];
        double s = sigmoid_d(a);
        dg[i] = d * b * (s * (1.0 + a * (1.0 - s)));
        du[i] = d * (a * s);
    }
}

extern "C" __global__ void swiglu_pairs_f64(const double* x, double* y, i64 n) {
    GRID_LOOP(i, n) {
        double a = x[2 * i];
        y[i] = a * sigmoid_d(a) * x[2 * i + 1];
    }
}
