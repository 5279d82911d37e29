/* The merges of the decode kernel's partial results: the CTA's warps' in shared memory (WarpMerge), the chunks' of a
   sequence by the last of its CTAs to finish (merge_chunks), or by decode_combine_kernel; one arithmetic
   (merge_term), so that every way gives the same bits (docs/kv_cache_layout.md, "Work split"). */
#pragma once

#include "attention/softmax.cuh"
#include "decode/decode_geometry.cuh"
#include "decode/unit_load.cuh"

#define DEC_COMBINE_THREADS 256 /* decode_combine_kernel's CTA: DEC_COMBINE_THREADS / D chains a channel (merge_term) */
#ifndef DEC_MERGE_BATCH /* chunk results a thread of merge_chunks loads at once, a power of two (more spill: performance.md) */
#define DEC_MERGE_BATCH 16
#endif
#ifndef DEC_MERGE_BATCH_ITEMS /* the same, over a thread's items when it has several (more spill) */
#define DEC_MERGE_BATCH_ITEMS 8
#endif

/* The workspace (S = num_splits chunks of each of the B Hq Tq query rows): chunk s's partial O of q's row r, D floats,
   at (r S + s) D, 16-byte aligned for merge_chunks' vector loads; its frame and row sum after all of those, at
   B Hq Tq S D + 2 (r S + s), so that a row's frames are contiguous. */
template <int D>
struct Workspace {
    float *o, *ml;
    int64_t splits;
    AQ_D explicit Workspace(const aq_decode_params &p)
        : o(p.workspace), ml(p.workspace + p.batch * p.heads_q * p.seqlen_q * p.num_splits * D), splits(p.num_splits) {}
    AQ_D float *o_of(int64_t row, int s) const { return o + (row * splits + s) * D; }
    AQ_D float *ml_of(int64_t row, int s) const { return ml + (row * splits + s) * 2; }
};

/* The chunks' merge of one output element, one arithmetic for decode_combine_kernel and the last CTA so that both give
   the same bits: chunk s's term (its partial result times the exact power of two f that takes its frame to the
   row's) goes to chain s % merge_chains in ascending s from 0, and the chains are added in order from 0 (the
   combine kernel's thread groups). merge_output: a row whose visible scores are all -inf or NaN (frame -inf), or
   one that met a page outside the pool, is NaN, like the forward kernels. */
template <int D>
constexpr int merge_chains() { return DEC_COMBINE_THREADS / D; }
AQ_D void merge_term(float &chain, float part, float f) { chain = __fmaf_rn(part, f, chain); }
template <int G>
AQ_D float merge_chain_sum(const float (&chain)[G]) {
    float sum = 0.0f;
#pragma unroll
    for (int g = 0; g < G; g++) sum += chain[g];
    return sum;
}
AQ_D float merge_output(float acc, float lsum, float frame, bool bad_page) {
    return frame == -INFINITY || bad_page ? NAN : acc * AQ_P_HEADROOM_INV * (1.0f / lsum);
}

/* The warps' partial results side by side in shared memory (the rings are free once every copy has landed and every
   warp is done): O^T as [warp][16 rows][D] in channel order, the frames and the row sums as [warp][16 rows]. */
template <int D>
struct WarpMerge {
    float *o, *m, *l;
    AQ_D explicit WarpMerge(unsigned char *smem)
        : o((float *)smem), m((float *)smem + DEC_WARPS * 16 * D), l((float *)smem + DEC_WARPS * 16 * (D + 1)) {}

    template <int NB>
    AQ_D void store(const float (&acc)[D / 16][NB][4], const float (&frame)[NB][2], const float (&sum)[NB][2]) const {
        const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane >> 2, t = lane & 3;
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) { /* query row 8 nb + 2t + c: its sum is spread over the 8 lanes sharing t */
                float lsum = sum[nb][c] + __shfl_xor_sync(AQ_FULL_MASK, sum[nb][c], 4);
                lsum += __shfl_xor_sync(AQ_FULL_MASK, lsum, 8);
                lsum += __shfl_xor_sync(AQ_FULL_MASK, lsum, 16);
                if (g == 0) {
                    m[warp * 16 + 8 * nb + 2 * t + c] = frame[nb][c];
                    l[warp * 16 + 8 * nb + 2 * t + c] = lsum;
                }
            }
#pragma unroll
        for (int mt = 0; mt < D / 16; mt++)
#pragma unroll
            for (int nb = 0; nb < NB; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) { /* rows past 8 * NB are past the tile's valid rows: never read */
                    const int row = warp * 16 + 8 * nb + frag_c_col(lane, e);
                    o[row * D + g * (D / 8) + 2 * mt + (e >> 1)] = acc[mt][nb][e];
                }
        __syncthreads();
    }

    /* The CTA's partial result of tile row `row`, channel d: O times DEC_FRAME (exact: O^T was accumulated from
       2^-14 V^F), the frame and the row sum; all NaN when the chunk met a page outside the pool. */
    AQ_D void chunk_result(int row, int d, bool bad_page, float &po, float &frame, float &lsum) const {
        frame = -INFINITY;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) frame = fmaxf(frame, m[w * 16 + row]);
        float acc = 0.0f;
        lsum = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) { /* 0 for a warp with nothing (frame -inf), and when frame is -inf */
            const float f = exp2_frame_step(m[w * 16 + row] - frame);
            acc += o[(w * 16 + row) * D + d] * f;
            lsum += l[w * 16 + row] * f;
        }
        po = bad_page ? NAN : acc * DEC_FRAME;
        frame = bad_page ? NAN : frame;
        lsum = bad_page ? NAN : lsum;
    }
};

/* O of a row whose sequence is one chunk, from that chunk's result: merge_chunks' arithmetic with one chunk, so the
   bits decode_combine_kernel would give. */
template <int D>
AQ_D float one_chunk_output(float po, float frame_s, float lsum_s) {
    constexpr int G = merge_chains<D>();
    const float frame = fmaxf(-INFINITY, frame_s); /* the merge's max, which passes over a NaN frame */
    const bool bad_page = isnan(frame_s);
    float acc[G], lsum[G];
#pragma unroll
    for (int g = 0; g < G; g++) acc[g] = lsum[g] = 0.0f;
    if (frame != -INFINITY && !bad_page) {
        const float f = exp2_frame_step(frame_s - frame);
        merge_term(acc[0], po, f);
        merge_term(lsum[0], lsum_s, f);
    }
    return merge_output(merge_chain_sum(acc), merge_chain_sum(lsum), frame, bad_page);
}

/* Whether this CTA is the last of the n sharing *counter to get here. Every thread's stores before the call are
   visible to that CTA: a barrier, then one atomic with acquire-release semantics at GPU scope (as CUTLASS's
   GenericBarrier::arrive_inc: a barrier, then one thread's release). The last one sets the counter back to 0 for
   the next call: no other CTA of this launch touches it again, and the next launch sees the store. */
AQ_D bool last_to_arrive(unsigned *counter, int n, int &flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
        flag = before == (unsigned)n - 1;
        if (flag) asm volatile("st.relaxed.gpu.global.u32 [%0], 0;\n" ::"l"(counter) : "memory");
    }
    __syncthreads();
    return flag != 0;
}

/* The shared-memory results of merge_chunks' first pass: each tile row's frame and bad-page mark. */
struct RowMerge {
    float frame[16];
    int bad_page[16];
};

/* O of the tile's rows from the sequence's n chunk results in the workspace, by the CTA that finished last, with
   decode_combine_kernel's arithmetic (merge_term ...). First a warp a row (the warp's rows' loads issued together)
   finds the row's frame and bad-page mark. Then, a window of the chunks at a time, each lane of that warp puts its
   chunks' factors f = 2^(frame_s - frame) with their row sums into `factors` (shared memory that the rings and the
   warps' merge are done with, 16 rows x WINDOW chunks), and each thread sums the chains of its ITEMS (row, channel
   quad) items and of their rows' sums from there: B chunks' loads in flight a round and item, the first round issued
   before the first pass, as those loads need no frame. (Before, every thread loaded and converted each chunk's frame
   itself, and a warp summed a row's sum chains by shuffles, one chunk after another, ahead of the items' sums.) The
   workspace is read through L2 (ld.cg): other CTAs wrote it during this launch. A row that sees no key is 0. */
template <int D, aq_dtype DT, int NB, int ITEMS, int CAPACITY>
AQ_D void merge_chunks(const aq_decode_params &p, const DecodeTile &tile, RowMerge &rm, float2 *factors) {
    constexpr int G = merge_chains<D>(), QUADS = D / 4, ROWS_A_WARP = 8 * NB / DEC_WARPS;
    constexpr int TOTAL = ITEMS == 1 ? DEC_MERGE_BATCH : DEC_MERGE_BATCH_ITEMS; /* loads in flight */
    constexpr int B = TOTAL / ITEMS / G * G > G ? TOTAL / ITEMS / G * G : G; /* a round: B chunks of each item */
    static_assert(32 % G == 0 && B % G == 0, "chunk s0 + k of a round is on chain k % G");
    static_assert(32 % B == 0 || B % 32 == 0, "powers of two: a window holds whole rounds and whole warp passes");
    constexpr int WINDOW = CAPACITY / (B > 32 ? B : 32) * (B > 32 ? B : 32); /* chunks of the factor table */
    static_assert(WINDOW > 0, "the factor table holds a window");
    const Workspace<D> ws(p);
    const int n = tile.splits, rows = tile.tile_rows(), warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;

    float4 part[ITEMS][B]; /* a round: chunks s0 .. s0 + B - 1 of each item, their O quads */
    auto load_round = [&](int s0) {
#pragma unroll
        for (int j = 0; j < ITEMS; j++) {
            const int item = (int)threadIdx.x + DEC_THREADS * j;
            if (item >= rows * QUADS) break;
            const float *po = ws.o_of(tile.q_row(16 * tile.mt + item / QUADS), 0) + 4 * (item % QUADS);
#pragma unroll
            for (int k = 0; k < B; k++)
                if (s0 + k < n) part[j][k] = __ldcg((const float4 *)(po + (int64_t)(s0 + k) * D));
        }
    };
    load_round(0);

    float2 first[ROWS_A_WARP]; /* (frame, row sum) of chunk `lane` of the warp's rows */
    float frame[ROWS_A_WARP];
    bool skip[ROWS_A_WARP]; /* the row's result is 0 or NaN whatever its sums: no factors needed */
#pragma unroll
    for (int i = 0; i < ROWS_A_WARP; i++) {
        const int r = warp + DEC_WARPS * i;
        first[i] = r < rows && lane < n ? __ldcg((const float2 *)ws.ml_of(tile.q_row(16 * tile.mt + r), 0) + lane)
                                        : make_float2(-INFINITY, 0.0f);
    }
#pragma unroll
    for (int i = 0; i < ROWS_A_WARP; i++) {
        const int r = warp + DEC_WARPS * i;
        if (r >= rows) break; /* warp-uniform */
        const float *ml = ws.ml_of(tile.q_row(16 * tile.mt + r), 0);
        float x = fmaxf(-INFINITY, first[i].x); /* the max passes over NaN frames, as in the combine kernel */
        bool bad_page = isnan(first[i].x);      /* a chunk that met a page outside the pool marked its frame NaN */
        for (int s = lane + 32; s < n; s += 32) {
            const float y = __ldcg(ml + 2 * s);
            x = fmaxf(x, y);
            bad_page |= isnan(y);
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(AQ_FULL_MASK, x, o));
        bad_page = __any_sync(AQ_FULL_MASK, bad_page);
        frame[i] = x, skip[i] = x == -INFINITY || bad_page;
        if (lane == 0) rm.frame[r] = x, rm.bad_page[r] = bad_page;
    }

    float acc[ITEMS][G][4], lsum[ITEMS][G];
#pragma unroll
    for (int j = 0; j < ITEMS; j++)
#pragma unroll
        for (int g = 0; g < G; g++) acc[j][g][0] = acc[j][g][1] = acc[j][g][2] = acc[j][g][3] = lsum[j][g] = 0.0f;
    for (int w0 = 0; w0 < n; w0 += WINDOW) {
        const int w_end = min(n, w0 + WINDOW);
        if (w0 > 0) __syncthreads(); /* every thread is done with the last window's factors */
#pragma unroll
        for (int i = 0; i < ROWS_A_WARP; i++) {
            const int r = warp + DEC_WARPS * i;
            if (r >= rows) break; /* warp-uniform */
            if (skip[i]) continue;
            const float *ml = ws.ml_of(tile.q_row(16 * tile.mt + r), 0);
            for (int s = w0 + lane; s < w_end; s += 32) {
                const float2 v = s < 32 ? first[i] : __ldcg((const float2 *)ml + s);
                factors[r * WINDOW + s - w0] = make_float2(exp2_frame_step(v.x - frame[i]), v.y);
            }
        }
        __syncthreads();
        for (int s0 = w0; s0 < w_end; s0 += B) {
            if (s0 > 0) load_round(s0);
#pragma unroll
            for (int j = 0; j < ITEMS; j++) {
                const int item = (int)threadIdx.x + DEC_THREADS * j;
                if (item >= rows * QUADS) break;
                const int r = item / QUADS;
                if (rm.frame[r] == -INFINITY || rm.bad_page[r]) continue; /* NaN (or 0 where the row sees no key) */
#pragma unroll
                for (int k = 0; k < B; k++)
                    if (s0 + k < n) {
                        const float2 f = factors[r * WINDOW + s0 + k - w0]; /* (factor, the chunk's row sum) */
                        merge_term(acc[j][k % G][0], part[j][k].x, f.x);
                        merge_term(acc[j][k % G][1], part[j][k].y, f.x);
                        merge_term(acc[j][k % G][2], part[j][k].z, f.x);
                        merge_term(acc[j][k % G][3], part[j][k].w, f.x);
                        merge_term(lsum[j][k % G], f.y, f.x);
                    }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < ITEMS; j++) {
        const int item = (int)threadIdx.x + DEC_THREADS * j;
        if (item >= rows * QUADS) break;
        const int r = item / QUADS, ridx = 16 * tile.mt + r;
        const bool sees = tile.visible(ridx, p.causal) > 0, bad_page = rm.bad_page[r] != 0;
        const float frame_r = rm.frame[r], lsum_r = merge_chain_sum(lsum[j]);
        float out[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float chain[G];
#pragma unroll
            for (int g = 0; g < G; g++) chain[g] = acc[j][g][i];
            out[i] = sees ? merge_output(merge_chain_sum(chain), lsum_r, frame_r, bad_page) : 0.0f;
        }
        *(uint2 *)((uint16_t *)p.out + tile.q_row(ridx) * D + 4 * (item % QUADS)) =
            make_uint2(pack2<DT>(out[0], out[1]), pack2<DT>(out[2], out[3]));
    }
}

/* grid B * Hq * Tq (one output row each), DEC_COMBINE_THREADS threads: merges the row's chunks and writes O in the
   cache dtype. Thread (group, d) sums channel d over every (DEC_COMBINE_THREADS / D)-th chunk (chain `group` of
   merge_term), so a row's chunks are read that many at a time rather than one after another, which left a single
   long sequence waiting on the merge. A row with no visible key is 0 (numerics.md §6); one whose visible scores are
   all -inf or NaN has frame -inf and is NaN, like the forward kernels. */
template <int D, aq_dtype DT>
__global__ void __launch_bounds__(DEC_COMBINE_THREADS) decode_combine_kernel(const aq_decode_params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    /* launched early (programmatic dependent launch, launch_decode): wait until kv_decode_kernel has completed and
       its partial results are visible; a no-op when launched the ordinary way */
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    constexpr int GROUPS = merge_chains<D>(), WARPS = DEC_COMBINE_THREADS / 32;
    __shared__ float warp_frame[WARPS], group_acc[GROUPS][D], group_sum[GROUPS];
    __shared__ int warp_bad[WARPS];
    const int64_t row = blockIdx.x; /* (b * Hq + h) * Tq + t */
    const int tq_count = (int)p.seqlen_q, tq = (int)(row % tq_count);
    const int d = (int)threadIdx.x % D, group = (int)threadIdx.x / D, lane = (int)threadIdx.x % 32;
    const int64_t b = row / (p.heads_q * tq_count);
    const int L = (int)min(max(p.lengths[b], (int64_t)0), p.max_length);
    const int visible = p.causal ? min(L, L - tq_count + tq + 1) : L;
    uint16_t *out = (uint16_t *)p.out + row * D + d;
    if (visible <= 0) { /* block-uniform */
        if (group == 0) *out = (uint16_t)(pack2<DT>(0.0f, 0.0f) & 0xFFFFu);
        return;
    }
    const int splits = (int)min((int64_t)((L + p.chunk - 1) / p.chunk), p.num_splits);
    const Workspace<D> ws(p);
    const float *part_o = ws.o_of(row, 0), *part_ml = ws.ml_of(row, 0);
    float frame = -INFINITY;
    bool bad_page = false; /* a chunk that met a page outside the pool marks its frame NaN (kv_decode_kernel) */
    for (int s = (int)threadIdx.x; s < splits; s += DEC_COMBINE_THREADS) {
        frame = fmaxf(frame, part_ml[2 * s]);
        bad_page |= isnan(part_ml[2 * s]);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) frame = fmaxf(frame, __shfl_xor_sync(AQ_FULL_MASK, frame, o));
    bad_page = __any_sync(AQ_FULL_MASK, bad_page);
    if (lane == 0) warp_frame[threadIdx.x / 32] = frame, warp_bad[threadIdx.x / 32] = bad_page;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WARPS; w++) frame = fmaxf(frame, warp_frame[w]), bad_page |= warp_bad[w] != 0;
    float acc = 0.0f, lsum = 0.0f;
    if (frame != -INFINITY && !bad_page) {
#pragma unroll 4
        for (int s = group; s < splits; s += GROUPS) {
            const float f = exp2_frame_step(part_ml[2 * s] - frame);
            merge_term(acc, part_o[s * D + d], f);
            merge_term(lsum, part_ml[2 * s + 1], f);
        }
    }
    group_acc[group][d] = acc;
    if (d == 0) group_sum[group] = lsum;
    __syncthreads();
    if (group != 0) return;
    float acc_chain[GROUPS], lsum_chain[GROUPS];
#pragma unroll
    for (int g = 0; g < GROUPS; g++) acc_chain[g] = group_acc[g][d], lsum_chain[g] = group_sum[g];
    const float o = merge_output(merge_chain_sum(acc_chain), merge_chain_sum(lsum_chain), frame, bad_page);
    *out = (uint16_t)(pack2<DT>(o, 0.0f) & 0xFFFFu);
}
