// What the op files share: the LibTorch stable ABI headers, the kernels' interface, and the helpers that turn tensors
// into kernel parameters and launch on the tensors' device.
#pragma once
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

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "attn_qat.h"

namespace aq_ops {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

inline aq_dtype kernel_dtype(const Tensor &t) {
    switch (t.scalar_type()) {
    case ScalarType::BFloat16: return AQ_BFLOAT16;
    case ScalarType::Half: return AQ_FLOAT16;
    case ScalarType::Float: return AQ_FLOAT32;
    default: STD_TORCH_CHECK(false, "attn_qat: expected a bfloat16, float16 or float32 tensor");
    }
    return AQ_FLOAT32;
}

// The dtype of an attention or decode operand: one of those attn_qat.h names.
inline aq_dtype attention_dtype(const Tensor &t) {
    const aq_dtype dt = kernel_dtype(t);
    STD_TORCH_CHECK(aq_attention_dtype_supported(dt), "attn_qat: attention takes bfloat16 or float16 tensors");
    return dt;
}

inline bool same_device(const Tensor &a, const Tensor &b) {
    return a.is_cpu() == b.is_cpu() && a.get_device_index() == b.get_device_index();
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

// Whether a (B, H, N, D) tensor's memory is (B, N, H, D): attn_qat.h's rule.
inline bool token_major(const Tensor &t) { return aq_token_major(t.size(1), t.size(2), t.stride(1), t.stride(2)); }

// A new (b, h, n, d) tensor in the layout of `like`.
inline Tensor empty_like_layout(const Tensor &like, int64_t b, int64_t h, int64_t n, int64_t d) {
    if (token_major(like))
        return torch::stable::transpose(torch::stable::new_empty(like, {b, n, h, d}), 1, 2);
    return torch::stable::new_empty(like, {b, h, n, d});
}

// The kernels take the row max on raw scores and scale inside the exp (attention/mask.cuh's logit_map), which
// needs scale > 0 as the float they use, with scale * log2(e) finite.
inline void check_scale(double scale) {
    STD_TORCH_CHECK(scale > 0.0, "attn_qat: the attention ops take softmax scale > 0, got ", scale,
                    " (the Python entry points pass a negative scale as -q and -scale, zero as zero queries)");
    const float exp_scale = (float)scale * AQ_LOG2E;
    STD_TORCH_CHECK((float)scale > 0.0f && std::isfinite(exp_scale), "attn_qat: softmax scale ", scale,
                    " is outside what the kernels take as a float (above 0 and below about 2e38)");
}

// The operand of numerics.md §2's pre-pass, fake-quantized in its own layout (quantize_ops.cpp).
Tensor fake_quantize_operand(const Tensor &x, bool along_tokens);

} // namespace aq_ops
