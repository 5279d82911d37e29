/* attn_qat kernel interface (as FlashAttention-3's flash.h): the parameter structs and launchers that binding/ calls.
   Plain C, so the CPU kernels (C), the CUDA kernels (CUDA C) and the op glue (C++) share one definition.
   Every launcher returns NULL on success, else a static message saying what went wrong. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { AQ_FLOAT32 = 0, AQ_BFLOAT16 = 1, AQ_FLOAT16 = 2 } aq_dtype;

/* log2(e) as a float: the kernels compute exponents as 2^(scores * softmax_scale * AQ_LOG2E) */
#define AQ_LOG2E 1.4426950408889634f

/* The head dims the attention kernels take: any multiple of 16 (one NVFP4 block along D) from 32 to 256, for Q and K
   (head_dim) and for V (head_dim_v, which may differ, as DeepSeek's 192 / 128). The ops check their inputs against
   these, and attn_qat/attention.py's SUPPORTED_HEAD_DIMS reads them through the module. The kernels are built for a
   few tile widths and zero-fill the columns past the call's head dims (attention/launch.h); the Hopper kernels take
   only the head dims of aq_sm90_head_dims. The decode kernel takes 64 or 128 (aq_decode_head_dim_supported). */
#define AQ_HEAD_DIM_MIN 32
#define AQ_HEAD_DIM_MAX 256
#define AQ_HEAD_DIM_STEP 16
#define AQ_HEAD_DIMS_TEXT "a multiple of 16 from 32 to 256"
static inline int aq_head_dim_supported(int64_t head_dim) {
    return head_dim >= AQ_HEAD_DIM_MIN && head_dim <= AQ_HEAD_DIM_MAX && head_dim % AQ_HEAD_DIM_STEP == 0;
}
/* The Hopper (wgmma, TMA) kernels: equal head dims of Q/K and V, 64 or 128; the mma.sync kernels take the others. */
static inline int aq_sm90_head_dims(int64_t head_dim, int64_t head_dim_v) {
    return head_dim == head_dim_v && (head_dim == 64 || head_dim == 128);
}
/* The Hopper forward also takes 256 where it keeps no second accumulator for O' (the inference forward; training
   forwards that make no O', and mode "bf16", whose O' is O) and the kernel options allow it (sm90_d256): O alone then
   fills 128 registers a thread, so forwards with O and O' and the backward keep the mma.sync kernels at 256. */
static inline int aq_sm90_forward_head_dims(int64_t head_dim, int64_t head_dim_v, int with_o_prime, int d256) {
    return aq_sm90_head_dims(head_dim, head_dim_v) || (d256 && !with_o_prime && head_dim == 256 && head_dim_v == 256);
}
#define AQ_DECODE_HEAD_DIMS_TEXT "64 or 128"
static inline int aq_decode_head_dim_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
static inline int aq_attention_dtype_supported(aq_dtype dtype) { return dtype == AQ_BFLOAT16 || dtype == AQ_FLOAT16; }

/* The sizes every attention kernel takes, CPU or CUDA (the CUDA grids add their own bounds, attention/dispatch.cu):
   NULL, or what is wrong. The binding checks the tensors themselves (shapes agree, devices, strides). */
static inline const char *aq_attention_sizes_problem(aq_dtype dtype, int64_t head_dim, int64_t head_dim_v,
                                                     int64_t batch, int64_t heads_q, int64_t heads_kv,
                                                     int64_t seqlen_q, int64_t seqlen_k) {
    if (!aq_attention_dtype_supported(dtype)) return "attention takes bfloat16 or float16 tensors";
    if (!aq_head_dim_supported(head_dim) || !aq_head_dim_supported(head_dim_v))
        return "attention takes head dims (of Q and K, and of V) that are " AQ_HEAD_DIMS_TEXT;
    if (heads_kv <= 0 || heads_q <= 0 || heads_q % heads_kv != 0)
        return "attention takes query heads that are a positive multiple of the key/value heads";
    if (batch < 0 || seqlen_q < 0 || seqlen_k < 0) return "attention takes sizes >= 0";
    return NULL;
}

/* The modes of numerics.md §5 by code (the ops' `mode` argument), and what each one's forward and backward do:
   the binding acts on these flags, and attn_qat/ops.py reads the table through the module (MODES, MODE_FLAGS). */
typedef enum {
    AQ_MODE_ATTN_QAT = 0, AQ_MODE_HIGH_PRECISION_P, AQ_MODE_LOW_PRECISION_O, AQ_MODE_DROP_IN, AQ_MODE_BF16, AQ_MODES
} aq_mode;
enum {
    AQ_QUANTIZES = 1,             /* the forward fake-quantizes Q, K, V (the pre-pass, numerics.md §2) and P */
    AQ_BACKWARD_THROUGH_FQ = 2,   /* the backward differentiates through Q^F, K^F, V^F, its P̂ the fp16 one (§3) */
    AQ_DELTA_FROM_O_PRIME = 4,    /* the backward takes delta from O' = P̂ V, so a training forward returns O' */
    AQ_DV_FROM_P_FQ = 8,          /* dV sums P^F dO, else P dO */
    AQ_BACKWARD_REDOES_STATS = 16 /* the backward reruns an unquantized forward for the frame and sums it needs */
};
typedef struct {
    const char *name;
    unsigned flags;
} aq_mode_info;
/* NULL for a code that is no mode. */
static inline const aq_mode_info *aq_mode_of(int64_t code) {
    static const aq_mode_info modes[AQ_MODES] = {
        {"attn_qat", AQ_QUANTIZES | AQ_BACKWARD_THROUGH_FQ | AQ_DELTA_FROM_O_PRIME | AQ_DV_FROM_P_FQ},
        {"high_precision_p", AQ_QUANTIZES | AQ_BACKWARD_THROUGH_FQ | AQ_DELTA_FROM_O_PRIME},
        {"low_precision_o", AQ_QUANTIZES | AQ_BACKWARD_THROUGH_FQ | AQ_DV_FROM_P_FQ},
        {"drop_in", AQ_QUANTIZES | AQ_BACKWARD_REDOES_STATS},
        {"bf16", 0},
    };
    return code >= 0 && code < AQ_MODES ? &modes[code] : NULL;
}

/* The causal codes (the ops' `causal` argument; numerics.md §6): none, top-left (SDPA's), bottom-right
   (FlashAttention's, aq_attention_fwd_params' causal_offset = Nk - Nq). */
typedef enum { AQ_CAUSAL_NONE = 0, AQ_CAUSAL_TOP_LEFT, AQ_CAUSAL_BOTTOM_RIGHT } aq_causal;

/* A (B, H, N, D) tensor is token-major when its memory is (B, N, H, D), as diffusers' and transformers' q/k/v
   projections make it; the ops' new tensors take the layout of the one they mirror. The rule is written for any
   number type, given its comparisons: binding/module.c applies it to Python's numbers for attn_qat/ops.py's fake
   kernels, so that torch.compile's symbolic sizes stay symbolic. */
#define AQ_TOKEN_MAJOR_RULE(greater, less, heads, tokens, head_stride, token_stride) \
    (greater(heads, 1) && greater(tokens, 1) && less(head_stride, token_stride))
#define AQ_GREATER(a, b) ((a) > (b))
#define AQ_LESS(a, b) ((a) < (b))
static inline int aq_token_major(int64_t heads, int64_t tokens, int64_t head_stride, int64_t token_stride) {
    return AQ_TOKEN_MAJOR_RULE(AQ_GREATER, AQ_LESS, heads, tokens, head_stride, token_stride);
}

/* ---------------------------------------------------------------------------------------------
   NVFP4 quantization of a tensor viewed as (outer[0], outer[1], outer[2], axis_len, inner), blocked
   along axis_len; outer = outer[0] * outer[1] * outer[2] below. Strides are in elements and may be
   anything (0 too). Each output is optional (NULL: skip it):
     codes  (outer, ceil(axis_len / 2), inner) uint8, contiguous: element 2k in the low nibble
     scales (outer, ceil(axis_len / 16), inner) E4M3 bytes, contiguous
     fake   (outer, axis_len, inner) in x's dtype, contiguous: the dequantized values
   A trailing partial block (axis_len % 16 != 0) holds only the valid elements. */
typedef struct {
    const void *x;
    aq_dtype dtype;
    int64_t outer[3], axis_len, inner;
    int64_t stride_outer[3], stride_axis, stride_inner;
    uint8_t *codes;
    uint8_t *scales;
    void *fake;
} aq_quantize_params;

/* Dequantize codes + scales laid out as above into out (outer, axis_len, inner) contiguous. */
typedef struct {
    const uint8_t *codes;
    const uint8_t *scales;
    int64_t outer, axis_len, inner;
    void *out;
    aq_dtype dtype;
} aq_dequantize_params;

/* ---------------------------------------------------------------------------------------------
   Attention (numerics.md §3, §4). Logical shapes: q (B, Hq, Nq, D); k (B, Hkv, Nk, D); v (B, Hkv, Nk, Dv);
   o, o_prime (B, Hq, Nq, Dv), with D = head_dim and Dv = head_dim_v;
   any strides in elements for batch, head and token ([0], [1], [2]); the head-dim stride is 1. (The Hopper kernels
   take those TMA can address: 16-byte aligned, strides multiples of 8 elements, outputs included; others run on the
   mma.sync kernels.)
   Query head h reads kv head h / (Hq / Hkv). The kernels see operands already fake-quantized by the
   pre-pass (or raw ones for bf16 / drop-in) and quantize only P.
   Key j is visible to query i iff (!causal || j <= i + causal_offset) and mask[b,h,i,j] != -inf; or, for packed
   sequences (q_span set), iff q_span[2i] <= j < q_span[2i+1].
   Packed sequences (attn_qat/varlen.py builds the spans; batch 1, no mask, causal 0): q_span (Nq, 2) int32 holds
   the keys [lo, hi) each query sees and k_span (Nk, 2) the queries [lo, hi) that see each key, the same relation
   from both sides (a row that sees nothing has lo == hi). Both columns of both are non-decreasing along the tokens,
   so the keys a run of queries sees lie in [q_span[first].lo, q_span[last].hi) and the kernels visit only those
   tiles (and in the backward a key tile only the queries of [k_span[first].lo, k_span[last].hi)). Values outside
   [0, Nk] (resp. [0, Nq]) are clamped: nothing outside the tensors is read whatever the spans say.
   work_order (optional, packed only): the Hopper kernels' work items (item = head * tiles + tile, the index order
   they run in without it) in the order to hand them out, a permutation of [0, items): attn_qat/varlen.py sorts them
   longest first so that a short item, not a head's long one, ends the grid. The launcher takes it only when its
   length is the kernel's item count (else an error); the sm80 and CPU kernels ignore it. Each item's outputs are
   computed alike in any order, and the split last wave keeps the items it takes in index order (the largest).
   mask (optional): additive fp32, strides for (b, h, i, j), 0 where broadcast; added to the scaled
   score before the log2(e) factor: t_ij = (q_i . k_j * scale + mask_ij) * log2(e).
   Row statistics, (B, Hq, Nq) contiguous fp32: frame_m = M_i = ceil(max_j t_ij), an integer, and
   row_sum = l_i = sum_j P̂_ij. With quantize_p, P̂_ij = fp16(2^fp32(t_ij - (M_i - 11))) * 2^-11 (numerics.md §3: P's
   fp16 path); without it P̂_ij = 2^(t_ij - M_i). A row with no visible key has M = -inf, l = 0 and O = 0.
   NaN in a row's scores makes its l and O NaN (never a finite value, never "empty"). */
typedef struct {
    const void *q, *k, *v;
    int64_t q_stride[3], k_stride[3], v_stride[3];
    const float *mask;
    int64_t mask_stride[4];
    void *o;                 /* O = sum_j P^F_ij v_j / l_i (or P̂ when !quantize_p) */
    int64_t o_stride[3];
    void *o_prime;           /* O' = sum_j P̂_ij v_j / l_i, or NULL when not needed */
    int64_t o_prime_stride[3];
    float *frame_m, *row_sum;
    int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
    float softmax_scale;
    int causal;
    int64_t causal_offset;
    int quantize_p;          /* 1: P̂ is fp16 and O uses P^F (§3's fp16 path), blocks of 16 keys from key 0 */
    aq_dtype dtype;          /* of q, k, v, o, o_prime: AQ_BFLOAT16 or AQ_FLOAT16 */
    const int32_t *q_span, *k_span; /* NULL, or packed sequences (above) */
    const int32_t *work_order; /* CUDA, packed only: NULL, or the Hopper grid's items in the order to run them */
    int64_t work_order_len;  /* (attn_qat/varlen.py's LPT table, a permutation of the item indices; see below) */
    int *scratch;            /* CUDA: one device int the launcher may use, or NULL (attention_fwd_sm90.cu) */
    float *tail_workspace;   /* CUDA: NULL, or the plan's tail_floats floats (the split last wave's parts) */
    int64_t head_dim_v;      /* of v, o and o_prime (head_dim: of q and k) */
} aq_attention_fwd_params;

/* Backward (straight-through, numerics.md §4), given the forward's frame_m / row_sum:
     P_ij = P̂_ij / l_i;  P^F_ij = (P's fp16 block rule on P̂_ij * 2^11) * 2^-11 / l_i, P̂ as the forward's (above:
     fp16 when p_fp16 or quantize_p_for_dv, the forward having quantized P)
     dV_j = sum_i (quantize_p_for_dv ? P^F_ij : P_ij) dO_i      (summed over the query heads of kv head)
     dP_ij = dO_i . v_j;  delta_i = dO_i . out_for_delta_i;  dS_ij = P_ij (dP_ij - delta_i)
     dQ_i = scale sum_j dS_ij k_j;  dK_j = scale sum_i dS_ij q_i   (dK summed over the group too)
   Rows with row_sum == 0 (no visible key) contribute nothing. dq (B, Hq, Nq, D), dk (B, Hkv, Nk, D) and
   dv (B, Hkv, Nk, Dv) are written (not accumulated) in dtype, with the given strides. delta is (B, Hq, Nq) fp32 scratch
   that the launcher fills. With dq_accum NULL the result is deterministic, bit-identical run to run; with
   dq_accum (the plan's dq_accum_floats of fp32 scratch) the Hopper kernels add the dQ of each key tile into
   it in whatever order the tiles finish (5 products instead of 7, FlashAttention-3's way), so dQ may differ
   in its last bits between runs; dK and dV stay deterministic. */
typedef struct {
    const void *q, *k, *v, *dout, *out_for_delta;
    int64_t q_stride[3], k_stride[3], v_stride[3], dout_stride[3], out_for_delta_stride[3];
    const float *mask;
    int64_t mask_stride[4];
    const float *frame_m, *row_sum;
    float *delta;
    void *dq, *dk, *dv;
    int64_t dq_stride[3], dk_stride[3], dv_stride[3];
    int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
    float softmax_scale;
    int causal;
    int64_t causal_offset;
    int quantize_p_for_dv;
    aq_dtype dtype;
    const int32_t *q_span, *k_span; /* NULL, or packed sequences (as in aq_attention_fwd_params) */
    const int32_t *work_order; /* CUDA, packed only: NULL, or the dK/dV kernel's key-tile items in run order */
    int64_t work_order_len;
    int *scratch;            /* CUDA: one device int the launcher may use, or NULL (attention_bwd_sm90.cu) */
    float *dq_accum;         /* CUDA: NULL, or the plan's dq_accum_floats floats (see above) */
    float *tail_workspace;   /* CUDA: NULL, or the plan's tail_floats floats (the split last wave's parts) */
    int sm_count;            /* CUDA: set by aq_attention_bwd_cuda (the causal order of work, work_item_at) */
    int p_fp16;              /* 1: P̂ is §3's fp16 value (the forward quantized P: attn_qat, high_precision_p,
                                low_precision_o); 0: 2^(t - M) (drop_in's and bf16's plain backward). In
                                sm_count's padding: the kernels' parameter offsets before it stay as they were. */
    int64_t head_dim_v;      /* of v, dv, dout and out_for_delta (head_dim: of q, k, dq, dk) */
} aq_attention_bwd_params;

/* CPU kernels (C) */
const char *aq_quantize_cpu(const aq_quantize_params *p);
const char *aq_dequantize_cpu(const aq_dequantize_params *p);
const char *aq_attention_fwd_cpu(const aq_attention_fwd_params *p);
const char *aq_attention_bwd_cpu(const aq_attention_bwd_params *p);
/* P's fp16 path (numerics.md §3) on rows x (rows, n) of fp32 exponent arguments x = t - (M - 11) (-inf for a hidden
   key), blocks of 16 from each row's index 0: w = fp16(2^x) = P̂ * 2^11 and w_fq = P^F * 2^11, (rows, n) each. The
   attention kernels' own P path, for tests against attn_qat.reference. */
const char *aq_p_fp16_path_cpu(const float *x, int64_t rows, int64_t n, float *w, float *w_fq);

/* CUDA kernels; stream is a cudaStream_t */
const char *aq_quantize_cuda(const aq_quantize_params *p, void *stream);
const char *aq_dequantize_cuda(const aq_dequantize_params *p, void *stream);

/* The CUDA kernels' options, one set per process (README, "Kernel options"): read from ATTN_QAT_SM90,
   ATTN_QAT_TAIL_SPLIT, ATTN_QAT_DECODE_VARIANT, ATTN_QAT_DECODE_CHUNK, ATTN_QAT_WORK_ORDER, ATTN_QAT_PAD_HEAD_DIMS
   and ATTN_QAT_SM90_D256 when the library loads (binding/kernel_options.cpp), set at run time by
   attn_qat.ops.kernel_options; a call is planned with the set in force when it starts. */
typedef enum { AQ_TAIL_SPLIT_AUTO = 0, AQ_TAIL_SPLIT_OFF = 1, AQ_TAIL_SPLIT_FORCED = 2 } aq_tail_split_mode;
typedef struct {
    int sm90;                       /* 0: the mma.sync kernels, even where the Hopper ones could run */
    aq_tail_split_mode tail_split;  /* AUTO: the plan splits a short last wave; OFF: never; FORCED (tests): */
    int64_t forced_tail, forced_splits; /* the last forced_tail items in forced_splits parts, at most one a unit */
    int decode_variant;             /* the decode kernel's FLAGS (decode_cuda.cu), or -1 for the default */
    int64_t decode_chunk;           /* keys a decode CTA takes (a multiple of 64 up to 4096), or 0: planned */
    int index_order;                /* 1: packed calls' work_order tables are ignored (index order; A/B runs) */
    int pad_head_dims;              /* -1: the ops zero-pad head dims up to 128 that the Hopper kernels do not take
                                       to 64 or 128 where those run (aq_attention_sm90_runs), and with sm90_d256 a
                                       forward without O' above 128 to 256; 1: always, on the CPU too (tests);
                                       0: never */
    int sm90_d256;                  /* 1: the Hopper forward without O' takes D = Dv = 256 (aq_sm90_forward_head_dims);
                                       0 (the default) until it has run against the reference on a GPU */
} aq_kernel_options;

/* What the decode options may pick: a variant below AQ_DECODE_VARIANTS (decode_cuda.cu's FLAGS), and chunks of a
   multiple of AQ_DECODE_CHUNK_STEP keys up to AQ_DECODE_CHUNK_MAX. */
#define AQ_DECODE_VARIANTS 4
#define AQ_DECODE_CHUNK_STEP 64
#define AQ_DECODE_CHUNK_MAX 4096
static inline int aq_decode_chunk_valid(int64_t keys) {
    return keys > 0 && keys % AQ_DECODE_CHUNK_STEP == 0 && keys <= AQ_DECODE_CHUNK_MAX;
}

aq_kernel_options aq_get_kernel_options(void);
void aq_set_kernel_options(const aq_kernel_options *o);

/* CUDA attention runs in two steps (attention/dispatch.cu). aq_attention_*_plan_cuda checks the sizes and decides once,
   for the current device, these sizes and the options, which kernels run and how, and what fp32 workspace that
   takes; the caller allocates the workspace, sets it in the params and launches with the same plan. */
typedef struct {
    int sm_count;            /* of the current device */
    int sm90;                /* the Hopper kernels take the call (the mma.sync ones run where they decline it) */
    int main_items, tail_items, tail_splits; /* the Hopper grid's last tail_items items run in tail_splits parts */
    int64_t tail_floats;     /* for tail_workspace; 0: no split */
    int64_t dq_accum_floats; /* backward: for dq_accum (the fused dQ, not deterministic); 0: none */
    int use_work_order;      /* the Hopper launchers follow the params' work_order (not kernel_options' index_order) */
} aq_attention_plan;

/* Whether the Hopper kernels may run on the current device under these options (an sm_90 device, this build's sm_90a
   code, the options' sm90), for head dims they take (aq_sm90_head_dims). */
int aq_attention_sm90_runs(const aq_kernel_options *o);
const char *aq_attention_fwd_plan_cuda(const aq_attention_fwd_params *p, const aq_kernel_options *o,
                                       aq_attention_plan *plan);
const char *aq_attention_bwd_plan_cuda(const aq_attention_bwd_params *p, const aq_kernel_options *o,
                                       aq_attention_plan *plan);
const char *aq_attention_fwd_cuda(const aq_attention_fwd_params *p, const aq_attention_plan *plan, void *stream);
const char *aq_attention_bwd_cuda(const aq_attention_bwd_params *p, const aq_attention_plan *plan, void *stream);
/* aq_p_fp16_path_cpu on the GPU (x, w, w_fq device pointers): the CUDA kernels' device functions for P's path. */
const char *aq_p_fp16_path_cuda(const float *x, int64_t rows, int64_t n, float *w, float *w_fq, void *stream);

/* ---------------------------------------------------------------------------------------------
   Decode on an NVFP4 KV cache (attn_qat/kv_cache.py): numerics.md §3 without O' on Q^F, K^F and V^F, K and V
   both blocked along D (numerics.md §2: a decoding query does not see every key).
   Sequence b holds L_b = lengths[b] tokens (0 <= L_b <= max_length <= capacity = pages_per_seq * page_size) in
   pages of page_size tokens (a multiple of 16) from pools of num_pages pages:
     k_codes  (num_pages, Hkv, page_size, D/2)   K: codes of channels 2i (low nibble), 2i+1 (high) of each token
     k_scales (num_pages, Hkv, page_size, D/16)  their E4M3 bytes
     v_codes  (num_pages, Hkv, page_size/2, D)   V, the same codes per token, tokens 2p and 2p+1 interleaved by
                                                 16-bit halves: row p holds half 0 of token 2p, half 0 of 2p+1, half 1
                                                 of 2p, ... (one 32-bit word: 4 channels of both tokens)
     v_scales (num_pages, Hkv, page_size/16, D)  per 16-token unit, D/16 rows (the 16-channel blocks) of 16 bytes,
                                                 the unit's tokens in the order 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, ...
     block_table (B, pages_per_seq) int32        token j of sequence b is token j % page_size of page
                                                 block_table[b][j / page_size]; entries past L_b are not read
   An unpaged cache is the case num_pages = B, page_size = capacity, block_table[b] = {b}. A block-table entry
   outside [0, num_pages) that the kernel meets makes the rows of that sequence NaN; nothing outside the pools is
   read. q (B, Hq, Tq, D) contiguous holds the raw queries (the kernel makes Q^F, blocked along D, itself); query
   t of sequence b is token L_b - Tq + t and sees keys j < L_b with, when causal, j <= L_b - Tq + t. A row with no
   visible key gives O = 0.
   out (B, Hq, Tq, D) contiguous in dtype. The CUDA kernel splits the keys into chunks of `chunk` tokens and
   merges the chunks' partial results through `workspace` (aq_kv_cache_decode_plan_cuda sizes both); the merge's
   counters are the launcher's own, one set a (device, stream) (decode_cuda.cu, decode_counters), so calls that
   may run at the same time must be on different streams. */
typedef struct {
    const void *q;
    const uint8_t *k_codes, *k_scales, *v_codes, *v_scales;
    const int32_t *block_table;
    const int64_t *lengths;
    void *out;
    float *workspace;
    int64_t batch, heads_q, heads_kv, seqlen_q, head_dim, max_length;
    int64_t num_pages, page_size, pages_per_seq;
    float softmax_scale;
    int causal;
    aq_dtype dtype;
    int64_t chunk, num_splits; /* set by aq_kv_cache_decode_plan_cuda */
    int programmatic_launch;    /* likewise: sm_90+ overlaps the two kernels' launches */
    int variant;                /* likewise: kv_decode_kernel's FLAGS (decode_cuda.cu) */
} aq_decode_params;

/* Checks the sizes, picks chunk and num_splits for the current device and sets *workspace_floats. */
const char *aq_kv_cache_decode_plan_cuda(aq_decode_params *p, const aq_kernel_options *o, int64_t *workspace_floats);
const char *aq_kv_cache_decode_cuda(const aq_decode_params *p, void *stream);

#ifdef __cplusplus
}
#endif
