/* The Hopper kernels' output epilogue through TMA, one for the forward's O and O' and the dK/dV kernel's dK and dV:
   the outputs are staged in shared memory the mainloop is done with and copied out by the TMA unit. */
#pragma once

#include <cuda.h>

#include "attention/nonfinite.cuh"
#include "sm90/hopper.cuh"
#include "sm90/named_barriers.h"

/* A consumer warp's 16 output rows: rows row0 .. row0 + 15 of a staging tile of `rows` rows, for rows
   tile0 + row0 .. + 15 of head h, batch b of the output. */
struct warp_out_rows {
    int rows, row0, tile0, h, b;
};

/* One accumulator (or two, TWO) of a consumer warp out through TMA: flags non-finite values (nonfinite not NULL:
   flag_if_nonfinite), waits on named barrier `barrier` until all `threads` consumer threads are done with the
   shared memory the outputs are staged in, then stages and copies each out (tma_store_warp_rows says why). The
   caller's lane 0 then waits (bulk_wait_read) until the copies have read the tiles, before the CTA exits. */
template <int D, aq_dtype DT, bool TWO>
AQ_D void store_outputs_tma(int *nonfinite, sm90_named_barrier barrier, int threads, const warp_out_rows &at,
                            const float (&acc)[D / 8][4], unsigned char *tile, const CUtensorMap *map,
                            const float (&acc2)[D / 8][4], unsigned char *tile2, const CUtensorMap *map2) {
    if (nonfinite != NULL) {
        flag_if_nonfinite(acc, nonfinite);
        if constexpr (TWO) flag_if_nonfinite(acc2, nonfinite);
    }
    named_barrier_sync(barrier, threads);
    stage_fragment_rows<D, DT>(acc, tile, at.rows, at.row0);
    tma_store_warp_rows<D>(map, tile, at.rows, at.row0, at.tile0 + at.row0, at.h, at.b);
    if constexpr (TWO) {
        stage_fragment_rows<D, DT>(acc2, tile2, at.rows, at.row0);
        tma_store_warp_rows<D>(map2, tile2, at.rows, at.row0, at.tile0 + at.row0, at.h, at.b);
    }
}
