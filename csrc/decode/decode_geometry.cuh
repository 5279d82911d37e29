/* The decode kernel's geometry (docs/kv_cache_layout.md): its CTA's warps, the 16-key units they take and the chunks
   of keys a CTA takes, a unit's bytes in shared memory, and the tile of query rows and keys a CTA works on. */
#pragma once

#include "attention/fragments.cuh"

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
#define DEC_STAGES 4                          /* units in a warp's ring: a step's one or two, the rest in flight */
#define DEC_UNIT 16                           /* keys per unit: one V block, one P block */
#define DEC_MIN_CHUNK (DEC_WARPS * DEC_UNIT)  /* chunks are multiples of this, at most DEC_MAX_CHUNK */
#define DEC_MAX_CHUNK AQ_DECODE_CHUNK_MAX
#define DEC_FRAME 16384.0f                    /* K^F and V^F are dequantized times 1 / DEC_FRAME (kv_cache_layout.md) */

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
