/* NVFP4 attention forward and backward on the CPU, in C: the exact two-pass form of numerics.md §3/§4.
   Scores use fp32 accumulation like the GPU (they decide the frame M and the P codes); every other sum is double.
   P's fp16 path is attn_qat.reference's bit for bit, given the same fp32 exponent arguments (aq_p_fp16_path_cpu).
   Built with OpenMP, the forward runs its (batch, query head) items and the backward its (batch, KV head) items on
   omp_get_max_threads() threads, which is torch.get_num_threads() where torch and this share one OpenMP runtime (they
   do with torch's libgomp); every item writes only its own outputs and sums in one fixed order, so the bits do not
   depend on the thread count. Without OpenMP the pragmas vanish and the items run one after another. */
#include <stdlib.h>
#include <string.h>

#include "attn_qat.h"
#include "format/nvfp4.h"

#ifdef _OPENMP
/* dynamic: causal items differ in work */
#define AQ_PARALLEL_FOR _Pragma("omp parallel for schedule(dynamic, 1)")
#else
#define AQ_PARALLEL_FOR
#endif

static float load_half(const void *base, aq_dtype dtype, int64_t offset) {
    uint16_t h = ((const uint16_t *)base)[offset];
    return dtype == AQ_BFLOAT16 ? aq_bf16_to_float(h) : aq_fp16_to_float(h);
}

static void store_half(void *base, aq_dtype dtype, int64_t offset, float value) {
    ((uint16_t *)base)[offset] = dtype == AQ_BFLOAT16 ? aq_float_to_bf16(value) : aq_float_to_fp16(value);
}

/* malloc never asked for 0 bytes, so NULL always means out of memory. */
static void *alloc_array(int64_t count, size_t elem_size) {
    return malloc((size_t)(count > 0 ? count : 1) * elem_size);
}

/* One (batch, kv head) slice of K or V, (Nk, D) in fp32, converted once and shared by its query heads. */
static void load_kv_head(const void *src, aq_dtype dtype, const int64_t *stride, int64_t b, int64_t h,
                         int64_t seqlen, int64_t head_dim, float *dst) {
    for (int64_t j = 0; j < seqlen; j++) {
        const int64_t base = b * stride[0] + h * stride[1] + j * stride[2];
        for (int64_t d = 0; d < head_dim; d++) dst[j * head_dim + d] = load_half(src, dtype, base + d);
    }
}

static void load_row(const void *src, aq_dtype dtype, const int64_t *stride, int64_t b, int64_t h, int64_t i,
                     int64_t head_dim, float *dst) {
    const int64_t base = b * stride[0] + h * stride[1] + i * stride[2];
    for (int64_t d = 0; d < head_dim; d++) dst[d] = load_half(src, dtype, base + d);
}

/* What the forward and the backward both need to recompute the same t_ij, bit for bit. */
typedef struct {
    const float *k;        /* (Nk, D) fp32 of the row's kv head */
    const float *mask;     /* mask[b, h, i, 0] or NULL */
    int64_t mask_stride_j;
    int64_t seqlen_k, head_dim;
    float softmax_scale;
    int causal;
    int64_t last_visible;  /* i + causal_offset */
    /* Keys outside [key_begin, key_end) are hidden (packed sequences: the row's span, attn_qat.h; else every key).
       The loops run over [first, key_end), first = key_begin rounded down to a P block (16 keys from key 0). */
    int64_t key_begin, key_end, first;
} score_row;

static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

static score_row score_row_at(const float *k_head, const float *mask, const int64_t *mask_stride, int64_t b,
                              int64_t h, int64_t i, int64_t seqlen_k, int64_t head_dim, float softmax_scale,
                              int causal, int64_t causal_offset, const int32_t *q_span) {
    score_row r;
    r.key_begin = 0;
    r.key_end = seqlen_k;
    if (q_span) {
        r.key_end = clamp64(q_span[2 * i + 1], 0, seqlen_k);
        r.key_begin = clamp64(q_span[2 * i], 0, r.key_end);
    }
    r.first = r.key_begin - r.key_begin % AQ_BLOCK;
    r.k = k_head;
    r.mask = mask ? mask + b * mask_stride[0] + h * mask_stride[1] + i * mask_stride[2] : NULL;
    r.mask_stride_j = mask_stride[3];
    r.seqlen_k = seqlen_k;
    r.head_dim = head_dim;
    r.softmax_scale = softmax_scale;
    r.causal = causal;
    r.last_visible = i + causal_offset;
    return r;
}

/* t_j in the log2 domain and whether key j is visible (for j in [r->first, r->key_end)); returns whether any key
   is. Visibility is kept apart from t: a visible key whose score is -inf (or NaN) is not a hidden key, and its row
   is not empty. */
static int compute_scores(const score_row *r, const float *q, float *t, uint8_t *visible) {
    const float scale_log2 = r->softmax_scale * AQ_LOG2E;
    int any_visible = 0;
    for (int64_t j = r->first; j < r->key_end; j++) {
        const float mask_value = r->mask ? r->mask[j * r->mask_stride_j] : 0.0f;
        visible[j] = j >= r->key_begin && !(r->causal && j > r->last_visible) && mask_value != -INFINITY;
        if (!visible[j]) continue;
        any_visible = 1;
        const float *k = r->k + j * r->head_dim;
        float s = 0.0f;
        for (int64_t d = 0; d < r->head_dim; d++) s += q[d] * k[d];
        t[j] = r->mask ? (s * r->softmax_scale + mask_value) * AQ_LOG2E : s * scale_log2;
    }
    return any_visible;
}

/* M = ceil(max_j t_j) over the visible keys, ignoring NaN so that NaN reaches l and O instead of hiding
   in M. It is -inf for an empty row, and also for a visible row of only NaN or -inf scores: there
   2^(t - M) is NaN, so that row's l and O come out NaN rather than empty. */
static float row_frame(const float *t, const uint8_t *visible, const score_row *r) {
    float max_t = -INFINITY;
    for (int64_t j = r->first; j < r->key_end; j++)
        if (visible[j] && t[j] > max_t) max_t = t[j]; /* false for NaN */
    return ceilf(max_t);
}

/* The fp16 value nearest to v >= 0 (or NaN), as a float: ties to even, subnormals kept (grid 2^-24 below 2^-14),
   Inf from 65520 on. Bit arithmetic on the double, so that no compiler fp16 type is needed. */
static float round_double_to_fp16(double v) {
    if (v != v) return (float)v;
    if (v >= 65520.0) return INFINITY;
    if (v < 6.103515625e-05) return (float)(nearbyint(v * 16777216.0) / 16777216.0); /* v * 2^24 is exact */
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    b += 0x1FFFFFFFFFFull + ((b >> 42) & 1u); /* round the 52-bit fraction to 10 bits, ties to even */
    b &= ~0x3FFFFFFFFFFull;
    memcpy(&v, &b, sizeof v);
    return (float)v; /* 11 significant bits: exact */
}

/* w = fp16(2^x) = P̂ * 2^11 for the fp32 exponent argument x = t - (M - 11) (numerics.md §3). 2^x in double is within
   an ulp, and no fp32 x in [-25, 11.01] but -25 (a tie, to 0) has 2^x within 2^-39 of an fp16 midpoint, so this is
   the correctly rounded value (dev/p_fp16_numerics.py). */
static float p_frame_value(float x) { return round_double_to_fp16(exp2((double)x)); }

/* P̂_j for visible keys, 0 for hidden ones (they do not raise a block's amax either). fp16 (a mode that quantizes P,
   numerics.md §3): w_j = fp16(2^(t_j - (M - 11))) and P̂_j = w_j * 2^-11; else (plain attention) P̂_j = 2^(t_j - M) in
   fp32 and w is not written. */
static void frame_values(const float *t, const uint8_t *visible, const score_row *r, float frame, int fp16, float *w,
                         float *p_hat) {
    const float shifted = frame - AQ_P_HEADROOM_LOG2; /* exact: M is an integer below 2^24 (or -inf) */
    for (int64_t j = r->first; j < r->key_end; j++) {
        if (!fp16) {
            p_hat[j] = visible[j] ? exp2f(t[j] - frame) : 0.0f;
            continue;
        }
        w[j] = visible[j] ? p_frame_value(t[j] - shifted) : 0.0f; /* the argument rounded once to fp32 */
        p_hat[j] = w[j] * AQ_P_HEADROOM_INV;
    }
}

/* P^F for w from frame_values, blocks of 16 from `first` (the entries past `end` of the last block are hidden: 0,
   which raises no amax): p_fq = P's fp16 block rule on w, times 2^-11. */
static void quantize_frame_values(const float *w, int64_t first, int64_t end, float *p_fq) {
    for (int64_t j0 = first; j0 < end; j0 += AQ_BLOCK) {
        const int n = (int)(end - j0 < AQ_BLOCK ? end - j0 : AQ_BLOCK);
        float block[AQ_BLOCK];
        for (int e = 0; e < n; e++) block[e] = w[j0 + e];
        aq_p_fake_quantize_block_fp16(block, n);
        for (int e = 0; e < n; e++) p_fq[j0 + e] = block[e] * AQ_P_HEADROOM_INV;
    }
}

const char *aq_p_fp16_path_cpu(const float *x, int64_t rows, int64_t n, float *w, float *w_fq) {
    if (rows < 0 || n < 0) return "p_fp16_path: negative size";
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t j = 0; j < n; j++) w[i * n + j] = p_frame_value(x[i * n + j]);
        quantize_frame_values(w + i * n, 0, n, w_fq + i * n);
        for (int64_t j = 0; j < n; j++) w_fq[i * n + j] *= AQ_P_HEADROOM; /* P^F * 2^11: exact */
    }
    return NULL;
}

/* The forward of query head h of batch b, every row; returns 0, or 1 when out of memory. */
static int forward_item(const void *params, int64_t b, int64_t h) {
    const aq_attention_fwd_params *p = (const aq_attention_fwd_params *)params;
    const int64_t nk = p->seqlen_k, dim = p->head_dim, dim_v = p->head_dim_v, hkv = h / (p->heads_q / p->heads_kv);
    float *k_head = (float *)alloc_array(nk * dim, sizeof(float));
    float *v_head = (float *)alloc_array(nk * dim_v, sizeof(float));
    float *q_row = (float *)alloc_array(dim, sizeof(float));
    float *t = (float *)alloc_array(nk, sizeof(float));
    uint8_t *visible = (uint8_t *)alloc_array(nk, sizeof(uint8_t));
    float *w = (float *)alloc_array(nk, sizeof(float));
    float *p_hat = (float *)alloc_array(nk, sizeof(float));
    float *p_fq = (float *)alloc_array(nk, sizeof(float));
    double *o_acc = (double *)alloc_array(dim_v, sizeof(double));
    double *o_prime_acc = (double *)alloc_array(dim_v, sizeof(double));
    const int failed = !k_head || !v_head || !q_row || !t || !visible || !w || !p_hat || !p_fq || !o_acc ||
                       !o_prime_acc;
    if (!failed) {
        load_kv_head(p->k, p->dtype, p->k_stride, b, hkv, nk, dim, k_head);
        load_kv_head(p->v, p->dtype, p->v_stride, b, hkv, nk, dim_v, v_head);
    }
    for (int64_t i = 0; !failed && i < p->seqlen_q; i++) {
        const score_row r = score_row_at(k_head, p->mask, p->mask_stride, b, h, i, nk, dim, p->softmax_scale,
                                         p->causal, p->causal_offset, p->q_span);
        load_row(p->q, p->dtype, p->q_stride, b, h, i, dim, q_row);
        const int any_visible = compute_scores(&r, q_row, t, visible);
        const float frame = row_frame(t, visible, &r);
        frame_values(t, visible, &r, frame, p->quantize_p, w, p_hat);
        /* exact with fp16 P̂ (multiples of 2^-35 below 2, fewer than 2^17 keys), as the reference's */
        double row_sum = 0.0;
        for (int64_t j = r.first; j < r.key_end; j++) row_sum += p_hat[j];
        if (p->quantize_p) quantize_frame_values(w, r.first, r.key_end, p_fq);
        const float *weight = p->quantize_p ? p_fq : p_hat;

        for (int64_t d = 0; d < dim_v; d++) o_acc[d] = o_prime_acc[d] = 0.0;
        /* Hidden keys are skipped, so a NaN in a masked-out V row stays out of O. */
        for (int64_t j = r.first; j < r.key_end; j++) {
            if (!visible[j]) continue;
            const float *v = v_head + j * dim_v;
            const double w_j = weight[j], w_prime = p_hat[j];
            for (int64_t d = 0; d < dim_v; d++) o_acc[d] += w_j * v[d];
            if (p->o_prime)
                for (int64_t d = 0; d < dim_v; d++) o_prime_acc[d] += w_prime * v[d];
        }
        /* An empty row has l = 0 and all-zero accumulators: it writes O = O' = 0, not 0/0. */
        const double l = any_visible ? row_sum : 1.0;
        const int64_t o_base = b * p->o_stride[0] + h * p->o_stride[1] + i * p->o_stride[2];
        for (int64_t d = 0; d < dim_v; d++) store_half(p->o, p->dtype, o_base + d, (float)(o_acc[d] / l));
        if (p->o_prime) {
            const int64_t base = b * p->o_prime_stride[0] + h * p->o_prime_stride[1] + i * p->o_prime_stride[2];
            for (int64_t d = 0; d < dim_v; d++)
                store_half(p->o_prime, p->dtype, base + d, (float)(o_prime_acc[d] / l));
        }
        const int64_t stat = (b * p->heads_q + h) * p->seqlen_q + i;
        p->frame_m[stat] = frame;
        p->row_sum[stat] = (float)row_sum;
    }
    free(k_head);
    free(v_head);
    free(q_row);
    free(t);
    free(visible);
    free(w);
    free(p_hat);
    free(p_fq);
    free(o_acc);
    free(o_prime_acc);
    return failed;
}

/* Runs item(params, b, h) for every b < batch, h < heads (in parallel with OpenMP); returns "out of memory" if an
   item ran out, else NULL. */
typedef int (*work_item)(const void *params, int64_t b, int64_t h);

static const char *run_items(work_item item, const void *params, int64_t batch, int64_t heads) {
    const int64_t items = batch * heads;
    uint8_t *failed = (uint8_t *)calloc((size_t)(items > 0 ? items : 1), 1);
    if (!failed) return "out of memory";
    AQ_PARALLEL_FOR
    for (int64_t it = 0; it < items; it++) failed[it] = (uint8_t)item(params, it / heads, it % heads);
    const char *err = NULL;
    for (int64_t it = 0; it < items; it++)
        if (failed[it]) err = "out of memory";
    free(failed);
    return err;
}

const char *aq_attention_fwd_cpu(const aq_attention_fwd_params *p) {
    const char *err = aq_attention_sizes_problem(p->dtype, p->head_dim, p->head_dim_v, p->batch, p->heads_q,
                                                 p->heads_kv, p->seqlen_q, p->seqlen_k);
    return err ? err : run_items(forward_item, p, p->batch, p->heads_q);
}

/* delta_i = dO_i . out_for_delta_i (O' in attn_qat mode, so that each row of dS sums to zero), for query head h of
   batch b. */
static int delta_item(const void *params, int64_t b, int64_t h) {
    const aq_attention_bwd_params *p = (const aq_attention_bwd_params *)params;
    for (int64_t i = 0; i < p->seqlen_q; i++) {
        const int64_t dout_base = b * p->dout_stride[0] + h * p->dout_stride[1] + i * p->dout_stride[2];
        const int64_t out_base = b * p->out_for_delta_stride[0] + h * p->out_for_delta_stride[1] +
                                 i * p->out_for_delta_stride[2];
        double delta = 0.0;
        for (int64_t d = 0; d < p->head_dim_v; d++)
            delta += (double)load_half(p->dout, p->dtype, dout_base + d) *
                     load_half(p->out_for_delta, p->dtype, out_base + d);
        p->delta[(b * p->heads_q + h) * p->seqlen_q + i] = (float)delta;
    }
    return 0;
}

/* The backward of KV head hkv of batch b: dQ of its query heads, and dK, dV summed over them in head, then row
   order. Returns 0, or 1 when out of memory. */
static int backward_item(const void *params, int64_t b, int64_t hkv) {
    const aq_attention_bwd_params *p = (const aq_attention_bwd_params *)params;
    const int64_t nk = p->seqlen_k, dim = p->head_dim, dim_v = p->head_dim_v, group = p->heads_q / p->heads_kv;
    const double scale = p->softmax_scale;
    float *k_head = (float *)alloc_array(nk * dim, sizeof(float));
    float *v_head = (float *)alloc_array(nk * dim_v, sizeof(float));
    double *dk_acc = (double *)alloc_array(nk * dim, sizeof(double));
    double *dv_acc = (double *)alloc_array(nk * dim_v, sizeof(double));
    float *q_row = (float *)alloc_array(dim, sizeof(float));
    float *dout_row = (float *)alloc_array(dim_v, sizeof(float));
    double *dq_acc = (double *)alloc_array(dim, sizeof(double));
    float *t = (float *)alloc_array(nk, sizeof(float));
    uint8_t *visible = (uint8_t *)alloc_array(nk, sizeof(uint8_t));
    float *w = (float *)alloc_array(nk, sizeof(float));
    float *p_hat = (float *)alloc_array(nk, sizeof(float));
    float *p_fq = (float *)alloc_array(nk, sizeof(float));
    const int failed = !k_head || !v_head || !dk_acc || !dv_acc || !q_row || !dout_row || !dq_acc || !t ||
                       !visible || !w || !p_hat || !p_fq;
    if (!failed) {
        load_kv_head(p->k, p->dtype, p->k_stride, b, hkv, nk, dim, k_head);
        load_kv_head(p->v, p->dtype, p->v_stride, b, hkv, nk, dim_v, v_head);
        for (int64_t e = 0; e < nk * dim; e++) dk_acc[e] = 0.0;
        for (int64_t e = 0; e < nk * dim_v; e++) dv_acc[e] = 0.0;
    }
    for (int64_t h = hkv * group; !failed && h < (hkv + 1) * group; h++) {
        for (int64_t i = 0; i < p->seqlen_q; i++) {
            const int64_t stat = (b * p->heads_q + h) * p->seqlen_q + i;
            const float frame = p->frame_m[stat], row_sum = p->row_sum[stat], delta = p->delta[stat];
            for (int64_t d = 0; d < dim; d++) dq_acc[d] = 0.0;
            if (row_sum != 0.0f) {
                const score_row r = score_row_at(k_head, p->mask, p->mask_stride, b, h, i, nk, dim,
                                                 p->softmax_scale, p->causal, p->causal_offset, p->q_span);
                load_row(p->q, p->dtype, p->q_stride, b, h, i, dim, q_row);
                load_row(p->dout, p->dtype, p->dout_stride, b, h, i, dim_v, dout_row);
                compute_scores(&r, q_row, t, visible);
                frame_values(t, visible, &r, frame, p->p_fp16 || p->quantize_p_for_dv, w, p_hat);
                if (p->quantize_p_for_dv) quantize_frame_values(w, r.first, r.key_end, p_fq);
                for (int64_t j = r.first; j < r.key_end; j++) {
                    if (!visible[j]) continue;
                    const float prob = p_hat[j] / row_sum;
                    const double dv_weight = p->quantize_p_for_dv ? p_fq[j] / row_sum : prob;
                    const float *k = k_head + j * dim, *v = v_head + j * dim_v;
                    double dprob = 0.0;
                    for (int64_t d = 0; d < dim_v; d++) dprob += (double)dout_row[d] * v[d];
                    const double dscore = prob * (dprob - delta);
                    double *dk = dk_acc + j * dim, *dv = dv_acc + j * dim_v;
                    for (int64_t d = 0; d < dim; d++) {
                        dq_acc[d] += dscore * k[d];
                        dk[d] += dscore * q_row[d];
                    }
                    for (int64_t d = 0; d < dim_v; d++) dv[d] += dv_weight * dout_row[d];
                }
            }
            const int64_t dq_base = b * p->dq_stride[0] + h * p->dq_stride[1] + i * p->dq_stride[2];
            for (int64_t d = 0; d < dim; d++) store_half(p->dq, p->dtype, dq_base + d, (float)(scale * dq_acc[d]));
        }
    }
    for (int64_t j = 0; !failed && j < nk; j++) {
        const int64_t dk_base = b * p->dk_stride[0] + hkv * p->dk_stride[1] + j * p->dk_stride[2];
        const int64_t dv_base = b * p->dv_stride[0] + hkv * p->dv_stride[1] + j * p->dv_stride[2];
        for (int64_t d = 0; d < dim; d++)
            store_half(p->dk, p->dtype, dk_base + d, (float)(scale * dk_acc[j * dim + d]));
        for (int64_t d = 0; d < dim_v; d++) store_half(p->dv, p->dtype, dv_base + d, (float)dv_acc[j * dim_v + d]);
    }
    free(k_head);
    free(v_head);
    free(dk_acc);
    free(dv_acc);
    free(q_row);
    free(dout_row);
    free(dq_acc);
    free(t);
    free(visible);
    free(w);
    free(p_hat);
    free(p_fq);
    return failed;
}

const char *aq_attention_bwd_cpu(const aq_attention_bwd_params *p) {
    const char *err = aq_attention_sizes_problem(p->dtype, p->head_dim, p->head_dim_v, p->batch, p->heads_q,
                                                 p->heads_kv, p->seqlen_q, p->seqlen_k);
    if (!err) err = run_items(delta_item, p, p->batch, p->heads_q);
    return err ? err : run_items(backward_item, p, p->batch, p->heads_kv);
}
