/* The kernel families' launchers as attention/dispatch.cu calls them (sm80/ and sm90/ define them). */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/scheduler.cuh"
#include "attn_qat.h"

/* ------------------------------------------------------------------------------------------------
   attention/backward_preprocess.cu: delta = rowsum(dO * out_for_delta), which every backward kernel reads; it runs
   before the backward kernels of either family. */

const char *aq_attention_bwd_delta(const aq_attention_bwd_params *p, cudaStream_t stream);

/* ------------------------------------------------------------------------------------------------
   sm80/: the mma.sync kernels, any CUDA GPU. only_if: NULL, or a device flag without which the kernels exit at once
   (the fallback behind the Hopper kernels, which set it). */

const char *aq_attention_fwd_sm80(const aq_attention_fwd_params *p, cudaStream_t stream, const int *only_if);

/* The dK/dV and dQ kernels (delta is done). */
const char *aq_attention_bwd_sm80(const aq_attention_bwd_params *p, cudaStream_t stream, const int *only_if);

/* ------------------------------------------------------------------------------------------------
   sm90/: the Hopper kernels (wgmma, TMA). */

/* Whether the current device, an sm_90 one, runs this build's sm_90a code: cudaFuncGetAttributes cannot tell an
   sm_90a image from an empty sm_90 one, so a build without one (setup.py's AQ_BUILT_SM90A) answers false. */
bool aq_sm90_kernels_run_here(void);

/* How a Hopper kernel's grid may split its last wave, for the plan: its work items, the units of an item's reduction
   axis, whether grids of more than one wave split too (else only a partial wave), and the floats of a part's partial
   results. splittable false: this call's kernel has no tail variant. */
typedef struct {
    int64_t items, units, part_floats;
    bool splittable, full_grids;
} sm90_tail_shape;

sm90_tail_shape aq_attention_fwd_sm90_tail_shape(const aq_attention_fwd_params *p);
sm90_tail_shape aq_attention_bwd_sm90_tail_shape(const aq_attention_bwd_params *p);

/* The fused dQ's fp32 sums (dq_accum) for these sizes, in floats. */
int64_t aq_attention_bwd_sm90_dq_accum_floats(const aq_attention_bwd_params *p);

/* Run the call on the Hopper kernels when these operands allow it (TMA can address them; *taken says whether they
   ran). When *fallback_flag comes back non-NULL, the mma.sync kernels must still run on the same stream, doing their
   work only if the device flag is set (hidden keys over non-finite values, which those kernels keep absent). The
   backward's delta kernel runs before. Return NULL or an error message. */
const char *aq_attention_fwd_sm90(const aq_attention_fwd_params *p, const aq_attention_plan *plan,
                                  cudaStream_t stream, bool *taken, const int **fallback_flag);
const char *aq_attention_bwd_sm90(const aq_attention_bwd_params *p, const aq_attention_plan *plan,
                                  cudaStream_t stream, bool *taken, const int **fallback_flag);

/* The plan's split of the last wave over the caller's workspace; without one, no split. */
static inline tail_split planned_tail_split(const aq_attention_plan *plan, float *workspace) {
    tail_split t = {plan->main_items, plan->tail_items, workspace != NULL ? plan->tail_splits : 1, workspace};
    return t;
}
