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
#define AQ_P_HEADROOM 2048.0f   /* 2^11: P̂ is quantized as fq16(P̂ * 2^11) * 2^-11 (numerics.md §3) */
#define AQ_P_HEADROOM_INV (1.0f / 2048.0f)
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

/* E2M1 code (sign << 3 | magnitude code 0..7) of a finite y: round to nearest, ties to the even code,
   saturating at ±6, over the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}: ties 0.25->0, 0.75->1, 1.25->1,
   1.75->2, 2.5->2, 3.5->4, 5->4. Branch-free bit arithmetic (about 10 instructions), checked against
   the seven-comparison definition for every finite fp32 input. */
AQ_HD uint8_t aq_e2m1_code(float y) {
    const float a = fminf(fabsf(y), 6.0f);
    /* below 1 the grid is {0, 0.5, 1}: the code is 2a rounded to an even integer, which the fp32
       rounding of 2a + 2^23 leaves in the low mantissa bits */
    const uint32_t below_one = aq_float_bits(aq_fma_rn(a, 2.0f, 8388608.0f)) & 3u;
    /* from 1 on, the codes 2..7 are the numbers with one mantissa bit: round the mantissa to one bit,
       ties to even; the exponent and that bit then spell the code */
    uint32_t b = aq_float_bits(a);
    b = (b + 0x1FFFFFu + ((b >> 22) & 1u)) >> 22;
    const uint32_t mag = a < 1.0f ? below_one : b - 252u;
    return (uint8_t)(mag | ((aq_float_bits(y) >> 28) & 8u));
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

/* Quantize n <= 16 values (a trailing partial block has n < 16; its missing codes are 0).
   Writes the 16 codes and returns the scale s; the dequantized value is aq_e2m1_value(code) * s. */
AQ_HD float aq_quantize_block(const float *x, int n, uint8_t *codes) {
    uint32_t amax_bits = 0; /* max of |x| as integers: NaN > Inf > every finite value */
    AQ_UNROLL /* constant trip counts keep x and codes in registers on the GPU */
    for (int i = 0; i < AQ_BLOCK; i++) {
        uint32_t a = i < n ? aq_float_bits(x[i]) & 0x7FFFFFFFu : 0u;
        amax_bits = a > amax_bits ? a : amax_bits;
    }
    float s = aq_block_scale_from_amax_bits(amax_bits);
    float r = aq_rcp_rn(s);
    const uint8_t keep = s > 0.0f ? 0xF : 0; /* zero and NaN scales: every code 0 */
    AQ_UNROLL
    for (int i = 0; i < AQ_BLOCK; i++)
        codes[i] = i < n ? (uint8_t)(aq_e2m1_code(aq_mul_rn(x[i], r)) & keep) : 0;
    return s;
}

/* Fake-quantize n <= 16 values in place: x_i <- e2m1(x_i / s) * s (exact in bf16 and fp16). */
AQ_HD void aq_fake_quantize_block(float *x, int n) {
    uint8_t codes[AQ_BLOCK];
    float s = aq_quantize_block(x, n, codes);
    AQ_UNROLL
    for (int i = 0; i < AQ_BLOCK; i++)
        if (i < n) x[i] = aq_e2m1_value(codes[i]) * s;
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
