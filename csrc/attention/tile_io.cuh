/* Global <-> padded shared-memory tiles and fragment stores: sm80/'s kernels, sm90/'s stores. */
#pragma once

#include "attention/fragments.cuh"

#define AQ_THREADS 128            /* 4 warps per CTA in every mma.sync attention kernel */
#define AQ_SMEM_PAD 8             /* 16-bit elements appended to each shared-memory row: 16 bytes, so the 8 rows
                                     read by one ldmatrix phase start in 8 different bank groups */

/* ------------------------------------------------------------------------------------------------
   Global <-> padded shared memory. A tile is ROWS x D 16-bit values, row r at smem + r * (D + AQ_SMEM_PAD).
   vec: the global base and every stride are multiples of 16 bytes, so a row chunk of 8 values is one uint4. */

AQ_D uint4 load_chunk8(const uint16_t *src, bool vec) {
    if (vec) return *(const uint4 *)src;
    uint4 v;
    v.x = src[0] | ((uint32_t)src[1] << 16);
    v.y = src[2] | ((uint32_t)src[3] << 16);
    v.z = src[4] | ((uint32_t)src[5] << 16);
    v.w = src[6] | ((uint32_t)src[7] << 16);
    return v;
}

AQ_D void store_chunk8(uint16_t *dst, uint4 v, bool vec) {
    if (vec) {
        *(uint4 *)dst = v;
        return;
    }
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        dst[2 * i] = (uint16_t)(w[i] & 0xFFFFu);
        dst[2 * i + 1] = (uint16_t)(w[i] >> 16);
    }
}

/* Whether any of the 8 values of a chunk is Inf or NaN (all exponent bits set). Per 32-bit word: the masked
   exponent of each half plus one unit of it reaches bit 15 only when the exponent was all ones, and no carry
   crosses the halves. */
template <aq_dtype DT>
AQ_D bool chunk8_nonfinite(uint4 v) {
    constexpr uint32_t EXP = DT == AQ_BFLOAT16 ? 0x7F807F80u : 0x7C007C00u;
    constexpr uint32_t ONE = DT == AQ_BFLOAT16 ? 0x00800080u : 0x04000400u;
    return (((v.x & EXP) + ONE) | ((v.y & EXP) + ONE) | ((v.z & EXP) + ONE) | ((v.w & EXP) + ONE)) & 0x80008000u;
}

/* All AQ_THREADS threads copy global rows [0, valid), columns [0, cols) (row stride `stride` elements; cols a
   multiple of 8 up to D) into the tile and write zeros to the rest of its ROWS x D: padding keys then give finite
   scores and V rows of 0, so 0-weighted padding never makes a NaN (0 * garbage), and padding columns add exact
   zeros to every product (a head dim below the tile's). Nothing outside [0, valid) x [0, cols) is read from global
   memory. Returns whether this thread loaded an Inf or NaN (for the tiles that may need scrub_nonfinite_tile). */
template <int ROWS, int D, aq_dtype DT>
AQ_D bool load_tile(uint16_t *smem, const uint16_t *g, int64_t stride, int valid, int cols, bool vec) {
    constexpr int LD = D + AQ_SMEM_PAD, CHUNKS = D / 8;
    static_assert((ROWS * CHUNKS) % AQ_THREADS == 0, "tile chunks must split evenly over the CTA");
    bool nonfinite = false;
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / AQ_THREADS; i++) {
        const int c = (int)threadIdx.x + i * AQ_THREADS, r = c / CHUNKS, col = (c % CHUNKS) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < valid && col < cols) v = load_chunk8(g + r * stride + col, vec);
        nonfinite |= chunk8_nonfinite<DT>(v);
        *(uint4 *)(smem + r * LD + col) = v;
    }
    return nonfinite;
}

/* One warp writes its 16 x D fp32 accumulator (C fragments acc[n] = columns 8n .. 8n+7) as DT to global rows
   [0, valid), columns [0, cols) (a multiple of 8), staged through `stage` (the warp's own 16 rows of a padded
   tile, row stride D + AQ_SMEM_PAD, that no other warp reads any more) so the global writes are whole 16-byte
   chunks of a row. Bank-conflict free: the 32-bit writes of one instruction hit word (g * LD / 2 + t) mod 32 =
   4g + t, since LD / 2 = 4 mod 32. */
template <int D, aq_dtype DT>
AQ_D void store_warp_rows(const float (&acc)[D / 8][4], uint16_t *stage, uint16_t *g, int64_t stride, int valid,
                          int cols, bool vec) {
    constexpr int LD = D + AQ_SMEM_PAD, CHUNKS = D / 8;
    const int lane = (int)threadIdx.x & 31;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        const int col = 8 * n + frag_c_col(lane, 0);
        *(uint32_t *)(stage + frag_c_row(lane, 0) * LD + col) = pack2<DT>(acc[n][0], acc[n][1]);
        *(uint32_t *)(stage + frag_c_row(lane, 2) * LD + col) = pack2<DT>(acc[n][2], acc[n][3]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * CHUNKS / 32; i++) {
        const int c = lane + 32 * i, r = c / CHUNKS, col = (c % CHUNKS) * 8;
        if (r < valid && col < cols) store_chunk8(g + r * stride + col, *(const uint4 *)(stage + r * LD + col), vec);
    }
    __syncwarp();
}

/* A warp's 16 x D fp32 C fragments (acc[n] = columns 8n .. 8n+7) written as DT straight from registers to global
   rows [0, valid), 4 bytes per store (the quad of a row fills 16 contiguous bytes): base 4-byte aligned, stride
   even. */
template <int D, aq_dtype DT>
AQ_D void store_fragment_rows(const float (&acc)[D / 8][4], uint16_t *g, int64_t stride, int valid) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = frag_c_row(lane, 2 * r);
        if (row >= valid) continue;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            *(uint32_t *)(g + row * stride + 8 * n + frag_c_col(lane, 0)) = pack2<DT>(acc[n][2 * r], acc[n][2 * r + 1]);
    }
}
