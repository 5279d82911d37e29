/* mma.sync m16n8k16 fragment maps, ldmatrix / mma wrappers, 16-bit packing: every attention kernel. */
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "attn_qat.h"
#include "format/nvfp4.h"

#define AQ_FULL_MASK 0xFFFFFFFFu

#define AQ_D __device__ __forceinline__

/* ------------------------------------------------------------------------------------------------
   Fragment maps of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with g = lane >> 2 and
   t = lane & 3:
     A (16 x 16, row-major): reg 0 = row g, cols 2t, 2t+1; reg 1 = row g+8, same cols;
                             reg 2 = row g, cols 2t+8, 2t+9; reg 3 = row g+8, cols 2t+8, 2t+9 (low half = lower col)
     B (16 x 8, "col"):      reg 0 = k 2t, 2t+1 at n = g; reg 1 = k 2t+8, 2t+9 at n = g
     C (16 x 8, fp32):       c[e] at row g + 8 * (e >> 1), col 2t + (e & 1)
   ldmatrix.x4: lane l gives the address of row l & 7 of 8x8 matrix l >> 3; register i receives matrix i, lane l
   holding row l >> 2, cols 2(l & 3), 2(l & 3)+1 (with .trans: rows 2(l & 3), 2(l & 3)+1 of col l >> 2).
   The two address maps below are (row, col) inside a 16 x 16 block of a row-major shared tile.
   Host-callable so a CPU test can check them against the PTX layouts. */

/* "mk": the block holds A as [m][k] (plain ldmatrix gives A regs 0..3), or B as [k][n] (ldmatrix.trans gives
   reg 0, 1 = B regs 0, 1 of n-block 0 (n 0..7) and reg 2, 3 = B regs 0, 1 of n-block 1 (n 8..15)).
   Matrices: (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15). */
AQ_HD int ldsm_row_mk(int lane) { return lane & 15; }
AQ_HD int ldsm_col_mk(int lane) { return (lane >> 4) * 8; }

/* "nk": the block holds B transposed, [n][k] (keys x head dim for S = Q K^T); plain ldmatrix gives reg 0, 1 =
   B regs 0, 1 of n-block 0 (rows 0..7) and reg 2, 3 = B regs 0, 1 of n-block 1 (rows 8..15).
   Matrices: (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15). */
AQ_HD int ldsm_row_nk(int lane) { return (lane & 7) + (lane >> 4) * 8; }
AQ_HD int ldsm_col_nk(int lane) { return ((lane >> 3) & 1) * 8; }

/* Row and column inside the 16 x 8 C fragment of element c[e]. */
AQ_HD int frag_c_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
AQ_HD int frag_c_col(int lane, int e) { return 2 * (lane & 3) + (e & 1); }

/* ------------------------------------------------------------------------------------------------
   Tensor-core and conversion wrappers. DT is AQ_BFLOAT16 or AQ_FLOAT16; 16-bit data travels as uint16_t. */

template <aq_dtype DT>
AQ_D void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    if constexpr (DT == AQ_BFLOAT16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

AQ_D void ldsm_x4(uint32_t r[4], const uint16_t *smem_row) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

AQ_D void ldsm_x4_trans(uint32_t r[4], const uint16_t *smem_row) {
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* Two fp32 values rounded to nearest even into one register, lo in the low half (the lower column). */
template <aq_dtype DT>
AQ_D uint32_t pack2(float lo, float hi) {
    uint32_t r;
    if constexpr (DT == AQ_BFLOAT16)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* The two halves of a and b multiplied pairwise, each product rounded once to nearest even in DT. */
template <aq_dtype DT>
AQ_D uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t r;
    if constexpr (DT == AQ_BFLOAT16)
        asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    else
        asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

template <aq_dtype DT>
AQ_D float to_float(uint16_t h) {
    if constexpr (DT == AQ_BFLOAT16)
        return __uint_as_float((uint32_t)h << 16);
    else
        return __half2float(__ushort_as_half(h));
}

/* The A fragment (16 rows x 16 k) made of two C fragments side by side: c0 = columns 0..7 and c1 = columns
   8..15 of the same 16 rows. This is how a score tile becomes the left operand of the next product without
   going through shared memory: C's (row g, cols 2t, 2t+1) is exactly A's reg 0, and so on. */
template <aq_dtype DT>
AQ_D void pack_a_from_c(uint32_t a[4], const float c0[4], const float c1[4]) {
    a[0] = pack2<DT>(c0[0], c0[1]);
    a[1] = pack2<DT>(c0[2], c0[3]);
    a[2] = pack2<DT>(c1[0], c1[1]);
    a[3] = pack2<DT>(c1[2], c1[3]);
}
