/* A unit's tensor-core products on the dequantized cache: Q^F's B fragments, S^T = K Q^T and O^T += V^T P^T, in the
   contraction and column orders of docs/kv_cache_layout.md ("Fragment layouts"). */
#pragma once

#include "decode/decode_geometry.cuh"
#include "decode/dequantize.cuh"

/* N 32-bit words from shared memory aligned to 4N bytes, in one access. */
template <int N>
AQ_D void load_words(uint32_t (&w)[N], const unsigned char *p) {
    static_assert(N == 2 || N == 4, "8- or 16-byte accesses");
    if constexpr (N == 4) {
        const uint4 v = *(const uint4 *)p;
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
        const uint2 v = *(const uint2 *)p;
        w[0] = v.x, w[1] = v.y;
    }
}


/* The B fragments of Q^F (fp16) for n-block nb of the tile's query rows: row 8 nb + g (row_index[nb]:
   (b * Hq + h) * Tq + t, or -1 for a row past the KV group's, which stays 0), in the contraction order of
   kv_cache_layout.md: qb[kk][nb] = {channels c, c + 4; channels c + 1, c + 5} with
   c = t * D/4 + 8 (kk >> 1) + 2 (kk & 1).
   q holds the raw queries: the lane's D/4 channels are whole 16-channel blocks (D/64 of them), so it applies the
   block rule itself (aq_fake_quantize_block, the quantize kernels' code) and no separate pass over Q runs before
   the kernel. Q^F is exact in fp16 (numerics.md §1). */
template <int D, aq_dtype DT, int NB>
struct QFragmentBuild {
    /* One 16-channel block of one query row a thread: NB n-blocks x 8 rows g x 4 lanes t x D/64 blocks of lane
       (g, t)'s channels [t * D/4, (t + 1) * D/4). At most 128 items, so the CTA's threads build Q^F in one pass
       (with one warp doing it all, every CTA's first unit waited behind it). */
    static constexpr int ITEMS = NB * 8 * 4 * (D / 64);
    static_assert(ITEMS <= DEC_THREADS, "one item a thread");
    int nb, g, t, blk;
    int64_t row; /* the query row's index in q, or -1 (past the group's rows, or no item: Q = 0) */
    uint4 raw[2];

    /* Issues the loads; the block is quantized later (store), so their latency overlaps the block-table lookup. */
    AQ_D void load(int item, const void *q, int first_row, int rows, int64_t row_base) {
        blk = item % (D / 64);
        t = item / (D / 64) % 4;
        g = item / (D / 64) / 4 % 8;
        nb = item / (D / 64) / 32;
        const int qr = first_row + 8 * nb + g;
        row = item < ITEMS && qr < rows ? row_base + qr : -1;
        raw[0] = raw[1] = make_uint4(0u, 0u, 0u, 0u);
        if (row >= 0) {
            const uint4 *src = (const uint4 *)((const uint16_t *)q + row * D + t * (D / 4) + 16 * blk);
            raw[0] = src[0];
            raw[1] = src[1];
        }
    }

    /* Q^F of the block by the quantizers' own block rule (exact in fp16, numerics.md §1), as the B fragments
       qf[kk][nb][4g + t] of steps kk = 4 blk .. 4 blk + 3 (unit_scores' channel order). */
    AQ_D void store(uint2 (&qf)[D / 16][NB][32], int item) const {
        if (item >= ITEMS) return;
        float v[16];
        const uint16_t *h = (const uint16_t *)raw;
#pragma unroll
        for (int i = 0; i < 16; i++) v[i] = to_float<DT>(h[i]);
        if (row >= 0) aq_fake_quantize_block(v, 16);
        uint32_t w[8]; /* channel pairs 2i, 2i + 1 of the block */
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = pack2<AQ_FLOAT16>(v[2 * i], v[2 * i + 1]);
#pragma unroll
        for (int k4 = 0; k4 < 4; k4++) { /* w[i]: channels c, c+1; w[i + 2]: c+4, c+5 */
            const int i = 4 * (k4 >> 1) + (k4 & 1);
            qf[4 * blk + k4][nb][4 * g + t] =
                make_uint2(__byte_perm(w[i], w[i + 2], 0x5410), __byte_perm(w[i], w[i + 2], 0x7632));
        }
    }
};

/* s[nb] = K Q^T for the unit in `st` against n-block nb of the query rows (S^T: keys as M, so one query token
   and up to 8 query heads take one MMA a k-step, not two): s[nb][e] is key g + 8 (e >> 1), query row
   8 nb + 2t + (e & 1). Lane (g, t) dequantizes channels [t * D/4, (t + 1) * D/4) of keys g (h = 0) and g + 8
   (h = 1): word j holds channels 8j .. 8j + 7 of that range, in block t * D/64 + j / 2 (D/4 channels span D/64
   blocks of 16), and its pairs c[h][i] = channels 8j + i and 8j + i + 4 are the A registers of keys g + 8h in
   steps 2j (i = 0, 1) and 2j + 1 (i = 2, 3), in kv_cache_layout.md's order. qf: Q^F's B fragments of
   every lane (QFragmentBuild), kept in shared memory once per CTA: in registers they cost 16 of
   the 128 a thread has with four CTAs an SM. */
template <int D, int NB>
AQ_D void unit_scores(float (&s)[NB][4], const uint2 (&qf)[D / 16][NB][32], const unsigned char *st, int g, int t) {
    using U = UnitLayout<D>;
    uint32_t w[2][D / 32], sc[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int key = 8 * h + g;
        load_words<D / 32>(w[h], st + U::K_CODES + key * (D / 2) + t * (D / 8));
        const unsigned char *sp = st + U::K_SCALES + key * (D / 16) + t * (D / 64);
        /* the scales of blocks t * D/64 (low half) and, for D = 128, t * D/64 + 1 (high half) */
        sc[h] = e4m3x2_to_f16x2(D == 128 ? (uint32_t)sp[0] | ((uint32_t)sp[1] << 8) : sp[0]);
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb++) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < D / 32; j++) {
        uint32_t c[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            e2m1x8_to_f16(w[h][j], c[h]);
#pragma unroll
            for (int i = 0; i < 4; i++) c[h][i] = hmul2_by_half(c[h][i], sc[h], j / 2);
        }
#pragma unroll
        for (int step = 0; step < 2; step++) {
            const uint32_t a[4] = {c[0][2 * step], c[1][2 * step], c[0][2 * step + 1], c[1][2 * step + 1]};
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                const uint2 qb = qf[2 * j + step][nb][4 * g + t];
                mma_16816<AQ_FLOAT16>(s[nb], a, qb.x, qb.y);
            }
        }
    }
}

/* The lane's V of a unit (kv_cache_layout.md): channels [g * D/8, (g + 1) * D/8) (within one 16-channel block) of
   tokens 2t, 2t + 1 (codes[0]) and 2t + 8, 2t + 9 (codes[1]), word j holding half j of both tokens' code bytes (the
   first token's in the low half), and those tokens' block scales: bytes 0 .. 3 of `scales` are tokens 2t, 2t + 1,
   2t + 8, 2t + 9. */
template <int D>
struct VWords {
    uint32_t codes[2][D / 32];
    uint32_t scales;
};

template <int D>
AQ_D void load_v_words(VWords<D> &v, const unsigned char *st, int g, int t) {
    using U = UnitLayout<D>;
    load_words<D / 32>(v.codes[0], st + U::V_CODES + t * U::V_ROW + g * (D / 8));
    load_words<D / 32>(v.codes[1], st + U::V_CODES + (t + 4) * U::V_ROW + g * (D / 8));
    v.scales = *(const uint32_t *)(st + U::V_SCALES + 16 * (g * D / 128) + 4 * t);
}

/* Channels 4j .. 4j + 3 of the lane's range as B-fragment registers in the natural token order, times 2^-14:
   c[h][i] = channel 4j + i of tokens 2t + 8h (low half) and 2t + 8h + 1. Word j of a pair row holds one channel's
   codes of the two tokens 16 bits apart (e2m1x8_to_f16's pairs), so one fp16 product with the tokens' two scales
   makes each register. */
template <int D>
AQ_D void v_channel_quad(uint32_t (&c)[2][4], const VWords<D> &v, int j) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t sc = e4m3x2_to_f16x2(v.scales >> (16 * h));
        e2m1x8_to_f16(v.codes[h][j], c[h]);
#pragma unroll
        for (int i = 0; i < 4; i++) asm("mul.rn.f16x2 %0, %0, %1;\n" : "+r"(c[h][i]) : "r"(sc));
    }
}

/* The A fragment of V^T for m-tile mt from the B-style registers of channels g * D/8 + 2 mt (c0) and + 1 (c1): rows
   g and g + 8 are those channels, tokens 2t, 2t + 1 (row_t) and 2t + 8, 2t + 9 (row_t8). */
AQ_D void v_a_fragment(uint32_t (&a)[4], uint32_t c0_row_t, uint32_t c1_row_t, uint32_t c0_row_t8, uint32_t c1_row_t8) {
    a[0] = c0_row_t, a[1] = c1_row_t, a[2] = c0_row_t8, a[3] = c1_row_t8;
}

/* movmatrix: the transpose of an 8x8 matrix of 16-bit values held one row a lane quad (lane (g, t): row g,
   columns 2t, 2t + 1), in the same layout. */
AQ_D uint32_t transpose_8x8(uint32_t x) {
    uint32_t r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

/* P^T's B fragments (fp16) in the natural token order, from values of P in S^T's C layout (p[nb][e]: key
   g + 8 (e >> 1), query row 8 nb + 2t + (e & 1)): pb[nb][k] = keys 8k + 2t, 8k + 2t + 1 of query row 8 nb + g.
   Packing a lane's key-row pair gives one 8x8 block of P^T row-major by keys; its transpose is the B register. */
template <int NB>
AQ_D void p_b_fragments(uint32_t (&pb)[NB][2], const float (&p)[NB][4]) {
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int k = 0; k < 2; k++) pb[nb][k] = transpose_8x8(pack2<AQ_FLOAT16>(p[nb][2 * k], p[nb][2 * k + 1]));
}

/* O^T += V^T P^F^T for a unit whose every key each query row sees: no hidden term, so a plain product, a channel quad
   (two m-tiles) at a time. */
template <int D, int NB>
AQ_D void pv_packed(float (&o)[D / 16][NB][4], const uint32_t (&pb)[NB][2], const VWords<D> &v) {
#pragma unroll
    for (int j = 0; j < D / 32; j++) {
        uint32_t c[2][4];
        v_channel_quad<D>(c, v, j);
#pragma unroll
        for (int h = 0; h < 2; h++) { /* m-tile 2j + h: channels 4j + 2h, 4j + 2h + 1 */
            uint32_t a[4];
            v_a_fragment(a, c[0][2 * h], c[0][2 * h + 1], c[1][2 * h], c[1][2 * h + 1]);
#pragma unroll
            for (int nb = 0; nb < NB; nb++) mma_16816<AQ_FLOAT16>(o[2 * j + h][nb], a, pb[nb][0], pb[nb][1]);
        }
    }
}

/* All of the lane's V registers of a unit, for pv_checked: vb[n][0] = tokens 2t, 2t + 1 and vb[n][1] = tokens 2t + 8,
   2t + 9 of channel g * D/8 + n. */
template <int D>
AQ_D void packed_v_fragments(uint32_t (&vb)[D / 8][2], const VWords<D> &v) {
#pragma unroll
    for (int j = 0; j < D / 32; j++) {
        uint32_t c[2][4];
        v_channel_quad<D>(c, v, j);
#pragma unroll
        for (int i = 0; i < 4; i++) vb[4 * j + i][0] = c[0][i], vb[4 * j + i][1] = c[1][i];
    }
}

/* O^T += V^T P^T for a unit with hidden terms (the causal edge or the sequence's end, where a page's later tokens hold
   stale values), keeping them absent rather than 0 * x (numerics.md §8): V values that are Inf or NaN (an fp16
   exponent all ones) are zeroed before the product, and afterwards acc[row, channel] becomes NaN where a key visible
   to the row had one in that channel. vis[nb][c]: bit i = key i of the unit is visible to this lane's query row
   8 nb + 2t + c; pb: P^T's B fragments (p_b_fragments). Rare: only the last units of a sequence come here, and the
   NaN bookkeeping runs only if some value is not finite. */
template <int D, int NB>
AQ_D void pv_checked(float (&o)[D / 16][NB][4], const uint32_t (&pb)[NB][2], uint32_t (&vb)[D / 8][2],
                     const uint32_t (&vis)[NB][2], int t) {
    constexpr uint32_t EXP = 0x7C00u;
    uint32_t bad[D / 8], any = 0; /* bad[n]: unit keys with a non-finite value in the lane's channel g * D/8 + n */
#pragma unroll
    for (int nb = 0; nb < D / 8; nb++) {
        uint32_t keys = 0;
#pragma unroll
        for (int k = 0; k < 2; k++)
#pragma unroll
            for (int half = 0; half < 2; half++)
                if (((vb[nb][k] >> (16 * half)) & EXP) == EXP) { /* keys 2t + 8k + half */
                    keys |= 1u << (2 * t + 8 * k + half);
                    vb[nb][k] &= ~(0xFFFFu << (16 * half));
                }
        keys |= __shfl_xor_sync(AQ_FULL_MASK, keys, 1);
        keys |= __shfl_xor_sync(AQ_FULL_MASK, keys, 2);
        bad[nb] = keys;
        any |= keys;
    }
#pragma unroll
    for (int mt = 0; mt < D / 16; mt++) {
        uint32_t a[4];
        v_a_fragment(a, vb[2 * mt][0], vb[2 * mt + 1][0], vb[2 * mt][1], vb[2 * mt + 1][1]);
#pragma unroll
        for (int nb = 0; nb < NB; nb++) mma_16816<AQ_FLOAT16>(o[mt][nb], a, pb[nb][0], pb[nb][1]);
    }
    if (!__any_sync(AQ_FULL_MASK, any != 0)) return;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) { /* the lane's query row 8 nb + 2t + c */
            const uint32_t row_vis = vis[nb][c];
#pragma unroll
            for (int mt = 0; mt < D / 16; mt++)
#pragma unroll
                for (int e = c; e < 4; e += 2)
                    if (row_vis & bad[2 * mt + (e >> 1)]) o[mt][nb][e] = NAN;
        }
}
