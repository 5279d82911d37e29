// The attn_qat ops in PyTorch's op registry: their schemas, and one list of kernels for both dispatch keys (each op
// function serves both devices: `launch` picks the kernel by the tensors' device).
#include "binding/ops.h"

using torch::stable::detail::StableLibrary;

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
    m.def("kv_cache_append(Tensor k, Tensor v, Tensor? counts, Tensor(a!) lengths, Tensor block_table, "
          "Tensor(b!) k_codes, Tensor(c!) k_scales, Tensor(d!) v_codes, Tensor(e!) v_scales) -> ()");
}

// The kernels of every op for one dispatch key; kv_cache_decode has only a CUDA kernel.
static void register_kernels(StableLibrary &m, bool cuda) {
    m.impl("nvfp4_quantize", TORCH_BOX(&aq_ops::nvfp4_quantize));
    m.impl("nvfp4_fake_quantize", TORCH_BOX(&aq_ops::nvfp4_fake_quantize));
    m.impl("nvfp4_dequantize", TORCH_BOX(&aq_ops::nvfp4_dequantize));
    m.impl("fake_quantize_qkv", TORCH_BOX(&aq_ops::fake_quantize_qkv));
    m.impl("attention_forward", TORCH_BOX(&aq_ops::attention_forward));
    m.impl("attention_backward", TORCH_BOX(&aq_ops::attention_backward));
    m.impl("attention_forward_prequantized", TORCH_BOX(&aq_ops::attention_forward_prequantized));
    m.impl("p_fp16_path", TORCH_BOX(&aq_ops::p_fp16_path));
    m.impl("kv_cache_append", TORCH_BOX(&aq_ops::kv_cache_append));
#ifdef AQ_WITH_CUDA
    if (cuda) m.impl("kv_cache_decode", TORCH_BOX(&aq_ops::kv_cache_decode));
#else
    (void)cuda;
#endif
}

STABLE_TORCH_LIBRARY_IMPL(attn_qat, CPU, m) { register_kernels(m, false); }

#ifdef AQ_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(attn_qat, CUDA, m) { register_kernels(m, true); }
#endif
