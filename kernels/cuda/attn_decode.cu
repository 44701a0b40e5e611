// One new token's attention over its cache (decode), split over the keys as flash-decoding does.
// candle's path (a cuBLAS GEMM for the scores, a softmax, a GEMM for the values) runs the
// value product with one block per kv head and no split of the 8K-long sum: at 8K context it
// took ~40 % of an 8B bf16 decode step (docs/cuda.md). Here each block attends one kv head's
// query heads over one chunk of keys (scores, online softmax and the weighted values in f32
// registers), and a second kernel joins the chunks. Keys and values are read once per kv head.
// Reference: `attention_ref` in f32 (tests/attention_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

// Most query heads per kv head; more takes candle's path.
#define MAX_GROUPS 8
#define WARPS 4

__device__ __forceinline__ void to_f8(const float* p, float* x) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

__device__ __forceinline__ void to_f8(const __half* p, float* x) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void to_f8(const __nv_bfloat16* p, float* x) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}

// exp(m - top) for a stream's running max, 0 for a stream that saw no key.
__device__ __forceinline__ float weight(float m, float top) {
    return m == -CUDART_INF_F ? 0.f : __expf(m - top);
}

// Block (kv head blockIdx.x, chunk blockIdx.y): the `groups` query heads of that kv head over
// keys [chunk · chunk_keys, +chunk_keys) ∩ [0, n). Lanes take 8 values of a key row each, D / 8
// lanes a key, so a warp reads 256 / D keys at a time; each such lane group keeps its own
// running max, sum and weighted values (a stream), and the block joins its streams at the end.
// Writes part_o[head][chunk][D] (unnormalised) and part_ml[head][chunk] = (max, sum).
// q: [heads][D] f32, scores scaled by `scale`; k, v: kv head h's key j at
// k + h * head_stride + j * D.
template <typename T, int D>
__device__ void partial(const float* q, const T* k, const T* v, long head_stride, int n,
                        int groups, int chunk_keys, float scale, float softcap, float* part_o,
                        float2* part_ml) {
    constexpr int LANES = D / 8;          // lanes per key
    constexpr int KEYS = 32 / LANES;      // keys per warp pass
    constexpr int STREAMS = WARPS * KEYS;
    __shared__ float sq[MAX_GROUPS * D];
    __shared__ float so[STREAMS * MAX_GROUPS * D];  // 32 KiB whatever D
    __shared__ float2 sml[STREAMS * MAX_GROUPS];
    const int kvh = blockIdx.x, chunk = blockIdx.y, chunks = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / LANES, col = (lane % LANES) * 8;
    for (int i = threadIdx.x; i < groups * D; i += blockDim.x) sq[i] = q[kvh * groups * D + i];
    __syncthreads();
    const T* kh = k + kvh * head_stride;
    const T* vh = v + kvh * head_stride;
    float m[MAX_GROUPS], l[MAX_GROUPS], o[MAX_GROUPS][8];
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
        m[g] = -CUDART_INF_F;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[g][e] = 0.f;
    }
    const int first = chunk * chunk_keys, end = min(n, first + chunk_keys);
    // Every lane runs every pass (the shuffles need the whole warp); a key past the end is
    // read as nothing.
    for (int j0 = first + warp * KEYS; j0 < end; j0 += WARPS * KEYS) {
        const int j = j0 + sub;
        const bool live = j < end;
        // Both rows' loads in flight before the scores need the key's.
        float x[8], y[8];
        if (live) {
            to_f8(kh + (long)j * D + col, x);
            to_f8(vh + (long)j * D + col, y);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = y[e] = 0.f;
        }
        float s[MAX_GROUPS];
#pragma unroll
        for (int g = 0; g < MAX_GROUPS; ++g) {
            if (g < groups) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) dot += sq[g * D + col + e] * x[e];
#pragma unroll
                for (int off = LANES / 2; off > 0; off >>= 1)
                    dot += __shfl_xor_sync(0xffffffff, dot, off);
                dot *= scale;
                s[g] = softcap > 0.f ? softcap * tanhf(dot / softcap) : dot;
            }
        }
        if (!live) continue;
#pragma unroll
        for (int g = 0; g < MAX_GROUPS; ++g) {
            if (g < groups) {
                const float top = fmaxf(m[g], s[g]);
                const float keep = __expf(m[g] - top), p = __expf(s[g] - top);
                l[g] = l[g] * keep + p;
#pragma unroll
                for (int e = 0; e < 8; ++e) o[g][e] = o[g][e] * keep + p * y[e];
                m[g] = top;
            }
        }
    }
    // Each stream's state to shared memory: stream = warp · KEYS + sub.
    const int stream = warp * KEYS + sub;
#pragma unroll
    for (int g = 0; g < MAX_GROUPS; ++g) {
        if (g < groups) {
#pragma unroll
            for (int e = 0; e < 8; ++e) so[(stream * MAX_GROUPS + g) * D + col + e] = o[g][e];
            if (col == 0) sml[stream * MAX_GROUPS + g] = make_float2(m[g], l[g]);
        }
    }
    __syncthreads();
    // Join the streams: one thread per (query head of the group, column).
    for (int i = threadIdx.x; i < groups * D; i += blockDim.x) {
        const int g = i / D, c = i % D;
        float top = -CUDART_INF_F;
        for (int s = 0; s < STREAMS; ++s) top = fmaxf(top, sml[s * MAX_GROUPS + g].x);
        float sum = 0.f, acc = 0.f;
        for (int s = 0; s < STREAMS; ++s) {
            const float2 ml = sml[s * MAX_GROUPS + g];
            const float w = weight(ml.x, top);
            sum += w * ml.y;
            acc += w * so[(s * MAX_GROUPS + g) * D + c];
        }
        const int head = kvh * groups + g;
        part_o[((long)head * chunks + chunk) * D + c] = acc;
        if (c == 0) part_ml[head * chunks + chunk] = make_float2(top, sum);
    }
}

// Block blockIdx.x (a query head), D threads: its chunks joined and normalised into out[head].
template <typename T>
__device__ void join(const float* part_o, const float2* part_ml, int chunks, int d, T* out) {
    const int head = blockIdx.x, c = threadIdx.x;
    const float2* ml = part_ml + head * chunks;
    float top = -CUDART_INF_F;
    for (int i = 0; i < chunks; ++i) top = fmaxf(top, ml[i].x);
    float sum = 0.f, acc = 0.f;
    for (int i = 0; i < chunks; ++i) {
        const float w = weight(ml[i].x, top);
        sum += w * ml[i].y;
        acc += w * part_o[((long)head * chunks + i) * d + c];
    }
    if (c < d) out[head * d + c] = from_f<T>(sum > 0.f ? acc / sum : 0.f);
}

#define DECODE(NAME, T, D)                                                                     \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attn_partial_##NAME##_d##D(      \
        const float* q, const T* k, const T* v, long head_stride, int n, int groups,           \
        int chunk_keys, float scale, float softcap, float* part_o, float2* part_ml) {          \
        partial<T, D>(q, k, v, head_stride, n, groups, chunk_keys, scale, softcap, part_o,     \
                      part_ml);                                                                \
    }

#define JOIN(NAME, T)                                                                          \
    extern "C" __global__ void attn_join_##NAME(const float* part_o, const float2* part_ml,    \
                                                int chunks, int d, T* out) {                   \
        join<T>(part_o, part_ml, chunks, d, out);                                              \
    }

// A decode step's sequences in one launch (blockIdx.z a sequence): each attends its own cache,
// found through the tables (its keys' and values' first row, its head stride and key count);
// q: [sequences][heads][D]; its chunks are its keys split over gridDim.y, and the parts are
// laid out per sequence as the one-sequence kernel lays them out.
#define DECODE_MANY(NAME, T, D)                                                                \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) attn_partial_many_##NAME##_d##D( \
        const float* q, const T* const* ks, const T* const* vs, const long* head_strides,      \
        const int* ns, int groups, float scale, float softcap, float* part_o,                  \
        float2* part_ml) {                                                                     \
        const int s = blockIdx.z, heads = gridDim.x * groups, chunks = gridDim.y;              \
        const int n = ns[s], chunk_keys = max(1, (n + chunks - 1) / chunks);                   \
        partial<T, D>(q + (long)s * heads * D, ks[s], vs[s], head_strides[s], n, groups,       \
                      chunk_keys, scale, softcap, part_o + (long)s * heads * chunks * D,       \
                      part_ml + (long)s * heads * chunks);                                     \
    }

// Block (query head blockIdx.x, sequence blockIdx.y): as `attn_join`, out: [sequences][heads][d].
#define JOIN_MANY(NAME, T)                                                                     \
    extern "C" __global__ void attn_join_many_##NAME(const float* part_o,                      \
                                                     const float2* part_ml, int chunks, int d, \
                                                     T* out) {                                 \
        const long s = blockIdx.y, heads = gridDim.x;                                          \
        join<T>(part_o + s * heads * chunks * d, part_ml + s * heads * chunks, chunks, d,      \
                out + s * heads * d);                                                          \
    }

#define ALL_DIMS(NAME, T) \
    DECODE(NAME, T, 16) DECODE(NAME, T, 32) DECODE(NAME, T, 64) DECODE(NAME, T, 128) \
    DECODE(NAME, T, 256) JOIN(NAME, T) \
    DECODE_MANY(NAME, T, 16) DECODE_MANY(NAME, T, 32) DECODE_MANY(NAME, T, 64) \
    DECODE_MANY(NAME, T, 128) DECODE_MANY(NAME, T, 256) JOIN_MANY(NAME, T)

ALL_DIMS(f32, float)
ALL_DIMS(f16, __half)
ALL_DIMS(bf16, __nv_bfloat16)
