/* Attention backward on Hopper (numerics.md §4): attention_bwd.cu's dK/dV and dQ kernels on wgmma fed by TMA, with
   a producer warp and two consumer warpgroups, and the same elementwise code (attention/backward_steps.cuh). dK/dV
   per key tile (looping over the query heads of its KV group); the delta kernel of attention_bwd.cu runs first. dQ two ways:
   - fused (params.dq_accum set, the default): the dK/dV kernel also makes dQ = dS K from its own dS and adds it
     into dq_accum (5 products instead of 7; the order of the fp32 adds varies run to run), then a small kernel
     converts dq_accum into dQ;
   - deterministic (dq_accum NULL): a dQ kernel per query tile recomputes S and dP, without atomics
     (sm90/deterministic_dq.cuh).

   dK/dV: CTA = 128 keys (64 per consumer warpgroup), K and V loaded once; Q, dO and the row statistics of 64
     queries stream through a ring of 3 slots (2 when fused at D = 128). Per step: S^T = K Q^T and dP^T = V dO^T
     (64 x 64), the elementwise step, dV += (P^F or P)^T dO and dK += dS^T Q (P^T and dS^T from registers, dO and Q
     as MN-major operands); fused, dS^T to shared memory and dQ[:, half c] = dS K (see the loop).
   Left to the mma.sync kernels by the launcher: operands TMA cannot take, and hidden terms over non-finite Q, dO
   or K: with hidden terms the kernels flag any gradient that came out non-finite, and the mma.sync kernels,
   launched behind them, then do the whole backward again (as in attention_fwd_sm90.cu). */
#include "attention/backward_steps.cuh"
#include "attention/dispatch.h"
#include "attention/launch.h"
#include "attention/nonfinite.cuh"
#include "attention/scheduler.cuh"
#include "attention/tile_io.cuh"
#include "sm90/epilogue.cuh"
#include "sm90/hopper.cuh"
#include "sm90/named_barriers.h"
#include "sm90/tensor_map.h"
#include "sm90/tile_shapes.h"

#define BWD90_THREADS 384 /* producer warpgroup + 2 consumer warpgroups */
#define BWD90_STAGES 3
#define BWD90_ROWS 128    /* dQ: query rows per CTA */
#define BWD90_K_STEP 64   /* dQ: keys per step */

/* The fused dQ's fp32 sums (dq_accum): per (batch, query head, 64-query step, half of the head dim) a chunk of
   64 x D/2 floats in the order of a wgmma accumulator, thread t of the warpgroup's fragment float4 n at
   4 (128 n + t): the consumers stage it in shared memory with conflict-free 16-byte stores, and the bulk copy
   engine adds the whole chunk into global memory at once. */
__host__ __device__ inline int64_t dq_accum_chunk(int64_t b, int64_t h, int64_t heads_q, int64_t seqlen_q, int64_t q_step, int half,
                                int head_dim) {
    const int64_t q_steps = (seqlen_q + BWD90_Q_STEP - 1) / BWD90_Q_STEP;
    return (((b * heads_q + h) * q_steps + q_step) * 2 + half) * (BWD90_Q_STEP * head_dim / 2);
}

/* dq_accum's size in floats: where the chunk one past the last (batch, head, step, half) would start. */
int64_t aq_attention_bwd_sm90_dq_accum_floats(const aq_attention_bwd_params *p) {
    return dq_accum_chunk(p->batch, 0, p->heads_q, p->seqlen_q, 0, 0, (int)p->head_dim);
}

template <int D, bool FUSED_DQ>
struct DkdvLayout {
    /* at D = 128 the fused kernel's dS^T and dQ staging take the third slot of the Q / dO ring (227 KB in all) */
    static constexpr int STAGES = FUSED_DQ && D > 64 ? 2 : BWD90_STAGES;
    static constexpr int KV_BYTES = BWD90_KEYS * D * 2, STEP_BYTES = BWD90_Q_STEP * D * 2;
    static constexpr int K_OFFSET = 0, V_OFFSET = KV_BYTES, Q_OFFSET = 2 * KV_BYTES;
    static constexpr int DO_OFFSET = Q_OFFSET + STAGES * STEP_BYTES;
    /* fused dQ: the step's dS^T (128 keys x 64 queries, one swizzled panel), double-buffered so that a warpgroup
       may write the next step's while the other still reads this one (DS_BARRIER keeps them a step apart) */
    static constexpr int DS_TILE_BYTES = BWD90_KEYS * BWD90_Q_STEP * 2;
    static constexpr int DS_OFFSET = DO_OFFSET + STAGES * STEP_BYTES;
    /* fused dQ: each consumer warpgroup's dQ partial of the step (dq_accum_chunk's order) for the bulk reduction */
    static constexpr int DQ_CHUNK_BYTES = BWD90_Q_STEP * D / 2 * 4;
    static constexpr int DQ_OFFSET = DS_OFFSET + (FUSED_DQ ? 2 * DS_TILE_BYTES : 0);
    /* per stage: m, inv_l, delta of the step's 64 queries (dkdv_stat_slot's order; with QUANTIZE_DV 11 - m and
       inv_l * 2^-11, dkdv90_producer), whether one of them is a dead row,
       and for packed sequences whether each consumer warpgroup's 64 keys need per-element visibility (as floats) */
    static constexpr int STATS_FLOATS = 3 * BWD90_Q_STEP + 4;
    static constexpr int STATS_OFFSET = DQ_OFFSET + (FUSED_DQ ? 2 * DQ_CHUNK_BYTES : 0);
    /* each consumer warp's 32 float4 through which dkdv_step_p_quantized's lanes trade block scales */
    static constexpr int SCALES_OFFSET = STATS_OFFSET + STAGES * STATS_FLOATS * 4;
    static constexpr int BAR_OFFSET = SCALES_OFFSET + 8 * 32 * 16;
    /* kv_full, step_full[STAGES], step_empty[STAGES], dq_full[2], dq_empty[2] */
    static constexpr int ALLOC = BAR_OFFSET + 8 * (1 + 2 * STAGES + 4) + 1024;
};

/* The dK/dV loop's next step: the next 64 queries of head h, or the first of head h + 1 once past q_end (counters
   rather than a division of the step index, whose dependent chain stood at the top of every step: performance.md). */
AQ_D void next_query_step(int *h, int *q0, int q_begin, int q_end) {
    *q0 += BWD90_Q_STEP;
    if (*q0 >= q_end) *q0 = q_begin, ++*h;
}

/* The warp's dS^T rows (keys key0 .. key0 + 15, dkdv_step_ds's A fragments) into the step's dS^T tile (128 keys x
   BQ queries, one 128-byte swizzled panel as TMA would write it): one stmatrix per 16 queries. */
template <int BQ>
AQ_D void store_ds_transposed(unsigned char *tile, const uint32_t (&dsa)[BQ / 16][4], int key0) {
    static_assert(BQ == SM90_PANEL, "a dS^T row is one 128-byte panel row");
    const int lane = (int)threadIdx.x & 31, mat = lane / 8, row = key0 + (mat & 1) * 8 + (lane & 7);
#pragma unroll
    for (int kb = 0; kb < BQ / 16; kb++)
        stmatrix_x4(tile + row * 128 + (((2 * kb + (mat >> 1)) ^ (row & 7)) << 4), dsa[kb]);
}

/* dP^T = V dO^T for warpgroup c's 64 keys and the step's 64 queries, as one commit group. */
template <int D, aq_dtype DT>
AQ_D void issue_dpt(float (&dpt)[BWD90_Q_STEP / 8][4], const unsigned char *vs, const unsigned char *dot, int c) {
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wgmma_ss<BWD90_Q_STEP, DT, 0>(dpt, k_major_desc(vs, BWD90_KEYS, 64 * c, kk),
                                      k_major_desc(dot, BWD90_Q_STEP, 0, kk), kk > 0);
    wgmma_commit();
}

/* A dK/dV tail part's partial results (tail_split; floats a part): dK (already times the softmax scale) and dV of
   its 128 keys, fp32. */
template <int D>
struct DkdvTailPart {
    static constexpr int DK = 0, DV = BWD90_KEYS * D, FLOATS = 2 * BWD90_KEYS * D;
};

/* The split items' dK and dV: the sum of their parts in part order, a warp a key row, D / 32 columns a lane. */
template <int D, aq_dtype DT>
__global__ void __launch_bounds__(128)
    attention_bwd_dkdv_merge_kernel(const aq_attention_bwd_params p, const tail_split ts, int *nonfinite) {
    constexpr int C = D / 32;
    using P = DkdvTailPart<D>;
    const int lane = (int)threadIdx.x & 31, t = (int)blockIdx.x * 4 + (int)threadIdx.x / 32;
    const int i = t / BWD90_KEYS, r = t % BWD90_KEYS, nk = (int)p.seqlen_k;
    if (i >= ts.tail_items) return;
    const work_item wi = work_item_at(ts.main_items + i, (nk + BWD90_KEYS - 1) / BWD90_KEYS, (int)p.heads_kv,
                                      (int)p.batch, 0, false, p.sm_count);
    const int key = wi.tile * BWD90_KEYS + r;
    if (key >= nk) return;
    const float *part = ts.part + (int64_t)i * ts.splits * P::FLOATS + r * D + C * lane;
    float g[2][C] = {}, (&dk)[C] = g[0], (&dv)[C] = g[1];
    for (int s = 0; s < ts.splits; s++)
#pragma unroll
        for (int c = 0; c < C; c++) {
            dk[c] += part[(int64_t)s * P::FLOATS + P::DK + c];
            dv[c] += part[(int64_t)s * P::FLOATS + P::DV + c];
        }
    if (nonfinite != NULL) flag_if_nonfinite(g, nonfinite); /* a warp a key row: all its lanes are here */
    uint16_t *gk = (uint16_t *)p.dk + wi.b * p.dk_stride[0] + wi.h * p.dk_stride[1] + key * p.dk_stride[2] + C * lane;
    uint16_t *gv = (uint16_t *)p.dv + wi.b * p.dv_stride[0] + wi.h * p.dv_stride[1] + key * p.dv_stride[2] + C * lane;
#pragma unroll
    for (int c = 0; c < C; c += 2) {
        *(uint32_t *)(gk + c) = pack2<DT>(dk[c], dk[c + 1]);
        *(uint32_t *)(gv + c) = pack2<DT>(dv[c], dv[c + 1]);
    }
}

/* A warp's 16 x D fp32 C fragments into rows [row0, row0 + 16) of a D-column fp32 array. */
template <int D>
AQ_D void store_fragment_rows_f32(const float (&acc)[D / 8][4], float *g, int row0) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *(float2 *)(g + (row0 + frag_c_row(lane, 2 * r)) * D + 8 * n + frag_c_col(lane, 0)) =
                make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
}

/* Packed sequences: whether a consumer warpgroup's 64 keys [j0, j0 + 64) need per-element visibility against the
   step's queries [q0, q0 + BWD90_Q_STEP) (rows_common_keys and tile_needs_mask for span tables). The producer
   decides it, so that the tables' global loads stay off the consumers' critical path; written for spans only,
   as the producer's 24 registers have no room for the dense rule's arithmetic. */
AQ_D bool packed_keys_need_mask(const aq_attention_bwd_params &p, int q0, int j0) {
    const int2 *span = (const int2 *)p.q_span;
    const int nk = (int)p.seqlen_k, i_last = min(q0 + BWD90_Q_STEP, (int)p.seqlen_q) - 1;
    const int lo = clamped_span(span[i_last], nk).x, hi = clamped_span(span[q0], nk).y;
    return p.mask != NULL || j0 < lo || j0 + 64 > hi;
}

/* The dK/dV CTA's work item: keys k0 .. k0 + 127 of KV head hk, batch b, and the query steps that see them: from
   query q_first of head h_first, n_steps steps of 64 queries (next_query_step), [q_begin, q_end) of each head. */
struct dkdv_item {
    int nq, nk, group, k0, hk, b, q_begin, q_end, h_first, q_first, n_steps;
};

/* What every role of the dK/dV kernel reads besides its item: the parameters and tensor maps, the shared-memory
   tiles and barriers, and this thread's place. Built once, before the roles split. */
template <int D_, aq_dtype DT_, bool QUANTIZE_DV_, bool FUSED_DQ_, bool TAIL_, bool P_FP16_>
struct Dkdv90State {
    static constexpr int D = D_, BQ = BWD90_Q_STEP;
    static constexpr aq_dtype DT = DT_;
    static constexpr bool QUANTIZE_DV = QUANTIZE_DV_, FUSED_DQ = FUSED_DQ_, TAIL = TAIL_;
    static constexpr bool P_FP16 = P_FP16_; /* P̂ in fp16 (p_fp16): a template flag, so bf16 mode's code is fp32's */
    using L = DkdvLayout<D, FUSED_DQ>;

    const aq_attention_bwd_params &p;
    const tail_split &ts;
    const CUtensorMap *tm_q, *tm_do, *tm_k, *tm_v, *tm_dk, *tm_dv;
    int *nonfinite;
    unsigned char *smem, *ks, *vs, *qs, *dos, *ds_tiles;
    float *stats;
    uint64_t *kv_full, *step_full, *step_empty, *dq_full, *dq_empty;
    int warpgroup, warp, lane;

    AQ_D Dkdv90State(unsigned char *smem, const aq_attention_bwd_params &p, const tail_split &ts,
                     const CUtensorMap *tm_q, const CUtensorMap *tm_do, const CUtensorMap *tm_k,
                     const CUtensorMap *tm_v, const CUtensorMap *tm_dk, const CUtensorMap *tm_dv, int *nonfinite)
        : p(p), ts(ts), tm_q(tm_q), tm_do(tm_do), tm_k(tm_k), tm_v(tm_v), tm_dk(tm_dk), tm_dv(tm_dv),
          nonfinite(nonfinite), smem(smem), ks(smem + L::K_OFFSET), vs(smem + L::V_OFFSET), qs(smem + L::Q_OFFSET),
          dos(smem + L::DO_OFFSET), ds_tiles(smem + L::DS_OFFSET), stats((float *)(smem + L::STATS_OFFSET)) {
        uint64_t *bars = (uint64_t *)(smem + L::BAR_OFFSET);
        kv_full = bars, step_full = bars + 1, step_empty = step_full + L::STAGES;
        dq_full = step_empty + L::STAGES, dq_empty = dq_full + 2;
        warpgroup = warpgroup_index(), warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    }

    /* by thread 0, before the CTA's __syncthreads */
    AQ_D void init_barriers() const {
        mbar_init(kv_full, 1);
        for (int s = 0; s < L::STAGES; s++) {
            mbar_init(&step_full[s], 32); /* the producer warp's lanes, after writing the statistics */
            mbar_init(&step_empty[s], 256); /* every consumer thread, once done with the slot */
        }
        for (int c = 0; c < 2; c++) {
            mbar_init(&dq_full[c], 128); /* every thread of consumer warpgroup c, after staging its dQ */
            mbar_init(&dq_empty[c], 1);  /* the dQ warp, once the bulk reduction has read the staging */
        }
        mbar_init_fence();
    }
};

/* The fused kernel's dQ warp, one thread: adds each step's dQ partials, which the consumer warpgroups stage, into
   dq_accum with the bulk copy engine. Apart from the producer, whose TMA it would otherwise wait behind. */
template <class Bwd>
AQ_D void dkdv90_dq_warp(const Bwd &bwd, const dkdv_item &it) {
    using L = typename Bwd::L;
    const aq_attention_bwd_params &p = bwd.p;
    for (int step = 0, h = it.h_first, q0 = it.q_first; step < it.n_steps;
         step++, next_query_step(&h, &q0, it.q_begin, it.q_end)) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            mbar_wait(&bwd.dq_full[c], step & 1);
            bulk_reduce_add_f32(p.dq_accum + dq_accum_chunk(it.b, h, p.heads_q, it.nq, q0 / Bwd::BQ, c, Bwd::D),
                                bwd.smem + L::DQ_OFFSET + c * L::DQ_CHUNK_BYTES, L::DQ_CHUNK_BYTES);
            bulk_commit();
            bulk_wait_read<0>();
            mbar_arrive(&bwd.dq_empty[c]);
        }
    }
    bulk_wait_all<0>();
}

/* The producer warp: K and V once, then per query step Q and dO (TMA, lane 0) and the step's row statistics (a
   query a lane, staged through m, inv_l and delta) into the ring, as the consumers free its slots. */
template <class Bwd>
AQ_D void dkdv90_producer(const Bwd &bwd, const dkdv_item &it, float (&m)[Bwd::BQ / 32], float (&inv_l)[Bwd::BQ / 32],
                          float (&delta)[Bwd::BQ / 32]) {
    constexpr int D = Bwd::D, BQ = Bwd::BQ;
    using L = typename Bwd::L;
    const aq_attention_bwd_params &p = bwd.p;
    const int lane = bwd.lane, k0 = it.k0, b = it.b;
    if (lane == 0) {
        mbar_arrive_expect_tx(bwd.kv_full, 2 * L::KV_BYTES);
        tma_load_rows<D>(bwd.ks, bwd.tm_k, bwd.kv_full, BWD90_KEYS, k0, it.hk, b);
        tma_load_rows<D>(bwd.vs, bwd.tm_v, bwd.kv_full, BWD90_KEYS, k0, it.hk, b);
    }
    for (int step = 0, h = it.h_first, q0 = it.q_first; step < it.n_steps;
         step++, next_query_step(&h, &q0, it.q_begin, it.q_end)) {
        const int s = step % L::STAGES;
        /* the statistics first, into registers: their global-load latency then overlaps the wait for the
           slot instead of delaying the step's TMA, which the consumers wait on (performance.md v6) */
        const int64_t stat0 = ((int64_t)b * p.heads_q + h) * it.nq;
        bool dead = false;
#pragma unroll
        for (int k = 0; k < BQ / 32; k++)
            dead |= load_row_stats(&p, stat0, q0 + lane + 32 * k, &m[k], &inv_l[k], &delta[k]);
        dead = __any_sync(AQ_FULL_MASK, dead);
        mbar_wait(&bwd.step_empty[s], ((step / L::STAGES) & 1) ^ 1);
        if (lane == 0) {
            mbar_expect_tx(&bwd.step_full[s], 2 * L::STEP_BYTES);
            tma_load_rows<D>(bwd.qs + s * L::STEP_BYTES, bwd.tm_q, &bwd.step_full[s], BQ, q0, h, b);
            tma_load_rows<D>(bwd.dos + s * L::STEP_BYTES, bwd.tm_do, &bwd.step_full[s], BQ, q0, h, b);
        }
        float *st = bwd.stats + s * L::STATS_FLOATS;
#pragma unroll
        for (int k = 0; k < BQ / 32; k++) {
            const int slot = dkdv_stat_slot(lane + 32 * k);
            /* P^F's column quant takes 11 - m, its exponent's addend, and 1/l * 2^-11 (exact), its products' factor
               (dkdv_step_p_quantized): a consumer's step then spends no instruction on either */
            st[slot] = Bwd::QUANTIZE_DV ? AQ_P_HEADROOM_LOG2 - m[k] : m[k];
            st[BQ + slot] = Bwd::QUANTIZE_DV ? inv_l[k] * AQ_P_HEADROOM_INV : inv_l[k];
            st[2 * BQ + slot] = delta[k];
        }
        if (lane == 0) st[3 * BQ] = dead ? 1.0f : 0.0f;
        if (p.q_span != NULL && lane < 2)
            st[3 * BQ + 1 + lane] = dead || packed_keys_need_mask(p, q0, k0 + 64 * lane) ? 1.0f : 0.0f;
        mbar_arrive(&bwd.step_full[s]); /* releases the statistics; the phase ends when the TMA bytes are in too */
    }
}

/* A consumer warp: warpgroup c owns keys k0 + 64c .. +63, its warp w keys k0 + 64c + 16w .. +15. mainloop() runs
   the query steps into dk and dv, epilogue() writes them. The register arrays are the kernel's (it says why). */
template <class Bwd>
struct Dkdv90Consumer {
    static constexpr int D = Bwd::D, BQ = Bwd::BQ;
    static constexpr aq_dtype DT = Bwd::DT;
    static constexpr bool QUANTIZE_DV = Bwd::QUANTIZE_DV, FUSED_DQ = Bwd::FUSED_DQ;
    using L = typename Bwd::L;
    /* Ping-pong (unquantized only): the two consumer warpgroups take turns at the P part, so that one runs its
       FP32 work while the other's products keep the tensor cores busy; with the P^F column quant, whose P part is
       three times as long, the turns cost more than they gain (performance.md v6). */
    static constexpr bool ping_pong = !QUANTIZE_DV && !FUSED_DQ;

    const Bwd &bwd;
    const dkdv_item &it;
    const int c, key0;
    float4 *const scales;                    /* the warp's exchange of block scales (dkdv_step_p_quantized) */
    float (&dk)[D / 8][4], (&dv)[D / 8][4];  /* the accumulators */
    float (&st)[BQ / 8][4], (&dpt)[BQ / 8][4]; /* a step's S^T and dP^T */
    float4 (&m4)[BQ / 16];                   /* its row frames */
    uint32_t (&pa)[BQ / 16][4], (&dsa)[BQ / 16][4]; /* P^T and dS^T as A operands */
    float4 (&delta4)[BQ / 16];               /* its rows' delta */
    float (&dq)[D / 16][4];                  /* fused: the step's dQ partial */

    AQ_D Dkdv90Consumer(const Bwd &bwd, const dkdv_item &it, float (&dk)[D / 8][4], float (&dv)[D / 8][4],
                        float (&st)[BQ / 8][4], float (&dpt)[BQ / 8][4], float4 (&m4)[BQ / 16],
                        uint32_t (&pa)[BQ / 16][4], uint32_t (&dsa)[BQ / 16][4], float4 (&delta4)[BQ / 16],
                        float (&dq)[D / 16][4])
        : bwd(bwd), it(it), c(bwd.warpgroup - 1), key0(64 * c + 16 * (bwd.warp % 4)),
          scales((float4 *)(bwd.smem + L::SCALES_OFFSET) + 32 * (bwd.warp - 4)), dk(dk), dv(dv), st(st), dpt(dpt),
          m4(m4), pa(pa), dsa(dsa), delta4(delta4), dq(dq) {
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0.0f;
    }

    /* The fused dQ of the step's 64 queries, columns c D/2 .. +D/2, = dS (both warpgroups' keys) K: dS^T goes to
       shared memory (stmatrix), and the products read it and K as MN-major operands; the result is staged for
       the dQ warp (dkdv90_dq_warp). */
    AQ_D void fused_dq(int step) {
        unsigned char *ds_tile = bwd.ds_tiles + (step & 1) * L::DS_TILE_BYTES;
        store_ds_transposed<BQ>(ds_tile, dsa, key0);
        fence_proxy_async_shared();
        named_barrier_sync(DS_BARRIER, 256);
        constexpr int DH = D / 2;
        const unsigned char *k_half = bwd.ks + (c * DH / SM90_PANEL) * BWD90_KEYS * 128 + (c * DH % SM90_PANEL) * 2;
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < BWD90_KEYS / 16; kb++)
            wgmma_ss<DH, DT, 1, 1>(dq, mn_major_desc(ds_tile, BWD90_KEYS, kb), mn_major_desc(k_half, BWD90_KEYS, kb),
                                   kb > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(dq);
        /* staged for the dQ warp's bulk reduction (per-thread red.global.add of the same data from here cost
           far more: v10 in performance.md) */
        mbar_wait(&bwd.dq_empty[c], (step & 1) ^ 1);
        float4 *stage = (float4 *)(bwd.smem + L::DQ_OFFSET + c * L::DQ_CHUNK_BYTES) +
                        ((int)threadIdx.x - 128 * bwd.warpgroup);
#pragma unroll
        for (int n = 0; n < DH / 8; n++) stage[128 * n] = make_float4(dq[n][0], dq[n][1], dq[n][2], dq[n][3]);
        fence_proxy_async_shared();
        mbar_arrive(&bwd.dq_full[c]);
    }

    /* The CTA's query steps: S^T, dP^T, the elementwise steps, dV += P^T dO and dK += dS^T Q (and the fused dQ). */
    AQ_D void mainloop() {
        const aq_attention_bwd_params &p = bwd.p;
        /* read here, not from it.nq: that form moved a conversion in the kernel's SASS */
        const int nq = (int)p.seqlen_q, k0 = it.k0;
        if (ping_pong && c == 1) named_barrier_arrive(PING_PONG_BARRIER, 256); /* warpgroup 0 takes the first turn */
        mbar_wait(bwd.kv_full, 0);
        for (int step = 0, h = it.h_first, q0 = it.q_first; step < it.n_steps;
             step++, next_query_step(&h, &q0, it.q_begin, it.q_end)) {
            const int s = step % L::STAGES;
            const logit_map lm = make_logit_map(p.mask, p.mask_stride, it.b, h, nq, it.nk, p.causal, p.causal_offset,
                                                p.softmax_scale, p.q_span, p.k_span);
            const unsigned char *qt = bwd.qs + s * L::STEP_BYTES, *dot = bwd.dos + s * L::STEP_BYTES;
            const float *st_m = bwd.stats + s * L::STATS_FLOATS;

            /* Unquantized: S^T and dP^T as two groups, the P part (exp2) runs while the tensor cores compute dP^T,
               and the dS part while they compute dV. With the P^F column quant the P part is latency-bound (v9 in
               performance.md), and dP^T's 32 accumulator registers held across it left the compiler too few to
               interleave its element chains (spills): dP^T is issued after it, just before dV, and the dS part
               waits for it, without spills (performance.md, "Measurements behind choices in the code").
               (Issuing the next step's S^T behind dK, to keep the tensor cores busy across steps, puts a wgmma in
               flight across the loop's back edge, and ptxas then serializes every wgmma: C7515.) */
            constexpr bool dp_after_p = QUANTIZE_DV;
            mbar_wait(&bwd.step_full[s], (step / L::STAGES) & 1);
            /* the step's row frames and dead-row flag are read before the products are issued: behind S^T and dP^T,
               which saturate the shared-memory pipe, these loads waited hundreds of cycles (step_stat). 1/l is read
               where used: 16 more registers held across the products cost more (spills) than its loads' wait. */
            dkdv_step_stats<BQ>(m4, st_m);
            const float dead_rows = st_m[3 * BQ];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss<BQ, DT, 0>(st, k_major_desc(bwd.ks, BWD90_KEYS, 64 * c, kk), k_major_desc(qt, BQ, 0, kk),
                                    kk > 0);
            wgmma_commit();
            if constexpr (!dp_after_p) issue_dpt<D, DT>(dpt, bwd.vs, dot, c);
            /* packed sequences: the producer's decision (packed_keys_need_mask) */
            const bool checked =
                p.q_span != NULL
                    ? st_m[3 * BQ + 1 + c] != 0.0f
                    : tile_needs_mask(&lm, rows_common_keys(&lm, q0, BQ), k0 + 64 * c, 64) || dead_rows != 0.0f;
            if constexpr (dp_after_p) {
                wgmma_wait<0>();
            } else {
                fence_registers(dpt);
                wgmma_wait<1>();
            }
            fence_registers(st);

            if constexpr (ping_pong) named_barrier_sync(PING_PONG_BARRIER + c, 256);
            const uint32_t live =
                QUANTIZE_DV ? dkdv_step_p_quantized<DT>(&lm, st, pa, m4, st_m + BQ, q0, k0 + key0, checked, scales)
                            : dkdv_step_p<BQ, false, Bwd::P_FP16, DT>(&lm, st, pa, m4, st_m + BQ, q0, k0 + key0, checked);
            dkdv_step_stats<BQ>(delta4, st_m + 2 * BQ); /* before dV is issued, for the same reason */
            wgmma_fence();
            if constexpr (dp_after_p) issue_dpt<D, DT>(dpt, bwd.vs, dot, c);
#pragma unroll
            for (int kb = 0; kb < BQ / 16; kb++) wgmma_rs<D, DT, 1>(dv, pa[kb], mn_major_desc(dot, BQ, kb), 1);
            wgmma_commit();
            if constexpr (ping_pong) named_barrier_arrive(PING_PONG_BARRIER + (1 - c), 256);
            fence_registers(dv);
            wgmma_wait<1>();
            fence_registers(dpt);

            dkdv_step_ds<BQ, DT>(st, dpt, dsa, delta4, live, checked);
            wgmma_fence();
#pragma unroll
            for (int kb = 0; kb < BQ / 16; kb++) wgmma_rs<D, DT, 1>(dk, dsa[kb], mn_major_desc(qt, BQ, kb), 1);
            wgmma_commit();
            if constexpr (FUSED_DQ) fused_dq(step);
            else wgmma_wait<0>();
            fence_registers(dv);
            fence_registers(dk);
            mbar_arrive(&bwd.step_empty[s]); /* each thread releases its own loads of the slot's statistics */
        }
        if (ping_pong && c == 0) named_barrier_sync(PING_PONG_BARRIER, 256); /* warpgroup 1's last turn: none pending */
    }

    /* dK (times the softmax scale) and dV of the warp's keys: a TAIL part's fp32 partial results, or the outputs,
       staged where K and V were and written by TMA. */
    AQ_D void epilogue() {
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) dk[n][e] *= bwd.p.softmax_scale;
        if constexpr (Bwd::TAIL) {
            float *part = bwd.ts.part + (int64_t)blockIdx.x * DkdvTailPart<D>::FLOATS;
            store_fragment_rows_f32<D>(dk, part + DkdvTailPart<D>::DK, key0);
            store_fragment_rows_f32<D>(dv, part + DkdvTailPart<D>::DV, key0);
            return;
        }
        store_outputs_tma<D, DT, true>(bwd.nonfinite, DKDV_EPILOGUE_BARRIER, 256,
                                       {BWD90_KEYS, key0, it.k0, it.hk, it.b}, dk, bwd.ks, bwd.tm_dk, dv, bwd.vs,
                                       bwd.tm_dv);
        if (bwd.lane == 0) bulk_wait_read<0>(); /* the CTA's shared memory outlives the copies' reads */
    }
};

/* grid ceil(Nk / 128) Hkv B (work_item_at), 384 threads, or TAIL: a CTA per part of the split last wave's items
   (tail_split, not causal), over query steps [u0, u1) of the item's group heads x ceil(Nq / 64) steps, writing its
   dK and dV to a DkdvTailPart for attention_bwd_dkdv_merge_kernel (the main kernel then skips those items).
   Tensor maps: q, dout (B, Hq, Nq, D) with boxes of 64 rows; k, v (B, Hkv, Nk, D) with boxes of 128 rows; dk, dv
   (the outputs, written through TMA) with boxes of 16 rows. nonfinite: NULL, or a device flag set when dK or dV came
   out Inf or NaN (flag_if_nonfinite; a TAIL part's merge checks its rows). */
template <int D, aq_dtype DT, bool QUANTIZE_DV, bool FUSED_DQ, bool TAIL, bool P_FP16>
__global__ void __launch_bounds__(BWD90_THREADS, 1)
    attention_bwd_dkdv_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_do,
                                   const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                                   const __grid_constant__ CUtensorMap tm_dk, const __grid_constant__ CUtensorMap tm_dv,
                                   const aq_attention_bwd_params p, int *nonfinite, const tail_split ts) {
#if AQ_SM90_ENABLED
    using Bwd = Dkdv90State<D, DT, QUANTIZE_DV, FUSED_DQ, TAIL, P_FP16>;
    constexpr int BQ = Bwd::BQ;
    /* the item's index: a packed call's work order may hand them out longest first (attn_qat.h) */
    const int item = TAIL ? ts.main_items + (int)blockIdx.x / ts.splits
                          : ordered_item(p.work_order, (int)blockIdx.x, (int)gridDim.x);
    if (!TAIL && ts.splits > 1 && item >= ts.main_items) return; /* a tail item (by index): the TAIL kernel's */
    extern __shared__ unsigned char smem_raw[];
    const Bwd bwd(align1024(smem_raw), p, ts, &tm_q, &tm_do, &tm_k, &tm_v, &tm_dk, &tm_dv, nonfinite);

    /* The work item. Here rather than in a function: there its conversion of seqlen_q moved in the SASS. */
    const int nq = (int)p.seqlen_q, nk = (int)p.seqlen_k, group = (int)(p.heads_q / p.heads_kv);
    const work_item wi = work_item_at(item, (nk + BWD90_KEYS - 1) / BWD90_KEYS, (int)p.heads_kv, (int)p.batch,
                                      p.causal, false, p.sm_count);
    const int k0 = wi.tile * BWD90_KEYS, hk = wi.h, b = wi.b;
    /* the query steps [q_begin, q_end) holding a query that sees a key of the tile (the same for every head: masks
       do not move them) */
    const logit_map lm0 = make_logit_map(NULL, p.mask_stride, b, 0, nq, nk, p.causal, p.causal_offset, 0.0f, p.q_span,
                                         p.k_span);
    const int2 queries = key_rows_query_range(&lm0, k0, min(k0 + BWD90_KEYS, nk));
    const int q_begin = queries.x / BQ * BQ, q_end = queries.y;
    const int steps_per_head = max(q_end - q_begin + BQ - 1, 0) / BQ;
    /* the loop's first head and query step, and its number of steps (next_query_step) */
    int h_first = hk * group, q_first = q_begin, n_steps = group * steps_per_head;
    if constexpr (TAIL) { /* not causal: a share of the item's steps, [u0, u1) of its group's heads in turn */
        int u0, u1;
        tail_split_units((int)blockIdx.x % ts.splits, ts.splits, n_steps, &u0, &u1);
        if (u1 > u0) h_first += u0 / steps_per_head, q_first = q_begin + u0 % steps_per_head * BQ;
        n_steps = u1 - u0;
    }
    const dkdv_item it{nq, nk, group, k0, hk, b, q_begin, q_end, h_first, q_first, n_steps};

    if (threadIdx.x == 0) bwd.init_barriers();
    __syncthreads();

    /* The roles' register arrays are declared here, in this order, rather than in the functions that use them:
       an inlined function's arrays come out numbered otherwise, and ptxas then allocates differently. */
    if (bwd.warpgroup == 0) {
        setmaxnreg_dec<24>();
        if (FUSED_DQ && bwd.warp == 1) {
            if (bwd.lane == 0) dkdv90_dq_warp(bwd, it);
            return;
        }
        if (bwd.warp != 0) return;
        float m[BQ / 32], inv_l[BQ / 32], delta[BQ / 32];
        dkdv90_producer(bwd, it, m, inv_l, delta);
        return;
    }
    setmaxnreg_inc<240>();
    float dk[D / 8][4], dv[D / 8][4];
    float st[BQ / 8][4], dpt[BQ / 8][4];
    float4 m4[BQ / 16];
    uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];
    float4 delta4[BQ / 16];
    float dq[D / 16][4];
    Dkdv90Consumer<Bwd> consumer(bwd, it, dk, dv, st, dpt, m4, pa, dsa, delta4, dq);
    consumer.mainloop();
    consumer.epilogue();
#endif
}

/* The deterministic dQ kernel (dq_accum NULL). */
#include "sm90/deterministic_dq.cuh"

/* dQ = scale * the fused dK/dV kernel's sums (dq_accum_chunk's layout), in dtype. grid (ceil(Nq / 64), Hq, B),
   256 threads: warpgroup c converts columns c D/2 .. +D/2 of the step's 64 queries. */
template <int D, aq_dtype DT>
__global__ void __launch_bounds__(256)
    attention_bwd_dq_convert_kernel(const aq_attention_bwd_params p, int *nonfinite) {
    constexpr int DH = D / 2;
    const int c = (int)threadIdx.x / 128, t = (int)threadIdx.x % 128, row0 = 16 * (t / 32);
    const int q0 = (int)blockIdx.x * BWD90_Q_STEP, h = (int)blockIdx.y, b = (int)blockIdx.z;
    const float4 *src =
        (const float4 *)(p.dq_accum + dq_accum_chunk(b, h, p.heads_q, p.seqlen_q, blockIdx.x, c, D)) + t;
    float dq[DH / 8][4];
#pragma unroll
    for (int n = 0; n < DH / 8; n++) {
        const float4 v = src[128 * n];
        dq[n][0] = v.x * p.softmax_scale, dq[n][1] = v.y * p.softmax_scale;
        dq[n][2] = v.z * p.softmax_scale, dq[n][3] = v.w * p.softmax_scale;
    }
    if (nonfinite != NULL) flag_if_nonfinite(dq, nonfinite);
    store_fragment_rows<DH, DT>(dq, (uint16_t *)p.dq + b * p.dq_stride[0] + h * p.dq_stride[1] +
                                        (q0 + row0) * p.dq_stride[2] + c * DH,
                                p.dq_stride[2], (int)p.seqlen_q - q0 - row0);
}

/* ------------------------------------------------------------------------------------------------
   Launcher */

typedef void (*dkdv90_kernel)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const CUtensorMap,
                              const CUtensorMap, const CUtensorMap, const aq_attention_bwd_params, int *,
                              const tail_split);
typedef void (*dq90_kernel)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const CUtensorMap,
                            const aq_attention_bwd_params, int *);

/* P̂'s fp16 path without P^F (high_precision_p) gets its own kernels, so that bf16 mode's carry none of it. */
template <int D, aq_dtype DT, bool FUSED_DQ, bool TAIL>
static dkdv90_kernel dkdv_sm90_kernel(const aq_attention_bwd_params *p) {
    if (p->quantize_p_for_dv) return attention_bwd_dkdv_sm90_kernel<D, DT, true, FUSED_DQ, TAIL, true>;
    return p->p_fp16 ? attention_bwd_dkdv_sm90_kernel<D, DT, false, FUSED_DQ, TAIL, true>
                     : attention_bwd_dkdv_sm90_kernel<D, DT, false, FUSED_DQ, TAIL, false>;
}

template <int D, aq_dtype DT, bool TAIL>
static dkdv90_kernel dkdv_sm90_kernel(const aq_attention_bwd_params *p, bool fused_dq) {
    return fused_dq ? dkdv_sm90_kernel<D, DT, true, TAIL>(p) : dkdv_sm90_kernel<D, DT, false, TAIL>(p);
}

/* The dK/dV kernel's tail split (attention/dispatch.cu plans it): items of 128 keys, not causal (those items differ
   in length and run longest first), parts of 64-query steps over the group's heads. Packed sequences (causal 0,
   attn_qat.h): each part takes its share of its item's own steps; the host caps the parts by every query's steps. */
sm90_tail_shape aq_attention_bwd_sm90_tail_shape(const aq_attention_bwd_params *p) {
    sm90_tail_shape t = {};
    t.items = (p->seqlen_k + BWD90_KEYS - 1) / BWD90_KEYS * p->heads_kv * p->batch;
    if (p->causal || p->seqlen_q == 0) return t;
    t.splittable = t.full_grids = true;
    t.units = p->heads_q / p->heads_kv * ((p->seqlen_q + BWD90_Q_STEP - 1) / BWD90_Q_STEP);
    t.part_floats = with_head_dim(p->head_dim, [](auto d) { return DkdvTailPart<decltype(d)::value>::FLOATS; });
    return t;
}

template <int D, aq_dtype DT>
static const char *launch_bwd_sm90(const aq_attention_bwd_params *p, const aq_attention_plan *plan,
                                   cudaStream_t stream, bool *taken, const int **fallback_flag) {
    const bool fused_dq = p->dq_accum != NULL;
    const dkdv90_kernel dkdv = dkdv_sm90_kernel<D, DT, false>(p, fused_dq);
    const dkdv90_kernel dkdv_tail = dkdv_sm90_kernel<D, DT, true>(p, fused_dq);
    const dq90_kernel dq = p->p_fp16 || p->quantize_p_for_dv ? attention_bwd_dq_sm90_kernel<D, DT, true>
                                                             : attention_bwd_dq_sm90_kernel<D, DT, false>;
    const int dkdv_smem = fused_dq ? DkdvLayout<D, true>::ALLOC : DkdvLayout<D, false>::ALLOC;
    if (!fragment_store_ok(p->dq, p->dq_stride) || !fragment_store_ok(p->dk, p->dk_stride) ||
        !fragment_store_ok(p->dv, p->dv_stride))
        return NULL;
    const bool hidden_terms = p->causal || p->mask != NULL || p->q_span != NULL; /* packed: other sequences' */
    if (hidden_terms && p->scratch == NULL) return NULL;
    /* boxes: Q and dO of 64 rows (dK/dV) and 128 rows (dQ); K and V of 128 rows (dK/dV) and 64 rows (dQ) */
    CUtensorMap q64, do64, k128, v128, q128, do128, k64, v64, dk16, dv16;
    if (!make_tensor_map(&q64, p->q, DT, p->batch, p->heads_q, p->seqlen_q, D, p->q_stride, BWD90_Q_STEP) ||
        !make_tensor_map(&do64, p->dout, DT, p->batch, p->heads_q, p->seqlen_q, D, p->dout_stride, BWD90_Q_STEP) ||
        !make_tensor_map(&k128, p->k, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->k_stride, BWD90_KEYS) ||
        !make_tensor_map(&v128, p->v, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->v_stride, BWD90_KEYS) ||
        !make_tensor_map(&q128, p->q, DT, p->batch, p->heads_q, p->seqlen_q, D, p->q_stride, BWD90_ROWS) ||
        !make_tensor_map(&do128, p->dout, DT, p->batch, p->heads_q, p->seqlen_q, D, p->dout_stride, BWD90_ROWS) ||
        !make_tensor_map(&k64, p->k, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->k_stride, BWD90_K_STEP) ||
        !make_tensor_map(&v64, p->v, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->v_stride, BWD90_K_STEP) ||
        !make_tensor_map(&dk16, p->dk, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->dk_stride, 16) ||
        !make_tensor_map(&dv16, p->dv, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->dv_stride, 16))
        return NULL; /* the mma.sync kernels then run; the ops allocate dK and dV, always in a layout TMA takes */

    /* the dK/dV kernel's copy of the parameters: the work order only where the plan follows it; checked before any
       work is queued, as the forward does */
    const int64_t items = (p->seqlen_k + BWD90_KEYS - 1) / BWD90_KEYS * p->heads_kv * p->batch;
    aq_attention_bwd_params kp = *p;
    if (!plan->use_work_order) kp.work_order = NULL;
    if (kp.work_order != NULL && (kp.work_order_len != items || p->causal))
        return "attention (CUDA): work_order must list the dK/dV kernel's items (128-key tiles a KV head, "
               "attn_qat/varlen.py) and comes only with causal 0";
    cudaError_t err = cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_smem);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(dkdv_tail, cudaFuncAttributeMaxDynamicSharedMemorySize, dkdv_smem);
    if (err == cudaSuccess)
        err = cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, DqLayout<D>::ALLOC);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    if (hidden_terms) { /* a non-finite Q or dO meets hidden terms in dK, K in dQ: the gradients are checked */
        err = cudaMemsetAsync(p->scratch, 0, sizeof(int), stream);
        if (err != cudaSuccess) return cudaGetErrorString(err);
        *fallback_flag = p->scratch;
    }
    int *nonfinite = hidden_terms ? p->scratch : NULL;
    *taken = true;
    if (fused_dq && p->seqlen_q > 0) {
        err = cudaMemsetAsync(p->dq_accum, 0, aq_attention_bwd_sm90_dq_accum_floats(p) * sizeof(float), stream);
        if (err != cudaSuccess) return cudaGetErrorString(err);
    }
    if (p->seqlen_k > 0) {
        const tail_split ts = planned_tail_split(plan, p->tail_workspace);
        dkdv<<<dim3((unsigned)items), BWD90_THREADS, dkdv_smem, stream>>>(q64, do64, k128, v128, dk16, dv16, kp,
                                                                          nonfinite, ts);
        if (ts.splits > 1) {
            dkdv_tail<<<ts.tail_items * ts.splits, BWD90_THREADS, dkdv_smem, stream>>>(q64, do64, k128, v128, dk16,
                                                                                      dv16, kp, nonfinite, ts);
            attention_bwd_dkdv_merge_kernel<D, DT>
                <<<(ts.tail_items * BWD90_KEYS + 3) / 4, 128, 0, stream>>>(*p, ts, nonfinite);
        }
        const char *msg = launch_status();
        if (msg) return msg;
    }
    if (p->seqlen_q > 0 && fused_dq) {
        const dim3 grid((unsigned)((p->seqlen_q + BWD90_Q_STEP - 1) / BWD90_Q_STEP), (unsigned)p->heads_q,
                        (unsigned)p->batch);
        attention_bwd_dq_convert_kernel<D, DT><<<grid, 256, 0, stream>>>(*p, nonfinite);
        return launch_status();
    }
    if (p->seqlen_q > 0) {
        const dim3 grid((unsigned)((p->seqlen_q + BWD90_ROWS - 1) / BWD90_ROWS * p->heads_q * p->batch));
        dq<<<grid, BWD90_THREADS, DqLayout<D>::ALLOC, stream>>>(q128, do128, k64, v64, *p, nonfinite);
        return launch_status();
    }
    return NULL;
}

const char *aq_attention_bwd_sm90(const aq_attention_bwd_params *p, const aq_attention_plan *plan,
                                  cudaStream_t stream, bool *taken, const int **fallback_flag) {
    *taken = false;
    *fallback_flag = NULL;
    if (!aq_sm90_head_dims(p->head_dim, p->head_dim_v)) return NULL; /* the mma.sync kernels take these */
    return with_head_dim_and_dtype(p->head_dim, p->dtype, [&](auto d, auto dt) {
        return launch_bwd_sm90<decltype(d)::value, decltype(dt)::value>(p, plan, stream, taken, fallback_flag);
    });
}
