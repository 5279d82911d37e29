/* TMA tensor maps (host): how sm90/'s launchers describe the operands and outputs to the Hopper kernels. */
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "attention/launch.h"
#include "sm90/hopper.cuh"

static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn = NULL;
    if (fn == NULL) {
        void *ptr = NULL;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) ==
                cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)ptr;
    }
    return fn;
}

/* A 4-D tensor map over x (B, H, N, D) with boxes of 64 columns x box_rows tokens, 128-byte swizzled; false when
   TMA cannot address the tensor (alignment, strides). */
static bool make_tensor_map(CUtensorMap *map, const void *x, aq_dtype dtype, int64_t batch, int64_t heads,
                            int64_t tokens, int64_t head_dim, const int64_t stride[3], int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == NULL || !aligned16(x)) return false;
    const int64_t sizes[3] = {tokens, heads, batch}, strides[3] = {stride[2], stride[1], stride[0]};
    cuuint64_t dims[4] = {(cuuint64_t)head_dim, 0, 0, 0}, byte_strides[3];
    for (int i = 0; i < 3; i++) {
        /* a dimension of size 1 is never stepped along: any legal stride will do */
        const int64_t st = sizes[i] == 1 ? 8 : strides[i];
        if (st <= 0 || st % 8 != 0 || st >= ((int64_t)1 << 39)) return false;
        dims[i + 1] = (cuuint64_t)sizes[i];
        byte_strides[i] = (cuuint64_t)st * 2;
    }
    const cuuint32_t box[4] = {SM90_PANEL, (cuuint32_t)box_rows, 1, 1}, elem_strides[4] = {1, 1, 1, 1};
    const CUtensorMapDataType type =
        dtype == AQ_BFLOAT16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return encode(map, type, 4, (void *)x, dims, byte_strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
