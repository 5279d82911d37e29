/* Decode attention on an NVFP4 KV cache (attn_qat.NVFP4KVCache; attn_qat.h has the pools' layout): the mainloop over
   a chunk's units, kv_decode_kernel, and the plan and launchers. Work split, layout and fragment order:
   docs/kv_cache_layout.md. */
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "attention/fragments.cuh"
#include "attention/launch.h"
#include "attention/softmax.cuh"
#include "decode/chunk_merge.cuh"
#include "decode/decode_geometry.cuh"
#include "decode/unit_load.cuh"
#include "decode/unit_mma.cuh"

/* ------------------------------------------------------------------------------------------------
   The CTA's pieces: its variant, its start, the warps' loop and the step of a unit */

/* kv_decode_kernel's variants, bits of its FLAGS (aq_kv_cache_decode_plan_cuda picks one a call):
   - DEC_LAST_CTA_MERGE: the last CTA of a (row tile, KV head, sequence) to finish merges the chunks' partial results
     (merge_chunks) instead of decode_combine_kernel, and the CTA of a one-chunk sequence writes O itself.
   - DEC_EARLY_START: the sequence's length, the chunk's block-table entries and the raw Q are loaded side by side,
     so the first copies wait for one global load rather than two in a row. */
enum { DEC_LAST_CTA_MERGE = 1, DEC_EARLY_START = 2, DEC_VARIANTS = AQ_DECODE_VARIANTS };
static_assert(DEC_MIN_CHUNK == AQ_DECODE_CHUNK_STEP, "the options' chunk step is a step's keys");

/* n / d for 0 <= n < 2^31 and a run-time d >= 1 by a multiplier the host picks (make): a multiply-high and two
   shifts, where a division by a run-time value first builds a reciprocal (a dozen instructions in a row, in every
   CTA's start before its first copies). With s = ceil(log2 d) and m = ceil(2^(31+s) / d) < 2^32, m d = 2^(31+s) + e
   with 0 <= e < d <= 2^s, so m n / 2^(31+s) = n / d + e n / (d 2^(31+s)) with e n < 2^(31+s): below the next
   multiple of 1/d, so the floors agree. */
struct DecodeDivisor {
    uint32_t d, magic, shift;
    static DecodeDivisor make(uint32_t d) {
        uint32_t s = 0;
        while (s < 31 && (1u << s) < d) s++;
        return {d, (uint32_t)((((uint64_t)1 << (31 + s)) + d - 1) / d), s};
    }
    AQ_D uint32_t div(uint32_t n) const { return __umulhi(n << 1, magic) >> shift; }
};

/* The online softmax of one unit in S^T's layout (s[nb][e]: key g + 8 (e >> 1), query row 8 nb + 2t + (e & 1);
   a query row's 16 keys are in the 8 lanes sharing t), in integer frames as online_softmax_scores: s becomes
   P̂ = 2^(t - m), O^T and l are rescaled by the exact power of two alpha. The lane holds the frames m, sums l and
   O^T columns of its own query rows, so the rescale needs no exchange, and it is skipped when no row's frame
   moves, as in most units after the first few: every factor would then be exactly 1 (an integer frame only moves
   by a whole number), so the result is the same bit for bit. s holds raw scores (-inf for hidden keys), which
   exp_scale turns into log2 logits inside the exp's fma, as in the forward (numerics.md §8). The max ignores NaN
   (fmaxf); a NaN score still reaches l and O through exp2. */
template <int D, int NB, int SU>
AQ_D void step_softmax(float (&s)[SU][NB][4], float (&o)[D / 16][NB][4], float (&m)[NB][2], float (&l)[NB][2],
                       float exp_scale) {
    float mx[NB][2];
    bool moves = false;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            float x = fmaxf(s[0][nb][c], s[0][nb][c + 2]);
#pragma unroll
            for (int su = 1; su < SU; su++) x = fmaxf(x, fmaxf(s[su][nb][c], s[su][nb][c + 2]));
            x = fmaxf(x, __shfl_xor_sync(AQ_FULL_MASK, x, 4));
            x = fmaxf(x, __shfl_xor_sync(AQ_FULL_MASK, x, 8));
            x = fmaxf(x, __shfl_xor_sync(AQ_FULL_MASK, x, 16));
            mx[nb][c] = ceilf(x * exp_scale);
            moves |= m[nb][c] == -INFINITY || mx[nb][c] > m[nb][c];
        }
    if (__any_sync(AQ_FULL_MASK, moves)) {
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const float m_new = fmaxf(m[nb][c], mx[nb][c]), alpha = exp2_frame_step(m[nb][c] - m_new);
                m[nb][c] = m_new;
                l[nb][c] *= alpha;
#pragma unroll
                for (int mt = 0; mt < D / 16; mt++) {
                    o[mt][nb][c] *= alpha;
                    o[mt][nb][c + 2] *= alpha;
                }
            }
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            /* frame -inf (no finite score yet): exp2(t - 0), so a hidden key's -inf gives 0, not NaN */
            const float frame = m[nb][c] == -INFINITY ? 0.0f : m[nb][c];
#pragma unroll
            for (int su = 0; su < SU; su++) {
                s[su][nb][c] = p_hat<true>(s[su][nb][c], exp_scale, frame);
                s[su][nb][c + 2] = p_hat<true>(s[su][nb][c + 2], exp_scale, frame);
                l[nb][c] += s[su][nb][c] + s[su][nb][c + 2];
            }
        }
}

/* fq16(P̂ * 2^11) in place for a step's units in S^T's layout (step_softmax): query row 8 nb + 2t + c's 16 values
   of unit su (one P block) are s[su][nb][c] and s[su][nb][c + 2] of the 8 lanes sharing t. A step always holds
   four such blocks (two units of one n-block, or one unit of two), which fake_quantize_p_columns quantizes with
   one block scale computation a lane. */
template <int NB, int SU>
AQ_D void fake_quantize_p_step(float (&s)[SU][NB][4]) {
    static_assert(NB * SU == 2, "four 16-key blocks a lane group");
    float x[4][2];
#pragma unroll
    for (int su = 0; su < SU; su++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                x[2 * (su * NB + nb) + c][0] = s[su][nb][c];
                x[2 * (su * NB + nb) + c][1] = s[su][nb][c + 2];
            }
    fake_quantize_p_columns<true>(x);
#pragma unroll
    for (int su = 0; su < SU; su++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                s[su][nb][c] = x[2 * (su * NB + nb) + c][0];
                s[su][nb][c + 2] = x[2 * (su * NB + nb) + c][1];
            }
}

/* This warp's units u_begin + warp + DEC_WARPS * i, i < count, through its ring: unit i sits in stage i % DEC_STAGES
   and is cp.async group i (one group is committed per unit, empty or not; the first DEC_STAGES - SU are in flight
   already, from the CTA's start). A step takes SU units: with one n-block, two (32 keys), so the softmax's
   reductions, its rescale vote and the P block scales are shared by two units (one p_block_scale a lane for four
   blocks instead of one for two), and the loop's bookkeeping runs half as often; with two n-blocks, one (their
   registers leave no room). Accumulates O^T, the frames m and the row sums l of the lane's query rows. */
template <int NB>
constexpr int units_a_step() { return NB == 1 ? 2 : 1; }

template <int D, int NB>
AQ_D void decode_mainloop(float (&o)[D / 16][NB][4], float (&m)[NB][2], float (&l)[NB][2], const aq_decode_params &p,
                          const DecodeTile &tile, unsigned char *ring, const uint32_t *unit_slot,
                          const uint2 (&q_frag)[D / 16][NB][32], int u_begin, int count) {
    using U = UnitLayout<D>;
    constexpr int SU = units_a_step<NB>();
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const page_pools pools = {p.k_codes, p.k_scales, p.v_codes, p.v_scales};
    const int L = tile.L, tq_count = tile.tq_count;

    /* The lane loads Q^F of rows 8 nb + g (the B operand) and keeps the scores, frames and O^T columns of rows
       8 nb + 2t + c, with the last key each sees (keys < L only; rows past the group's, computed with Q = 0 and
       dropped, see them all). */
    int lim[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int ridx = 16 * tile.mt + 8 * nb + 2 * t + c;
            lim[nb][c] = ridx < tile.rows && p.causal ? L - tq_count + ridx % tq_count : L - 1;
        }
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
        m[nb][0] = m[nb][1] = -INFINITY;
        l[nb][0] = l[nb][1] = 0.0f;
#pragma unroll
        for (int mt = 0; mt < D / 16; mt++) o[mt][nb][0] = o[mt][nb][1] = o[mt][nb][2] = o[mt][nb][3] = 0.0f;
    }
    const float exp_scale = p.softmax_scale * AQ_LOG2E * DEC_FRAME; /* the scores are 2^-14 q.k (DEC_FRAME) */

    for (int i0 = 0; i0 < count; i0 += SU) {
#pragma unroll
        for (int su = 0; su < SU; su++) { /* into the stages that the previous step used and released */
            const int ahead = i0 + DEC_STAGES - SU + su;
            if (ahead < count)
                load_unit<D>(ring + (ahead % DEC_STAGES) * U::BYTES, pools, unit_slot[warp + DEC_WARPS * ahead], lane);
            cp_async_commit();
        }
        cp_async_wait<DEC_STAGES - SU>(); /* the step's groups have landed (for this lane's copies) */
        __syncwarp();                     /* ... and every lane's copies are visible to the warp */

        float s[SU][NB][4]; /* S^T: key g + 8 (e >> 1) of unit su, query row 8 nb + 2t + (e & 1) */
        bool present[SU], masked[SU];
        /* no branch on `present`, so ptxas interleaves the units' MMA chains; an absent unit's stale stage gives
           scores that the mask below replaces by -inf */
#pragma unroll
        for (int su = 0; su < SU; su++)
            unit_scores<D, NB>(s[su], q_frag, ring + ((i0 + su) % DEC_STAGES) * U::BYTES, g, t);
#pragma unroll
        for (int su = 0; su < SU; su++) {
            const int i = i0 + su, u = u_begin + warp + DEC_WARPS * i, key0 = u * DEC_UNIT;
            present[su] = i < count; /* the last step of an odd count has one unit */
            masked[su] = !present[su] || key0 + DEC_UNIT > L || (p.causal && key0 + DEC_UNIT - 1 > L - tq_count);
            if (masked[su])
#pragma unroll
                for (int nb = 0; nb < NB; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (!present[su] || key0 + g + 8 * (e >> 1) > lim[nb][e & 1]) s[su][nb][e] = -INFINITY;
        }
        step_softmax<D, NB, SU>(s, o, m, l, exp_scale); /* s becomes P̂ */
        fake_quantize_p_step<NB, SU>(s);                 /* ... and then fq16(P̂ * 2^11) */

#pragma unroll
        for (int su = 0; su < SU; su++) {
            if (!present[su]) continue;
            const int i = i0 + su, u = u_begin + warp + DEC_WARPS * i, key0 = u * DEC_UNIT;
            const unsigned char *st = ring + (i % DEC_STAGES) * U::BYTES;
            uint32_t pb[NB][2]; /* P^T's B fragments */
            VWords<D> v;
            p_b_fragments<NB>(pb, s[su]);
            load_v_words<D>(v, st, g, t);
            if (!masked[su]) {
                pv_packed<D, NB>(o, pb, v);
                continue;
            }
            uint32_t vis[NB][2], vb[D / 8][2];
#pragma unroll
            for (int nb = 0; nb < NB; nb++)
#pragma unroll
                for (int c = 0; c < 2; c++) vis[nb][c] = (1u << min(max(lim[nb][c] - key0 + 1, 0), DEC_UNIT)) - 1u;
            packed_v_fragments<D>(vb, v);
            pv_checked<D, NB>(o, pb, vb, vis, t);
        }
        __syncwarp(); /* every lane is done with the step's stages before the next step refills them */
    }
}

/* ------------------------------------------------------------------------------------------------
   Kernels */

/* grid (num_splits * m_tiles, Hkv, B), DEC_THREADS threads; NB query n-blocks of O^T (1: the tile has at most 8
   valid rows). With one n-block the O registers fit in 128 per thread, so four CTAs (16 warps) share an SM instead
   of three: more units in flight and in compute. Each CTA's chunk result of its valid rows, D floats of unnormalised
   O (sum of fq16(P̂ * 2^11) v), the frame M and the row sum l, goes to the workspace, which decode_combine_kernel
   merges; with DEC_LAST_CTA_MERGE the CTA of a one-chunk sequence writes O instead, and the last of a longer
   sequence's CTAs to finish merges them (counters: one an (m-tile, KV head, sequence), 0 at the launch). Chunks at
   or past the sequence's length write nothing. */
template <int D, aq_dtype DT, int NB, int FLAGS>
__global__ void __launch_bounds__(DEC_THREADS, NB == 1 ? 4 : 3)
    kv_decode_kernel(const aq_decode_params p, DecodeDivisor m_tiles, DecodeDivisor page_units, int group,
                     unsigned *counters) {
    using U = UnitLayout<D>;
    constexpr bool LAST_CTA = (FLAGS & DEC_LAST_CTA_MERGE) != 0, EARLY = (FLAGS & DEC_EARLY_START) != 0;
    constexpr int RING = DEC_STAGES * U::BYTES, MERGE = DEC_WARPS * 16 * (D + 2) * (int)sizeof(float);
    constexpr int SU = units_a_step<NB>(), FIRST = DEC_STAGES - SU; /* FIRST: units a warp starts with */
    constexpr int TABLE_ITEMS = DEC_MAX_CHUNK / DEC_UNIT / DEC_THREADS; /* a thread's units of the longest chunk */
    __shared__ __align__(16) unsigned char smem[DEC_WARPS * RING > MERGE ? DEC_WARPS * RING : MERGE];
    __shared__ uint32_t unit_slot[DEC_MAX_CHUNK / DEC_UNIT];
    __shared__ uint2 q_frag[D / 16][NB][32]; /* Q^F's B fragments by lane: the same for every warp */
    __shared__ int chunk_bad_page; /* read after the merge's barriers; kept out of the registers of the loop */

    DecodeTile tile;
    tile.b = (int)blockIdx.z;
    const int64_t length = p.lengths[tile.b]; /* first: everything below waits for it */
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    tile.split = (int)m_tiles.div(blockIdx.x), tile.mt = (int)(blockIdx.x - (uint32_t)tile.split * m_tiles.d);
    tile.hk = (int)blockIdx.y;
    const int chunk = (int)p.chunk;
    tile.c0 = tile.split * chunk;
    const int u_begin = (int)((uint32_t)tile.c0 / DEC_UNIT);
    const int32_t *table = p.block_table + (int64_t)tile.b * p.pages_per_seq;
    QFragmentBuild<D, DT, NB> qbuild;

    /* The CTA's start, three latencies side by side rather than in a row: each warp's first units (their slots read
       from the block table directly), the raw Q blocks, and the block table for the rest of the chunk (into shared
       memory, so the copies of a later step wait for no global load). EARLY also issues the table and Q loads
       before the length arrives (entries past the length are loaded but not used). A unit's page and its place in
       the page come from one division (page_units). */
    auto set_rows = [&] {
        tile.tq_count = (int)p.seqlen_q, tile.rows = group * tile.tq_count;
        tile.row_base = ((int64_t)tile.b * p.heads_q + (int64_t)tile.hk * group) * tile.tq_count;
    };
    int32_t first_page[FIRST], chunk_page[TABLE_ITEMS];
    uint32_t first_in_page[FIRST], chunk_in_page[TABLE_ITEMS];
    if constexpr (EARLY) {
        /* units clamped to the table's extent, so the loads need no branch (a clamped entry is never used) */
        const uint32_t last_unit = (uint32_t)p.pages_per_seq * page_units.d - 1;
#pragma unroll
        for (int i = 0; i < FIRST; i++) {
            const uint32_t u = min((uint32_t)(u_begin + warp + DEC_WARPS * i), last_unit), pg = page_units.div(u);
            first_page[i] = table[pg];
            first_in_page[i] = u - pg * page_units.d;
        }
        set_rows();
        qbuild.load((int)threadIdx.x, p.q, 16 * tile.mt, tile.rows, tile.row_base);
#pragma unroll
        for (int k = 0; k < TABLE_ITEMS; k++) {
            const uint32_t u = min((uint32_t)(u_begin + threadIdx.x + DEC_THREADS * k), last_unit);
            const uint32_t pg = page_units.div(u);
            chunk_page[k] = table[pg];
            chunk_in_page[k] = u - pg * page_units.d;
        }
    }
    tile.L = (int)min(max(length, (int64_t)0), p.max_length);
    if (tile.c0 >= tile.L) { /* CTA-uniform, before any barrier */
        if (!EARLY) set_rows();
        if (LAST_CTA && tile.split == 0) /* an empty sequence: no CTA of this tile has keys, so this one writes O = 0 */
            for (int idx = (int)threadIdx.x; idx < tile.tile_rows() * D; idx += DEC_THREADS)
                ((uint16_t *)p.out)[tile.q_row(16 * tile.mt) * D + idx] = 0;
        return;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    /* decode_combine_kernel may be scheduled once every CTA has started; it waits for this grid to complete */
    if constexpr (!LAST_CTA) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    const int u_end = (min(tile.c0 + chunk, tile.L) + DEC_UNIT - 1) / DEC_UNIT, n_units = u_end - u_begin;
    const int count = n_units > warp ? (n_units - warp + DEC_WARPS - 1) / DEC_WARPS : 0; /* the warp's units */
    unsigned char *ring = smem + warp * RING;
    const page_pools pools = {p.k_codes, p.k_scales, p.v_codes, p.v_scales};

    bool bad_page = false;
#pragma unroll
    for (int i = 0; i < FIRST; i++) {
        const uint32_t u = u_begin + warp + DEC_WARPS * i;
        if (i < count) {
            int32_t page;
            uint32_t in_page;
            if constexpr (EARLY) {
                page = first_page[i], in_page = first_in_page[i];
            } else {
                const uint32_t pg = page_units.div(u);
                page = table[pg], in_page = u - pg * page_units.d;
            }
            load_unit<D>(ring + i * U::BYTES, pools, unit_slot_of(p, page, in_page, tile.hk, page_units.d, bad_page),
                         lane);
        }
        cp_async_commit();
    }
    if constexpr (EARLY) {
#pragma unroll
        for (int k = 0; k < TABLE_ITEMS; k++) {
            const int i = (int)threadIdx.x + DEC_THREADS * k;
            if (i < n_units)
                unit_slot[i] = unit_slot_of(p, chunk_page[k], chunk_in_page[k], tile.hk, page_units.d, bad_page);
        }
    } else {
        set_rows();
        qbuild.load((int)threadIdx.x, p.q, 16 * tile.mt, tile.rows, tile.row_base);
        for (int i = (int)threadIdx.x; i < n_units; i += DEC_THREADS) {
            const uint32_t u = u_begin + i, pg = page_units.div(u);
            unit_slot[i] = unit_slot_of(p, table[pg], u - pg * page_units.d, tile.hk, page_units.d, bad_page);
        }
    }
    qbuild.store(q_frag, (int)threadIdx.x);
    bad_page = __syncthreads_or(bad_page); /* also publishes unit_slot and q_frag */
    if (threadIdx.x == 0) chunk_bad_page = bad_page;

    float o[D / 16][NB][4], m[NB][2], l[NB][2];
    decode_mainloop<D, NB>(o, m, l, p, tile, ring, unit_slot, q_frag, u_begin, count);

    tile.splits = (tile.L + chunk - 1) / chunk; /* here, not in the start: only the merge reads it */
    const WarpMerge<D> merged(smem);
    merged.store<NB>(o, m, l);
    const bool one_chunk = LAST_CTA && tile.splits == 1;
    const Workspace<D> ws(p);
    for (int idx = (int)threadIdx.x; idx < 16 * D; idx += DEC_THREADS) {
        const int row = idx / D, d = idx % D, ridx = 16 * tile.mt + row;
        if (ridx >= tile.rows) break; /* rows ascend with idx */
        float po, frame, lsum;
        merged.chunk_result(row, d, chunk_bad_page, po, frame, lsum);
        const int64_t qr = tile.q_row(ridx);
        if (one_chunk) {
            const float out = tile.visible(ridx, p.causal) > 0 ? one_chunk_output<D>(po, frame, lsum) : 0.0f;
            ((uint16_t *)p.out)[qr * D + d] = (uint16_t)(pack2<DT>(out, 0.0f) & 0xFFFFu);
            continue;
        }
        ws.o_of(qr, tile.split)[d] = po;
        if (d == 0) ws.ml_of(qr, tile.split)[0] = frame, ws.ml_of(qr, tile.split)[1] = lsum;
    }
    if constexpr (LAST_CTA) {
        if (one_chunk) return;
        __shared__ RowMerge row_merge;
        __shared__ int last;
        unsigned *counter = counters + ((int64_t)tile.b * p.heads_kv + tile.hk) * m_tiles.d + tile.mt;
        if (!last_to_arrive(counter, tile.splits, last)) return;
        /* a thread's (row, channel quad) items: up to NB D / 64 (8 NB rows of D / 4 quads over the CTA's threads) */
        constexpr int MAX_ITEMS = NB * D / 64;
        const int items = (tile.tile_rows() * (D / 4) + DEC_THREADS - 1) / DEC_THREADS;
        /* the merge's factor table in the rings' shared memory, CAPACITY chunks of the tile's rows */
        constexpr int CAPACITY = (int)(sizeof(smem) / (16 * sizeof(float2)));
        float2 *factors = (float2 *)smem;
        if (MAX_ITEMS == 1 || items == 1)
            merge_chunks<D, DT, NB, 1, CAPACITY>(p, tile, row_merge, factors);
        else if (MAX_ITEMS == 2 || items == 2)
            merge_chunks<D, DT, NB, MAX_ITEMS < 2 ? 1 : 2, CAPACITY>(p, tile, row_merge, factors);
        else
            merge_chunks<D, DT, NB, MAX_ITEMS < 4 ? 1 : 4, CAPACITY>(p, tile, row_merge, factors);
    }
}

/* ------------------------------------------------------------------------------------------------
   Launchers */

static int decode_m_tiles(const aq_decode_params *p) {
    return (int)((p->heads_q / p->heads_kv * p->seqlen_q + 15) / 16);
}

const char *aq_kv_cache_decode_plan_cuda(aq_decode_params *p, const aq_kernel_options *o, int64_t *workspace_floats) {
    if (!aq_attention_dtype_supported(p->dtype)) return "kv_cache_decode: dtype must be bfloat16 or float16";
    if (!aq_decode_head_dim_supported(p->head_dim)) return "kv_cache_decode: head_dim must be " AQ_DECODE_HEAD_DIMS_TEXT;
    if (p->heads_kv <= 0 || p->heads_q <= 0 || p->heads_q % p->heads_kv != 0)
        return "kv_cache_decode: heads_q must be a positive multiple of heads_kv";
    if (p->batch < 0 || p->batch > 65535 || p->heads_kv > 65535)
        return "kv_cache_decode: batch and heads_kv must be <= 65535";
    if (p->seqlen_q < 1 || p->seqlen_q > 16) return "kv_cache_decode: 1 to 16 query tokens";
    if (p->heads_q / p->heads_kv > 1024) return "kv_cache_decode: at most 1024 query heads per KV head";
    if (p->page_size < DEC_UNIT || p->page_size % DEC_UNIT || p->pages_per_seq < 1 || p->num_pages < 1)
        return "kv_cache_decode: page_size must be a positive multiple of 16, with at least one page";
    const int64_t capacity = p->pages_per_seq * p->page_size;
    if (capacity > INT32_MAX - 2 * DEC_MAX_CHUNK) return "kv_cache_decode: capacity (pages_per_seq * page_size) too large";
    if (p->num_pages * p->heads_kv * (p->page_size / DEC_UNIT) > UINT32_MAX) /* the kernel's 32-bit unit slots */
        return "kv_cache_decode: more than 2^32 16-token units (pages x KV heads) in the pools";
    if (p->max_length < 0 || p->max_length > capacity) return "kv_cache_decode: max_length must be in [0, capacity]";
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    int major = 0;
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    p->programmatic_launch = major >= 9;
    /* the kernel options' decode_variant picks kv_decode_kernel's FLAGS, for A/B runs and the tests' bit-for-bit check */
    p->variant = o->decode_variant >= 0 && o->decode_variant < DEC_VARIANTS ? o->decode_variant
                                                                           : DEC_LAST_CTA_MERGE | DEC_EARLY_START;
    /* The longest chunks (up to DEC_MAX_CHUNK keys) that still give every SM a CTA: a CTA's four warps already
       keep enough loads in flight, and shorter chunks only add pipeline start-up and partial results; longer ones
       amortize a CTA's start and merge (performance.md, "Measurements behind choices in the code"). */
    const int64_t ctas_per_split = p->batch * p->heads_kv * decode_m_tiles(p);
    int64_t chunk = DEC_MAX_CHUNK;
    while (chunk > DEC_MIN_CHUNK && ctas_per_split * ((p->max_length + chunk - 1) / chunk) < (int64_t)sms)
        chunk /= 2;
    /* the kernel options' decode_chunk (a multiple of DEC_MIN_CHUNK up to DEC_MAX_CHUNK) sets it instead, for sweeps */
    if (o->decode_chunk > 0) chunk = o->decode_chunk;
    if (!aq_decode_chunk_valid(chunk)) return "kv_cache_decode: decode_chunk must be a multiple of 64 up to 4096";
    p->chunk = chunk;
    p->num_splits = (p->max_length + chunk - 1) / chunk;
    if (p->num_splits * decode_m_tiles(p) > INT32_MAX) return "kv_cache_decode: too many query rows and splits";
    *workspace_floats = p->batch * p->heads_q * p->seqlen_q * p->num_splits * (p->head_dim + 2);
    return NULL;
}

/* The last-CTA merge's counters on the current device for calls on `stream`: n or more, all 0. Why not a workspace
   from torch's allocator zeroed by a memset every call: that memset is a launch (a graph node) ahead of every call,
   where the point was to remove the combine kernel's; instead each call leaves its counters 0 (the merging CTA resets
   its own), so one zeroing at allocation serves every later call, graph replays included. Kept per (device, stream),
   since two calls that run at once must not share counters; a graph keeps those of the stream it was captured on, so
   replays of graphs captured on one stream must not overlap. Never freed: a captured graph may still use a buffer
   that a larger call replaced. A launch that dies mid-way leaves counters set, but also a dead CUDA context. */
static const char *decode_counters(cudaStream_t stream, int64_t n, unsigned **out) {
    static std::mutex mutex;
    static std::map<std::pair<int, cudaStream_t>, std::pair<unsigned *, int64_t>> buffers;
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    std::lock_guard<std::mutex> lock(mutex);
    std::pair<unsigned *, int64_t> &buffer = buffers[{device, stream}];
    if (buffer.second < n) {
        const int64_t size = std::max<int64_t>(n, std::max<int64_t>(2 * buffer.second, 4096));
        /* allocating and zeroing on a private stream, which a graph capture under way on `stream` allows in the
           relaxed mode (torch's caching allocator allocates the same way) */
        cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        err = cudaThreadExchangeStreamCaptureMode(&mode);
        if (err != cudaSuccess) return cudaGetErrorString(err);
        unsigned *ptr = NULL;
        cudaStream_t zeroing = NULL;
        err = cudaMalloc(&ptr, size * sizeof(unsigned));
        if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking);
        if (err == cudaSuccess) err = cudaMemsetAsync(ptr, 0, size * sizeof(unsigned), zeroing);
        if (err == cudaSuccess) err = cudaStreamSynchronize(zeroing);
        if (zeroing != NULL) cudaStreamDestroy(zeroing);
        if (err != cudaSuccess && ptr != NULL) cudaFree(ptr);
        const cudaError_t restored = cudaThreadExchangeStreamCaptureMode(&mode);
        if (err == cudaSuccess) err = restored;
        if (err != cudaSuccess) return cudaGetErrorString(err);
        buffer = {ptr, size};
    }
    *out = buffer.first;
    return NULL;
}

template <int D, aq_dtype DT, int NB>
static void launch_kv_decode(const aq_decode_params *p, dim3 grid, int m_tiles, unsigned *counters,
                             cudaStream_t stream) {
    const int group = (int)(p->heads_q / p->heads_kv); /* here, not a 64-bit division in every CTA's start */
    const DecodeDivisor tiles = DecodeDivisor::make((uint32_t)m_tiles);
    const DecodeDivisor units = DecodeDivisor::make((uint32_t)(p->page_size / DEC_UNIT));
    switch (p->variant) {
    case 0: kv_decode_kernel<D, DT, NB, 0><<<grid, DEC_THREADS, 0, stream>>>(*p, tiles, units, group, counters); break;
    case 1: kv_decode_kernel<D, DT, NB, 1><<<grid, DEC_THREADS, 0, stream>>>(*p, tiles, units, group, counters); break;
    case 2: kv_decode_kernel<D, DT, NB, 2><<<grid, DEC_THREADS, 0, stream>>>(*p, tiles, units, group, counters); break;
    default: kv_decode_kernel<D, DT, NB, 3><<<grid, DEC_THREADS, 0, stream>>>(*p, tiles, units, group, counters); break;
    }
}

template <int D, aq_dtype DT>
static const char *launch_decode(const aq_decode_params *p, cudaStream_t stream) {
    const int m_tiles = decode_m_tiles(p);
    const int64_t rows = p->batch * p->heads_q * p->seqlen_q;
    if (rows > INT32_MAX) return "kv_cache_decode: too many output rows";
    const bool last_cta = (p->variant & DEC_LAST_CTA_MERGE) != 0;
    if (p->num_splits > 0) {
        unsigned *counters = NULL;
        if (last_cta) {
            const char *err = decode_counters(stream, p->batch * p->heads_kv * m_tiles, &counters);
            if (err) return err;
        }
        const dim3 grid((unsigned)(p->num_splits * m_tiles), (unsigned)p->heads_kv, (unsigned)p->batch);
        if (p->heads_q / p->heads_kv * p->seqlen_q <= 8)
            launch_kv_decode<D, DT, 1>(p, grid, m_tiles, counters, stream);
        else
            launch_kv_decode<D, DT, 2>(p, grid, m_tiles, counters, stream);
        const char *err = launch_status();
        if (err) return err;
    }
    if (last_cta) {
        if (p->num_splits > 0) return NULL;
        /* no key in any sequence (max_length 0): O = 0, whose bits are 0 in either dtype */
        const cudaError_t err = cudaMemsetAsync(p->out, 0, rows * D * sizeof(uint16_t), stream);
        return err == cudaSuccess ? NULL : cudaGetErrorString(err);
    }
    /* Programmatic dependent launch: the combine kernel's launch overlaps the decode kernel's last CTAs instead of
       starting after them (performance.md, "Measurements behind choices in the code"). */
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((unsigned)rows);
    config.blockDim = dim3(DEC_COMBINE_THREADS);
    config.stream = stream;
    cudaLaunchAttribute overlap = {};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &overlap;
    config.numAttrs = p->programmatic_launch ? 1 : 0;
    const cudaError_t err = cudaLaunchKernelEx(&config, decode_combine_kernel<D, DT>, *p);
    return err == cudaSuccess ? launch_status() : cudaGetErrorString(err);
}

const char *aq_kv_cache_decode_cuda(const aq_decode_params *p, void *stream) {
    if (p->batch == 0) return NULL;
    if (p->chunk < DEC_MIN_CHUNK || p->chunk % DEC_MIN_CHUNK || p->chunk > DEC_MAX_CHUNK)
        return "kv_cache_decode: call aq_kv_cache_decode_plan_cuda first";
    const void *ptrs[] = {p->q, p->k_codes, p->k_scales, p->v_codes, p->v_scales, p->workspace, p->out};
    if (!p->block_table) return "kv_cache_decode: block_table is required";
    for (const void *ptr : ptrs)
        if (!aligned16(ptr)) return "kv_cache_decode: every buffer must be 16-byte aligned";
    return with_head_dim_and_dtype(p->head_dim, p->dtype, [&](auto d, auto dt) {
        return launch_decode<decltype(d)::value, decltype(dt)::value>(p, (cudaStream_t)stream);
    });
}
