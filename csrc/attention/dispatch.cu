/* The one place that decides how a CUDA attention call runs (attn_qat.h's plan-then-launch protocol): the sizes the
   kernels take, the plan made once per call (the device's SM count, the Hopper or the mma.sync kernels, the split of
   the last wave and the workspaces it needs), and the launch order: the backward's delta kernel first, then the
   Hopper kernels with their side kernels, then the mma.sync kernels where the Hopper ones declined the operands or
   flagged a non-finite result. */
#include <algorithm>

#include "attention/dispatch.h"

/* NULL when the kernels take these sizes: those every attention kernel takes (attn_qat.h), within the CUDA grids'
   bounds. */
static const char *check_attention_sizes(aq_dtype dtype, int64_t head_dim, int64_t head_dim_v, int64_t batch,
                                         int64_t heads_q, int64_t heads_kv, int64_t seqlen_q, int64_t seqlen_k) {
    const char *problem =
        aq_attention_sizes_problem(dtype, head_dim, head_dim_v, batch, heads_q, heads_kv, seqlen_q, seqlen_k);
    if (problem) return problem;
    if (heads_q > 65535 || batch > 65535) return "attention (CUDA): batch and heads must be <= 65535";
    if (seqlen_q > INT32_MAX - 256 || seqlen_k > INT32_MAX - 256)
        return "attention (CUDA): sequence lengths must be at most 2^31 - 256";
    /* the mma.sync backward's 1-D grids: 64-row tiles x heads x batch x (up to 2) column slices */
    if ((seqlen_q + 63) / 64 * heads_q * batch * 2 > INT32_MAX ||
        (seqlen_k + 63) / 64 * heads_kv * batch * 2 > INT32_MAX)
        return "attention (CUDA): too many 64-token tiles (tokens / 64 x heads x batch must stay below 2^30)";
    return NULL;
}

/* The split for W = items items whose reduction axis has `units` units: the tail is W mod sms when it fills at most
   half an SM wave, split into sms / tail parts of at least 2 units; only when W < sms (one partial wave) unless
   full_grids. The options may turn it off or force one (tests: the last forced_tail items in forced_splits parts, at
   most one a unit). */
static tail_split plan_tail_split(int64_t items, int64_t units, int sms, bool full_grids, const aq_kernel_options *o) {
    tail_split t = {(int)items, 0, 1, NULL};
    int64_t tail = items % sms, splits = tail > 0 ? sms / tail : 0, min_units = 2;
    if (o->tail_split == AQ_TAIL_SPLIT_OFF) return t;
    if (o->tail_split == AQ_TAIL_SPLIT_FORCED) {
        tail = std::min<int64_t>(o->forced_tail, items), splits = o->forced_splits, min_units = 1;
    } else if (tail == 0 || 2 * tail > sms || (!full_grids && items >= sms)) {
        return t;
    }
    splits = std::min<int64_t>(splits, units / min_units);
    if (tail <= 0 || splits <= 1) return t;
    t.main_items = (int)(items - tail), t.tail_items = (int)tail, t.splits = (int)splits;
    return t;
}

/* The plan's split and workspace for a Hopper kernel's grid. */
static void plan_tail(const sm90_tail_shape &shape, const aq_kernel_options *o, aq_attention_plan *plan) {
    const tail_split t = shape.splittable
                             ? plan_tail_split(shape.items, shape.units, plan->sm_count, shape.full_grids, o)
                             : tail_split{(int)shape.items, 0, 1, NULL};
    plan->main_items = t.main_items, plan->tail_items = t.tail_items, plan->tail_splits = t.splits;
    plan->tail_floats = t.splits > 1 ? (int64_t)t.tail_items * t.splits * shape.part_floats : 0;
}

/* What the current device decides before either kernel family is asked: the SM count, and whether the Hopper
   kernels may run (the options allow them, on an sm_90 device with this build's sm_90a code, for head dims they
   take: sm90_head_dims, the caller's rule). */
static const char *plan_device(const aq_kernel_options *o, int sm90_head_dims, aq_attention_plan *plan) {
    int device = 0, major = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&plan->sm_count, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    plan->sm90 = o->sm90 && major == 9 && sm90_head_dims && aq_sm90_kernels_run_here();
    return NULL;
}

int aq_attention_sm90_runs(const aq_kernel_options *o) {
    aq_attention_plan plan = {};
    return plan_device(o, 1, &plan) == NULL && plan.sm90; /* head dims they take: the device decides */
}

/* A plan that runs nothing beyond the mma.sync kernels, with no split. */
static aq_attention_plan empty_plan(void) {
    aq_attention_plan plan = {};
    plan.tail_splits = 1;
    return plan;
}

const char *aq_attention_fwd_plan_cuda(const aq_attention_fwd_params *p, const aq_kernel_options *o,
                                       aq_attention_plan *plan) {
    *plan = empty_plan();
    const char *err = check_attention_sizes(p->dtype, p->head_dim, p->head_dim_v, p->batch, p->heads_q, p->heads_kv,
                                            p->seqlen_q, p->seqlen_k);
    if (err || p->batch == 0 || p->seqlen_q == 0) return err;
    const int head_dims = aq_sm90_forward_head_dims(p->head_dim, p->head_dim_v, p->quantize_p && p->o_prime != NULL,
                                                    o->sm90_d256);
    if ((err = plan_device(o, head_dims, plan)) || !plan->sm90) return err;
    plan->use_work_order = p->work_order != NULL && !o->index_order;
    plan_tail(aq_attention_fwd_sm90_tail_shape(p), o, plan);
    return NULL;
}

const char *aq_attention_bwd_plan_cuda(const aq_attention_bwd_params *p, const aq_kernel_options *o,
                                       aq_attention_plan *plan) {
    *plan = empty_plan();
    const char *err = check_attention_sizes(p->dtype, p->head_dim, p->head_dim_v, p->batch, p->heads_q, p->heads_kv,
                                            p->seqlen_q, p->seqlen_k);
    if (err || p->batch == 0) return err;
    if ((err = plan_device(o, aq_sm90_head_dims(p->head_dim, p->head_dim_v), plan)) || !plan->sm90) return err;
    if (p->seqlen_q > 0) plan->dq_accum_floats = aq_attention_bwd_sm90_dq_accum_floats(p);
    plan->use_work_order = p->work_order != NULL && !o->index_order;
    plan_tail(aq_attention_bwd_sm90_tail_shape(p), o, plan);
    return NULL;
}

const char *aq_attention_fwd_cuda(const aq_attention_fwd_params *p, const aq_attention_plan *plan, void *stream) {
    if (p->batch == 0 || p->seqlen_q == 0) return NULL;
    cudaStream_t s = (cudaStream_t)stream;
    bool taken = false;
    const int *only_if = NULL;
    const char *err = plan->sm90 ? aq_attention_fwd_sm90(p, plan, s, &taken, &only_if) : NULL;
    if (err || (taken && only_if == NULL)) return err;
    return aq_attention_fwd_sm80(p, s, only_if);
}

const char *aq_attention_bwd_cuda(const aq_attention_bwd_params *caller, const aq_attention_plan *plan,
                                  void *stream) {
    if (caller->batch == 0) return NULL;
    aq_attention_bwd_params p = *caller;
    p.sm_count = plan->sm_count;
    cudaStream_t s = (cudaStream_t)stream;
    const char *err = aq_attention_bwd_delta(&p, s);
    if (err) return err;
    bool taken = false;
    const int *only_if = NULL;
    err = plan->sm90 ? aq_attention_bwd_sm90(&p, plan, s, &taken, &only_if) : NULL;
    if (err || (taken && only_if == NULL)) return err;
    return aq_attention_bwd_sm80(&p, s, only_if);
}
