/* NVFP4 format primitives: E4M3 block scales, E2M1 codes, the 16-element block rule.
   The one home of the rounding of numerics.md §1, shared by every CPU (C) and CUDA kernel. */
#pragma once

#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef __CUDACC__
#define AQ_HD __host__ __device__ __forceinline__
#define AQ_UNROLL _Pragma("unroll")
#else
#define AQ_HD static inline
#define AQ_UNROLL
#endif

#define AQ_BLOCK 16             /* elements per NVFP4 block */
#define AQ_E4M3_MAX 448.0f
#define AQ_P_HEADROOM 2048.0f   /* 2^11: P's block rule runs on w = P̂ * 2^11 (numerics.md §3) */
#define AQ_P_HEADROOM_INV (1.0f / 2048.0f)
#define AQ_P_HEADROOM_LOG2 11.0f /* P's exponent argument is x = t - (M - 11), so that 2^x = P̂ * 2^11 */
#define AQ_E4M3_NAN 0x7F        /* the scale byte of a block with a NaN or Inf in it */

AQ_HD uint32_t aq_float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
#endif
}

AQ_HD float aq_bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, 4);
    return x;
#endif
}

/* Correctly rounded fp32 operations, spelled out so neither nvcc nor gcc fuses or approximates them. */
AQ_HD float aq_div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
AQ_HD float aq_rcp_rn(float a) {
#ifdef __CUDA_ARCH__
    return __frcp_rn(a);
#else
    return 1.0f / a;
#endif
}
AQ_HD float aq_fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fmaf_rn(a, b, c);
#else
    return fmaf(a, b, c);
#endif
}
AQ_HD float aq_mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

/* Round a finite v >= 0 to E4M3 (round to nearest even, saturating at 448; below 2^-10 gives 0).
   Same result as cvt.rn.satfinite.e4m3x2.f32 on finite non-negative input. */
AQ_HD float aq_e4m3_round(float v) {
    if (v >= AQ_E4M3_MAX) return AQ_E4M3_MAX;
    if (v < 0.015625f) /* below 2^-6: the subnormal grid is 2^-9; v * 2^9 is exact */
        return rintf(v * 512.0f) * (1.0f / 512.0f);
    uint32_t b = aq_float_bits(v);
    b += 0x7FFFFu + ((b >> 20) & 1u); /* round the 23-bit mantissa to 3 bits, ties to even */
    b &= 0xFFF00000u;
    float r = aq_bits_float(b);
    return r > AQ_E4M3_MAX ? AQ_E4M3_MAX : r;
}

/* The E4M3 byte of an exact E4M3 value s >= 0 (or NaN). */
AQ_HD uint8_t aq_e4m3_encode(float s) {
    if (s != s) return AQ_E4M3_NAN;
    if (s < 0.015625f) return (uint8_t)(s * 512.0f); /* subnormal or zero: exponent field 0 */
    uint32_t b = aq_float_bits(s);
    int e = (int)((b >> 23) & 0xFF) - 127; /* -6 .. 8 */
    return (uint8_t)(((e + 7) << 3) | ((b >> 20) & 7u));
}

AQ_HD float aq_e4m3_decode(uint8_t c) {
    uint32_t e = (c >> 3) & 0xF, m = c & 7;
    float mag;
    if (e == 0xF && m == 7) mag = aq_bits_float(0x7FC00000u);
    else if (e == 0) mag = (float)m * (1.0f / 512.0f);
    else mag = aq_bits_float(((e + 120u) << 23) | (m << 20)); /* 2^(e-7) * (1 + m/8) */
    return (c & 0x80) ? -mag : mag;
}

/* E2M1 rounding of a finite y (numerics.md §1): the nearest of {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, ties to
   the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), saturating at ±6, keeping the
   sign (-0.1 -> -0). Branch-free bit arithmetic, checked against the seven-comparison definition of the
   reference for every finite fp32 input. */
AQ_HD float aq_e2m1_round(float y) {
    const float a = fminf(fabsf(y), 6.0f);
    /* below 1 the grid is {0, 0.5, 1}: 2a rounded to an even integer by the fp32 rounding of 2a + 2^23 */
    const float below_one = aq_mul_rn(aq_fma_rn(a, 2.0f, 8388608.0f) - 8388608.0f, 0.5f);
    /* from 1 on the values have one mantissa bit: round the mantissa to one bit, ties to even */
    const uint32_t b = aq_float_bits(a);
    const float from_one = aq_bits_float((b + 0x1FFFFFu + ((b >> 22) & 1u)) & 0xFFC00000u);
    const float mag = a < 1.0f ? below_one : from_one;
    return aq_bits_float(aq_float_bits(mag) | (aq_float_bits(y) & 0x80000000u));
}

/* aq_e2m1_round(y) for 0 <= y <= 2^20 or NaN, before the clamp at 6, in four instructions for the kernels' hot
   loops: with b = 2^max(e, 0) for y's exponent e (an integer max and a mask on y's bits), fma(b, 2^22, y) rounds
   y once to the multiple of b / 2 (ties to even: 2^22 b has an even significand), which is the E2M1 grid's
   spacing (0.5 below 2, then 1, 2, ...), and fma(b, -2^22, .) takes 2^22 b off again exactly. (The sum stays in
   2^22 b's binade, y < 2b.) Clamping after rounding gives what clamping first gives: 6 is on the grid and the
   rounding is monotonic, so any y > 6 rounds to 6 or more. A NaN y stays NaN. Only under that condition: negative
   y, y >= 2^106 (the sum overflows: Inf out) and y = +Inf (NaN out) come out wrong. It equals
   aq_e2m1_round(min(y, 6)) clamped at 6 (checked for all 1.09e9 fp32 values in [0, 6] in a numpy emulation; the
   form before this one, y + c - c with c = 2^22 b built by an integer add, five instructions, was checked bit for
   bit against this one for every fp32 y in [0, 2^20] and NaN; tests/test_nvfp4.py and tests/test_attention.py
   check its kernels bit for bit). */
AQ_HD float aq_e2m1_round_nonneg_unclamped(float y) {
    const uint32_t bits = aq_float_bits(y);
    const float b = aq_bits_float((bits > 0x3F800000u ? bits : 0x3F800000u) & 0x7F800000u);
    return aq_fma_rn(b, -4194304.0f, aq_fma_rn(b, 4194304.0f, y));
}

/* The E2M1 code (sign << 3 | magnitude index 0..7) of aq_e2m1_round(y). From 1 on, the exponent and the
   one mantissa bit of the rounded value spell the index; below 1 the value is 0 or 0.5. */
AQ_HD uint8_t aq_e2m1_code(float y) {
    const uint32_t v = aq_float_bits(aq_e2m1_round(y)), mag = v & 0x7FFFFFFFu;
    const uint32_t index = mag >= 0x3F800000u ? (mag >> 22) - 252u : (mag != 0u);
    return (uint8_t)(index | ((v >> 28) & 8u));
}

AQ_HD float aq_e2m1_value(uint8_t code) {
    /* Codes 2..7 are the normal numbers 2^((c >> 1) - 1) * (1 + (c & 1) / 2): built from their bits. */
    uint32_t c = code & 7u;
    uint32_t bits = c >= 2 ? ((126u + (c >> 1)) << 23) | ((c & 1u) << 22) : aq_float_bits(0.5f * (float)c);
    return aq_bits_float(bits | ((uint32_t)(code & 8u) << 28));
}

/* The block scale s = e4m3(amax / 6) of numerics.md §1, from the bits of amax = max |x_i|.
   A block holding NaN or Inf gets a NaN scale, so it dequantizes to NaN rather than to finite garbage. */
AQ_HD float aq_block_scale_from_amax_bits(uint32_t amax_bits) {
    if (amax_bits >= 0x7F800000u) return aq_bits_float(0x7FC00000u);
    return aq_e4m3_round(aq_div_rn(aq_bits_float(amax_bits), 6.0f));
}

/* max(amax_bits, |x| as an integer): NaN > Inf > every finite value, so the block amax propagates them. */
AQ_HD uint32_t aq_abs_bits_max(uint32_t amax_bits, float x) {
    const uint32_t a = aq_float_bits(x) & 0x7FFFFFFFu;
    return a > amax_bits ? a : amax_bits;
}

/* One element of a fake-quantized block of scale s, r = aq_rcp_rn(s): e2m1(x * r) * s, exactly 0 in a
   zero-scale block and NaN in a NaN-scale block. */
AQ_HD float aq_fake_quantize_element(float x, float s, float r) {
    return s == 0.0f ? 0.0f : aq_e2m1_round(aq_mul_rn(x, r)) * s;
}

/* The scale of n <= 16 values (a trailing partial block has n < 16). */
AQ_HD float aq_block_scale(const float *x, int n) {
    uint32_t amax_bits = 0;
    AQ_UNROLL /* constant trip counts keep x in registers on the GPU */
    for (int i = 0; i < AQ_BLOCK; i++)
        if (i < n) amax_bits = aq_abs_bits_max(amax_bits, x[i]);
    return aq_block_scale_from_amax_bits(amax_bits);
}

/* The 16 codes of n <= 16 values with block scale s (codes past n, and all of a zero or NaN block, are 0);
   the dequantized value is aq_e2m1_value(code) * s. */
AQ_HD void aq_block_codes(const float *x, int n, float s, uint8_t *codes) {
    const float r = aq_rcp_rn(s);
    const uint8_t keep = s > 0.0f ? 0xF : 0;
    AQ_UNROLL
    for (int i = 0; i < AQ_BLOCK; i++)
        codes[i] = i < n ? (uint8_t)(aq_e2m1_code(aq_mul_rn(x[i], r)) & keep) : 0;
}

/* Fake-quantize n <= 16 values in place with block scale s: x_i <- e2m1(x_i / s) * s (exact in bf16, fp16). */
AQ_HD void aq_block_fake_quantize(float *x, int n, float s) {
    const float r = aq_rcp_rn(s);
    AQ_UNROLL
    for (int i = 0; i < AQ_BLOCK; i++)
        if (i < n) x[i] = aq_fake_quantize_element(x[i], s, r);
}

/* The whole block rule on n <= 16 values, in place. Returns s. */
AQ_HD float aq_fake_quantize_block(float *x, int n) {
    const float s = aq_block_scale(x, n);
    aq_block_fake_quantize(x, n, s);
    return s;
}

/* bf16 / fp16 <-> fp32 in plain C for the CPU kernels (CUDA code uses cuda_bf16.h / cuda_fp16.h). */
AQ_HD float aq_bf16_to_float(uint16_t h) { return aq_bits_float((uint32_t)h << 16); }

AQ_HD uint16_t aq_float_to_bf16(float x) { /* round to nearest even; NaN stays NaN */
    uint32_t b = aq_float_bits(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

AQ_HD float aq_fp16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    float mag;
    if (e == 0x1F) mag = m ? aq_bits_float(0x7FC00000u) : aq_bits_float(0x7F800000u);
    else if (e == 0) mag = (float)m * (1.0f / 16777216.0f); /* m * 2^-24 */
    else mag = aq_bits_float(((e + 112u) << 23) | (m << 13));
    return aq_bits_float(aq_float_bits(mag) | sign);
}

AQ_HD uint16_t aq_float_to_fp16(float x) { /* round to nearest even, overflow to Inf */
    uint32_t b = aq_float_bits(x), sign = (b >> 16) & 0x8000u;
    float a = fabsf(x);
    if (a != a) return (uint16_t)(sign | 0x7E00u);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7C00u);
    if (a < 6.103515625e-05f) /* below 2^-14: subnormal grid 2^-24 */
        return (uint16_t)(sign | (uint32_t)rintf(a * 16777216.0f));
    uint32_t ab = aq_float_bits(a);
    ab += 0xFFFu + ((ab >> 13) & 1u);
    return (uint16_t)(sign | ((((ab >> 23) - 112u) << 10) | ((ab >> 13) & 0x3FFu)));
}

/* The fp16 value nearest to x (ties to even, subnormals kept, Inf from 65520 on; NaN stays NaN), as a float. */
AQ_HD float aq_round_fp16(float x) { return aq_fp16_to_float(aq_float_to_fp16(x)); }

/* P's block rule in fp16 (numerics.md §3) on n <= 16 values w = P̂ * 2^11 (fp16 values >= 0, or NaN), in place:
   w <- e2m1(fp16(w * r)) * s, with §1's scale s = e4m3(fp32(amax / 6)) and r = fp16(1 / s). Returns s.
   fp16(fp32(1 / s)) is fp16(1 / s) for every E4M3 s, and w * r (two fp16 values) is exact in fp32, so each step
   rounds once, as the f16x2 instructions do. */
AQ_HD float aq_p_fake_quantize_block_fp16(float *w, int n) {
    const float s = aq_block_scale(w, n);
    const float r = aq_round_fp16(aq_rcp_rn(s));
    AQ_UNROLL
    for (int i = 0; i < AQ_BLOCK; i++)
        if (i < n) w[i] = s == 0.0f ? 0.0f : aq_e2m1_round(aq_round_fp16(aq_mul_rn(w[i], r))) * s;
    return s;
}
