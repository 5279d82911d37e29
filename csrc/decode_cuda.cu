/* Decode attention on an NVFP4 KV cache (attn_qat.NVFP4KVCache; attn_qat.h describes the layout): the packed
   codes and scales are read once from global memory, dequantized in registers and multiplied on the tensor cores.

   Work split. CTA (split, m-tile, kv head, batch) takes the keys [split * chunk, (split + 1) * chunk) of one
   sequence and 16 query rows of one KV group: row r = head_in_group * Tq + t is the MMA's M (padded to 16; more
   than 16 rows take several m-tiles, which read the same keys, mostly from L2). The CTA's 4 warps take the chunk's
   16-key units in turn (warp w: units w, w + 4, ...), each with its own integer frame, row sums and O accumulator
   and a private cp.async ring of DEC_STAGES units. The warps' results merge in shared memory, the chunks' in
   decode_combine_kernel. Every frame is an integer, so both merges rescale by exact powers of two: the result is
   that of the one-pass forward kernel (numerics.md §3; chunks are multiples of 16 keys, so no P block straddles
   two of them).

   Numbers. All tensor-core work is fp16 mma.sync m16n8k16 with fp32 accumulation, whatever the cache dtype:
   Q^F, K^F, V^F and fq16(P̂ * 2^11) are exact in fp16 (numerics.md §1, §3), and so are the products formed below
   (no fp16 subnormal appears anywhere). Only the unquantized V tail, at most one unit per sequence, multiplies
   in the cache dtype.

   Fragment layouts (mma.sync m16n8k16, g = lane >> 2, t = lane & 3; see attention_common.cuh). The order of the
   contraction index inside an MMA is free as long as both operands agree, and so is the order of the output
   columns; the kernel picks both so that every lane reads contiguous bytes:
   - S = Q K^T: the k index 2t + i (i = 0, 1) of step kk stands for channel t * D/4 + 4 kk + i, and 2t + 8 + i
     for channel t * D/4 + 4 kk + 2 + i. Lane (g, t) thus needs channels [t * D/4, (t + 1) * D/4) of its query
     rows (g, g + 8) and of its key (g of each 8-key n-block): D/8 contiguous code bytes per key.
   - Keys are in natural order: n-block h of a unit holds keys 8h .. 8h + 7, so the C fragments of S are the
     forward's and two of them make P's A fragment (keys 2t, 2t + 1, 2t + 8, 2t + 9 of the unit).
   - O^T = V^T P^T, channels as M and query rows as N: one n-block (8 rows) when the tile has at most 8 valid rows,
     as with one query token and up to 8 query heads per KV head, else two. With queries as M, as in the forward,
     one query token would fill 4 of the 16 rows of every P V product; this way the product count halves and so
     do the O registers. Row m of m-tile mt is channel (m % 8) * D/8 + 2 mt + m / 8. Lane (g, t) needs pair rows t
     and t + 4 of the V block (tokens 2t, 2t + 1 and 2t + 8, 2t + 9, one byte per channel: exactly an A register)
     for channels [g * D/8, (g + 1) * D/8): D/8 contiguous bytes per row. P^T's B fragment of n-block nb is the
     P A fragment's registers nb and nb + 2 (row 8 nb + g, keys 2t, 2t + 1 and 2t + 8, 2t + 9). The products and
     their positions along the contraction are those of P V with queries as M, so the sums are the same. The
     lane's O elements o[mt][nb][e] are channel g * D/8 + 2 mt + (e >> 1), query row 8 nb + 2t + (e & 1). */
#include "attention_common.cuh"

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_STAGES 4                          /* units in a warp's ring: three in flight while one is used */
#define DEC_UNIT 16                           /* keys per unit: one V block, one P block */
#define DEC_MIN_CHUNK (DEC_WARPS * DEC_UNIT)  /* chunks are multiples of this, at most DEC_MAX_CHUNK */
#define DEC_MAX_CHUNK 1024
#define DEC_F16X2_64 0x54005400u              /* (64.0, 64.0) in fp16 */

/* One unit in shared memory: the bytes of its global rows, in order. V's 8 pair rows are padded by 32 bytes, so the
   row-t, column-(g * D/8) reads of one load phase fall into distinct banks (D = 128: 8 lanes x 16 bytes, row
   offsets 8t words apart mod 32; D = 64: 16 lanes x 8 bytes, 24t words apart). */
template <int D>
struct UnitLayout {
    static constexpr int K_CODES = 0;                            /* 16 keys x D/2 */
    static constexpr int K_SCALES = K_CODES + DEC_UNIT * D / 2;  /* 16 keys x D/16 */
    static constexpr int V_ROW = D + 32;
    static constexpr int V_CODES = K_SCALES + DEC_UNIT * D / 16; /* 8 pair rows x V_ROW (D used) */
    static constexpr int V_SCALES = V_CODES + 8 * V_ROW;         /* D */
    static constexpr int BYTES = V_SCALES + D;
    static_assert(K_SCALES % 16 == 0 && V_CODES % 16 == 0 && V_SCALES % 16 == 0 && BYTES % 16 == 0,
                  "cp.async writes 16-byte chunks");
};

/* ------------------------------------------------------------------------------------------------
   Small device helpers */

AQ_D void cp_async16(void *smem, const void *gmem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
AQ_D void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
AQ_D void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

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

AQ_D uint32_t hmul2(uint32_t a, uint32_t b) { /* two fp16 products, round to nearest (exact for our operands) */
    uint32_t r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

/* Two E4M3 values (low byte first) as an fp16 pair, exactly: one cvt on sm_89+; elsewhere (the sm_80-class build)
   through nvfp4.h's decode, every E4M3 value (2^-9 .. 448, NaN) being an fp16 normal. */
AQ_D uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    uint32_t r = 0;
#pragma unroll
    for (int i = 0; i < 2; i++)
        r |= (uint32_t)__half_as_ushort(__float2half_rn(aq_e4m3_decode((uint8_t)(two_bytes >> (8 * i))))) << (16 * i);
    return r;
#else
    uint32_t r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"((uint16_t)two_bytes));
    return r;
#endif
}

/* The 8 E2M1 codes of w (two per byte, the low nibble first) as four fp16 pairs of code * 2^-6: pair i holds byte
   i, its low nibble in the low half. Each nibble s|e1 e0|m becomes the E4M3 byte s|00 e1 e0|m 00: the sign lands on
   the sign, e on the low exponent bits and m on the top mantissa bit, so the E4M3 value is the E2M1 value times
   2^-6, E2M1's subnormal 0.5 (0|00|1) included, and cvt.rn.f16x2.e4m3x2 converts it exactly. Shifts move nibble
   bits only within their byte, and the masks drop everything else. */
AQ_D void e2m1x8_to_f16(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu); /* byte i: E4M3 of its low nibble */
    const uint32_t hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);        /* byte i: E4M3 of its high nibble */
    const uint32_t b01 = __byte_perm(lo, hi, 0x5140), b23 = __byte_perm(lo, hi, 0x7362); /* lo0 hi0 lo1 hi1, ... */
    out[0] = e4m3x2_to_f16x2(b01);
    out[1] = e4m3x2_to_f16x2(b01 >> 16);
    out[2] = e4m3x2_to_f16x2(b23);
    out[3] = e4m3x2_to_f16x2(b23 >> 16);
}

/* Two E4M3 block scales (low byte first) as the fp16 pairs (s0 * 64, s0 * 64) and (s1 * 64, s1 * 64), the factors
   that turn code * 2^-6 into code * s. s * 64 <= 28672 and >= 2^-3 (or 0, or NaN for a non-finite block): exact. */
AQ_D void scale_pairs(uint32_t two_bytes, uint32_t *s0, uint32_t *s1) {
    const uint32_t s = hmul2(e4m3x2_to_f16x2(two_bytes), DEC_F16X2_64);
    *s0 = __byte_perm(s, 0, 0x1010);
    *s1 = __byte_perm(s, 0, 0x3232);
}

/* A bf16 or fp16 pair as an fp16 pair; exact for the values of a fake-quantized tensor (Q^F). */
template <aq_dtype DT>
AQ_D uint32_t to_f16x2(uint32_t x) {
    if constexpr (DT == AQ_FLOAT16) return x;
    else return pack2<AQ_FLOAT16>(__uint_as_float(x << 16), __uint_as_float(x & 0xFFFF0000u));
}

/* ------------------------------------------------------------------------------------------------
   Unit pieces */

/* The A fragments of Q^F (fp16) for the lane's rows g, g + 8 (row_index: (b * Hq + h) * Tq + t, or -1 for a row
   past the KV group's, which stays 0), in the contraction order of the file comment: qa[kk] = {row g channels
   c, c+1; row g+8 c, c+1; row g c+2, c+3; row g+8 c+2, c+3} with c = t * D/4 + 4 kk. */
template <int D, aq_dtype DT>
AQ_D void load_q_fragments(uint32_t (&qa)[D / 16][4], const void *q, const int64_t row_index[2], int t) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        uint32_t w[D / 8] = {}; /* channel pairs t * D/4 + 2i, + 1 */
        if (row_index[r] >= 0) {
            const uint4 *src = (const uint4 *)((const uint16_t *)q + row_index[r] * D + t * (D / 4));
#pragma unroll
            for (int c = 0; c < D / 32; c++) {
                const uint4 v = src[c];
                w[4 * c] = to_f16x2<DT>(v.x);
                w[4 * c + 1] = to_f16x2<DT>(v.y);
                w[4 * c + 2] = to_f16x2<DT>(v.z);
                w[4 * c + 3] = to_f16x2<DT>(v.w);
            }
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            qa[kk][r] = w[2 * kk];
            qa[kk][r + 2] = w[2 * kk + 1];
        }
    }
}

/* s[h] += Q K^T for n-block h of the unit in `st` (keys 8h .. 8h + 7). Lane (g, t) dequantizes channels
   [t * D/4, (t + 1) * D/4) of key 8h + g: word j holds channel pairs 4j .. 4j + 3 of that range, in block
   t * D/64 + j / 2 (D/4 channels span D/64 blocks of 16). */
template <int D>
AQ_D void unit_scores(float (&s)[2][4], const uint32_t (&qa)[D / 16][4], const unsigned char *st, int g, int t) {
    using U = UnitLayout<D>;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int key = 8 * h + g;
        uint32_t w[D / 32];
        load_words<D / 32>(w, st + U::K_CODES + key * (D / 2) + t * (D / 8));
        const unsigned char *sp = st + U::K_SCALES + key * (D / 16) + t * (D / 64);
        uint32_t sc[2]; /* D = 64: one block, sc[1] unused */
        if constexpr (D == 128) scale_pairs((uint32_t)sp[0] | ((uint32_t)sp[1] << 8), &sc[0], &sc[1]);
        else scale_pairs(sp[0], &sc[0], &sc[1]);
        uint32_t kb[D / 8];
#pragma unroll
        for (int j = 0; j < D / 32; j++) {
            uint32_t c[4];
            e2m1x8_to_f16(w[j], c);
#pragma unroll
            for (int i = 0; i < 4; i++) kb[4 * j + i] = hmul2(c[i], sc[j / 2]);
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) mma_16816<AQ_FLOAT16>(s[h], qa[kk], kb[2 * kk], kb[2 * kk + 1]);
    }
}

/* The B fragments of V^F for the 4 n-blocks 4j .. 4j + 3 from word j of the lane's pair rows t (r0) and t + 4
   (r1) and of its scales (sw): b0[i] = tokens 2t, 2t + 1 and b1[i] = tokens 2t + 8, 2t + 9 of channel
   g * D/8 + 4j + i. */
AQ_D void packed_v_word(uint32_t (&b0)[4], uint32_t (&b1)[4], uint32_t r0, uint32_t r1, uint32_t sw) {
    uint32_t c0[4], c1[4], sc[4];
    e2m1x8_to_f16(r0, c0);
    e2m1x8_to_f16(r1, c1);
    scale_pairs(sw, &sc[0], &sc[1]);
    scale_pairs(sw >> 16, &sc[2], &sc[3]);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        b0[i] = hmul2(c0[i], sc[i]);
        b1[i] = hmul2(c1[i], sc[i]);
    }
}

template <int D>
AQ_D void load_v_words(uint32_t (&r0)[D / 32], uint32_t (&r1)[D / 32], uint32_t (&sw)[D / 32],
                       const unsigned char *st, int g, int t) {
    using U = UnitLayout<D>;
    load_words<D / 32>(r0, st + U::V_CODES + t * U::V_ROW + g * (D / 8));
    load_words<D / 32>(r1, st + U::V_CODES + (t + 4) * U::V_ROW + g * (D / 8));
    load_words<D / 32>(sw, st + U::V_SCALES + g * (D / 8));
}

/* The A fragment of V^T for m-tile mt from the B-style registers of channels g * D/8 + 2 mt (b[0]) and + 1 (b[1]):
   rows t (tokens 2t, 2t + 1) and t + 4 (2t + 8, 2t + 9). */
AQ_D void v_a_fragment(uint32_t (&a)[4], uint32_t c0_row_t, uint32_t c1_row_t, uint32_t c0_row_t4, uint32_t c1_row_t4) {
    a[0] = c0_row_t, a[1] = c1_row_t, a[2] = c0_row_t4, a[3] = c1_row_t4;
}

/* O^T += V^T P^F^T for a unit whose every key each query row sees: no hidden term, so a plain product. */
template <int D, int NB>
AQ_D void pv_packed(float (&o)[D / 16][NB][4], const uint32_t pa[4], const unsigned char *st, int g, int t) {
    uint32_t r0[D / 32], r1[D / 32], sw[D / 32];
    load_v_words<D>(r0, r1, sw, st, g, t);
#pragma unroll
    for (int j = 0; j < D / 32; j++) {
        uint32_t b0[4], b1[4]; /* channels g * D/8 + 4j + i */
        packed_v_word(b0, b1, r0[j], r1[j], sw[j]);
#pragma unroll
        for (int h = 0; h < 2; h++) { /* m-tile 2j + h: channels 4j + 2h and 4j + 2h + 1 of the lane's range */
            uint32_t a[4];
            v_a_fragment(a, b0[2 * h], b0[2 * h + 1], b1[2 * h], b1[2 * h + 1]);
#pragma unroll
            for (int nb = 0; nb < NB; nb++) mma_16816<AQ_FLOAT16>(o[2 * j + h][nb], a, pa[nb], pa[nb + 2]);
        }
    }
}

/* All B fragments of a packed V unit, for pv_checked. */
template <int D>
AQ_D void packed_v_fragments(uint32_t (&vb)[D / 8][2], const unsigned char *st, int g, int t) {
    uint32_t r0[D / 32], r1[D / 32], sw[D / 32];
    load_v_words<D>(r0, r1, sw, st, g, t);
#pragma unroll
    for (int j = 0; j < D / 32; j++) {
        uint32_t b0[4], b1[4];
        packed_v_word(b0, b1, r0[j], r1[j], sw[j]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            vb[4 * j + i][0] = b0[i];
            vb[4 * j + i][1] = b1[i];
        }
    }
}

/* The B fragments (cache dtype) of the unquantized tail: rows 0 .. valid-1 of v_tail (16, D) are tokens; later
   rows are not read and count as 0. Lane (g, t) reads channels [g * D/8, (g + 1) * D/8) of rows 2t, 2t + 1 (for
   vb[.][0]) and 2t + 8, 2t + 9 (vb[.][1]); n-block nb takes channel g * D/8 + nb of each. */
template <int D>
AQ_D void tail_v_fragments(uint32_t (&vb)[D / 8][2], const uint16_t *tail, int valid, int g, int t) {
#pragma unroll
    for (int k = 0; k < 2; k++) {
        uint32_t w[2][D / 16] = {}; /* rows 2t + 8k and 2t + 8k + 1, two channels per word */
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int row = 2 * t + 8 * k + i;
            if (row >= valid) continue;
            const uint4 *src = (const uint4 *)(tail + row * D + g * (D / 8));
#pragma unroll
            for (int c = 0; c < D / 64; c++) {
                const uint4 v = src[c];
                w[i][4 * c] = v.x, w[i][4 * c + 1] = v.y, w[i][4 * c + 2] = v.z, w[i][4 * c + 3] = v.w;
            }
        }
#pragma unroll
        for (int nb = 0; nb < D / 8; nb++) /* low halves for even channels, high halves for odd ones */
            vb[nb][k] = __byte_perm(w[0][nb / 2], w[1][nb / 2], nb % 2 ? 0x7632 : 0x5410);
    }
}

/* O^T += V^T P^T for a unit with hidden terms (the causal edge or the tail's end), keeping them absent rather than
   0 * x (numerics.md §8): V values that are Inf or NaN (MT's exponent all ones) are zeroed before the product,
   and afterwards acc[row, channel] becomes NaN where a key visible to the row had one in that channel.
   vis[r]: bit i = key i of the unit is visible to this lane's row g + 8r. Rare: only the last units of a sequence
   come here, and the NaN bookkeeping runs only if some value is not finite. */
template <int D, int NB, aq_dtype MT>
AQ_D void pv_checked(float (&o)[D / 16][NB][4], const uint32_t pa[4], uint32_t (&vb)[D / 8][2], const uint32_t vis[2],
                     int t) {
    constexpr uint32_t EXP = MT == AQ_BFLOAT16 ? 0x7F80u : 0x7C00u;
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
        for (int nb = 0; nb < NB; nb++) mma_16816<MT>(o[mt][nb], a, pa[nb], pa[nb + 2]);
    }
    if (!__any_sync(AQ_FULL_MASK, any != 0)) return;
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) { /* query row 8 nb + 2t + c is row g' = 2t + c of lanes 4g' .. 4g' + 3 */
            const uint32_t row_vis = __shfl_sync(AQ_FULL_MASK, vis[nb], 4 * (2 * t + c));
#pragma unroll
            for (int mt = 0; mt < D / 16; mt++)
#pragma unroll
                for (int e = c; e < 4; e += 2)
                    if (row_vis & bad[2 * mt + (e >> 1)]) o[mt][nb][e] = NAN;
        }
}

/* o *= alpha of each query row (alpha[r]: rows g + 8r of this lane, as online_softmax_scores leaves it). */
template <int D, int NB>
AQ_D void rescale_query_columns(float (&o)[D / 16][NB][4], const float alpha[2], int t) {
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float f = __shfl_sync(AQ_FULL_MASK, alpha[nb], 4 * (2 * t + c));
#pragma unroll
            for (int mt = 0; mt < D / 16; mt++) {
                o[mt][nb][c] *= f;
                o[mt][nb][c + 2] *= f;
            }
        }
}

/* The cache of one (batch, kv head): its four packed buffers. */
typedef struct {
    const uint8_t *k_codes, *k_scales, *v_codes, *v_scales;
} head_cache;

/* online_softmax_scores and the rescale of O for one unit, without that rescale when no row's frame moves, as in
   most units after the first few: every factor would then be exactly 1 (an integer frame only moves by a whole
   number), so the result is the same bit for bit. A row still at frame -inf takes the full step, which handles it. */
template <int D, int NB>
AQ_D void unit_softmax(float (&s)[2][4], float (&o)[D / 16][NB][4], float m[2], float l[2], int t) {
    bool moves = false;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(AQ_FULL_MASK, mx, 2));
        moves |= m[r] == -INFINITY || ceilf(mx) > m[r];
    }
    if (__any_sync(AQ_FULL_MASK, moves)) {
        float alpha[2];
        online_softmax_scores<DEC_UNIT>(s, m, l, alpha);
        rescale_query_columns<D, NB>(o, alpha, t);
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; r++)
#pragma unroll
        for (int n = 0; n < 2; n++) {
            s[n][2 * r] = frame_exp2(s[n][2 * r] - m[r]);
            s[n][2 * r + 1] = frame_exp2(s[n][2 * r + 1] - m[r]);
            l[r] += s[n][2 * r] + s[n][2 * r + 1];
        }
}

/* Issues the cp.async copies of unit u (all its bytes, 16 per copy, spread over the warp's lanes) into st. */
template <int D>
AQ_D void load_unit(unsigned char *st, const head_cache &hc, int u, int lane) {
    using U = UnitLayout<D>;
    const uint8_t *kc = hc.k_codes + (int64_t)u * DEC_UNIT * (D / 2);
    const uint8_t *ks = hc.k_scales + (int64_t)u * DEC_UNIT * (D / 16);
    const uint8_t *vc = hc.v_codes + (int64_t)u * (DEC_UNIT / 2) * D;
    const uint8_t *vs = hc.v_scales + (int64_t)u * D;
#pragma unroll
    for (int c = lane; c < DEC_UNIT * D / 32; c += 32) cp_async16(st + U::K_CODES + 16 * c, kc + 16 * c);
    if (lane < D / 16) {
        cp_async16(st + U::K_SCALES + 16 * lane, ks + 16 * lane);
        cp_async16(st + U::V_SCALES + 16 * lane, vs + 16 * lane);
    }
#pragma unroll
    for (int c = lane; c < 8 * (D / 16); c += 32) {
        const int row = c / (D / 16), col = 16 * (c % (D / 16));
        cp_async16(st + U::V_CODES + row * U::V_ROW + col, vc + row * D + col);
    }
}

/* ------------------------------------------------------------------------------------------------
   Kernels */

/* grid (num_splits * m_tiles, Hkv, B), DEC_THREADS threads; NB query n-blocks of O^T (1: the tile has at most 8
   valid rows). Writes, for each of its valid rows, the chunk's partial result to the workspace: D floats of
   unnormalised O (sum of fq16(P̂ * 2^11) v), then the frame M and the row sum l. Chunks at or past the sequence's
   length write nothing (the combine kernel stops before them). With one n-block the O registers fit in 128 per
   thread, so four CTAs (16 warps) share an SM instead of three: more units in flight and in compute. */
template <int D, aq_dtype DT, int NB>
__global__ void __launch_bounds__(DEC_THREADS, NB == 1 ? 4 : 3) kv_decode_kernel(const aq_decode_params p, int m_tiles) {
    using U = UnitLayout<D>;
    constexpr int RING = DEC_STAGES * U::BYTES, MERGE = DEC_WARPS * 16 * (D + 2) * (int)sizeof(float);
    __shared__ __align__(16) unsigned char smem[DEC_WARPS * RING > MERGE ? DEC_WARPS * RING : MERGE];

    const int split = (int)blockIdx.x / m_tiles, mt = (int)blockIdx.x % m_tiles;
    const int hk = (int)blockIdx.y, b = (int)blockIdx.z;
    const int L = (int)min(max(p.lengths[b], (int64_t)0), p.max_length);
    const int chunk = (int)p.chunk, c0 = split * chunk;
    if (c0 >= L) return; /* CTA-uniform, before any barrier */
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int tq_count = (int)p.seqlen_q, group = (int)(p.heads_q / p.heads_kv), rows = group * tq_count;
    const int full_units = L / DEC_UNIT; /* units below have a packed V block; unit full_units is the tail */
    const int u_begin = c0 / DEC_UNIT, u_end = (min(c0 + chunk, L) + DEC_UNIT - 1) / DEC_UNIT;
    const int64_t kv_head = (int64_t)b * p.heads_kv + hk;

    head_cache hc;
    hc.k_codes = p.k_codes + kv_head * p.capacity * (D / 2);
    hc.k_scales = p.k_scales + kv_head * p.capacity * (D / 16);
    hc.v_codes = p.v_codes + kv_head * (p.capacity / 2) * D;
    hc.v_scales = p.v_scales + kv_head * (p.capacity / 16) * D;

    /* the lane's query rows g and g + 8 of the tile: the last key each sees (keys < L only; rows past the group's,
       which are computed and dropped, see them all) and where its Q^F and output live (-1: past the group's) */
    int lim[2];
    int64_t row_index[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int ridx = 16 * mt + g + 8 * r, tq = ridx % tq_count;
        lim[r] = ridx < rows && p.causal ? L - tq_count + tq : L - 1;
        row_index[r] = ridx < rows ? ((int64_t)b * p.heads_q + (int64_t)hk * group + ridx / tq_count) * tq_count + tq
                                   : -1;
    }
    uint32_t qa[D / 16][4];
    load_q_fragments<D, DT>(qa, p.q, row_index, t);

    float o[D / 16][NB][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int mt = 0; mt < D / 16; mt++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++) o[mt][nb][0] = o[mt][nb][1] = o[mt][nb][2] = o[mt][nb][3] = 0.0f;
    const float scale_log2 = p.softmax_scale * AQ_LOG2E;

    /* This warp's units u_begin + warp + DEC_WARPS * i, i < count, through its ring: unit i sits in stage
       i % DEC_STAGES and is cp.async group i (one group is committed per step, empty or not). */
    unsigned char *ring = smem + warp * RING;
    const int n_units = u_end - u_begin;
    const int count = n_units > warp ? (n_units - warp + DEC_WARPS - 1) / DEC_WARPS : 0;
#pragma unroll
    for (int i = 0; i < DEC_STAGES - 1; i++) {
        if (i < count) load_unit<D>(ring + i * U::BYTES, hc, u_begin + warp + DEC_WARPS * i, lane);
        cp_async_commit();
    }
    for (int i = 0; i < count; i++) {
        const int ahead = i + DEC_STAGES - 1; /* into the stage that step i - 1 used and released */
        if (ahead < count)
            load_unit<D>(ring + (ahead % DEC_STAGES) * U::BYTES, hc, u_begin + warp + DEC_WARPS * ahead, lane);
        cp_async_commit();
        cp_async_wait<DEC_STAGES - 1>(); /* group i has landed (for this lane's copies) */
        __syncwarp();                    /* ... and every lane's copies are visible to the warp */
        const unsigned char *st = ring + (i % DEC_STAGES) * U::BYTES;
        const int u = u_begin + warp + DEC_WARPS * i, key0 = u * DEC_UNIT;
        const bool tail = u == full_units;
        const bool masked = tail || (p.causal && key0 + DEC_UNIT - 1 > L - tq_count);

        float s[2][4] = {};
        unit_scores<D>(s, qa, st, g, t);
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = key0 + 8 * h + frag_c_col(lane, e);
                s[h][e] = !masked || key <= lim[e >> 1] ? s[h][e] * scale_log2 : -INFINITY;
            }
        unit_softmax<D, NB>(s, o, m, l, t); /* s becomes P̂ */

        uint32_t vis[2] = {0xFFFFu, 0xFFFFu};
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int n = min(max(lim[r] - key0 + 1, 0), DEC_UNIT);
            vis[r] = (1u << n) - 1u;
        }
        if (!tail) {
            uint32_t pa[4];
            quantized_p_fragment<AQ_FLOAT16>(pa, s[0], s[1]);
            if (!masked) {
                pv_packed<D, NB>(o, pa, st, g, t);
            } else {
                uint32_t vb[D / 8][2];
                packed_v_fragments<D>(vb, st, g, t);
                pv_checked<D, NB, AQ_FLOAT16>(o, pa, vb, vis, t);
            }
        } else {
            uint32_t pa[4];
            quantized_p_fragment<DT>(pa, s[0], s[1]);
            uint32_t vb[D / 8][2];
            tail_v_fragments<D>(vb, (const uint16_t *)p.v_tail + kv_head * DEC_UNIT * D, L - key0, g, t);
            pv_checked<D, NB, DT>(o, pa, vb, vis, t);
        }
        __syncwarp(); /* every lane is done with stage i % DEC_STAGES before step i + 1 refills it */
    }

    /* Merge the warps' partial results: the rings are free once every copy has landed and every warp is done. */
    cp_async_wait<0>();
    __syncthreads();
    float *merge_o = (float *)smem;                      /* [warp][16 rows][D], channel order */
    float *merge_m = merge_o + DEC_WARPS * 16 * D;       /* [warp][16 rows] */
    float *merge_l = merge_m + DEC_WARPS * 16;           /* [warp][16 rows] */
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lsum = l[r] + __shfl_xor_sync(AQ_FULL_MASK, l[r], 1);
        lsum += __shfl_xor_sync(AQ_FULL_MASK, lsum, 2);
        if (t == 0) {
            merge_m[warp * 16 + g + 8 * r] = m[r];
            merge_l[warp * 16 + g + 8 * r] = lsum;
        }
    }
#pragma unroll
    for (int mt = 0; mt < D / 16; mt++)
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) /* rows past 8 * NB are past the tile's valid rows: never read */
                merge_o[(warp * 16 + 8 * nb + frag_c_col(lane, e)) * D + g * (D / 8) + 2 * mt + (e >> 1)] = o[mt][nb][e];
    __syncthreads();
    for (int idx = (int)threadIdx.x; idx < 16 * D; idx += DEC_THREADS) {
        const int row = idx / D, d = idx % D, ridx = 16 * mt + row;
        if (ridx >= rows) break; /* rows ascend with idx */
        float frame = -INFINITY;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) frame = fmaxf(frame, merge_m[w * 16 + row]);
        float acc = 0.0f, lsum = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) { /* 0 for a warp with nothing (frame -inf), and when frame is -inf */
            const float f = exp2_frame_step(merge_m[w * 16 + row] - frame);
            acc += merge_o[(w * 16 + row) * D + d] * f;
            lsum += merge_l[w * 16 + row] * f;
        }
        const int64_t out_row = ((int64_t)b * p.heads_q + (int64_t)hk * group + ridx / tq_count) * tq_count +
                                ridx % tq_count;
        float *part = p.workspace + (out_row * p.num_splits + split) * (D + 2);
        part[d] = acc;
        if (d == 0) {
            part[D] = frame;
            part[D + 1] = lsum;
        }
    }
}

/* grid B * Hq * Tq (one output row each), D threads (one channel each): merges the row's chunks and writes O in
   the cache dtype. A row with no visible key is 0 (numerics.md §6); one whose visible scores are all -inf or NaN
   has frame -inf and is NaN, like the forward kernels. */
template <int D, aq_dtype DT>
__global__ void __launch_bounds__(D) decode_combine_kernel(const aq_decode_params p) {
    const int64_t row = blockIdx.x; /* (b * Hq + h) * Tq + t */
    const int tq_count = (int)p.seqlen_q, tq = (int)(row % tq_count), d = (int)threadIdx.x;
    const int64_t b = row / (p.heads_q * tq_count);
    const int L = (int)min(max(p.lengths[b], (int64_t)0), p.max_length);
    const int visible = p.causal ? min(L, L - tq_count + tq + 1) : L;
    float out = 0.0f;
    if (visible > 0) {
        const int splits = (int)min((int64_t)((L + p.chunk - 1) / p.chunk), p.num_splits);
        const float *part = p.workspace + row * p.num_splits * (D + 2);
        float frame = -INFINITY;
        for (int s = 0; s < splits; s++) frame = fmaxf(frame, part[s * (D + 2) + D]);
        if (frame == -INFINITY) {
            out = NAN;
        } else {
            float acc = 0.0f, lsum = 0.0f;
            for (int s = 0; s < splits; s++) {
                const float f = exp2_frame_step(part[s * (D + 2) + D] - frame);
                acc += part[s * (D + 2) + d] * f;
                lsum += part[s * (D + 2) + D + 1] * f;
            }
            out = acc * AQ_P_HEADROOM_INV * (1.0f / lsum);
        }
    }
    ((uint16_t *)p.out)[row * D + d] = (uint16_t)(pack2<DT>(out, 0.0f) & 0xFFFFu);
}

/* ------------------------------------------------------------------------------------------------
   Launchers */

static int decode_m_tiles(const aq_decode_params *p) {
    return (int)((p->heads_q / p->heads_kv * p->seqlen_q + 15) / 16);
}

const char *aq_kv_cache_decode_plan_cuda(aq_decode_params *p, int64_t *workspace_floats) {
    if (p->dtype != AQ_BFLOAT16 && p->dtype != AQ_FLOAT16) return "kv_cache_decode: dtype must be bfloat16 or float16";
    if (p->head_dim != 64 && p->head_dim != 128) return "kv_cache_decode: head_dim must be 64 or 128";
    if (p->heads_kv <= 0 || p->heads_q <= 0 || p->heads_q % p->heads_kv != 0)
        return "kv_cache_decode: heads_q must be a positive multiple of heads_kv";
    if (p->batch < 0 || p->batch > 65535 || p->heads_kv > 65535)
        return "kv_cache_decode: batch and heads_kv must be <= 65535";
    if (p->seqlen_q < 1 || p->seqlen_q > 16) return "kv_cache_decode: 1 to 16 query tokens";
    if (p->heads_q / p->heads_kv > 1024) return "kv_cache_decode: at most 1024 query heads per KV head";
    if (p->capacity < 0 || p->capacity % DEC_UNIT || p->capacity > INT32_MAX - 2 * DEC_MAX_CHUNK)
        return "kv_cache_decode: capacity must be a multiple of 16 below 2^31 - 2048";
    if (p->max_length < 0 || p->max_length > p->capacity) return "kv_cache_decode: max_length must be in [0, capacity]";
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    /* The longest chunks (up to DEC_MAX_CHUNK keys) that still give every SM a CTA: a CTA's four warps already
       keep enough loads in flight, and shorter chunks only add pipeline start-up and partial results. Measured on
       the H100 (batch 8, 32 q / 8 kv heads, D = 128, one query token): 4k context 42.6 us with this rule against
       121 us when aiming at 12 CTAs per SM; 32k context unchanged (1024-key chunks either way, 258-261 us). */
    const int64_t ctas_per_split = p->batch * p->heads_kv * decode_m_tiles(p);
    int64_t chunk = DEC_MAX_CHUNK;
    while (chunk > DEC_MIN_CHUNK && ctas_per_split * ((p->max_length + chunk - 1) / chunk) < (int64_t)sms)
        chunk /= 2;
    p->chunk = chunk;
    p->num_splits = (p->max_length + chunk - 1) / chunk;
    if (p->num_splits * decode_m_tiles(p) > INT32_MAX) return "kv_cache_decode: too many query rows and splits";
    *workspace_floats = p->batch * p->heads_q * p->seqlen_q * p->num_splits * (p->head_dim + 2);
    return NULL;
}

template <int D, aq_dtype DT>
static const char *launch_decode(const aq_decode_params *p, cudaStream_t stream) {
    const int m_tiles = decode_m_tiles(p);
    if (p->num_splits > 0) {
        const dim3 grid((unsigned)(p->num_splits * m_tiles), (unsigned)p->heads_kv, (unsigned)p->batch);
        if (p->heads_q / p->heads_kv * p->seqlen_q <= 8)
            kv_decode_kernel<D, DT, 1><<<grid, DEC_THREADS, 0, stream>>>(*p, m_tiles);
        else
            kv_decode_kernel<D, DT, 2><<<grid, DEC_THREADS, 0, stream>>>(*p, m_tiles);
        const char *err = launch_status();
        if (err) return err;
    }
    const int64_t rows = p->batch * p->heads_q * p->seqlen_q;
    if (rows > INT32_MAX) return "kv_cache_decode: too many output rows";
    decode_combine_kernel<D, DT><<<(unsigned)rows, D, 0, stream>>>(*p);
    return launch_status();
}

const char *aq_kv_cache_decode_cuda(const aq_decode_params *p, void *stream) {
    if (p->batch == 0) return NULL;
    if (p->chunk < DEC_MIN_CHUNK || p->chunk % DEC_MIN_CHUNK || p->chunk > DEC_MAX_CHUNK)
        return "kv_cache_decode: call aq_kv_cache_decode_plan_cuda first";
    const void *ptrs[] = {p->q, p->k_codes, p->k_scales, p->v_codes, p->v_scales, p->v_tail, p->workspace};
    for (const void *ptr : ptrs)
        if (!aligned16(ptr)) return "kv_cache_decode: every buffer must be 16-byte aligned";
    cudaStream_t s = (cudaStream_t)stream;
    if (p->dtype == AQ_BFLOAT16)
        return p->head_dim == 64 ? launch_decode<64, AQ_BFLOAT16>(p, s) : launch_decode<128, AQ_BFLOAT16>(p, s);
    return p->head_dim == 64 ? launch_decode<64, AQ_FLOAT16>(p, s) : launch_decode<128, AQ_FLOAT16>(p, s);
}
