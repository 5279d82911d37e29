/* The deterministic dQ kernel of the Hopper backward (dq_accum NULL): a CTA per tile of 128 query rows (64 per
   consumer warpgroup) recomputes S and dP, without atomics. Q and dO are loaded once; K and V tiles of 64 keys
   stream. Per step: S = Q K^T and dP = dO V^T, dS = P (dP - delta), dQ += dS K.
   Part of attention_bwd_sm90.cu's translation unit, whose launcher runs it and whose BWD90_* geometry it shares. */
#pragma once

#if !defined(BWD90_THREADS) || !defined(BWD90_STAGES) || !defined(BWD90_ROWS) || !defined(BWD90_K_STEP)
#error "sm90/deterministic_dq.cuh: include it from attention_bwd_sm90.cu, after the BWD90_* geometry"
#endif

#include "attention/backward_steps.cuh"
#include "attention/nonfinite.cuh"
#include "attention/scheduler.cuh"
#include "attention/tile_io.cuh"
#include "sm90/hopper.cuh"

template <int D>
struct DqLayout {
    static constexpr int ROWS_BYTES = BWD90_ROWS * D * 2, STEP_BYTES = BWD90_K_STEP * D * 2;
    static constexpr int Q_OFFSET = 0, DO_OFFSET = ROWS_BYTES, K_OFFSET = 2 * ROWS_BYTES;
    static constexpr int V_OFFSET = K_OFFSET + BWD90_STAGES * STEP_BYTES;
    static constexpr int BAR_OFFSET = V_OFFSET + BWD90_STAGES * STEP_BYTES;
    static constexpr int ALLOC = BAR_OFFSET + 8 * (1 + 2 * BWD90_STAGES) + 1024;
};

/* The dQ CTA's work item: queries q0 .. q0 + 127 of head h (KV head hk), batch b, and the key tiles kt0 ..
   kt0 + n_tiles - 1 that hold the keys any of its rows sees. */
struct dq_item {
    int nq, h, b, hk, q0, kt0, n_tiles;
};

/* What every role of the dQ kernel reads besides its item: the parameters and tensor maps, the shared-memory tiles
   and barriers, and this thread's place. Built once, before the roles split (as Dkdv90State). */
template <int D_, aq_dtype DT_, bool P_FP16_>
struct Dq90State {
    static constexpr int D = D_, BK = BWD90_K_STEP;
    static constexpr aq_dtype DT = DT_;
    static constexpr bool P_FP16 = P_FP16_; /* as Dkdv90State's */
    using L = DqLayout<D>;

    const aq_attention_bwd_params &p;
    const CUtensorMap *tm_q, *tm_do, *tm_k, *tm_v;
    int *nonfinite;
    unsigned char *qs, *dos, *ks, *vs;
    uint64_t *rows_full, *kv_full, *kv_empty;
    int warpgroup, lane; /* no warp: the kernel's own, whose tests then fold as before the split */

    AQ_D Dq90State(unsigned char *smem, const aq_attention_bwd_params &p, const CUtensorMap *tm_q,
                   const CUtensorMap *tm_do, const CUtensorMap *tm_k, const CUtensorMap *tm_v, int *nonfinite)
        : p(p), tm_q(tm_q), tm_do(tm_do), tm_k(tm_k), tm_v(tm_v), nonfinite(nonfinite), qs(smem + L::Q_OFFSET),
          dos(smem + L::DO_OFFSET), ks(smem + L::K_OFFSET), vs(smem + L::V_OFFSET) {
        uint64_t *bars = (uint64_t *)(smem + L::BAR_OFFSET);
        rows_full = bars, kv_full = bars + 1, kv_empty = kv_full + BWD90_STAGES;
        warpgroup = warpgroup_index(), lane = (int)threadIdx.x % 32;
    }

    /* by thread 0, before the CTA's __syncthreads */
    AQ_D void init_barriers() const {
        mbar_init(rows_full, 1);
        for (int s = 0; s < BWD90_STAGES; s++) {
            mbar_init(&kv_full[s], 1);
            mbar_init(&kv_empty[s], 8); /* lane 0 of each consumer warp */
        }
        mbar_init_fence();
    }
};

/* The producer, one thread: the item's Q and dO once, then its K and V tiles into the ring as the consumers free
   its slots. */
template <class Bwd>
AQ_D void dq90_producer(const Bwd &bwd, const dq_item &it) {
    constexpr int D = Bwd::D, BK = Bwd::BK;
    using L = typename Bwd::L;
    mbar_arrive_expect_tx(bwd.rows_full, 2 * L::ROWS_BYTES);
    tma_load_rows<D>(bwd.qs, bwd.tm_q, bwd.rows_full, BWD90_ROWS, it.q0, it.h, it.b);
    tma_load_rows<D>(bwd.dos, bwd.tm_do, bwd.rows_full, BWD90_ROWS, it.q0, it.h, it.b);
    for (int j = 0; j < it.n_tiles; j++) {
        const int s = j % BWD90_STAGES;
        mbar_wait(&bwd.kv_empty[s], ((j / BWD90_STAGES) & 1) ^ 1);
        mbar_arrive_expect_tx(&bwd.kv_full[s], 2 * L::STEP_BYTES);
        tma_load_rows<D>(bwd.ks + s * L::STEP_BYTES, bwd.tm_k, &bwd.kv_full[s], BK, (it.kt0 + j) * BK, it.hk, it.b);
        tma_load_rows<D>(bwd.vs + s * L::STEP_BYTES, bwd.tm_v, &bwd.kv_full[s], BK, (it.kt0 + j) * BK, it.hk, it.b);
    }
}

/* The consumer warp's mainloop over the item's key tiles (queries q0 + row0 .. + 15 of the warp, q0 + wrow .. + 63
   of its warpgroup; m, inv_l, delta: the rows' statistics): dQ / scale accumulates in dq. */
template <class Bwd>
AQ_D void dq90_mainloop(const Bwd &bwd, const dq_item &it, const logit_map &lm, int wrow, int row0,
                        const int2 &common, bool warp_has_dead_row, const float (&m)[2], const float (&inv_l)[2],
                        const float (&delta)[2], float (&dq)[Bwd::D / 8][4]) {
    constexpr int D = Bwd::D, BK = Bwd::BK;
    constexpr aq_dtype DT = Bwd::DT;
    using L = typename Bwd::L;
    const int q0 = it.q0;
    mbar_wait(bwd.rows_full, 0);
    for (int j = 0; j < it.n_tiles; j++) {
        const int s = j % BWD90_STAGES, k0 = (it.kt0 + j) * BK;
        const unsigned char *kt = bwd.ks + s * L::STEP_BYTES, *vt = bwd.vs + s * L::STEP_BYTES;
        /* S and dP as two groups: the P part of the step runs while the tensor cores compute dP */
        float sc[BK / 8][4], dps[BK / 8][4];
        mbar_wait(&bwd.kv_full[s], (j / BWD90_STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BK, DT, 0>(sc, k_major_desc(bwd.qs, BWD90_ROWS, wrow, kk), k_major_desc(kt, BK, 0, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BK, DT, 0>(dps, k_major_desc(bwd.dos, BWD90_ROWS, wrow, kk), k_major_desc(vt, BK, 0, kk),
                                kk > 0);
        wgmma_commit();
        fence_registers(dps);
        wgmma_wait<1>();
        fence_registers(sc);

        const bool checked = tile_needs_mask(&lm, common, k0, BK) || warp_has_dead_row;
        const uint32_t live = dq_step_p<BK, Bwd::P_FP16, true>(&lm, sc, m, inv_l, q0 + row0, k0, checked);
        wgmma_wait<0>();
        fence_registers(dps);
        uint32_t dsa[BK / 16][4];
        dq_step_ds<BK, DT>(sc, dps, dsa, delta, live, checked);
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < BK / 16; kb++) wgmma_rs<D, DT, 1>(dq, dsa[kb], mn_major_desc(kt, BK, kb), 1);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(dq);
        if (bwd.lane == 0) mbar_arrive(&bwd.kv_empty[s]);
    }
}

/* dQ = scale * dq, checked and stored from the warp's rows */
template <class Bwd>
AQ_D void dq90_epilogue(const Bwd &bwd, const dq_item &it, int row0, float (&dq)[Bwd::D / 8][4]) {
    constexpr int D = Bwd::D;
    const aq_attention_bwd_params &p = bwd.p;
    const int q0 = it.q0;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[n][e] *= p.softmax_scale;
    if (bwd.nonfinite != NULL) flag_if_nonfinite(dq, bwd.nonfinite);
    store_fragment_rows<D, Bwd::DT>(dq, (uint16_t *)p.dq + it.b * p.dq_stride[0] + it.h * p.dq_stride[1] +
                                            (q0 + row0) * p.dq_stride[2], p.dq_stride[2], it.nq - q0 - row0);
}

/* grid ceil(Nq / 128) Hq B (work_item_at), 384 threads. Tensor maps: q, dout with boxes of 128 rows; k, v of 64
   rows. */
template <int D, aq_dtype DT, bool P_FP16>
__global__ void __launch_bounds__(BWD90_THREADS, 1)
    attention_bwd_dq_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                                 const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                                 const aq_attention_bwd_params p, int *nonfinite) {
#if AQ_SM90_ENABLED
    using Bwd = Dq90State<D, DT, P_FP16>;
    constexpr int BK = Bwd::BK;
    extern __shared__ unsigned char smem_raw[];
    const Bwd bwd(align1024(smem_raw), p, &tm_q, &tm_do, &tm_k, &tm_v, nonfinite);
    const int warp = (int)threadIdx.x / 32;

    const int nq = (int)p.seqlen_q, nk = (int)p.seqlen_k;
    const work_item wi = work_item_at((int)blockIdx.x, (nq + BWD90_ROWS - 1) / BWD90_ROWS, (int)p.heads_q,
                                      (int)p.batch, p.causal, true, p.sm_count);
    const int h = wi.h, b = wi.b, hk = h / (int)(p.heads_q / p.heads_kv), q0 = wi.tile * BWD90_ROWS;
    const logit_map lm = make_logit_map(p.mask, p.mask_stride, b, h, nq, nk, p.causal, p.causal_offset, p.softmax_scale,
                                        p.q_span, p.k_span);
    /* the key tiles kt0 .. kt0 + n_tiles - 1 hold the keys any row sees */
    const int2 keys = query_rows_key_range(&lm, q0, min(q0 + BWD90_ROWS, nq));
    const int kt0 = keys.x / BK, n_tiles = (keys.y + BK - 1) / BK - kt0;
    const dq_item it{nq, h, b, hk, q0, kt0, n_tiles};

    if (threadIdx.x == 0) bwd.init_barriers();
    __syncthreads();

    if (bwd.warpgroup == 0) { /* producer */
        setmaxnreg_dec<24>();
        if (warp == 0 && bwd.lane == 0) dq90_producer(bwd, it);
        return;
    }

    setmaxnreg_inc<240>();
    const int c = bwd.warpgroup - 1, wrow = 64 * c, row0 = wrow + 16 * (warp % 4);
    const int2 common = rows_common_keys(&lm, q0 + wrow, 64); /* the keys every row of the warpgroup sees */
    const int64_t stat0 = ((int64_t)b * p.heads_q + h) * nq;
    /* the register arrays here, as in the dK/dV kernel, so that they keep their order */
    float m[2], inv_l[2], delta[2];
    const bool warp_has_dead_row = load_fragment_row_stats(&p, stat0, q0 + row0, m, inv_l, delta);
    float dq[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dq[n][e] = 0.0f;
    dq90_mainloop(bwd, it, lm, wrow, row0, common, warp_has_dead_row, m, inv_l, delta, dq);
    dq90_epilogue(bwd, it, row0, dq);
#endif
}
