/* Host helpers of the CUDA launchers (sm80/, sm90/, decode/): launch errors, operand alignment and strides. */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "attn_qat.h"

/* f(std::integral_constant<int, D>()) for a head dim that aq_head_dim_supported accepts (checked before), and
   with_head_dim_and_dtype likewise with the dtype: where the call's sizes become the kernels' template arguments. */
template <typename F>
static inline auto with_head_dim(int64_t head_dim, F &&f) {
    return head_dim == 64 ? f(std::integral_constant<int, 64>()) : f(std::integral_constant<int, 128>());
}

template <typename F>
static inline auto with_head_dim_and_dtype(int64_t head_dim, aq_dtype dtype, F &&f) {
    return with_head_dim(head_dim, [&](auto d) {
        return dtype == AQ_BFLOAT16 ? f(d, std::integral_constant<aq_dtype, AQ_BFLOAT16>())
                                    : f(d, std::integral_constant<aq_dtype, AQ_FLOAT16>());
    });
}

static inline bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

/* NULL, or the error of the last kernel launch. */
static inline const char *launch_status(void) {
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}

/* A tensor can use 16-byte vector access: base 16-byte aligned and strides multiples of 8 elements. */
static inline bool vec_ok(const void *ptr, const int64_t stride[3]) {
    return ptr == NULL || (aligned16(ptr) && stride[0] % 8 == 0 && stride[1] % 8 == 0 && stride[2] % 8 == 0);
}

/* Outputs written 4 bytes at a time from the fragments (store_fragment_rows). */
static inline bool fragment_store_ok(const void *ptr, const int64_t stride[3]) {
    return ptr == NULL || (((uintptr_t)ptr & 3u) == 0 && stride[0] % 2 == 0 && stride[1] % 2 == 0 && stride[2] % 2 == 0);
}
