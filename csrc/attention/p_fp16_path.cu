/* The op p_fp16_path on the GPU: the kernels' own device functions for P's fp16 path (numerics.md §3), run on given
   exponent arguments, so that tests can hold them to attn_qat.reference bit for bit (tests/test_p_fp16.py). */
#include "binding/attn_qat.h"
#include "attention/softmax.cuh"

/* One thread a block of 16 entries of a row (blocks from each row's index 0, the last one possibly shorter):
   w = p_frame_value(x) (fp16(2^x), as p_hat<true> forms it from its fma), P̂ = w * 2^-11, the block's amax as the
   max of the P̂ bits, p_block_scale and p_fake_quantize_element, which give w_fq = P^F * 2^11 with the scale s. */
__global__ void p_fp16_path_kernel(const float *x, int64_t rows, int64_t n, float *w, float *w_fq) {
    const int64_t blocks_per_row = (n + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t blk = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= rows * blocks_per_row) return;
    const int64_t row = blk / blocks_per_row, j0 = (blk % blocks_per_row) * AQ_BLOCK;
    const int count = (int)min((int64_t)AQ_BLOCK, n - j0);
    const int64_t base = row * n + j0;
    float p[AQ_BLOCK];
    uint32_t amax = 0;
#pragma unroll
    for (int e = 0; e < AQ_BLOCK; e++) {
        p[e] = e < count ? p_frame_value(x[base + e]) * AQ_P_HEADROOM_INV : 0.0f;
        amax = max(amax, __float_as_uint(p[e]));
    }
    float s, s_pf, r;
    p_block_scale(amax, &s, &s_pf, &r);
#pragma unroll
    for (int e = 0; e < AQ_BLOCK; e++)
        if (e < count) {
            w[base + e] = p[e] * AQ_P_HEADROOM;
            w_fq[base + e] = p_fake_quantize_element(p[e], s, r);
        }
}

const char *aq_p_fp16_path_cuda(const float *x, int64_t rows, int64_t n, float *w, float *w_fq, void *stream) {
    if (rows < 0 || n < 0) return "p_fp16_path: negative size";
    const int64_t blocks = rows * ((n + AQ_BLOCK - 1) / AQ_BLOCK);
    if (blocks == 0) return NULL;
    const int threads = 128;
    p_fp16_path_kernel<<<(unsigned)((blocks + threads - 1) / threads), threads, 0, (cudaStream_t)stream>>>(x, rows, n,
                                                                                                          w, w_fq);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}
