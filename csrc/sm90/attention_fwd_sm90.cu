/* Attention forward on Hopper (numerics.md §3): the same computation as attention_fwd.cu's mma.sync kernel, on
   warpgroup MMA (wgmma) fed by TMA, with a producer warp and two consumer warpgroups (FlashAttention-3's layout).

   CTA = 3 warpgroups, 128 query rows:
     warpgroup 0, the producer: one thread loads Q once and then K and V tiles (BN keys x D) with TMA into a ring of
       STAGES slots, each guarded by "full" mbarriers (TMA bytes arrived) and an "empty" one (all consumer warps done);
       it gives most of its registers away (setmaxnreg).
     warpgroups 1 and 2, the consumers: 64 query rows each. Per key tile: S = Q K^T (wgmma, both operands in shared
       memory), the online softmax in an integer frame and the P fake-quant in registers (attention/softmax.cuh,
       p_quant.cuh, shared with the mma.sync kernel), then O += P^F V and O' += P̂ V (wgmma, P from registers).
   The accumulator layout of wgmma m64nN is, per warp, the mma.sync C fragment repeated along N, and the register
   A operand is the mma.sync A fragment, so the softmax code and the P fragments are the mma.sync kernel's.
   Rows and keys past the sequence arrive as zeros (TMA bounds); their results are masked or never stored.

   Not handled here, left to the mma.sync kernel by the launcher: an input whose strides or alignment TMA cannot
   take, and hidden keys (causal or masked) whose V rows hold Inf or NaN, which must stay absent (numerics.md §8)
   where this kernel's P V multiplies them by 0: with hidden keys it flags any output that came out non-finite
   (flag_if_nonfinite), and the mma.sync kernel, launched behind it, then does the whole call again. */
#include <algorithm>

#include "attention/dispatch.h"
#include "attention/launch.h"
#include "attention/mask.cuh"
#include "attention/nonfinite.cuh"
#include "attention/scheduler.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_io.cuh"
#include "sm90/epilogue.cuh"
#include "sm90/forward_tail_split.cuh"
#include "sm90/hopper.cuh"
#include "sm90/named_barriers.h"
#include "sm90/tensor_map.h"
#include "sm90/tile_shapes.h"

#define SM90_STAGES 2       /* K/V ring slots */

/* A non-persistent CTA's index in its grid (query tiles fastest, then heads, batch): the order CTAs start in. */
AQ_D int fwd_cta_index() { return (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)); }

/* Shared memory: Q (BM x D), then STAGES K tiles and STAGES V tiles (BN x D), each as D / 64 swizzled panels,
   then the mbarriers and, QUANTIZED, the consumer warps' P block scales (4 bytes x 2 x BN / 32 block pairs x 32
   lanes a warp), then the spans of every consumer warp's 16 rows (store_warp_row_spans). */
template <int D, int BN, int BM, bool QUANTIZED>
struct Sm90Layout {
    static constexpr int Q_BYTES = BM * D * 2, TILE_BYTES = BN * D * 2;
    static constexpr int K_OFFSET = Q_BYTES, V_OFFSET = K_OFFSET + SM90_STAGES * TILE_BYTES;
    static constexpr int BAR_OFFSET = V_OFFSET + SM90_STAGES * TILE_BYTES;
    static constexpr int SCALES_OFFSET = BAR_OFFSET + 8 * (2 + 4 * SM90_STAGES);
    static_assert(SCALES_OFFSET % 16 == 0, "the scales are read as 16-byte vectors");
    static constexpr int SPANS_OFFSET = SCALES_OFFSET + (QUANTIZED ? (BM / 16) * 2 * (BN / 32) * 32 * 4 : 0);
    static constexpr int BYTES = SPANS_OFFSET + BM * 8;
    static_assert(SPANS_OFFSET % 16 == 0, "the spans are read as 16-byte vectors");
    static constexpr int ALLOC = BYTES + 1024; /* the panels need 1024-byte alignment */
};

/* A work item: query rows q0 .. q0 + BM - 1 of head h, batch b, and the key tiles kt0 .. kt0 + n_tiles - 1 it
   reads (a TAIL part's share of them). */
struct fwd_tile {
    int q0, h, b, n_tiles, kt0;
    logit_map lm;
};

/* What every role of the forward kernel reads: the parameters and tensor maps, the shared-memory tiles and
   barriers, this thread's place, and the map from work items to query tiles. The kernel fills it in, before the
   roles split: computed in a constructor, the same values came out in another order and the SASS changed. */
template <int D_, aq_dtype DT_, bool QUANTIZE_P_, bool WITH_O_PRIME_, int NWG_, bool PERSISTENT_, bool TAIL_>
struct Fwd90State {
    static constexpr int D = D_, NWG = NWG_, BN = sm90_keys_per_tile(D_, WITH_O_PRIME_, NWG_), BM = 64 * NWG_;
    static constexpr aq_dtype DT = DT_;
    static constexpr bool QUANTIZE_P = QUANTIZE_P_, WITH_O_PRIME = WITH_O_PRIME_, PERSISTENT = PERSISTENT_,
                          TAIL = TAIL_;
    using L = Sm90Layout<D, BN, BM, QUANTIZE_P>;
    static_assert(QUANTIZE_P || !WITH_O_PRIME, "O' is a separate accumulator only when O uses P^F");
    static_assert(!(TAIL && PERSISTENT), "a tail part is one CTA's");
    static_assert(!WITH_O_PRIME || SM90_STAGES * BN >= BM, "O' is staged in the K ring");
    static_assert(!(QUANTIZE_P && PERSISTENT), "the outputs are staged in Q's and the K ring's shared memory, which a "
                                              "persistent CTA's producer refills for its next item");

    const aq_attention_fwd_params &p;
    const tail_split &ts;
    const CUtensorMap *tm_q, *tm_k, *tm_v, *tm_o, *tm_o2;
    int *nonfinite;
    unsigned char *qs, *ks, *vs;
    /* a consumer warp's P block scales and spans (quantized kernels; the kernel says more) */
    uint32_t *warp_scales;
    const uint32_t *quad_scales;
    int4 *warp_spans;
    uint64_t *q_full, *q_empty, *k_full, *v_full, *k_empty, *v_empty;
    int warpgroup, warp, lane;
    int nq, heads, group, n_qtiles, n_work;

    /* by thread 0, before the CTA's __syncthreads */
    AQ_D void init_barriers() const {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 4 * NWG);
        for (int s = 0; s < SM90_STAGES; s++) {
            mbar_init(&k_full[s], 1);
            mbar_init(&v_full[s], 1);
            mbar_init(&k_empty[s], 4 * NWG); /* lane 0 of each consumer warp */
            mbar_init(&v_empty[s], 4 * NWG);
        }
        mbar_init_fence();
    }

    /* Work item t: a query tile of one head, the longest first when causal. Persistent: causal items in
       descending order over the whole grid (the heads inside), so that the CTAs' static shares stay balanced;
       else the query tiles of one head next to each other, which then read the same K and V from L2. Packed calls
       (causal 0) may bring a work order (item = head * n_qtiles + tile, longest first: attn_qat.h). */
    AQ_D fwd_tile tile_at(int t) const {
        fwd_tile w;
        int qtile;
        if constexpr (TAIL) { /* the main grid's item main_items + t / splits (query tile fastest, then head, batch) */
            const int item = ts.main_items + t / ts.splits, hb = item / n_qtiles;
            qtile = item % n_qtiles, w.h = hb % heads, w.b = hb / heads;
        } else if constexpr (!PERSISTENT) { /* grid (query tiles, heads, batch), t = blockIdx.x */
            if (p.work_order != NULL) { /* the CTA's linear index in the grid picks its table entry */
                const int item = ordered_item(p.work_order, fwd_cta_index(), n_work), hb = item / n_qtiles;
                qtile = item % n_qtiles, w.h = hb % heads, w.b = hb / heads;
            } else {
                qtile = p.causal ? (int)gridDim.x - 1 - t : t;
                w.h = (int)blockIdx.y, w.b = (int)blockIdx.z;
            }
        } else {
            int hb;
            if (p.causal) {
                qtile = n_qtiles - 1 - t / (heads * (int)p.batch), hb = t % (heads * (int)p.batch);
            } else {
                const int item = ordered_item(p.work_order, t, n_work);
                qtile = item % n_qtiles, hb = item / n_qtiles;
            }
            w.h = hb % heads, w.b = hb / heads;
        }
        w.q0 = qtile * BM;
        w.lm = make_logit_map(p.mask, p.mask_stride, w.b, w.h, nq, p.seqlen_k, p.causal, p.causal_offset,
                              p.softmax_scale, p.q_span, p.k_span);
        /* the key tiles holding a key that some row of the item sees */
        const int2 keys = query_rows_key_range(&w.lm, w.q0, min(w.q0 + BM, nq));
        const int first = keys.x / BN, end = (keys.y + BN - 1) / BN;
        w.kt0 = first, w.n_tiles = end - first;
        if constexpr (TAIL) { /* the item's own keys (every key unless packed) in FWD_TAIL_KEYS units, this part's */
            constexpr int PER_UNIT = FWD_TAIL_KEYS / BN;
            const int unit0 = keys.x / FWD_TAIL_KEYS;
            int u0, u1;
            tail_split_units(t % ts.splits, ts.splits, (keys.y + FWD_TAIL_KEYS - 1) / FWD_TAIL_KEYS - unit0, &u0, &u1);
            w.kt0 = max((unit0 + u0) * PER_UNIT, first);
            w.n_tiles = max(min((unit0 + u1) * PER_UNIT, end) - w.kt0, 0);
        }
        return w;
    }

    /* fn(t, first K/V slot, item count) for each of the CTA's items; one item (t = blockIdx.x) unless
       PERSISTENT, which the quantized kernels are not: the loop's state costs them registers (performance.md) */
    template <class Fn>
    AQ_D void for_each_item(Fn &&fn) const {
        if constexpr (PERSISTENT) {
            unsigned ring = 0;
            int it = 0;
            for (int t = (int)blockIdx.x; t < n_work; t += (int)gridDim.x, it++) ring += fn(t, ring, it);
        } else {
            fn((int)blockIdx.x, 0u, 0);
        }
    }
};

/* The producer, one thread: each item's Q, then its K and V tiles into the ring as the consumers free its slots.
   A function of its own: it runs in the producer warpgroup's few registers (setmaxnreg) and shares only the state. */
template <class Fwd>
AQ_D void fwd90_producer(const Fwd &fwd) {
    constexpr int D = Fwd::D, BN = Fwd::BN;
    using L = typename Fwd::L;
    tma_prefetch_descriptor(fwd.tm_q);
    tma_prefetch_descriptor(fwd.tm_k);
    tma_prefetch_descriptor(fwd.tm_v);
    if constexpr (Fwd::QUANTIZE_P && !Fwd::TAIL) {
        tma_prefetch_descriptor(fwd.tm_o);
        if constexpr (Fwd::WITH_O_PRIME) tma_prefetch_descriptor(fwd.tm_o2);
    }
    /* work item t, its K/V slots from ring on, the CTA's it-th item; returns its key tiles */
    auto produce = [&](int t, unsigned ring, int it) {
        const fwd_tile w = fwd.tile_at(t);
        const int hk = w.h / fwd.group;
        /* the next Q once every consumer warp is done with the last S of the previous item */
        if (Fwd::PERSISTENT) mbar_wait(fwd.q_empty, (it & 1) ^ 1);
        mbar_arrive_expect_tx(fwd.q_full, L::Q_BYTES);
        tma_load_rows<D>(fwd.qs, fwd.tm_q, fwd.q_full, Fwd::BM, w.q0, w.h, w.b);
        for (int j = 0; j < w.n_tiles; j++, ring++) {
            const int s = ring % SM90_STAGES;
            const unsigned phase = ((ring / SM90_STAGES) & 1) ^ 1;
            /* K and V slots free up separately: K(j) once S(j) is done, V(j) once P(j) V is */
            mbar_wait(&fwd.k_empty[s], phase);
            mbar_arrive_expect_tx(&fwd.k_full[s], L::TILE_BYTES);
            tma_load_rows<D>(fwd.ks + s * L::TILE_BYTES, fwd.tm_k, &fwd.k_full[s], BN, (w.kt0 + j) * BN, hk, w.b);
            mbar_wait(&fwd.v_empty[s], phase);
            mbar_arrive_expect_tx(&fwd.v_full[s], L::TILE_BYTES);
            tma_load_rows<D>(fwd.vs + s * L::TILE_BYTES, fwd.tm_v, &fwd.v_full[s], BN, (w.kt0 + j) * BN, hk, w.b);
        }
        return w.n_tiles;
    };
    fwd.for_each_item(produce);
}

/* The stages of fwd90_mainloop's software pipeline over key tiles, as named force-inlined members (they were its
   lambdas). Every member is a reference to a local of fwd90_mainloop, as the lambdas' captures were: members that
   held the arrays or values themselves changed the SASS. */
template <class Fwd>
struct Fwd90Mainloop {
    static constexpr int D = Fwd::D, BN = Fwd::BN, BM = Fwd::BM;
    static constexpr aq_dtype DT = Fwd::DT;
    static constexpr bool QUANTIZE_P = Fwd::QUANTIZE_P, WITH_O_PRIME = Fwd::WITH_O_PRIME,
                          PERSISTENT = Fwd::PERSISTENT;
    using L = typename Fwd::L;
    using hat_regs = uint32_t[WITH_O_PRIME ? BN / 16 : 1][4];

    const Fwd &fwd;
    const unsigned &ring;
    const logit_map &lm;
    const int &q0, &n_tiles, &k0, &wrow, &row0, &lane;
    float (&o)[D / 8][4];
    float (&o2)[D / 8][4];
    float (&m)[2];
    float (&l)[2];
    bool (&seen)[2];
    float (&sc)[BN / 8][4];
    uint32_t (&a_o)[BN / 16][4];
    hat_regs &a_hat;
    const int2 &common;
    uint32_t (&p_scales)[QUANTIZE_P ? BN / 32 : 1];
    uint32_t (&p_recips)[QUANTIZE_P ? BN / 32 : 1];

    AQ_D int slot(int j) const { return (int)((ring + j) % SM90_STAGES); }
    AQ_D int phase(int j) const { return ((ring + j) / SM90_STAGES) & 1; }
    /* S(j) has landed: its K slot is free, and after the item's last S so is Q */
    AQ_D void scores_done(int j) {
        fence_registers(sc);
        if (lane == 0) {
            mbar_arrive(&fwd.k_empty[slot(j)]);
            if (PERSISTENT && j == n_tiles - 1) mbar_arrive(fwd.q_empty);
        }
    }
    AQ_D void issue_scores(int j) { /* S = Q K^T of tile j into sc, one commit group */
        const int s = slot(j);
        mbar_wait(&fwd.k_full[s], phase(j));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<BN, DT, 0>(sc, k_major_desc(fwd.qs, BM, wrow, kk),
                                k_major_desc(fwd.ks + s * L::TILE_BYTES, BN, 0, kk), kk > 0);
        wgmma_commit();
    }
    AQ_D bool needs_mask(int j) const { return tile_needs_mask(&lm, common, k0 + j * BN, BN); }
    AQ_D void softmax_scores(int j, bool masked, float alpha[2]) {
        scores_to_logits<BN>(&lm, sc, q0 + row0, k0 + j * BN, masked, seen, fwd.warp_spans);
        if constexpr (QUANTIZE_P) {
            online_softmax_p_scales<BN, DT, D >= 128, WITH_O_PRIME>(sc, m, l, alpha, lm.exp_scale, p_recips, p_scales);
            __syncwarp(); /* the last tile's reads are done */
#pragma unroll
            for (int pp = 0; pp < BN / 32; pp++) {
                fwd.warp_scales[pp * 32 + lane] = p_recips[pp];
                fwd.warp_scales[(BN / 32 + pp) * 32 + lane] = p_scales[pp];
            }
            __syncwarp();
        } else {
            online_softmax_scores<BN, false>(sc, m, l, alpha, lm.exp_scale);
        }
    }
    AQ_D void pack_scores(uint32_t (&a)[BN / 16][4]) { /* P̂ for P V (bf16 mode) */
#pragma unroll
        for (int kb = 0; kb < BN / 16; kb++) pack_a_from_c<DT>(a[kb], sc[2 * kb], sc[2 * kb + 1]);
    }
    AQ_D void quantize_scores() { /* w pairs in sc -> the E2M1 roundings of w / s, for pack_p */
#pragma unroll
        for (int bp = 0; bp < BN / 32; bp++) p_round_block_pair<BN>(sc, bp, *(const uint4 *)&fwd.quad_scales[bp * 32]);
    }
    /* P^F * 2^11 into a_o from quantize_scores' roundings, and with O' P̂ into a_hat (hat_pair's place in sc) */
    AQ_D void pack_p() {
#pragma unroll
        for (int bp = 0; bp < BN / 32; bp++) {
            const uint4 quad_s = *(const uint4 *)&fwd.quad_scales[(BN / 32 + bp) * 32];
            pack_quantized_p_pair<BN, DT>(a_o[2 * bp], a_o[2 * bp + 1], sc, bp, quad_s);
        }
        if constexpr (WITH_O_PRIME)
#pragma unroll
            for (int n = 0; n < BN / 8; n++)
#pragma unroll
                for (int r = 0; r < 2; r++) a_hat[n / 2][2 * (n & 1) + r] = scale_hat_pair<DT>(hat_pair<BN>(sc, n, r));
    }

    /* O += P V, O' += P̂ V for tile j: one 16-key block of P (two C fragments = one A fragment) per wgmma */
    AQ_D void issue_pv(int j) {
        const int s = slot(j);
        const unsigned char *vt = fwd.vs + s * L::TILE_BYTES;
        mbar_wait(&fwd.v_full[s], phase(j));
        wgmma_fence();
#pragma unroll
        for (int kb = 0; kb < BN / 16; kb++) {
            wgmma_rs<D, DT, 1>(o, a_o[kb], mn_major_desc(vt, BN, kb), 1);
            if constexpr (WITH_O_PRIME) wgmma_rs<D, DT, 1>(o2, a_hat[kb], mn_major_desc(vt, BN, kb), 1);
        }
        wgmma_commit();
    }
    AQ_D void finish_pv(int j) { /* waits for every group; V(j) is then consumed */
        wgmma_wait<0>();
        fence_registers(o);
        /* the A operands stay live up to here, so no other value is given their registers while the wgmma
           may still read them (else ptxas serializes every wgmma: warning C7513) */
        fence_registers(a_o);
        if constexpr (WITH_O_PRIME) fence_registers(o2), fence_registers(a_hat);
        if (lane == 0) mbar_arrive(&fwd.v_empty[slot(j)]);
    }

    /* the elementwise part of step for tile j + 1: its softmax and the roundings in sc (and P̂(j+1) there) */
    AQ_D void elementwise(int j, bool masked, float alpha[2]) {
        softmax_scores(j + 1, masked, alpha);
        quantize_scores();
    }
    /* one step: P(j) V, while tile j+1 becomes P^F(j+1)'s roundings (and P̂(j+1)) in sc */
    AQ_D void step(int j) {
        issue_scores(j + 1);
        issue_pv(j);
        float alpha[2];
        wgmma_wait<1>(); /* groups complete in order: S(j+1) before P(j) V */
        scores_done(j + 1);
        const bool masked = needs_mask(j + 1);
        /* The whole elementwise part inside both arms of the mask test: ptxas puts the wait for P(j) V at
           the top of the basic block after the arms, so a softmax there would run after it and overlap
           nothing. With O' at D = 128 this costs spills, still less than waiting first (performance.md v7). */
        if (masked) elementwise(j, true, alpha);
        else elementwise(j, false, alpha);
        finish_pv(j);
        rescale_rows<D>(o, alpha);
        if constexpr (WITH_O_PRIME) rescale_rows<D>(o2, alpha);
        pack_p();
    }

    /* the whole mainloop of the CTA's it-th item */
    AQ_D void run(int it) {
        mbar_wait(fwd.q_full, it & 1);
        if (PERSISTENT && n_tiles == 0 && lane == 0) mbar_arrive(fwd.q_empty);
        if constexpr (!QUANTIZE_P) {
            /* Unquantized (bf16 mode): too little FP32 work per tile to hide, and the pipeline's extra waits and
               register copies cost more than they save (performance.md v4). */
            for (int j = 0; j < n_tiles; j++) {
                float alpha[2];
                issue_scores(j);
                wgmma_wait<0>();
                scores_done(j);
                softmax_scores(j, needs_mask(j), alpha);
                pack_scores(a_o);
                rescale_rows<D>(o, alpha);
                issue_pv(j);
                finish_pv(j);
            }
        } else {
            /* P(j) V is in flight while S(j+1) lands and becomes P^F(j+1)'s roundings in sc; only the packing
               into the A registers waits for P(j) V to finish reading them. */
            if (n_tiles > 0) {
                float alpha[2]; /* the accumulators are still 0: nothing to rescale */
                issue_scores(0);
                wgmma_wait<0>();
                scores_done(0);
                softmax_scores(0, needs_mask(0), alpha);
                quantize_scores();
                pack_p();
            }
            for (int j = 0; j + 1 < n_tiles; j++) step(j);
            if (n_tiles > 0) {
                issue_pv(n_tiles - 1);
                finish_pv(n_tiles - 1);
            }
        }
    }
};

/* The consumer warp's mainloop over an item's key tiles (the CTA's it-th item, its first K/V slot ring; queries
   q0 + row0 .. + 15 of the warp, q0 + wrow .. + 63 of its warpgroup; n_tiles key tiles from key k0): O (and O')
   in o (o2), the online softmax's row frames m, sums l and seen flags. q0, n_tiles and k0 come as the consumer
   computed them: taking its fwd_tile instead and reading them here changed the SASS. */
template <class Fwd>
AQ_D void fwd90_mainloop(const Fwd &fwd, unsigned ring, int it, const logit_map &lm, int q0, int n_tiles, int k0,
                         int wrow, int row0, float (&o)[Fwd::D / 8][4], float (&o2)[Fwd::D / 8][4], float (&m)[2],
                         float (&l)[2], bool (&seen)[2]) {
    using ML = Fwd90Mainloop<Fwd>;
    constexpr int BN = Fwd::BN;
    const int lane = fwd.lane;
    /* Software pipeline over key tiles: S(j+1) is issued before P(j) V, and the softmax and P fake-quant of
       tile j+1 run on the FP32 pipe while the tensor cores compute P(j) V. The accumulators are rescaled by the
       frame step of tile j+1 only once P(j) V has landed in them. */
    float sc[BN / 8][4];
    /* P of the tile whose P V is next: P^F (or P̂ in bf16 mode) in a_o, and for O' P̂ in a_hat, both packed once
       P(j) V has read the last ones (pack_p): till then the tile's values wait in sc, the next S's accumulator */
    uint32_t a_o[BN / 16][4];
    typename ML::hat_regs a_hat;
    /* the online softmax of tile j: scores in sc become P̂ (fp32, in place; quantized: fp16 pairs of w = P̂ * 2^11,
       in place, and with O' P̂ in DT in a_hat or a_hat2); alpha: the rescale the accumulators owe.
       Then, apart, since the pipeline runs them at different times: w turned into its E2M1 roundings in place
       (quantize_scores), and those packed into the A operand of O += P V (pack_p, which scales them into
       P^F * 2^11, exact in 16 bits). */
    const int2 common = rows_common_keys(&lm, q0 + wrow, 64); /* the keys every row of the warpgroup sees */
    /* quantized: the lane's block scale (a DT pair, for pack_p) and reciprocal (for quantize_scores) of each
       block pair (online_softmax_p_scales), stored to fwd.warp_scales */
    uint32_t p_scales[Fwd::QUANTIZE_P ? BN / 32 : 1];
    uint32_t p_recips[Fwd::QUANTIZE_P ? BN / 32 : 1];
    ML{fwd, ring, lm, q0, n_tiles, k0, wrow, row0, lane, o, o2, m, l, seen, sc, a_o, a_hat, common,
       p_scales, p_recips}
        .run(it);
}

/* The item's outputs from the consumer warp's rows: a TAIL part's partial results, or O (and O') normalized and
   the rows' statistics, through TMA from shared memory (quantized) or straight from the registers (bf16 mode). */
template <class Fwd>
AQ_D void fwd90_epilogue(const Fwd &fwd, const fwd_tile &w, int row0, float (&o)[Fwd::D / 8][4],
                         float (&o2)[Fwd::D / 8][4], const float (&m)[2], const float (&l)[2], const bool (&seen)[2]) {
    constexpr int D = Fwd::D, BM = Fwd::BM;
    constexpr aq_dtype DT = Fwd::DT;
    constexpr bool QUANTIZE_P = Fwd::QUANTIZE_P, WITH_O_PRIME = Fwd::WITH_O_PRIME;
    const aq_attention_fwd_params &p = fwd.p;
    const int nq = fwd.nq, q0 = w.q0, h = w.h, b = w.b;
    if constexpr (Fwd::TAIL) {
        store_fwd_tail_part<D, BM, WITH_O_PRIME>(o, o2, m, l, seen, fwd.ts.part, (int)blockIdx.x, row0);
        return;
    }
    const int64_t stat0 = ((int64_t)b * p.heads_q + h) * nq;
    finish_forward_rows<D, WITH_O_PRIME>(o, o2, m, l, seen, QUANTIZE_P ? AQ_P_HEADROOM_INV : 1.0f,
                                         p.frame_m + stat0, p.row_sum + stat0, q0 + row0, nq);
    if constexpr (QUANTIZE_P) {
        /* O staged where Q was and O' where the K ring was, once every consumer warp is done with its
           products (a warpgroup's S reads its 64 rows of Q and all of a K slot) */
        store_outputs_tma<D, DT, WITH_O_PRIME>(fwd.nonfinite, FWD_EPILOGUE_BARRIER, 128 * Fwd::NWG,
                                               {BM, row0, q0, h, b}, o, fwd.qs, fwd.tm_o, o2, fwd.ks, fwd.tm_o2);
        if (fwd.lane == 0) bulk_wait_read<0>(); /* the CTA's shared memory outlives the copies' reads */
        return;
    }
    if (fwd.nonfinite != NULL) flag_if_nonfinite(o, fwd.nonfinite); /* bf16 mode: no O' */
    const int valid = nq - q0 - row0;
    uint16_t *og0 = (uint16_t *)p.o + b * p.o_stride[0] + h * p.o_stride[1] + (q0 + row0) * p.o_stride[2];
    store_fragment_rows<D, DT>(o, og0, p.o_stride[2], valid);
    if (p.o_prime) {
        uint16_t *og = (uint16_t *)p.o_prime + b * p.o_prime_stride[0] + h * p.o_prime_stride[1] +
                       (q0 + row0) * p.o_prime_stride[2];
        store_fragment_rows<D, DT>(WITH_O_PRIME ? o2 : o, og, p.o_prime_stride[2], valid);
    }
}

/* The consumer warps: per item, its accumulators, the mainloop over its key tiles and the epilogue. Warpgroup c
   owns CTA rows 64c .. 64c+63, its warp w rows 64c + 16w .. +15. */
template <class Fwd>
AQ_D void fwd90_consumer(const Fwd &fwd) {
    constexpr int D = Fwd::D;
    const int c = fwd.warpgroup - 1, wrow = 64 * c, row0 = wrow + 16 * (fwd.warp % 4);
    auto consume = [&](int t, unsigned ring, int it) { /* as fwd90_producer's produce */
        const fwd_tile w = fwd.tile_at(t);
        const int q0 = w.q0, n_tiles = w.n_tiles, k0 = w.kt0 * Fwd::BN;
        const logit_map lm = w.lm;
        store_warp_row_spans(&lm, q0 + row0, fwd.warp_spans); /* after the last item's reads: the warp's own */
        float o[D / 8][4], o2[D / 8][4]; /* o2: O', unused (and optimised away) without WITH_O_PRIME */
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[n][e] = o2[n][e] = 0.0f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        bool seen[2] = {false, false};
        fwd90_mainloop(fwd, ring, it, lm, q0, n_tiles, k0, wrow, row0, o, o2, m, l, seen);
        fwd90_epilogue(fwd, w, row0, o, o2, m, l, seen);
        return n_tiles;
    };
    fwd.for_each_item(consume);
}

/* A CTA per work item (a query tile of one head), or PERSISTENT: a CTA an SM, each taking every gridDim.x-th
   item, so that the producer loads the next item's Q while the consumers store the last one's outputs and the
   K/V ring runs on across items (performance.md, "Measurements behind choices in the code").
   TAIL: a CTA per part of the split last wave's items (tail_split, not causal): its key tiles are those of its
   FWD_TAIL_KEYS-key units [u0, u1) of the keys the item sees, and it writes its rows' partial results (FwdTailPart) for
   attention_fwd_merge_kernel; the main kernel then skips those items.
   128 (NWG + 1) threads. Tensor maps: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), boxes of 64 columns x 64 NWG (Q)
   or BN (K, V) tokens; o and o2 (the outputs O and O', boxes of 16 rows: the quantized kernels write them through
   TMA; o2 unused without O', both unused in bf16 mode). nonfinite: NULL, or a device flag set when an output came out
   Inf or NaN (flag_if_nonfinite; not checked in a TAIL part: its merge checks the rows). */
template <int D, aq_dtype DT, bool QUANTIZE_P, bool WITH_O_PRIME, int NWG, bool PERSISTENT, bool TAIL>
__global__ void __launch_bounds__(128 * (NWG + 1), 1)
    attention_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                              const __grid_constant__ CUtensorMap tm_v, const __grid_constant__ CUtensorMap tm_o,
                              const __grid_constant__ CUtensorMap tm_o2, const aq_attention_fwd_params p,
                              int *nonfinite, const tail_split ts) {
#if AQ_SM90_ENABLED
    constexpr int BN = sm90_keys_per_tile(D, WITH_O_PRIME, NWG), SM90_BM = 64 * NWG;
    using L = Sm90Layout<D, BN, SM90_BM, QUANTIZE_P>;
    if (!PERSISTENT && !TAIL && ts.splits > 1 &&
        ordered_item(p.work_order, fwd_cta_index(), (int)(gridDim.x * gridDim.y * gridDim.z)) >= ts.main_items)
        return; /* a tail item (by its index, whatever the order): the TAIL kernel's */
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = align1024(smem_raw);
    unsigned char *qs = smem, *ks = smem + L::K_OFFSET, *vs = smem + L::V_OFFSET;
    uint64_t *bars = (uint64_t *)(smem + L::BAR_OFFSET);
    /* a consumer warp's P block scales (quantized kernels): reciprocals, then DT scale pairs, each [block pair][lane].
       Each lane computes one row-block's and needs its quad's four: a 16-byte load each, where shuffles took 8 a
       block pair (performance.md v12). Set here, before the roles split: computed in the consumer branch, the
       pointer made the inference kernel spill more. The producer warps, which never use it, get warp 4's.
       quad_scales: the entries of the lane's quad, one base for every block pair's load, whose offsets then fold
       into the load instructions (indexed from warp_scales, each block pair's address took a register of its own,
       and the inference kernel spilled them; performance.md has the counts). */
    uint32_t *warp_scales = (uint32_t *)(smem + L::SCALES_OFFSET) +
                            max((int)threadIdx.x / 32 - 4, 0) * 2 * (BN / 32) * 32;
    const uint32_t *quad_scales = warp_scales + ((int)threadIdx.x & 28);
    int4 *warp_spans = (int4 *)(smem + L::SPANS_OFFSET) + max((int)threadIdx.x / 32 - 4, 0) * 8;
    uint64_t *q_full = bars, *q_empty = bars + 1, *k_full = bars + 2, *v_full = k_full + SM90_STAGES,
             *k_empty = v_full + SM90_STAGES, *v_empty = k_empty + SM90_STAGES;
    const int warpgroup = warpgroup_index(), warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int nq = (int)p.seqlen_q, heads = (int)p.heads_q, group = (int)(p.heads_q / p.heads_kv);
    const int n_qtiles = (nq + SM90_BM - 1) / SM90_BM, n_work = n_qtiles * heads * (int)p.batch;
    const Fwd90State<D, DT, QUANTIZE_P, WITH_O_PRIME, NWG, PERSISTENT, TAIL> fwd{
        p, ts, &tm_q, &tm_k, &tm_v, &tm_o, &tm_o2, nonfinite,
        qs, ks, vs, warp_scales, quad_scales, warp_spans, q_full, q_empty, k_full, v_full, k_empty, v_empty,
        warpgroup, warp, lane, nq, heads, group, n_qtiles, n_work};
    if (threadIdx.x == 0) fwd.init_barriers();
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<24>();
        if (warp == 0 && lane == 0) fwd90_producer(fwd);
        return;
    }
    setmaxnreg_inc<NWG == 3 ? 160 : 240>(); /* 128 x 24 + 128 NWG x this <= 64K registers */
    fwd90_consumer(fwd);
#endif
}

/* ------------------------------------------------------------------------------------------------
   Launcher */

bool aq_sm90_kernels_run_here(void) {
#ifndef AQ_BUILT_SM90A
    return false; /* no sm_90a image: the kernels' bodies were compiled empty */
#else
    const void *kernel = (const void *)attention_fwd_sm90_kernel<128, AQ_BFLOAT16, true, false, 2, false, true>;
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
        cudaGetLastError(); /* no sm_90a code in this build: not an error of the caller's */
        return false;
    }
    return attr.binaryVersion >= 90;
#endif
}

/* The forward's tail split (attention/dispatch.cu plans it): the quantized kernels' items of 128 query rows, not
   causal (those items differ in length and run longest first), parts of FWD_TAIL_KEYS-key units. Packed sequences
   come with causal 0 whatever their rule (attn_qat.h): each part then takes its share of its item's own keys, and
   the host, which cannot see those, caps the parts by all the keys' units (a part of a short item may get none). The
   D = 64 inference forward splits only a grid of less than one wave, where the parts fill idle SMs: with more waves
   its split costs more than it saves, unlike the D = 128 one's (performance.md v19). */
sm90_tail_shape aq_attention_fwd_sm90_tail_shape(const aq_attention_fwd_params *p) {
    static_assert(64 * sm90_consumer_warpgroups(64, true) == FWD_TAIL_BM &&
                      64 * sm90_consumer_warpgroups(128, true) == FWD_TAIL_BM &&
                      64 * sm90_consumer_warpgroups(256, true) == FWD_TAIL_BM,
                  "the quantized kernels' items are FWD_TAIL_BM query rows");
    sm90_tail_shape t = {};
    t.items = (p->seqlen_q + FWD_TAIL_BM - 1) / FWD_TAIL_BM * p->heads_q * p->batch;
    if (!p->quantize_p || p->causal) return t;
    t.splittable = true;
    t.units = (p->seqlen_k + FWD_TAIL_KEYS - 1) / FWD_TAIL_KEYS;
    t.full_grids = p->o_prime != NULL || p->head_dim >= 128;
    t.part_floats = p->head_dim == 256 ? FwdTailPart<256, FWD_TAIL_BM, false>::FLOATS /* no O' at 256 */
                                       : with_head_dim(p->head_dim, [&](auto d) {
                                             constexpr int D = decltype(d)::value;
                                             return p->o_prime ? FwdTailPart<D, FWD_TAIL_BM, true>::FLOATS
                                                               : FwdTailPart<D, FWD_TAIL_BM, false>::FLOATS;
                                         });
    return t;
}

template <int D, aq_dtype DT, bool QUANTIZE_P, bool WITH_O_PRIME>
static const char *launch_sm90(const aq_attention_fwd_params *p, const aq_attention_plan *plan, cudaStream_t stream,
                               bool *taken, const int **fallback_flag) {
    constexpr int NWG = sm90_consumer_warpgroups(D, QUANTIZE_P);
    constexpr bool PERSISTENT = !QUANTIZE_P;
    using kernel_t = void (*)(const CUtensorMap, const CUtensorMap, const CUtensorMap, const CUtensorMap,
                              const CUtensorMap, const aq_attention_fwd_params, int *, const tail_split);
    kernel_t kernel = attention_fwd_sm90_kernel<D, DT, QUANTIZE_P, WITH_O_PRIME, NWG, PERSISTENT, false>;
    constexpr int BN = sm90_keys_per_tile(D, WITH_O_PRIME, NWG), SM90_BM = 64 * NWG, SM90_THREADS = 128 * (NWG + 1);
    if (!fragment_store_ok(p->o, p->o_stride) || !fragment_store_ok(p->o_prime, p->o_prime_stride)) return NULL;
    /* hidden keys whose V is not finite need the mma.sync kernel's scrubbing: the outputs are checked (packed
       sequences hide the other sequences' keys, causal or not) */
    const bool hidden_keys = p->causal || p->mask != NULL || p->q_span != NULL;
    if (hidden_keys && p->scratch == NULL) return NULL;
    CUtensorMap tm_q, tm_k, tm_v, tm_o, tm_o2;
    if (!make_tensor_map(&tm_q, p->q, DT, p->batch, p->heads_q, p->seqlen_q, D, p->q_stride, SM90_BM) ||
        !make_tensor_map(&tm_k, p->k, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->k_stride, BN) ||
        !make_tensor_map(&tm_v, p->v, DT, p->batch, p->heads_kv, p->seqlen_k, D, p->v_stride, BN))
        return NULL;
    tm_o = tm_o2 = tm_q; /* unused by the bf16-mode kernels */
    if (QUANTIZE_P &&
        (!make_tensor_map(&tm_o, p->o, DT, p->batch, p->heads_q, p->seqlen_q, D, p->o_stride, 16) ||
         (WITH_O_PRIME &&
          !make_tensor_map(&tm_o2, p->o_prime, DT, p->batch, p->heads_q, p->seqlen_q, D, p->o_prime_stride, 16))))
        return NULL; /* the mma.sync kernel then runs; the ops allocate the outputs, always in a layout TMA takes */

    const int64_t q_tiles = (p->seqlen_q + SM90_BM - 1) / SM90_BM, work = q_tiles * p->heads_q * p->batch;
    aq_attention_fwd_params kp = *p; /* the kernels' copy: the work order only where the plan follows it */
    if (!plan->use_work_order) kp.work_order = NULL;
    if (kp.work_order != NULL && (kp.work_order_len != work || p->causal))
        return "attention (CUDA): work_order must list the forward kernel's items (query tiles of 64 x its consumer "
               "warpgroups rows a head, attn_qat/varlen.py) and comes only with causal 0";
    tail_split ts = {(int)work, 0, 1, NULL};
    kernel_t tail_kernel = NULL;
    if constexpr (QUANTIZE_P) {
        ts = planned_tail_split(plan, p->tail_workspace);
        tail_kernel = attention_fwd_sm90_kernel<D, DT, QUANTIZE_P, WITH_O_PRIME, NWG, false, true>;
    }
    const int smem = Sm90Layout<D, BN, SM90_BM, QUANTIZE_P>::ALLOC;
    cudaError_t err;
    for (kernel_t k : {kernel, tail_kernel})
        if (k != NULL && (err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) != cudaSuccess)
            return cudaGetErrorString(err);
    if (hidden_keys) {
        err = cudaMemsetAsync(p->scratch, 0, sizeof(int), stream);
        if (err != cudaSuccess) return cudaGetErrorString(err);
        *fallback_flag = p->scratch;
    }
    int *nonfinite = hidden_keys ? p->scratch : NULL;
    const dim3 grid = PERSISTENT ? dim3((unsigned)std::min<int64_t>(work, plan->sm_count))
                                 : dim3((unsigned)q_tiles, (unsigned)p->heads_q, (unsigned)p->batch);
    kernel<<<grid, SM90_THREADS, smem, stream>>>(tm_q, tm_k, tm_v, tm_o, tm_o2, kp, nonfinite, ts);
    if (ts.splits > 1) {
        tail_kernel<<<ts.tail_items * ts.splits, SM90_THREADS, smem, stream>>>(tm_q, tm_k, tm_v, tm_o, tm_o2, kp,
                                                                               nonfinite, ts);
        attention_fwd_merge_kernel<D, DT, WITH_O_PRIME>
            <<<(ts.tail_items * FWD_TAIL_BM + 3) / 4, 128, 0, stream>>>(*p, ts, nonfinite);
    }
    *taken = true;
    return launch_status();
}

template <int D, aq_dtype DT>
static const char *launch_sm90_mode(const aq_attention_fwd_params *p, const aq_attention_plan *plan,
                                    cudaStream_t stream, bool *taken, const int **fallback_flag) {
    if (!p->quantize_p) return launch_sm90<D, DT, false, false>(p, plan, stream, taken, fallback_flag);
    if (p->o_prime) {
        if constexpr (D == 256) /* O and O' do not fit a thread's registers (aq_sm90_forward_head_dims) */
            return "attention (CUDA): no Hopper forward makes O' at head dim 256";
        else
            return launch_sm90<D, DT, true, true>(p, plan, stream, taken, fallback_flag);
    }
    return launch_sm90<D, DT, true, false>(p, plan, stream, taken, fallback_flag);
}

const char *aq_attention_fwd_sm90(const aq_attention_fwd_params *p, const aq_attention_plan *plan,
                                  cudaStream_t stream, bool *taken, const int **fallback_flag) {
    *taken = false;
    *fallback_flag = NULL;
    /* the plan has applied the options; the mma.sync kernels take what is left */
    if (!aq_sm90_forward_head_dims(p->head_dim, p->head_dim_v, p->quantize_p && p->o_prime != NULL, 1)) return NULL;
    const auto launch = [&](auto d, auto dt) {
        return launch_sm90_mode<decltype(d)::value, decltype(dt)::value>(p, plan, stream, taken, fallback_flag);
    };
    if (p->head_dim == 256)
        return with_dtype(p->dtype, [&](auto dt) { return launch(std::integral_constant<int, 256>(), dt); });
    return with_head_dim_and_dtype(p->head_dim, p->dtype, launch);
}
