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

// `in` is a multiple of 8 and every row starts 16-byte aligned (the caller checks). Each lane
// keeps UNROLL 16-byte weight loads in flight before it multiplies (a first kernel that left
// that to the compiler, a launch per matrix, decoded 15 % slower, docs/cuda.md); M rows of
// input known at compile time (1: batch-1 decode), or up to MAX_ROWS with `m` checked.
#define UNROLL 4
template <typename T, int M>
__device__ __forceinline__ void gemv_row(const T* __restrict__ x, const T* __restrict__ w,
                                         T* __restrict__ y, int m, int r, int out, int in,
                                         int lane) {
    const uint4* row = reinterpret_cast<const uint4*>(w + (size_t)r * in);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int vecs = in >> 3;
    float acc[M];
#pragma unroll
    for (int t = 0; t < M; ++t) acc[t] = 0.f;
    int j = lane;
    for (; j + 32 * (UNROLL - 1) < vecs; j += 32 * UNROLL) {
        uint4 wv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wv[u] = __ldcs(row + j + 32 * u);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float wf[8];
            widen8(wv[u], w, wf);
#pragma unroll
            for (int t = 0; t < M; ++t) {
                if (t >= m) break;
                float xf[8];
                widen8(__ldg(xv + (size_t)t * vecs + j + 32 * u), x, xf);
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[t] = fmaf(wf[k], xf[k], acc[t]);
            }
        }
    }
    for (; j < vecs; j += 32) {
        float wf[8];
        widen8(__ldcs(row + j), w, wf);
#pragma unroll
        for (int t = 0; t < M; ++t) {
            if (t >= m) break;
            float xf[8];
            widen8(__ldg(xv + (size_t)t * vecs + j), x, xf);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[t] = fmaf(wf[k], xf[k], acc[t]);
        }
    }
#pragma unroll
    for (int t = 0; t < M; ++t) {
        if (t >= m) break;
        float s = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) y[(size_t)t * out + r] = narrow(s, y);
    }
}

// Up to three matrices that read the same input (q/k/v, gate/up) in one launch: warps
// [0, out0) take matrix 0's rows, the next out1 matrix 1's, then matrix 2's; each output
// is its own [m, out_i] buffer.
template <typename T>
__device__ void gemv_group(const T* x, const T* w0, const T* w1, const T* w2, T* y0, T* y1,
                           T* y2, int out0, int out1, int out2, int m, int in) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const T* w = w0;
    T* y = y0;
    int out = out0;
    if (r >= out0) {
        r -= out0, w = w1, y = y1, out = out1;
        if (r >= out1) r -= out1, w = w2, y = y2, out = out2;
    }
    if (r >= out) return;
    if (m == 1) gemv_row<T, 1>(x, w, y, 1, r, out, in, lane);
    else gemv_row<T, MAX_ROWS>(x, w, y, m, r, out, in, lane);
}

extern "C" __global__ void dense_gemv_group_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w0,
                                                 const __nv_bfloat16* w1,
                                                 const __nv_bfloat16* w2, __nv_bfloat16* y0,
                                                 __nv_bfloat16* y1, __nv_bfloat16* y2, int out0,
                                                 int out1, int out2, int m, int in) {
    gemv_group(x, w0, w1, w2, y0, y1, y2, out0, out1, out2, m, in);
}

extern "C" __global__ void dense_gemv_group_f16(const __half* x, const __half* w0,
                                                const __half* w1, const __half* w2, __half* y0,
                                                __half* y1, __half* y2, int out0, int out1,
                                                int out2, int m, int in) {
    gemv_group(x, w0, w1, w2, y0, y1, y2, out0, out1, out2, m, in);
}
