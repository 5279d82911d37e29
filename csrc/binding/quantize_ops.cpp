// The NVFP4 quantization ops (numerics.md §1) and the Q/K/V pre-pass (§2).
#include "binding/ops.h"

namespace aq_ops {
namespace {

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

} // namespace

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

} // namespace aq_ops
