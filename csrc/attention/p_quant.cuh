/* P's NVFP4 fake quantizer in fp16 (numerics.md §3 step 4), bit for bit aq_p_fake_quantize_block_fp16: sm80/, sm90/,
   decode/. */
#pragma once

#include <type_traits>

#include "attention/fragments.cuh"

/* ------------------------------------------------------------------------------------------------
   NVFP4 fake-quant of w = P̂ * 2^11 (numerics.md §3), P̂ being p_hat<true>'s fp16 value. P̂ is >= 0 (or NaN), which
   makes the block rule cheap; the functions below give bit for bit aq_p_fake_quantize_block_fp16's result on w:
   - amax is the max of the values' bits (non-negative floats order like their bits; NaN above all), or, in the
     sm90 forward at D = 128, w at the block's largest logit (block_amax_w_from_logit), where a NaN logit leaves
     its block's scale finite: that element's P^F is then 6 s, not NaN, but its row's l is NaN, and with it the
     row's O, O' and LSE, as when the whole block was NaN;
   - amax / 6 correctly rounded as x * fl(1/6) plus one fma correction (Markstein; checked for every fp32 x:
     it differs from x / 6 only where x / 6 is subnormal, and such a scale is 0 either way);
   - the E4M3 rounding by the hardware cvt (sm_89+; nvfp4.h's software rounding elsewhere);
   - e2m1(y) for y >= 0 by nvfp4.h's aq_e2m1_round_nonneg_unclamped: y + 2^(22 + max(exponent(y), 0)) rounded once
     (an fma) lands on the E2M1 spacing of y's binade (0.5 below 2, 1 below 4, 2 from 4), ties to even, which is
     the E2M1 tie rule; the offset comes off exactly (fminf saturates at 6 first, or a 16-bit min after);
   - r = 2^11 fp16(1 / s): fl(1 / s) from the approximate reciprocal and one Newton step (exact for E4M3 scales, see
     below), then rounded to fp16; y = fp16(x * r), the product exact in fp32, rounded once;
   - a zero-scale block uses r = 0, so its y and values are 0; a NaN scale makes every value NaN. */

/* The fp16 value nearest to x (ties to even, subnormals kept, NaN stays NaN), as a float: cvt.rn.f16.f32 and back. */
AQ_D float p_round_fp16(float x) { return __half2float(__float2half_rn(x)); }

/* From the bits of the amax of a block of P̂ (unscaled): s, the E4M3 scale of the block of P̂ * 2^11; s_pf = s * 2^-11,
   the scale of P^F itself; and r = fl(2^11 / s) (0 when s = 0), so that x * r for x = P̂ is (x * 2^11) / s rounded
   once: the 2^11 costs no multiply per element. The Markstein steps are those on A = amax * 2^11 scaled by 2^-11,
   which is exact wherever the scale is not 0 (A >= 2^-10, so no intermediate is subnormal). */
AQ_D void p_block_scale(uint32_t amax_bits, float *s, float *s_pf, float *r) {
    const float amax = __uint_as_float(amax_bits), sixth = (1.0f / 6.0f) * AQ_P_HEADROOM; /* 2^11 fl(1/6) */
    const float q0 = __fmul_rn(amax, sixth);
    const float v = __fmaf_rn(__fmaf_rn(-q0, 6.0f * AQ_P_HEADROOM_INV, amax), sixth, q0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;\n" : "=h"(pair) : "f"(v));
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"(pair));
    *s = __half2float(__ushort_as_half((uint16_t)(halves & 0xFFFFu)));
#else
    *s = amax_bits >= 0x7F800000u ? __uint_as_float(0x7FC00000u) : aq_e4m3_round(v);
#endif
    *s_pf = *s * AQ_P_HEADROOM_INV;
    /* 1 / s_pf correctly rounded without __frcp_rn's special-case branch: the approximate reciprocal (within an
       ulp) and one Newton step land within 2^-45 of 1 / s_pf, while 1 / s = 2^-e * 8 / (8 + m) (or 512 / m) is a
       fraction with an odd denominator below 16, at least 2^-29 away from any rounding midpoint; a power of two
       comes out exact. So the rounding is the correct one for every E4M3 scale. */
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r0) : "f"(*s_pf));
    const float r32 = __fmaf_rn(r0, __fmaf_rn(-*s_pf, r0, 1.0f), r0); /* 2^11 fp32(1 / s) */
    /* §3 step 4d: r = fp16(1 / s) = fp16(fp32(1 / s)) for every E4M3 s, kept times 2^11 (exact) so that x = P̂ gives
       x * r = w * fp16(1 / s) */
    *r = *s == 0.0f ? 0.0f : p_round_fp16(r32 * AQ_P_HEADROOM_INV) * AQ_P_HEADROOM;
}

/* e2m1(fp16(x * r)) * s for x >= 0 or NaN (§3 steps 4e-4g): x * r is the exact product w * fp16(1 / s) (two fp16
   significands, 22 bits), rounded once to fp16 as mul.rn.f16x2 would. */
AQ_D float p_fake_quantize_element(float x, float s, float r) {
    return __fmul_rn(aq_e2m1_round_nonneg_unclamped(fminf(p_round_fp16(__fmul_rn(x, r)), 6.0f)), s);
}

/* Query rows in C-fragment rows (forward): one row's 16-key block is two adjacent n-blocks, held by the 4 lanes
   of a quad (lanes 4g .. 4g+3), 4 values each (keys 2t, 2t+1, 2t+8, 2t+9). x = P̂ in, P^F * 2^11 out. */
AQ_D void fake_quantize_p_quad(float x[4]) {
    uint32_t amax = max(max(__float_as_uint(x[0]), __float_as_uint(x[1])),
                        max(__float_as_uint(x[2]), __float_as_uint(x[3])));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 1));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 2));
    float s, s_pf, r;
    p_block_scale(amax, &s, &s_pf, &r);
#pragma unroll
    for (int i = 0; i < 4; i++) x[i] = p_fake_quantize_element(x[i], s, r);
}

/* Keys in C-fragment rows (dK/dV kernels, S^T = K Q^T): a warp's 16 keys are one block of every query column, and
   that column's 16 values sit in the 8 lanes sharing lane & 3, two each (key rows g and g+8). x[c][0..1] = P̂ of
   the thread's query column c (of the 4 of one A fragment: c = 2h + e for n-block h, column 2t + e) in, P^F out.
   The 8 lanes of a column set share the work instead of each computing all 4 scales: a reduce-scatter of the 4
   amaxes (lane bits 4 and 3 pick the column a lane keeps, bit 2 lanes finish the same one), one block scale a
   lane, and an all-gather of (s_pf, r): 12 shuffles, as before, but one scale computation instead of four.
   HEADROOM: P^F * 2^11 out instead (the decode kernel's fq16(P̂ * 2^11)). */
template <bool HEADROOM = false>
AQ_D void fake_quantize_p_columns(float (&x)[4][2]) {
    const int lane = (int)threadIdx.x & 31;
    const bool hi4 = lane & 16, hi3 = lane & 8;
    uint32_t a[4];
#pragma unroll
    for (int c = 0; c < 4; c++) a[c] = max(__float_as_uint(x[c][0]), __float_as_uint(x[c][1]));
    uint32_t b[2]; /* columns 2 * hi4 + i */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint32_t keep = hi4 ? a[i + 2] : a[i], send = hi4 ? a[i] : a[i + 2];
        b[i] = max(keep, __shfl_xor_sync(AQ_FULL_MASK, send, 16));
    }
    uint32_t amax = hi3 ? b[1] : b[0]; /* column 2 * hi4 + hi3 */
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, hi3 ? b[0] : b[1], 8));
    amax = max(amax, __shfl_xor_sync(AQ_FULL_MASK, amax, 4));
    float s, s_pf, r;
    p_block_scale(amax, &s, &s_pf, &r);
#pragma unroll
    for (int c = 0; c < 4; c++) { /* column c's scale from the lanes that kept it */
        const int src = (lane & 7) | (c << 3);
        const float cs = __shfl_sync(AQ_FULL_MASK, HEADROOM ? s : s_pf, src), cr = __shfl_sync(AQ_FULL_MASK, r, src);
        x[c][0] = p_fake_quantize_element(x[c][0], cs, cr);
        x[c][1] = p_fake_quantize_element(x[c][1], cs, cr);
    }
}

/* fq16(P̂ * 2^11) in place for one 16-key block of a warp's 16 rows in C layout (c0 = keys 0..7, c1 = keys 8..15
   of the block): P̂ in, P^F * 2^11 out. Row g's block is c0[0..1], c1[0..1] across the lane quad, row g+8's is
   c0[2..3], c1[2..3]. The results are exact in bf16 and fp16 (6 significant bits, <= 2112). */
AQ_D void fake_quantize_p_block(float c0[4], float c1[4]) {
    float row_g[4] = {c0[0], c0[1], c1[0], c1[1]}, row_g8[4] = {c0[2], c0[3], c1[2], c1[3]};
    fake_quantize_p_quad(row_g);
    fake_quantize_p_quad(row_g8);
    c0[0] = row_g[0], c0[1] = row_g[1], c1[0] = row_g[2], c1[1] = row_g[3];
    c0[2] = row_g8[0], c0[3] = row_g8[1], c1[2] = row_g8[2], c1[3] = row_g8[3];
}

/* The larger of two values: logits (fmaxf, which skips a NaN), or the bits of non-negative floats (P̂), which order
   like the values, with NaN above all. */
AQ_D float max_of(float a, float b) { return fmaxf(a, b); }
AQ_D uint32_t max_of(uint32_t a, uint32_t b) { return max(a, b); }

/* A pair of fp16 values >= 0 (or NaN), whose maxima are taken per half (f16x2_max_nan). */
struct f16_pair {
    uint32_t bits;
};
/* Elementwise max of two fp16 pairs, NaN if either is NaN (as the integer max of P̂'s bits: NaN above all). */
AQ_D uint32_t f16x2_max_nan(uint32_t a, uint32_t b) {
    uint32_t r;
    asm("max.NaN.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

AQ_D f16_pair max_of(f16_pair a, f16_pair b) { return {f16x2_max_nan(a.bits, b.bits)}; }

/* __shfl_xor_sync of the full warp for the types max_of takes. */
AQ_D float shuffle_xor(float v, int mask) { return __shfl_xor_sync(AQ_FULL_MASK, v, mask); }
AQ_D uint32_t shuffle_xor(uint32_t v, int mask) { return __shfl_xor_sync(AQ_FULL_MASK, v, mask); }
AQ_D f16_pair shuffle_xor(f16_pair v, int mask) { return {__shfl_xor_sync(AQ_FULL_MASK, v.bits, mask)}; }

/* Two 16-key blocks at once (c0, c1: block A, c2, c3: block B, C layout): the lane quad holds 4 row-blocks (j = 0:
   block A row g, 1: block A row g+8, 2: block B row g, 3: block B row g+8), 4 values of each a lane. a[j]: the
   lane's maximum of row-block j, as floats or (T = uint32_t) as the bits of non-negative ones. */
template <typename T>
AQ_D void lane_row_block_max(const float c0[4], const float c1[4], const float c2[4], const float c3[4], T a[4]) {
    auto v = [](float x) {
        if constexpr (std::is_same<T, float>::value) return x;
        else return __float_as_uint(x);
    };
    a[0] = max_of(max_of(v(c0[0]), v(c0[1])), max_of(v(c1[0]), v(c1[1])));
    a[1] = max_of(max_of(v(c0[2]), v(c0[3])), max_of(v(c1[2]), v(c1[3])));
    a[2] = max_of(max_of(v(c2[0]), v(c2[1])), max_of(v(c3[0]), v(c3[1])));
    a[3] = max_of(max_of(v(c2[2]), v(c2[3])), max_of(v(c3[2]), v(c3[3])));
}

/* A tile's w pairs (fp16 pairs of w = P̂ * 2^11) in its score registers s (C-fragment order): pair (n, r), row r's
   (g, g+8) keys 8n + 2t, +1, sits in s[n][2r], in place of the first score it came from, so that the A fragment of
   16-key block kb is pairs (2kb, 0), (2kb, 1), (2kb+1, 0), (2kb+1, 1). In the score registers, not apart: those are
   the next S wgmma's accumulator, idle till then, and pairs of their own spilled the D = 128 training forward. */
template <int BN>
AQ_D uint32_t w_pair(const float (&s)[BN / 8][4], int n, int r) { return __float_as_uint(s[n][2 * r]); }
template <int BN>
AQ_D void set_w_pair(float (&s)[BN / 8][4], int n, int r, uint32_t pair) { s[n][2 * r] = __uint_as_float(pair); }
/* With O', w of the same keys in DT (unscaled_hat_pair) beside it, in s[n][2r + 1], till pack_p scales it into the
   A fragments of O' += P̂ V (scale_hat_pair): a product there, not a copy, which ptxas would merge into the score
   registers (serializing the wgmma, warning C7513). */
template <int BN>
AQ_D uint32_t hat_pair(const float (&s)[BN / 8][4], int n, int r) { return __float_as_uint(s[n][2 * r + 1]); }

/* lane_row_block_max of block pair bp of a tile's w pairs (p_round_block_pair's order), per half: row-block j's
   pairs are (4bp + 2 (j >> 1) + h, j & 1), h = 0, 1. */
template <int BN>
AQ_D void lane_row_block_max_pairs(const float (&s)[BN / 8][4], int bp, f16_pair a[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++)
        a[j] = max_of(f16_pair{w_pair<BN>(s, 4 * bp + 2 * (j >> 1), j & 1)},
                      f16_pair{w_pair<BN>(s, 4 * bp + 2 * (j >> 1) + 1, j & 1)});
}

/* A reduce-scatter of lane_row_block_max's 4 maxima over lane bits 0 and 1 leaves lane 4g + t the maximum over the
   quad of row-block 2 (t & 1) + (t >> 1) (block A or B by lane bit 0, row g or g+8 by bit 1), so that each lane
   computes one block scale. */
template <typename T>
AQ_D T quad_row_block_max(const T a[4]) {
    const int lane = (int)threadIdx.x & 31;
    const bool bit0 = lane & 1, bit1 = lane & 2;
    T kept[2]; /* over lane bit 0: row-blocks 2 * bit0 + i */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const T keep = bit0 ? a[2 + i] : a[i], send = bit0 ? a[i] : a[2 + i];
        kept[i] = max_of(keep, shuffle_xor(send, 1));
    }
    /* over lane bit 1 */
    return max_of(bit1 ? kept[1] : kept[0], shuffle_xor(bit1 ? kept[0] : kept[1], 2));
}

/* ------------------------------------------------------------------------------------------------
   P's block rule on f16x2 pairs (the sm90 forward): w, y and the E2M1 roundings stay in fp16, two elements an
   instruction, where the fp32 form spent a conversion to fp16 and back on each element. Each step is one that
   dev/p_fp16_gpu_checks.cu (on the GPU) or dev/p_fp16_pair_checks.c (exhaustive host emulation) holds equal to
   the fp32 functions above. A pair's low half is the lower key (the A fragment's order). */

#define AQ_F16X2_ONE 0x3C003C00u          /* 1, 1 */
#define AQ_F16X2_EXPONENT_MASK 0x7C007C00u
#define AQ_F16X2_512 0x60006000u          /* 2^9: its ulp in fp16 is 1/2 */
#define AQ_F16X2_MINUS_512 0xE000E000u
#define AQ_F16X2_SIX 0x46004600u
#define AQ_F16X2_HEADROOM_INV 0x10001000u /* 2^-11, 2^-11 */
#define AQ_BF16X2_HEADROOM_INV 0x3A003A00u
#define AQ_BF16_FROM_F16_SCALE 0x1p112f   /* fp16 bits >> 3, read as bf16, are the value times 2^-112 */

/* The fp16 halves of a pair as floats (HADD2.F32: exact). */
AQ_D float f16_lo(uint32_t pair) { return __half2float(__ushort_as_half((uint16_t)(pair & 0xFFFFu))); }
AQ_D float f16_hi(uint32_t pair) { return __half2float(__ushort_as_half((uint16_t)(pair >> 16))); }

/* p_block_scale in w's units and as pairs: from amax = max w (a float), the reciprocal pair fp16(1 / s) for
   p_round_pair and the scale pair for scale_rounded_pair (s in fp16 or, for bf16, s * 2^112: scale_rounded_pair's
   rounding is 2^-112 q). amax / 6 is p_block_scale's Markstein pair on amax itself (its steps scaled by 2^11, exact:
   no intermediate is subnormal either way), and fp16(1 / s) comes straight from the approximate reciprocal: 1 / s
   (2^k 8 / (8 + m) or a power of two) is a power of two or has an odd denominator below 16, so it lies at least
   2^-17 of itself away from every fp16 rounding midpoint, far beyond rcp.approx's 2^-23; a zero scale gives r = 0. */
template <aq_dtype DT>
AQ_D void p_block_scale_pairs(float amax, uint32_t *recip_pair, uint32_t *scale_pair) {
    const float sixth = 1.0f / 6.0f;
    const float q0 = __fmul_rn(amax, sixth);
    const float v = __fmaf_rn(__fmaf_rn(-q0, 6.0f, amax), sixth, q0);
    uint16_t e4m3_pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;\n" : "=h"(e4m3_pair) : "f"(v));
    uint32_t halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"(e4m3_pair));
    const float s = f16_lo(halves);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(s));
    *recip_pair = s == 0.0f ? 0u : pack2<AQ_FLOAT16>(r, r);
    if constexpr (DT == AQ_BFLOAT16) {
        const float sv = s * AQ_BF16_FROM_F16_SCALE;
        *scale_pair = pack2<AQ_BFLOAT16>(sv, sv);
    } else {
        *scale_pair = halves;
    }
}

/* p_block_scale_pairs<AQ_FLOAT16> of two blocks at once (the dK/dV kernel's two query columns) from their amax pair
   (max.NaN.f16x2 of w; the low half is the lower column's): both E4M3 roundings in one cvt, each half of the outputs
   its block's fp16(1 / s) (0 for a zero scale) and s. */
AQ_D void p_block_scales_of_pair(uint32_t amax_pair, uint32_t *recip_pair, uint32_t *scale_pair) {
    float v[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const float amax = j ? f16_hi(amax_pair) : f16_lo(amax_pair), sixth = 1.0f / 6.0f;
        const float q0 = __fmul_rn(amax, sixth);
        v[j] = __fmaf_rn(__fmaf_rn(-q0, 6.0f, amax), sixth, q0);
    }
    uint16_t e4m3_pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(e4m3_pair) : "f"(v[1]), "f"(v[0])); /* first: high byte */
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(*scale_pair) : "h"(e4m3_pair));
    float rc[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const float s = j ? f16_hi(*scale_pair) : f16_lo(*scale_pair);
        asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(rc[j]) : "f"(s));
        rc[j] = s == 0.0f ? 0.0f : rc[j];
    }
    *recip_pair = pack2<AQ_FLOAT16>(rc[0], rc[1]);
}

/* e2m1(min(fp16(w * r), 6)) for a pair of w = P̂ * 2^11 (fp16 values >= 0, or NaN) and r = fp16(1 / s): the product
   rounded once (mul.rn.f16x2), then y + 2^9 b with b = 2^max(exponent(y), 0) rounded once lands on the E2M1
   spacing b / 2 of y's binade, ties to even, and comes off exactly; min saturates at 6 (and turns a NaN into 6,
   as min.DT did after the fp32 rounding). */
AQ_D uint32_t p_round_pair(uint32_t w, uint32_t r) {
    uint32_t q;
    asm("{\n .reg .b32 y, b;\n"
        " mul.rn.f16x2 y, %1, %2;\n"
        " max.f16x2 b, y, %3;\n"
        " and.b32 b, b, %4;\n"
        " fma.rn.f16x2 y, b, %5, y;\n"
        " fma.rn.f16x2 y, b, %6, y;\n"
        " min.f16x2 %0, y, %7;\n}\n"
        : "=r"(q)
        : "r"(w), "r"(r), "r"(AQ_F16X2_ONE), "r"(AQ_F16X2_EXPONENT_MASK), "r"(AQ_F16X2_512),
          "r"(AQ_F16X2_MINUS_512), "r"(AQ_F16X2_SIX));
    return q;
}

/* P^F * 2^11 = q * s in DT for a pair of p_round_pair's roundings q (E2M1 values in fp16) and a scale pair of
   p_block_scale_pairs: exact (at most 6 significant bits, within [2^-10, 2688]); a NaN s makes both NaN. For bf16,
   q's fp16 bits shifted right by 3 are bf16 bits of q * 2^-112 (q's low 3 bits are 0, so the high half's do not
   reach the low one), and the scale pair holds s * 2^112. */
template <aq_dtype DT>
AQ_D uint32_t scale_rounded_pair(uint32_t q, uint32_t scale_pair) {
    return mul2<DT>(DT == AQ_BFLOAT16 ? q >> 3 : q, scale_pair);
}

/* P̂ = w * 2^-11 in DT for a pair of w (w_lo, w_hi: its halves as floats), the values pack2<DT>(P̂) gives, in two
   steps (p_hat_pair): w in DT (unscaled_hat_pair: fp16 w itself; bf16 w rounded, as pack2 of the floats), then
   times 2^-11 (scale_hat_pair): fp16 rounds the exact product once, bf16 scales exactly (it has fp32's range). */
template <aq_dtype DT>
AQ_D uint32_t unscaled_hat_pair(uint32_t w, float w_lo, float w_hi) {
    if constexpr (DT == AQ_BFLOAT16) return pack2<AQ_BFLOAT16>(w_lo, w_hi);
    else return w;
}
template <aq_dtype DT>
AQ_D uint32_t scale_hat_pair(uint32_t h) {
    return mul2<DT>(h, DT == AQ_BFLOAT16 ? AQ_BF16X2_HEADROOM_INV : AQ_F16X2_HEADROOM_INV);
}
template <aq_dtype DT>
AQ_D uint32_t p_hat_pair(uint32_t w, float w_lo, float w_hi) {
    return scale_hat_pair<DT>(unscaled_hat_pair<DT>(w, w_lo, w_hi));
}

/* The E2M1 roundings (p_round_pair) in place for block pair bp (n-blocks 4bp .. 4bp+3, lane_row_block_max's
   row-blocks). quad_r: the quad's reciprocal pairs (online_softmax_p_scales' recip_pairs) of lanes 4g .. 4g+3 in
   x .. w, so of row-blocks 0, 2, 1, 3. With pack_quantized_p_pair, bit for bit the per-block rule on w. */
template <int BN>
AQ_D void p_round_block_pair(float (&s)[BN / 8][4], int bp, const uint4 &quad_r) {
    const uint32_t jr[4] = {quad_r.x, quad_r.z, quad_r.y, quad_r.w}; /* quad_row_block_max's order */
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = 4 * bp + 2 * (j >> 1) + h;
            set_w_pair<BN>(s, n, j & 1, p_round_pair(w_pair<BN>(s, n, j & 1), jr[j]));
        }
}

/* The A fragments of block pair bp's blocks A (a0) and B (a1) from p_round_block_pair's roundings and the quad's
   scale pairs (online_softmax_p_scales' scale_pairs, in lane order as quad_r). */
template <int BN, aq_dtype DT>
AQ_D void pack_quantized_p_pair(uint32_t a0[4], uint32_t a1[4], const float (&s)[BN / 8][4], int bp,
                                const uint4 &quad_s) {
    const uint32_t s2[4] = {quad_s.x, quad_s.z, quad_s.y, quad_s.w}; /* as quad_r */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        a0[i] = scale_rounded_pair<DT>(w_pair<BN>(s, 4 * bp + (i >> 1), i & 1), s2[i & 1]);
        a1[i] = scale_rounded_pair<DT>(w_pair<BN>(s, 4 * bp + 2 + (i >> 1), i & 1), s2[2 + (i & 1)]);
    }
}

/* The A fragment of fq16(P̂ * 2^11) for one 16-key block, from P̂ in C layout (fake_quantize_p_block). */
template <aq_dtype DT>
AQ_D void quantized_p_fragment(uint32_t a[4], const float c0[4], const float c1[4]) {
    float q0[4] = {c0[0], c0[1], c0[2], c0[3]}, q1[4] = {c1[0], c1[1], c1[2], c1[3]};
    fake_quantize_p_block(q0, q1);
    pack_a_from_c<DT>(a, q0, q1);
}
