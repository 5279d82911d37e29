/* Appending tokens to an NVFP4 KV cache (attn_qat.NVFP4KVCache): each new token's K and V quantized along head_dim
   (numerics.md §1, §2) and their codes and scales scattered into the page pools (attn_qat.h, above aq_decode_params,
   has their layout), in one pass; then every sequence's length advanced. The CPU (kv_append_cpu.c) and CUDA
   (kv_append_cuda.cu) kernels share the block rule (format/nvfp4.h) and the byte placement below: both write the bytes
   of nvfp4_quantize(k, 3) and nvfp4_quantize(v, 3) where attn_qat.h places them (tests/test_kv_cache.py compares
   them with a scatter of torch ops). */
#pragma once

#include "attn_qat.h"
#include "format/nvfp4.h"

#ifdef __cplusplus
extern "C" {
#endif

/* k, v: (batch, heads_kv, tokens, head_dim) in dtype, element strides k_stride / v_stride for (batch, head, token),
   channels contiguous. Token t < counts[b] (every token when counts is NULL) of sequence b goes to position
   lengths[b] + t, token (lengths[b] + t) % page_size of page block_table[b][(lengths[b] + t) / page_size]; then
   lengths[b] += counts[b] (or tokens). A position at or past pages_per_seq * page_size, or a page outside
   [0, num_pages), is skipped (the caller allots pages first; nothing outside the pools is written). */
typedef struct {
    const void *k, *v;
    int64_t k_stride[3], v_stride[3];
    const int64_t *counts; /* (batch,) or NULL */
    int64_t *lengths;      /* (batch,), read for the positions, then advanced */
    const int32_t *block_table;
    uint8_t *k_codes, *k_scales, *v_codes, *v_scales;
    int64_t batch, heads_kv, tokens, head_dim;
    int64_t num_pages, page_size, pages_per_seq;
    aq_dtype dtype;
} aq_kv_append_params;

/* The kernels: NULL on success, else what went wrong. */
const char *aq_kv_cache_append_cpu(const aq_kv_append_params *p);
const char *aq_kv_cache_append_cuda(const aq_kv_append_params *p, void *stream);

#ifdef __cplusplus
}
#endif

/* NULL, or what is wrong with the sizes (the binding checks the tensors themselves). */
static inline const char *aq_kv_append_sizes_problem(const aq_kv_append_params *p) {
    if (!aq_attention_dtype_supported(p->dtype)) return "kv_cache_append: keys and values must be bfloat16 or float16";
    if (p->head_dim <= 0 || p->head_dim % AQ_BLOCK) return "kv_cache_append: head_dim must be a multiple of 16";
    if (p->page_size <= 0 || p->page_size % AQ_BLOCK) return "kv_cache_append: page_size must be a multiple of 16";
    if (p->batch < 0 || p->heads_kv <= 0 || p->tokens < 0 || p->num_pages <= 0 || p->pages_per_seq <= 0)
        return "kv_cache_append: sizes must be positive (batch and tokens >= 0)";
    if (p->batch > 65535 || p->heads_kv > 65535) return "kv_cache_append: batch and heads_kv must be <= 65535";
    if (p->tokens * (p->head_dim / AQ_BLOCK) > 0x7FFFFFFF) return "kv_cache_append: too many tokens in one append";
    return NULL;
}

/* Where block `blk` (channels 16 blk .. 16 blk + 15) of one token lands: byte offsets into the four pools. */
typedef struct {
    int64_t k_codes;  /* 8 bytes: channel 2i in the low nibble of byte i, 2i + 1 in the high one */
    int64_t k_scale;  /* 1 byte */
    int64_t v_codes;  /* 4 two-byte halves, 4 bytes apart: the token's code bytes 2j, 2j + 1 at + 4 (j - 4 blk) */
    int64_t v_scale;  /* 1 byte */
} aq_kv_block_place;

/* Token `slot` of page `page`, KV head h: K's row of D/2 code bytes and row of D/16 scale bytes; V's pair row
   slot / 2 holding the 16-bit halves of tokens 2p and 2p + 1 alternately; V's unit row slot / 16 per 16-channel
   block, its tokens in the order 0, 1, 8, 9, 2, 3, 10, 11, ... (token r of the unit at 4 ((r % 8) / 2) + 2 (r / 8)
   + r % 2). */
AQ_HD aq_kv_block_place aq_kv_place(const aq_kv_append_params *p, int64_t page, int64_t h, int64_t slot,
                                    int64_t blk) {
    const int64_t d = p->head_dim, ps = p->page_size, r = slot % AQ_BLOCK;
    const int64_t head = page * p->heads_kv + h;
    aq_kv_block_place at;
    at.k_codes = (head * ps + slot) * (d / 2) + blk * (AQ_BLOCK / 2);
    at.k_scale = (head * ps + slot) * (d / AQ_BLOCK) + blk;
    at.v_codes = (head * (ps / 2) + slot / 2) * d + blk * AQ_BLOCK + 2 * (slot % 2);
    at.v_scale =
        (head * (ps / AQ_BLOCK) + slot / AQ_BLOCK) * d + blk * AQ_BLOCK + 4 * (r % 8 / 2) + 2 * (r / 8) + r % 2;
    return at;
}

/* The tokens sequence b appends: counts[b] (or every token), clamped to [0, tokens]. */
AQ_HD int64_t aq_kv_count(const aq_kv_append_params *p, int64_t b) {
    const int64_t count = p->counts ? p->counts[b] : p->tokens;
    return count < 0 ? 0 : count > p->tokens ? p->tokens : count;
}

/* The pool page of position `pos` of sequence b, or -1 where nothing may be written. */
AQ_HD int64_t aq_kv_page_of(const aq_kv_append_params *p, int64_t b, int64_t pos) {
    if (pos < 0 || pos >= p->pages_per_seq * p->page_size) return -1;
    const int64_t page = p->block_table[b * p->pages_per_seq + pos / p->page_size];
    return page >= 0 && page < p->num_pages ? page : -1;
}

/* One 16-value block quantized (numerics.md §1): its 8 packed code bytes (as two 32-bit words, byte i in bits
   8 (i % 4) of word i / 4) and its E4M3 scale byte, as nvfp4_quantize's kernels write them. */
AQ_HD uint8_t aq_kv_quantize_block(const float *x, uint32_t packed[2]) {
    const float s = aq_block_scale(x, AQ_BLOCK);
    uint8_t codes[AQ_BLOCK];
    aq_block_codes(x, AQ_BLOCK, s, codes);
    packed[0] = packed[1] = 0;
    AQ_UNROLL
    for (int i = 0; i < AQ_BLOCK / 2; i++)
        packed[i / 4] |= (uint32_t)(codes[2 * i] | (codes[2 * i + 1] << 4)) << (8 * (i % 4));
    return aq_e4m3_encode(s);
}

