/* The Hopper forward's tail split (tail_split, attention/scheduler.cuh): the last wave's items of the quantized
   kernels run as several CTAs, each over its share of the item's keys (the TAIL kernel of attention_fwd_sm90.cu),
   which write partial results that attention_fwd_merge_kernel then merges in a fixed order. */
#pragma once

#include "attention/fragments.cuh"
#include "attention/nonfinite.cuh"
#include "attention/scheduler.cuh"
#include "attention/softmax.cuh"

/* The tail split (tail_split): the quantized kernels' query rows a CTA (aq_attention_fwd_sm90_tail_shape checks),
   and the keys of a part's unit, so that the inference kernel's 128-key tiles and the training kernel's 64-key ones
   split alike. */
#define FWD_TAIL_BM 128
#define FWD_TAIL_KEYS 128

/* A tail part's partial results (tail_split; floats a part): the unnormalized accumulators O (and O') of its BM
   rows, then each row's frame m and sum l, l = -1 when the part saw no visible key of the row. */
template <int D, int BM, bool WITH_O_PRIME>
struct FwdTailPart {
    static constexpr int O = 0, O2 = BM * D, M = BM * D * (WITH_O_PRIME ? 2 : 1), L = M + BM, FLOATS = L + BM;
};

/* A consumer warp's 16 rows (from row0 of the CTA's) into tail part `slot` (FwdTailPart). */
template <int D, int BM, bool WITH_O_PRIME>
AQ_D void store_fwd_tail_part(const float (&o)[D / 8][4], const float (&o2)[D / 8][4], const float m[2],
                              const float l[2], const bool seen[2], float *part, int slot, int row0) {
    using P = FwdTailPart<D, BM, WITH_O_PRIME>;
    const int lane = (int)threadIdx.x & 31;
    float *pt = part + (int64_t)slot * P::FLOATS;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        bool any_seen;
        const float lsum = quad_row_sum(l[r], seen[r], &any_seen);
        const int row = row0 + frag_c_row(lane, 2 * r);
        if ((lane & 3) == 0) {
            pt[P::M + row] = m[r];
            pt[P::L + row] = any_seen ? lsum : -1.0f;
        }
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            const int col = 8 * n + frag_c_col(lane, 0);
            *(float2 *)(pt + P::O + row * D + col) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
            if constexpr (WITH_O_PRIME)
                *(float2 *)(pt + P::O2 + row * D + col) = make_float2(o2[n][2 * r], o2[n][2 * r + 1]);
        }
    }
}

/* The split items' outputs from their parts, as finish_forward_rows makes them from one CTA's accumulators: per row
   the frame M is the largest of the parts' frames (integers: the frame of the whole row), each part's O, O' and l
   are scaled by 2^(m - M) (exact) and summed in part order, and O = sum * o_factor / l (o_factor = 2^-11: P^F *
   2^11 was accumulated), O' = sum / l; 0 where no part saw a visible key, NaN where one did and l is 0. A warp a
   row, lane covering D / 32 columns. */
template <int D, aq_dtype DT, bool WITH_O_PRIME>
__global__ void __launch_bounds__(128)
    attention_fwd_merge_kernel(const aq_attention_fwd_params p, const tail_split ts, int *nonfinite) {
    constexpr int BM = FWD_TAIL_BM, C = D / 32;
    using P = FwdTailPart<D, BM, WITH_O_PRIME>;
    const int lane = (int)threadIdx.x & 31, t = (int)blockIdx.x * 4 + (int)threadIdx.x / 32;
    const int i = t / BM, r = t % BM, nq = (int)p.seqlen_q, n_qtiles = (nq + BM - 1) / BM;
    if (i >= ts.tail_items) return;
    const int item = ts.main_items + i, hb = item / n_qtiles, q = item % n_qtiles * BM + r;
    if (q >= nq) return;
    const int h = hb % (int)p.heads_q, b = hb / (int)p.heads_q;
    const float *part = ts.part + (int64_t)i * ts.splits * P::FLOATS;
    float frame = -INFINITY;
    bool seen = false;
    for (int s = 0; s < ts.splits; s++) {
        const float *pt = part + (int64_t)s * P::FLOATS;
        if (!(pt[P::L + r] < 0.0f)) seen = true, frame = fmaxf(frame, pt[P::M + r]);
    }
    float lsum = 0.0f, o[C] = {}, o2[C] = {};
    for (int s = 0; s < ts.splits; s++) {
        const float *pt = part + (int64_t)s * P::FLOATS;
        const float ls = pt[P::L + r];
        if (ls < 0.0f) continue;
        const float f = exp2_frame_step(pt[P::M + r] - frame);
        lsum = __fmaf_rn(f, ls, lsum);
#pragma unroll
        for (int c = 0; c < C; c++) {
            o[c] = __fmaf_rn(f, pt[P::O + r * D + C * lane + c], o[c]);
            if constexpr (WITH_O_PRIME) o2[c] = __fmaf_rn(f, pt[P::O2 + r * D + C * lane + c], o2[c]);
        }
    }
    lsum = finished_row_sum(lsum, seen);
    const float inv_l = 1.0f / lsum;
    const int64_t stat = ((int64_t)b * p.heads_q + h) * nq + q;
    if (lane == 0) p.frame_m[stat] = frame, p.row_sum[stat] = lsum;
    float out[2][C]; /* O, O' */
#pragma unroll
    for (int c = 0; c < C; c++) {
        out[0][c] = seen ? o[c] * AQ_P_HEADROOM_INV * inv_l : 0.0f;
        out[1][c] = seen && WITH_O_PRIME ? o2[c] * inv_l : 0.0f;
    }
    if (nonfinite != NULL) flag_if_nonfinite(out, nonfinite); /* a warp a row: all its lanes are here */
    uint16_t *og = (uint16_t *)p.o + b * p.o_stride[0] + h * p.o_stride[1] + q * p.o_stride[2] + C * lane;
#pragma unroll
    for (int c = 0; c < C; c += 2) *(uint32_t *)(og + c) = pack2<DT>(out[0][c], out[0][c + 1]);
    if constexpr (WITH_O_PRIME) {
        uint16_t *og2 = (uint16_t *)p.o_prime + b * p.o_prime_stride[0] + h * p.o_prime_stride[1] +
                        q * p.o_prime_stride[2] + C * lane;
#pragma unroll
        for (int c = 0; c < C; c += 2) *(uint32_t *)(og2 + c) = pack2<DT>(out[1][c], out[1][c + 1]);
    }
}
