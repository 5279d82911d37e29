/* NVFP4 quantize / fake-quantize / dequantize on the CPU, in C.
   Bit-identical to the CUDA kernels: both apply nvfp4.h's block rule to the same fp32 values. */
#include "attn_qat.h"
#include "format/nvfp4.h"

static float load_element(const void *base, aq_dtype dtype, int64_t offset) {
    switch (dtype) {
    case AQ_FLOAT32: return ((const float *)base)[offset];
    case AQ_BFLOAT16: return aq_bf16_to_float(((const uint16_t *)base)[offset]);
    default: return aq_fp16_to_float(((const uint16_t *)base)[offset]);
    }
}

static void store_element(void *base, aq_dtype dtype, int64_t offset, float value) {
    switch (dtype) {
    case AQ_FLOAT32: ((float *)base)[offset] = value; break;
    case AQ_BFLOAT16: ((uint16_t *)base)[offset] = aq_float_to_bf16(value); break;
    default: ((uint16_t *)base)[offset] = aq_float_to_fp16(value); break;
    }
}

const char *aq_quantize_cpu(const aq_quantize_params *p) {
    const int64_t nblocks = (p->axis_len + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t packed_len = (p->axis_len + 1) / 2;
    const int64_t outer = p->outer[0] * p->outer[1] * p->outer[2];
    for (int64_t o = 0; o < outer; o++) {
        const int64_t base = (o / (p->outer[1] * p->outer[2])) * p->stride_outer[0] +
                             (o / p->outer[2] % p->outer[1]) * p->stride_outer[1] + (o % p->outer[2]) * p->stride_outer[2];
        for (int64_t blk = 0; blk < nblocks; blk++) {
            const int64_t a0 = blk * AQ_BLOCK;
            const int n = (int)(p->axis_len - a0 < AQ_BLOCK ? p->axis_len - a0 : AQ_BLOCK);
            for (int64_t in = 0; in < p->inner; in++) {
                float x[AQ_BLOCK];
                for (int i = 0; i < n; i++)
                    x[i] = load_element(p->x, p->dtype,
                                        base + (a0 + i) * p->stride_axis + in * p->stride_inner);
                const float s = aq_block_scale(x, n);
                if (p->scales) p->scales[(o * nblocks + blk) * p->inner + in] = aq_e4m3_encode(s);
                if (p->codes) {
                    uint8_t codes[AQ_BLOCK];
                    aq_block_codes(x, n, s, codes);
                    for (int i = 0; i < n; i += 2)
                        p->codes[(o * packed_len + (a0 + i) / 2) * p->inner + in] =
                            (uint8_t)(codes[i] | (codes[i + 1] << 4));
                }
                if (p->fake) {
                    aq_block_fake_quantize(x, n, s);
                    for (int i = 0; i < n; i++)
                        store_element(p->fake, p->dtype, (o * p->axis_len + a0 + i) * p->inner + in, x[i]);
                }
            }
        }
    }
    return NULL;
}

const char *aq_dequantize_cpu(const aq_dequantize_params *p) {
    const int64_t nblocks = (p->axis_len + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t packed_len = (p->axis_len + 1) / 2;
    for (int64_t o = 0; o < p->outer; o++)
        for (int64_t a = 0; a < p->axis_len; a++)
            for (int64_t in = 0; in < p->inner; in++) {
                uint8_t byte = p->codes[(o * packed_len + a / 2) * p->inner + in];
                float s = aq_e4m3_decode(p->scales[(o * nblocks + a / AQ_BLOCK) * p->inner + in]);
                store_element(p->out, p->dtype, (o * p->axis_len + a) * p->inner + in,
                              aq_e2m1_value((uint8_t)((a & 1) ? byte >> 4 : byte & 15)) * s);
            }
    return NULL;
}
