// The attention ops: the forward and backward of numerics.md §3-§5 in each mode, the forward on operands the caller
// has quantized, and P's fp16 path on its own (for tests).
#include <algorithm>

#include "binding/ops.h"

namespace aq_ops {
namespace {

// n floats of fp32 workspace on q's device in *ptr (none for n = 0); the tensor must outlive the launch.
Tensor fp32_workspace(const Tensor &q, int64_t n, float **ptr) {
    Tensor workspace;
    if (n > 0) {
        workspace = torch::stable::new_empty(q, {n}, ScalarType::Float);
        *ptr = static_cast<float *>(workspace.data_ptr());
    }
    return workspace;
}

// A CUDA attention call (attn_qat.h): the plan, once, for the kernel options in force, then the workspaces it names,
// then the launch on that plan.
// dq_accum: where the caller takes the fused dQ (not deterministic), else NULL.
template <typename Params>
const char *plan_and_launch(const Tensor &q, Params *p,
                            const char *(*plan_cuda)(const Params *, const aq_kernel_options *, aq_attention_plan *),
                            const char *(*cuda)(const Params *, const aq_attention_plan *, void *), void *stream,
                            float **dq_accum = nullptr) {
    const aq_kernel_options options = aq_get_kernel_options();
    aq_attention_plan plan;
    const char *err = plan_cuda(p, &options, &plan);
    if (err) return err;
    const Tensor tail = fp32_workspace(q, plan.tail_floats, &p->tail_workspace);
    const Tensor fused_dq = dq_accum ? fp32_workspace(q, plan.dq_accum_floats, dq_accum) : Tensor();
    return cuda(p, &plan, stream);
}

void copy_strides(const Tensor &t, int64_t out[3]) {
    for (int i = 0; i < 3; i++) out[i] = t.stride(i);
}

struct AttentionShape {
    int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v;
};

// What the kernels need of q, k, v to read and write only their own memory: the tensors agree with each other (the
// Python entry points state the user-facing rules, attn_qat/attention.py's input_problem), then the sizes every
// kernel takes (attn_qat.h). Non-empty: the Python entry points answer empty calls themselves.
AttentionShape check_attention_inputs(const Tensor &q, const Tensor &k, const Tensor &v) {
    STD_TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attn_qat: query, key and value must be 4-D (batch, heads, tokens, head_dim)");
    const aq_dtype dt = kernel_dtype(q);
    STD_TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "attn_qat: query, key and value must have the same dtype");
    STD_TORCH_CHECK(same_device(k, q) && same_device(v, q),
                    "attn_qat: query, key and value must be on the same device");
    AttentionShape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
    STD_TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch && v.size(1) == s.heads_kv &&
                        v.size(2) == s.seqlen_k && k.size(3) == s.head_dim,
                    "attn_qat: query, key and value must agree in batch, query and key in head_dim, key and value in "
                    "heads and tokens");
    STD_TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
                    "attn_qat: the last dimension (head_dim) of query, key and value must be contiguous");
    STD_TORCH_CHECK(s.seqlen_q > 0 && s.seqlen_k > 0 && s.batch > 0, "attn_qat: empty query or key sequence");
    const char *problem = aq_attention_sizes_problem(dt, s.head_dim, s.head_dim_v, s.batch, s.heads_q, s.heads_kv,
                                                     s.seqlen_q, s.seqlen_k);
    STD_TORCH_CHECK(problem == nullptr, "attn_qat: ", problem ? problem : "", " (got ", q.scalar_type(),
                    " query (", s.batch, ", ", s.heads_q, ", ", s.seqlen_q, ", ", s.head_dim, "), ", s.heads_kv,
                    " key/value heads, value head_dim ", s.head_dim_v, ")");
    return s;
}

// The mask arrives from Python as fp32 of shape (B, Hq, Nq, Nk), broadcast dims with stride 0.
void set_mask(const std::optional<Tensor> &mask, const AttentionShape &s, const Tensor &q, const float **ptr,
              int64_t strides[4]) {
    *ptr = nullptr;
    for (int i = 0; i < 4; i++) strides[i] = 0;
    if (!mask.has_value()) return;
    const Tensor &m = *mask;
    STD_TORCH_CHECK(m.scalar_type() == ScalarType::Float, "attn_qat: the kernel mask must be additive float32");
    STD_TORCH_CHECK(m.dim() == 4 && m.size(0) == s.batch && m.size(1) == s.heads_q && m.size(2) == s.seqlen_q &&
                        m.size(3) == s.seqlen_k,
                    "attn_qat: the kernel mask must be expanded to (batch, heads, query tokens, key tokens)");
    STD_TORCH_CHECK(same_device(m, q),
                    "attn_qat: attn_mask must be on the device of the query");
    *ptr = static_cast<const float *>(m.data_ptr());
    for (int i = 0; i < 4; i++) strides[i] = m.stride(i);
}

void set_causal(int64_t causal, const AttentionShape &s, int *flag, int64_t *offset) {
    STD_TORCH_CHECK(causal >= AQ_CAUSAL_NONE && causal <= AQ_CAUSAL_BOTTOM_RIGHT, "attn_qat: bad causal code ",
                    causal);
    if (flag) *flag = causal != AQ_CAUSAL_NONE;
    if (offset) *offset = causal == AQ_CAUSAL_BOTTOM_RIGHT ? s.seqlen_k - s.seqlen_q : 0;
}

// Packed sequences (attn_qat/varlen.py): the spans of keys each query sees and of queries that see each key, int32
// (Nq, 2) and (Nk, 2) contiguous on the query's device (attn_qat.h). They carry the causal rule and the sequence
// boundaries themselves, so they come with batch 1, no mask and causal none.
struct Spans {
    const int32_t *q = nullptr, *k = nullptr;
};

Spans check_spans(const std::optional<Tensor> &q_span, const std::optional<Tensor> &k_span, const AttentionShape &s,
                  const Tensor &q, bool has_mask, int64_t causal) {
    Spans spans;
    STD_TORCH_CHECK(q_span.has_value() == k_span.has_value(), "attn_qat: q_span and k_span come together");
    if (!q_span.has_value()) return spans;
    STD_TORCH_CHECK(s.batch == 1 && !has_mask && causal == AQ_CAUSAL_NONE,
                    "attn_qat: spans (packed sequences) need batch 1, no mask and causal none (they hold the causal "
                    "rule)");
    const std::pair<const Tensor *, int64_t> both[2] = {{&*q_span, s.seqlen_q}, {&*k_span, s.seqlen_k}};
    for (const auto &[t, n] : both) {
        STD_TORCH_CHECK(t->scalar_type() == ScalarType::Int && t->dim() == 2 && t->size(0) == n && t->size(1) == 2 &&
                            t->is_contiguous(),
                        "attn_qat: q_span and k_span must be contiguous int32 (query tokens, 2) and (key tokens, 2)");
        STD_TORCH_CHECK(same_device(*t, q),
                        "attn_qat: q_span and k_span must be on the device of the query");
        STD_TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 8 == 0,
                        "attn_qat: q_span and k_span must be 8-byte aligned (a span is read as one int2)");
    }
    spans.q = static_cast<const int32_t *>(q_span->data_ptr());
    spans.k = static_cast<const int32_t *>(k_span->data_ptr());
    return spans;
}

// A packed call's work order (attn_qat.h; fwd_order for the forward kernel, dkdv_order for the dK/dV kernel): int32
// (items,) contiguous on the query's device, with the spans; a permutation of the kernel's items, as
// attn_qat/varlen.py makes them. The launcher that uses it checks its length against the kernel's items (it alone
// knows the tiles); an entry out of range runs the item of its own index, but a repeated entry is not detected (a
// check would read the table back on the host every call): one item would run twice and another not at all.
const int32_t *check_work_order(const std::optional<Tensor> &order, const Spans &spans, const Tensor &q,
                                int64_t *len) {
    *len = 0;
    if (!order.has_value()) return nullptr;
    STD_TORCH_CHECK(spans.q != nullptr, "attn_qat: work_order comes only with spans (packed sequences)");
    STD_TORCH_CHECK(order->scalar_type() == ScalarType::Int && order->dim() == 1 && order->is_contiguous(),
                    "attn_qat: work_order must be a contiguous 1-D int32 tensor");
    STD_TORCH_CHECK(same_device(*order, q),
                    "attn_qat: work_order must be on the device of the query");
    *len = order->numel();
    return static_cast<const int32_t *>(order->data_ptr());
}

// The fields the forward and backward parameters share: sizes, scale, causal rule, dtype and spans (set after the
// mask). Returns the CUDA launchers' flag for non-finite values under hidden keys, which must outlive the launch.
template <typename Params>
Tensor set_problem(Params *p, const Tensor &q, const AttentionShape &s, double scale, int64_t causal,
                   const Spans &spans) {
    p->batch = s.batch;
    p->heads_q = s.heads_q;
    p->heads_kv = s.heads_kv;
    p->seqlen_q = s.seqlen_q;
    p->seqlen_k = s.seqlen_k;
    p->head_dim = s.head_dim;
    p->head_dim_v = s.head_dim_v;
    p->softmax_scale = (float)scale;
    set_causal(causal, s, &p->causal, &p->causal_offset);
    p->dtype = kernel_dtype(q);
    p->q_span = spans.q;
    p->k_span = spans.k;
    Tensor nonfinite_flag;
    if (!q.is_cpu() && (p->causal || p->mask || p->q_span)) {
        nonfinite_flag = torch::stable::new_empty(q, {1}, ScalarType::Int);
        p->scratch = static_cast<int *>(nonfinite_flag.data_ptr());
    }
    return nonfinite_flag;
}

// The head dim a call's operands are zero-padded to, or 0: head dims up to 128 that the Hopper kernels do not take as
// they are (D != Dv, or other than 64 and 128) go to 64 or 128 where those run, per kernel_options' pad_head_dims
// (attn_qat.h): the mma.sync kernels are several times slower there. Above 128 a forward that keeps no second
// accumulator for O' (`single_accumulator`) goes to 256 where sm90_d256 lets the Hopper forward take it; others stay
// as they are (the mma.sync kernels' tile is 256 wide there anyway). The padding columns are absent (numerics.md
// §6: zeros in every product, never stored), so a padded call computes what the kernels that run it compute.
int64_t padded_head_dim(const Tensor &q, const AttentionShape &s, bool single_accumulator) {
    const int64_t d = std::max(s.head_dim, s.head_dim_v);
    const aq_kernel_options o = aq_get_kernel_options();
    if (aq_sm90_head_dims(s.head_dim, s.head_dim_v) || o.pad_head_dims == 0) return 0;
    const bool takes_256 = aq_sm90_forward_head_dims(256, 256, !single_accumulator, o.sm90_d256);
    if (d > 128 && (!takes_256 || (s.head_dim == 256 && s.head_dim_v == 256))) return 0; // 256 / 256: nothing to pad
    bool pad = o.pad_head_dims == 1;
#ifdef AQ_WITH_CUDA
    if (!pad && q.is_cuda()) {
        torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
        pad = aq_attention_sm90_runs(&o);
    }
#endif
    return pad ? (d <= 64 ? 64 : d <= 128 ? 128 : 256) : 0;
}

// A (B, H, N, D) tensor with zero columns appended up to `width` (a new tensor); t itself when it has them.
Tensor with_columns(const Tensor &t, int64_t width) {
    return t.size(3) == width ? t : torch::stable::pad(t, {0, width - t.size(3)});
}

// The first `d` columns of a (B, H, N, width) tensor as a new tensor in the layout of `like` (an unpadded operand), as
// the unpadded ops and their fake kernels (attn_qat/ops.py) make it: torch.compile plans the outputs' strides from
// those; an empty placeholder, or a tensor with no padding, as it is.
Tensor first_columns(Tensor t, int64_t d, const Tensor &like) {
    if (t.dim() != 4 || t.size(3) == d) return t;
    Tensor out = empty_like_layout(like, t.size(0), t.size(1), t.size(2), d);
    torch::stable::copy_(out, torch::stable::narrow(t, 3, 0, d));
    return out;
}

// A call's sizes as given, and as the kernels take them once q, k and v are padded to `width` (0: not padded).
struct KernelShape {
    AttentionShape given, s;
    int64_t width;
};

// Checks q, k, v (check_attention_inputs) and zero-pads them in place to padded_head_dim's width.
KernelShape pad_for_kernels(Tensor &q, Tensor &k, Tensor &v, bool single_accumulator) {
    KernelShape shape{check_attention_inputs(q, k, v), {}, 0};
    shape.s = shape.given;
    shape.width = padded_head_dim(q, shape.given, single_accumulator);
    if (shape.width) {
        shape.s.head_dim = shape.s.head_dim_v = shape.width;
        q = with_columns(q, shape.width), k = with_columns(k, shape.width), v = with_columns(v, shape.width);
    }
    return shape;
}

// Runs the forward kernel on operands the caller has already prepared.
void run_forward(const Tensor &q, const Tensor &k, const Tensor &v, const std::optional<Tensor> &mask,
                 double scale, int64_t causal, bool quantize_p, const Tensor &out, const Tensor *out_prime,
                 const Tensor &frame, const Tensor &row_sum, const AttentionShape &s, const Spans &spans = Spans(),
                 const int32_t *work_order = nullptr, int64_t work_order_len = 0) {
    check_scale(scale);
    aq_attention_fwd_params p = {};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    copy_strides(q, p.q_stride);
    copy_strides(k, p.k_stride);
    copy_strides(v, p.v_stride);
    set_mask(mask, s, q, &p.mask, p.mask_stride);
    p.o = out.data_ptr();
    copy_strides(out, p.o_stride);
    if (out_prime) {
        p.o_prime = out_prime->data_ptr();
        copy_strides(*out_prime, p.o_prime_stride);
    }
    p.frame_m = static_cast<float *>(frame.data_ptr());
    p.row_sum = static_cast<float *>(row_sum.data_ptr());
    p.quantize_p = quantize_p;
    p.work_order = work_order;
    p.work_order_len = work_order_len;
    const Tensor nonfinite_flag = set_problem(&p, q, s, scale, causal, spans);
    launch(q, p, aq_attention_fwd_cpu, [&](void *stream) {
        return plan_and_launch(q, &p, aq_attention_fwd_plan_cuda, aq_attention_fwd_cuda, stream);
    });
}

// The flags of numerics.md §5's mode (attn_qat.h's table), or an error for a code that is no mode.
unsigned mode_flags(int64_t mode) {
    const aq_mode_info *info = aq_mode_of(mode);
    STD_TORCH_CHECK(info != nullptr, "attn_qat: bad mode code ", mode);
    return info->flags;
}

// p_fp16_path's arguments, in the one-struct form `launch` hands the CPU kernel.
struct p_path_args {
    const float *x;
    int64_t rows, n;
    float *w, *w_fq;
};
const char *p_fp16_path_cpu(const p_path_args *a) { return aq_p_fp16_path_cpu(a->x, a->rows, a->n, a->w, a->w_fq); }

} // namespace

// Returns (out, out_prime, frame, row_sum, q_fq, k_fq, v_fq). need_grad: the call is for training, so the
// backward's operands come back too: O' when the mode's backward takes delta from it (AQ_DELTA_FROM_O_PRIME), and
// Q^F, K^F, V^F when it differentiates through them (AQ_BACKWARD_THROUGH_FQ), for autograd to save so that the
// backward need not quantize again. The others are empty (attn_qat/ops.py's fake kernel reads the same flags). One
// op for both (not a pre-pass op, then this one) because each op call from Python costs tens of microseconds of host
// time in its autograd wrapper (performance.md v16).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
attention_forward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> mask, double scale, int64_t causal, int64_t mode,
                  bool need_grad, bool v_along_tokens, std::optional<Tensor> q_span, std::optional<Tensor> k_span,
                  std::optional<Tensor> fwd_order, std::optional<Tensor> dkdv_order) {
    const unsigned flags = mode_flags(mode);
    const Tensor q_in = q, k_in = k, v_in = v;
    const bool quantize = flags & AQ_QUANTIZES;
    const bool with_prime = need_grad && (flags & AQ_DELTA_FROM_O_PRIME);
    const auto [given, s, width] = pad_for_kernels(q, k, v, !(quantize && with_prime));
    set_causal(causal, s, nullptr, nullptr); // a bad code fails before any work
    const Spans spans = check_spans(q_span, k_span, s, q, mask.has_value(), causal);
    int64_t order_len = 0, dkdv_len = 0;
    const int32_t *order = check_work_order(fwd_order, spans, q, &order_len);
    check_work_order(dkdv_order, spans, q, &dkdv_len); // carried for the backward (attn_qat/ops.py saves it)
    Tensor qf = quantize ? fake_quantize_operand(q, false) : q;
    Tensor kf = quantize ? fake_quantize_operand(k, false) : k;
    Tensor vf = quantize ? fake_quantize_operand(v, v_along_tokens) : v;
    Tensor out = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim_v);
    const bool with_operands = need_grad && (flags & AQ_BACKWARD_THROUGH_FQ);
    auto none = [&q]() { return torch::stable::new_empty(q, {0}); }; // a fresh one each: outputs may not alias
    Tensor out_prime = with_prime ? empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim_v) : none();
    Tensor frame = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    Tensor row_sum = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    run_forward(qf, kf, vf, mask, scale, causal, quantize, out, with_prime ? &out_prime : nullptr, frame, row_sum, s,
                spans, order, order_len);
    out = first_columns(out, given.head_dim_v, q_in), out_prime = first_columns(out_prime, given.head_dim_v, q_in);
    if (!with_operands) return {out, out_prime, frame, row_sum, none(), none(), none()};
    return {out, out_prime, frame, row_sum, first_columns(qf, given.head_dim, q_in),
            first_columns(kf, given.head_dim, k_in), first_columns(vf, given.head_dim_v, v_in)};
}

// Gradients w.r.t. the original q, k, v (straight-through), for each mode of numerics.md §5.
std::tuple<Tensor, Tensor, Tensor> attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor out_prime, std::optional<Tensor> mask, Tensor frame,
                                                      Tensor row_sum, double scale, int64_t causal, int64_t mode,
                                                      bool deterministic, bool v_along_tokens,
                                                      bool operands_quantized, std::optional<Tensor> q_span,
                                                      std::optional<Tensor> k_span, std::optional<Tensor> dkdv_order) {
    const unsigned flags = mode_flags(mode);
    check_scale(scale);
    const Tensor q_in = q, k_in = k, v_in = v;
    const auto [given, s, width] = pad_for_kernels(q, k, v, false); // the backward's kernels at 256 are mma.sync's
    set_causal(causal, s, nullptr, nullptr);
    const Spans spans = check_spans(q_span, k_span, s, q, mask.has_value(), causal);
    int64_t order_len = 0;
    const int32_t *order = check_work_order(dkdv_order, spans, q, &order_len);
    STD_TORCH_CHECK(!operands_quantized || !(flags & AQ_BACKWARD_REDOES_STATS),
                    "attn_qat: drop_in's backward needs the unquantized operands");
    const bool quantized_operands = !operands_quantized && (flags & AQ_BACKWARD_THROUGH_FQ);
    const bool delta_from_prime = flags & AQ_DELTA_FROM_O_PRIME;
    STD_TORCH_CHECK(!delta_from_prime || out_prime.numel() == out.numel(),
                    "attn_qat: this mode's backward needs O' from the forward (need_grad=True)");
    Tensor for_delta = delta_from_prime ? out_prime : out;
    for (const auto &[t, name] : {std::pair<const Tensor *, const char *>{&dout, "grad_output"},
                                  {&for_delta, delta_from_prime ? "out_prime" : "out"}}) {
        STD_TORCH_CHECK(t->dim() == 4 && t->size(0) == s.batch && t->size(1) == s.heads_q &&
                            t->size(2) == s.seqlen_q && t->size(3) == given.head_dim_v && t->stride(3) == 1 &&
                            t->scalar_type() == q.scalar_type() && same_device(*t, q),
                        "attn_qat: ", name, " must have the output's shape and dtype, a contiguous last dimension, "
                        "on the query's device");
    }
    if (width) dout = with_columns(dout, width), for_delta = with_columns(for_delta, width);
    Tensor qo = quantized_operands ? fake_quantize_operand(q, false) : q;
    Tensor ko = quantized_operands ? fake_quantize_operand(k, false) : k;
    Tensor vo = quantized_operands ? fake_quantize_operand(v, v_along_tokens) : v;
    if (flags & AQ_BACKWARD_REDOES_STATS) {
        // Drop-in QAT differentiates plain softmax attention of the unquantized operands: its P needs
        // the unquantized scores' frame and sum, which the FP4 forward did not compute.
        Tensor scratch = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim_v);
        frame = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
        row_sum = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
        run_forward(q, k, v, mask, scale, causal, false, scratch, nullptr, frame, row_sum, s, spans);
    }
    STD_TORCH_CHECK(frame.scalar_type() == ScalarType::Float && row_sum.scalar_type() == ScalarType::Float &&
                        frame.numel() == s.batch * s.heads_q * s.seqlen_q && row_sum.numel() == frame.numel() &&
                        frame.is_contiguous() && row_sum.is_contiguous() && same_device(frame, q) &&
                        same_device(row_sum, q),
                    "attn_qat: frame and row_sum must be contiguous float32 (batch, heads, query tokens) on the "
                    "query's device");

    Tensor dq = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim);
    Tensor dk = empty_like_layout(k, s.batch, s.heads_kv, s.seqlen_k, s.head_dim);
    Tensor dv = empty_like_layout(v, s.batch, s.heads_kv, s.seqlen_k, s.head_dim_v);
    Tensor delta = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);

    aq_attention_bwd_params p = {};
    p.q = qo.data_ptr();
    p.k = ko.data_ptr();
    p.v = vo.data_ptr();
    p.dout = dout.data_ptr();
    p.out_for_delta = for_delta.data_ptr();
    copy_strides(qo, p.q_stride);
    copy_strides(ko, p.k_stride);
    copy_strides(vo, p.v_stride);
    copy_strides(dout, p.dout_stride);
    copy_strides(for_delta, p.out_for_delta_stride);
    set_mask(mask, s, q, &p.mask, p.mask_stride);
    p.frame_m = static_cast<const float *>(frame.data_ptr());
    p.row_sum = static_cast<const float *>(row_sum.data_ptr());
    p.delta = static_cast<float *>(delta.data_ptr());
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    copy_strides(dq, p.dq_stride);
    copy_strides(dk, p.dk_stride);
    copy_strides(dv, p.dv_stride);
    p.quantize_p_for_dv = (flags & AQ_DV_FROM_P_FQ) != 0;
    p.work_order = order;
    p.work_order_len = order_len;
    p.p_fp16 = (flags & AQ_BACKWARD_THROUGH_FQ) != 0; // their forward quantized P, so their P̂ is fp16 (§3)
    const Tensor nonfinite_flag = set_problem(&p, q, s, scale, causal, spans);
    // not deterministic: the fused dQ's fp32 sums (attn_qat.h), 5 products instead of 7, dQ not bit-reproducible
    launch(q, p, aq_attention_bwd_cpu, [&](void *stream) {
        return plan_and_launch(q, &p, aq_attention_bwd_plan_cuda, aq_attention_bwd_cuda, stream,
                               deterministic ? nullptr : &p.dq_accum);
    });
    return {first_columns(dq, given.head_dim, q_in), first_columns(dk, given.head_dim, k_in),
            first_columns(dv, given.head_dim_v, v_in)};
}

// The forward of numerics.md §3 on operands the caller has already made: nothing is quantized but P (the KV cache's
// composite path and attention on packed operands dequantize theirs).
// Returns (out, frame, row_sum).
std::tuple<Tensor, Tensor, Tensor> attention_forward_prequantized(Tensor q, Tensor k, Tensor v,
                                                                  std::optional<Tensor> mask, double scale,
                                                                  int64_t causal) {
    const Tensor q_in = q;
    const auto [given, s, width] = pad_for_kernels(q, k, v, true);
    Tensor out = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim_v);
    Tensor frame = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    Tensor row_sum = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    run_forward(q, k, v, mask, scale, causal, /*quantize_p=*/true, out, nullptr, frame, row_sum, s);
    return {first_columns(out, given.head_dim_v, q_in), frame, row_sum};
}

// P's fp16 path (numerics.md §3) on fp32 exponent arguments x = t - (M - 11), blocks of 16 along the last dim:
// (w, w_fq) = (P̂ * 2^11, P^F * 2^11) in x's shape, contiguous float32. The kernels' own code on x's device (the C
// kernels' on the CPU, the CUDA kernels' device functions on a GPU), exposed so that tests can hold it to
// attn_qat.reference bit for bit on arguments of their choosing.
std::tuple<Tensor, Tensor> p_fp16_path(Tensor x) {
    STD_TORCH_CHECK(x.scalar_type() == ScalarType::Float, "attn_qat: p_fp16_path takes float32 exponent arguments");
    STD_TORCH_CHECK(x.dim() >= 1, "attn_qat: p_fp16_path needs at least one dimension");
    x = torch::stable::contiguous(x);
    const std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    Tensor w = torch::stable::new_empty(x, sizes);
    Tensor w_fq = torch::stable::new_empty(x, sizes);
    const int64_t n = x.size(x.dim() - 1);
    const int64_t rows = n == 0 ? 0 : x.numel() / n;
    const p_path_args args = {static_cast<const float *>(x.data_ptr()), rows, n, static_cast<float *>(w.data_ptr()),
                              static_cast<float *>(w_fq.data_ptr())};
    launch(x, args, p_fp16_path_cpu, [&](void *stream) {
        return aq_p_fp16_path_cuda(args.x, args.rows, args.n, args.w, args.w_fq, stream);
    });
    return {w, w_fq};
}

} // namespace aq_ops
