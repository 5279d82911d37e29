/* Attention forward on CUDA (numerics.md §3): FlashAttention-2 on mma.sync, one pass with an integer running
   frame, the NVFP4 fake-quant of P in registers; writes O, optionally O', and the row statistics M and l. */
#include "attention/dispatch.h"
#include "attention/launch.h"
#include "attention/mask.cuh"
#include "attention/nonfinite.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_io.cuh"

#define FWD_BM 64 /* query rows per CTA, 16 per warp */

/* Keys per tile for a tile width W (attention/launch.h): a multiple of 16, so a P block (16 keys counted from key 0)
   never straddles tiles. 32 from W = 128 on keeps S, O and O' (16 x 32, 16 x 128, 16 x 128 per warp) in registers
   without spilling; 64 at W = 64. */
static constexpr __host__ __device__ int fwd_keys_per_tile(int w) { return w == 64 ? 64 : 32; }

/* CTAs per SM that ptxas must fit in registers (<= 168 each for 3): all variants but a 128-column slice with the
   second accumulator O' (about 250 registers) fit 3 without spilling; left to itself ptxas picks fewer or spills. */
static constexpr __host__ __device__ int fwd_min_ctas_per_sm(int w, bool with_o_prime) {
    return w != 64 && with_o_prime ? 1 : 3;
}

/* ------------------------------------------------------------------------------------------------
   CUDA kernel */

/* q: (B, Hq, Nq, D); k: (B, Hkv, Nk, D); v: (B, Hkv, Nk, Dv); o, o_prime: (B, Hq, Nq, Dv), strided; frame_m, row_sum:
   (B, Hq, Nq) fp32 contiguous. W is the tile width (attention/launch.h): Q and K tiles of W columns, zeros past D.
   grid (ceil(Nq / 64) * slices, Hq, B), 128 threads, slices = ceil(Dv / SW) with SW = sm80_slice_width(W): CTA x
   takes query tile x / slices and the SW columns of V, O and O' from SW * (x % slices). FULL: D = Dv = W, which
   makes the column checks compile-time (the registers of the kernels before head dims other than W). run_only_if:
   NULL, or a device flag without which the CTA exits at once (attention/dispatch.h). The CTA keeps its 64 query
   rows in shared memory and walks the key tiles of BN that any of its rows can see (K and its slice of V through
   shared memory).
   Warp w owns rows 16w .. 16w+15 and keeps S (16 x BN), O (16 x SW) and, with WITH_O_PRIME, O' (16 x SW) in
   registers. The slices compute the same S, M and l; the first stores M and l.
   QUANTIZE_P: O accumulates fq16(P̂ * 2^11) (scaled back by 2^-11 / l at the end) and, with WITH_O_PRIME, O'
   accumulates P̂. !QUANTIZE_P: O accumulates P̂, and O' (if wanted) is the same tensor, stored twice.
   A row with no visible key stores O = O' = 0, M = -inf, l = 0; one whose visible scores are all -inf (or NaN)
   stores M = -inf and NaN l, O, O', like attn_qat.reference. */
template <int W, bool FULL, aq_dtype DT, bool QUANTIZE_P, bool WITH_O_PRIME>
__global__ void __launch_bounds__(AQ_THREADS, fwd_min_ctas_per_sm(W, WITH_O_PRIME))
    attention_fwd_kernel(const aq_attention_fwd_params p, bool vec, const int *run_only_if) {
    static_assert(QUANTIZE_P || !WITH_O_PRIME, "O' is a separate accumulator only when O uses P^F");
    constexpr int LD = W + AQ_SMEM_PAD, SW = sm80_slice_width(W), LDV = SW + AQ_SMEM_PAD, BN = fwd_keys_per_tile(W);
    if (run_only_if != NULL && !*run_only_if) return;
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *qs = (uint16_t *)smem, *ks = qs + FWD_BM * LD, *vs = ks + BN * LD;
    uint64_t *v_nonfinite = (uint64_t *)(vs + BN * LDV); /* SW column masks, for scrub_nonfinite_tile */
    int4 *warp_spans = (int4 *)(v_nonfinite + SW) + 8 * ((int)threadIdx.x / 32); /* the warp's rows' spans */

    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, row0 = 16 * warp;
    const int dk = FULL ? W : (int)p.head_dim, d_v = FULL ? W : (int)p.head_dim_v;
    const int tiles = (int)((p.seqlen_q + FWD_BM - 1) / FWD_BM), slices = sm80_slices(d_v, W);
    const int tile_x = (int)blockIdx.x / slices, c0 = SW * ((int)blockIdx.x % slices); /* this CTA's V columns */
    const int dv = min(SW, d_v - c0);
    /* causal: the last query tiles see the most keys, so they are scheduled first */
    const int qtile = p.causal ? tiles - 1 - tile_x : tile_x;
    const int h = (int)blockIdx.y, b = (int)blockIdx.z, hk = h / (int)(p.heads_q / p.heads_kv);
    const int nq = (int)p.seqlen_q, nk = (int)p.seqlen_k, q0 = qtile * FWD_BM;
    const logit_map lm = make_logit_map(p.mask, p.mask_stride, b, h, nq, nk, p.causal, p.causal_offset, p.softmax_scale,
                                        p.q_span, p.k_span);
    const uint16_t *kg = (const uint16_t *)p.k + b * p.k_stride[0] + hk * p.k_stride[1];
    const uint16_t *vg = (const uint16_t *)p.v + b * p.v_stride[0] + hk * p.v_stride[1] + c0;

    load_tile<FWD_BM, W, DT>(qs,
                             (const uint16_t *)p.q + b * p.q_stride[0] + h * p.q_stride[1] + q0 * p.q_stride[2],
                             p.q_stride[2], min(FWD_BM, nq - q0), dk, vec);

    float o[SW / 8][4], o2[SW / 8][4]; /* o2: O', unused (and optimised away) without WITH_O_PRIME */
#pragma unroll
    for (int n = 0; n < SW / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            o[n][e] = 0.0f;
            if constexpr (WITH_O_PRIME) o2[n][e] = 0.0f;
        }
    /* per thread row r (r = 0: row g, C elements 0, 1; r = 1: row g+8, elements 2, 3): the integer frame m, this
       lane's part of l and whether this lane met a visible key (both combined over the quad at the end) */
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    bool seen[2] = {false, false};

    const int2 keys = query_rows_key_range(&lm, q0, min(q0 + FWD_BM, nq)); /* the keys any row sees */
    const int2 common = rows_common_keys(&lm, q0, FWD_BM);                  /* and those every row sees */
    store_warp_row_spans(&lm, q0 + row0, warp_spans);
    for (int k0 = keys.x / BN * BN; k0 < keys.y; k0 += BN) {
        __syncthreads(); /* every warp is done with the previous K, V tile */
        load_tile<BN, W, DT>(ks, kg + k0 * p.k_stride[2], p.k_stride[2], min(BN, nk - k0), dk, vec);
        const bool v_bad = __syncthreads_or(
            load_tile<BN, SW, DT>(vs, vg + k0 * p.v_stride[2], p.v_stride[2], min(BN, nk - k0), dv, vec));
        if (v_bad) { /* V is only used by P V: scrub it now, poison O below */
            scrub_nonfinite_tile<BN, SW, DT>(vs, v_nonfinite);
            __syncthreads();
        }

        /* S = Q K^T: s[n] = keys 8n .. 8n+7 of the tile (the zero columns past D skipped) */
        float s[BN / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < W / 16; kk++) {
            if (16 * kk >= dk) break;
            uint32_t qa[4];
            ldsm_x4(qa, qs + (row0 + ldsm_row_mk(lane)) * LD + kk * 16 + ldsm_col_mk(lane));
#pragma unroll
            for (int np = 0; np < BN / 16; np++) {
                uint32_t kb[4];
                ldsm_x4(kb, ks + (np * 16 + ldsm_row_nk(lane)) * LD + kk * 16 + ldsm_col_nk(lane));
                mma_16816<DT>(s[2 * np], qa, kb[0], kb[1]);
                mma_16816<DT>(s[2 * np + 1], qa, kb[2], kb[3]);
            }
        }

        scores_to_logits<BN>(&lm, s, q0 + row0, k0, tile_needs_mask(&lm, common, k0, BN), seen, warp_spans);
        online_softmax_tile<BN, SW, WITH_O_PRIME, QUANTIZE_P>(s, o, o2, m, l, lm.exp_scale);

        /* O += P V, one 16-key block of P (two C fragments = one A fragment) at a time */
#pragma unroll
        for (int kb = 0; kb < BN / 16; kb++) {
            uint32_t a_hat[4], a_fq[4];
            if constexpr (!QUANTIZE_P || WITH_O_PRIME) pack_a_from_c<DT>(a_hat, s[2 * kb], s[2 * kb + 1]);
            if constexpr (QUANTIZE_P) quantized_p_fragment<DT>(a_fq, s[2 * kb], s[2 * kb + 1]);
            const uint32_t *a_o = QUANTIZE_P ? a_fq : a_hat;
#pragma unroll
            for (int dp = 0; dp < SW / 16; dp++) {
                if (16 * dp >= dv) break;
                uint32_t vb[4];
                ldsm_x4_trans(vb, vs + (kb * 16 + ldsm_row_mk(lane)) * LDV + dp * 16 + ldsm_col_mk(lane));
                mma_16816<DT>(o[2 * dp], a_o, vb[0], vb[1]);
                mma_16816<DT>(o[2 * dp + 1], a_o, vb[2], vb[3]);
                if constexpr (WITH_O_PRIME) {
                    mma_16816<DT>(o2[2 * dp], a_hat, vb[0], vb[1]);
                    mma_16816<DT>(o2[2 * dp + 1], a_hat, vb[2], vb[3]);
                }
            }
        }
        if (v_bad) {
            const uint64_t visible[2] = {
                visible_keys_of_query(&lm, q0 + row0 + frag_c_row(lane, 0), k0, BN),
                visible_keys_of_query(&lm, q0 + row0 + frag_c_row(lane, 2), k0, BN)};
            poison_nonfinite_products<SW>(o, visible, v_nonfinite);
            if constexpr (WITH_O_PRIME) poison_nonfinite_products<SW>(o2, visible, v_nonfinite);
        }
    }

    /* Epilogue. The barrier covers a CTA with no key tile: its Q rows, loaded by all threads, are reused below
       as each warp's staging area. */
    __syncthreads();
    const int64_t stat0 = ((int64_t)b * p.heads_q + h) * nq;
    finish_forward_rows<SW, WITH_O_PRIME>(o, o2, m, l, seen, QUANTIZE_P ? AQ_P_HEADROOM_INV : 1.0f,
                                          c0 == 0 ? p.frame_m + stat0 : NULL, p.row_sum + stat0, q0 + row0, nq);

    uint16_t *stage = qs + row0 * LD; /* the warp's 16 Q rows, staged at row stride SW + AQ_SMEM_PAD <= LD */
    const int valid = min(16, nq - q0 - row0);
    store_warp_rows<SW, DT>(o, stage,
                            (uint16_t *)p.o + b * p.o_stride[0] + h * p.o_stride[1] + (q0 + row0) * p.o_stride[2] + c0,
                            p.o_stride[2], valid, dv, vec);
    if (p.o_prime) {
        uint16_t *og = (uint16_t *)p.o_prime + b * p.o_prime_stride[0] + h * p.o_prime_stride[1] +
                       (q0 + row0) * p.o_prime_stride[2] + c0;
        if constexpr (WITH_O_PRIME)
            store_warp_rows<SW, DT>(o2, stage, og, p.o_prime_stride[2], valid, dv, vec);
        else
            store_warp_rows<SW, DT>(o, stage, og, p.o_prime_stride[2], valid, dv, vec);
    }
}

/* ------------------------------------------------------------------------------------------------
   Kernel launcher */

template <int W, aq_dtype DT, bool QUANTIZE_P, bool WITH_O_PRIME>
static const char *launch_fwd(const aq_attention_fwd_params *p, cudaStream_t stream, bool vec, const int *only_if) {
    void (*kernel)(const aq_attention_fwd_params, bool, const int *) =
        p->head_dim == W && p->head_dim_v == W ? attention_fwd_kernel<W, true, DT, QUANTIZE_P, WITH_O_PRIME>
                                               : attention_fwd_kernel<W, false, DT, QUANTIZE_P, WITH_O_PRIME>;
    constexpr int SW = sm80_slice_width(W), BN = fwd_keys_per_tile(W);
    const int smem = ((FWD_BM + BN) * (W + AQ_SMEM_PAD) + BN * (SW + AQ_SMEM_PAD)) * 2 + SW * (int)sizeof(uint64_t) +
                     FWD_BM * (int)sizeof(int2); /* the rows' spans (store_warp_row_spans) */
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    const int64_t tiles = (p->seqlen_q + FWD_BM - 1) / FWD_BM;
    const dim3 grid((unsigned)(tiles * sm80_slices(p->head_dim_v, W)), (unsigned)p->heads_q, (unsigned)p->batch);
    kernel<<<grid, AQ_THREADS, smem, stream>>>(*p, vec, only_if);
    return launch_status();
}

template <int W, aq_dtype DT>
static const char *launch_fwd_mode(const aq_attention_fwd_params *p, cudaStream_t stream, bool vec,
                                   const int *only_if) {
    if (!p->quantize_p) return launch_fwd<W, DT, false, false>(p, stream, vec, only_if);
    if (p->o_prime) return launch_fwd<W, DT, true, true>(p, stream, vec, only_if);
    return launch_fwd<W, DT, true, false>(p, stream, vec, only_if);
}

const char *aq_attention_fwd_sm80(const aq_attention_fwd_params *p, cudaStream_t s, const int *only_if) {
    const bool vec = vec_ok(p->q, p->q_stride) && vec_ok(p->k, p->k_stride) && vec_ok(p->v, p->v_stride) &&
                     vec_ok(p->o, p->o_stride) && vec_ok(p->o_prime, p->o_prime_stride);
    return with_tile_width_and_dtype(p->head_dim, p->head_dim_v, p->dtype, [&](auto w, auto dt) {
        return launch_fwd_mode<decltype(w)::value, decltype(dt)::value>(p, s, vec, only_if);
    });
}
