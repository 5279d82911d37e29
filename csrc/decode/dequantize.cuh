/* NVFP4 codes and E4M3 scales to exact fp16 in registers, without a convert instruction or a table
   (docs/kv_cache_layout.md, "Dequantization"). */
#pragma once

#include "attention/fragments.cuh"

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
   bytes of an fp16 pair: two masks serve four codes, where masking each pair took two (fewer instructions a word,
   performance.md; bit-identical, checked over all 2^32 words). */
AQ_D void e2m1x8_to_f16(uint32_t w, uint32_t (&out)[4]) {
    const uint32_t even = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u); /* byte k: n_{2k} */
    const uint32_t odd = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);        /* byte k: n_{2k+1} */
    out[0] = __byte_perm(even, 0, 0x2404); /* bytes 0 and 2 (n0, n4) to bytes 1 and 3, zeros below */
    out[1] = __byte_perm(odd, 0, 0x2404);
    out[2] = __byte_perm(even, 0, 0x3414);
    out[3] = __byte_perm(odd, 0, 0x3414);
}
