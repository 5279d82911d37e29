// The op functions behind torch.ops.attn_qat, one file per family; registry.cpp declares their schemas and registers
// them for the CPU and CUDA dispatch keys.
#pragma once
#include "binding/tensors.h"

namespace aq_ops {

// quantize_ops.cpp: NVFP4 quantization (numerics.md §1) and the Q/K/V pre-pass (§2)
std::tuple<Tensor, Tensor> nvfp4_quantize(Tensor x, int64_t axis);
Tensor nvfp4_fake_quantize(Tensor x, int64_t axis);
Tensor nvfp4_dequantize(Tensor codes, Tensor scales, int64_t axis, int64_t axis_len, ScalarType dtype);
std::tuple<Tensor, Tensor, Tensor> fake_quantize_qkv(Tensor q, Tensor k, Tensor v, bool v_along_tokens);

// attention_ops.cpp: the attention forward and backward (numerics.md §3-§5) and P's fp16 path
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
attention_forward(Tensor q, Tensor k, Tensor v, std::optional<Tensor> mask, double scale, int64_t causal, int64_t mode,
                  bool need_grad, bool v_along_tokens, std::optional<Tensor> q_span, std::optional<Tensor> k_span,
                  std::optional<Tensor> fwd_order, std::optional<Tensor> dkdv_order);
std::tuple<Tensor, Tensor, Tensor> attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor out_prime, std::optional<Tensor> mask, Tensor frame,
                                                      Tensor row_sum, double scale, int64_t causal, int64_t mode,
                                                      bool deterministic, bool v_along_tokens,
                                                      bool operands_quantized, std::optional<Tensor> q_span,
                                                      std::optional<Tensor> k_span, std::optional<Tensor> dkdv_order);
std::tuple<Tensor, Tensor, Tensor> attention_forward_prequantized(Tensor q, Tensor k, Tensor v,
                                                                  std::optional<Tensor> mask, double scale,
                                                                  int64_t causal);
std::tuple<Tensor, Tensor> p_fp16_path(Tensor x);

// decode_op.cpp: the NVFP4 KV cache's append (attn_qat/kv_cache.py)
void kv_cache_append(Tensor k, Tensor v, std::optional<Tensor> counts, Tensor lengths, Tensor block_table,
                     Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales);

#ifdef AQ_WITH_CUDA
// decode_op.cpp: decode on the NVFP4 KV cache (attn_qat/kv_cache.py), CUDA only
Tensor kv_cache_decode(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, Tensor lengths,
                       Tensor block_table, int64_t max_length, double scale, bool causal);
#endif

} // namespace aq_ops
