// A decode step's element-wise chains in one launch each (docs/cuda.md: ~25 small kernels a
// layer took a quarter of an 8B bf16 step's GPU time): the residual add with the RMSNorm after
// it, and SiLU with the multiply by the up projection. Values round to the storage type where
// the unfused ops round them (the sum before it is normed, SiLU before the multiply), so the
// results are candle's up to the float summation order of the norm.
// Reference: candle's `+`, `candle_nn::ops::rms_norm`, `silu` and `*` (tests/fused_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}

// Row blockIdx.x: out[row] = x + y, out[rows + row] = rms_norm(x + y) * w.
template <typename T>
__device__ void add_rmsnorm(const T* x, const T* y, const T* w, T* out, int rows, int cols,
                            float eps) {
    const size_t at = (size_t)blockIdx.x * cols;
    T* sum = out + at;
    T* normed = out + (size_t)rows * cols + at;
    float squares = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const T s = from_f<T>(to_f(x[at + i]) + to_f(y[at + i]));
        sum[i] = s;
        const float v = to_f(s);
        squares += v * v;
    }
    __shared__ float warps[32];
    for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffff, squares, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warps[warp] = squares;
    __syncthreads();
    if (warp == 0) {
        squares = lane < (int)(blockDim.x >> 5) ? warps[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffff, squares, o);
        if (lane == 0) warps[0] = squares;
    }
    __syncthreads();
    const float scale = rsqrtf(warps[0] / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        normed[i] = from_f<T>(scale * to_f(sum[i]) * to_f(w[i]));
    }
}

// out = silu(g) * u, SiLU rounded to the storage type first (as the two unfused ops round).
template <typename T>
__device__ void silu_mul(const T* g, const T* u, T* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = to_f(g[i]);
        const T s = from_f<T>(x / (1.f + expf(-x)));
        out[i] = from_f<T>(to_f(s) * to_f(u[i]));
    }
}

#define FUSED(NAME, T)                                                                        \
    extern "C" __global__ void add_rmsnorm_##NAME(const T* x, const T* y, const T* w, T* out,  \
                                                  int rows, int cols, float eps) {            \
        add_rmsnorm<T>(x, y, w, out, rows, cols, eps);                                        \
    }                                                                                          \
    extern "C" __global__ void silu_mul_##NAME(const T* g, const T* u, T* out, int n) {        \
        silu_mul<T>(g, u, out, n);                                                            \
    }

FUSED(f32, float)
FUSED(f16, __half)
FUSED(bf16, __nv_bfloat16)
