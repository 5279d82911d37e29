/* The GPU facts behind P's fp16 path (docs/numerics.md §3, §8), measured on the card this runs on:
     1. cvt.rn.f16.f32(ex2.approx.ftz.f32(x)) against fp16(2^x) (2^x in double, rounded once) for every fp32 x in
        [-25, 11.01]: how often and by how much the kernels' frame values stray from the definition;
     2. the f16x2 steps of the block rule, exhaustively: cvt.rn.satfinite.e4m3x2.f16x2 on every fp16 value, the E2M1
        sequence (max.f16x2, and.b32, fma.rn.f16x2 twice, min.f16x2) on every fp16 y in [0, 8], mul.rn.f16x2 on every
        fp16 w in [0, 2100] times every r = fp16(1 / s) of an E4M3 scale s;
     3. the throughput of MUFU.EX2 (fp32) against ex2.approx.f16x2 (two MUFU.EX2.F16 and a PRMT on sm_90), and of
        the two per-pair sequences a kernel could use for w: fp32 argument -> ex2.f32 -> cvt.rn.f16x2.f32 (the
        definition's), or fp32 argument -> cvt.rn.f16x2.f32 -> ex2.approx.f16x2 (rejected, numerics.md §3).
   Build and run (no Python, no torch; the binary links the CUDA runtime statically):
     nvcc -O3 -arch=sm_90a -std=c++17 -I csrc -o build/p_fp16_gpu_checks dev/p_fp16_gpu_checks.cu
     build/p_fp16_gpu_checks */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "format/nvfp4.h"

#define CHECK(call)                                                                          \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* fp16 value nearest to v >= 0 (ties to even, subnormals, Inf from 65520), from a double: as attention_cpu.c. */
__host__ __device__ double round_double_to_fp16(double v) {
    if (v != v) return v;
    if (v >= 65520.0) return INFINITY;
    if (v < 6.103515625e-05) return rint(v * 16777216.0) / 16777216.0;
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    b += 0x1FFFFFFFFFFull + ((b >> 42) & 1u);
    b &= ~0x3FFFFFFFFFFull;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* 1. counts[0]: inputs, [1]: differ by one fp16 ulp, [2]: differ by more, [3 + k]: differ with x in binade k of |x|
   (2^(k-20) <= |x| < 2^(k-19)), k = 0..24 */
__global__ void ex2_deviation(uint32_t first, uint32_t count, unsigned long long *counts) {
    unsigned long long n = 0, one = 0, more = 0;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
        const float x = __uint_as_float(first + i);
        float e;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x));
        const double got = (double)__half2float(__float2half_rn(e));
        const double want = round_double_to_fp16(exp2((double)x));
        n++;
        if (got != want) {
            int ex;
            frexp(want, &ex);
            const double spacing = ldexp(1.0, ex - 11 < -24 ? -24 : ex - 11);
            if (fabs(got - want) <= spacing) one++;
            else more++;
            const float ax = fabsf(x);
            int k = ax > 0 ? (int)floorf(log2f(ax)) + 20 : 0;
            k = k < 0 ? 0 : k > 24 ? 24 : k;
            atomicAdd(&counts[3 + k], 1ull);
        }
    }
    atomicAdd(&counts[0], n);
    atomicAdd(&counts[1], one);
    atomicAdd(&counts[2], more);
}

/* 2a. cvt.rn.satfinite.e4m3x2.f16x2 of fp16 bits i (both halves) */
__global__ void e4m3_from_f16(uint8_t *out) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536) return;
    const uint32_t pair = i | (i << 16);
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(pair));
    out[i] = (uint8_t)(r & 0xFF);
}

/* 2b. the E2M1 sequence on fp16 bits i (both halves): b = max(y, 1) & 0x7C00; fma(b, 512, y); fma(b, -512, .); min 6 */
__global__ void e2m1_sequence(uint16_t *out) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 65536) return;
    const uint32_t y = i | (i << 16);
    uint32_t r;
    asm("{\n .reg .b32 b, t;\n"
        " max.f16x2 b, %1, %2;\n"
        " and.b32 b, b, 0x7C007C00;\n"
        " fma.rn.f16x2 t, b, %3, %1;\n"
        " fma.rn.f16x2 t, b, %4, t;\n"
        " min.f16x2 %0, t, %5;\n}"
        : "=r"(r) : "r"(y), "r"(0x3C003C00u) /* 1 */, "r"(0x60006000u) /* 512 */, "r"(0xE000E000u) /* -512 */,
          "r"(0x46004600u) /* 6 */);
    out[i] = (uint16_t)(r & 0xFFFF);
}

/* 2c. mul.rn.f16x2 of fp16 bits w (both halves) by r */
__global__ void f16_products(const uint16_t *w, int nw, const uint16_t *r, int nr, uint16_t *out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nw * nr) return;
    const uint32_t a = w[i % nw] * 0x10001u, b = r[i / nw] * 0x10001u;
    uint32_t p;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p) : "r"(a), "r"(b));
    out[i] = (uint16_t)(p >> 16);
}

/* 3. throughput: 8 independent chains a thread */
template <int ITERS>
__global__ void mufu_f32(float *out, float seed) {
    float a[8];
#pragma unroll
    for (int c = 0; c < 8; c++) a[c] = seed + 0.01f * c + 1e-6f * threadIdx.x;
    for (int it = 0; it < ITERS; it++)
#pragma unroll
        for (int c = 0; c < 8; c++) asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(a[c]) : "f"(-a[c]));
    float s = 0;
#pragma unroll
    for (int c = 0; c < 8; c++) s += a[c];
    if (s == 12345.f) out[0] = s;
}

template <int ITERS>
__global__ void mufu_f16x2(float *out, float seed) {
    uint32_t a[8];
#pragma unroll
    for (int c = 0; c < 8; c++) {
        __half2 h = __floats2half2_rn(seed + 0.01f * c, seed - 0.01f * c);
        memcpy(&a[c], &h, 4);
    }
    for (int it = 0; it < ITERS; it++)
#pragma unroll
        for (int c = 0; c < 8; c++)
            asm volatile("{\n .reg .b32 t;\n neg.f16x2 t, %1;\n ex2.approx.f16x2 %0, t;\n}" : "=r"(a[c]) : "r"(a[c]));
    uint32_t s = 0;
#pragma unroll
    for (int c = 0; c < 8; c++) s ^= a[c];
    if (s == 12345u) out[0] = (float)s;
}

/* w for a pair from two fp32 logits u (as the kernels: fma(u, exp_scale, 11 - M)), accumulated by hadd2; the logits
   step on each iteration so that nothing is loop-invariant. RESULT_F16: the definition's order (ex2.f32, then
   cvt to f16x2); else the rejected one (cvt the arguments, then ex2.approx.f16x2). */
template <int ITERS, bool RESULT_F16>
__global__ void pair_sequence(float *out, float seed) {
    float u[8];
    uint32_t acc[4] = {0, 0, 0, 0};
#pragma unroll
    for (int c = 0; c < 8; c++) u[c] = seed + 0.37f * c + 1e-6f * threadIdx.x;
    const float es = 0.1275f, off = -7.0f;
    for (int it = 0; it < ITERS; it++) {
#pragma unroll
        for (int p = 0; p < 4; p++) {
            const float x0 = fmaf(u[2 * p], es, off), x1 = fmaf(u[2 * p + 1], es, off);
            uint32_t w;
            if (RESULT_F16) {
                float e0, e1;
                asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(e0) : "f"(x0));
                asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(e1) : "f"(x1));
                asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(e1), "f"(e0));
            } else {
                uint32_t xh;
                asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(xh) : "f"(x1), "f"(x0));
                asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(w) : "r"(xh));
            }
            asm volatile("add.rn.f16x2 %0, %0, %1;" : "+r"(acc[p]) : "r"(w));
        }
#pragma unroll
        for (int c = 0; c < 8; c++) u[c] -= 0.001f;
    }
    if ((acc[0] ^ acc[1] ^ acc[2] ^ acc[3]) == 12345u) out[0] = 1;
}

template <typename K>
static float time_kernel(K kernel, int blocks, int threads, float *out) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    kernel<<<blocks, threads>>>(out, -0.75f); /* warm up */
    CHECK(cudaEventRecord(a));
    for (int r = 0; r < 5; r++) kernel<<<blocks, threads>>>(out, -0.75f);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms / 5;
}

static float fp16_bits_to_float(uint16_t h) { return aq_fp16_to_float(h); }

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0;
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    printf("device: %s, %d SMs, %.0f MHz\n", prop.name, prop.multiProcessorCount, clock_khz / 1000.0);

    /* 1 */
    unsigned long long *d_counts, counts[28];
    CHECK(cudaMalloc(&d_counts, sizeof counts));
    CHECK(cudaMemset(d_counts, 0, sizeof counts));
    ex2_deviation<<<prop.multiProcessorCount * 8, 256>>>(0x80000000u, 0xC1C80000u - 0x80000000u + 1, d_counts);
    ex2_deviation<<<prop.multiProcessorCount * 8, 256>>>(0x00000000u, 0x41302900u + 1, d_counts);
    CHECK(cudaMemcpy(counts, d_counts, sizeof counts, cudaMemcpyDeviceToHost));
    printf("1. cvt.rn.f16(ex2.approx.ftz.f32(x)) vs fp16(2^x), every fp32 x in [-25, 11.01]: %llu inputs, %llu differ "
           "by one fp16 ulp (%.3e), %llu by more\n   by binade of |x| (2^k <= |x| < 2^(k+1)):",
           counts[0], counts[1], (double)counts[1] / counts[0], counts[2]);
    for (int k = 0; k < 25; k++)
        if (counts[3 + k]) printf(" k=%d:%llu", k - 20, counts[3 + k]);
    printf("\n");

    /* 2a */
    uint8_t *d_e4m3, e4m3[65536];
    CHECK(cudaMalloc(&d_e4m3, 65536));
    e4m3_from_f16<<<256, 256>>>(d_e4m3);
    CHECK(cudaMemcpy(e4m3, d_e4m3, 65536, cudaMemcpyDeviceToHost));
    int bad_e4m3 = 0, checked = 0;
    for (uint32_t i = 0; i < 0x7C00; i++) { /* finite non-negative fp16 */
        const float v = fp16_bits_to_float((uint16_t)i);
        const uint8_t want = aq_e4m3_encode(aq_e4m3_round(v));
        checked++;
        if (e4m3[i] != want) {
            if (bad_e4m3 < 5) printf("   e4m3 of fp16 %g: got %#x want %#x\n", v, e4m3[i], want);
            bad_e4m3++;
        }
    }
    printf("2a. cvt.rn.satfinite.e4m3x2.f16x2 vs RN-even E4M3 (saturating at 448, to 0 at or below 2^-10): %d of %d "
           "finite fp16 >= 0 differ; NaN -> %#x, +Inf -> %#x\n", bad_e4m3, checked, e4m3[0x7E00], e4m3[0x7C00]);

    /* 2b */
    uint16_t *d_q, q[65536];
    CHECK(cudaMalloc(&d_q, 65536 * 2));
    e2m1_sequence<<<256, 256>>>(d_q);
    CHECK(cudaMemcpy(q, d_q, 65536 * 2, cudaMemcpyDeviceToHost));
    int bad_e2m1 = 0, n_e2m1 = 0;
    for (uint32_t i = 0; i < 0x7C00; i++) {
        const float y = fp16_bits_to_float((uint16_t)i);
        if (y > 8.0f) continue;
        n_e2m1++;
        const float want = aq_e2m1_round(fminf(y, 6.0f)), got = fp16_bits_to_float(q[i]);
        if (got != want) {
            if (bad_e2m1 < 5) printf("   e2m1 of %g: got %g want %g\n", y, got, want);
            bad_e2m1++;
        }
    }
    printf("2b. f16x2 E2M1 sequence vs e2m1(min(y, 6)): %d of %d fp16 y in [0, 8] differ; NaN in -> %g\n", bad_e2m1,
           n_e2m1, fp16_bits_to_float(q[0x7E00]));

    /* 2c */
    static uint16_t ws[0x7000], rs[126];
    int nw = 0, nr = 0;
    for (uint32_t i = 0; i < 0x7C00; i++)
        if (fp16_bits_to_float((uint16_t)i) <= 2100.0f) ws[nw++] = (uint16_t)i;
    for (int c = 1; c < 0x7F; c++) rs[nr++] = aq_float_to_fp16(1.0f / aq_e4m3_decode((uint8_t)c));
    uint16_t *d_w, *d_r, *d_p;
    CHECK(cudaMalloc(&d_w, nw * 2));
    CHECK(cudaMalloc(&d_r, nr * 2));
    CHECK(cudaMalloc(&d_p, (size_t)nw * nr * 2));
    CHECK(cudaMemcpy(d_w, ws, nw * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_r, rs, nr * 2, cudaMemcpyHostToDevice));
    f16_products<<<(nw * nr + 255) / 256, 256>>>(d_w, nw, d_r, nr, d_p);
    uint16_t *prod = (uint16_t *)malloc((size_t)nw * nr * 2);
    CHECK(cudaMemcpy(prod, d_p, (size_t)nw * nr * 2, cudaMemcpyDeviceToHost));
    long bad_mul = 0;
    for (long i = 0; i < (long)nw * nr; i++) {
        const float exact = fp16_bits_to_float(ws[i % nw]) * fp16_bits_to_float(rs[i / nw]); /* exact in fp32 */
        if (prod[i] != aq_float_to_fp16(exact)) bad_mul++;
    }
    printf("2c. mul.rn.f16x2 w * r vs fp16(w * r): %ld of %ld differ\n", bad_mul, (long)nw * nr);

    /* 3 */
    float *d_out;
    CHECK(cudaMalloc(&d_out, 4));
    const int blocks = prop.multiProcessorCount * 8, threads = 256;
    constexpr int ITERS = 2048;
    const double elems = (double)blocks * threads * ITERS * 8;
    const double sm_clocks = clock_khz * 1e3 * prop.multiProcessorCount;
    const float t32 = time_kernel(mufu_f32<ITERS>, blocks, threads, d_out);
    const float t16 = time_kernel(mufu_f16x2<ITERS>, blocks, threads, d_out);
    printf("3. ex2.approx.ftz.f32: %.3f ms for %.3g exponentials, %.1f a clock an SM; ex2.approx.f16x2: %.3f ms for "
           "%.3g, %.1f a clock an SM (at the %.0f MHz the device reports)\n",
           t32, elems, elems / (t32 * 1e-3) / sm_clocks, t16, 2 * elems, 2 * elems / (t16 * 1e-3) / sm_clocks,
           clock_khz / 1000.0);
    const float tr = time_kernel(pair_sequence<ITERS, true>, blocks, threads, d_out);
    const float ta = time_kernel(pair_sequence<ITERS, false>, blocks, threads, d_out);
    printf("   per pair, fp32 argument -> w: ex2.f32 x2 + cvt.rn.f16x2.f32 %.3f ms; cvt.rn.f16x2.f32 + "
           "ex2.approx.f16x2 %.3f ms (%.3g pairs each)\n", tr, ta, elems / 2);
    return 0;
}
