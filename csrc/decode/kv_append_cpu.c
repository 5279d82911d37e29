/* Appending to an NVFP4 KV cache on the CPU, in C (kv_append.h): the same block rule and byte placement as the CUDA
   kernel, one (sequence, KV head) at a time on torch's OpenMP threads. */
#include <string.h>

#include "decode/kv_append.h"

#ifdef _OPENMP
#define AQ_PARALLEL_FOR_SEQUENCES_AND_HEADS _Pragma("omp parallel for collapse(2) schedule(static)")
#else
#define AQ_PARALLEL_FOR_SEQUENCES_AND_HEADS
#endif

static float load_element(const void *base, aq_dtype dtype, int64_t offset) {
    const uint16_t bits = ((const uint16_t *)base)[offset];
    return dtype == AQ_BFLOAT16 ? aq_bf16_to_float(bits) : aq_fp16_to_float(bits);
}

/* Block blk of token t of (b, h) of x, quantized and stored at the K (is_v 0) or V (is_v 1) places of `at`. */
static void append_block(const aq_kv_append_params *p, int is_v, int64_t b, int64_t h, int64_t t, int64_t blk,
                         const aq_kv_block_place *at) {
    const void *x = is_v ? p->v : p->k;
    const int64_t *stride = is_v ? p->v_stride : p->k_stride;
    const int64_t row = b * stride[0] + h * stride[1] + t * stride[2] + blk * AQ_BLOCK;
    float values[AQ_BLOCK];
    for (int i = 0; i < AQ_BLOCK; i++) values[i] = load_element(x, p->dtype, row + i);
    uint32_t packed[2];
    const uint8_t scale = aq_kv_quantize_block(values, packed);
    uint8_t bytes[AQ_BLOCK / 2];
    for (int i = 0; i < AQ_BLOCK / 2; i++) bytes[i] = (uint8_t)(packed[i / 4] >> (8 * (i % 4)));
    if (!is_v) {
        memcpy(p->k_codes + at->k_codes, bytes, sizeof bytes);
        p->k_scales[at->k_scale] = scale;
        return;
    }
    for (int half = 0; half < 4; half++) memcpy(p->v_codes + at->v_codes + 4 * half, bytes + 2 * half, 2);
    p->v_scales[at->v_scale] = scale;
}

const char *aq_kv_cache_append_cpu(const aq_kv_append_params *p) {
    const char *problem = aq_kv_append_sizes_problem(p);
    if (problem) return problem;
    const int64_t blocks = p->head_dim / AQ_BLOCK;
    AQ_PARALLEL_FOR_SEQUENCES_AND_HEADS
    for (int64_t b = 0; b < p->batch; b++) {
        for (int64_t h = 0; h < p->heads_kv; h++) {
            const int64_t count = aq_kv_count(p, b);
            for (int64_t t = 0; t < count; t++) {
                const int64_t pos = p->lengths[b] + t, page = aq_kv_page_of(p, b, pos);
                if (page < 0) continue;
                for (int64_t blk = 0; blk < blocks; blk++) {
                    const aq_kv_block_place at = aq_kv_place(p, page, h, pos % p->page_size, blk);
                    append_block(p, 0, b, h, t, blk, &at);
                    append_block(p, 1, b, h, t, blk, &at);
                }
            }
        }
    }
    for (int64_t b = 0; b < p->batch; b++) p->lengths[b] += aq_kv_count(p, b);
    return NULL;
}
