// The NVFP4 KV cache's ops (attn_qat/kv_cache.py): the append (CPU and CUDA) and the decode (CUDA only;
// NVFP4KVCache.attention takes its composite path on the CPU).
#include "binding/ops.h"
#include "decode/kv_append.h"

namespace aq_ops {
namespace {

std::vector<int64_t> sizes_of(const Tensor &t) { return std::vector<int64_t>(t.sizes().begin(), t.sizes().end()); }

} // namespace

// Appends k, v (B, Hkv, T, D), the first counts[b] tokens of each sequence (every token without counts), to the page
// pools at positions lengths[b] onwards (block_table as for the decode), then advances lengths: kv_append.h.
void kv_cache_append(Tensor k, Tensor v, std::optional<Tensor> counts, Tensor lengths, Tensor block_table,
                     Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales) {
    STD_TORCH_CHECK(k.dim() == 4 && sizes_of(k) == sizes_of(v),
                    "attn_qat: kv_cache_append: k and v must be (batch, heads_kv, tokens, head_dim), the same shape");
    STD_TORCH_CHECK(k.scalar_type() == v.scalar_type(), "attn_qat: kv_cache_append: k and v must have one dtype");
    const int64_t batch = k.size(0), heads_kv = k.size(1), tokens = k.size(2), dim = k.size(3);
    STD_TORCH_CHECK(dim % 16 == 0 && k_codes.dim() == 4,
                    "attn_qat: kv_cache_append: head_dim must be a multiple of 16 and the pools 4-D");
    const int64_t pages = k_codes.size(0), page_size = k_codes.size(2);
    const std::vector<std::pair<const Tensor *, std::vector<int64_t>>> pools = {
        {&k_codes, {pages, heads_kv, page_size, dim / 2}}, {&k_scales, {pages, heads_kv, page_size, dim / 16}},
        {&v_codes, {pages, heads_kv, page_size / 2, dim}}, {&v_scales, {pages, heads_kv, page_size / 16, dim}},
    };
    for (const auto &[t, shape] : pools) {
        STD_TORCH_CHECK(sizes_of(*t) == shape && t->is_contiguous() && t->scalar_type() == ScalarType::Byte,
                        "attn_qat: kv_cache_append: the pools must be contiguous uint8, shaped as NVFP4KVCache's for "
                        "the keys' heads and head_dim");
        STD_TORCH_CHECK(same_device(*t, k), "attn_qat: kv_cache_append: k, v and the cache must be on one device");
    }
    STD_TORCH_CHECK(same_device(v, k), "attn_qat: kv_cache_append: k, v and the cache must be on one device");
    STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == batch && lengths.scalar_type() == ScalarType::Long &&
                        lengths.is_contiguous() && same_device(lengths, k),
                    "attn_qat: kv_cache_append: lengths must be a contiguous int64 (batch,) tensor on k's device");
    STD_TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == batch && block_table.size(1) >= 1 &&
                        block_table.scalar_type() == ScalarType::Int && block_table.is_contiguous() &&
                        same_device(block_table, k),
                    "attn_qat: kv_cache_append: block_table must be a contiguous int32 (batch, pages_per_seq) tensor "
                    "on k's device");
    if (counts.has_value())
        STD_TORCH_CHECK(counts->dim() == 1 && counts->size(0) == batch && counts->scalar_type() == ScalarType::Long &&
                            counts->is_contiguous() && same_device(*counts, k),
                        "attn_qat: kv_cache_append: counts must be a contiguous int64 (batch,) tensor on k's device");
    // channels contiguous: the kernels read a block's 16 values in a row
    if (k.stride(3) != 1) k = torch::stable::contiguous(k);
    if (v.stride(3) != 1) v = torch::stable::contiguous(v);
    aq_kv_append_params p = {};
    p.dtype = attention_dtype(k);
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    for (int d = 0; d < 3; d++) {
        p.k_stride[d] = k.stride(d);
        p.v_stride[d] = v.stride(d);
    }
    p.counts = counts.has_value() ? static_cast<const int64_t *>(counts->data_ptr()) : nullptr;
    p.lengths = static_cast<int64_t *>(lengths.data_ptr());
    p.block_table = static_cast<const int32_t *>(block_table.data_ptr());
    p.k_codes = static_cast<uint8_t *>(k_codes.data_ptr());
    p.k_scales = static_cast<uint8_t *>(k_scales.data_ptr());
    p.v_codes = static_cast<uint8_t *>(v_codes.data_ptr());
    p.v_scales = static_cast<uint8_t *>(v_scales.data_ptr());
    p.batch = batch;
    p.heads_kv = heads_kv;
    p.tokens = tokens;
    p.head_dim = dim;
    p.num_pages = pages;
    p.page_size = page_size;
    p.pages_per_seq = block_table.size(1);
    launch(k, p, aq_kv_cache_append_cpu, [&](void *stream) { return aq_kv_cache_append_cuda(&p, stream); });
}

} // namespace aq_ops

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
    if (reinterpret_cast<uintptr_t>(qc.data_ptr()) % 16) { // the kernel reads q's rows 16 bytes at a time
        qc = torch::stable::new_empty(q, {batch, heads_q, tokens, dim});
        torch::stable::copy_(qc, q);
    }
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
