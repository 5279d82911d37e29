/* Device helpers shared by the attention forward and backward kernels (attention_fwd.cu, attention_bwd.cu):
   mma.sync / ldmatrix wrappers, fragment index maps, padded shared-memory tiles, masking, and the P fake-quant. */
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "attn_qat.h"
#include "nvfp4.h"

#define AQ_THREADS 128            /* 4 warps per CTA in every attention kernel */
#define AQ_SMEM_PAD 8             /* 16-bit elements appended to each shared-memory row: 16 bytes, so the 8 rows
                                     read by one ldmatrix phase start in 8 different bank groups */
#define AQ_LOG2E 1.4426950408889634f
#define AQ_FULL_MASK 0xFFFFFFFFu

#define AQ_D __device__ __forceinline__

/* ------------------------------------------------------------------------------------------------
   Fragment maps of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane >> 2 and
   t = lane & 3:
     A (16 x 16, row-major): reg 0 = row g, cols 2t, 2t+1; reg 1 = row g+8, same cols;
                             reg 2 = row g, cols 2t+8, 2t+9; reg 3 = row g+8, cols 2t+8, 2t+9 (low half = lower col)
     B (16 x 8, "col"):      reg 0 = k 2t, 2t+1 at n = g; reg 1 = k 2t+8, 2t+9 at n = g
     C (16 x 8, fp32):       c[e] at row g + 8 * (e >> 1), col 2t + (e & 1)
   ldmatrix.x4: lane l gives the address of row l & 7 of 8x8 matrix l >> 3; register i receives matrix i, lane l
   holding row l >> 2, cols 2(l & 3), 2(l & 3)+1 (with .trans: rows 2(l & 3), 2(l & 3)+1 of col l >> 2).
   The two address maps below are (row, col) inside a 16 x 16 block of a row-major shared tile.
   Host-callable so a CPU test can check them against the PTX layouts. */

/* "mk": the block holds A as [m][k] (plain ldmatrix gives A regs 0..3), or B as [k][n] (ldmatrix.trans gives
   reg 0, 1 = B regs 0, 1 of n-block 0 (n 0..7) and reg 2, 3 = B regs 0, 1 of n-block 1 (n 8..15)).
   Matrices: (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15). */
AQ_HD int ldsm_row_mk(int lane) { return lane & 15; }
AQ_HD int ldsm_col_mk(int lane) { return (lane >> 4) * 8; }

/* "nk": the block holds B transposed, [n][k] (keys x head dim for S = Q K^T); plain ldmatrix gives reg 0, 1 =
   B regs 0, 1 of n-block 0 (rows 0..7) and reg 2, 3 = B regs 0, 1 of n-block 1 (rows 8..15).
   Matrices: (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15). */
AQ_HD int ldsm_row_nk(int lane) { return (lane & 7) + (lane >> 4) * 8; }
AQ_HD int ldsm_col_nk(int lane) { return ((lane >> 3) & 1) * 8; }

/* Row and column inside the 16 x 8 C fragment of element c[e]. */
AQ_HD int frag_c_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
AQ_HD int frag_c_col(int lane, int e) { return 2 * (lane & 3) + (e & 1); }

/* ------------------------------------------------------------------------------------------------
   Tensor-core and conversion wrappers. DT is AQ_BFLOAT16 or AQ_FLOAT16; 16-bit data travels as uint16_t. */

template <aq_dtype DT>
AQ_D void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (DT == AQ_BFLOAT16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

AQ_D void ldsm_x4(uint32_t r[4], const uint16_t *smem_row) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

AQ_D void ldsm_x4_trans(uint32_t r[4], const uint16_t *smem_row) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* Two fp32 values rounded to nearest even into one register, lo in the low half (the lower column). */
template <aq_dtype DT>
AQ_D uint32_t pack2(float lo, float hi) {
    uint32_t r;
    if constexpr (DT == AQ_BFLOAT16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <aq_dtype DT>
AQ_D float to_float(uint16_t h) {
    if constexpr (DT == AQ_BFLOAT16)
        return __uint_as_float((uint32_t)h << 16);
    else
        return __half2float(__ushort_as_half(h));
}

/* The A fragment (16 rows x 16 k) made of two C fragments side by side: c0 = columns 0..7 and c1 = columns
   8..15 of the same 16 rows. This is how a score tile becomes the left operand of the next product without
   going through shared memory: C's (row g, cols 2t, 2t+1) is exactly A's reg 0, and so on. */
template <aq_dtype DT>
AQ_D void pack_a_from_c(uint32_t a[4], const float c0[4], const float c1[4]) {
    a[0] = pack2<DT>(c0[0], c0[1]);
    a[1] = pack2<DT>(c0[2], c0[3]);
    a[2] = pack2<DT>(c1[0], c1[1]);
    a[3] = pack2<DT>(c1[2], c1[3]);
}

/* ------------------------------------------------------------------------------------------------
   Global <-> padded shared memory. A tile is ROWS x D 16-bit values, row r at smem + r * (D + AQ_SMEM_PAD).
   vec: the global base and every stride are multiples of 16 bytes, so a row chunk of 8 values is one uint4. */

AQ_D uint4 load_chunk8(const uint16_t *src, bool vec) {
    if (vec) return *(const uint4 *)src;
    uint4 v;
    v.x = src[0] | ((uint32_t)src[1] << 16);
    v.y = src[2] | ((uint32_t)src[3] << 16);
    v.z = src[4] | ((uint32_t)src[5] << 16);
    v.w = src[6] | ((uint32_t)src[7] << 16);
    return v;
}

AQ_D void store_chunk8(uint16_t *dst, uint4 v, bool vec) {
    if (vec) {
        *(uint4 *)dst = v;
        return;
    }
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dst[2 * i] = (uint16_t)(w[i] & 0xFFFFu);
        dst[2 * i + 1] = (uint16_t)(w[i] >> 16);
    }
}

/* All AQ_THREADS threads copy global rows [0, valid) (row stride `stride` elements) into the tile and write zeros
   to rows [valid, ROWS): padding keys then give finite scores and V rows of 0, so 0-weighted padding never makes
   a NaN (0 * garbage). Rows >= valid are never read from global memory. */
template <int ROWS, int D>
AQ_D void load_tile(uint16_t *smem, const uint16_t *g, int64_t stride, int valid, bool vec) {
    constexpr int LD = D + AQ_SMEM_PAD, CHUNKS = D / 8;
    static_assert((ROWS * CHUNKS) % AQ_THREADS == 0, "tile chunks must split evenly over the CTA");
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / AQ_THREADS; i++) {
        const int c = (int)threadIdx.x + i * AQ_THREADS, r = c / CHUNKS, col = (c % CHUNKS) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < valid) v = load_chunk8(g + r * stride + col, vec);
        *(uint4 *)(smem + r * LD + col) = v;
    }
}

/* One warp writes its 16 x D fp32 accumulator (C fragments acc[n] = columns 8n .. 8n+7) as DT to global rows
   [0, valid), staged through `stage` (the warp's own 16 rows of a padded tile that no other warp reads any
   more) so the global writes are whole 16-byte chunks of a row. Bank-conflict free: the 32-bit writes of one
   instruction hit word (g * LD / 2 + t) mod 32 = 4g + t, since LD / 2 = 4 mod 32. */
template <int D, aq_dtype DT>
AQ_D void store_warp_rows(const float (&acc)[D / 8][4], uint16_t *stage, uint16_t *g, int64_t stride, int valid,
                          bool vec) {
    constexpr int LD = D + AQ_SMEM_PAD, CHUNKS = D / 8;
    const int lane = (int)threadIdx.x & 31;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        const int col = 8 * n + frag_c_col(lane, 0);
        *(uint32_t *)(stage + frag_c_row(lane, 0) * LD + col) = pack2<DT>(acc[n][0], acc[n][1]);
        *(uint32_t *)(stage + frag_c_row(lane, 2) * LD + col) = pack2<DT>(acc[n][2], acc[n][3]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * CHUNKS / 32; i++) {
        const int c = lane + 32 * i, r = c / CHUNKS, col = (c % CHUNKS) * 8;
        if (r < valid) store_chunk8(g + r * stride + col, *(const uint4 *)(stage + r * LD + col), vec);
    }
    __syncwarp();
}

/* ------------------------------------------------------------------------------------------------
   Scores to the log2 domain (numerics.md §3) with masking, for one (batch, query head). */
typedef struct {
    const float *mask;            /* at (b, h), or NULL */
    int64_t mask_stride_i, mask_stride_j;
    int seqlen_q, seqlen_k, causal;
    int64_t causal_offset;
    float scale;                  /* softmax_scale, for the masked formula */
    float scale_log2;             /* softmax_scale * log2(e), for the unmasked one */
} logit_map;

AQ_D logit_map make_logit_map(const float *mask, const int64_t mask_stride[4], int b, int h, int64_t seqlen_q,
                              int64_t seqlen_k, int causal, int64_t causal_offset, float scale) {
    logit_map lm;
    lm.mask = mask ? mask + b * mask_stride[0] + h * mask_stride[1] : NULL;
    lm.mask_stride_i = mask_stride[2];
    lm.mask_stride_j = mask_stride[3];
    lm.seqlen_q = (int)seqlen_q;
    lm.seqlen_k = (int)seqlen_k;
    lm.causal = causal;
    lm.causal_offset = causal_offset;
    lm.scale = scale;
    lm.scale_log2 = scale * AQ_LOG2E;
    return lm;
}

/* One past the last key that any query row <= last_row sees, in [0, seqlen_k]: later key tiles are skipped. */
AQ_D int causal_key_end(const logit_map *lm, int last_row) {
    if (!lm->causal) return lm->seqlen_k;
    const int64_t end = (int64_t)last_row + lm->causal_offset + 1;
    return (int)(end < 0 ? 0 : end > lm->seqlen_k ? lm->seqlen_k : end);
}

/* The first query row that sees key first_key or a later one, in [0, seqlen_q]: earlier query tiles are skipped. */
AQ_D int causal_query_begin(const logit_map *lm, int first_key) {
    if (!lm->causal) return 0;
    const int64_t begin = (int64_t)first_key - lm->causal_offset;
    return (int)(begin < 0 ? 0 : begin > lm->seqlen_q ? lm->seqlen_q : begin);
}

/* Whether a tile of query rows [i0, i0 + ni) x keys [j0, j0 + nj) needs per-element logit_log2: an additive
   mask, keys past seqlen_k, or a causal cut through it (its first row sees the fewest keys). Rows past seqlen_q
   do not count: their results are discarded (forward) or zeroed by a row flag (backward). */
AQ_D bool tile_needs_mask(const logit_map *lm, int i0, int j0, int nj) {
    return lm->mask != NULL || j0 + nj > lm->seqlen_k ||
           (lm->causal && (int64_t)j0 + nj - 1 > (int64_t)i0 + lm->causal_offset);
}

/* t_ij for the fp32 score s = q_i . k_j, or -inf where key j is invisible to query i. Rows and keys past the
   sequence are invisible, so the mask is only read in bounds. */
AQ_D float logit_log2(const logit_map *lm, float s, int i, int j) {
    const bool visible = i < lm->seqlen_q && j < lm->seqlen_k &&
                         (!lm->causal || (int64_t)j <= (int64_t)i + lm->causal_offset);
    if (!visible) return -INFINITY;
    if (lm->mask) return (s * lm->scale + lm->mask[i * lm->mask_stride_i + j * lm->mask_stride_j]) * AQ_LOG2E;
    return s * lm->scale_log2;
}

/* 2^e for e an integer <= 0 (the step between two integer frames), built from the exponent bits so it is exact;
   0 below 2^-126, and 0 for e = -inf or NaN (old frame -inf: nothing accumulated yet, or already NaN). */
AQ_D float exp2_frame_step(float e) {
    return e >= -126.0f ? __uint_as_float((uint32_t)((int)e + 127) << 23) : 0.0f;
}

/* ------------------------------------------------------------------------------------------------
   NVFP4 fake-quant of P̂ * 2^11 (numerics.md §3) where one 16-key block is spread over several lanes. */

/* The block rule of nvfp4.h (aq_quantize_block then aq_fake_quantize_block) for the n values of a block that
   this lane holds, once amax_bits (max |x| as integers, NaN > Inf > finite) is known for the whole block. */
AQ_HD void fake_quantize_with_amax(float *x, int n, uint32_t amax_bits) {
    const float s = aq_block_scale_from_amax_bits(amax_bits);
    const float r = aq_rcp_rn(s);
#pragma unroll
    for (int i = 0; i < n; i++) {
        const uint8_t code = s > 0.0f ? aq_e2m1_code(aq_mul_rn(x[i], r)) : 0;
        x[i] = aq_e2m1_value(code) * s;
    }
}

AQ_HD uint32_t abs_bits_max(uint32_t amax_bits, float x) {
    const uint32_t a = aq_float_bits(x) & 0x7FFFFFFFu;
    return a > amax_bits ? a : amax_bits;
}

/* Query rows in C-fragment rows (forward, dQ): one row's 16-key block is two adjacent n-blocks, held by the 4
   lanes of a quad (lanes 4g .. 4g+3), 4 values each (keys 2t, 2t+1, 2t+8, 2t+9). */
AQ_D void fake_quantize_quad_block(float x[4]) {
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) amax = abs_bits_max(amax, x[i]);
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 1));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 2));
    fake_quantize_with_amax(x, 4, amax);
}

/* Keys in C-fragment rows (dK/dV kernel, S^T = K Q^T): a warp's 16 keys are one block of every query column;
   that column's values sit in the 8 lanes sharing lane & 3, two each (key rows g and g+8). */
AQ_D void fake_quantize_column_block(float x[2]) {
    uint32_t amax = abs_bits_max(abs_bits_max(0, x[0]), x[1]);
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 4));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 8));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 16));
    fake_quantize_with_amax(x, 2, amax);
}

/* ------------------------------------------------------------------------------------------------
   Launcher helpers. */

AQ_HD bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

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
