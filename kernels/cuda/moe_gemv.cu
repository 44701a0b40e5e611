// A MoE layer's routed experts for a few tokens (decode) in two launches, GGUF Q4_K / Q6_K
// weights read where they lie (each expert's matrices at its own address, from a table).
// Slot s = t * k + j is token t's j-th choice: expert ids[s] (outside 0..experts: unused).
// moe_gate_up: h[s][r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t), a warp per r.
// moe_down: y[t][c] = sum over j of w[t * k + j] * (down_e[c] . h[t * k + j]), a warp per c,
// the choices summed in their order (no atomics: the same bits every run).
// Each lane takes 8 of a 256-weight super-block's weights, inputs in f32.
// Q4_K block (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins of eight
// sub-blocks of 32, then 128 code bytes: bytes 32p..32p+31 hold weights 64p..64p+31 in their low
// nibbles (sub-block 2p) and 64p+32..64p+63 in their high ones; w = d*sc*q - dmin*m.
// Q6_K block (210 bytes): ql[128], qh[64], 16 int8 scales of sub-blocks of 16, f16 d; each
// half n of 128 weights: w[l + 32i] = d * sc[l/16 + 2i] * (q - 32), q of 6 bits (llama.cpp's
// dequantize_row_q6_K). Reference: the dequantized experts' f32 products (tests/moe_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define Q4K 0
#define Q6K 1

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ void put(__nv_bfloat16* y, float v) { *y = __float2bfloat16(v); }
__device__ __forceinline__ void put(__half* y, float v) { *y = __float2half(v); }

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

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

// This lane's 8 weights of a Q4_K super-block times their inputs x[0..256).
template <typename In>
__device__ __forceinline__ float q4k_lane(const uint8_t* blk, const In* x, int lane) {
    const int p = lane >> 3, c = (lane & 7) << 2;
    const float d = __half2float(*reinterpret_cast<const __half*>(blk));
    const float dmin = __half2float(*reinterpret_cast<const __half*>(blk + 2));
    int sc0, m0, sc1, m1;
    scale_min(2 * p, blk + 4, &sc0, &m0);
    scale_min(2 * p + 1, blk + 4, &sc1, &m1);
    const uint32_t q = __ldg(reinterpret_cast<const uint32_t*>(blk + 16 + 32 * p + c));
    const In* x0 = x + 64 * p + c;
    float dot0 = 0.f, dot1 = 0.f, sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = to_f(x0[i]), b = to_f(x0[32 + i]);
        dot0 += static_cast<float>((q >> (8 * i)) & 0xF) * a;
        dot1 += static_cast<float>((q >> (8 * i + 4)) & 0xF) * b;
        sum0 += a;
        sum1 += b;
    }
    return d * (sc0 * dot0 + sc1 * dot1) - dmin * (m0 * sum0 + m1 * sum1);
}

// This lane's 8 weights of a Q6_K super-block times their inputs x[0..256).
template <typename In>
__device__ __forceinline__ float q6k_lane(const uint8_t* blk, const In* x, int lane) {
    const int n = lane >> 4, l = (lane & 15) << 1;
    const uint8_t* ql = blk + 64 * n;
    const uint8_t* qh = blk + 128 + 32 * n;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * n + (l >> 4);
    const In* xs = x + 128 * n;
    float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int L = l + u, h = qh[L], lo = ql[L], hi = ql[L + 32];
        a[0] += static_cast<float>(((lo & 0xF) | ((h & 3) << 4)) - 32) * to_f(xs[L]);
        a[1] += static_cast<float>(((hi & 0xF) | (((h >> 2) & 3) << 4)) - 32) * to_f(xs[L + 32]);
        a[2] += static_cast<float>(((lo >> 4) | (((h >> 4) & 3) << 4)) - 32) * to_f(xs[L + 64]);
        a[3] += static_cast<float>(((hi >> 4) | (((h >> 6) & 3) << 4)) - 32) * to_f(xs[L + 96]);
    }
    const float d = __half2float(*reinterpret_cast<const __half*>(blk + 208));
    return d * (sc[0] * a[0] + sc[2] * a[1] + sc[4] * a[2] + sc[6] * a[3]);
}

template <int F>
__device__ __forceinline__ int block_bytes() { return F == Q4K ? 144 : 210; }

// This lane's share of row `row` (blocks super-blocks) times x.
template <int F, typename In>
__device__ __forceinline__ float row_lane(const uint8_t* row, const In* x, int blocks, int lane) {
    float s = 0.f;
    for (int b = 0; b < blocks; ++b) {
        const uint8_t* blk = row + b * block_bytes<F>();
        s += F == Q4K ? q4k_lane(blk, x + 256 * b, lane) : q6k_lane(blk, x + 256 * b, lane);
    }
    return s;
}

// Grid (inter / warps a block, slots); `inter` and `hidden` multiples of 256.
template <int F, typename T>
__device__ void moe_gate_up(const uint64_t* gates, const uint64_t* ups, const int* ids,
                            const T* x, float* h, int experts, int k, int inter, int hidden) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int s = blockIdx.y;
    if (r >= inter) return;
    const int e = ids[s];
    float* out = h + (size_t)s * inter + r;
    if (e < 0 || e >= experts) {
        if (lane == 0) *out = 0.f;
        return;
    }
    const int blocks = hidden >> 8;
    const size_t at = (size_t)r * blocks * block_bytes<F>();
    const T* xt = x + (size_t)(s / k) * hidden;
    const float g = warp_sum(row_lane<F>(reinterpret_cast<const uint8_t*>(gates[e]) + at, xt, blocks, lane));
    const float u = warp_sum(row_lane<F>(reinterpret_cast<const uint8_t*>(ups[e]) + at, xt, blocks, lane));
    if (lane == 0) *out = g / (1.f + __expf(-g)) * u;
}

// Grid (hidden / warps a block, tokens).
template <int F, typename T>
__device__ void moe_down(const uint64_t* downs, const int* ids, const float* weights,
                         const float* h, T* y, int experts, int k, int inter, int hidden) {
    const int lane = threadIdx.x & 31;
    const int c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (c >= hidden) return;
    const int blocks = inter >> 8;
    const size_t at = (size_t)c * blocks * block_bytes<F>();
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
        const int s = t * k + j, e = ids[s];
        if (e < 0 || e >= experts) continue;
        const uint8_t* row = reinterpret_cast<const uint8_t*>(downs[e]) + at;
        acc += weights[s] * warp_sum(row_lane<F>(row, h + (size_t)s * inter, blocks, lane));
    }
    if (lane == 0) put(y + (size_t)t * hidden + c, acc);
}

#define GATE_UP(name, F, T)                                                                      \
    extern "C" __global__ void name(const uint64_t* gates, const uint64_t* ups, const int* ids,  \
                                    const T* x, float* h, int experts, int k, int inter,         \
                                    int hidden) {                                                \
        moe_gate_up<F, T>(gates, ups, ids, x, h, experts, k, inter, hidden);                     \
    }
#define DOWN(name, F, T)                                                                         \
    extern "C" __global__ void name(const uint64_t* downs, const int* ids, const float* weights, \
                                    const float* h, T* y, int experts, int k, int inter,         \
                                    int hidden) {                                                \
        moe_down<F, T>(downs, ids, weights, h, y, experts, k, inter, hidden);                    \
    }

GATE_UP(moe_gate_up_q4k_bf16, Q4K, __nv_bfloat16)
GATE_UP(moe_gate_up_q4k_f16, Q4K, __half)
GATE_UP(moe_gate_up_q6k_bf16, Q6K, __nv_bfloat16)
GATE_UP(moe_gate_up_q6k_f16, Q6K, __half)
DOWN(moe_down_q4k_bf16, Q4K, __nv_bfloat16)
DOWN(moe_down_q4k_f16, Q4K, __half)
DOWN(moe_down_q6k_bf16, Q6K, __nv_bfloat16)
DOWN(moe_down_q6k_f16, Q6K, __half)

// The routing of moe_gate_up / moe_down made where the router's logits are (Mixtral's and
// Qwen-MoE's): per token, softmax over the experts, the k largest scores (the first index of
// equal ones, as the host router), renormalised to sum to 1 when `normalize`, times `scale`.
// Writes ids[t * k + j] and, as float bits, weights at ids + slots. A warp per token; at most
// 32 * ROUTE_PER_LANE experts.
#define ROUTE_PER_LANE 16
extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ ids,
                                     int experts, int k, int slots, int normalize, float scale) {
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* row = logits + (size_t)t * experts;
    float p[ROUTE_PER_LANE];
    float max = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < experts ? row[e] : -INFINITY;
        max = fmaxf(max, p[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, o));
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        p[j] = lane + 32 * j < experts ? expf(p[j] - max) : 0.f;
        sum += p[j];
    }
    sum = warp_sum(sum);
    float taken[ROUTE_PER_LANE];
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        p[j] /= sum;
        taken[j] = lane + 32 * j < experts ? p[j] : -INFINITY;
    }
    float* weights = reinterpret_cast<float*>(ids + slots);
    float chosen = 0.f;
    for (int i = 0; i < k; ++i) {
        float best = -INFINITY;
        int at = experts;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) {
            if (taken[j] > best) best = taken[j], at = lane + 32 * j;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float b = __shfl_xor_sync(0xffffffffu, best, o);
            const int a = __shfl_xor_sync(0xffffffffu, at, o);
            if (b > best || (b == best && a < at)) best = b, at = a;
        }
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) {
            if (lane + 32 * j == at) taken[j] = -INFINITY;
        }
        chosen += best;
        if (lane == 0) {
            ids[t * k + i] = at;
            weights[t * k + i] = best;
        }
    }
    if (lane == 0) {
        for (int i = 0; i < k; ++i) {
            const float w = weights[t * k + i];
            weights[t * k + i] = (normalize ? w / chosen : w) * scale;
        }
    }
}

// A prompt's tokens (more than a few), grouped by expert so that each expert's rows are read
// once for all the tokens sent to it. `routing` (i32 words): offsets[experts + 1] of each
// expert's run of positions, tokens[slots] (the token at each position), pos[slots] (the
// position of slot t * k + j, -1: unused), weights[slots] (f32 bits, by slot).
#define TILE 4

// This lane's 8 weights of super-block `blk` and their indices within it.
template <int F>
__device__ __forceinline__ void lane_weights(const uint8_t* blk, int lane, float* w, int* at) {
    if (F == Q4K) {
        const int p = lane >> 3, c = (lane & 7) << 2;
        const float d = __half2float(*reinterpret_cast<const __half*>(blk));
        const float dmin = __half2float(*reinterpret_cast<const __half*>(blk + 2));
        int sc0, m0, sc1, m1;
        scale_min(2 * p, blk + 4, &sc0, &m0);
        scale_min(2 * p + 1, blk + 4, &sc1, &m1);
        const uint32_t q = __ldg(reinterpret_cast<const uint32_t*>(blk + 16 + 32 * p + c));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = d * sc0 * static_cast<float>((q >> (8 * i)) & 0xF) - dmin * m0;
            w[4 + i] = d * sc1 * static_cast<float>((q >> (8 * i + 4)) & 0xF) - dmin * m1;
            at[i] = 64 * p + c + i;
            at[4 + i] = 64 * p + 32 + c + i;
        }
    } else {
        const int n = lane >> 4, l = (lane & 15) << 1;
        const uint8_t* ql = blk + 64 * n;
        const uint8_t* qh = blk + 128 + 32 * n;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * n + (l >> 4);
        const float d = __half2float(*reinterpret_cast<const __half*>(blk + 208));
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int L = l + u, h = qh[L], lo = ql[L], hi = ql[L + 32];
            w[4 * u + 0] = d * sc[0] * static_cast<float>(((lo & 0xF) | ((h & 3) << 4)) - 32);
            w[4 * u + 1] = d * sc[2] * static_cast<float>(((hi & 0xF) | (((h >> 2) & 3) << 4)) - 32);
            w[4 * u + 2] = d * sc[4] * static_cast<float>(((lo >> 4) | (((h >> 4) & 3) << 4)) - 32);
            w[4 * u + 3] = d * sc[6] * static_cast<float>(((hi >> 4) | (((h >> 6) & 3) << 4)) - 32);
#pragma unroll
            for (int i = 0; i < 4; ++i) at[4 * u + i] = 128 * n + L + 32 * i;
        }
    }
}

// Grid (inter / warps a block, experts): h[p][r] = silu(gate_e[r] . x) * (up_e[r] . x) for
// each position p of expert e (token tokens[p]), TILE tokens a pass over the rows.
template <int F, typename T>
__device__ void moe_gate_up_grouped(const uint64_t* gates, const uint64_t* ups,
                                    const int* routing, const T* x, float* h, int experts,
                                    int inter, int hidden) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int e = blockIdx.y;
    const int begin = routing[e], end = routing[e + 1];
    if (r >= inter || begin == end) return;
    const int* tokens = routing + experts + 1;
    const int blocks = hidden >> 8;
    const size_t at0 = (size_t)r * blocks * block_bytes<F>();
    const uint8_t* gate = reinterpret_cast<const uint8_t*>(gates[e]) + at0;
    const uint8_t* up = reinterpret_cast<const uint8_t*>(ups[e]) + at0;
    for (int p0 = begin; p0 < end; p0 += TILE) {
        const int count = min(TILE, end - p0);
        float g[TILE] = {0.f, 0.f, 0.f, 0.f}, u[TILE] = {0.f, 0.f, 0.f, 0.f};
        for (int b = 0; b < blocks; ++b) {
            float wg[8], wu[8];
            int at[8];
            lane_weights<F>(gate + b * block_bytes<F>(), lane, wg, at);
            lane_weights<F>(up + b * block_bytes<F>(), lane, wu, at);
#pragma unroll
            for (int q = 0; q < TILE; ++q) {
                if (q >= count) break;
                const T* xb = x + (size_t)tokens[p0 + q] * hidden + 256 * b;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float v = to_f(xb[at[i]]);
                    g[q] += wg[i] * v;
                    u[q] += wu[i] * v;
                }
            }
        }
#pragma unroll
        for (int q = 0; q < TILE; ++q) {
            if (q >= count) break;
            const float gs = warp_sum(g[q]), us = warp_sum(u[q]);
            if (lane == 0) h[(size_t)(p0 + q) * inter + r] = gs / (1.f + __expf(-gs)) * us;
        }
    }
}

// Grid (hidden / warps a block, experts): ys[p][c] = down_e[c] . h[p] for each position p of
// expert e.
template <int F>
__device__ void moe_down_grouped(const uint64_t* downs, const int* routing, const float* h,
                                 float* ys, int inter, int hidden) {
    const int lane = threadIdx.x & 31;
    const int c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int e = blockIdx.y;
    const int begin = routing[e], end = routing[e + 1];
    if (c >= hidden || begin == end) return;
    const int blocks = inter >> 8;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(downs[e]) + (size_t)c * blocks * block_bytes<F>();
    for (int p0 = begin; p0 < end; p0 += TILE) {
        const int count = min(TILE, end - p0);
        float acc[TILE] = {0.f, 0.f, 0.f, 0.f};
        for (int b = 0; b < blocks; ++b) {
            float w[8];
            int at[8];
            lane_weights<F>(row + b * block_bytes<F>(), lane, w, at);
#pragma unroll
            for (int q = 0; q < TILE; ++q) {
                if (q >= count) break;
                const float* hb = h + (size_t)(p0 + q) * inter + 256 * b;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[q] += w[i] * hb[at[i]];
            }
        }
#pragma unroll
        for (int q = 0; q < TILE; ++q) {
            if (q >= count) break;
            const float s = warp_sum(acc[q]);
            if (lane == 0) ys[(size_t)(p0 + q) * hidden + c] = s;
        }
    }
}

// Grid (hidden / 256, tokens), 256 threads: y[t][c] = sum over j of w[t k + j] * ys[pos][c],
// the choices in order.
template <typename T>
__device__ void moe_combine(const int* routing, const float* ys, T* y, int experts, int k,
                            int slots, int hidden) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (c >= hidden) return;
    const int* pos = routing + experts + 1 + slots;
    const float* weights = reinterpret_cast<const float*>(pos + slots);
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
        const int s = t * k + j, p = pos[s];
        if (p >= 0) acc += weights[s] * ys[(size_t)p * hidden + c];
    }
    put(y + (size_t)t * hidden + c, acc);
}

#define GATE_UP_GROUPED(name, F, T)                                                              \
    extern "C" __global__ void name(const uint64_t* gates, const uint64_t* ups,                  \
                                    const int* routing, const T* x, float* h, int experts,       \
                                    int inter, int hidden) {                                     \
        moe_gate_up_grouped<F, T>(gates, ups, routing, x, h, experts, inter, hidden);            \
    }
#define DOWN_GROUPED(name, F)                                                                    \
    extern "C" __global__ void name(const uint64_t* downs, const int* routing, const float* h,   \
                                    float* ys, int inter, int hidden) {                          \
        moe_down_grouped<F>(downs, routing, h, ys, inter, hidden);                               \
    }
#define COMBINE(name, T)                                                                         \
    extern "C" __global__ void name(const int* routing, const float* ys, T* y, int experts,      \
                                    int k, int slots, int hidden) {                              \
        moe_combine<T>(routing, ys, y, experts, k, slots, hidden);                               \
    }

GATE_UP_GROUPED(moe_gate_up_grouped_q4k_bf16, Q4K, __nv_bfloat16)
GATE_UP_GROUPED(moe_gate_up_grouped_q4k_f16, Q4K, __half)
GATE_UP_GROUPED(moe_gate_up_grouped_q6k_bf16, Q6K, __nv_bfloat16)
GATE_UP_GROUPED(moe_gate_up_grouped_q6k_f16, Q6K, __half)
DOWN_GROUPED(moe_down_grouped_q4k, Q4K)
DOWN_GROUPED(moe_down_grouped_q6k, Q6K)
COMBINE(moe_combine_bf16, __nv_bfloat16)
COMBINE(moe_combine_f16, __half)
