/* Host helpers of the CUDA launchers (sm80/, sm90/, decode/): SM count, launch errors, operand checks. */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "binding/attn_qat.h"

static inline bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

/* The current device's SM count in *n: the grid of a persistent kernel, the last wave's split (hopper.cuh), the
   causal backward's order of work (work_item_at). */
static inline cudaError_t sm_count(int *n) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    return err != cudaSuccess ? err : cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, dev);
}

/* NULL, or the error of the last kernel launch. */
static inline const char *launch_status(void) {
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}

/* The checks shared by the forward and backward launchers; NULL when the sizes are supported. */
static inline const char *check_attention_sizes(aq_dtype dtype, int64_t head_dim, int64_t batch, int64_t heads_q,
                                                int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k) {
    if (dtype != AQ_BFLOAT16 && dtype != AQ_FLOAT16) return "attention (CUDA): dtype must be bfloat16 or float16";
    if (head_dim != 64 && head_dim != 128) return "attention (CUDA): head_dim must be 64 or 128";
    if (heads_kv <= 0 || heads_q <= 0 || heads_q % heads_kv != 0)
        return "attention (CUDA): heads_q must be a positive multiple of heads_kv";
    if (batch < 0 || heads_q > 65535 || batch > 65535) return "attention (CUDA): batch and heads must be <= 65535";
    if (seqlen_q < 0 || seqlen_k < 0 || seqlen_q > INT32_MAX - 256 || seqlen_k > INT32_MAX - 256)
        return "attention (CUDA): sequence lengths must be in [0, 2^31 - 256]";
    return NULL;
}

/* A tensor can use 16-byte vector access: base 16-byte aligned and strides multiples of 8 elements. */
static inline bool vec_ok(const void *ptr, const int64_t stride[3]) {
    return ptr == NULL || (aligned16(ptr) && stride[0] % 8 == 0 && stride[1] % 8 == 0 && stride[2] % 8 == 0);
}

/* Outputs written 4 bytes at a time from the fragments (store_fragment_rows). */
static inline bool fragment_store_ok(const void *ptr, const int64_t stride[3]) {
    return ptr == NULL || (((uintptr_t)ptr & 3u) == 0 && stride[0] % 2 == 0 && stride[1] % 2 == 0 && stride[2] % 2 == 0);
}
