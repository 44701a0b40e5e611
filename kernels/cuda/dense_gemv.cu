// Dense GEMV on the GPU for decode and small batches: y[t][r] = sum_i w[r][i] * x[t][i] for up
// to MAX_ROWS input rows of bf16 or f16, one warp per output row streaming the row in 16-byte
// vectors, f32 accumulation, a warp shuffle reduction. cuBLAS runs these shapes as split-K GEMMs
// with a reduce kernel after each (at ~73 % of an H100's HBM bandwidth, measured with Nsight
// Compute on the 8B decode step, docs/cuda.md); this streams each weight row once.
// Reference: candle's matmul (tests/dense_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MAX_ROWS 8

__device__ __forceinline__ void widen8(uint4 v, const __nv_bfloat16*, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float2 p = __bfloat1622float2(h[k]);
        f[2 * k] = p.x;
        f[2 * k + 1] = p.y;
    }
}

__device__ __forceinline__ void widen8(uint4 v, const __half*, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        float2 p = __half22float2(h[k]);
        f[2 * k] = p.x;
        f[2 * k + 1] = p.y;
    }
}

__device__ __forceinline__ __nv_bfloat16 narrow(float v, const __nv_bfloat16*) {
    return __float2bfloat16(v);
}
__device__ __forceinline__ __half narrow(float v, const __half*) { return __float2half(v); }

// `in` is a multiple of 8 and every row starts 16-byte aligned (the caller checks).
template <typename T>
__device__ void gemv(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int m,
                     int out, int in) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (r >= out) return;
    const uint4* row = reinterpret_cast<const uint4*>(w + (size_t)r * in);
    int vecs = in >> 3;
    float acc[MAX_ROWS];
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) acc[t] = 0.f;
#pragma unroll 4
    for (int j = lane; j < vecs; j += 32) {
        float wf[8];
        // Weights are read once: stream them past the caches.
        widen8(__ldcs(row + j), w, wf);
#pragma unroll
        for (int t = 0; t < MAX_ROWS; ++t) {
            if (t >= m) break;
            float xf[8];
            widen8(__ldg(reinterpret_cast<const uint4*>(x + (size_t)t * in) + j), x, xf);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[t] = fmaf(wf[k], xf[k], acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) {
        if (t >= m) break;
        float s = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) y[(size_t)t * out + r] = narrow(s, y);
    }
}

extern "C" __global__ void dense_gemv_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                           __nv_bfloat16* y, int m, int out, int in) {
    gemv(x, w, y, m, out, in);
}

extern "C" __global__ void dense_gemv_f16(const __half* x, const __half* w, __half* y, int m,
                                          int out, int in) {
    gemv(x, w, y, m, out, in);
}
