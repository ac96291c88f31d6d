// GELU in its tanh form (the tensor crate's `gelu`), the one definition of its device math:
// gelu(x) = x/2 (1 + tanh(c (x + k x^3))), c = sqrt(2/pi), k = 0.044715, and g gelu'(x).
// `T` is float or double, each with its own tanh.
__device__ __forceinline__ float  gelu_tanh(float x)  { return tanhf(x); }
__device__ __forceinline__ double gelu_tanh(double x) { return tanh(x); }
template <typename T> __device__ __forceinline__ T gelu_of(T x) {
    const T c = (T)0.7978845608028654, k = (T)0.044715;
    return (T)0.5 * x * ((T)1 + gelu_tanh(c * (x + k * x * x * x)));
}
template <typename T> __device__ __forceinline__ T gelu_grad(T g, T x) {
    const T c = (T)0.7978845608028654, k = (T)0.044715, k3 = (T)(3.0 * 0.044715);
    const T t = gelu_tanh(c * (x + k * x * x * x));
    return g * ((T)0.5 * ((T)1 + t) + (T)0.5 * x * ((T)1 - t * t) * c * ((T)1 + k3 * x * x));
}
