// A decode step's new key and value rows written into every sequence's cache in one launch.
// The generic path appends each sequence's row with its own copies (a cast and a `slice_set`
// for keys and again for values): at 64 sequences, 128+ launches a layer. Here a table gives
// each row's source and destination addresses, and block (kv head, row) copies one head's
// keys and values, converting to the cache's dtype on the way.
// Reference: candle's `slice_set` of the same rows (tests/attention_cuda.rs).
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

// Row r's entry in `table` (7 words a row): the addresses of its keys' and values' head 0 in
// the inputs and in the caches' slot, then the head strides (elements) of the caches, the
// input keys and the input values. Each head is `d` contiguous elements on both sides.
template <typename I, typename O>
__device__ void append(const uint64_t* table, int d) {
    const int head = blockIdx.x, row = blockIdx.y;
    const uint64_t* e = table + 7 * row;
    const I* ks = reinterpret_cast<const I*>(e[0]) + head * static_cast<long>(e[5]);
    const I* vs = reinterpret_cast<const I*>(e[1]) + head * static_cast<long>(e[6]);
    const long dst_head = static_cast<long>(e[4]);
    O* kd = reinterpret_cast<O*>(e[2]) + head * dst_head;
    O* vd = reinterpret_cast<O*>(e[3]) + head * dst_head;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        kd[i] = from_f<O>(to_f<I>(ks[i]));
        vd[i] = from_f<O>(to_f<I>(vs[i]));
    }
}

#define APPEND(NAME, I, O)                                                                   \
    extern "C" __global__ void kv_append_##NAME(const uint64_t* table, int d) {               \
        append<I, O>(table, d);                                                              \
    }

APPEND(bf16_f16, __nv_bfloat16, __half)
APPEND(bf16_bf16, __nv_bfloat16, __nv_bfloat16)
APPEND(bf16_f32, __nv_bfloat16, float)
APPEND(f16_f16, __half, __half)
APPEND(f16_bf16, __half, __nv_bfloat16)
APPEND(f16_f32, __half, float)
APPEND(f32_f16, float, __half)
APPEND(f32_bf16, float, __nv_bfloat16)
APPEND(f32_f32, float, float)
