// The decode op on the NVFP4 KV cache (attn_qat/kv_cache.py): CUDA only, NVFP4KVCache.attention takes its composite
// path on the CPU.
#include "binding/ops.h"

#ifdef AQ_WITH_CUDA
namespace aq_ops {
namespace {

const char *kv_cache_decode_no_cpu(const aq_decode_params *) {
    return "kv_cache_decode has no CPU kernel (NVFP4KVCache.attention takes its composite path on the CPU)";
}

} // namespace

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
        STD_TORCH_CHECK(t->is_cuda() && q.is_cuda() && same_device(*t, q),
                        "attn_qat: kv_cache_decode: q and the cache must be on one CUDA device");
        STD_TORCH_CHECK(t->scalar_type() == ScalarType::Byte, "attn_qat: kv_cache_decode: codes and scales are uint8");
    }
    for (const Tensor *t : {&lengths, &block_table})
        STD_TORCH_CHECK(t->is_contiguous() && same_device(*t, q),
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

} // namespace aq_ops
#endif
