// GGUF Q4_K matrices times a few input rows (decode): y[t][r] = sum_i w[r][i] * x[t][i], the
// input first quantized to 8 bits by `q8_split_*` into a layout made for this kernel: each
// row's int8 codes contiguous (16-byte loads, where candle's block_q8_1 interleaves a 4-byte
// head every 32 codes) and, per 32 inputs, the float pair (d8, d8 * sum of codes).
// A warp per output row: eight lanes a 144-byte block, each lane one 16-byte load of codes
// (32 weights) and the block's 16-byte head, U blocks' loads in flight before it multiplies
// four 8-bit pairs an instruction (dp4a); f32 sums; up to three matrices of the same input
// (q/k/v, gate/up) in one launch.
// Q4_K block (256 weights): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for eight
// sub-blocks of 32, then 128 bytes of codes: bytes 32p..32p+31 hold weights 64p..64p+31 in
// their low nibbles (sub-block 2p) and 64p+32..64p+63 in their high ones (sub-block 2p+1);
// weight = d * scale * code - dmin * min.
// Reference: candle's MMVQ on the same 8-bit input, and the f32 product (tests/gguf_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define MAX_ROWS 8
#define BLOCK_BYTES 144

__device__ __forceinline__ float load(const __nv_bfloat16* x) { return __bfloat162float(*x); }
__device__ __forceinline__ float load(const __half* x) { return __half2float(*x); }
__device__ __forceinline__ void put(__nv_bfloat16* y, float v) { *y = __float2bfloat16(v); }
__device__ __forceinline__ void put(__half* y, float v) { *y = __float2half(v); }

// Each of the first m of a warp's M partial sums reduced across the lanes, into y[t][r].
template <typename T, int M>
__device__ __forceinline__ void store_sums(const float (&acc)[M], T* y, int m, int r, int out,
                                           int lane) {
#pragma unroll
    for (int t = 0; t < M; ++t) {
        if (t >= m) break;
        float v = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) put(y + (size_t)t * out + r, v);
    }
}

// `x` ([m, k], k a multiple of 32) to 8 bits: a warp per 32 inputs, d8 = max|x| / 127, code =
// round(x / d8) (candle's quantize_q8_1 rule, so the same codes); codes [m, k] int8, then
// ds [m, k / 32] float2 (d8, d8 * sum of the 32 codes).
template <typename T>
__device__ void q8_split(const T* __restrict__ x, int8_t* __restrict__ codes,
                         float2* __restrict__ ds, int blocks) {
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b >= blocks) return;
    const float v = load(x + (size_t)b * 32 + lane);
    float amax = fabsf(v);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.f;
    const int q = amax == 0.f ? 0 : __float2int_rn(v / d);
    codes[(size_t)b * 32 + lane] = static_cast<int8_t>(q);
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) ds[b] = make_float2(d, d * sum);
}

extern "C" __global__ void q8_split_bf16(const __nv_bfloat16* x, int8_t* codes, float2* ds,
                                         int blocks) {
    q8_split(x, codes, ds, blocks);
}

extern "C" __global__ void q8_split_f16(const __half* x, int8_t* codes, float2* ds, int blocks) {
    q8_split(x, codes, ds, blocks);
}

// Sub-block j's 6-bit scale and min (llama.cpp's get_scale_min_k4) from the block head's last
// 12 bytes, held as three words (bytes 0-3, 4-7, 8-11): shifts, not byte indexing, since j
// differs between lanes (indexing would put the head in local memory), and no branch.
__device__ __forceinline__ void scale_min(int j, uint4 head, float d, float dmin, float* scale,
                                          float* min) {
    const int shift = 8 * (j & 3);
    const int a = (head.y >> shift) & 0xFF, b = (head.z >> shift) & 0xFF;
    const int c = (head.w >> shift) & 0xFF;
    const bool high = j >= 4;
    const int sc = high ? (c & 0xF) | ((a >> 6) << 4) : a & 63;
    const int m = high ? (c >> 4) | ((b >> 6) << 4) : b & 63;
    *scale = d * sc;
    *min = dmin * m;
}

// Row `r` of one Q4_K matrix (`in` a multiple of 256) times M input rows (`m` of them checked
// when M is MAX_ROWS), U blocks' loads a lane in flight.
template <typename T, int M, int U>
__device__ __forceinline__ void q4k_row(const uint8_t* __restrict__ w,
                                        const int8_t* __restrict__ codes,
                                        const float2* __restrict__ ds, T* __restrict__ y, int m,
                                        int r, int out, int in, int lane) {
    const int blocks = in >> 8;
    const int part = lane & 7;   // 16 bytes of a block's 128 code bytes
    const int pair = part >> 1;  // sub-blocks 2·pair (low nibbles) and 2·pair+1 (high)
    const int half = part & 1;   // which 16 of each sub-block's 32 weights
    const uint8_t* row = w + (size_t)r * blocks * BLOCK_BYTES;
    float acc[M];
#pragma unroll
    for (int t = 0; t < M; ++t) acc[t] = 0.f;
    for (int b0 = lane >> 3; b0 < blocks; b0 += 4 * U) {
        uint4 raw[U], head[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (b0 + 4 * u < blocks) {
                const uint8_t* blk = row + (size_t)(b0 + 4 * u) * BLOCK_BYTES;
                raw[u] = __ldcs(reinterpret_cast<const uint4*>(blk + 16 + 16 * part));
                head[u] = __ldg(reinterpret_cast<const uint4*>(blk));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = b0 + 4 * u;
            if (b >= blocks) break;
            const uint32_t all[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
            const float2 dm = __half22float2(*reinterpret_cast<const __half2*>(&head[u].x));
            float sl, ml, sh, mh;
            scale_min(2 * pair, head[u], dm.x, dm.y, &sl, &ml);
            scale_min(2 * pair + 1, head[u], dm.x, dm.y, &sh, &mh);
            // The two lanes of a sub-block: one adds its min term for all 32 inputs.
            if (half) ml = mh = 0.f;
#pragma unroll
            for (int t = 0; t < M; ++t) {
                if (t >= m) break;
                const int8_t* xq = codes + (size_t)t * in + 256 * b + 64 * pair + 16 * half;
                const uint4 xl = __ldg(reinterpret_cast<const uint4*>(xq));
                const uint4 xh = __ldg(reinterpret_cast<const uint4*>(xq + 32));
                const float4 s = __ldg(reinterpret_cast<const float4*>(
                    ds + (size_t)t * (in >> 5) + 8 * b + 2 * pair));
                const int ul[4] = {(int)xl.x, (int)xl.y, (int)xl.z, (int)xl.w};
                const int uh[4] = {(int)xh.x, (int)xh.y, (int)xh.z, (int)xh.w};
                int dot_l = 0, dot_h = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    dot_l = __dp4a(static_cast<int>(all[k] & 0x0F0F0F0Fu), ul[k], dot_l);
                    dot_h = __dp4a(static_cast<int>((all[k] >> 4) & 0x0F0F0F0Fu), uh[k], dot_h);
                }
                acc[t] += sl * s.x * dot_l - ml * s.y + sh * s.z * dot_h - mh * s.w;
            }
        }
    }
    store_sums(acc, y, m, r, out, lane);
}

// Q6_K block (210 bytes, so only 2-byte aligned): 128 bytes `ql` of low 4 bits, 64 bytes `qh`
// of high 2 bits, 16 int8 scales (one per 16 weights), f16 d; weight = d * scale * (q - 32).
// Of each 128-weight half n, weight 32g + l (g < 4, l < 32) has its low bits in ql[64n + l]
// (g = 0, 2: low / high nibble) or ql[64n + 32 + l] (g = 1, 3), its high bits at 2g of
// qh[32n + l], its scale at 8n + l / 16 + 2g.
#define Q6K_BYTES 210

// 8 bytes at a 2-byte aligned address as two words.
__device__ __forceinline__ uint2 load8(const uint8_t* p) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return make_uint2(__ldg(h) | (uint32_t)__ldg(h + 1) << 16,
                      __ldg(h + 2) | (uint32_t)__ldg(h + 3) << 16);
}

// Row `r` of one Q6_K matrix times M input rows: eight lanes a block, each lane 8 weights of
// each of a half's four groups (bytes l0..l0+7 of ql, ql + 32 and qh), U blocks in flight.
template <typename T, int M, int U>
__device__ __forceinline__ void q6k_row(const uint8_t* __restrict__ w,
                                        const int8_t* __restrict__ codes,
                                        const float2* __restrict__ ds, T* __restrict__ y, int m,
                                        int r, int out, int in, int lane) {
    const int blocks = in >> 8;
    const int part = lane & 7;
    const int n = part >> 2, l0 = 8 * (part & 3);
    const uint8_t* row = w + (size_t)r * blocks * Q6K_BYTES;
    float acc[M];
#pragma unroll
    for (int t = 0; t < M; ++t) acc[t] = 0.f;
    for (int b0 = lane >> 3; b0 < blocks; b0 += 4 * U) {
        uint2 lo[U], hi[U], hb[U];
        uint32_t sc[U];
        float d[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (b0 + 4 * u < blocks) {
                const uint8_t* blk = row + (size_t)(b0 + 4 * u) * Q6K_BYTES;
                lo[u] = load8(blk + 64 * n + l0);
                hi[u] = load8(blk + 64 * n + 32 + l0);
                hb[u] = load8(blk + 128 + 32 * n + l0);
                // Scales 8n + l0/16 + {0, 2, 4, 6}: bytes 0, 2, 4, 6 of the 8 from 8n + l0/16.
                const uint8_t* s = blk + 192 + 8 * n + (l0 >> 4);
                sc[u] = (uint32_t)s[0] | (uint32_t)s[2] << 8 | (uint32_t)s[4] << 16 |
                        (uint32_t)s[6] << 24;
                d[u] = __half2float(__ldg(reinterpret_cast<const __half*>(blk + 208)));
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int b = b0 + 4 * u;
            if (b >= blocks) break;
            int v[4][2];
            const uint32_t l[2] = {lo[u].x, lo[u].y}, h[2] = {hi[u].x, hi[u].y};
            const uint32_t q[2] = {hb[u].x, hb[u].y};
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                v[0][k] = (l[k] & 0x0F0F0F0Fu) | ((q[k] & 0x03030303u) << 4);
                v[1][k] = (h[k] & 0x0F0F0F0Fu) | (((q[k] >> 2) & 0x03030303u) << 4);
                v[2][k] = ((l[k] >> 4) & 0x0F0F0F0Fu) | (((q[k] >> 4) & 0x03030303u) << 4);
                v[3][k] = ((h[k] >> 4) & 0x0F0F0F0Fu) | (((q[k] >> 6) & 0x03030303u) << 4);
#pragma unroll
                for (int g = 0; g < 4; ++g) v[g][k] = __vsubss4(v[g][k], 0x20202020);
            }
            float scale[4];
#pragma unroll
            for (int g = 0; g < 4; ++g)
                scale[g] = d[u] * static_cast<float>(static_cast<int8_t>(sc[u] >> (8 * g)));
#pragma unroll
            for (int t = 0; t < M; ++t) {
                if (t >= m) break;
                const int8_t* xq = codes + (size_t)t * in + 256 * b + 128 * n + l0;
                const float2* s = ds + (size_t)t * (in >> 5) + 8 * b + 4 * n;
                const float4 s01 = __ldg(reinterpret_cast<const float4*>(s));
                const float4 s23 = __ldg(reinterpret_cast<const float4*>(s + 2));
                const float d8[4] = {s01.x, s01.z, s23.x, s23.z};
#pragma unroll
                for (int g = 0; g < 4; ++g) {
                    const uint2 x = __ldg(reinterpret_cast<const uint2*>(xq + 32 * g));
                    const int dot = __dp4a(v[g][1], (int)x.y, __dp4a(v[g][0], (int)x.x, 0));
                    acc[t] += scale[g] * d8[g] * dot;
                }
            }
        }
    }
    store_sums(acc, y, m, r, out, lane);
}

// Up to three Q4_K / Q6_K matrices of the same input in one launch: warps [0, out0) take
// matrix 0's rows, the next out1 matrix 1's, then matrix 2's; bit j of `q6k` marks matrix j as
// Q6_K; each output its own [m, out_j] buffer.
template <typename T, int U>
__device__ void gguf_group(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,
                           const int8_t* codes, const float2* ds, T* y0, T* y1, T* y2, int out0,
                           int out1, int out2, int q6k, int m, int in) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const uint8_t* w = w0;
    T* y = y0;
    int out = out0, j = 0;
    if (r >= out0) {
        r -= out0, w = w1, y = y1, out = out1, j = 1;
        if (r >= out1) r -= out1, w = w2, y = y2, out = out2, j = 2;
    }
    if (r >= out) return;
    const bool six = (q6k >> j) & 1;
    if (m == 1 && six) q6k_row<T, 1, U>(w, codes, ds, y, 1, r, out, in, lane);
    else if (m == 1) q4k_row<T, 1, U>(w, codes, ds, y, 1, r, out, in, lane);
    else if (six) q6k_row<T, MAX_ROWS, 1>(w, codes, ds, y, m, r, out, in, lane);
    else q4k_row<T, MAX_ROWS, 1>(w, codes, ds, y, m, r, out, in, lane);
}

#define LOADS 4
extern "C" __global__ void gguf_gemv_group_bf16(const uint8_t* w0, const uint8_t* w1,
                                                const uint8_t* w2, const int8_t* codes,
                                                const float2* ds, __nv_bfloat16* y0,
                                                __nv_bfloat16* y1, __nv_bfloat16* y2, int out0,
                                                int out1, int out2, int q6k, int m, int in) {
    gguf_group<__nv_bfloat16, LOADS>(w0, w1, w2, codes, ds, y0, y1, y2, out0, out1, out2, q6k,
                                     m, in);
}

extern "C" __global__ void gguf_gemv_group_f16(const uint8_t* w0, const uint8_t* w1,
                                               const uint8_t* w2, const int8_t* codes,
                                               const float2* ds, __half* y0, __half* y1,
                                               __half* y2, int out0, int out1, int out2, int q6k,
                                               int m, int in) {
    gguf_group<__half, LOADS>(w0, w1, w2, codes, ds, y0, y1, y2, out0, out1, out2, q6k, m, in);
}
