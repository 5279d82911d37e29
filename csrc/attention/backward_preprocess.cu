/* The backward's preprocess, before the dK/dV and dQ kernels of every architecture (attention/dispatch.cu runs it
   first): delta = rowsum(dO * O'), which every backward kernel reads (numerics.md §4). */
#include "attention/dispatch.h"
#include "attention/fragments.cuh"
#include "attention/launch.h"
#include "attention/tile_io.cuh"

/* delta_i = sum_d dO_id * out_id in fp32. dout, out_for_delta: (B, Hq, Nq, Dv) strided, Dv <= W (a tile width of
   attention/launch.h); delta: (B, Hq, Nq) fp32. grid (ceil(Nq / (4 DELTA_ROWS)), Hq, B), 128 threads: a warp takes
   DELTA_ROWS query rows, lane reading columns lane + 32i < Dv of each (zeros past Dv), all of its loads issued
   before the sums (one row a warp kept too few bytes in flight:
   performance.md v18). Each row's sum keeps its order (lane partials over i,
   then the butterfly): with one visible key, dS = P (dP - delta) is 0 in the reference, and the kernels get
   exactly 0 only when delta matches the wgmma's dP bit for bit, which this order does at the tests' seeds and
   another did not (performance.md v13). */
#define DELTA_ROWS 4
template <int W, aq_dtype DT>
__global__ void __launch_bounds__(AQ_THREADS) attention_bwd_delta_kernel(const aq_attention_bwd_params p) {
    constexpr int PER_LANE = (W + 31) / 32;
    const int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32;
    const int row0 = ((int)blockIdx.x * (AQ_THREADS / 32) + warp) * DELTA_ROWS;
    const int h = (int)blockIdx.y, b = (int)blockIdx.z;
    const uint16_t *dog = (const uint16_t *)p.dout + b * p.dout_stride[0] + h * p.dout_stride[1];
    const uint16_t *og =
        (const uint16_t *)p.out_for_delta + b * p.out_for_delta_stride[0] + h * p.out_for_delta_stride[1];
    const int dv = (int)p.head_dim_v;
    uint16_t dx[DELTA_ROWS][PER_LANE], ox[DELTA_ROWS][PER_LANE];
#pragma unroll
    for (int r = 0; r < DELTA_ROWS; r++) {
        const bool in = row0 + r < p.seqlen_q;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const bool col = lane + 32 * i < dv;
            dx[r][i] = in && col ? dog[(row0 + r) * p.dout_stride[2] + lane + 32 * i] : 0;
            ox[r][i] = in && col ? og[(row0 + r) * p.out_for_delta_stride[2] + lane + 32 * i] : 0;
        }
    }
#pragma unroll
    for (int r = 0; r < DELTA_ROWS; r++) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) acc += to_float<DT>(dx[r][i]) * to_float<DT>(ox[r][i]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(AQ_FULL_MASK, acc, off);
        if (lane == 0 && row0 + r < p.seqlen_q) p.delta[((int64_t)b * p.heads_q + h) * p.seqlen_q + row0 + r] = acc;
    }
}

template <int W, aq_dtype DT>
static const char *launch_bwd_delta(const aq_attention_bwd_params *p, cudaStream_t stream) {
    if (p->seqlen_q == 0) return NULL;
    const int rows = AQ_THREADS / 32 * DELTA_ROWS;
    const dim3 grid((unsigned)((p->seqlen_q + rows - 1) / rows), (unsigned)p->heads_q, (unsigned)p->batch);
    attention_bwd_delta_kernel<W, DT><<<grid, AQ_THREADS, 0, stream>>>(*p);
    return launch_status();
}

const char *aq_attention_bwd_delta(const aq_attention_bwd_params *p, cudaStream_t s) {
    return with_tile_width_and_dtype(p->head_dim_v, p->head_dim_v, p->dtype, [&](auto w, auto dt) {
        return launch_bwd_delta<decltype(w)::value, decltype(dt)::value>(p, s);
    });
}
