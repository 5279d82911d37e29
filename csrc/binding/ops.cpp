// Op schemas, argument checks and dispatch to the CPU and CUDA kernels, through PyTorch's op registry.
// C++ only because the LibTorch stable ABI headers are C++; every kernel behind it is C / CUDA C.
#include <cmath>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#ifdef AQ_WITH_CUDA
#include <torch/csrc/stable/accelerator.h>
#endif
#include <torch/csrc/stable/macros.h>
#include <torch/headeronly/util/shim_utils.h>

// torch compat: the headers of 2.10 and 2.11 (README asks for >= 2.10) lack STABLE_TORCH_ERROR_CODE_CHECK, new in
// 2.12. TORCH_ERROR_CODE_CHECK, which it extends, throws the same std::runtime_error, only without the failed
// call's own message (which a running torch gives from 2.13 on).
#ifndef STABLE_TORCH_ERROR_CODE_CHECK
#define STABLE_TORCH_ERROR_CODE_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attn_qat.h"

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

namespace {

// The modes of numerics.md §5; attn_qat/ops.py holds the names.
enum Mode : int64_t { MODE_ATTN_QAT = 0, MODE_HIGH_PRECISION_P, MODE_LOW_PRECISION_O, MODE_DROP_IN, MODE_BF16 };
// Causal alignment codes; see numerics.md §6.
enum Causal : int64_t { CAUSAL_NONE = 0, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT };

aq_dtype kernel_dtype(const Tensor &t) {
    switch (t.scalar_type()) {
    case ScalarType::BFloat16: return AQ_BFLOAT16;
    case ScalarType::Half: return AQ_FLOAT16;
    case ScalarType::Float: return AQ_FLOAT32;
    default: STD_TORCH_CHECK(false, "attn_qat: expected a bfloat16, float16 or float32 tensor");
    }
    return AQ_FLOAT32;
}

// The dtype of an attention or decode operand: one of those attn_qat.h names.
aq_dtype attention_dtype(const Tensor &t) {
    const aq_dtype dt = kernel_dtype(t);
    STD_TORCH_CHECK(aq_attention_dtype_supported(dt), "attn_qat: attention takes bfloat16 or float16 tensors, got "
                                                      "float32 (use torch.autocast or cast the inputs)");
    return dt;
}

// Launches on the tensor's device: the CPU kernel, or cuda(stream) on the current stream of the tensor's CUDA
// device (made the current device).
template <typename Params, typename Cuda>
void launch(const Tensor &on, const Params &params, const char *(*cpu)(const Params *), const Cuda &cuda) {
    const char *err = nullptr;
    if (on.is_cpu()) {
        err = cpu(&params);
    } else {
#ifdef AQ_WITH_CUDA
        STD_TORCH_CHECK(on.is_cuda(), "attn_qat: tensors must be on the CPU or a CUDA device");
        torch::stable::accelerator::DeviceGuard guard(on.get_device_index());
        void *stream = nullptr;
        STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(on.get_device_index(), &stream));
        err = cuda(stream);
#else
        (void)cuda;
        STD_TORCH_CHECK(false, "attn_qat: this build has no CUDA kernels (it was built without nvcc)");
#endif
    }
    STD_TORCH_CHECK(err == nullptr, "attn_qat: ", err ? err : "");
}

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

// ---------------------------------------------------------------------------------------------
// NVFP4 quantization

// x viewed as (outer0, outer1, outer2, axis, inner) with one stride per dim, merging dims where the
// strides allow; nullopt when the dims before (or after) the axis do not merge into 3 (or 1).
struct BlockedView {
    int64_t outer[3] = {1, 1, 1}, outer_stride[3] = {0, 0, 0};
    int64_t axis_len = 1, axis_stride = 0, inner = 1, inner_stride = 0;
};

std::vector<std::pair<int64_t, int64_t>> merge_dims(const Tensor &x, int64_t begin, int64_t end) {
    std::vector<std::pair<int64_t, int64_t>> dims; // (size, stride), outermost first
    for (int64_t d = begin; d < end; d++) {
        const int64_t size = x.size(d), stride = x.stride(d);
        if (size == 1) continue;
        if (!dims.empty() && dims.back().second == stride * size) {
            dims.back() = {dims.back().first * size, stride};
        } else {
            dims.push_back({size, stride});
        }
    }
    return dims;
}

std::optional<BlockedView> blocked_view(const Tensor &x, int64_t axis) {
    BlockedView v;
    auto outer = merge_dims(x, 0, axis), inner = merge_dims(x, axis + 1, x.dim());
    if (outer.size() > 3 || inner.size() > 1) return std::nullopt;
    for (size_t i = 0; i < outer.size(); i++) {
        v.outer[3 - outer.size() + i] = outer[i].first;
        v.outer_stride[3 - outer.size() + i] = outer[i].second;
    }
    v.axis_len = x.size(axis);
    v.axis_stride = x.stride(axis);
    if (!inner.empty()) {
        v.inner = inner[0].first;
        v.inner_stride = inner[0].second;
    }
    return v;
}

// Fills the kernel's view of x; copies x to contiguous memory first if its strides do not merge.
aq_quantize_params quantize_params(Tensor &x, int64_t axis) {
    STD_TORCH_CHECK(x.dim() >= 1, "attn_qat: cannot quantize a 0-dimensional tensor");
    STD_TORCH_CHECK(axis >= 0 && axis < x.dim(), "attn_qat: block axis ", axis, " out of range for a ", x.dim(),
                    "-dimensional tensor");
    auto view = blocked_view(x, axis);
    if (!view) {
        x = torch::stable::contiguous(x);
        view = blocked_view(x, axis);
    }
    aq_quantize_params p = {};
    p.x = x.data_ptr();
    p.dtype = kernel_dtype(x);
    for (int i = 0; i < 3; i++) {
        p.outer[i] = view->outer[i];
        p.stride_outer[i] = view->outer_stride[i];
    }
    p.axis_len = view->axis_len;
    p.stride_axis = view->axis_stride;
    p.inner = view->inner;
    p.stride_inner = view->inner_stride;
    return p;
}

std::vector<int64_t> sizes_with_axis(const Tensor &x, int64_t axis, int64_t axis_len) {
    std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
    s[axis] = axis_len;
    return s;
}

// Codes (x's shape, axis halved) and scales (x's shape, axis / 16), both contiguous.
std::tuple<Tensor, Tensor> nvfp4_quantize(Tensor x, int64_t axis) {
    aq_quantize_params p = quantize_params(x, axis);
    const int64_t n = x.size(axis);
    Tensor codes = torch::stable::new_empty(x, sizes_with_axis(x, axis, (n + 1) / 2), ScalarType::Byte);
    Tensor scales = torch::stable::new_empty(x, sizes_with_axis(x, axis, (n + 15) / 16), ScalarType::Float8_e4m3fn);
    p.codes = static_cast<uint8_t *>(codes.data_ptr());
    p.scales = static_cast<uint8_t *>(scales.data_ptr());
    launch(x, p, aq_quantize_cpu, [&](void *stream) { return aq_quantize_cuda(&p, stream); });
    return {codes, scales};
}

// Quantize-dequantize into x's dtype and shape (contiguous). A trailing partial block is allowed.
Tensor nvfp4_fake_quantize(Tensor x, int64_t axis) {
    aq_quantize_params p = quantize_params(x, axis);
    Tensor out = torch::stable::new_empty(x, std::vector<int64_t>(x.sizes().begin(), x.sizes().end()));
    p.fake = out.data_ptr();
    launch(x, p, aq_quantize_cpu, [&](void *stream) { return aq_quantize_cuda(&p, stream); });
    return out;
}

Tensor nvfp4_dequantize(Tensor codes, Tensor scales, int64_t axis, int64_t axis_len, ScalarType dtype) {
    STD_TORCH_CHECK(codes.scalar_type() == ScalarType::Byte, "attn_qat: codes must be uint8");
    STD_TORCH_CHECK(scales.scalar_type() == ScalarType::Float8_e4m3fn, "attn_qat: scales must be float8_e4m3fn");
    STD_TORCH_CHECK(codes.dim() == scales.dim() && axis >= 0 && axis < codes.dim(),
                    "attn_qat: codes and scales must have the same rank and contain the block axis");
    STD_TORCH_CHECK(codes.size(axis) == (axis_len + 1) / 2 && scales.size(axis) == (axis_len + 15) / 16,
                    "attn_qat: codes / scales do not match the block axis length ", axis_len);
    for (int64_t d = 0; d < codes.dim(); d++)
        STD_TORCH_CHECK(d == axis || codes.size(d) == scales.size(d), "attn_qat: codes and scales disagree in dim ", d);
    STD_TORCH_CHECK(codes.get_device_index() == scales.get_device_index() && codes.is_cpu() == scales.is_cpu(),
                    "attn_qat: codes and scales must be on the same device");
    codes = torch::stable::contiguous(codes);
    scales = torch::stable::contiguous(scales);
    Tensor out = torch::stable::new_empty(codes, sizes_with_axis(codes, axis, axis_len), dtype);
    aq_dequantize_params p = {};
    p.codes = static_cast<const uint8_t *>(codes.data_ptr());
    p.scales = static_cast<const uint8_t *>(scales.data_ptr());
    p.outer = 1;
    for (int64_t d = 0; d < axis; d++) p.outer *= codes.size(d);
    p.axis_len = axis_len;
    p.inner = 1;
    for (int64_t d = axis + 1; d < codes.dim(); d++) p.inner *= codes.size(d);
    p.out = out.data_ptr();
    p.dtype = kernel_dtype(out);
    launch(codes, p, aq_dequantize_cpu, [&](void *stream) { return aq_dequantize_cuda(&p, stream); });
    return out;
}

// ---------------------------------------------------------------------------------------------
// Attention

// A (B, H, N, D) tensor is "token-major" when its memory is (B, N, H, D), as diffusers and
// transformers' q/k/v projections produce it; new tensors follow the layout of the one they mirror.
bool token_major(const Tensor &t) { return t.size(1) > 1 && t.size(2) > 1 && t.stride(1) < t.stride(2); }

Tensor empty_like_layout(const Tensor &like, int64_t b, int64_t h, int64_t n, int64_t d) {
    if (token_major(like)) return torch::stable::transpose(torch::stable::new_empty(like, {b, n, h, d}), 1, 2);
    return torch::stable::new_empty(like, {b, h, n, d});
}

// The Q/K/V pre-pass of numerics.md §2: Q and K blocked along D, V along tokens (the last block partial) when
// every query sees every key, else along D like K. Each is quantized in its memory order so the kernel reads
// coalesced and the result keeps the input's layout.
Tensor fake_quantize_operand(const Tensor &x, bool along_tokens) {
    const bool tm = token_major(x);
    Tensor mem = tm ? torch::stable::transpose(x, 1, 2) : x; // dims in memory order
    const int64_t axis = along_tokens ? (tm ? 1 : 2) : 3;
    Tensor fq = nvfp4_fake_quantize(mem, axis);
    return tm ? torch::stable::transpose(fq, 1, 2) : fq;
}

// The whole pre-pass, for callers that want the fake-quantized operands themselves.
std::tuple<Tensor, Tensor, Tensor> fake_quantize_qkv(Tensor q, Tensor k, Tensor v, bool v_along_tokens) {
    STD_TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attn_qat: query, key and value must be 4-D (batch, heads, tokens, head_dim)");
    STD_TORCH_CHECK(q.size(3) % 16 == 0 && k.size(3) % 16 == 0 && (v_along_tokens || v.size(3) % 16 == 0),
                    "attn_qat: head_dim must be a multiple of 16");
    return {fake_quantize_operand(q, false), fake_quantize_operand(k, false), fake_quantize_operand(v, v_along_tokens)};
}

void copy_strides(const Tensor &t, int64_t out[3]) {
    for (int i = 0; i < 3; i++) out[i] = t.stride(i);
}

struct AttentionShape {
    int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim;
};

AttentionShape check_attention_inputs(const Tensor &q, const Tensor &k, const Tensor &v) {
    STD_TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                    "attn_qat: query, key and value must be 4-D (batch, heads, tokens, head_dim)");
    const aq_dtype dt = attention_dtype(q);
    STD_TORCH_CHECK(attention_dtype(k) == dt && attention_dtype(v) == dt,
                    "attn_qat: query, key and value must have the same dtype");
    STD_TORCH_CHECK(q.is_cpu() == k.is_cpu() && q.is_cpu() == v.is_cpu() &&
                        q.get_device_index() == k.get_device_index() && q.get_device_index() == v.get_device_index(),
                    "attn_qat: query, key and value must be on the same device");
    AttentionShape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
    STD_TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch, "attn_qat: batch sizes differ");
    STD_TORCH_CHECK(v.size(1) == s.heads_kv && v.size(2) == s.seqlen_k,
                    "attn_qat: key and value must have the same heads and tokens");
    STD_TORCH_CHECK(k.size(3) == s.head_dim && v.size(3) == s.head_dim,
                    "attn_qat: query, key and value must have the same head_dim");
    STD_TORCH_CHECK(aq_head_dim_supported(s.head_dim), "attn_qat: head_dim must be " AQ_HEAD_DIMS_TEXT ", got ",
                    s.head_dim);
    STD_TORCH_CHECK(s.heads_kv > 0 && s.heads_q % s.heads_kv == 0, "attn_qat: query heads (", s.heads_q,
                    ") must be a multiple of key/value heads (", s.heads_kv, ")");
    STD_TORCH_CHECK(s.seqlen_q > 0 && s.seqlen_k > 0 && s.batch > 0, "attn_qat: empty query or key sequence");
    STD_TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
                    "attn_qat: the last dimension (head_dim) of query, key and value must be contiguous");
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
    STD_TORCH_CHECK(m.is_cpu() == q.is_cpu() && m.get_device_index() == q.get_device_index(),
                    "attn_qat: attn_mask must be on the device of the query");
    *ptr = static_cast<const float *>(m.data_ptr());
    for (int i = 0; i < 4; i++) strides[i] = m.stride(i);
}

void set_causal(int64_t causal, const AttentionShape &s, int *flag, int64_t *offset) {
    STD_TORCH_CHECK(causal >= CAUSAL_NONE && causal <= CAUSAL_BOTTOM_RIGHT, "attn_qat: bad causal code ", causal);
    if (flag) *flag = causal != CAUSAL_NONE;
    if (offset) *offset = causal == CAUSAL_BOTTOM_RIGHT ? s.seqlen_k - s.seqlen_q : 0;
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
    STD_TORCH_CHECK(s.batch == 1 && !has_mask && causal == CAUSAL_NONE,
                    "attn_qat: spans (packed sequences) need batch 1, no mask and causal none (they hold the causal "
                    "rule)");
    const std::pair<const Tensor *, int64_t> both[2] = {{&*q_span, s.seqlen_q}, {&*k_span, s.seqlen_k}};
    for (const auto &[t, n] : both) {
        STD_TORCH_CHECK(t->scalar_type() == ScalarType::Int && t->dim() == 2 && t->size(0) == n && t->size(1) == 2 &&
                            t->is_contiguous(),
                        "attn_qat: q_span and k_span must be contiguous int32 (query tokens, 2) and (key tokens, 2)");
        STD_TORCH_CHECK(t->is_cpu() == q.is_cpu() && t->get_device_index() == q.get_device_index(),
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
    STD_TORCH_CHECK(order->is_cpu() == q.is_cpu() && order->get_device_index() == q.get_device_index(),
                    "attn_qat: work_order must be on the device of the query");
    *len = order->numel();
    return static_cast<const int32_t *>(order->data_ptr());
}

// The kernels take the row max on raw scores and scale inside the exp (attention/mask.cuh's logit_map), which
// needs scale > 0 as the float they use, with scale * log2(e) finite.
void check_scale(double scale) {
    STD_TORCH_CHECK(scale > 0.0, "attn_qat: the attention ops take softmax scale > 0, got ", scale,
                    " (the Python entry points pass a negative scale as -q and -scale, zero as zero queries)");
    const float exp_scale = (float)scale * AQ_LOG2E;
    STD_TORCH_CHECK((float)scale > 0.0f && std::isfinite(exp_scale), "attn_qat: softmax scale ", scale,
                    " is outside what the kernels take as a float (above 0 and below about 2e38)");
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
    p->softmax_scale = (float)scale;
    set_causal(causal, s, &p->causal, &p->causal_offset);
    p->dtype = attention_dtype(q);
    p->q_span = spans.q;
    p->k_span = spans.k;
    Tensor nonfinite_flag;
    if (!q.is_cpu() && (p->causal || p->mask || p->q_span)) {
        nonfinite_flag = torch::stable::new_empty(q, {1}, ScalarType::Int);
        p->scratch = static_cast<int *>(nonfinite_flag.data_ptr());
    }
    return nonfinite_flag;
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

void check_mode(int64_t mode) {
    STD_TORCH_CHECK(mode >= MODE_ATTN_QAT && mode <= MODE_BF16, "attn_qat: bad mode code ", mode);
}

// Whether the mode's backward differentiates through Q^F, K^F, V^F (numerics.md §5; drop_in's goes through the
// unquantized operands, bf16's has none).
bool quantized_backward(int64_t mode) {
    return mode == MODE_ATTN_QAT || mode == MODE_HIGH_PRECISION_P || mode == MODE_LOW_PRECISION_O;
}

// Whether the mode's backward takes delta from O' (the forward's P̂ V), so that a training forward must return O'.
bool delta_from_out_prime(int64_t mode) { return mode == MODE_ATTN_QAT || mode == MODE_HIGH_PRECISION_P; }

// Returns (out, out_prime, frame, row_sum, q_fq, k_fq, v_fq). need_grad: the call is for training, so the
// backward's operands come back too: O' when the mode's backward uses it (attn_qat, high_precision_p), and
// Q^F, K^F, V^F in the modes whose backward differentiates through them (attn_qat, high_precision_p,
// low_precision_o), for autograd to save so that the backward need not quantize again. The others are
// empty. One op for both (not a pre-pass op, then this one) because each op call from Python costs tens of
// microseconds of host time in its autograd wrapper (performance.md v16).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
attention_forward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> mask, double scale, int64_t causal, int64_t mode,
                  bool need_grad, bool v_along_tokens, std::optional<Tensor> q_span, std::optional<Tensor> k_span,
                  std::optional<Tensor> fwd_order, std::optional<Tensor> dkdv_order) {
    check_mode(mode);
    const AttentionShape s = check_attention_inputs(q, k, v);
    set_causal(causal, s, nullptr, nullptr); // a bad code fails before any work
    const Spans spans = check_spans(q_span, k_span, s, q, mask.has_value(), causal);
    int64_t order_len = 0, dkdv_len = 0;
    const int32_t *order = check_work_order(fwd_order, spans, q, &order_len);
    check_work_order(dkdv_order, spans, q, &dkdv_len); // carried for the backward (attn_qat/ops.py saves it)
    const bool quantize = mode != MODE_BF16;
    Tensor qf = quantize ? fake_quantize_operand(q, false) : q;
    Tensor kf = quantize ? fake_quantize_operand(k, false) : k;
    Tensor vf = quantize ? fake_quantize_operand(v, v_along_tokens) : v;
    Tensor out = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim);
    const bool with_prime = need_grad && delta_from_out_prime(mode);
    const bool with_operands = need_grad && quantized_backward(mode);
    auto none = [&q]() { return torch::stable::new_empty(q, {0}); }; // a fresh one each: outputs may not alias
    Tensor out_prime = with_prime ? empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim) : none();
    Tensor frame = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    Tensor row_sum = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    run_forward(qf, kf, vf, mask, scale, causal, quantize, out, with_prime ? &out_prime : nullptr, frame, row_sum, s,
                spans, order, order_len);
    if (!with_operands) return {out, out_prime, frame, row_sum, none(), none(), none()};
    return {out, out_prime, frame, row_sum, qf, kf, vf};
}

// Gradients w.r.t. the original q, k, v (straight-through), for each mode of numerics.md §5.
std::tuple<Tensor, Tensor, Tensor> attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor out_prime, std::optional<Tensor> mask, Tensor frame,
                                                      Tensor row_sum, double scale, int64_t causal, int64_t mode,
                                                      bool deterministic, bool v_along_tokens,
                                                      bool operands_quantized, std::optional<Tensor> q_span,
                                                      std::optional<Tensor> k_span, std::optional<Tensor> dkdv_order) {
    check_mode(mode);
    check_scale(scale);
    const AttentionShape s = check_attention_inputs(q, k, v);
    set_causal(causal, s, nullptr, nullptr);
    const Spans spans = check_spans(q_span, k_span, s, q, mask.has_value(), causal);
    int64_t order_len = 0;
    const int32_t *order = check_work_order(dkdv_order, spans, q, &order_len);
    STD_TORCH_CHECK(dout.dim() == 4 && dout.size(0) == s.batch && dout.size(1) == s.heads_q &&
                        dout.size(2) == s.seqlen_q && dout.size(3) == s.head_dim && dout.stride(3) == 1,
                    "attn_qat: grad_output must match the output's shape with a contiguous last dimension");
    STD_TORCH_CHECK(dout.scalar_type() == q.scalar_type(), "attn_qat: grad_output must have the query's dtype");
    STD_TORCH_CHECK(!operands_quantized || mode != MODE_DROP_IN,
                    "attn_qat: drop_in's backward needs the unquantized operands");
    const bool quantized_operands = !operands_quantized && quantized_backward(mode);
    const bool delta_from_prime = delta_from_out_prime(mode);
    STD_TORCH_CHECK(!delta_from_prime || out_prime.numel() == out.numel(),
                    "attn_qat: this mode's backward needs O' from the forward (need_grad=True)");
    Tensor qo = quantized_operands ? fake_quantize_operand(q, false) : q;
    Tensor ko = quantized_operands ? fake_quantize_operand(k, false) : k;
    Tensor vo = quantized_operands ? fake_quantize_operand(v, v_along_tokens) : v;
    if (mode == MODE_DROP_IN) {
        // Drop-in QAT differentiates plain softmax attention of the unquantized operands: its P needs
        // the unquantized scores' frame and sum, which the FP4 forward did not compute.
        Tensor scratch = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim);
        frame = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
        row_sum = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
        run_forward(q, k, v, mask, scale, causal, false, scratch, nullptr, frame, row_sum, s, spans);
    }
    const Tensor &for_delta = delta_from_prime ? out_prime : out;
    STD_TORCH_CHECK(frame.scalar_type() == ScalarType::Float && row_sum.scalar_type() == ScalarType::Float &&
                        frame.numel() == s.batch * s.heads_q * s.seqlen_q && row_sum.numel() == frame.numel() &&
                        frame.is_contiguous() && row_sum.is_contiguous(),
                    "attn_qat: frame and row_sum must be contiguous float32 (batch, heads, query tokens)");

    Tensor dq = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim);
    Tensor dk = empty_like_layout(k, s.batch, s.heads_kv, s.seqlen_k, s.head_dim);
    Tensor dv = empty_like_layout(v, s.batch, s.heads_kv, s.seqlen_k, s.head_dim);
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
    p.quantize_p_for_dv = mode == MODE_ATTN_QAT || mode == MODE_LOW_PRECISION_O;
    p.work_order = order;
    p.work_order_len = order_len;
    p.p_fp16 = quantized_backward(mode); // these modes' forward quantized P, so their P̂ is fp16 (numerics.md §3)
    const Tensor nonfinite_flag = set_problem(&p, q, s, scale, causal, spans);
    // not deterministic: the fused dQ's fp32 sums (attn_qat.h), 5 products instead of 7, dQ not bit-reproducible
    launch(q, p, aq_attention_bwd_cpu, [&](void *stream) {
        return plan_and_launch(q, &p, aq_attention_bwd_plan_cuda, aq_attention_bwd_cuda, stream,
                               deterministic ? nullptr : &p.dq_accum);
    });
    return {dq, dk, dv};
}

// P's fp16 path (numerics.md §3) on fp32 exponent arguments x = t - (M - 11), blocks of 16 along the last dim:
// (w, w_fq) = (P̂ * 2^11, P^F * 2^11) in x's shape, contiguous float32. The kernels' own code on x's device (the C
// kernels' on the CPU, the CUDA kernels' device functions on a GPU), exposed so that tests can hold it to
// attn_qat.reference bit for bit on arguments of their choosing.
struct p_path_args {
    const float *x;
    int64_t rows, n;
    float *w, *w_fq;
};
const char *p_fp16_path_cpu(const p_path_args *a) { return aq_p_fp16_path_cpu(a->x, a->rows, a->n, a->w, a->w_fq); }

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

// ---------------------------------------------------------------------------------------------
// NVFP4 KV cache (attn_qat/kv_cache.py)

// The forward of numerics.md §3 on operands the caller has already made: nothing is quantized but P (the KV cache's
// composite path and attention on packed operands dequantize theirs).
// Returns (out, frame, row_sum).
std::tuple<Tensor, Tensor, Tensor> attention_forward_prequantized(Tensor q, Tensor k, Tensor v,
                                                                  std::optional<Tensor> mask, double scale,
                                                                  int64_t causal) {
    const AttentionShape s = check_attention_inputs(q, k, v);
    Tensor out = empty_like_layout(q, s.batch, s.heads_q, s.seqlen_q, s.head_dim);
    Tensor frame = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    Tensor row_sum = torch::stable::new_empty(q, {s.batch, s.heads_q, s.seqlen_q}, ScalarType::Float);
    run_forward(q, k, v, mask, scale, causal, /*quantize_p=*/true, out, nullptr, frame, row_sum, s);
    return {out, frame, row_sum};
}

#ifdef AQ_WITH_CUDA
const char *kv_cache_decode_no_cpu(const aq_decode_params *) {
    return "kv_cache_decode has no CPU kernel (NVFP4KVCache.attention takes its composite path on the CPU)";
}

// Decode on the packed cache (attn_qat.h's aq_decode_params): q (B, Hq, Tq, D) raw (the kernel fake-quantizes
// it); the page pools as NVFP4KVCache holds them; lengths (B,) int64; block_table (B, pages_per_seq) int32;
// max_length >= every length.
Tensor kv_cache_decode(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, Tensor lengths,
                       Tensor block_table, int64_t max_length, double scale, bool causal) {
    check_scale(scale);
    STD_TORCH_CHECK(q.dim() == 4, "attn_qat: kv_cache_decode: q must be (batch, heads_q, tokens, head_dim)");
    const int64_t batch = q.size(0), heads_q = q.size(1), tokens = q.size(2), dim = q.size(3);
    STD_TORCH_CHECK(k_codes.dim() == 4 && k_codes.size(3) * 2 == dim,
                    "attn_qat: kv_cache_decode: k_codes must be (num_pages, heads_kv, page_size, head_dim / 2)");
    const int64_t pages = k_codes.size(0), heads_kv = k_codes.size(1), page_size = k_codes.size(2);
    const std::vector<std::pair<const Tensor *, std::vector<int64_t>>> buffers = {
        {&k_codes, {pages, heads_kv, page_size, dim / 2}}, {&k_scales, {pages, heads_kv, page_size, dim / 16}},
        {&v_codes, {pages, heads_kv, page_size / 2, dim}}, {&v_scales, {pages, heads_kv, page_size / 16, dim}},
    };
    for (const auto &[t, shape] : buffers) {
        STD_TORCH_CHECK(t->dim() == 4 && std::vector<int64_t>(t->sizes().begin(), t->sizes().end()) == shape &&
                            t->is_contiguous(),
                        "attn_qat: kv_cache_decode: the cache buffers must be contiguous, shaped as NVFP4KVCache's");
        STD_TORCH_CHECK(t->is_cuda() && q.is_cuda() && t->get_device_index() == q.get_device_index(),
                        "attn_qat: kv_cache_decode: q and the cache must be on one CUDA device");
        STD_TORCH_CHECK(t->scalar_type() == ScalarType::Byte, "attn_qat: kv_cache_decode: codes and scales are uint8");
    }
    for (const Tensor *t : {&lengths, &block_table})
        STD_TORCH_CHECK(t->is_contiguous() && t->is_cuda() && t->get_device_index() == q.get_device_index(),
                        "attn_qat: kv_cache_decode: lengths and block_table must be contiguous, on q's device");
    STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == batch && lengths.scalar_type() == ScalarType::Long,
                    "attn_qat: kv_cache_decode: lengths must be an int64 (batch,) tensor");
    STD_TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch && block_table.size(1) >= 1 &&
                        block_table.scalar_type() == ScalarType::Int,
                    "attn_qat: kv_cache_decode: block_table must be an int32 (batch, pages_per_seq) tensor");
    aq_decode_params p = {};
    p.dtype = attention_dtype(q);
    Tensor qc = torch::stable::contiguous(q); // raw: the kernel fake-quantizes its rows along D itself
    p.q = qc.data_ptr();
    p.k_codes = static_cast<const uint8_t *>(k_codes.data_ptr());
    p.k_scales = static_cast<const uint8_t *>(k_scales.data_ptr());
    p.v_codes = static_cast<const uint8_t *>(v_codes.data_ptr());
    p.v_scales = static_cast<const uint8_t *>(v_scales.data_ptr());
    p.block_table = static_cast<const int32_t *>(block_table.data_ptr());
    p.lengths = static_cast<const int64_t *>(lengths.data_ptr());
    p.batch = batch;
    p.heads_q = heads_q;
    p.heads_kv = heads_kv;
    p.seqlen_q = tokens;
    p.head_dim = dim;
    p.num_pages = pages;
    p.page_size = page_size;
    p.pages_per_seq = block_table.size(1);
    p.max_length = max_length;
    p.softmax_scale = (float)scale;
    p.causal = causal;
    int64_t workspace_floats = 0;
    {
        torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
        const aq_kernel_options options = aq_get_kernel_options();
        const char *err = aq_kv_cache_decode_plan_cuda(&p, &options, &workspace_floats);
        STD_TORCH_CHECK(err == nullptr, "attn_qat: ", err ? err : "");
    }
    Tensor workspace = torch::stable::new_empty(q, {workspace_floats > 0 ? workspace_floats : 1}, ScalarType::Float);
    Tensor out = torch::stable::new_empty(q, {batch, heads_q, tokens, dim});
    p.workspace = static_cast<float *>(workspace.data_ptr());
    p.out = out.data_ptr();
    launch(q, p, kv_cache_decode_no_cpu, [&](void *stream) { return aq_kv_cache_decode_cuda(&p, stream); });
    return out;
}
#endif

} // namespace

STABLE_TORCH_LIBRARY(attn_qat, m) {
    m.def("nvfp4_quantize(Tensor x, int axis) -> (Tensor codes, Tensor scales)");
    m.def("nvfp4_fake_quantize(Tensor x, int axis) -> Tensor");
    m.def("nvfp4_dequantize(Tensor codes, Tensor scales, int axis, int axis_len, ScalarType dtype) -> Tensor");
    m.def("fake_quantize_qkv(Tensor q, Tensor k, Tensor v, bool v_along_tokens) -> (Tensor, Tensor, Tensor)");
    m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int causal, int mode, "
          "bool need_grad, bool v_along_tokens, Tensor? q_span=None, Tensor? k_span=None, Tensor? fwd_order=None, "
          "Tensor? dkdv_order=None) -> (Tensor out, Tensor out_prime, Tensor frame, Tensor row_sum, Tensor q_fq, "
          "Tensor k_fq, Tensor v_fq)");
    m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor out_prime, "
          "Tensor? mask, Tensor frame, Tensor row_sum, float scale, int causal, int mode, bool deterministic, "
          "bool v_along_tokens, bool operands_quantized=False, Tensor? q_span=None, Tensor? k_span=None, "
          "Tensor? dkdv_order=None) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("attention_forward_prequantized(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int causal) "
          "-> (Tensor out, Tensor frame, Tensor row_sum)");
    m.def("kv_cache_decode(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, "
          "Tensor lengths, Tensor block_table, int max_length, float scale, bool causal) -> Tensor");
    m.def("p_fp16_path(Tensor x) -> (Tensor w, Tensor w_fq)");
}

// The same functions serve both devices: `launch` picks the kernel from the tensors' device.
STABLE_TORCH_LIBRARY_IMPL(attn_qat, CPU, m) {
    m.impl("nvfp4_quantize", TORCH_BOX(&nvfp4_quantize));
    m.impl("nvfp4_fake_quantize", TORCH_BOX(&nvfp4_fake_quantize));
    m.impl("nvfp4_dequantize", TORCH_BOX(&nvfp4_dequantize));
    m.impl("fake_quantize_qkv", TORCH_BOX(&fake_quantize_qkv));
    m.impl("attention_forward", TORCH_BOX(&attention_forward));
    m.impl("attention_backward", TORCH_BOX(&attention_backward));
    m.impl("attention_forward_prequantized", TORCH_BOX(&attention_forward_prequantized));
    m.impl("p_fp16_path", TORCH_BOX(&p_fp16_path));
}

#ifdef AQ_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(attn_qat, CUDA, m) {
    m.impl("nvfp4_quantize", TORCH_BOX(&nvfp4_quantize));
    m.impl("nvfp4_fake_quantize", TORCH_BOX(&nvfp4_fake_quantize));
    m.impl("nvfp4_dequantize", TORCH_BOX(&nvfp4_dequantize));
    m.impl("fake_quantize_qkv", TORCH_BOX(&fake_quantize_qkv));
    m.impl("attention_forward", TORCH_BOX(&attention_forward));
    m.impl("attention_backward", TORCH_BOX(&attention_backward));
    m.impl("attention_forward_prequantized", TORCH_BOX(&attention_forward_prequantized));
    m.impl("kv_cache_decode", TORCH_BOX(&kv_cache_decode));
    m.impl("p_fp16_path", TORCH_BOX(&p_fp16_path));
}
#endif
