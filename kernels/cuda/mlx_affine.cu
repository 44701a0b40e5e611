// MLX affine-quantized weights on the GPU: w[r][i] = scale[r][g] * q[r][i] + bias[r][g] with
// g = i / group and q the `bits`-wide code at bit i * bits of row r's little-endian u32 stream
// (codes of 3, 5 and 6 bits cross word boundaries). Reference: MlxQuantized::dequantize_ref.
//
// mlx_gemv_*: y[t][r] = sum_i w[r][i] * x[t][i] for up to MAX_ROWS input rows (decode and small
//   batches), one warp per output row, f32 accumulation, never materialising w.
// mlx_dequant_*: w (or the rows `ids` selects) written out in the activations' dtype, for a
//   cuBLAS matmul of larger batches and for embedding lookups.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MAX_ROWS 8

__device__ __forceinline__ float widen(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float widen(float v) { return v; }

template <typename T> __device__ __forceinline__ T narrow(float v);
template <> __device__ __forceinline__ __nv_bfloat16 narrow(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half narrow(float v) { return __float2half(v); }
template <> __device__ __forceinline__ float narrow(float v) { return v; }

// The code of element i of a row; two words are read when it crosses a boundary.
__device__ __forceinline__ uint32_t code(const uint32_t* row, int i, int bits) {
    uint32_t bit = (uint32_t)i * bits, w = bit >> 5, s = bit & 31;
    uint64_t pair = row[w];
    if (s + bits > 32) pair |= (uint64_t)row[w + 1] << 32;
    return (uint32_t)(pair >> s) & ((1u << bits) - 1);
}

template <typename X, typename S>
__device__ void gemv(const X* x, const uint32_t* w, const S* scales, const S* biases, X* y,
                     int m, int out, int in, int bits, int group) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (r >= out) return;
    int words = in * bits / 32, groups = in / group;
    const uint32_t* row = w + (size_t)r * words;
    const S* sr = scales + (size_t)r * groups;
    const S* br = biases + (size_t)r * groups;
    float acc[MAX_ROWS];
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) acc[t] = 0.f;
    if (32 % bits == 0) {
        // 2, 4 or 8 bits: a word holds whole codes of one group (groups are >= 32 wide).
        int per = 32 / bits;
        uint32_t mask = (1u << bits) - 1;
        for (int j = lane; j < words; j += 32) {
            uint32_t word = row[j];
            int i0 = j * per, g = i0 / group;
            float s = widen(sr[g]), b = widen(br[g]);
#pragma unroll
            for (int t = 0; t < MAX_ROWS; ++t) {
                if (t >= m) break;
                const X* xr = x + (size_t)t * in + i0;
                float dot = 0.f, sum = 0.f;
                for (int k = 0; k < per; ++k) {
                    float xv = widen(xr[k]);
                    dot += (float)((word >> (k * bits)) & mask) * xv;
                    sum += xv;
                }
                acc[t] += s * dot + b * sum;
            }
        }
    } else {
        for (int i = lane; i < in; i += 32) {
            int g = i / group;
            float wv = widen(sr[g]) * (float)code(row, i, bits) + widen(br[g]);
#pragma unroll
            for (int t = 0; t < MAX_ROWS; ++t) {
                if (t >= m) break;
                acc[t] += wv * widen(x[(size_t)t * in + i]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) {
        if (t >= m) break;
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (lane == 0) y[(size_t)t * out + r] = narrow<X>(v);
    }
}

// Rows ids[0..n) of w (all rows when ids is null) dequantized into y [n][in].
template <typename O, typename S>
__device__ void dequant(const uint32_t* w, const S* scales, const S* biases, const uint32_t* ids,
                        O* y, int n, int in, int bits, int group) {
    int words = in * bits / 32, groups = in / group;
    size_t total = (size_t)n * in;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(e / in), i = (int)(e % in);
        size_t r = ids ? ids[t] : (size_t)t;
        int g = i / group;
        float v = widen(scales[r * groups + g]) * (float)code(w + r * words, i, bits) +
                  widen(biases[r * groups + g]);
        y[e] = narrow<O>(v);
    }
}

#define INSTANTIATE(XN, X, SN, S)                                                               \
    extern "C" __global__ void mlx_gemv_##XN##_##SN(const X* x, const uint32_t* w,             \
                                                      const S* scales, const S* biases, X* y,  \
                                                      int m, int out, int in, int bits,        \
                                                      int group) {                             \
        gemv<X, S>(x, w, scales, biases, y, m, out, in, bits, group);                          \
    }                                                                                           \
    extern "C" __global__ void mlx_dequant_##XN##_##SN(const uint32_t* w, const S* scales,     \
                                                         const S* biases, const uint32_t* ids, \
                                                         X* y, int n, int in, int bits,        \
                                                         int group) {                          \
        dequant<X, S>(w, scales, biases, ids, y, n, in, bits, group);                           \
    }

#define FOR_SCALES(XN, X)                     \
    INSTANTIATE(XN, X, bf16, __nv_bfloat16) \
    INSTANTIATE(XN, X, f16, __half)         \
    INSTANTIATE(XN, X, f32, float)

FOR_SCALES(bf16, __nv_bfloat16)
FOR_SCALES(f16, __half)
FOR_SCALES(f32, float)
