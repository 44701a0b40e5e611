// GGUF Q4_K matrices times a few 8-bit input rows (decode): y[t][r] = sum_i w[r][i] * x[t][i],
// x already quantized to candle's block_q8_1 (gguf_cuda.rs quantizes it once per group of
// matrices). Where candle's MMVQ kernel gives a row 128 threads that each read 4-byte words, a
// warp here takes four output rows, eight lanes a 144-byte block (each lane one 16-byte load of
// codes and the block's 16-byte head per row, its 8-bit inputs once for the four), four
// blocks a pass, and multiplies four 8-bit pairs an instruction (dp4a), summing in f32.
// Q4_K block (256 weights): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for eight
// sub-blocks of 32, then 128 bytes of codes: bytes 32p..32p+31 hold weights 64p..64p+31 in
// their low nibbles (sub-block 2p) and 64p+32..64p+63 in their high ones (sub-block 2p+1);
// weight = d * scale * code - dmin * min. block_q8_1 (32 inputs, 36 bytes): half2 (d8, sum),
// then 32 int8 codes; input = d8 * code.
// Reference: candle's MMVQ on the same 8-bit input, and the f32 product (tests/dense_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MAX_ROWS 8
#define BLOCK_BYTES 144
#define Q8_BYTES 36

__device__ __forceinline__ void put(__nv_bfloat16* y, float v) { *y = __float2bfloat16(v); }
__device__ __forceinline__ void put(__half* y, float v) { *y = __float2half(v); }

// Sub-block j's 6-bit scale and min (llama.cpp's get_scale_min_k4).
__device__ __forceinline__ void scale_min(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// `in` is a multiple of 256; `q8_row` is an input row's stride in 8-bit blocks. A warp takes
// WR consecutive output rows, so each lane's inputs (the same for every row) are read once for
// all of them, and U passes of four blocks a row: each lane's 16-byte loads for all U passes
// are issued before it multiplies. Both forms measured slower than candle's MMVQ on an H100
// (docs/cuda.md), so gguf_cuda.rs takes this kernel only when asked.
template <typename T, int WR, int U>
__device__ void q4k_q8_gemv(const uint8_t* __restrict__ w, const uint8_t* __restrict__ q8,
                            T* __restrict__ y, int m, int out, int in, int q8_row) {
    const int r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * WR;
    const int lane = threadIdx.x & 31;
    if (r0 >= out) return;
    const int blocks = in >> 8;
    const int part = lane & 7;   // 16 bytes of a block's 128 code bytes
    const int pair = part >> 1;  // sub-blocks 2·pair (low nibbles) and 2·pair+1 (high)
    const int at = 4 + 16 * (part & 1);  // the lane's 16 inputs within each 8-bit block
    float acc[MAX_ROWS][WR];
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t)
#pragma unroll
        for (int i = 0; i < WR; ++i) acc[t][i] = 0.f;
    for (int b0 = lane >> 3; b0 < blocks; b0 += 4 * U) {
        uint4 raw[WR][U], head[WR][U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (b0 + 4 * u >= blocks) break;
#pragma unroll
            for (int i = 0; i < WR; ++i) {
                const int r = min(r0 + i, out - 1);  // past the last row: a duplicate, not stored
                const uint8_t* blk = w + ((size_t)r * blocks + b0 + 4 * u) * BLOCK_BYTES;
                // Codes are read once: stream them past the caches.
                raw[i][u] = __ldcs(reinterpret_cast<const uint4*>(blk + 16 + 16 * part));
                head[i][u] = __ldg(reinterpret_cast<const uint4*>(blk));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = b0 + 4 * u;
            if (b >= blocks) break;
            uint32_t lo[WR][4], hi[WR][4];
            float dl[WR], ml[WR], dh[WR], mh[WR];
#pragma unroll
            for (int i = 0; i < WR; ++i) {
                const uint32_t all[4] = {raw[i][u].x, raw[i][u].y, raw[i][u].z, raw[i][u].w};
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    lo[i][k] = all[k] & 0x0F0F0F0Fu;
                    hi[i][k] = (all[k] >> 4) & 0x0F0F0F0Fu;
                }
                const uint8_t* h = reinterpret_cast<const uint8_t*>(&head[i][u]);
                const float d = __half2float(*reinterpret_cast<const __half*>(h));
                const float dmin = __half2float(*reinterpret_cast<const __half*>(h + 2));
                int sc_lo, m_lo, sc_hi, m_hi;
                scale_min(2 * pair, h + 4, &sc_lo, &m_lo);
                scale_min(2 * pair + 1, h + 4, &sc_hi, &m_hi);
                dl[i] = d * sc_lo, ml[i] = dmin * m_lo, dh[i] = d * sc_hi, mh[i] = dmin * m_hi;
            }
#pragma unroll
            for (int t = 0; t < MAX_ROWS; ++t) {
                if (t >= m) break;
                const uint8_t* qb = q8 + ((size_t)t * q8_row + 8 * b + 2 * pair) * Q8_BYTES;
                const int* ul = reinterpret_cast<const int*>(qb + at);
                const int* uh = reinterpret_cast<const int*>(qb + Q8_BYTES + at);
                int u_lo[4], u_hi[4], sum_lo = 0, sum_hi = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    u_lo[k] = __ldg(ul + k);
                    u_hi[k] = __ldg(uh + k);
                    sum_lo = __dp4a(0x01010101, u_lo[k], sum_lo);
                    sum_hi = __dp4a(0x01010101, u_hi[k], sum_hi);
                }
                const float d8_lo = __low2float(__ldg(reinterpret_cast<const __half2*>(qb)));
                const float d8_hi =
                    __low2float(__ldg(reinterpret_cast<const __half2*>(qb + Q8_BYTES)));
#pragma unroll
                for (int i = 0; i < WR; ++i) {
                    int dot_lo = 0, dot_hi = 0;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        dot_lo = __dp4a(static_cast<int>(lo[i][k]), u_lo[k], dot_lo);
                        dot_hi = __dp4a(static_cast<int>(hi[i][k]), u_hi[k], dot_hi);
                    }
                    acc[t][i] += d8_lo * (dl[i] * dot_lo - ml[i] * sum_lo) +
                                 d8_hi * (dh[i] * dot_hi - mh[i] * sum_hi);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_ROWS; ++t) {
        if (t >= m) break;
#pragma unroll
        for (int i = 0; i < WR; ++i) {
            float s = acc[t][i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0 && r0 + i < out) put(y + (size_t)t * out + r0 + i, s);
        }
    }
}

// One input row (batch-1 decode): a warp per output row, four passes' loads in flight a lane.
// More rows: a warp per WARP_ROWS output rows, each input read once for them (the caller sizes
// the grid by the same rule).
#define WARP_ROWS 4
template <typename T>
__device__ void q4k_q8_gemv_any(const uint8_t* w, const uint8_t* q8, T* y, int m, int out,
                                int in, int q8_row) {
    if (m == 1) q4k_q8_gemv<T, 1, 4>(w, q8, y, m, out, in, q8_row);
    else q4k_q8_gemv<T, WARP_ROWS, 1>(w, q8, y, m, out, in, q8_row);
}

extern "C" __global__ void q4k_q8_gemv_bf16(const uint8_t* w, const uint8_t* q8, __nv_bfloat16* y,
                                            int m, int out, int in, int q8_row) {
    q4k_q8_gemv_any(w, q8, y, m, out, in, q8_row);
}

extern "C" __global__ void q4k_q8_gemv_f16(const uint8_t* w, const uint8_t* q8, __half* y, int m,
                                           int out, int in, int q8_row) {
    q4k_q8_gemv_any(w, q8, y, m, out, in, q8_row);
}
