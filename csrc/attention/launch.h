/* Host helpers of the CUDA launchers (sm80/, sm90/, decode/): launch errors, operand alignment and strides. */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "attn_qat.h"

/* f(std::integral_constant<int, D>()) for a head dim of 64 or 128 (the Hopper and decode kernels', checked before),
   with_dtype f(std::integral_constant<aq_dtype, DT>()) for the call's dtype, and with_head_dim_and_dtype both: where
   the call's sizes become the kernels' template arguments. The mma.sync kernels and the delta kernel take any head
   dims through a tile width (sm80_tile_width). */
template <typename F>
static inline auto with_head_dim(int64_t head_dim, F &&f) {
    return head_dim == 64 ? f(std::integral_constant<int, 64>()) : f(std::integral_constant<int, 128>());
}
template <typename F>
static inline auto with_dtype(aq_dtype dtype, F &&f) {
    return dtype == AQ_BFLOAT16 ? f(std::integral_constant<aq_dtype, AQ_BFLOAT16>())
                                : f(std::integral_constant<aq_dtype, AQ_FLOAT16>());
}

/* The columns of the mma.sync kernels' Q, K, V and dO tiles for a call's head dims: 64, 128 or 256, the smallest that
   holds both (the columns past a head dim are zeros, which add nothing to a product). Their fp32 accumulators (O,
   O', dQ, dK, dV) hold slices of sm80_slice_width(W) columns, a CTA per slice, so that a warp's registers hold
   them at W = 256 as at 128. */
static inline int sm80_tile_width(int64_t head_dim, int64_t head_dim_v) {
    const int64_t d = head_dim > head_dim_v ? head_dim : head_dim_v;
    return d <= 64 ? 64 : d <= 128 ? 128 : 256;
}
static constexpr __host__ __device__ int sm80_slice_width(int tile_width) {
    return tile_width < 128 ? tile_width : 128;
}
/* The column slices (CTAs) that cover `columns` accumulator columns at tile width W: the launchers size their grids
   by it and the kernels split blockIdx by it. */
static constexpr __host__ __device__ int sm80_slices(int columns, int tile_width) {
    return (columns + sm80_slice_width(tile_width) - 1) / sm80_slice_width(tile_width);
}

/* f(std::integral_constant<int, W>(), std::integral_constant<aq_dtype, DT>()) for the call's tile width W. */
template <typename F>
static inline auto with_tile_width_and_dtype(int64_t head_dim, int64_t head_dim_v, aq_dtype dtype, F &&f) {
    auto with_width = [&](auto w) { return with_dtype(dtype, [&](auto dt) { return f(w, dt); }); };
    const int w = sm80_tile_width(head_dim, head_dim_v);
    return w == 64    ? with_width(std::integral_constant<int, 64>())
           : w == 128 ? with_width(std::integral_constant<int, 128>())
                      : with_width(std::integral_constant<int, 256>());
}

template <typename F>
static inline auto with_head_dim_and_dtype(int64_t head_dim, aq_dtype dtype, F &&f) {
    return with_head_dim(head_dim, [&](auto d) { return with_dtype(dtype, [&](auto dt) { return f(d, dt); }); });
}

static inline bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

/* NULL when the current device gives a block `bytes` of shared memory (the mma.sync kernels at a tile width of 256
   ask for up to 137 KB: an A100 or H100 has it, sm_86 and sm_89 GPUs have 99 KB), else why not. */
static inline const char *check_shared_memory(int bytes) {
    int device = 0, most = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
        return "attention (CUDA): cannot read the device's shared memory per block";
    return bytes <= most ? NULL
                         : "attention (CUDA): head dims above 128 need more shared memory per block than this GPU has "
                           "(the mma.sync kernels' backward at a tile width of 256 takes 137 KB: an A100 or H100)";
}

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
