/* Device helpers shared by every attention kernel (sm80/, sm90/ through hopper.cuh, decode/): mma.sync / ldmatrix
   wrappers, fragment index maps, padded shared-memory tiles, masking and spans, the work order, and the P fake-quant. */
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "binding/attn_qat.h"
#include "format/nvfp4.h"

#define AQ_THREADS 128            /* 4 warps per CTA in every attention kernel */
#define AQ_SMEM_PAD 8             /* 16-bit elements appended to each shared-memory row: 16 bytes, so the 8 rows
                                     read by one ldmatrix phase start in 8 different bank groups */
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

/* Whether any of the 8 values of a chunk is Inf or NaN (all exponent bits set). Per 32-bit word: the masked
   exponent of each half plus one unit of it reaches bit 15 only when the exponent was all ones, and no carry
   crosses the halves. */
template <aq_dtype DT>
AQ_D bool chunk8_nonfinite(uint4 v) {
    constexpr uint32_t EXP = DT == AQ_BFLOAT16 ? 0x7F807F80u : 0x7C007C00u;
    constexpr uint32_t ONE = DT == AQ_BFLOAT16 ? 0x00800080u : 0x04000400u;
    return (((v.x & EXP) + ONE) | ((v.y & EXP) + ONE) | ((v.z & EXP) + ONE) | ((v.w & EXP) + ONE)) & 0x80008000u;
}

/* All AQ_THREADS threads copy global rows [0, valid) (row stride `stride` elements) into the tile and write zeros
   to rows [valid, ROWS): padding keys then give finite scores and V rows of 0, so 0-weighted padding never makes
   a NaN (0 * garbage). Rows >= valid are never read from global memory. Returns whether this thread loaded an
   Inf or NaN (for the tiles that may need scrub_nonfinite_tile). */
template <int ROWS, int D, aq_dtype DT>
AQ_D bool load_tile(uint16_t *smem, const uint16_t *g, int64_t stride, int valid, bool vec) {
    constexpr int LD = D + AQ_SMEM_PAD, CHUNKS = D / 8;
    static_assert((ROWS * CHUNKS) % AQ_THREADS == 0, "tile chunks must split evenly over the CTA");
    bool nonfinite = false;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / AQ_THREADS; i++) {
        const int c = (int)threadIdx.x + i * AQ_THREADS, r = c / CHUNKS, col = (c % CHUNKS) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < valid) v = load_chunk8(g + r * stride + col, vec);
        nonfinite |= chunk8_nonfinite<DT>(v);
        *(uint4 *)(smem + r * LD + col) = v;
    }
    return nonfinite;
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

/* A warp's 16 x D fp32 C fragments (acc[n] = columns 8n .. 8n+7) written as DT straight from registers to global
   rows [0, valid), 4 bytes per store (the quad of a row fills 16 contiguous bytes): base 4-byte aligned, stride
   even. */
template <int D, aq_dtype DT>
AQ_D void store_fragment_rows(const float (&acc)[D / 8][4], uint16_t *g, int64_t stride, int valid) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = frag_c_row(lane, 2 * r);
        if (row >= valid) continue;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *(uint32_t *)(g + row * stride + 8 * n + frag_c_col(lane, 0)) = pack2<DT>(acc[n][2 * r], acc[n][2 * r + 1]);
    }
}

/* ------------------------------------------------------------------------------------------------
   Scores to the log2 domain (numerics.md §3) with masking, for one (batch, query head).

   The kernels carry logits u with t = u * exp_scale and evaluate P̂ = 2^(t - M) as ex2(fma(u, exp_scale, -M)), so
   without an additive mask the scaling rides in the exp's fma instead of a multiply per element: u is the raw
   score q.k and exp_scale = scale * log2(e), and the frame M = ceil(max u * exp_scale) is the same as ceil(max t),
   since rounding is monotonic and the scale is > 0 (the ops reject others: the Python entry points flip q's sign
   for a negative scale, and a zero one would turn a hidden key's -inf into NaN). With an additive mask, u = t and
   exp_scale = 1. An unchecked step (no hidden key, hence no additive mask) takes u = s as it comes.

   Which keys a query sees (attn_qat.h) is decided here and nowhere else, as spans: query row i sees the keys
   [lo, hi) of query_key_span(i), less those an additive mask sets to -inf, and key j is seen by the queries of
   key_query_span(j) (the same relation from the key's side). Dense attention's span is every key in range up to the
   causal limit; packed sequences (q_span, k_span) read theirs from the tables attn_qat/varlen.py built. The kernels
   take the two spans of a thread's C-fragment rows once per checked step (query_row_spans, key_row_spans; the
   forwards keep theirs in shared memory, store_warp_row_spans), test each term against its row's span, and take
   their tile ranges from the spans of a run of rows' first and last (the columns of the tables are non-decreasing). */
typedef struct {
    const float *mask;            /* at (b, h), or NULL */
    int64_t mask_stride_i, mask_stride_j;
    int seqlen_q, seqlen_k, causal;
    int64_t causal_offset;
    float scale;                  /* softmax_scale, for the masked formula */
    float exp_scale;              /* t = u * exp_scale (above) */
    const int2 *q_span, *k_span;  /* packed sequences (attn_qat.h), or NULL */
} logit_map;

AQ_D logit_map make_logit_map(const float *mask, const int64_t mask_stride[4], int b, int h, int64_t seqlen_q,
                              int64_t seqlen_k, int causal, int64_t causal_offset, float scale, const int32_t *q_span,
                              const int32_t *k_span) {
    logit_map lm;
    lm.q_span = (const int2 *)q_span;
    lm.k_span = (const int2 *)k_span;
    lm.mask = mask ? mask + b * mask_stride[0] + h * mask_stride[1] : NULL;
    lm.mask_stride_i = mask_stride[2];
    lm.mask_stride_j = mask_stride[3];
    lm.seqlen_q = (int)seqlen_q;
    lm.seqlen_k = (int)seqlen_k;
    lm.causal = causal;
    lm.causal_offset = causal_offset;
    lm.scale = scale;
    lm.exp_scale = mask ? 1.0f : scale * AQ_LOG2E;
    return lm;
}

AQ_HD int clamp_span_end(int64_t x, int n) { return (int)(x < 0 ? 0 : x > n ? n : x); }

/* A span [x, y) read from a packed table, clamped into [0, n] with x <= y: whatever a table says, nothing outside the
   tensors is read. */
AQ_D int2 clamped_span(int2 s, int n) {
    const int hi = clamp_span_end(s.y, n);
    return make_int2(min(max(s.x, 0), hi), hi);
}

/* The keys [x, y) that query row i sees (before the additive mask); empty for rows past seqlen_q. */
AQ_D int2 query_key_span(const logit_map *lm, int i) {
    if (i >= lm->seqlen_q) return make_int2(0, 0);
    if (lm->q_span != NULL) return clamped_span(lm->q_span[i], lm->seqlen_k);
    return make_int2(0, lm->causal ? clamp_span_end((int64_t)i + lm->causal_offset + 1, lm->seqlen_k) : lm->seqlen_k);
}

/* The queries [x, y) that see key j (before the additive mask); empty for keys past seqlen_k. */
AQ_D int2 key_query_span(const logit_map *lm, int j) {
    if (j >= lm->seqlen_k) return make_int2(0, 0);
    if (lm->k_span != NULL) return clamped_span(lm->k_span[j], lm->seqlen_q);
    return make_int2(lm->causal ? clamp_span_end((int64_t)j - lm->causal_offset, lm->seqlen_q) : 0, lm->seqlen_q);
}

/* The keys [x, y) that any query of rows [i0, i_end) sees (i_end <= seqlen_q; empty when i_end <= i0): key tiles
   outside are skipped. Spans only grow along the rows, so these are the first row's start and the last row's end. */
AQ_D int2 query_rows_key_range(const logit_map *lm, int i0, int i_end) {
    if (i_end <= i0) return make_int2(0, 0);
    const int lo = lm->q_span != NULL ? query_key_span(lm, i0).x : 0;
    return make_int2(lo, max(lo, query_key_span(lm, i_end - 1).y));
}

/* The queries [x, y) that see any key of [j0, j_end) (j_end <= seqlen_k): query tiles outside are skipped. */
AQ_D int2 key_rows_query_range(const logit_map *lm, int j0, int j_end) {
    if (j_end <= j0) return make_int2(0, 0);
    const int lo = key_query_span(lm, j0).x;
    return make_int2(lo, max(lo, lm->k_span != NULL ? key_query_span(lm, j_end - 1).y : lm->seqlen_q));
}

typedef struct {
    int tile, h, b;
} work_item;

/* The backward kernels' work items: tile w.tile (the dK/dV kernel's key tile, or the dQ kernel's query tile) of head
   w.h and batch entry w.b, for block t of a 1-D grid of n_tiles x heads x batch. Blocks start in index order. By
   default each head's tiles go side by side (they read the same Q and dO, or K and V, from L2), and under a causal
   mask the longest first (the first key tile, or the last query tile: last_longest). But then each head's longest
   item comes once more near the end, and when the grid is short (under ~13 waves of `sms` items) and the items long
   (grouped heads: a dK/dV item covers the group's query heads), the last wave holds long items: the Qwen causal
   backward (4 x 8 KV heads, 4096 tokens) was 14% over its mean in a list-scheduling model (a CTA an SM). There
   the tiles go longest first across chunks of consecutive heads (h + heads b) of about two waves of items. H200,
   backward, attn_qat (bf16 mode) ms, head-major -> chunks: (4, 32/8 heads, 4096) 3.99 -> 3.68 (3.41 -> 3.22);
   (2, 32/8, 8192) 7.02 -> 6.62 (6.12 -> 5.83); (1, 32/8, 16384) 12.3 -> 12.4 (11.2 -> 11.3). On a long grid
   the model gains less and L2 loses more (more heads in flight): (8, 16, 4096) MHA 3.90 -> 4.03, so grids over
   13 waves keep head-major order. The forward keeps it too: a short item at the end moves it 1-3% (model), and
   this index arithmetic held across its loop made the quantized forward spill. */
AQ_D work_item work_item_at(int t, int n_tiles, int heads, int batch, int causal, bool last_longest, int sms) {
    const int n_hb = heads * batch;
    int tile, hb;
    if (causal && n_hb * n_tiles <= 13 * sms) {
        const int want = (2 * sms + n_tiles - 1) / n_tiles, n_chunks = (n_hb + want - 1) / want;
        const int chunk = (n_hb + n_chunks - 1) / n_chunks; /* equal chunks, the last up to n_chunks - 1 smaller */
        const int first = t / (chunk * n_tiles) * chunk, r = t - first * n_tiles, size = min(chunk, n_hb - first);
        tile = r / size, hb = first + r % size;
    } else {
        tile = t % n_tiles, hb = t / n_tiles;
    }
    work_item w;
    w.tile = causal && last_longest ? n_tiles - 1 - tile : tile;
    w.h = hb % heads, w.b = hb / heads;
    return w;
}

/* The keys [x, y) that every row of [i0, i0 + ni) sees (before the mask; rows past seqlen_q do not count: their
   results are discarded or zeroed by a row flag); empty (x >= y) when some row sees none. Dense: every key up to the
   first row's causal limit (it sees the fewest); packed: spans grow along the rows, so from the last row's start to
   the first row's end. Taken once per run of rows, so that tile_needs_mask is two compares a tile. */
AQ_D int2 rows_common_keys(const logit_map *lm, int i0, int ni) {
    const int i_last = min(i0 + ni, lm->seqlen_q) - 1;
    if (i_last < i0) return make_int2(0, 0);
    return make_int2(lm->q_span != NULL ? query_key_span(lm, i_last).x : 0, query_key_span(lm, i0).y);
}

/* Whether a tile of keys [j0, j0 + nj) of those rows needs per-element visibility: an additive mask, keys past
   seqlen_k, or a key that some row does not see. Otherwise every key is visible to every row. */
AQ_D bool tile_needs_mask(const logit_map *lm, int2 common, int j0, int nj) {
    return lm->mask != NULL || j0 < common.x || j0 + nj > common.y;
}

AQ_D float mask_at(const logit_map *lm, int i, int j) {
    return lm->mask[i * lm->mask_stride_i + j * lm->mask_stride_j];
}

/* The spans of the thread's two C-fragment rows (r = 0: row g, r = 1: row g + 8, from row_base): the keys of query
   rows (forward, dQ) or the queries of key rows (dK/dV). */
AQ_D void query_row_spans(const logit_map *lm, int row_base, int2 span[2]) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; r++) span[r] = query_key_span(lm, row_base + frag_c_row(lane, 2 * r));
}

AQ_D void key_row_spans(const logit_map *lm, int key_base, int2 span[2]) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; r++) span[r] = key_query_span(lm, key_base + frag_c_row(lane, 2 * r));
}

AQ_D bool in_span(int2 span, int x) { return (x >= span.x) & (x < span.y); }

/* For the fp32 score s = q_i . k_j, where `span` is the span of the term's row and `col` its column (key j of a query
   row, or query i of a key row): whether key j is visible to query i (in the span, and not masked with -inf), and the
   logit u_ij in *u (logit_map: t_ij = u_ij * exp_scale), or -inf for a hidden key (whose score, even NaN, is never
   used). Visibility is apart from the score: a visible key whose score is -inf or NaN is not a hidden one. GENERAL:
   an additive mask may be present (read only at visible positions); else the same result without a branch, so
   that the terms of a masked tile stay straight-line code. */
template <bool GENERAL>
AQ_D bool span_logit(const logit_map *lm, int2 span, int col, float s, int i, int j, float *u) {
    const bool in = in_span(span, col);
    if constexpr (GENERAL) {
        *u = -INFINITY;
        if (!in) return false;
        if (lm->mask == NULL) {
            *u = s;
            return true;
        }
        const float m = mask_at(lm, i, j);
        if (m == -INFINITY) return false;
        *u = (s * lm->scale + m) * AQ_LOG2E;
        return true;
    } else {
        *u = in ? s : -INFINITY;
        return in;
    }
}

/* Whether key j is visible to query i (attn_qat.h). */
AQ_D bool key_visible(const logit_map *lm, int i, int j) {
    float u;
    return span_logit<true>(lm, query_key_span(lm, i), j, 0.0f, i, j, &u);
}

/* The visible keys j0 .. j0+n-1 (n <= 64) of query i, and the visible queries i0 .. i0+n-1 of key j, as bit
   masks; only the rare non-finite path needs them whole. */
AQ_D uint64_t visible_keys_of_query(const logit_map *lm, int i, int j0, int n) {
    const int2 span = query_key_span(lm, i);
    uint64_t bits = 0;
    float u;
    for (int jj = 0; jj < n; jj++) bits |= (uint64_t)span_logit<true>(lm, span, j0 + jj, 0.0f, i, j0 + jj, &u) << jj;
    return bits;
}

AQ_D uint64_t visible_queries_of_key(const logit_map *lm, int j, int i0, int n) {
    const int2 span = key_query_span(lm, j);
    uint64_t bits = 0;
    float u;
    for (int ii = 0; ii < n; ii++) bits |= (uint64_t)span_logit<true>(lm, span, i0 + ii, 0.0f, i0 + ii, j, &u) << ii;
    return bits;
}

/* 2^e for e an integer <= 0 (the step between two integer frames), built from the exponent bits so it is exact;
   0 below 2^-126, and 0 for e = -inf or NaN (old frame -inf: nothing accumulated yet, or already NaN). */
AQ_D float exp2_frame_step(float e) {
    return e >= -126.0f ? __uint_as_float((uint32_t)((int)e + 127) << 23) : 0.0f;
}

/* 2^x for x = t - frame <= 0 (or NaN): the bare MUFU.EX2. exp2f wraps it in a range check and two conditional
   multiplies (4 more instructions an element) only to return subnormal results; here those flush to 0, which
   changes no output: every P̂ that counts is at least 2^-126 of a row maximum that is >= 1/2 (p_hat). */
AQ_D float frame_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* P̂ = 2^(t - frame) for the logit u (t = u * exp_scale, logit_map) as ex2(fma(u, exp_scale, -frame)): one rounding
   of the exponent argument (numerics.md §8), the form every kernel uses, so the backward recomputes the forward's
   P̂. */
AQ_D float p_hat(float u, float exp_scale, float frame) { return frame_exp2(fmaf(u, exp_scale, -frame)); }

/* ------------------------------------------------------------------------------------------------
   NVFP4 fake-quant of P̂ * 2^11 (numerics.md §3). P̂ is >= 0 (or NaN), which makes the block rule cheap; the
   functions below give bit for bit aq_block_fake_quantize's result for such inputs:
   - amax is the max of the values' bits (non-negative floats order like their bits; NaN above all), or, in the
     sm90 forward at D = 128 and the dK/dV kernel's unmasked steps, P̂ at the block's largest logit
     (block_amax_from_logit), where a NaN logit leaves its block's scale finite: that element's P^F is then 6 s,
     not NaN, but its row's l is NaN, and with it the row's O, O' and LSE (forward) and its 1/l-scaled P^F and P
     (dK/dV), as when the whole block was NaN;
   - amax / 6 correctly rounded as x * fl(1/6) plus one fma correction (Markstein; checked for every fp32 x:
     it differs from x / 6 only where x / 6 is subnormal, and such a scale is 0 either way);
   - the E4M3 rounding by the hardware cvt (sm_89+; nvfp4.h's software rounding elsewhere);
   - e2m1(y) for y >= 0 by nvfp4.h's aq_e2m1_round_nonneg_unclamped: y + 2^(22 + max(exponent(y), 0)) rounded once
     (an fma) lands on the E2M1 spacing of y's binade (0.5 below 2, 1 below 4, 2 from 4), ties to even, which is
     the E2M1 tie rule; the offset comes off exactly (fminf saturates at 6 first, or a 16-bit min after);
   - r = fl(2^11 / s) from the approximate reciprocal and one Newton step (exact for E4M3 scales, see below);
   - a zero-scale block uses r = 0, so its y and values are 0; a NaN scale makes every value NaN. */

/* From the bits of the amax of a block of P̂ (unscaled): s, the E4M3 scale of the block of P̂ * 2^11; s_pf = s * 2^-11,
   the scale of P^F itself; and r = fl(2^11 / s) (0 when s = 0), so that x * r for x = P̂ is (x * 2^11) / s rounded
   once: the 2^11 costs no multiply per element. The Markstein steps are those on A = amax * 2^11 scaled by 2^-11,
   which is exact wherever the scale is not 0 (A >= 2^-10, so no intermediate is subnormal). */
AQ_D void p_block_scale(uint32_t amax_bits, float *s, float *s_pf, float *r) {
    const float amax = __uint_as_float(amax_bits), sixth = (1.0f / 6.0f) * AQ_P_HEADROOM; /* 2^11 fl(1/6) */
    const float q0 = __fmul_rn(amax, sixth);
    const float v = __fmaf_rn(__fmaf_rn(-q0, 6.0f * AQ_P_HEADROOM_INV, amax), sixth, q0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;\n" : "=h"(pair) : "f"(v));
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"(pair));
    *s = __half2float(__ushort_as_half((uint16_t)(halves & 0xFFFFu)));
#else
    *s = amax_bits >= 0x7F800000u ? __uint_as_float(0x7FC00000u) : aq_e4m3_round(v);
#endif
    *s_pf = *s * AQ_P_HEADROOM_INV;
    /* 1 / s_pf correctly rounded without __frcp_rn's special-case branch: the approximate reciprocal (within an
       ulp) and one Newton step land within 2^-45 of 1 / s_pf, while 1 / s = 2^-e * 8 / (8 + m) (or 512 / m) is a
       fraction with an odd denominator below 16, at least 2^-29 away from any rounding midpoint; a power of two
       comes out exact. So the rounding is the correct one for every E4M3 scale. */
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r0) : "f"(*s_pf));
    *r = *s == 0.0f ? 0.0f : __fmaf_rn(r0, __fmaf_rn(-*s_pf, r0, 1.0f), r0);
}

/* e2m1(x * r) * s for x >= 0 or NaN. */
AQ_D float p_fake_quantize_element(float x, float s, float r) {
    return __fmul_rn(aq_e2m1_round_nonneg_unclamped(fminf(__fmul_rn(x, r), 6.0f)), s);
}

/* Query rows in C-fragment rows (forward): one row's 16-key block is two adjacent n-blocks, held by the 4 lanes
   of a quad (lanes 4g .. 4g+3), 4 values each (keys 2t, 2t+1, 2t+8, 2t+9). x = P̂ in, P^F * 2^11 out. */
AQ_D void fake_quantize_p_quad(float x[4]) {
    uint32_t amax = max(max(__float_as_uint(x[0]), __float_as_uint(x[1])),
                        max(__float_as_uint(x[2]), __float_as_uint(x[3])));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 1));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 2));
    float s, s_pf, r;
    p_block_scale(amax, &s, &s_pf, &r);
#pragma unroll
    for (int i = 0; i < 4; i++) x[i] = p_fake_quantize_element(x[i], s, r);
}

/* Keys in C-fragment rows (dK/dV kernels, S^T = K Q^T): a warp's 16 keys are one block of every query column, and
   that column's 16 values sit in the 8 lanes sharing lane & 3, two each (key rows g and g+8). x[c][0..1] = P̂ of
   the thread's query column c (of the 4 of one A fragment: c = 2h + e for n-block h, column 2t + e) in, P^F out.
   The 8 lanes of a column set share the work instead of each computing all 4 scales: a reduce-scatter of the 4
   amaxes (lane bits 4 and 3 pick the column a lane keeps, bit 2 lanes finish the same one), one block scale a
   lane, and an all-gather of (s_pf, r): 12 shuffles, as before, but one scale computation instead of four.
   HEADROOM: P^F * 2^11 out instead (the decode kernel's fq16(P̂ * 2^11)). */
template <bool HEADROOM = false>
AQ_D void fake_quantize_p_columns(float (&x)[4][2]) {
    const int lane = (int)threadIdx.x & 31;
    const bool hi4 = lane & 16, hi3 = lane & 8;
    uint32_t a[4];
#pragma unroll
    for (int c = 0; c < 4; c++) a[c] = max(__float_as_uint(x[c][0]), __float_as_uint(x[c][1]));
    uint32_t b[2]; /* columns 2 * hi4 + i */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint32_t keep = hi4 ? a[i + 2] : a[i], send = hi4 ? a[i] : a[i + 2];
        b[i] = max(keep, __shfl_xor_sync(AQ_FULL_MASK, send, 16));
    }
    uint32_t amax = hi3 ? b[1] : b[0]; /* column 2 * hi4 + hi3 */
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, hi3 ? b[0] : b[1], 8));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 4));
    float s, s_pf, r;
    p_block_scale(amax, &s, &s_pf, &r);
#pragma unroll
    for (int c = 0; c < 4; c++) { /* column c's scale from the lanes that kept it */
        const int src = (lane & 7) | (c << 3);
        const float cs = __shfl_sync(AQ_FULL_MASK, HEADROOM ? s : s_pf, src), cr = __shfl_sync(AQ_FULL_MASK, r, src);
        x[c][0] = p_fake_quantize_element(x[c][0], cs, cr);
        x[c][1] = p_fake_quantize_element(x[c][1], cs, cr);
    }
}

/* fq16(P̂ * 2^11) in place for one 16-key block of a warp's 16 rows in C layout (c0 = keys 0..7, c1 = keys 8..15
   of the block): P̂ in, P^F * 2^11 out. Row g's block is c0[0..1], c1[0..1] across the lane quad, row g+8's is
   c0[2..3], c1[2..3]. The results are exact in bf16 and fp16 (6 significant bits, <= 2112). */
AQ_D void fake_quantize_p_block(float c0[4], float c1[4]) {
    float row_g[4] = {c0[0], c0[1], c1[0], c1[1]}, row_g8[4] = {c0[2], c0[3], c1[2], c1[3]};
    fake_quantize_p_quad(row_g);
    fake_quantize_p_quad(row_g8);
    c0[0] = row_g[0], c0[1] = row_g[1], c1[0] = row_g[2], c1[1] = row_g[3];
    c0[2] = row_g8[0], c0[3] = row_g8[1], c1[2] = row_g8[2], c1[3] = row_g8[3];
}

/* e2m1(x * r) for x >= 0 or NaN, as p_fake_quantize_element but neither clamped at 6 nor scaled
   (aq_e2m1_round_nonneg_unclamped; y <= 2^20 here: x <= 1, r <= 2^20): p_round_block_pair's part, whose other half
   (pack_quantized_p_pair) clamps and scales two values at once in 16-bit pairs. */
AQ_D float p_round_element(float x, float r) { return aq_e2m1_round_nonneg_unclamped(__fmul_rn(x, r)); }

/* min(q, 6) * s on a 16-bit pair (DT), both exact: q is an E2M1 grid value or a larger power-of-two multiple of one
   (at most 2 significant bits), s an E4M3 value (4), so the product has at most 6 significant bits and lies within
   [2^-10, 2688]. One min and one multiply for two elements, where fp32 took two of each; a NaN s (non-finite block)
   makes both NaN. */
template <aq_dtype DT>
AQ_D uint32_t clamp_scale_pair(uint32_t q, uint32_t s2) {
    uint32_t r;
    if constexpr (DT == AQ_BFLOAT16)
        asm("{\n .reg .b32 t;\n min.bf16x2 t, %1, %3;\n mul.rn.bf16x2 %0, t, %2;\n}\n"
            : "=r"(r) : "r"(q), "r"(s2), "r"(0x40C040C0u));
    else
        asm("{\n .reg .b32 t;\n min.f16x2 t, %1, %3;\n mul.rn.f16x2 %0, t, %2;\n}\n"
            : "=r"(r) : "r"(q), "r"(s2), "r"(0x46004600u));
    return r;
}

/* The larger of two values: logits (fmaxf, which skips a NaN), or the bits of non-negative floats (P̂), which order
   like the values, with NaN above all. */
AQ_D float max_of(float a, float b) { return fmaxf(a, b); }
AQ_D uint32_t max_of(uint32_t a, uint32_t b) { return max(a, b); }

/* Two 16-key blocks at once (c0, c1: block A, c2, c3: block B, C layout): the lane quad holds 4 row-blocks (j = 0:
   block A row g, 1: block A row g+8, 2: block B row g, 3: block B row g+8), 4 values of each a lane. a[j]: the
   lane's maximum of row-block j, as floats or (T = uint32_t) as the bits of non-negative ones. */
template <typename T>
AQ_D void lane_row_block_max(const float c0[4], const float c1[4], const float c2[4], const float c3[4], T a[4]) {
    auto v = [](float x) {
        if constexpr (std::is_same<T, float>::value) return x;
        else return __float_as_uint(x);
    };
    a[0] = max_of(max_of(v(c0[0]), v(c0[1])), max_of(v(c1[0]), v(c1[1])));
    a[1] = max_of(max_of(v(c0[2]), v(c0[3])), max_of(v(c1[2]), v(c1[3])));
    a[2] = max_of(max_of(v(c2[0]), v(c2[1])), max_of(v(c3[0]), v(c3[1])));
    a[3] = max_of(max_of(v(c2[2]), v(c2[3])), max_of(v(c3[2]), v(c3[3])));
}

/* A reduce-scatter of lane_row_block_max's 4 maxima over lane bits 0 and 1 leaves lane 4g + t the maximum over the
   quad of row-block 2 (t & 1) + (t >> 1) (block A or B by lane bit 0, row g or g+8 by bit 1), so that each lane
   computes one block scale. */
template <typename T>
AQ_D T quad_row_block_max(const T a[4]) {
    const int lane = (int)threadIdx.x & 31;
    const bool bit0 = lane & 1, bit1 = lane & 2;
    T kept[2]; /* over lane bit 0: row-blocks 2 * bit0 + i */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const T keep = bit0 ? a[2 + i] : a[i], send = bit0 ? a[i] : a[2 + i];
        kept[i] = max_of(keep, __shfl_xor_sync(AQ_FULL_MASK, send, 1));
    }
    /* over lane bit 1 */
    return max_of(bit1 ? kept[1] : kept[0], __shfl_xor_sync(AQ_FULL_MASK, bit1 ? kept[0] : kept[1], 2));
}

/* A block's amax from its largest logit u: max_j P̂_j = P̂(u) exactly, because fma(u, exp_scale, -frame) is
   monotonic in u (exp_scale > 0, checked by ops.cpp) and so is ex2.approx.ftz.f32 (not promised by PTX; checked
   on the GPU for every fp32 input by tests/test_attention.py). As bits, for p_block_scale. */
AQ_D uint32_t block_amax_from_logit(float u, float exp_scale, float frame) {
    return __float_as_uint(p_hat(u, exp_scale, frame));
}

/* The E2M1 roundings of x * r (p_round_element) in place for one block pair (as lane_row_block_max). quad_r: the
   quad's reciprocals (online_softmax_p_scales' r) of lanes 4g .. 4g+3 in x .. w, so of row-blocks 0, 2, 1, 3. With
   pack_quantized_p_pair, bit for bit the per-block rule (aq_block_fake_quantize on P̂ * 2^11). */
AQ_D void p_round_block_pair(float c0[4], float c1[4], float c2[4], float c3[4], const float4 &quad_r) {
    float x[4][4] = {{c0[0], c0[1], c1[0], c1[1]}, {c0[2], c0[3], c1[2], c1[3]},
                     {c2[0], c2[1], c3[0], c3[1]}, {c2[2], c2[3], c3[2], c3[3]}};
    const float jr[4] = {quad_r.x, quad_r.z, quad_r.y, quad_r.w}; /* quad_row_block_max's order */
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) x[j][i] = p_round_element(x[j][i], jr[j]);
    c0[0] = x[0][0], c0[1] = x[0][1], c1[0] = x[0][2], c1[1] = x[0][3];
    c0[2] = x[1][0], c0[3] = x[1][1], c1[2] = x[1][2], c1[3] = x[1][3];
    c2[0] = x[2][0], c2[1] = x[2][1], c3[0] = x[2][2], c3[1] = x[2][3];
    c2[2] = x[3][0], c2[3] = x[3][1], c3[2] = x[3][2], c3[3] = x[3][3];
}

/* The A fragments of blocks A (a0) and B (a1) from p_round_block_pair's roundings and the quad's scale pairs
   (online_softmax_p_scales' scale_pairs, in lane order as quad_r). */
template <aq_dtype DT>
AQ_D void pack_quantized_p_pair(uint32_t a0[4], uint32_t a1[4], const float c0[4], const float c1[4], const float c2[4],
                                const float c3[4], const uint4 &quad_s) {
    const uint32_t s2[4] = {quad_s.x, quad_s.z, quad_s.y, quad_s.w}; /* as quad_r */
    a0[0] = clamp_scale_pair<DT>(pack2<DT>(c0[0], c0[1]), s2[0]);
    a0[1] = clamp_scale_pair<DT>(pack2<DT>(c0[2], c0[3]), s2[1]);
    a0[2] = clamp_scale_pair<DT>(pack2<DT>(c1[0], c1[1]), s2[0]);
    a0[3] = clamp_scale_pair<DT>(pack2<DT>(c1[2], c1[3]), s2[1]);
    a1[0] = clamp_scale_pair<DT>(pack2<DT>(c2[0], c2[1]), s2[2]);
    a1[1] = clamp_scale_pair<DT>(pack2<DT>(c2[2], c2[3]), s2[3]);
    a1[2] = clamp_scale_pair<DT>(pack2<DT>(c3[0], c3[1]), s2[2]);
    a1[3] = clamp_scale_pair<DT>(pack2<DT>(c3[2], c3[3]), s2[3]);
}

/* The A fragment of fq16(P̂ * 2^11) for one 16-key block, from P̂ in C layout (fake_quantize_p_block). */
template <aq_dtype DT>
AQ_D void quantized_p_fragment(uint32_t a[4], const float c0[4], const float c1[4]) {
    float q0[4] = {c0[0], c0[1], c0[2], c0[3]}, q1[4] = {c1[0], c1[1], c1[2], c1[3]};
    fake_quantize_p_block(q0, q1);
    pack_a_from_c<DT>(a, q0, q1);
}

/* ------------------------------------------------------------------------------------------------
   The forward's per-row online softmax (numerics.md §3), shared by the mma.sync and wgmma forwards. A warp holds
   16 query rows as C fragments: s[n][e] is row `row_base + frag_c_row(lane, e)`, key `k0 + 8n + frag_c_col`; each
   thread keeps two rows (r = 0: row g, elements 0, 1; r = 1: row g+8, elements 2, 3) with their integer frame
   m[r], its part of l[r] (summed over the quad at the end) and whether it met a visible key. */

/* The spans of a warp's 16 query rows in shared memory (8 int4: [g] holds the spans of rows g and g + 8, the two C-
   fragment rows of lanes 4g .. 4g + 3), written once per run of rows by the forward kernels so that a masked tile
   reads its rows' spans with one 16-byte load: taken in the masked step itself (a branch and two global loads for
   packed sequences, clamps for dense ones), they made the Hopper training forward spill more (ptxas, D = 128:
   28/80 bytes of spills stored/loaded before spans, 52/92 so, 28/48 this way). Called by the whole warp. */
AQ_D void store_warp_row_spans(const logit_map *lm, int row_base, int4 *warp_spans) {
    const int lane = (int)threadIdx.x & 31;
    __syncwarp(); /* the previous rows' spans are read */
    if (lane < 8) {
        const int2 a = query_key_span(lm, row_base + lane), b = query_key_span(lm, row_base + lane + 8);
        warp_spans[lane] = make_int4(a.x, a.y, b.x, b.y);
    }
    __syncwarp();
}

/* Scores q.k -> logits u (logit_map: t = u * exp_scale), hidden keys -inf (attn_qat.h's visibility), the rows' spans
   from store_warp_row_spans. */
template <int BN>
AQ_D void scores_to_logits(const logit_map *lm, float (&s)[BN / 8][4], int row_base, int k0, bool needs_mask,
                         bool seen[2], const int4 *warp_spans) {
    const int lane = (int)threadIdx.x & 31;
    auto masked = [&](auto general) {
        const int4 both = warp_spans[lane >> 2];
        const int2 span[2] = {make_int2(both.x, both.y), make_int2(both.z, both.w)};
#pragma unroll
        for (int n = 0; n < BN / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = k0 + 8 * n + frag_c_col(lane, e);
                seen[e >> 1] |= span_logit<decltype(general)::value>(lm, span[e >> 1], j, s[n][e],
                                                                     row_base + frag_c_row(lane, e), j, &s[n][e]);
            }
    };
    if (needs_mask && lm->mask != NULL) {
        masked(std::true_type());
    } else if (needs_mask) {
        masked(std::false_type());
    } else {
        seen[0] = seen[1] = true; /* the logits are the scores (logit_map) */
    }
}

/* One key tile of the online softmax in an integer frame: m = ceil(running max), so the factor alpha by which the
   accumulators must be rescaled (rescale_rows) is an exact power of two, which commutes with the P block rule.
   s holds logits u (t = u * exp_scale, logit_map) and becomes P̂ = 2^(t - m), and l is rescaled and accumulated. The
   row max ignores NaN (fmaxf); a NaN score still reaches l and O through exp2. */
/* Row r's frame after a tile whose largest logit is mx: m = max(m, ceil(mx * exp_scale)), alpha the step from the
   old frame, l rescaled by it. Returns the frame the tile's exponentials use. */
AQ_D float advance_frame(float mx, float exp_scale, float &m, float &l, float &alpha) {
    const float m_new = fmaxf(m, ceilf(mx * exp_scale));
    alpha = exp2_frame_step(m - m_new);
    m = m_new;
    l *= alpha;
    /* frame -inf (no finite score yet): exp2(t - 0), so a hidden key's -inf gives 0, not NaN; a row whose visible
       scores are all -inf is made NaN at the end */
    return m_new == -INFINITY ? 0.0f : m_new;
}

/* Row r of the tile's logits in s becomes P̂ = 2^(t - frame), added to l. */
template <int BN>
AQ_D void exp_row(float (&s)[BN / 8][4], int r, float exp_scale, float frame, float &l) {
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
        s[n][2 * r] = p_hat(s[n][2 * r], exp_scale, frame);
        s[n][2 * r + 1] = p_hat(s[n][2 * r + 1], exp_scale, frame);
        l += s[n][2 * r] + s[n][2 * r + 1];
    }
}

template <int BN>
AQ_D void online_softmax_scores(float (&s)[BN / 8][4], float m[2], float l[2], float alpha[2], float exp_scale) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 2));
        exp_row<BN>(s, r, exp_scale, advance_frame(mx, exp_scale, m[r], l[r], alpha[r]), l[r]);
    }
}

/* The online softmax of one key tile (online_softmax_scores) together with the block scales of its P (the quantized
   forward on sm90). Out, per block pair (quad_row_block_max's row-block of the lane): r, the reciprocal for
   p_round_block_pair, and the scale as a DT pair for pack_quantized_p_pair; those take the quad's four, which
   the caller trades through shared memory.
   FROM_LOGITS: each block's amax from its largest logit (block_amax_from_logit), so that the scales need only
   the logits' block maxima and the frame: their chain (the reduce-scatter, the E4M3 rounding, the reciprocal)
   then runs beside the exponentials instead of after them, the block maxima give the row maxima too, and the
   integer max over P̂ per element is gone, for one more MUFU.EX2 a block pair and lane (performance.md v12:
   inference forward -3 to -4%). Not at D = 64, where the exponentials alone keep MUFU as busy as the tensor cores
   (performance.md, cost model) and that extra one cost 5%: there the amax is the integer max of the P̂ bits. */
template <int BN, aq_dtype DT, bool FROM_LOGITS>
AQ_D void online_softmax_p_scales(float (&s)[BN / 8][4], float m[2], float l[2], float alpha[2], float exp_scale,
                                  float (&r)[BN / 32], uint32_t (&scale_pairs)[BN / 32]) {
    using T = typename std::conditional<FROM_LOGITS, float, uint32_t>::type;
    T bmax[BN / 32];
    auto block_maxima = [&]() {
#pragma unroll
        for (int p = 0; p < BN / 32; p++) {
            T a[4];
            lane_row_block_max(s[4 * p], s[4 * p + 1], s[4 * p + 2], s[4 * p + 3], a);
            bmax[p] = quad_row_block_max(a);
        }
    };
    auto block_scales = [&](auto amax_bits) {
#pragma unroll
        for (int p = 0; p < BN / 32; p++) {
            float sv, s_pf;
            p_block_scale(amax_bits(p), &sv, &s_pf, &r[p]);
            scale_pairs[p] = pack2<DT>(sv, sv);
        }
    };
    if constexpr (FROM_LOGITS) {
        block_maxima();
        const bool bit1 = (int)threadIdx.x & 2; /* the lane's row-blocks are of row g + 8 bit1 */
        float mine = bmax[0];
#pragma unroll
        for (int p = 1; p < BN / 32; p++) mine = fmaxf(mine, bmax[p]);
        mine = fmaxf(mine, __shfl_xor_sync(AQ_FULL_MASK, mine, 1)); /* lane bit 0: the pairs' other blocks */
        const float theirs = __shfl_xor_sync(AQ_FULL_MASK, mine, 2);
        const float mx[2] = {bit1 ? theirs : mine, bit1 ? mine : theirs};
        float frame[2];
#pragma unroll
        for (int rr = 0; rr < 2; rr++) frame[rr] = advance_frame(mx[rr], exp_scale, m[rr], l[rr], alpha[rr]);
        const float lane_frame = bit1 ? frame[1] : frame[0];
        block_scales([&](int p) { return block_amax_from_logit(bmax[p], exp_scale, lane_frame); });
#pragma unroll
        for (int rr = 0; rr < 2; rr++) exp_row<BN>(s, rr, exp_scale, frame[rr], l[rr]);
    } else {
        online_softmax_scores<BN>(s, m, l, alpha, exp_scale);
        block_maxima();
        block_scales([&](int p) { return bmax[p]; });
    }
}

/* Whether any of the warp's 16 rows moved its frame in this tile (alpha != 1). An integer frame moves only when a
   row's max passes the next integer, so after the first tiles most tiles move none, and skipping their rescale
   (a multiply per accumulator element: D/2 a thread, as much as a tenth of a tile's elementwise work) is exact. */
AQ_D bool frames_moved(const float alpha[2]) {
    return __any_sync(AQ_FULL_MASK, alpha[0] != 1.0f || alpha[1] != 1.0f);
}

/* acc *= alpha of each of the thread's two rows, if any row of the warp moved its frame (frames_moved). */
template <int D>
AQ_D void rescale_rows(float (&acc)[D / 8][4], const float alpha[2]) {
    if (!frames_moved(alpha)) return;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[n][e] *= alpha[e >> 1];
}

/* online_softmax_scores, then the rescale of o (and o2 with RESCALE_O2). */
template <int BN, int D, bool RESCALE_O2>
AQ_D void online_softmax_tile(float (&s)[BN / 8][4], float (&o)[D / 8][4], float (&o2)[D / 8][4], float m[2],
                              float l[2], float exp_scale) {
    float alpha[2];
    online_softmax_scores<BN>(s, m, l, alpha, exp_scale);
    rescale_rows<D>(o, alpha);
    if constexpr (RESCALE_O2) rescale_rows<D>(o2, alpha);
}

/* A C-fragment row's l summed over its lane quad, and whether any lane of the quad met a visible key (every lane
   shuffles: no short-circuit around __shfl_xor_sync). */
AQ_D float quad_row_sum(float l, bool seen, bool *any_seen) {
    float lsum = l + __shfl_xor_sync(AQ_FULL_MASK, l, 1);
    lsum += __shfl_xor_sync(AQ_FULL_MASK, lsum, 2);
    int any = (int)seen;
    any |= __shfl_xor_sync(AQ_FULL_MASK, any, 1);
    any |= __shfl_xor_sync(AQ_FULL_MASK, any, 2);
    *any_seen = any;
    return lsum;
}

/* A finished row's l: NaN for a row that saw visible keys but whose l is 0 (every visible score -inf, like
   attn_qat.reference), so that its outputs become NaN; an empty row (no visible key) keeps l = 0 and gets zeros. */
AQ_D float finished_row_sum(float lsum, bool any_seen) { return any_seen && lsum == 0.0f ? NAN : lsum; }

/* End of the forward for a warp's 16 rows: sums l over the quad, stores M and l (rows < nq) at stats + row, and
   turns o (and o2) into outputs: o * o_factor / l, o2 / l; exact zeros for empty rows (no visible key), NaN for
   rows that saw keys but whose l is 0 (finished_row_sum). */
template <int D, bool SCALE_O2>
AQ_D void finish_forward_rows(float (&o)[D / 8][4], float (&o2)[D / 8][4], const float m[2], const float l[2],
                              const bool seen[2], float o_factor, float *frame_m, float *row_sum, int row_base,
                              int nq) {
    const int lane = (int)threadIdx.x & 31;
    float inv_l[2];
    bool empty[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        bool any_seen;
        const float lsum = finished_row_sum(quad_row_sum(l[r], seen[r], &any_seen), any_seen);
        empty[r] = !any_seen;
        inv_l[r] = 1.0f / lsum;
        const int row = row_base + frag_c_row(lane, 2 * r);
        if ((lane & 3) == 0 && row < nq) {
            frame_m[row] = m[r];
            row_sum[row] = lsum;
        }
    }
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = e >> 1;
            o[n][e] = empty[r] ? 0.0f : o[n][e] * o_factor * inv_l[r];
            if constexpr (SCALE_O2) o2[n][e] = empty[r] ? 0.0f : o2[n][e] * inv_l[r];
        }
}

/* The backward's statistics of query row `row`: M_i, 1/l_i and delta_i. A row past seqlen_q or with no visible
   key (l = 0) gets inv_l = 0, which the kernels read as "contributes nothing"; a NaN l stays NaN and spreads. */
AQ_D bool load_row_stats(const aq_attention_bwd_params *p, int64_t stat0, int row, float *m, float *inv_l,
                         float *delta) {
    *m = 0.0f;
    *inv_l = 0.0f;
    *delta = 0.0f;
    if (row >= p->seqlen_q) return false;
    /* the three loads together, so that their latencies overlap */
    const float l = p->row_sum[stat0 + row], frame = p->frame_m[stat0 + row], d = p->delta[stat0 + row];
    if (l == 0.0f) return true;
    *m = frame;
    *inv_l = 1.0f / l;
    *delta = d;
    return false;
}

/* load_row_stats for the two rows of a C fragment a thread holds (row_base + frag_c_row: r = 0 row g, r = 1 row
   g+8); returns whether any row of the warp is a dead one (in the sequence with l = 0), so that its steps must
   be checked. */
AQ_D bool load_fragment_row_stats(const aq_attention_bwd_params *p, int64_t stat0, int row_base, float m[2],
                                  float inv_l[2], float delta[2]) {
    const int lane = (int)threadIdx.x & 31;
    bool dead = false;
#pragma unroll
    for (int r = 0; r < 2; r++)
        dead |= load_row_stats(p, stat0, row_base + frag_c_row(lane, 2 * r), &m[r], &inv_l[r], &delta[r]);
    return __any_sync(AQ_FULL_MASK, dead);
}

/* ------------------------------------------------------------------------------------------------
   The backward's elementwise steps (numerics.md §4), shared by the mma.sync and wgmma backwards. A term counts
   ("live") when the key is visible and the query row has a visible key (inv_l != 0, load_row_stats); every
   other term is an exact zero. */

/* Each step comes in two parts, so a wgmma kernel can run the first while the tensor cores compute dP: the
   P part needs only S and the row statistics, the dS part then needs dP. live_bits (bit 4n + e) carries which
   terms count from one to the other; P is 0 on dead terms, but dS must be an exact 0 there even where dP is
   not finite.
   checked: whether any term of the step may be dead (a hidden key, or a row in the sequence with l = 0; rows
   past the sequence are all zeros, so their terms come out 0 unchecked). Decided once per step by the caller:
   the common, unchecked step is straight-line code with no per-term selects or bits, whose latencies the
   compiler can interleave. */

/* dK/dV orientation, keys as C rows: st = S^T (key key_base + frag_c_row, query q0 + 8n + frag_c_col). The step's
   row statistics (m, 1/l, delta of its BQ queries, BQ a multiple of 16) wait in shared memory in the order the
   threads read them: the 4 query columns a thread holds in A fragment kb (2t, 2t + 1 of n-blocks 2kb and 2kb + 1)
   are one aligned float4, so a step takes BQ / 16 loads per statistic instead of BQ / 4. */
AQ_HD int dkdv_stat_slot(int i) { /* where query i of the step goes */
    const int n = i >> 3, col = i & 7;
    return (n >> 1) * 16 + (col >> 1) * 4 + (n & 1) * 2 + (col & 1);
}

/* The statistic of A fragment kb's columns: [2h + e] is n-block 2kb + h, column 2t + e (element e or e + 2). */
AQ_D float4 dkdv_fragment_stats(const float *stat, int kb) {
    return *(const float4 *)(stat + 16 * kb + 4 * ((int)threadIdx.x & 3));
}

AQ_D float float4_at(const float4 &v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

/* A step's statistic for the P and dS parts below, either read from shared memory where it is used, or from
   registers that the caller loaded earlier (dkdv_step_stats): the wgmma kernel loads what it can before issuing
   the products, because behind S^T and dP^T, which saturate the shared-memory pipe, a load waited ~hundreds of
   cycles (ncu: the largest single stalls of the dK/dV kernel). */
AQ_D float4 step_stat(const float *stat, int kb) { return dkdv_fragment_stats(stat, kb); }
template <int N>
AQ_D float4 step_stat(const float4 (&stat)[N], int kb) { return stat[kb]; }

/* All BQ / 16 of them at once, into registers. */
template <int BQ>
AQ_D void dkdv_step_stats(float4 (&v)[BQ / 16], const float *stat) {
#pragma unroll
    for (int kb = 0; kb < BQ / 16; kb++) v[kb] = dkdv_fragment_stats(stat, kb);
}

/* P̂ of the step's term (n, e) from its score s (st[n][e]). With CHECKED, *live says whether the term counts (its
   key is visible and its row has inv_l != 0), which also goes into *live_bits, and a dead term's P̂ is 0; span: the
   queries the thread's two key rows see (key_row_spans). */
template <bool CHECKED>
AQ_D float dkdv_term_p_hat(const logit_map *lm, float s, float m, float inv_l, int q0, int key_base, int n, int e,
                           const int2 (&span)[2], bool *live, uint32_t *live_bits) {
    if constexpr (CHECKED) {
        const int lane = (int)threadIdx.x & 31, i = q0 + 8 * n + frag_c_col(lane, e);
        float u;
        *live = span_logit<true>(lm, span[e >> 1], i, s, i, key_base + frag_c_row(lane, e), &u) && inv_l != 0.0f;
        *live_bits |= (uint32_t)*live << (4 * n + e);
        return *live ? p_hat(u, lm->exp_scale, m) : 0.0f;
    } else {
        *live = true;
        return p_hat(s, lm->exp_scale, m);
    }
}

/* Leaves P^T = P̂ / l in st and the dV operand as A fragments in pa (16 queries each): P^F = fq16(P̂ * 2^11) *
   2^-11 / l with QUANTIZE_DV (the forward's P^F, since M is the forward's final frame; a block with a NaN is NaN
   throughout, its dead terms stay 0), else P. row_m, row_inv_l: step_stat's shared memory or registers. */
template <int BQ, bool QUANTIZE_DV, aq_dtype DT, bool CHECKED, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p_impl(const logit_map *lm, float (&st)[BQ / 8][4], uint32_t (&pa)[BQ / 16][4],
                               const M &row_m, const InvL &row_inv_l, int q0, int key_base) {
    static_assert(BQ <= 64 && BQ % 16 == 0, "one live bit per term of the step, whole A fragments");
    uint32_t live_bits = CHECKED ? 0u : ~0u;
    int2 span[2] = {};
    if constexpr (CHECKED) key_row_spans(lm, key_base, span);
#pragma unroll
    for (int kb = 0; kb < BQ / 16; kb++) { /* 16 queries at a time, so only their P̂ is kept aside */
        const float4 m4 = step_stat(row_m, kb), inv_l4 = step_stat(row_inv_l, kb);
        float xq[4][2]; /* P̂ of the fragment's 4 columns (fake_quantize_p_columns' order), key rows g and g+8 */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = 2 * kb + h;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = 2 * h + (e & 1);
                const float inv_l = float4_at(inv_l4, col);
                bool live;
                const float phat = dkdv_term_p_hat<CHECKED>(lm, st[n][e], float4_at(m4, col), inv_l, q0, key_base, n,
                                                            e, span, &live, &live_bits);
                st[n][e] = live ? phat * inv_l : 0.0f;
                xq[col][e >> 1] = phat;
            }
        }
        if constexpr (QUANTIZE_DV) {
            fake_quantize_p_columns(xq);
            float pf[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = 2 * h + (e & 1);
                    const float v = xq[col][e >> 1] * float4_at(inv_l4, col);
                    pf[h][e] = (live_bits >> (4 * (2 * kb + h) + e)) & 1u ? v : 0.0f;
                }
            pack_a_from_c<DT>(pa[kb], pf[0], pf[1]);
        } else {
            pack_a_from_c<DT>(pa[kb], st[2 * kb], st[2 * kb + 1]);
        }
    }
    return live_bits;
}

template <int BQ, bool QUANTIZE_DV, aq_dtype DT, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p(const logit_map *lm, float (&st)[BQ / 8][4], uint32_t (&pa)[BQ / 16][4],
                          const M &row_m, const InvL &row_inv_l, int q0, int key_base, bool checked) {
    /* one checked variant for masks and causal alike: a third (span_logit<false>, branch-free causal, as the
       forward has) made the kernels spill and measured no faster (Wan 14B and Qwen causal shapes, H100) */
    if (checked) return dkdv_step_p_impl<BQ, QUANTIZE_DV, DT, true>(lm, st, pa, row_m, row_inv_l, q0, key_base);
    return dkdv_step_p_impl<BQ, QUANTIZE_DV, DT, false>(lm, st, pa, row_m, row_inv_l, q0, key_base);
}

/* dkdv_step_p with QUANTIZE_DV for a step of 64 queries, the P^F column quant done for the whole step at once rather
   than per A fragment (the wgmma dK/dV kernel; bit for bit the same st, pa and live bits, checked on the H200 over
   causal, grouped-KV, odd-length and D = 64 shapes; the mma.sync kernel, with 32-query steps at D = 128, keeps the
   per-fragment form). One reduce-scatter of the thread's 16 column amaxes (of the logits on unmasked steps, beside the
   exponentials; else of the P̂, after them) over the 8 lanes of a column set (lane bits 4, 3, 2: 8 + 4 + 2 shuffles)
   leaves lane (g, t) the amaxes of columns 8g + 2t and 8g + 2t + 1, two block scales a lane instead of
   fake_quantize_p_columns' four; the lanes trade (s_pf, r) through `scales` (this warp's 32 float4 of shared memory,
   lane l's pair at [l]) with one 16-byte store and 8 broadcast loads instead of 32 shuffles; only then the elements.
   580 -> 530 instructions a step, 2.4% off the backward (performance.md v9: the per-fragment chains were not what bound
   it). */
template <aq_dtype DT, bool CHECKED, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p_quantized_impl(const logit_map *lm, float (&st)[8][4], uint32_t (&pa)[4][4],
                                         const M &row_m, const InvL &row_inv_l, int q0, int key_base,
                                         float4 *scales) {
    const int lane = (int)threadIdx.x & 31;
    uint32_t live_bits = CHECKED ? 0u : ~0u;
    int2 span[2] = {};
    if constexpr (CHECKED) key_row_spans(lm, key_base, span);
    /* the column maxima of 16 values a column (the lane's two keys, a[n][j] for column 8n + 2t + j), then over the
       8 lanes of the column set, halving the columns a lane holds at each level: lane bit 4 keeps n-blocks
       4 * bit + i, bit 3 then 2 * bit + i, bit 2 the one n-block g. select_column: the same choices without the
       exchange, for values every lane of the set already has. */
    auto select_column = [&](auto (&a)[8][2], auto exchange) {
#pragma unroll
        for (int half = 4; half >= 1; half /= 2) {
            const int lane_bit = half == 4 ? 16 : half == 2 ? 8 : 4;
            const bool hi = lane & lane_bit;
#pragma unroll
            for (int i = 0; i < half; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const auto keep = hi ? a[half + i][j] : a[i][j], send = hi ? a[i][j] : a[half + i][j];
                    a[i][j] = exchange(keep, send, lane_bit);
                }
        }
    };
    auto reduce_column = [&](auto (&a)[8][2]) {
        select_column(a, [](auto keep, auto send, int lane_bit) {
            return max_of(keep, __shfl_xor_sync(AQ_FULL_MASK, send, lane_bit));
        });
    };
    uint32_t amax[2];
    if constexpr (!CHECKED) {
        /* Every term counts, so a column block's amax is P̂ at its largest score (block_amax_from_logit), and the
           reduce-scatter and scales run beside the exponentials instead of after them. The frame of the lane's
           column from the values it holds. */
        float a[8][2], m[8][2];
#pragma unroll
        for (int kb = 0; kb < 4; kb++) {
            const float4 m4 = step_stat(row_m, kb);
            m[2 * kb][0] = m4.x, m[2 * kb][1] = m4.y, m[2 * kb + 1][0] = m4.z, m[2 * kb + 1][1] = m4.w;
        }
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 2; j++) a[n][j] = fmaxf(st[n][j], st[n][j + 2]);
        reduce_column(a);
        select_column(m, [](float keep, float, int) { return keep; });
#pragma unroll
        for (int j = 0; j < 2; j++) amax[j] = block_amax_from_logit(a[0][j], lm->exp_scale, m[0][j]);
    }
    /* P̂ in place (0 on dead terms) */
#pragma unroll
    for (int kb = 0; kb < 4; kb++) {
        const float4 m4 = step_stat(row_m, kb);
        float4 inv_l4 = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        if constexpr (CHECKED) inv_l4 = step_stat(row_inv_l, kb);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = 2 * kb + h;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = 2 * h + (e & 1);
                bool live;
                st[n][e] = dkdv_term_p_hat<CHECKED>(lm, st[n][e], float4_at(m4, col), float4_at(inv_l4, col), q0,
                                                    key_base, n, e, span, &live, &live_bits);
            }
        }
    }
    if constexpr (CHECKED) { /* over the P̂ themselves, dead terms 0: the integer max of their bits */
        uint32_t a[8][2];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int j = 0; j < 2; j++) a[n][j] = max(__float_as_uint(st[n][j]), __float_as_uint(st[n][j + 2]));
        reduce_column(a);
        amax[0] = a[0][0], amax[1] = a[0][1];
    }
    float s[2], s_pf[2], r[2];
#pragma unroll
    for (int j = 0; j < 2; j++) p_block_scale(amax[j], &s[j], &s_pf[j], &r[j]);
    __syncwarp(); /* the last step's loads are done before the store */
    scales[lane] = make_float4(s_pf[0], r[0], s_pf[1], r[1]);
    __syncwarp();
#pragma unroll
    for (int kb = 0; kb < 4; kb++) {
        const float4 inv_l4 = step_stat(row_inv_l, kb);
        float pf[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = 2 * kb + h;
            const float4 sr = scales[4 * n + (lane & 3)]; /* columns 8n + 2t and 8n + 2t + 1 */
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = 2 * h + (e & 1);
                const float inv_l = float4_at(inv_l4, col);
                const float xq = (e & 1) ? p_fake_quantize_element(st[n][e], sr.z, sr.w)
                                         : p_fake_quantize_element(st[n][e], sr.x, sr.y);
                pf[h][e] = xq * inv_l;
                st[n][e] *= inv_l;
                if constexpr (CHECKED) {
                    const bool live = (live_bits >> (4 * n + e)) & 1u;
                    pf[h][e] = live ? pf[h][e] : 0.0f;
                    st[n][e] = live ? st[n][e] : 0.0f;
                }
            }
        }
        pack_a_from_c<DT>(pa[kb], pf[0], pf[1]);
    }
    return live_bits;
}

template <aq_dtype DT, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p_quantized(const logit_map *lm, float (&st)[8][4], uint32_t (&pa)[4][4], const M &row_m,
                                    const InvL &row_inv_l, int q0, int key_base, bool checked, float4 *scales) {
    if (checked) return dkdv_step_p_quantized_impl<DT, true>(lm, st, pa, row_m, row_inv_l, q0, key_base, scales);
    return dkdv_step_p_quantized_impl<DT, false>(lm, st, pa, row_m, row_inv_l, q0, key_base, scales);
}

/* dS^T = P^T (dP^T - delta) into dpt as A fragments dsa, from dkdv_step_p's st and live bits. */
template <int BQ, aq_dtype DT, bool CHECKED, typename Delta>
AQ_D void dkdv_step_ds_impl(const float (&st)[BQ / 8][4], const float (&dpt)[BQ / 8][4], uint32_t (&dsa)[BQ / 16][4],
                            const Delta &row_delta, uint32_t live_bits) {
#pragma unroll
    for (int kb = 0; kb < BQ / 16; kb++) {
        const float4 delta4 = step_stat(row_delta, kb);
        float ds[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int n = 2 * kb + h;
                ds[h][e] = st[n][e] * (dpt[n][e] - float4_at(delta4, 2 * h + (e & 1)));
                if constexpr (CHECKED) ds[h][e] = (live_bits >> (4 * n + e)) & 1u ? ds[h][e] : 0.0f;
            }
        pack_a_from_c<DT>(dsa[kb], ds[0], ds[1]);
    }
}

template <int BQ, aq_dtype DT, typename Delta>
AQ_D void dkdv_step_ds(const float (&st)[BQ / 8][4], const float (&dpt)[BQ / 8][4], uint32_t (&dsa)[BQ / 16][4],
                       const Delta &row_delta, uint32_t live_bits, bool checked) {
    if (checked) dkdv_step_ds_impl<BQ, DT, true>(st, dpt, dsa, row_delta, live_bits);
    else dkdv_step_ds_impl<BQ, DT, false>(st, dpt, dsa, row_delta, live_bits);
}

/* dQ orientation, queries as C rows: s = S (row row_base + frag_c_row, key k0 + 8n + frag_c_col); the thread's
   two rows' statistics in m, inv_l. Leaves P = P̂ / l (unquantized) in s. */
template <int BK, bool CHECKED>
AQ_D uint32_t dq_step_p_impl(const logit_map *lm, float (&s)[BK / 8][4], const float m[2], const float inv_l[2],
                             int row_base, int k0) {
    static_assert(BK <= 64, "one live bit per term of the step");
    const int lane = (int)threadIdx.x & 31;
    uint32_t live_bits = CHECKED ? 0u : ~0u;
    int2 span[2] = {};
    if constexpr (CHECKED) query_row_spans(lm, row_base, span);
#pragma unroll
    for (int n = 0; n < BK / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = e >> 1;
            if constexpr (CHECKED) {
                float u;
                const int j = k0 + 8 * n + frag_c_col(lane, e);
                const bool live =
                    span_logit<true>(lm, span[r], j, s[n][e], row_base + frag_c_row(lane, e), j, &u) && inv_l[r] != 0.0f;
                s[n][e] = live ? p_hat(u, lm->exp_scale, m[r]) * inv_l[r] : 0.0f;
                live_bits |= (uint32_t)live << (4 * n + e);
            } else {
                s[n][e] = p_hat(s[n][e], lm->exp_scale, m[r]) * inv_l[r];
            }
        }
    return live_bits;
}

template <int BK>
AQ_D uint32_t dq_step_p(const logit_map *lm, float (&s)[BK / 8][4], const float m[2], const float inv_l[2],
                        int row_base, int k0, bool checked) {
    if (checked) return dq_step_p_impl<BK, true>(lm, s, m, inv_l, row_base, k0);
    return dq_step_p_impl<BK, false>(lm, s, m, inv_l, row_base, k0);
}

/* dS = P (dP - delta) as A fragments dsa (16 keys each), from dq_step_p's s and live bits. */
template <int BK, aq_dtype DT>
AQ_D void dq_step_ds(const float (&s)[BK / 8][4], const float (&dps)[BK / 8][4], uint32_t (&dsa)[BK / 16][4],
                     const float delta[2], uint32_t live_bits, bool checked) {
    float ds[BK / 8][4];
    if (checked) {
#pragma unroll
        for (int n = 0; n < BK / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                ds[n][e] = (live_bits >> (4 * n + e)) & 1u ? s[n][e] * (dps[n][e] - delta[e >> 1]) : 0.0f;
    } else {
#pragma unroll
        for (int n = 0; n < BK / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) ds[n][e] = s[n][e] * (dps[n][e] - delta[e >> 1]);
    }
#pragma unroll
    for (int kb = 0; kb < BK / 16; kb++) pack_a_from_c<DT>(dsa[kb], ds[2 * kb], ds[2 * kb + 1]);
}

/* ------------------------------------------------------------------------------------------------
   Non-finite operands (numerics.md §6, attn_qat.reference._matmul_visible). In a product
   acc[r, d] += sum_j w_rj B[j, d] a hidden term (w_rj = 0 by the kernels' selects) must be absent, not
   0 * NaN, while a visible term meeting a non-finite B[j, d] must make acc[r, d] NaN. When a B tile in shared
   memory holds any Inf or NaN (rare; flagged by load_tile), the kernels zero those entries before the product,
   remembering for each column d the rows j that held one, and afterwards poison acc[r, d] where a visible j
   is among them. */

/* One thread per column (D <= AQ_THREADS): zero the non-finite values of a ROWS x D tile (ROWS <= 64) in place
   and write col_rows[d] = the rows that held one in column d. */
template <int ROWS, int D, aq_dtype DT>
AQ_D void scrub_nonfinite_tile(uint16_t *tile, uint64_t *col_rows) {
    static_assert(ROWS <= 64 && D <= AQ_THREADS, "one thread per column, one bit per row");
    constexpr int LD = D + AQ_SMEM_PAD;
    constexpr uint16_t EXP = DT == AQ_BFLOAT16 ? 0x7F80 : 0x7C00;
    const int d = (int)threadIdx.x;
    if (d >= D) return;
    uint64_t rows = 0;
    for (int r = 0; r < ROWS; r++) {
        uint16_t *x = tile + r * LD + d;
        if ((*x & EXP) == EXP) {
            rows |= 1ull << r;
            *x = 0;
        }
    }
    col_rows[d] = rows;
}

/* NaN into acc (C fragments: acc[n][e] at row r = e >> 1, column 8n + frag_c_col) wherever a visible B row of
   this lane's C row r (bits in visible_rows[r]) was non-finite in that column. */
template <int D>
AQ_D void poison_nonfinite_products(float (&acc)[D / 8][4], const uint64_t visible_rows[2], const uint64_t *col_rows) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (visible_rows[e >> 1] & col_rows[8 * n + frag_c_col(lane, e)]) acc[n][e] = NAN;
}

/* ------------------------------------------------------------------------------------------------
   Launcher helpers. */

AQ_HD bool aligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) == 0; }

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
