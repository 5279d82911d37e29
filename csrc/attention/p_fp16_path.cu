/* The op p_fp16_path on the GPU: the kernels' own device functions for P's fp16 path (numerics.md §3), run on given
   exponent arguments, so that tests can hold them to attn_qat.reference bit for bit (tests/test_p_fp16.py). */
#include "attn_qat.h"
#include "attention/softmax.cuh"

/* p_fp16_path_kernel's block as the sm90 forward computes it, in f16x2 pairs (p_quant.cuh: p_block_scale_pairs,
   p_round_pair, scale_rounded_pair, p_hat_pair; exp_row_pairs' packing, the D = 64 amax), in both 16-bit types, and
   the sm90 backward's p_over_l_pair, p_block_scales_of_pair and P^F / l: whether every value equals the fp32
   functions' (w_fq: P^F * 2^11, s, r = 2^11 fp16(1 / s) of p_block_scale; p_hat<true> * inv_l). */
AQ_D bool pair_path_agrees(const float (&x)[AQ_BLOCK], int count, const float (&w_fq)[AQ_BLOCK], float s, float r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    auto same = [](float a, float b) { return a == b || (a != a && b != b); };
    uint32_t w[AQ_BLOCK / 2], amax2 = 0;
#pragma unroll
    for (int i = 0; i < AQ_BLOCK / 2; i++) {
        w[i] = pack2<AQ_FLOAT16>(2 * i < count ? frame_exp2(x[2 * i]) : 0.0f,
                                 2 * i + 1 < count ? frame_exp2(x[2 * i + 1]) : 0.0f);
        amax2 = f16x2_max_nan(amax2, w[i]);
    }
    const float amax = f16_lo(f16x2_max_nan(amax2, amax2 >> 16));
    uint32_t r16, s16, rb, sb;
    p_block_scale_pairs<AQ_FLOAT16>(amax, &r16, &s16);
    p_block_scale_pairs<AQ_BFLOAT16>(amax, &rb, &sb);
    bool ok = same(f16_lo(s16), s) && same(f16_hi(r16), r * AQ_P_HEADROOM_INV) && r16 == rb &&
              same(__uint_as_float(sb << 16), s * AQ_BF16_FROM_F16_SCALE);
    /* the dK/dV kernel's two blocks at once (p_block_scales_of_pair): this block in either half, a zero one beside */
    const uint32_t amax_bits = f16x2_max_nan(amax2, amax2 >> 16) & 0xFFFFu;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint32_t r2, s2;
        p_block_scales_of_pair(amax_bits << (16 * h), &r2, &s2);
        const int mine = 16 * h, other = 16 - mine;
        ok = ok && ((r2 >> mine) & 0xFFFFu) == (r16 & 0xFFFFu) && ((s2 >> mine) & 0xFFFFu) == (s16 & 0xFFFFu) &&
             ((r2 >> other) & 0xFFFFu) == 0u && ((s2 >> other) & 0xFFFFu) == 0u;
    }
#pragma unroll
    for (int i = 0; i < AQ_BLOCK / 2; i++) {
        const uint32_t fq16 = scale_rounded_pair<AQ_FLOAT16>(p_round_pair(w[i], r16), s16);
        const uint32_t fqbf = scale_rounded_pair<AQ_BFLOAT16>(p_round_pair(w[i], rb), sb);
        const float lo = f16_lo(w[i]), hi = f16_hi(w[i]);
        const uint32_t hat16 = p_hat_pair<AQ_FLOAT16>(w[i], lo, hi), hatbf = p_hat_pair<AQ_BFLOAT16>(w[i], lo, hi);
        const float inv_l = 1.0f / (float)(3 + i), u[2] = {x[2 * i], x[2 * i + 1]};
        float p[2]; /* frame 11, exp_scale 1: the exponent arguments are x themselves */
        p_over_l_pair(u, 1.0f, AQ_P_HEADROOM_LOG2, inv_l, p);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int e = 2 * i + h;
            if (e >= count) continue;
            const float phat = (h ? hi : lo) * AQ_P_HEADROOM_INV;
            ok = ok && same(h ? f16_hi(fq16) : f16_lo(fq16), w_fq[e]) &&
                 same(p[h], p_hat<true>(x[e], 1.0f, AQ_P_HEADROOM_LOG2) * inv_l) &&
                 same((h ? f16_hi(fq16) : f16_lo(fq16)) * (inv_l * AQ_P_HEADROOM_INV),
                      w_fq[e] * AQ_P_HEADROOM_INV * inv_l) && /* the dK/dV kernel's P^F / l */
                 same(__uint_as_float(h ? fqbf & 0xFFFF0000u : fqbf << 16), w_fq[e]) &&
                 (h ? hat16 >> 16 : hat16 & 0xFFFFu) == (pack2<AQ_FLOAT16>(phat, 0.0f) & 0xFFFFu) &&
                 (h ? hatbf >> 16 : hatbf & 0xFFFFu) == (pack2<AQ_BFLOAT16>(phat, 0.0f) & 0xFFFFu);
        }
    }
    return ok;
#else
    return true;
#endif
}

/* One thread a block of 16 entries of a row (blocks from each row's index 0, the last one possibly shorter):
   w = p_frame_value(x) (fp16(2^x), as p_hat<true> forms it from its fma), P̂ = w * 2^-11, the block's amax as the
   max of the P̂ bits, p_block_scale and p_fake_quantize_element, which give w_fq = P^F * 2^11 with the scale s.
   Where the sm90 forward's f16x2 path (pair_path_agrees) differs from these anywhere in the block, the block's
   w_fq are -1, which no P^F is. */
__global__ void p_fp16_path_kernel(const float *x, int64_t rows, int64_t n, float *w, float *w_fq) {
    const int64_t blocks_per_row = (n + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t blk = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= rows * blocks_per_row) return;
    const int64_t row = blk / blocks_per_row, j0 = (blk % blocks_per_row) * AQ_BLOCK;
    const int count = (int)min((int64_t)AQ_BLOCK, n - j0);
    const int64_t base = row * n + j0;
    float xs[AQ_BLOCK], p[AQ_BLOCK], fq[AQ_BLOCK];
    uint32_t amax = 0;
#pragma unroll
    for (int e = 0; e < AQ_BLOCK; e++) {
        xs[e] = e < count ? x[base + e] : 0.0f;
        p[e] = e < count ? p_frame_value(xs[e]) * AQ_P_HEADROOM_INV : 0.0f;
        amax = max(amax, __float_as_uint(p[e]));
    }
    float s, s_pf, r;
    p_block_scale(amax, &s, &s_pf, &r);
#pragma unroll
    for (int e = 0; e < AQ_BLOCK; e++) fq[e] = p_fake_quantize_element(p[e], s, r);
    const bool agrees = pair_path_agrees(xs, count, fq, s, r);
#pragma unroll
    for (int e = 0; e < AQ_BLOCK; e++)
        if (e < count) {
            w[base + e] = p[e] * AQ_P_HEADROOM;
            w_fq[base + e] = agrees ? fq[e] : -1.0f;
        }
}

const char *aq_p_fp16_path_cuda(const float *x, int64_t rows, int64_t n, float *w, float *w_fq, void *stream) {
    if (rows < 0 || n < 0) return "p_fp16_path: negative size";
    const int64_t blocks = rows * ((n + AQ_BLOCK - 1) / AQ_BLOCK);
    if (blocks == 0) return NULL;
    const int threads = 128;
    p_fp16_path_kernel<<<(unsigned)((blocks + threads - 1) / threads), threads, 0, (cudaStream_t)stream>>>(x, rows, n,
                                                                                                          w, w_fq);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}
