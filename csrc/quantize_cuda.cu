/* NVFP4 quantize / fake-quantize / dequantize on the GPU: one thread per 16-element block.
   Memory-bound; the block rule itself is nvfp4.h's, shared with the CPU kernels. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attn_qat.h"
#include "nvfp4.h"

// ----------------------------------------------------------------------------------------------
// CUDA kernels

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// x viewed as (outer[0..2], axis_len, inner) with any strides, outer = their product; codes (outer, ceil(axis_len/2), inner),
// scales (outer, ceil(axis_len/16), inner), fake (outer, axis_len, inner), all contiguous.
// One thread per (outer, block, inner), inner fastest so that neighbouring threads read neighbours
// when the blocked axis is not the innermost one (V blocked along tokens).
// VEC: the blocked axis is innermost and contiguous, axis_len % 16 == 0 and everything 16-byte
// aligned, so a thread reads its block with 16-byte loads and writes its 8 code bytes at once.
template <typename T, bool VEC>
__global__ void quantize_kernel(aq_quantize_params p) {
    const int64_t nblocks = (p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t packed_len = (p.axis_len + 1) / 2;
    const int64_t total = p.outer[0] * p.outer[1] * p.outer[2] * nblocks * p.inner;
    const T *x = (const T *)p.x;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t in = idx % p.inner, blk = (idx / p.inner) % nblocks, o = idx / (p.inner * nblocks);
        const int64_t a0 = blk * AQ_BLOCK;
        const int n = (int)min((int64_t)AQ_BLOCK, p.axis_len - a0);
        const int64_t base = (o / (p.outer[1] * p.outer[2])) * p.stride_outer[0] +
                             (o / p.outer[2] % p.outer[1]) * p.stride_outer[1] + (o % p.outer[2]) * p.stride_outer[2];
        float v[AQ_BLOCK];
        uint8_t codes[AQ_BLOCK];
        if (VEC) {
            constexpr int per_vec = 16 / sizeof(T);
            const uint4 *src = (const uint4 *)(x + base + a0);
#pragma unroll
            for (int c = 0; c < AQ_BLOCK / per_vec; c++) {
                uint4 raw = __ldg(src + c);
                const T *e = (const T *)&raw;
#pragma unroll
                for (int i = 0; i < per_vec; i++) v[c * per_vec + i] = to_float<T>(e[i]);
            }
        } else {
            const T *src = x + base + a0 * p.stride_axis + in * p.stride_inner;
#pragma unroll
            for (int i = 0; i < AQ_BLOCK; i++) v[i] = i < n ? to_float<T>(src[i * p.stride_axis]) : 0.0f;
        }
        const float s = aq_quantize_block(v, n, codes);
        if (p.scales) p.scales[(o * nblocks + blk) * p.inner + in] = aq_e4m3_encode(s);
        if (p.codes) {
            uint8_t *dst = p.codes + (o * packed_len + a0 / 2) * p.inner;
            if (VEC) {
                uint2 packed;
                uint8_t *b = (uint8_t *)&packed;
#pragma unroll
                for (int i = 0; i < 8; i++) b[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
                *(uint2 *)dst = packed;
            } else {
#pragma unroll
                for (int i = 0; i < AQ_BLOCK; i += 2)
                    if (i < n) dst[(i / 2) * p.inner + in] = (uint8_t)(codes[i] | (codes[i + 1] << 4));
            }
        }
        if (p.fake) {
            T *dst = (T *)p.fake + (o * p.axis_len + a0) * p.inner + in;
            if (VEC) {
                constexpr int per_vec = 16 / sizeof(T);
#pragma unroll
                for (int c = 0; c < AQ_BLOCK / per_vec; c++) {
                    uint4 raw;
                    T *e = (T *)&raw;
#pragma unroll
                    for (int i = 0; i < per_vec; i++) e[i] = from_float<T>(aq_e2m1_value(codes[c * per_vec + i]) * s);
                    ((uint4 *)dst)[c] = raw;
                }
            } else {
#pragma unroll
                for (int i = 0; i < AQ_BLOCK; i++)
                    if (i < n) dst[i * p.inner] = from_float<T>(aq_e2m1_value(codes[i]) * s);
            }
        }
    }
}

// codes, scales as above -> out (outer, axis_len, inner) contiguous; one thread per element.
template <typename T>
__global__ void dequantize_kernel(aq_dequantize_params p) {
    const int64_t nblocks = (p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t packed_len = (p.axis_len + 1) / 2;
    const int64_t total = p.outer * p.axis_len * p.inner;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t in = idx % p.inner, a = (idx / p.inner) % p.axis_len, o = idx / (p.inner * p.axis_len);
        const uint8_t byte = p.codes[(o * packed_len + a / 2) * p.inner + in];
        const float s = aq_e4m3_decode(p.scales[(o * nblocks + a / AQ_BLOCK) * p.inner + in]);
        ((T *)p.out)[idx] = from_float<T>(aq_e2m1_value((uint8_t)((a & 1) ? byte >> 4 : byte & 15)) * s);
    }
}

// ----------------------------------------------------------------------------------------------
// kernel launchers

static int grid_for(int64_t work, int threads) {
    int64_t blocks = (work + threads - 1) / threads;
    const int64_t cap = 132 * 16; // enough resident blocks to fill an H100; the kernels stride past it
    return (int)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

template <typename T>
static void launch_quantize(const aq_quantize_params *p, cudaStream_t stream) {
    const int threads = 256;
    const int64_t work = p->outer[0] * p->outer[1] * p->outer[2] * ((p->axis_len + AQ_BLOCK - 1) / AQ_BLOCK) * p->inner;
    bool vec = p->inner == 1 && p->stride_axis == 1 && p->axis_len % AQ_BLOCK == 0 && (uintptr_t)p->x % 16 == 0 &&
               (uintptr_t)p->codes % 8 == 0 && (uintptr_t)p->fake % 16 == 0;
    for (int i = 0; i < 3; i++) vec = vec && (p->stride_outer[i] * (int64_t)sizeof(T)) % 16 == 0;
    if (vec) quantize_kernel<T, true><<<grid_for(work, threads), threads, 0, stream>>>(*p);
    else quantize_kernel<T, false><<<grid_for(work, threads), threads, 0, stream>>>(*p);
}

extern "C" const char *aq_quantize_cuda(const aq_quantize_params *p, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (p->outer[0] * p->outer[1] * p->outer[2] * p->axis_len * p->inner == 0) return NULL;
    switch (p->dtype) {
    case AQ_FLOAT32: launch_quantize<float>(p, s); break;
    case AQ_BFLOAT16: launch_quantize<__nv_bfloat16>(p, s); break;
    case AQ_FLOAT16: launch_quantize<__half>(p, s); break;
    }
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}

extern "C" const char *aq_dequantize_cuda(const aq_dequantize_params *p, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t work = p->outer * p->axis_len * p->inner;
    if (work == 0) return NULL;
    const int threads = 256;
    switch (p->dtype) {
    case AQ_FLOAT32: dequantize_kernel<float><<<grid_for(work, threads), threads, 0, s>>>(*p); break;
    case AQ_BFLOAT16: dequantize_kernel<__nv_bfloat16><<<grid_for(work, threads), threads, 0, s>>>(*p); break;
    case AQ_FLOAT16: dequantize_kernel<__half><<<grid_for(work, threads), threads, 0, s>>>(*p); break;
    }
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}
