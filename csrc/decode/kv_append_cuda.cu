/* Appending to an NVFP4 KV cache on the GPU (kv_append.h): one thread per 16-channel block of one new token and KV
   head quantizes that block of K and of V and stores their codes and scales in the page pools, so a decode step's
   append is one launch (and one more that advances the lengths, after every thread has read them). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "decode/kv_append.h"

#define APPEND_THREADS 256

template <typename T> __device__ __forceinline__ float append_to_float(uint16_t bits);
template <> __device__ __forceinline__ float append_to_float<__nv_bfloat16>(uint16_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
}
template <> __device__ __forceinline__ float append_to_float<__half>(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
}

/* The 16 values of one block at x + offset (elements), as floats: two 16-byte loads when VEC, else 16 2-byte ones. */
template <typename T, bool VEC>
__device__ __forceinline__ void load_block(const void *x, int64_t offset, float (&values)[AQ_BLOCK]) {
    const uint16_t *src = (const uint16_t *)x + offset;
    if (VEC) {
        uint4 raw[2];
        raw[0] = ((const uint4 *)src)[0];
        raw[1] = ((const uint4 *)src)[1];
        const uint16_t *bits = (const uint16_t *)raw;
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i++) values[i] = append_to_float<T>(bits[i]);
    } else {
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i++) values[i] = append_to_float<T>(src[i]);
    }
}

/* Grid (blocks of the tokens x 16-channel blocks, KV heads, batch). */
template <typename T, bool VEC>
__global__ void __launch_bounds__(APPEND_THREADS) kv_append_kernel(const __grid_constant__ aq_kv_append_params p) {
    const uint32_t blocks = (uint32_t)(p.head_dim / AQ_BLOCK);
    const uint32_t item = blockIdx.x * APPEND_THREADS + threadIdx.x;
    if (item >= (uint32_t)p.tokens * blocks) return;
    const int64_t t = item / blocks, blk = item % blocks, h = blockIdx.y, b = blockIdx.z;
    if (t >= aq_kv_count(&p, b)) return;
    const int64_t pos = p.lengths[b] + t, page = aq_kv_page_of(&p, b, pos);
    if (page < 0) return;
    const aq_kv_block_place at = aq_kv_place(&p, page, h, pos % p.page_size, blk);
    float values[AQ_BLOCK];
    uint32_t packed[2];

    load_block<T, VEC>(p.k, b * p.k_stride[0] + h * p.k_stride[1] + t * p.k_stride[2] + blk * AQ_BLOCK, values);
    uint8_t scale = aq_kv_quantize_block(values, packed);
    *(uint2 *)(p.k_codes + at.k_codes) = make_uint2(packed[0], packed[1]);
    p.k_scales[at.k_scale] = scale;

    load_block<T, VEC>(p.v, b * p.v_stride[0] + h * p.v_stride[1] + t * p.v_stride[2] + blk * AQ_BLOCK, values);
    scale = aq_kv_quantize_block(values, packed);
#pragma unroll
    for (int half = 0; half < 4; half++) /* the other token of the pair row owns the halves in between */
        *(uint16_t *)(p.v_codes + at.v_codes + 4 * half) = (uint16_t)(packed[half / 2] >> (16 * (half % 2)));
    p.v_scales[at.v_scale] = scale;
}

__global__ void advance_lengths_kernel(const __grid_constant__ aq_kv_append_params p) {
    const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (b < p.batch) p.lengths[b] += aq_kv_count(&p, b);
}

static bool strides_vec_ok(const void *x, const int64_t stride[3]) {
    return ((uintptr_t)x & 15u) == 0 && stride[0] % 8 == 0 && stride[1] % 8 == 0 && stride[2] % 8 == 0;
}

template <typename T>
static void launch_append(const aq_kv_append_params *p, cudaStream_t stream) {
    const int64_t items = p->tokens * (p->head_dim / AQ_BLOCK);
    const dim3 grid((unsigned)((items + APPEND_THREADS - 1) / APPEND_THREADS), (unsigned)p->heads_kv,
                    (unsigned)p->batch);
    if (strides_vec_ok(p->k, p->k_stride) && strides_vec_ok(p->v, p->v_stride))
        kv_append_kernel<T, true><<<grid, APPEND_THREADS, 0, stream>>>(*p);
    else
        kv_append_kernel<T, false><<<grid, APPEND_THREADS, 0, stream>>>(*p);
}

extern "C" const char *aq_kv_cache_append_cuda(const aq_kv_append_params *p, void *stream) {
    const char *problem = aq_kv_append_sizes_problem(p);
    if (problem) return problem;
    if (p->batch == 0) return NULL;
    const void *pools[] = {p->k_codes, p->k_scales, p->v_codes, p->v_scales};
    for (const void *pool : pools)
        if ((uintptr_t)pool & 15u) return "kv_cache_append: the pools must be 16-byte aligned";
    cudaStream_t s = (cudaStream_t)stream;
    (void)cudaGetLastError(); /* an earlier launch's error is not this op's */
    if (p->tokens > 0) {
        if (p->dtype == AQ_BFLOAT16) launch_append<__nv_bfloat16>(p, s);
        else launch_append<__half>(p, s);
        const cudaError_t err = cudaGetLastError(); /* no lengths advance over tokens that were not written */
        if (err != cudaSuccess) return cudaGetErrorString(err);
    }
    advance_lengths_kernel<<<(unsigned)((p->batch + 127) / 128), 128, 0, s>>>(*p);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}
