/* The named barriers (bar.sync ids) of the Hopper kernels, in one list so that no two uses in a kernel share an id.
   Id 0 is __syncthreads'. Each kernel uses its own: the forward's may repeat the backward's. */
#pragma once

enum sm90_named_barrier : int {
    /* attention_fwd_sm90_kernel */
    FWD_EPILOGUE_BARRIER = 1, /* the consumer warpgroups are done with Q and the K ring: the outputs are staged there */
    /* attention_bwd_dkdv_sm90_kernel */
    PING_PONG_BARRIER = 1,     /* 1 and 2: consumer warpgroup c waits on 1 + c for its turn at the P part */
    DS_BARRIER = 3,            /* fused dQ: both consumer warpgroups have written their dS^T of the step */
    DKDV_EPILOGUE_BARRIER = 4, /* both consumer warpgroups are done with K and V: dK and dV are staged there */
};
static_assert(DS_BARRIER > PING_PONG_BARRIER + 1, "ping-pong takes two ids");
