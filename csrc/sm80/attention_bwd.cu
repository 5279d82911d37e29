/* Attention backward on CUDA (numerics.md §4), deterministic and without atomics: after delta = rowsum(dO * O')
   (attention/backward_preprocess.cu), dK/dV per key tile (summing over the query heads of its KV group) and dQ per
   query tile, both recomputing P. */
#include <algorithm>

#include "attention/backward_steps.cuh"
#include "attention/dispatch.h"
#include "attention/launch.h"
#include "attention/nonfinite.cuh"
#include "attention/scheduler.cuh"
#include "attention/tile_io.cuh"

#define BWD_KEYS 64 /* keys per dK/dV CTA (16 per warp) and per dQ key tile */
#define BWD_ROWS 64 /* query rows per dQ CTA (16 per warp) */

/* Queries per dK/dV step for a tile width W (attention/launch.h): 32 from W = 128 on keeps S^T and dP^T (16 x 32 per
   warp) beside the dK and dV accumulators (16 x 128 each) in registers; 64 at W = 64. */
static constexpr __host__ __device__ int dkdv_queries_per_step(int w) { return w == 64 ? 64 : 32; }

/* ------------------------------------------------------------------------------------------------
   CUDA kernels */

/* q: (B, Hq, Nq, D), dout: (B, Hq, Nq, Dv); k, dk: (B, Hkv, Nk, D), v, dv: (B, Hkv, Nk, Dv), strided; frame_m,
   row_sum, delta: (B, Hq, Nq) fp32. W is the tile width (attention/launch.h): K, V, Q and dO tiles of W columns,
   zeros past D (K, Q) and Dv (V, dO). grid slices x ceil(Nk / 64) Hkv B (work_item_at of x / slices), 128 threads,
   slices = ceil(max(D, Dv) / SW) with SW = sm80_slice_width(W): CTA x takes the SW columns of dK and dV from
   SW * (x % slices) (those within D, resp. Dv). FULL: D = Dv = W, which makes the column checks compile-time. The
   CTA keeps its 64 keys (K, V) in shared memory and, for every query head of the KV group and every step of BQ
   queries that can see its keys, loads Q, dO and the row statistics.
   Warp w owns keys 16w .. 16w+15, with keys as the MMA rows:
     S^T = K Q^T and dP^T = V dO^T (16 x BQ), P̂ = 2^(t - M), dS^T = P^T ∘ (dP^T - delta),
     dV += (P^F or P)^T dO and dK += dS^T Q (16 x SW each, fp32 registers), scaled and written once at the end.
   Keys as rows make P^T and dS^T, as C fragments, directly the A fragments of the dV and dK products (no trip
   through shared memory). The price is in the P fake-quant: the block of query i is the warp's 16 keys (16w from a
   tile start that is a multiple of 64, so the blocks start at multiples of 16 from key 0, like the forward's), and
   those 16 values of one query column sit in the 8 lanes sharing lane & 3, so the block amax takes 3 shuffles. */
template <int W, bool FULL, aq_dtype DT, bool QUANTIZE_DV, bool P_FP16>
__global__ void __launch_bounds__(AQ_THREADS) attention_bwd_dkdv_kernel(const aq_attention_bwd_params p, bool vec, const int *run_only_if) {
    constexpr int LD = W + AQ_SMEM_PAD, SW = sm80_slice_width(W), BQ = dkdv_queries_per_step(W);
    if (run_only_if != NULL && !*run_only_if) return;
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *ks = (uint16_t *)smem, *vs = ks + BWD_KEYS * LD, *qs = vs + BWD_KEYS * LD, *dos = qs + BQ * LD;
    float *row_m = (float *)(dos + BQ * LD), *row_inv_l = row_m + BQ, *row_delta = row_inv_l + BQ;
    uint64_t *q_nonfinite = (uint64_t *)(row_delta + BQ), *do_nonfinite = q_nonfinite + W; /* column masks */

    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, key0 = 16 * warp;
    const int nq = (int)p.seqlen_q, nk = (int)p.seqlen_k, group = (int)(p.heads_q / p.heads_kv);
    const int d_qk = FULL ? W : (int)p.head_dim, d_v = FULL ? W : (int)p.head_dim_v;
    const int slices = sm80_slices(max(d_qk, d_v), W), c0 = SW * ((int)blockIdx.x % slices);
    const int dk_cols = min(SW, d_qk - c0), dv_cols = min(SW, d_v - c0); /* this CTA's columns (<= 0: none) */
    const work_item wi =
        work_item_at((int)blockIdx.x / slices, (nk + BWD_KEYS - 1) / BWD_KEYS, (int)p.heads_kv, (int)p.batch,
                     p.causal, false, p.sm_count);
    const int k0 = wi.tile * BWD_KEYS, hk = wi.h, b = wi.b;

    load_tile<BWD_KEYS, W, DT>(ks,
                               (const uint16_t *)p.k + b * p.k_stride[0] + hk * p.k_stride[1] + k0 * p.k_stride[2],
                               p.k_stride[2], min(BWD_KEYS, nk - k0), d_qk, vec);
    load_tile<BWD_KEYS, W, DT>(vs,
                               (const uint16_t *)p.v + b * p.v_stride[0] + hk * p.v_stride[1] + k0 * p.v_stride[2],
                               p.v_stride[2], min(BWD_KEYS, nk - k0), d_v, vec);

    float dk[SW / 8][4] = {}, dv[SW / 8][4] = {};
    for (int h = hk * group; h < (hk + 1) * group; h++) {
        const logit_map lm = make_logit_map(p.mask, p.mask_stride, b, h, nq, nk, p.causal, p.causal_offset,
                                            p.softmax_scale, p.q_span, p.k_span);
        const uint16_t *qg = (const uint16_t *)p.q + b * p.q_stride[0] + h * p.q_stride[1];
        const uint16_t *dog = (const uint16_t *)p.dout + b * p.dout_stride[0] + h * p.dout_stride[1];
        const int64_t stat0 = ((int64_t)b * p.heads_q + h) * nq;

        const int2 queries = key_rows_query_range(&lm, k0, min(k0 + BWD_KEYS, nk)); /* those that see a key here */
        for (int q0 = queries.x / BQ * BQ; q0 < queries.y; q0 += BQ) {
            __syncthreads(); /* every warp is done with the previous Q, dO and statistics */
            bool bad = load_tile<BQ, W, DT>(qs, qg + q0 * p.q_stride[2], p.q_stride[2], min(BQ, nq - q0), d_qk, vec);
            bad |= load_tile<BQ, W, DT>(dos, dog + q0 * p.dout_stride[2], p.dout_stride[2], min(BQ, nq - q0), d_v,
                                        vec);
            bool dead = false;
            if ((int)threadIdx.x < BQ) {
                const int slot = dkdv_stat_slot((int)threadIdx.x);
                dead = load_row_stats(&p, stat0, q0 + (int)threadIdx.x, &row_m[slot], &row_inv_l[slot],
                                      &row_delta[slot]);
            }
            bad = __syncthreads_or(bad); /* Q or dO holds Inf or NaN: they are scrubbed before dK, dV below */
            const bool checked = __syncthreads_or(dead) || tile_needs_mask(&lm, rows_common_keys(&lm, q0, BQ), k0, BWD_KEYS);

            /* st[n], dpt[n]: queries 8n .. 8n+7 of the step, for the warp's 16 keys */
            float st[BQ / 8][4] = {}, dpt[BQ / 8][4] = {};
#pragma unroll
            for (int kk = 0; kk < W / 16; kk++) { /* the zero columns past D and Dv skipped */
                const bool in_qk = 16 * kk < d_qk, in_v = 16 * kk < d_v;
                if (!in_qk && !in_v) break;
                uint32_t ka[4], va[4];
                if (in_qk) ldsm_x4(ka, ks + (key0 + ldsm_row_mk(lane)) * LD + kk * 16 + ldsm_col_mk(lane));
                if (in_v) ldsm_x4(va, vs + (key0 + ldsm_row_mk(lane)) * LD + kk * 16 + ldsm_col_mk(lane));
#pragma unroll
                for (int np = 0; np < BQ / 16; np++) {
                    uint32_t qb[4], dob[4];
                    if (in_qk) {
                        ldsm_x4(qb, qs + (np * 16 + ldsm_row_nk(lane)) * LD + kk * 16 + ldsm_col_nk(lane));
                        mma_16816<DT>(st[2 * np], ka, qb[0], qb[1]);
                        mma_16816<DT>(st[2 * np + 1], ka, qb[2], qb[3]);
                    }
                    if (in_v) {
                        ldsm_x4(dob, dos + (np * 16 + ldsm_row_nk(lane)) * LD + kk * 16 + ldsm_col_nk(lane));
                        mma_16816<DT>(dpt[2 * np], va, dob[0], dob[1]);
                        mma_16816<DT>(dpt[2 * np + 1], va, dob[2], dob[3]);
                    }
                }
            }

            uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];
            const uint32_t live = dkdv_step_p<BQ, QUANTIZE_DV, P_FP16, DT>(&lm, st, pa, row_m, row_inv_l, q0, k0 + key0, checked);
            dkdv_step_ds<BQ, DT>(st, dpt, dsa, row_delta, live, checked);
            if (bad) { /* S^T and dP^T are done with the raw Q and dO */
                __syncthreads();
                scrub_nonfinite_tile<BQ, W, DT>(qs, q_nonfinite);
                scrub_nonfinite_tile<BQ, W, DT>(dos, do_nonfinite);
                __syncthreads();
            }

            /* dV += P^T dO, dK += dS^T Q on this CTA's columns, 16 queries (two C fragments = one A fragment) at a
               time */
#pragma unroll
            for (int kb = 0; kb < BQ / 16; kb++) {
#pragma unroll
                for (int dp = 0; dp < SW / 16; dp++) {
                    const bool in_v = 16 * dp < dv_cols, in_qk = 16 * dp < dk_cols;
                    if (!in_qk && !in_v) break;
                    uint32_t dob[4], qb[4];
                    const int col = c0 + dp * 16 + ldsm_col_mk(lane);
                    if (in_v) {
                        ldsm_x4_trans(dob, dos + (kb * 16 + ldsm_row_mk(lane)) * LD + col);
                        mma_16816<DT>(dv[2 * dp], pa[kb], dob[0], dob[1]);
                        mma_16816<DT>(dv[2 * dp + 1], pa[kb], dob[2], dob[3]);
                    }
                    if (in_qk) {
                        ldsm_x4_trans(qb, qs + (kb * 16 + ldsm_row_mk(lane)) * LD + col);
                        mma_16816<DT>(dk[2 * dp], dsa[kb], qb[0], qb[1]);
                        mma_16816<DT>(dk[2 * dp + 1], dsa[kb], qb[2], qb[3]);
                    }
                }
            }
            if (bad) {
                const uint64_t visible[2] = {
                    visible_queries_of_key(&lm, k0 + key0 + frag_c_row(lane, 0), q0, BQ),
                    visible_queries_of_key(&lm, k0 + key0 + frag_c_row(lane, 2), q0, BQ)};
                if (dv_cols > 0) poison_nonfinite_products<SW>(dv, visible, do_nonfinite + c0);
                if (dk_cols > 0) poison_nonfinite_products<SW>(dk, visible, q_nonfinite + c0);
            }
        }
    }

    /* Epilogue: each warp stages through its own K and V rows. The barrier covers a CTA whose keys no query sees:
       those rows were loaded by other warps' threads and no barrier has run yet. */
    __syncthreads();
#pragma unroll
    for (int n = 0; n < SW / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[n][e] *= p.softmax_scale;
    const int valid = min(16, nk - k0 - key0);
    if (dk_cols > 0)
        store_warp_rows<SW, DT>(dk, ks + key0 * LD,
                                (uint16_t *)p.dk + b * p.dk_stride[0] + hk * p.dk_stride[1] +
                                    (k0 + key0) * p.dk_stride[2] + c0,
                                p.dk_stride[2], valid, dk_cols, vec);
    if (dv_cols > 0)
        store_warp_rows<SW, DT>(dv, vs + key0 * LD,
                                (uint16_t *)p.dv + b * p.dv_stride[0] + hk * p.dv_stride[1] +
                                    (k0 + key0) * p.dv_stride[2] + c0,
                                p.dv_stride[2], valid, dv_cols, vec);
}

/* q, dq: (B, Hq, Nq, D), dout: (B, Hq, Nq, Dv); k: (B, Hkv, Nk, D), v: (B, Hkv, Nk, Dv), strided; frame_m, row_sum,
   delta: (B, Hq, Nq) fp32. W is the tile width (attention/launch.h), as in the dK/dV kernel. grid slices x
   ceil(Nq / 64) Hq B (work_item_at of x / slices), 128 threads, slices = ceil(D / SW): CTA x takes the SW columns of
   dQ from SW * (x % slices). Q and dO of the CTA's 64 rows stay in shared memory while the key tiles of 64 that they
   can see stream through it. Warp w owns rows 16w .. 16w+15: S = Q K^T and dP = dO V^T (16 x 64), dS = P ∘ (dP -
   delta) in registers, which is the A fragment of dQ += dS K (16 x SW, fp32). FULL as in the dK/dV kernel. */
template <int W, bool FULL, aq_dtype DT, bool P_FP16>
__global__ void __launch_bounds__(AQ_THREADS) attention_bwd_dq_kernel(const aq_attention_bwd_params p, bool vec, const int *run_only_if) {
    constexpr int LD = W + AQ_SMEM_PAD, SW = sm80_slice_width(W);
    if (run_only_if != NULL && !*run_only_if) return;
    extern __shared__ __align__(16) unsigned char smem[];
    uint16_t *qs = (uint16_t *)smem, *dos = qs + BWD_ROWS * LD, *ks = dos + BWD_ROWS * LD, *vs = ks + BWD_KEYS * LD;
    uint64_t *k_nonfinite = (uint64_t *)(vs + BWD_KEYS * LD); /* W column masks, for scrub_nonfinite_tile */

    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, row0 = 16 * warp;
    const int nq = (int)p.seqlen_q, nk = (int)p.seqlen_k;
    const int d_qk = FULL ? W : (int)p.head_dim, d_v = FULL ? W : (int)p.head_dim_v;
    const int slices = sm80_slices(d_qk, W), c0 = SW * ((int)blockIdx.x % slices), dq_cols = min(SW, d_qk - c0);
    const work_item wi =
        work_item_at((int)blockIdx.x / slices, (nq + BWD_ROWS - 1) / BWD_ROWS, (int)p.heads_q, (int)p.batch,
                     p.causal, true, p.sm_count);
    const int h = wi.h, b = wi.b, hk = h / (int)(p.heads_q / p.heads_kv), q0 = wi.tile * BWD_ROWS;
    const logit_map lm = make_logit_map(p.mask, p.mask_stride, b, h, nq, nk, p.causal, p.causal_offset, p.softmax_scale,
                                        p.q_span, p.k_span);
    const uint16_t *kg = (const uint16_t *)p.k + b * p.k_stride[0] + hk * p.k_stride[1];
    const uint16_t *vg = (const uint16_t *)p.v + b * p.v_stride[0] + hk * p.v_stride[1];

    load_tile<BWD_ROWS, W, DT>(qs,
                               (const uint16_t *)p.q + b * p.q_stride[0] + h * p.q_stride[1] + q0 * p.q_stride[2],
                               p.q_stride[2], min(BWD_ROWS, nq - q0), d_qk, vec);
    load_tile<BWD_ROWS, W, DT>(dos,
                               (const uint16_t *)p.dout + b * p.dout_stride[0] + h * p.dout_stride[1] +
                                   q0 * p.dout_stride[2],
                               p.dout_stride[2], min(BWD_ROWS, nq - q0), d_v, vec);

    /* statistics of this thread's rows g (r = 0) and g+8 (r = 1) */
    const int64_t stat0 = ((int64_t)b * p.heads_q + h) * nq;
    float m[2], inv_l[2], delta[2];
    const bool warp_has_dead_row = load_fragment_row_stats(&p, stat0, q0 + row0, m, inv_l, delta);

    float dq[SW / 8][4] = {};
    const int2 keys = query_rows_key_range(&lm, q0, min(q0 + BWD_ROWS, nq)); /* the keys any row sees */
    const int2 common = rows_common_keys(&lm, q0, BWD_ROWS);                  /* and those every row sees */
    for (int k0 = keys.x / BWD_KEYS * BWD_KEYS; k0 < keys.y; k0 += BWD_KEYS) {
        __syncthreads(); /* every warp is done with the previous K, V tile */
        const bool k_bad_here = load_tile<BWD_KEYS, W, DT>(ks, kg + k0 * p.k_stride[2], p.k_stride[2],
                                                           min(BWD_KEYS, nk - k0), d_qk, vec);
        load_tile<BWD_KEYS, W, DT>(vs, vg + k0 * p.v_stride[2], p.v_stride[2], min(BWD_KEYS, nk - k0), d_v, vec);
        const bool k_bad = __syncthreads_or(k_bad_here); /* K holds Inf or NaN: scrubbed before dQ below */

        /* s[n], dps[n]: keys 8n .. 8n+7 of the tile */
        float s[BWD_KEYS / 8][4] = {}, dps[BWD_KEYS / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < W / 16; kk++) { /* the zero columns past D and Dv skipped */
            const bool in_qk = 16 * kk < d_qk, in_v = 16 * kk < d_v;
            if (!in_qk && !in_v) break;
            uint32_t qa[4], doa[4];
            if (in_qk) ldsm_x4(qa, qs + (row0 + ldsm_row_mk(lane)) * LD + kk * 16 + ldsm_col_mk(lane));
            if (in_v) ldsm_x4(doa, dos + (row0 + ldsm_row_mk(lane)) * LD + kk * 16 + ldsm_col_mk(lane));
#pragma unroll
            for (int np = 0; np < BWD_KEYS / 16; np++) {
                uint32_t kb[4], vb[4];
                if (in_qk) {
                    ldsm_x4(kb, ks + (np * 16 + ldsm_row_nk(lane)) * LD + kk * 16 + ldsm_col_nk(lane));
                    mma_16816<DT>(s[2 * np], qa, kb[0], kb[1]);
                    mma_16816<DT>(s[2 * np + 1], qa, kb[2], kb[3]);
                }
                if (in_v) {
                    ldsm_x4(vb, vs + (np * 16 + ldsm_row_nk(lane)) * LD + kk * 16 + ldsm_col_nk(lane));
                    mma_16816<DT>(dps[2 * np], doa, vb[0], vb[1]);
                    mma_16816<DT>(dps[2 * np + 1], doa, vb[2], vb[3]);
                }
            }
        }

        uint32_t dsa[BWD_KEYS / 16][4];
        const bool checked = tile_needs_mask(&lm, common, k0, BWD_KEYS) || warp_has_dead_row;
        const uint32_t live = dq_step_p<BWD_KEYS, P_FP16>(&lm, s, m, inv_l, q0 + row0, k0, checked);
        dq_step_ds<BWD_KEYS, DT>(s, dps, dsa, delta, live, checked);
        if (k_bad) { /* S is done with the raw K */
            __syncthreads();
            scrub_nonfinite_tile<BWD_KEYS, W, DT>(ks, k_nonfinite);
            __syncthreads();
        }

        /* dQ += dS K on this CTA's columns, 16 keys (two C fragments = one A fragment) at a time */
#pragma unroll
        for (int kb = 0; kb < BWD_KEYS / 16; kb++) {
#pragma unroll
            for (int dp = 0; dp < SW / 16; dp++) {
                if (16 * dp >= dq_cols) break;
                uint32_t kt[4];
                ldsm_x4_trans(kt, ks + (kb * 16 + ldsm_row_mk(lane)) * LD + c0 + dp * 16 + ldsm_col_mk(lane));
                mma_16816<DT>(dq[2 * dp], dsa[kb], kt[0], kt[1]);
                mma_16816<DT>(dq[2 * dp + 1], dsa[kb], kt[2], kt[3]);
            }
        }
        if (k_bad) {
            const uint64_t visible[2] = {
                visible_keys_of_query(&lm, q0 + row0 + frag_c_row(lane, 0), k0, BWD_KEYS),
                visible_keys_of_query(&lm, q0 + row0 + frag_c_row(lane, 2), k0, BWD_KEYS)};
            poison_nonfinite_products<SW>(dq, visible, k_nonfinite + c0);
        }
    }

    /* Epilogue: each warp stages through its own Q rows; the barrier covers a CTA with no key tile. */
    __syncthreads();
#pragma unroll
    for (int n = 0; n < SW / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[n][e] *= p.softmax_scale;
    store_warp_rows<SW, DT>(dq, qs + row0 * LD,
                            (uint16_t *)p.dq + b * p.dq_stride[0] + h * p.dq_stride[1] + (q0 + row0) * p.dq_stride[2] +
                                c0,
                            p.dq_stride[2], min(16, nq - q0 - row0), dq_cols, vec);
}

/* ------------------------------------------------------------------------------------------------
   Kernel launchers */

/* The dK/dV and dQ kernels; only_if: NULL, or the device flag without which they exit at once. */
template <int W, bool FULL, aq_dtype DT>
static const char *launch_bwd(const aq_attention_bwd_params *p, cudaStream_t stream, bool vec, const int *only_if) {
    const char *err;
    const int ld_bytes = (W + AQ_SMEM_PAD) * 2;
    if (p->seqlen_k > 0) {
        void (*kernel)(const aq_attention_bwd_params, bool, const int *) =
            p->quantize_p_for_dv ? attention_bwd_dkdv_kernel<W, FULL, DT, true, true>
            : p->p_fp16          ? attention_bwd_dkdv_kernel<W, FULL, DT, false, true>
                                 : attention_bwd_dkdv_kernel<W, FULL, DT, false, false>;
        const int bq = dkdv_queries_per_step(W);
        const int smem =
            (2 * BWD_KEYS + 2 * bq) * ld_bytes + 3 * bq * (int)sizeof(float) + 2 * W * (int)sizeof(uint64_t);
        if ((err = check_shared_memory(smem))) return err;
        const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return cudaGetErrorString(e);
        const int64_t slices = sm80_slices(std::max(p->head_dim, p->head_dim_v), W);
        const dim3 grid((unsigned)((p->seqlen_k + BWD_KEYS - 1) / BWD_KEYS * p->heads_kv * p->batch * slices));
        kernel<<<grid, AQ_THREADS, smem, stream>>>(*p, vec, only_if);
        if ((err = launch_status())) return err;
    }
    if (p->seqlen_q > 0) {
        void (*kernel)(const aq_attention_bwd_params, bool, const int *) =
            p->p_fp16 || p->quantize_p_for_dv ? attention_bwd_dq_kernel<W, FULL, DT, true>
                                              : attention_bwd_dq_kernel<W, FULL, DT, false>;
        const int smem = (2 * BWD_ROWS + 2 * BWD_KEYS) * ld_bytes + W * (int)sizeof(uint64_t);
        if ((err = check_shared_memory(smem))) return err;
        const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (e != cudaSuccess) return cudaGetErrorString(e);
        const int64_t slices = sm80_slices(p->head_dim, W);
        const dim3 grid((unsigned)((p->seqlen_q + BWD_ROWS - 1) / BWD_ROWS * p->heads_q * p->batch * slices));
        kernel<<<grid, AQ_THREADS, smem, stream>>>(*p, vec, only_if);
        if ((err = launch_status())) return err;
    }
    return NULL;
}

const char *aq_attention_bwd_sm80(const aq_attention_bwd_params *p, cudaStream_t s, const int *only_if) {
    const bool vec = vec_ok(p->q, p->q_stride) && vec_ok(p->k, p->k_stride) && vec_ok(p->v, p->v_stride) &&
                     vec_ok(p->dout, p->dout_stride) && vec_ok(p->dq, p->dq_stride) && vec_ok(p->dk, p->dk_stride) &&
                     vec_ok(p->dv, p->dv_stride);
    return with_tile_width_and_dtype(p->head_dim, p->head_dim_v, p->dtype, [&](auto w, auto dt) {
        constexpr int W = decltype(w)::value;
        return p->head_dim == W && p->head_dim_v == W ? launch_bwd<W, true, decltype(dt)::value>(p, s, vec, only_if)
                                                      : launch_bwd<W, false, decltype(dt)::value>(p, s, vec, only_if);
    });
}
