/* Decode attention on an NVFP4 KV cache (attn_qat.NVFP4KVCache; attn_qat.h describes the layout): the packed
   codes and scales are read once from global memory, dequantized in registers and multiplied on the tensor cores.

   Work split. CTA (split, m-tile, kv head, batch) takes the keys [split * chunk, (split + 1) * chunk) of one
   sequence and 16 query rows of one KV group: row r = head_in_group * Tq + t is the MMA's M (padded to 16; more
   than 16 rows take several m-tiles, which read the same keys, mostly from L2). The CTA's 4 warps take the chunk's
   16-key units in turn (warp w: units w, w + 4, ...), each with its own integer frame, row sums and O accumulator
   and a private cp.async ring of DEC_STAGES units. The warps' results merge in shared memory, the chunks' either
   in decode_combine_kernel or, by default, in the last of a sequence's CTAs to finish (merge_chunks, counted in by
   one atomic a CTA: no second kernel; a one-chunk sequence writes O at once). Every frame is an integer, so both
   merges rescale by exact powers of two: the result is that of the one-pass forward kernel (numerics.md §3; chunks
   are multiples of 16 keys, so no P block straddles two of them), and both chunk merges add the same terms in the
   same order (merge_term), so they agree bit for bit.

   Pages. A unit (16 tokens of one KV head) never straddles a page (pages are multiples of 16 tokens), so paging
   only changes where a unit's bytes start: the CTA looks its units' pool slots up in the block table once, into
   shared memory, and every copy after that is addressed as in a contiguous cache. The unpaged cache is the
   one-page-per-sequence case of the same kernel. Measured on the H100 (batch 8, 32 q / 8 kv heads, D = 128, one
   query token, CUDA graphs): 16-token pages cost nothing at 32k context (136.7 against 136.4 us), the lookup
   ~1 us at 4k (30.2 against 29.1 us before the block table).

   Numbers. All tensor-core work is fp16 mma.sync m16n8k16 with fp32 accumulation, whatever the cache dtype:
   Q^F, 2^-14 K^F, 2^-14 V^F and fq16(P̂ * 2^11) are exact in fp16 (numerics.md §1, §3; 2^-14 K^F and 2^-14 V^F
   reach the fp16 subnormals, which the tensor cores take exactly), and so are the products formed below. The
   2^-14 is undone where it costs nothing: in the factor that turns scores into log2 logits, and in the factor
   that stores the partial O. K and V are both blocked along D, one token at a time (numerics.md §2), so every
   cached token is packed and the last unit of a sequence differs from the others only in its hidden keys.

   Dequantization (e2m1x8_to_f16) uses no convert instruction and no table: an E2M1 code s e1 e0 m placed in an
   fp16 as sign s and bits e1 e0 m at 11 .. 9 (exponent field e1 e0, top mantissa bit m) reads as its value
   times 2^-14 (e = 0: the subnormal m * 2^-15); a code word's eight are placed with four masks and four byte
   permutes. The block scale, converted to fp16, then multiplies it to K^F or V^F times 2^-14. A code word yields
   the pairs (code i, code i + 4), i < 4: the two codes 16 bits apart, the two halves of an fp16 pair. That
   pairing fixes the contraction order below.

   Fragment layouts (mma.sync m16n8k16, g = lane >> 2, t = lane & 3; see attention/fragments.cuh). The order of the
   contraction index inside an MMA is free as long as both operands agree, and so is the order of the output
   columns; the kernel picks both so that every lane reads contiguous bytes and dequantizes a code word into
   whole registers:
   - S^T = K Q^T, keys as M and query rows as N (NB n-blocks of 8 rows: one when the tile has at most 8 valid
     rows, as with one query token and up to 8 query heads per KV head, else two). With c = t * D/4 + 8 (kk >> 1)
     + 2 (kk & 1), the k index 2t + i (i = 0, 1) of step kk stands for channel c + 4i, and 2t + 8 + i for
     channel c + 1 + 4i. Lane (g, t) thus needs channels [t * D/4, (t + 1) * D/4) of keys g and g + 8 (its A
     rows) and of query rows 8 nb + g (its B columns): D/8 contiguous code bytes per key; code word j (channels
     t * D/4 + 8j .. + 7) gives steps 2j and 2j + 1. The C fragments hold key g + 8 (e >> 1) of query row
     8 nb + 2t + (e & 1): a lane keeps the softmax state of its own query rows, whose 16 keys of a unit are in
     the 8 lanes sharing t.
   - O^T = V^T P^T, channels as M and query rows as N, NB n-blocks as above. With queries as M, as in the forward,
     one query token would fill 4 of the 16 rows of every P V product; this way the product count halves and so
     do the O registers. Row m of m-tile mt is channel (m % 8) * D/8 + 2 mt + m / 8, and the k index is the token
     (natural order). Lane (g, t) needs tokens 2t, 2t + 1, 2t + 8, 2t + 9 of channels [g * D/8, (g + 1) * D/8),
     inside one 16-channel block, so one scale a token. The cache interleaves the code bytes of tokens 2p and
     2p + 1 by 16-bit halves (attn_qat.h), so the lane reads D/8 contiguous bytes of pair rows t and t + 4, and
     word j of them, half j of both tokens, has codes i and i + 4 = channel 4j + i of the two tokens:
     e2m1x8_to_f16 turns it into the A registers of channels 4j .. 4j + 3, each times the two tokens' scales in
     one fp16 product. The scales, block-major in the order the lanes take them, come in one 32-bit load.
     P^T's B fragments come from S^T's C fragments by one movmatrix per 8 keys (keys 2t, 2t + 1 and 2t + 8,
     2t + 9 of query row 8 nb + g). The lane's O elements o[mt][nb][e] are channel g * D/8 + 2 mt + (e >> 1),
     query row 8 nb + 2t + (e & 1): the rows whose softmax state the lane keeps.
   - Units with hidden keys (pv_checked) take the same fragments, with non-finite V values set aside. */
#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "attention/fragments.cuh"
#include "attention/launch.h"
#include "attention/softmax.cuh"

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_STAGES 4                          /* units in a warp's ring: a step's one or two, the rest in flight */
#define DEC_UNIT 16                           /* keys per unit: one V block, one P block */
#define DEC_MIN_CHUNK (DEC_WARPS * DEC_UNIT)  /* chunks are multiples of this, at most DEC_MAX_CHUNK */
#define DEC_MAX_CHUNK AQ_DECODE_CHUNK_MAX
#define DEC_FRAME 16384.0f                    /* K^F and V^F are dequantized times 1 / DEC_FRAME (file comment) */

/* One unit in shared memory: the bytes of its global rows, in order (attn_qat.h has V's unit layout). V's 8 pair rows
   are padded by 32 bytes, so the row-t, column-(g * D/8) reads of one load phase fall into distinct banks (D = 128:
   8 lanes x 16 bytes, row offsets 8t words apart mod 32; D = 64: 16 lanes x 8 bytes, 24t words apart). */
template <int D>
struct UnitLayout {
    static constexpr int K_CODES = 0;                            /* 16 keys x D/2 */
    static constexpr int K_SCALES = K_CODES + DEC_UNIT * D / 2;  /* 16 keys x D/16 */
    static constexpr int V_ROW = D + 32;
    static constexpr int V_CODES = K_SCALES + DEC_UNIT * D / 16; /* 8 pair rows x V_ROW (D used) */
    static constexpr int V_SCALES = V_CODES + 8 * V_ROW;         /* D/16 blocks x 16 tokens */
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

/* Two fp16 products a * s_half (round to nearest, exact for our operands) with one half of s (half 0: low) as
   both factors: ptxas folds the broadcast into the HMUL2 operand (.H0_H0 / .H1_H1). */
AQ_D uint32_t hmul2_by_half(uint32_t a, uint32_t s, int half) {
    uint32_t r;
    if (half == 0)
        asm("{\n .reg .b16 l, h;\n .reg .b32 f;\n mov.b32 {l, h}, %2;\n mov.b32 f, {l, l};\n"
            " mul.rn.f16x2 %0, %1, f;\n}\n" : "=r"(r) : "r"(a), "r"(s));
    else
        asm("{\n .reg .b16 l, h;\n .reg .b32 f;\n mov.b32 {l, h}, %2;\n mov.b32 f, {h, h};\n"
            " mul.rn.f16x2 %0, %1, f;\n}\n" : "=r"(r) : "r"(a), "r"(s));
    return r;
}

/* Two E4M3 values (low byte first) as an fp16 pair, exactly: one cvt on sm_89+; elsewhere (the sm_80-class build)
   through nvfp4.h's decode, every E4M3 value (2^-9 .. 448, NaN) being an fp16 normal. As block scales, with
   e2m1x8_to_f16's 2^-14, hmul2_by_half gives the K^F or V^F element times 2^-14: a product of an E2M1 value (at
   most 2 significant bits, 0.5 .. 6) and an E4M3 value (at most 4, 2^-9 .. 448) has at most 6 significant bits
   and lies in [2^-10, 2688] or is 0; times 2^-14 it lies in [2^-24, 0.165], its last bit at or above 2^-24, the
   fp16 subnormals' step: exact in fp16. A NaN scale (non-finite block) makes every product NaN, 0 included. */
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

/* The 8 E2M1 codes n0 .. n7 of w (nibble i = bits 4i .. 4i + 3, sign in its top bit) as four fp16 pairs of their
   values times 2^-14: out[i] = (n_i, n_{i+4}), n_i in the low half; -0 for code 8 (aq_e2m1_value's decode). A
   placed code fills one byte (sign at bit 7, magnitude at 3 .. 1, the rest 0), so the even codes are placed
   all at once in the bytes of `even`, the odd ones in `odd`, and one byte permute puts two of them in the high
   bytes of an fp16 pair: two masks serve four codes, where masking each pair took two (11 instructions a word
   instead of 16; bit-identical, checked over all 2^32 words). */
AQ_D void e2m1x8_to_f16(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t even = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u); /* byte k: n_{2k} */
    const uint32_t odd = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);        /* byte k: n_{2k+1} */
    out[0] = __byte_perm(even, 0, 0x2404); /* bytes 0 and 2 (n0, n4) to bytes 1 and 3, zeros below */
    out[1] = __byte_perm(odd, 0, 0x2404);
    out[2] = __byte_perm(even, 0, 0x3414);
    out[3] = __byte_perm(odd, 0, 0x3414);
}

/* ------------------------------------------------------------------------------------------------
   Unit pieces */

/* The B fragments of Q^F (fp16) for n-block nb of the tile's query rows: row 8 nb + g (row_index[nb]:
   (b * Hq + h) * Tq + t, or -1 for a row past the KV group's, which stays 0), in the contraction order of the file
   comment: qb[kk][nb] = {channels c, c + 4; channels c + 1, c + 5} with c = t * D/4 + 8 (kk >> 1) + 2 (kk & 1).
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
   steps 2j (i = 0, 1) and 2j + 1 (i = 2, 3), in the file comment's order. qf: Q^F's B fragments of
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

/* The lane's V of a unit (file comment): channels [g * D/8, (g + 1) * D/8) (within one 16-channel block) of tokens
   2t, 2t + 1 (codes[0]) and 2t + 8, 2t + 9 (codes[1]), word j holding half j of both tokens' code bytes (the first
   token's in the low half), and those tokens' block scales: bytes 0 .. 3 of `scales` are tokens 2t, 2t + 1, 2t + 8,
   2t + 9. */
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

/* The cache's four packed page pools. */
typedef struct {
    const uint8_t *k_codes, *k_scales, *v_codes, *v_scales;
} page_pools;

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

/* Issues the cp.async copies of the unit stored at pool unit `slot` (all its bytes, 16 per copy, spread over the
   warp's lanes) into st. A pool unit is 16 tokens of one (page, KV head): its K and V codes are 8 D bytes each and
   its K and V scales D bytes each, at slot * 8 D and slot * D of the pools, and chunk c of every block is 16 c bytes
   in, so the lane's chunks lane + 32 j of all four buffers come from two offsets. In V's padded stage rows, chunk c
   is pair row c / (D/16), column 16 (c % (D/16)). */
template <int D>
AQ_D void load_unit(unsigned char *st, const page_pools &pools, uint32_t slot, int lane) {
    using U = UnitLayout<D>;
    constexpr int CHUNKS = 8 * D / 16 / 32, ROW_CHUNKS = D / 16; /* a lane's chunks of a code block; a V row's */
    const uint64_t codes = (uint64_t)slot * (8 * D) + 16 * lane, scales = (uint64_t)slot * D + 16 * lane;
    unsigned char *v_stage = st + U::V_CODES + (lane / ROW_CHUNKS) * U::V_ROW + 16 * (lane % ROW_CHUNKS);
#pragma unroll
    for (int j = 0; j < CHUNKS; j++) {
        cp_async16(st + U::K_CODES + 16 * lane + 512 * j, pools.k_codes + codes + 512 * j);
        cp_async16(v_stage + (32 / ROW_CHUNKS) * j * U::V_ROW, pools.v_codes + codes + 512 * j);
    }
    if (lane < D / 16) {
        cp_async16(st + U::K_SCALES + 16 * lane, pools.k_scales + scales);
        cp_async16(st + U::V_SCALES + 16 * lane, pools.v_scales + scales);
    }
}

/* ------------------------------------------------------------------------------------------------
   The CTA's pieces: its tile, its start, the warps' loop, their merge, and the chunks' merge */

/* kv_decode_kernel's variants, bits of its FLAGS (aq_kv_cache_decode_plan_cuda picks one a call):
   - DEC_LAST_CTA_MERGE: the last CTA of a (row tile, KV head, sequence) to finish merges the chunks' partial results
     (merge_chunks) instead of decode_combine_kernel, and the CTA of a one-chunk sequence writes O itself.
   - DEC_EARLY_START: the sequence's length, the chunk's block-table entries and the raw Q are loaded side by side,
     so the first copies wait for one global load rather than two in a row. */
enum { DEC_LAST_CTA_MERGE = 1, DEC_EARLY_START = 2, DEC_VARIANTS = AQ_DECODE_VARIANTS };
static_assert(DEC_MIN_CHUNK == AQ_DECODE_CHUNK_STEP, "the options' chunk step is a step's keys");

#define DEC_COMBINE_THREADS 256 /* decode_combine_kernel's CTA: DEC_COMBINE_THREADS / D chains a channel (merge_term) */
#ifndef DEC_MERGE_BATCH /* chunk results a thread of merge_chunks loads at once, a power of two (32 spills at D = 128) */
#define DEC_MERGE_BATCH 16
#endif
#ifndef DEC_MERGE_BATCH_ITEMS /* the same, over a thread's items when it has several (16 spills at D = 128) */
#define DEC_MERGE_BATCH_ITEMS 8
#endif

/* What a CTA works on: keys [c0, c0 + chunk) of sequence b, cut at its length L, against row tile mt of KV head hk's
   query rows. Group row ridx (< rows) is query token ridx % Tq of query head hk * group + ridx / Tq, q's row
   row_base + ridx; tile row r is group row 16 mt + r. */
struct DecodeTile {
    int split, mt, hk, b;
    int L, c0;
    int tq_count, rows; /* query tokens; the KV group's query rows, group * Tq */
    int64_t row_base;
    int splits;         /* the sequence's chunks, the CTAs that share the merge: ceil(L / chunk) */

    AQ_D int64_t q_row(int ridx) const { return row_base + ridx; }
    /* keys that group row ridx sees: the sequence's L, or with causal those up to L - Tq + its token */
    AQ_D int visible(int ridx, bool causal) const { return causal ? min(L, L - tq_count + ridx % tq_count + 1) : L; }
    AQ_D int tile_rows() const { return min(16, rows - 16 * mt); }
};

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

/* Pool unit of the sequence's unit u from its block-table entry `page`: (page * Hkv + hk) * page_units + the unit's
   place in its page, u % page_units = `in_page`. A page outside the pool is never read: the CTA reads pool unit 0
   instead and sets bad_page, so its results turn NaN (a corrupt block table must not give plausible output). */
AQ_D uint32_t unit_slot_of(const aq_decode_params &p, int32_t page, uint32_t in_page, int hk, uint32_t page_units,
                            bool &bad_page) {
    const bool ok = page >= 0 && page < p.num_pages;
    bad_page |= !ok;
    return ok ? ((uint32_t)page * (uint32_t)p.heads_kv + hk) * page_units + in_page : 0u;
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
    const float exp_scale = p.softmax_scale * AQ_LOG2E * DEC_FRAME; /* the scores are 2^-14 q.k (file comment) */

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

/* ------------------------------------------------------------------------------------------------
   Launchers */

static int decode_m_tiles(const aq_decode_params *p) {
    return (int)((p->heads_q / p->heads_kv * p->seqlen_q + 15) / 16);
}

const char *aq_kv_cache_decode_plan_cuda(aq_decode_params *p, const aq_kernel_options *o, int64_t *workspace_floats) {
    if (!aq_attention_dtype_supported(p->dtype)) return "kv_cache_decode: dtype must be bfloat16 or float16";
    if (!aq_head_dim_supported(p->head_dim)) return "kv_cache_decode: head_dim must be " AQ_HEAD_DIMS_TEXT;
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
       keep enough loads in flight, and shorter chunks only add pipeline start-up and partial results. Measured on
       the H100 (batch 8, 32 q / 8 kv heads, D = 128, one query token): 4k context 42.6 us with this rule against
       121 us when aiming at 12 CTAs per SM; 32k context unchanged (1024-key chunks either way, 258-261 us).
       Longer chunks amortize a CTA's start and merge (~70 of ~650 instructions a unit with 1024 keys): at 32k
       context, kernel time under ncu 181 / 164 / 159 / 179 us for at most 1024 / 2048 / 4096 / 8192 keys with
       one query token (8192: 256 CTAs, half the SMs' CTA slots idle), 289 / 246 / 245 / 232 us with four. */
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
       starting after them (~5 us of a 130 us decode at 32k context). */
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
