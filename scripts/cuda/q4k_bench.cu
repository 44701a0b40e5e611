// Q4_K GEMV kernels timed alone on the GPU, back to back as a decode step launches them:
// candle's MMVQ (with its own 8-bit input) against ours (kernels/cuda/gguf_gemv.cu), on the
// matrix shapes of Llama-3.1-8B, each launch reading a different copy of the weights so none
// is served from L2. Prints µs a launch and GB/s of weights, and the largest difference of
// ours from MMVQ's outputs. Built by scripts/cuda/q4k_bench.sh; a developer's tool.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <vector>

#include "../../kernels/cuda/gguf_gemv.cu"

extern "C" void launch_mmvq_gguf_q4_k_bf16_plain(const void* vx, const void* vy, void* dst,
                                                 int ncols_x, int nrows_x, int stride_col_y,
                                                 int stride_col_dst, int b_size, void* stream);
extern "C" void launch_mmvq_gguf_q6_k_bf16_plain(const void* vx, const void* vy, void* dst,
                                                 int ncols_x, int nrows_x, int stride_col_y,
                                                 int stride_col_dst, int b_size, void* stream);
extern "C" void launch_mmvq_gguf_quantize_q8_1_bf16(const void* x, void* vy, int kx,
                                                    int kx_padded, int rows, void* stream);

#define CK(x)                                                                         \
    do {                                                                              \
        cudaError_t e = (x);                                                          \
        if (e != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

template <int U>
__global__ void ours_u(const uint8_t* w0, const uint8_t* w1, const uint8_t* w2,
                       const int8_t* codes, const float2* ds, __nv_bfloat16* y0,
                       __nv_bfloat16* y1, __nv_bfloat16* y2, int out0, int out1, int out2,
                       int m, int in) {
    gguf_group<__nv_bfloat16, U>(w0, w1, w2, codes, ds, y0, y1, y2, out0, out1, out2, 0, m, in);
}

template <int U>
__global__ void ours_q6k(const uint8_t* w, const int8_t* codes, const float2* ds,
                         __nv_bfloat16* y, int out, int m, int in) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (r >= out) return;
    if (m == 1) q6k_row<__nv_bfloat16, 1, U>(w, codes, ds, y, 1, r, out, in, lane);
    else q6k_row<__nv_bfloat16, MAX_ROWS, 1>(w, codes, ds, y, m, r, out, in, lane);
}

static uint16_t f2h(float f) {
    __half h = __float2half(f);
    return *reinterpret_cast<uint16_t*>(&h);
}

// `copies` Q6_K matrices of out x in with random codes and scales, d small.
static uint8_t* make_q6k(int out, int in, int copies) {
    const size_t bytes = (size_t)out * (in / 256) * Q6K_BYTES;
    std::vector<uint8_t> host(bytes);
    for (size_t b = 0; b < bytes / Q6K_BYTES; ++b) {
        uint8_t* blk = host.data() + b * Q6K_BYTES;
        for (int i = 0; i < 208; ++i) blk[i] = rand() & 255;
        uint16_t d = f2h(0.0001f + 0.001f * rand() / RAND_MAX);
        memcpy(blk + 208, &d, 2);
    }
    uint8_t* dev;
    CK(cudaMalloc(&dev, bytes * copies));
    for (int c = 0; c < copies; ++c)
        CK(cudaMemcpy(dev + bytes * c, host.data(), bytes, cudaMemcpyHostToDevice));
    return dev;
}

// `copies` Q4_K matrices of out x in with random codes and scales, d and dmin small.
static uint8_t* make_weights(int out, int in, int copies) {
    const size_t bytes = (size_t)out * (in / 256) * BLOCK_BYTES;
    std::vector<uint8_t> host(bytes);
    for (size_t b = 0; b < bytes / BLOCK_BYTES; ++b) {
        uint8_t* blk = host.data() + b * BLOCK_BYTES;
        uint16_t d = f2h(0.001f + 0.01f * rand() / RAND_MAX);
        uint16_t dm = f2h(0.001f + 0.01f * rand() / RAND_MAX);
        memcpy(blk, &d, 2);
        memcpy(blk + 2, &dm, 2);
        for (int i = 4; i < BLOCK_BYTES; ++i) blk[i] = rand() & 255;
    }
    uint8_t* dev;
    CK(cudaMalloc(&dev, bytes * copies));
    for (int c = 0; c < copies; ++c)
        CK(cudaMemcpy(dev + bytes * c, host.data(), bytes, cudaMemcpyHostToDevice));
    return dev;
}

struct Input {
    __nv_bfloat16* x;
    void* q8_1;     // candle's block_q8_1, padded to 512 columns
    int8_t* codes;  // ours
    float2* ds;
};

static Input make_input(int m, int in, cudaStream_t s) {
    std::vector<__nv_bfloat16> host((size_t)m * in);
    for (auto& v : host) v = __float2bfloat16(2.f * rand() / RAND_MAX - 1.f);
    Input i;
    CK(cudaMalloc(&i.x, host.size() * 2));
    CK(cudaMemcpy(i.x, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    const int padded = (in + 511) / 512 * 512;
    CK(cudaMalloc(&i.q8_1, (size_t)m * padded / 32 * 36));
    CK(cudaMalloc(&i.codes, (size_t)m * in));
    CK(cudaMalloc(&i.ds, (size_t)m * in / 32 * 8));
    launch_mmvq_gguf_quantize_q8_1_bf16(i.x, i.q8_1, in, padded, m, s);
    const int blocks = m * in / 32;
    q8_split_bf16<<<(blocks + 7) / 8, 256, 0, s>>>(i.x, i.codes, i.ds, blocks);
    CK(cudaStreamSynchronize(s));
    return i;
}

template <typename F>
static float time_us(F launch, int reps, cudaStream_t s) {
    for (int i = 0; i < 10; ++i) launch(i);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) launch(i);
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGetLastError());
    return ms * 1000.f / reps;
}

static float max_rel(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n) {
    std::vector<__nv_bfloat16> ha(n), hb(n);
    CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
    float worst = 0, scale = 0;
    for (size_t i = 0; i < n; ++i) scale = fmaxf(scale, fabsf(__bfloat162float(hb[i])));
    for (size_t i = 0; i < n; ++i)
        worst = fmaxf(worst, fabsf(__bfloat162float(ha[i]) - __bfloat162float(hb[i])));
    return worst / fmaxf(scale, 1e-20f);
}

typedef void (*Ours)(const uint8_t*, const uint8_t*, const uint8_t*, const int8_t*,
                     const float2*, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, int, int,
                     int, int, int);

int main() {
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    const int reps = 400;
    const size_t rotate = 512ull << 20;  // bytes cycled through per variant: past any L2
    struct Shape { const char* name; int out, in; };
    const Shape shapes[] = {{"q/o 4096x4096", 4096, 4096}, {"k/v 1024x4096", 1024, 4096},
                            {"gate/up 14336x4096", 14336, 4096},
                            {"down 4096x14336", 4096, 14336}};
    const Ours variants[] = {ours_u<1>, ours_u<2>, ours_u<4>, ours_u<8>};
    const int us[] = {1, 2, 4, 8};
    for (int m : {1, 2, 4, 8}) {
        for (const Shape& sh : shapes) {
            const size_t bytes = (size_t)sh.out * (sh.in / 256) * BLOCK_BYTES;
            const int copies = (int)((rotate + bytes - 1) / bytes);
            uint8_t* w = make_weights(sh.out, sh.in, copies);
            Input in = make_input(m, sh.in, s);
            __nv_bfloat16 *y_ref, *y;
            CK(cudaMalloc(&y_ref, (size_t)m * sh.out * 2));
            CK(cudaMalloc(&y, (size_t)m * sh.out * 2));
            const int stride_y = (sh.in + 511) / 512 * 16;
            auto at = [&](int i) { return w + bytes * (i % copies); };
            float t_mmvq = time_us([&](int i) {
                launch_mmvq_gguf_q4_k_bf16_plain(at(i), in.q8_1, y_ref, sh.in, sh.out, stride_y,
                                                 sh.out, m, s);
            }, reps, s);
            launch_mmvq_gguf_q4_k_bf16_plain(w, in.q8_1, y_ref, sh.in, sh.out, stride_y, sh.out,
                                             m, s);
            printf("m=%d %-20s mmvq %7.2f us %6.0f GB/s |", m, sh.name, t_mmvq,
                   bytes / t_mmvq / 1e3);
            for (int v = 0; v < 4; ++v) {
                if (m > 1 && v > 0) break;  // more rows take U = 1
                const int grid = (sh.out + 7) / 8;
                float t = time_us([&](int i) {
                    variants[v]<<<grid, 256, 0, s>>>(at(i), at(i), at(i), in.codes, in.ds, y, y,
                                                     y, sh.out, 0, 0, m, sh.in);
                }, reps, s);
                variants[v]<<<grid, 256, 0, s>>>(w, w, w, in.codes, in.ds, y, y, y, sh.out, 0,
                                                 0, m, sh.in);
                CK(cudaStreamSynchronize(s));
                printf(" U=%d %6.2f us %5.0f GB/s (diff %.1e)", us[v], t, bytes / t / 1e3,
                       max_rel(y, y_ref, (size_t)m * sh.out));
            }
            printf("\n");
            CK(cudaFree(w));
            CK(cudaFree(y));
            CK(cudaFree(y_ref));
        }
    }
    const Shape q6[] = {{"v 1024x4096", 1024, 4096}, {"o 4096x4096", 4096, 4096},
                        {"down 4096x14336", 4096, 14336}, {"lm_head 128256x4096", 128256, 4096}};
    for (int m : {1, 8}) {
        for (const Shape& sh : q6) {
            const size_t bytes = (size_t)sh.out * (sh.in / 256) * Q6K_BYTES;
            const int copies = (int)((rotate + bytes - 1) / bytes);
            uint8_t* w = make_q6k(sh.out, sh.in, copies);
            Input in = make_input(m, sh.in, s);
            __nv_bfloat16 *y_ref, *y;
            CK(cudaMalloc(&y_ref, (size_t)m * sh.out * 2));
            CK(cudaMalloc(&y, (size_t)m * sh.out * 2));
            const int stride_y = (sh.in + 511) / 512 * 16;
            auto at = [&](int i) { return w + bytes * (i % copies); };
            float t_mmvq = time_us([&](int i) {
                launch_mmvq_gguf_q6_k_bf16_plain(at(i), in.q8_1, y_ref, sh.in, sh.out, stride_y,
                                                 sh.out, m, s);
            }, reps, s);
            launch_mmvq_gguf_q6_k_bf16_plain(w, in.q8_1, y_ref, sh.in, sh.out, stride_y, sh.out,
                                             m, s);
            printf("Q6_K m=%d %-20s mmvq %7.2f us %6.0f GB/s |", m, sh.name, t_mmvq,
                   bytes / t_mmvq / 1e3);
            const int grid = (sh.out + 7) / 8;
            for (int v = 0; v < 2; ++v) {
                if (m > 1 && v > 0) break;
                auto run = [&](const uint8_t* wp) {
                    if (v == 0) ours_q6k<2><<<grid, 256, 0, s>>>(wp, in.codes, in.ds, y, sh.out, m, sh.in);
                    else ours_q6k<4><<<grid, 256, 0, s>>>(wp, in.codes, in.ds, y, sh.out, m, sh.in);
                };
                float t = time_us([&](int i) { run(at(i)); }, reps, s);
                run(w);
                CK(cudaStreamSynchronize(s));
                printf(" U=%d %6.2f us %5.0f GB/s (diff %.1e)", v == 0 ? 2 : 4, t,
                       bytes / t / 1e3, max_rel(y, y_ref, (size_t)m * sh.out));
            }
            printf("\n");
            CK(cudaFree(w));
            CK(cudaFree(y));
            CK(cudaFree(y_ref));
        }
    }
    // One layer's q/k/v and gate/up at batch 1: a launch per matrix against one for the group.
    for (int g = 0; g < 2; ++g) {
        const int outs[3] = {g == 0 ? 4096 : 14336, g == 0 ? 1024 : 14336, g == 0 ? 1024 : 0};
        size_t bytes[3], total = 0;
        uint8_t* ws[3] = {nullptr, nullptr, nullptr};
        int copies = 0;
        for (int j = 0; j < 3; ++j) total += bytes[j] = (size_t)outs[j] * 16 * BLOCK_BYTES;
        copies = (int)((rotate + total - 1) / total);
        for (int j = 0; j < 3; ++j)
            if (outs[j]) ws[j] = make_weights(outs[j], 4096, copies);
        Input in = make_input(1, 4096, s);
        __nv_bfloat16* y;
        CK(cudaMalloc(&y, 3 * 14336 * 2));
        auto at = [&](int j, int i) { return ws[j] ? ws[j] + bytes[j] * (i % copies) : nullptr; };
        const int n = g == 0 ? 3 : 2;
        float t_each = time_us([&](int i) {
            for (int j = 0; j < n; ++j)
                ours_u<4><<<(outs[j] + 7) / 8, 256, 0, s>>>(at(j, i), 0, 0, in.codes, in.ds, y,
                                                            y, y, outs[j], 0, 0, 1, 4096);
        }, reps, s);
        const int rows = outs[0] + outs[1] + outs[2];
        float t_group = time_us([&](int i) {
            ours_u<4><<<(rows + 7) / 8, 256, 0, s>>>(at(0, i), at(1, i), at(2, i), in.codes,
                                                     in.ds, y, y + 14336, y + 28672, outs[0],
                                                     outs[1], outs[2], 1, 4096);
        }, reps, s);
        float t_mmvq = time_us([&](int i) {
            for (int j = 0; j < n; ++j)
                launch_mmvq_gguf_q4_k_bf16_plain(at(j, i), in.q8_1, y, 4096, outs[j], 16,
                                                 outs[j], 1, s);
        }, reps, s);
        printf("%s: mmvq %d launches %.2f us, ours %d launches %.2f us, one launch %.2f us "
               "(%.0f GB/s)\n", g == 0 ? "q/k/v" : "gate/up", n, t_mmvq, n, t_each, t_group,
               total / t_group / 1e3);
    }
    return 0;
}
