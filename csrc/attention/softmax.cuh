/* The exp2 frame (P̂ = 2^(t - frame), fp16 on P's quantized path, numerics.md §3) and the forward's online softmax:
   sm80/, sm90/ and decode/. */
#pragma once

#include <type_traits>

#include "attention/p_quant.cuh"

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

/* w = fp16(2^x) for P's exponent argument x = t - (M - 11) (numerics.md §3 step 2), as a float: the fp32 MUFU.EX2
   rounded once to fp16 (cvt.rn keeps fp16 subnormals, the definition's grid down to 2^-24). */
AQ_D float p_frame_value(float x) { return __half2float(__float2half_rn(frame_exp2(x))); }

/* P̂ for the logit u (t = u * exp_scale, logit_map), with one rounding of the exponent argument (numerics.md §8), the
   form every kernel uses, so the backward recomputes the forward's P̂. F16 (a mode that quantizes P, numerics.md §3):
   P̂ = w * 2^-11 with w = fp16(2^fma(u, exp_scale, 11 - frame)), the 2^11 headroom in the fma's addend (exact: the
   frame is an integer); else P̂ = 2^fma(u, exp_scale, -frame) in fp32 (bf16 mode, drop-in's backward). */
template <bool F16>
AQ_D float p_hat(float u, float exp_scale, float frame) {
    if constexpr (F16)
        return p_frame_value(fmaf(u, exp_scale, AQ_P_HEADROOM_LOG2 - frame)) * AQ_P_HEADROOM_INV;
    else
        return frame_exp2(fmaf(u, exp_scale, -frame));
}

/* P = p_hat<true>(u) * inv_l for two logits u of one row (frame, inv_l = 1 / l): w's pair from one cvt.rn.f16x2.f32
   (as exp_row_pairs), then w * (inv_l * 2^-11), the same fp32 value as (w * 2^-11) * inv_l: both round the real
   w * 2^-11 * inv_l once, since w * 2^-11 (>= 2^-35 or 0, Inf, NaN) and inv_l * 2^-11 are exact, the latter for
   inv_l >= 2^-115, 0, Inf or NaN, which holds for every row (l is at most the key count: each P̂ <= 1). */
AQ_D void p_over_l_pair(const float (&u)[2], float exp_scale, float frame, float inv_l, float (&p)[2]) {
    const float offset = AQ_P_HEADROOM_LOG2 - frame, inv_l_hat = inv_l * AQ_P_HEADROOM_INV;
    const uint32_t w =
        pack2<AQ_FLOAT16>(frame_exp2(fmaf(u[0], exp_scale, offset)), frame_exp2(fmaf(u[1], exp_scale, offset)));
    p[0] = f16_lo(w) * inv_l_hat;
    p[1] = f16_hi(w) * inv_l_hat;
}

/* A block's amax in w's units (p_block_scale_pairs) from its largest logit u: max_j w_j = w(u) exactly, because
   fma(u, exp_scale, 11 - frame) is monotonic in u (exp_scale > 0: binding/tensors.h) and so are ex2.approx.ftz.f32
   (not promised by PTX; checked on the GPU for every fp32 input by tests/test_attention.py) and the fp16 rounding. */
AQ_D float block_amax_w_from_logit(float u, float exp_scale, float frame) {
    return p_frame_value(fmaf(u, exp_scale, AQ_P_HEADROOM_LOG2 - frame));
}

/* ------------------------------------------------------------------------------------------------
   The forward's per-row online softmax (numerics.md §3), shared by the mma.sync and wgmma forwards. A warp holds
   16 query rows as C fragments: s[n][e] is row `row_base + frag_c_row(lane, e)`, key `k0 + 8n + frag_c_col`; each
   thread keeps two rows (r = 0: row g, elements 0, 1; r = 1: row g+8, elements 2, 3) with their integer frame
   m[r], its part of l[r] (summed over the quad at the end) and whether it met a visible key. */

/* One key tile of the online softmax in an integer frame: m = ceil(running max), so the factor alpha by which the
   accumulators must be rescaled (rescale_rows) is an exact power of two, which commutes with the P block rule.
   s holds logits u (t = u * exp_scale, logit_map) and becomes P̂ (p_hat<F16>), and l is rescaled and accumulated. The
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

/* Row r of the tile's logits in s becomes P̂ (p_hat<F16>), added to l: with F16, l sums the fp16 P̂ (§3 step 3). */
template <int BN, bool F16>
AQ_D void exp_row(float (&s)[BN / 8][4], int r, float exp_scale, float frame, float &l) {
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
        s[n][2 * r] = p_hat<F16>(s[n][2 * r], exp_scale, frame);
        s[n][2 * r + 1] = p_hat<F16>(s[n][2 * r + 1], exp_scale, frame);
        l += s[n][2 * r] + s[n][2 * r + 1];
    }
}

template <int BN, bool F16>
AQ_D void online_softmax_scores(float (&s)[BN / 8][4], float m[2], float l[2], float alpha[2], float exp_scale) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 2));
        exp_row<BN, F16>(s, r, exp_scale, advance_frame(mx, exp_scale, m[r], l[r], alpha[r]), l[r]);
    }
}

/* Row r of the tile's logits in s becomes w = P̂ * 2^11 in fp16 pairs in place (w_pair's order), p_hat<true>'s
   values: the fp32 exponentials rounded to fp16 two at a time (cvt.rn.f16x2.f32). l adds each pair's sum times
   2^-11, which is l + (P̂0 + P̂1) exactly as exp_row adds it (scaling by 2^-11 commutes with the fp32 rounding:
   P̂ >= 2^-35 or 0). HAT (O'): w in DT beside each pair (hat_pair, unscaled_hat_pair), from the same halves as l,
   which then die at once (taken later from w, they stayed live and spilled at D = 128). */
template <int BN, aq_dtype DT, bool HAT>
AQ_D void exp_row_pairs(float (&s)[BN / 8][4], int r, float exp_scale, float frame, float &l) {
    const float offset = AQ_P_HEADROOM_LOG2 - frame;
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
        const uint32_t pair = pack2<AQ_FLOAT16>(frame_exp2(fmaf(s[n][2 * r], exp_scale, offset)),
                                                frame_exp2(fmaf(s[n][2 * r + 1], exp_scale, offset)));
        set_w_pair<BN>(s, n, r, pair);
        const float lo = f16_lo(pair), hi = f16_hi(pair);
        l = fmaf(lo + hi, AQ_P_HEADROOM_INV, l);
        if constexpr (HAT) s[n][2 * r + 1] = __uint_as_float(unscaled_hat_pair<DT>(pair, lo, hi));
    }
}

/* The online softmax of one key tile together with the block scales of its P (the quantized forward on sm90), in
   fp16 pairs: s holds logits u (t = u * exp_scale, logit_map) and receives the pairs of w = P̂ * 2^11 (w_pair) and,
   HAT (O'), w in DT beside them (hat_pair; exp_row_pairs). Out, per block pair (quad_row_block_max's row-block of
   the lane): the reciprocal pair for p_round_block_pair and the scale pair for pack_quantized_p_pair
   (p_block_scale_pairs); those take the quad's four, which the caller trades through shared memory.
   FROM_LOGITS: each block's amax from its largest logit (block_amax_w_from_logit), so that the scales need only
   the logits' block maxima and the frame: their chain (the reduce-scatter, the E4M3 rounding, the reciprocal)
   then runs beside the exponentials instead of after them, the block maxima give the row maxima too, and the
   max over P̂ per element is gone, for one more MUFU.EX2 a block pair and lane (performance.md v12). Not at
   D = 64, where the exponentials alone keep MUFU as busy as the tensor cores and that extra one costs more
   (performance.md, cost model): there the amax is the max of the w pairs (NaN above all, as the integer max of
   P̂'s bits). */
template <int BN, aq_dtype DT, bool FROM_LOGITS, bool HAT>
AQ_D void online_softmax_p_scales(float (&s)[BN / 8][4], float m[2], float l[2], float alpha[2], float exp_scale,
                                  uint32_t (&recip_pairs)[BN / 32], uint32_t (&scale_pairs)[BN / 32]) {
    if constexpr (FROM_LOGITS) {
        float bmax[BN / 32];
#pragma unroll
        for (int p = 0; p < BN / 32; p++) {
            float a[4];
            lane_row_block_max(s[4 * p], s[4 * p + 1], s[4 * p + 2], s[4 * p + 3], a);
            bmax[p] = quad_row_block_max(a);
        }
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
#pragma unroll
        for (int p = 0; p < BN / 32; p++)
            p_block_scale_pairs<DT>(block_amax_w_from_logit(bmax[p], exp_scale, lane_frame), &recip_pairs[p],
                                    &scale_pairs[p]);
#pragma unroll
        for (int rr = 0; rr < 2; rr++) exp_row_pairs<BN, DT, HAT>(s, rr, exp_scale, frame[rr], l[rr]);
    } else {
#pragma unroll
        for (int r = 0; r < 2; r++) { /* online_softmax_scores' row maxima */
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < BN / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 2));
            exp_row_pairs<BN, DT, HAT>(s, r, exp_scale, advance_frame(mx, exp_scale, m[r], l[r], alpha[r]), l[r]);
        }
#pragma unroll
        for (int p = 0; p < BN / 32; p++) {
            f16_pair a[4];
            lane_row_block_max_pairs<BN>(s, p, a);
            const uint32_t both = quad_row_block_max(a).bits; /* the block's even keys' max and odd keys' */
            p_block_scale_pairs<DT>(f16_lo(f16x2_max_nan(both, both >> 16)), &recip_pairs[p], &scale_pairs[p]);
        }
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

/* online_softmax_scores<BN, F16>, then the rescale of o (and o2 with RESCALE_O2). */
template <int BN, int D, bool RESCALE_O2, bool F16>
AQ_D void online_softmax_tile(float (&s)[BN / 8][4], float (&o)[D / 8][4], float (&o2)[D / 8][4], float m[2],
                              float l[2], float exp_scale) {
    float alpha[2];
    online_softmax_scores<BN, F16>(s, m, l, alpha, exp_scale);
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

/* End of the forward for a warp's 16 rows: sums l over the quad, stores M and l (rows < nq; unless frame_m is NULL)
   at stats + row, and
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
        if (frame_m != NULL && (lane & 3) == 0 && row < nq) {
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
