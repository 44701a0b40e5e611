// GGUF Q4_K matrices times a few input rows (decode): y[t][r] = sum_i w[r][i] * x[t][i].
// candle's path quantizes the input to 8 bits (a launch of its own) and runs its MMVQ kernel
// (~48 % of an 8B Q4_K_M decode step on an H100, docs/cuda.md). Here a warp takes an output
// row, eight lanes a 144-byte block (each lane 16 bytes of its 4-bit codes, 32 weights), four
// blocks a pass; the input is read in bf16/f16 and everything is summed in f32. Measured
// slower than candle's (0.78x its decode on an H100: a conversion and a scalar FMA per weight
// where MMVQ does four 8-bit products an instruction), so off by default; see gguf_cuda.rs.
// Q4_K block (256 weights): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for eight
// sub-blocks of 32, then 128 bytes of codes: bytes 32p..32p+31 hold weights 64p..64p+31 in
// their low nibbles (sub-block 2p) and 64p+32..64p+63 in their high ones (sub-block 2p+1);
// weight = d * scale * code - dmin * min.
// Reference: candle's dequantization and an f32 product (tests/dense_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MAX_ROWS 8
#define BLOCK_BYTES 144

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void put(__nv_bfloat16* y, float v) { *y = __float2bfloat16(v); }
__device__ __forceinline__ void put(__half* y, float v) { *y = __float2half(v); }

// Sub-block j's 6-bit scale and min (llama.cpp's get_scale_min_k4).
__device__ __forceinline__ void scale_min(int j, const uint8_t* q, float* sc, float* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Sum of 16 inputs at `x` times the nibbles of `codes` (low or high, by `shift`), and of the
// inputs alone (for the min).
template <typename T>
__device__ __forceinline__ void dot16(const T* x, const uint32_t* codes, int shift, float* dot,
                                      float* sum) {
    float d = 0.f, s = 0.f;
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(x));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(x + 8));
    const T* xa = reinterpret_cast<const T*>(&a);
    const T* xb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const uint32_t c = codes[w] >> shift;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float xv = to_f(w < 2 ? xa[4 * w + k] : xb[4 * (w - 2) + k]);
            d = fmaf(static_cast<float>((c >> (8 * k)) & 0xF), xv, d);
            s += xv;
        }
    }
    *dot = d;
    *sum = s;
}

// `in` is a multiple of 256; rows of x start 16-byte aligned (the caller checks).
template <typename T>
__device__ void q4k_gemv(const uint8_t* __restrict__ w, const T* __restrict__ x, T* __restrict__ y,
                         int m, int out, int in) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (r >= out) return;
    const int blocks = in >> 8;
    const uint8_t* row = w + (size_t)r * blocks * BLOCK_BYTES;
    const int part = lane & 7;                 // 16 bytes of a block's 128 code bytes
    const int pair = part >> 1;                // sub-blocks 2·pair (low) and 2·pair+1 (high)
    const int first = 64 * pair + 16 * (part & 1);
    float acc[MAX_ROWS];
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) acc[t] = 0.f;
#pragma unroll 2
    for (int b = lane >> 3; b < blocks; b += 4) {
        const uint8_t* blk = row + (size_t)b * BLOCK_BYTES;
        // Codes are read once: stream them past the caches.
        const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(blk + 16 + 16 * part));
        const uint4 head = __ldg(reinterpret_cast<const uint4*>(blk));
        const uint32_t codes[4] = {raw.x, raw.y, raw.z, raw.w};
        const uint8_t* h = reinterpret_cast<const uint8_t*>(&head);
        const float d = __half2float(*reinterpret_cast<const __half*>(h));
        const float dmin = __half2float(*reinterpret_cast<const __half*>(h + 2));
        float sc_lo, m_lo, sc_hi, m_hi;
        scale_min(2 * pair, h + 4, &sc_lo, &m_lo);
        scale_min(2 * pair + 1, h + 4, &sc_hi, &m_hi);
#pragma unroll
        for (int t = 0; t < MAX_ROWS; ++t) {
            if (t >= m) break;
            const T* xt = x + (size_t)t * in + 256 * b + first;
            float dot_lo, sum_lo, dot_hi, sum_hi;
            dot16(xt, codes, 0, &dot_lo, &sum_lo);
            dot16(xt + 32, codes, 4, &dot_hi, &sum_hi);
            acc[t] += d * (sc_lo * dot_lo + sc_hi * dot_hi) - dmin * (m_lo * sum_lo + m_hi * sum_hi);
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) {
        if (t >= m) break;
        float s = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) put(y + (size_t)t * out + r, s);
    }
}

extern "C" __global__ void q4k_gemv_bf16(const uint8_t* w, const __nv_bfloat16* x,
                                         __nv_bfloat16* y, int m, int out, int in) {
    q4k_gemv(w, x, y, m, out, in);
}

extern "C" __global__ void q4k_gemv_f16(const uint8_t* w, const __half* x, __half* y, int m,
                                        int out, int in) {
    q4k_gemv(w, x, y, m, out, in);
}
