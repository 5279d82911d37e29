/* The backward's row statistics and elementwise steps (P, P^F, dS, live terms): the sm80/ and sm90/ backwards. */
#pragma once

#include "attention/mask.cuh"
#include "attention/softmax.cuh"

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
   queries the thread's two key rows see (key_row_spans). F16: P̂ is the fp16 one (p_hat<F16>; numerics.md §3: the
   forward quantized P). */
template <bool CHECKED, bool F16>
AQ_D float dkdv_term_p_hat(const logit_map *lm, float s, float m, float inv_l, int q0, int key_base, int n, int e,
                           const int2 (&span)[2], bool *live, uint32_t *live_bits) {
    if constexpr (CHECKED) {
        const int lane = (int)threadIdx.x & 31, i = q0 + 8 * n + frag_c_col(lane, e);
        float u;
        *live = span_logit<true>(lm, span[e >> 1], i, s, i, key_base + frag_c_row(lane, e), &u) && inv_l != 0.0f;
        *live_bits |= (uint32_t)*live << (4 * n + e);
        return *live ? p_hat<F16>(u, lm->exp_scale, m) : 0.0f;
    } else {
        *live = true;
        return p_hat<F16>(s, lm->exp_scale, m);
    }
}

/* Leaves P^T = P̂ / l in st and the dV operand as A fragments in pa (16 queries each): P^F = (P's fp16 block rule
   on P̂ * 2^11) * 2^-11 / l with QUANTIZE_DV (the forward's P^F, since M is the forward's final frame; a block with a
   NaN is NaN throughout, its dead terms stay 0), else P. P_FP16: P̂ is fp16 (dkdv_term_p_hat; QUANTIZE_DV implies
   it). row_m, row_inv_l: step_stat's shared memory or registers. */
template <int BQ, bool QUANTIZE_DV, bool P_FP16, aq_dtype DT, bool CHECKED, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p_impl(const logit_map *lm, float (&st)[BQ / 8][4], uint32_t (&pa)[BQ / 16][4],
                               const M &row_m, const InvL &row_inv_l, int q0, int key_base) {
    static_assert(BQ <= 64 && BQ % 16 == 0, "one live bit per term of the step, whole A fragments");
    static_assert(P_FP16 || !QUANTIZE_DV, "P^F is the fp16 P̂'s block rule");
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
                const float phat = dkdv_term_p_hat<CHECKED, P_FP16>(lm, st[n][e], float4_at(m4, col), inv_l, q0,
                                                                         key_base, n, e, span, &live, &live_bits);
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

template <int BQ, bool QUANTIZE_DV, bool P_FP16, aq_dtype DT, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p(const logit_map *lm, float (&st)[BQ / 8][4], uint32_t (&pa)[BQ / 16][4],
                          const M &row_m, const InvL &row_inv_l, int q0, int key_base, bool checked) {
    /* one checked variant for masks and causal alike: a third (span_logit<false>, branch-free causal, as the
       forward has) made the kernels spill and measured no faster (Wan 14B and Qwen causal shapes, H100) */
    if (checked) return dkdv_step_p_impl<BQ, QUANTIZE_DV, P_FP16, DT, true>(lm, st, pa, row_m, row_inv_l, q0, key_base);
    return dkdv_step_p_impl<BQ, QUANTIZE_DV, P_FP16, DT, false>(lm, st, pa, row_m, row_inv_l, q0, key_base);
}

/* dkdv_step_p with QUANTIZE_DV for a step of 64 queries (the wgmma dK/dV kernel; the mma.sync kernel, with 32-query
   steps at D = 128, keeps dkdv_step_p's per-fragment fp32 form): P's fp16 path on f16x2 pairs of one key row's two
   queries 8n + 2t, 8n + 2t + 1 (st[n][2r], st[n][2r + 1]), the pairs of an A fragment register. Each half keeps its
   own query's frame and 1/l where they enter in fp32 (the exponent argument, the final products), so the pair steps
   are the sm90 forward's (p_quant.cuh), bit for bit the fp32 functions (dev/p_fp16_pair_checks.c):
   - w = cvt.rn.f16x2.f32 of the two exponentials (p_hat<true>'s w, 0 on dead terms, whose P̂ was 0);
   - the column amax: max.NaN.f16x2 over key rows g and g+8 (a register holds both queries' maxima), then a
     reduce-scatter over the 8 lanes of a column set (lane bits 4, 3, 2: 4 + 2 + 1 shuffles, where fp32 took 14)
     leaves lane (g, t) the pair of columns 8g + 2t, 8g + 2t + 1; NaN above all, as the integer max of P̂'s bits
     (check 5). Where every term counts this differs from the logit amax before only for a NaN score, whose
     query's l is NaN, so its column's P and P^F are NaN either way;
   - the lane's two block scales as p_block_scale_pairs (checks 6, 7), both at once (p_block_scales_of_pair), traded
     through `scales` (one 8-byte store, 4 broadcast 16-byte loads);
   - P^F * 2^11 = q * s (p_round_pair, scale_rounded_pair<fp16>: exact in fp16);
   - P = w * (1/l * 2^-11) and P^F = (q * s) * (1/l * 2^-11) in fp32, each product rounding the real value once, as
     (w * 2^-11) * 1/l did (check 8).
   The producer stores the statistics as the steps use them: row_offset holds 11 - m (p_hat<true>'s fma addend, the
   same fp32 value) and row_inv_l_hat 1/l * 2^-11 (exact: l is NaN, 0, or between 1/2 and the key count). */
template <aq_dtype DT, bool CHECKED, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p_quantized_impl(const logit_map *lm, float (&st)[8][4], uint32_t (&pa)[4][4],
                                         const M &row_offset, const InvL &row_inv_l_hat, int q0, int key_base,
                                         float4 *scales) {
    const int lane = (int)threadIdx.x & 31;
    uint32_t live_bits = CHECKED ? 0u : ~0u;
    int2 span[2] = {};
    if constexpr (CHECKED) key_row_spans(lm, key_base, span);
    uint32_t w[8][2]; /* w[n][r]: key row g + 8r, queries 8n + 2t (low half) and 8n + 2t + 1 */
#pragma unroll
    for (int kb = 0; kb < 4; kb++) {
        const float4 off4 = step_stat(row_offset, kb);
        float4 il4 = make_float4(1.0f, 1.0f, 1.0f, 1.0f);
        if constexpr (CHECKED) il4 = step_stat(row_inv_l_hat, kb);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = 2 * kb + h;
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float x[2];
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int e = 2 * r + j, col = 2 * h + j;
                    const float offset = float4_at(off4, col);
                    if constexpr (CHECKED) {
                        const int i = q0 + 8 * n + frag_c_col(lane, e);
                        float u;
                        const bool live =
                            span_logit<true>(lm, span[r], i, st[n][e], i, key_base + frag_c_row(lane, e), &u) &&
                            float4_at(il4, col) != 0.0f;
                        live_bits |= (uint32_t)live << (4 * n + e);
                        x[j] = live ? frame_exp2(fmaf(u, lm->exp_scale, offset)) : 0.0f;
                    } else {
                        x[j] = frame_exp2(fmaf(st[n][e], lm->exp_scale, offset));
                    }
                }
                w[n][r] = pack2<AQ_FLOAT16>(x[0], x[1]);
            }
        }
    }
    /* the column maxima, then over the column set: lane bit 4 keeps n-blocks 4 * bit + i, bit 3 then 2 * bit + i,
       bit 2 the one n-block g */
    uint32_t a[8];
#pragma unroll
    for (int n = 0; n < 8; n++) a[n] = f16x2_max_nan(w[n][0], w[n][1]);
#pragma unroll
    for (int half = 4; half >= 1; half /= 2) {
        const int lane_bit = half == 4 ? 16 : half == 2 ? 8 : 4;
        const bool hi = lane & lane_bit;
#pragma unroll
        for (int i = 0; i < half; i++) {
            const uint32_t keep = hi ? a[half + i] : a[i], send = hi ? a[i] : a[half + i];
            a[i] = f16x2_max_nan(keep, __shfl_xor_sync(AQ_FULL_MASK, send, lane_bit));
        }
    }
    uint32_t recip_pair, scale_pair;
    p_block_scales_of_pair(a[0], &recip_pair, &scale_pair);
    /* lane (g, t)'s pairs at 8-byte slot 8t + g, so that a lane reads its t's n-blocks 2kb, 2kb + 1 as one 16-byte
       load kb; the 16-byte slot kb ^ (t >> 1) keeps a quarter warp's 4 loads in distinct banks */
    const int t = lane & 3, g = lane >> 2;
    uint2 *slots = (uint2 *)scales;
    __syncwarp(); /* the last step's loads are done before the store */
    slots[8 * t + 2 * ((g >> 1) ^ (t >> 1)) + (g & 1)] = make_uint2(recip_pair, scale_pair);
    __syncwarp();
#pragma unroll
    for (int kb = 0; kb < 4; kb++) {
        const uint4 rs = ((const uint4 *)scales)[4 * t + (kb ^ (t >> 1))]; /* n-block 2kb: x, y; 2kb + 1: z, w */
        const float4 il4 = step_stat(row_inv_l_hat, kb);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = 2 * kb + h;
            const uint32_t rp = h ? rs.z : rs.x, sp = h ? rs.w : rs.y;
            const float il[2] = {h ? il4.z : il4.x, h ? il4.w : il4.y};
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const uint32_t qs = scale_rounded_pair<AQ_FLOAT16>(p_round_pair(w[n][r], rp), sp); /* P^F * 2^11 */
                float pf[2], p[2];
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    pf[j] = (j ? f16_hi(qs) : f16_lo(qs)) * il[j];
                    p[j] = (j ? f16_hi(w[n][r]) : f16_lo(w[n][r])) * il[j];
                    if constexpr (CHECKED) {
                        const bool live = (live_bits >> (4 * n + 2 * r + j)) & 1u;
                        pf[j] = live ? pf[j] : 0.0f;
                        p[j] = live ? p[j] : 0.0f;
                    }
                    st[n][2 * r + j] = p[j];
                }
                pa[kb][2 * h + r] = pack2<DT>(pf[0], pf[1]);
            }
        }
    }
    return live_bits;
}

template <aq_dtype DT, typename M, typename InvL>
AQ_D uint32_t dkdv_step_p_quantized(const logit_map *lm, float (&st)[8][4], uint32_t (&pa)[4][4],
                                    const M &row_offset, const InvL &row_inv_l_hat, int q0, int key_base, bool checked,
                                    float4 *scales) {
    if (checked)
        return dkdv_step_p_quantized_impl<DT, true>(lm, st, pa, row_offset, row_inv_l_hat, q0, key_base, scales);
    return dkdv_step_p_quantized_impl<DT, false>(lm, st, pa, row_offset, row_inv_l_hat, q0, key_base, scales);
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
   two rows' statistics in m, inv_l. Leaves P = P̂ / l (unquantized) in s; P_FP16: P̂ is fp16 (p_hat<true>; PAIRS: a
   row's two keys at a time, p_over_l_pair, the same values). PAIRS only on sm90: the mma.sync dQ kernel at D = 64
   spills with it. */
template <int BK, bool P_FP16, bool PAIRS, bool CHECKED>
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
            if constexpr (P_FP16 && PAIRS) { /* row r's keys 8n + 2t, 8n + 2t + 1 together, at e = 2r (p_over_l_pair) */
                if (e & 1) continue;
                float u[2] = {s[n][e], s[n][e + 1]}, p[2];
                bool live[2] = {true, true};
#pragma unroll
                for (int h = 0; h < 2 && CHECKED; h++) {
                    const int j = k0 + 8 * n + frag_c_col(lane, e + h);
                    live[h] = span_logit<true>(lm, span[r], j, s[n][e + h], row_base + frag_c_row(lane, e), j, &u[h]) &&
                              inv_l[r] != 0.0f;
                    live_bits |= (uint32_t)live[h] << (4 * n + e + h);
                }
                p_over_l_pair(u, lm->exp_scale, m[r], inv_l[r], p);
                s[n][e] = live[0] ? p[0] : 0.0f;
                s[n][e + 1] = live[1] ? p[1] : 0.0f;
            } else if constexpr (CHECKED) {
                float u;
                const int j = k0 + 8 * n + frag_c_col(lane, e);
                const bool live =
                    span_logit<true>(lm, span[r], j, s[n][e], row_base + frag_c_row(lane, e), j, &u) && inv_l[r] != 0.0f;
                s[n][e] = live ? p_hat<P_FP16>(u, lm->exp_scale, m[r]) * inv_l[r] : 0.0f;
                live_bits |= (uint32_t)live << (4 * n + e);
            } else {
                s[n][e] = p_hat<P_FP16>(s[n][e], lm->exp_scale, m[r]) * inv_l[r];
            }
        }
    return live_bits;
}

template <int BK, bool P_FP16, bool PAIRS = false>
AQ_D uint32_t dq_step_p(const logit_map *lm, float (&s)[BK / 8][4], const float m[2], const float inv_l[2],
                        int row_base, int k0, bool checked) {
    if (checked) return dq_step_p_impl<BK, P_FP16, PAIRS, true>(lm, s, m, inv_l, row_base, k0);
    return dq_step_p_impl<BK, P_FP16, PAIRS, false>(lm, s, m, inv_l, row_base, k0);
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
