// A decode step's new rows for every sequence in one launch: keys turned by RoPE and written
// into each sequence's cache with its values (converted to the cache's dtype), and queries
// turned into f32 rows for the attention kernel. The generic path runs, per sequence and
// layer, RoPE of the queries and of the keys, copies, casts and a `slice_set` for keys and
// again for values: at 64 sequences, hundreds of launches a layer.
// Block (head, row): heads [0, heads) are query heads, [heads, heads + kv_heads) kv heads.
// RoPE is computed in the activations' type, operation by operation, as candle's `rope` /
// `rope_i` kernels do, so the rows are those of the generic path bit for bit (bf16, f16).
// Reference: candle's rope, cast and `slice_set` of the same rows (tests/attention_cuda.rs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}

// Words of a row's entry in the table: the addresses of its keys' and values' head 0 in the
// inputs and in the caches' slot, the head strides (elements) of the caches, the input keys and
// the input values, then its queries' address and head stride, and its position.
#define ENTRY 10

// Head `x` (d elements) turned at a position whose table rows are c, s (`half` pairs; none for
// no RoPE), element i written by `put(i, value)`; the dimensions past 2 · half pass through.
template <typename I, typename Put>
__device__ __forceinline__ void turn(const I* x, const I* c, const I* s, int half, int interleaved,
                                     int d, Put put) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int i1 = interleaved ? 2 * i : i, i2 = interleaved ? 2 * i + 1 : i + half;
        const I x1 = x[i1], x2 = x[i2], ci = c[i], si = s[i];
        put(i1, x1 * ci - x2 * si);
        put(i2, x1 * si + x2 * ci);
    }
    for (int i = 2 * half + threadIdx.x; i < d; i += blockDim.x) put(i, x[i]);
}

// cos, sin: [positions][half] in the activations' type (unused when half is 0); q_out:
// [rows][heads][d] f32 (unused when heads is 0).
template <typename I, typename O>
__device__ void decode_rows(const uint64_t* table, const I* cos, const I* sin, int heads, int d,
                            int half, int interleaved, float* q_out) {
    const int head = blockIdx.x, row = blockIdx.y;
    const uint64_t* e = table + ENTRY * row;
    const long at = static_cast<long>(e[9]) * half;
    const I* c = cos + at;
    const I* s = sin + at;
    if (head < heads) {
        const I* x = reinterpret_cast<const I*>(e[7]) + head * static_cast<long>(e[8]);
        float* y = q_out + (static_cast<long>(row) * heads + head) * d;
        turn(x, c, s, half, interleaved, d, [&](int i, I v) { y[i] = to_f(v); });
        return;
    }
    const long kv = head - heads, dst_head = static_cast<long>(e[4]);
    const I* ks = reinterpret_cast<const I*>(e[0]) + kv * static_cast<long>(e[5]);
    const I* vs = reinterpret_cast<const I*>(e[1]) + kv * static_cast<long>(e[6]);
    O* kd = reinterpret_cast<O*>(e[2]) + kv * dst_head;
    O* vd = reinterpret_cast<O*>(e[3]) + kv * dst_head;
    turn(ks, c, s, half, interleaved, d, [&](int i, I v) { kd[i] = from_f<O>(to_f(v)); });
    for (int i = threadIdx.x; i < d; i += blockDim.x) vd[i] = from_f<O>(to_f(vs[i]));
}

#define DECODE_ROWS(NAME, I, O)                                                              \
    extern "C" __global__ void decode_rows_##NAME(const uint64_t* table, const I* cos,        \
                                                  const I* sin, int heads, int d, int half,   \
                                                  int interleaved, float* q_out) {            \
        decode_rows<I, O>(table, cos, sin, heads, d, half, interleaved, q_out);              \
    }

DECODE_ROWS(bf16_f16, __nv_bfloat16, __half)
DECODE_ROWS(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
DECODE_ROWS(bf16_f32, __nv_bfloat16, float)
DECODE_ROWS(f16_f16, __half, __half)
DECODE_ROWS(f16_bf16, __half, __nv_bfloat16)
DECODE_ROWS(f16_f32, __half, float)
DECODE_ROWS(f32_f16, float, __half)
DECODE_ROWS(f32_bf16, float, __nv_bfloat16)
DECODE_ROWS(f32_f32, float, float)
