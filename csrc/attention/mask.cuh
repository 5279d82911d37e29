/* Which keys each query sees (logit_map: spans, causal, packed, additive mask), scores to logits: every kernel. */
#pragma once

#include <type_traits>

#include "attention/fragments.cuh"

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

/* The spans of a warp's 16 query rows in shared memory (8 int4: [g] holds the spans of rows g and g + 8, the two C-
   fragment rows of lanes 4g .. 4g + 3), written once per run of rows by the forward kernels so that a masked tile
   reads its rows' spans with one 16-byte load: taken in the masked step itself (a branch and two global loads for
   packed sequences, clamps for dense ones), they made the Hopper training forward spill more (performance.md,
   "Measurements behind choices in the code"). Called by the whole warp. */
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
