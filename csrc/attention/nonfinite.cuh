/* Inf / NaN operands kept out of hidden terms: sm80/'s scrub and poison, sm90/'s output check. */
#pragma once

#include "attention/tile_io.cuh"

/* ------------------------------------------------------------------------------------------------
   Non-finite operands (numerics.md §6, attn_qat.reference._matmul_visible). In a product
   acc[r, d] += sum_j w_rj B[j, d] a hidden term (w_rj = 0 by the kernels' selects) must be absent, not
   0 * NaN, while a visible term meeting a non-finite B[j, d] must make acc[r, d] NaN. When a B tile in shared
   memory holds any Inf or NaN (rare; flagged by load_tile), the kernels zero those entries before the product,
   remembering for each column d the rows j that held one, and afterwards poison acc[r, d] where a visible j
   is among them. */

/* A thread per column (d, d + AQ_THREADS, ...): zero the non-finite values of a ROWS x D tile (ROWS <= 64) in
   place and write col_rows[d] = the rows that held one in column d. */
template <int ROWS, int D, aq_dtype DT>
AQ_D void scrub_nonfinite_tile(uint16_t *tile, uint64_t *col_rows) {
    static_assert(ROWS <= 64, "one bit per row");
    constexpr int LD = D + AQ_SMEM_PAD;
    constexpr uint16_t EXP = DT == AQ_BFLOAT16 ? 0x7F80 : 0x7C00;
    for (int d = (int)threadIdx.x; d < D; d += AQ_THREADS) {
        uint64_t rows = 0;
        for (int r = 0; r < ROWS; r++) {
            uint16_t *x = tile + r * LD + d;
            if ((*x & EXP) == EXP) {
                rows |= 1ull << r;
                *x = 0;
            }
        }
        col_rows[d] = rows;
    }
}

/* NaN into acc (C fragments: acc[n][e] at row r = e >> 1, column 8n + frag_c_col) wherever a visible B row of
   this lane's C row r (bits in visible_rows[r]) was non-finite in that column. */
template <int D>
AQ_D void poison_nonfinite_products(float (&acc)[D / 8][4], const uint64_t visible_rows[2], const uint64_t *col_rows) {
    const int lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (visible_rows[e >> 1] & col_rows[8 * n + frag_c_col(lane, e)]) acc[n][e] = NAN;
}

/* Sets *flag when one of the warp's values is Inf or NaN (x * 0 + z keeps z = 0 for every finite x and makes it NaN
   otherwise). The Hopper kernels check their outputs with it where hidden terms could have carried a non-finite
   input into them (a hidden key's NaN times its P of 0); the launchers then run the mma.sync kernels, which keep
   hidden terms absent, behind them (attention_fwd_sm90.cu). Called by the whole warp. */
template <int N, int E>
AQ_D void flag_if_nonfinite(const float (&x)[N][E], int *flag) {
    float z[E] = {};
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int e = 0; e < E; e++) z[e] = __fmaf_rn(x[n][e], 0.0f, z[e]);
    bool bad = false;
#pragma unroll
    for (int e = 0; e < E; e++) bad |= z[e] != z[e];
    if (__any_sync(0xFFFFFFFFu, bad) && ((int)threadIdx.x & 31) == 0) *flag = 1;
}
