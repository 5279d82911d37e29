/* The f16x2 steps of the sm90 forward's P path (attention/p_quant.cuh, "P's block rule on f16x2 pairs") against the
   fp32 functions they replace, by exact emulation on the host, exhaustively where the inputs are one or two fp16
   values. The steps the GPU itself checked (dev/p_fp16_gpu_checks.cu: cvt.rn.satfinite.e4m3x2.f16x2, the E2M1
   sequence on [0, 8], mul.rn.f16x2 w * r) are here only where the kernels take them further:
     1. p_round_pair's E2M1 sequence on every fp16 y >= 0, Inf and NaN (the GPU check covered [0, 8]; y reaches 9
        for a block whose scale is E4M3's smallest subnormal), against min.DT(e2m1 of the fp32 path, 6);
     2. scale_rounded_pair: (q >> 3 as bf16) * bf16(s * 2^112) and q * s in fp16, for both halves of every pair of
        E2M1 values q and every E4M3 s (and NaN), against the fp32 path's q * s rounded to DT;
     3. p_hat_pair: bf16(bf16(w) * 2^-11) and fp16(w * 2^-11) against pack2<DT>(w * 2^-11) for every fp16 w >= 0;
     4. exp_row_pairs' l: fma(w0 + w1, 2^-11, l) against l + (P̂0 + P̂1) for every pair of fp16 w >= 0 below 2^12
        with a few l each (fp32, no contraction);
     5. the D = 64 amax: max.NaN.f16x2 of pairs, then of the halves, times 2^-11, against the integer max of the
        P̂ bits, for every pair of fp16 values (NaN included);
     6. p_block_scale_pairs' amax / 6 on w against p_block_scale's on P̂ = w * 2^-11, for every fp16 w >= 0;
     7. its fp16(rcp.approx(s)): fp16(x) = fp16(fp32(1 / s)) for every x within 2^-21 of 1 / s (rcp.approx.ftz.f32
        errs by at most 2^-23), for every nonzero E4M3 s.
     8. the sm90 backward's products by 1/l * 2^-11: w * (inv_l * 2^-11) against (w * 2^-11) * inv_l for every fp16
        w >= 0, Inf and NaN, with inv_l from 2^-115 to 8 (512 significands a binade), 0, Inf and NaN (fp32, no
        contraction): P in the dQ kernel (p_over_l_pair) and the dK/dV kernel, and there P^F / l too, whose w is
        q * s (an fp16 value, check 2).
   Build and run (seconds): gcc -O2 -std=c11 -ffp-contract=off -I csrc -o build/p_fp16_pair_checks
   dev/p_fp16_pair_checks.c -lm && build/p_fp16_pair_checks */
#include <stdio.h>
#include <stdlib.h>

#include "format/nvfp4.h"

/* fp16 bits of the double v rounded once to nearest even (subnormals, Inf past the top), NaN -> 0x7E00 */
static uint16_t f16_round(double v) {
    if (v != v) return 0x7E00;
    const _Float16 h = (_Float16)v;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

static double f16_value(uint16_t b) {
    _Float16 h;
    memcpy(&h, &b, 2);
    return (double)h;
}

static int f16_is_nan(uint16_t b) { return (b & 0x7C00) == 0x7C00 && (b & 0x3FF); }

/* PTX min/max.f16 (no .NaN): a NaN operand gives the other */
static uint16_t f16_min(uint16_t a, uint16_t b) {
    if (f16_is_nan(a)) return b;
    if (f16_is_nan(b)) return a;
    return f16_value(a) <= f16_value(b) ? a : b;
}

static uint16_t f16_max(uint16_t a, uint16_t b) {
    if (f16_is_nan(a)) return b;
    if (f16_is_nan(b)) return a;
    return f16_value(a) >= f16_value(b) ? a : b;
}

/* fma.rn.f16 a * b + c: the exact value in double (every case here: b a power of two, products of <= 22 bits),
   Inf - finite staying Inf, rounded once */
static uint16_t f16_fma(uint16_t a, uint16_t b, uint16_t c) {
    if (f16_is_nan(a) || f16_is_nan(b) || f16_is_nan(c)) return 0x7E00;
    return f16_round(f16_value(a) * f16_value(b) + f16_value(c));
}

/* p_round_pair after its product: the E2M1 sequence on one half */
static uint16_t e2m1_sequence(uint16_t y) {
    const uint16_t b = f16_max(y, 0x3C00) & 0x7C00;
    uint16_t t = f16_fma(b, 0x6000, y);
    t = f16_fma(b, 0xE000, t);
    return f16_min(t, 0x4600);
}

int main(void) {
    long bad = 0, n = 0;

    /* 1 */
    long bad1 = 0;
    for (uint32_t y = 0; y <= 0x7E00; y++) {
        if (y > 0x7C00 && y != 0x7E00) continue;
        const float yf = (float)f16_value((uint16_t)y);
        const float q = aq_e2m1_round_nonneg_unclamped(yf); /* the fp32 path, then min.DT at 6 */
        const double want = q != q ? 6.0 : (q < 6.0f ? q : 6.0);
        const uint16_t got = e2m1_sequence((uint16_t)y);
        n++;
        if (f16_value(got) != want) {
            if (bad1 < 5) printf("1. y = %g: got %g want %g\n", yf, f16_value(got), want);
            bad1++;
        }
    }
    printf("1. E2M1 sequence on %ld fp16 y >= 0 (Inf, NaN): %ld differ\n", n, bad1);
    bad += bad1;

    /* 2 */
    static const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    long bad2 = 0, n2 = 0;
    for (int c = 0; c <= 0x7F; c++) {
        const float s = c == 0x7F ? NAN : aq_e4m3_decode((uint8_t)c);
        const uint16_t s_bf = aq_float_to_bf16(s * 0x1p112f), s_h = f16_round(s);
        for (int i = 0; i < 8; i++)
            for (int k = 0; k < 8; k++) {
                const uint32_t q = (uint32_t)f16_round(grid[i]) | (uint32_t)f16_round(grid[k]) << 16;
                const uint32_t shifted = q >> 3;
                for (int h = 0; h < 2; h++) {
                    const float qv = h ? grid[k] : grid[i];
                    const uint16_t half = (uint16_t)(shifted >> (16 * h));
                    /* mul.rn.bf16x2: the exact product of two bf16 values (<= 16 bits) rounded once */
                    const uint16_t got_bf = aq_float_to_bf16(aq_bf16_to_float(half) * aq_bf16_to_float(s_bf));
                    const uint16_t got_h = f16_round(f16_value((uint16_t)(q >> (16 * h))) * f16_value(s_h));
                    /* the fp32 path: min(q, 6) * s rounded to DT, exact */
                    const uint16_t want_bf = aq_float_to_bf16(qv * s), want_h = f16_round((double)qv * s);
                    n2++;
                    if (got_bf != want_bf || got_h != want_h) {
                        if (bad2 < 5) printf("2. q = %g s = %g: bf16 %#x/%#x fp16 %#x/%#x\n", qv, s, got_bf, want_bf,
                                             got_h, want_h);
                        bad2++;
                    }
                }
            }
    }
    printf("2. scale_rounded_pair on %ld (q, s, half): %ld differ\n", n2, bad2);
    bad += bad2;

    /* 3 */
    long bad3 = 0, n3 = 0;
    for (uint32_t w = 0; w < 0x7C00; w++) {
        const float wf = (float)f16_value((uint16_t)w), phat = wf * 0x1p-11f; /* exact */
        const uint16_t got_bf = aq_float_to_bf16(aq_bf16_to_float(aq_float_to_bf16(wf)) * 0x1p-11f);
        const uint16_t got_h = f16_round(f16_value((uint16_t)w) * 0x1p-11);
        n3++;
        if (got_bf != aq_float_to_bf16(phat) || got_h != f16_round((double)phat)) bad3++;
    }
    printf("3. p_hat_pair on %ld fp16 w >= 0: %ld differ\n", n3, bad3);
    bad += bad3;

    /* 4 */
    long bad4 = 0, n4 = 0;
    static const float ls[6] = {0.0f, 1.0f, 0.3333333f, 123.456f, 1e-20f, 3.0e5f};
    for (uint32_t a = 0; a < 0x6C00; a += 1) /* w < 2^12 */
        for (uint32_t b = 0; b < 0x6C00; b += 7) {
            const float w0 = (float)f16_value((uint16_t)a), w1 = (float)f16_value((uint16_t)b);
            for (int i = 0; i < 6; i++) {
                const float l = ls[i] * (float)(1 + (a ^ b) % 5);
                volatile float p0 = w0 * 0x1p-11f, p1 = w1 * 0x1p-11f;
                const float want = l + (p0 + p1);
                const float got = fmaf(w0 + w1, 0x1p-11f, l);
                n4++;
                if (aq_float_bits(got) != aq_float_bits(want)) bad4++;
            }
        }
    printf("4. l's update on %ld (w0, w1, l): %ld differ\n", n4, bad4);
    bad += bad4;

    /* 5 */
    long bad5 = 0, n5 = 0;
    for (uint32_t a = 0; a <= 0x7E00; a++) {
        if (a > 0x7C00 && a != 0x7E00) continue;
        for (uint32_t b = 0; b <= 0x7E00; b += (b < 0x7C00 ? 3 : 1)) {
            if (b > 0x7C00 && b != 0x7E00) continue;
            /* max.NaN.f16: NaN if either is */
            const uint16_t m = f16_is_nan((uint16_t)a) || f16_is_nan((uint16_t)b) ? 0x7FFF : f16_max(a, b);
            const float got = (float)f16_value(m) * 0x1p-11f;
            const float pa = (float)f16_value((uint16_t)a) * 0x1p-11f, pb = (float)f16_value((uint16_t)b) * 0x1p-11f;
            const uint32_t want = aq_float_bits(pa) > aq_float_bits(pb) ? aq_float_bits(pa) : aq_float_bits(pb);
            n5++;
            if (!(got != got ? want >= 0x7F800001u : aq_float_bits(got) == want)) bad5++;
        }
    }
    printf("5. D = 64 amax on %ld pairs: %ld differ\n", n5, bad5);
    bad += bad5;
    /* 6 */
    long bad6 = 0, n6 = 0;
    for (uint32_t a = 0; a < 0x7C00; a++) {
        const float w = (float)f16_value((uint16_t)a), phat = w * 0x1p-11f;
        const float sixth = 1.0f / 6.0f, sixth_hat = (1.0f / 6.0f) * 2048.0f;
        const float q0 = w * sixth, v = fmaf(fmaf(-q0, 6.0f, w), sixth, q0);
        const float q0h = phat * sixth_hat, vh = fmaf(fmaf(-q0h, 6.0f / 2048.0f, phat), sixth_hat, q0h);
        n6++;
        if (aq_float_bits(v) != aq_float_bits(vh)) bad6++;
    }
    printf("6. amax / 6 in w's units on %ld fp16 w: %ld differ\n", n6, bad6);
    bad += bad6;

    /* 7 */
    long bad7 = 0, n7 = 0;
    for (int c = 1; c < 0x7F; c++) {
        const double s = aq_e4m3_decode((uint8_t)c);
        const uint16_t want = f16_round((double)(float)(1.0 / s));
        for (int k = -64; k <= 64; k++) {
            const double x = (1.0 / s) * (1.0 + k * 0x1p-27);
            n7++;
            if (f16_round((double)(float)x) != want || f16_round(x) != want) bad7++;
        }
    }
    printf("7. fp16(1 / s) within 2^-21 on %ld (s, x): %ld differ\n", n7, bad7);
    bad += bad7;

    /* 8 */
    long bad8 = 0, n8 = 0;
    static float inv_ls[3 + 119 * 512];
    int k8 = 0;
    inv_ls[k8++] = 0.0f, inv_ls[k8++] = INFINITY, inv_ls[k8++] = NAN;
    for (int e = -115; e <= 3; e++)
        for (uint32_t m = 0; m < (1u << 23); m += 16411u) inv_ls[k8++] = aq_bits_float((uint32_t)(e + 127) << 23 | m);
    for (int i = 0; i < k8; i++) {
        const float inv_l = inv_ls[i];
        volatile float inv_l_hat = inv_l * 0x1p-11f;
        for (uint32_t a = 0; a <= 0x7E00; a++) {
            if (a > 0x7C00 && a != 0x7E00) continue;
            const float w = (float)f16_value((uint16_t)a);
            volatile float phat = w * 0x1p-11f;
            const float want = phat * inv_l, got = w * inv_l_hat;
            n8++;
            if (aq_float_bits(got) != aq_float_bits(want) && !(got != got && want != want)) {
                if (bad8 < 5) printf("8. w = %g inv_l = %a: got %a want %a\n", w, inv_l, got, want);
                bad8++;
            }
        }
    }
    printf("8. w * (inv_l * 2^-11) on %ld (w, inv_l): %ld differ\n", n8, bad8);
    bad += bad8;
    printf(bad ? "FAIL\n" : "all equal\n");
    return bad != 0;
}
