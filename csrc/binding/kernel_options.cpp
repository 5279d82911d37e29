// The process's CUDA kernel options (attn_qat.h): read from the environment once, when the library loads; set at
// run time through attn_qat._C (module.c), which attn_qat.ops.kernel_options wraps.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "attn_qat.h"

namespace {

// ATTN_QAT_SM90: "0" keeps the Hopper kernels out. ATTN_QAT_TAIL_SPLIT: unset or empty, the plan decides; "T,S"
// forces the last T items into S parts; anything else never splits. ATTN_QAT_DECODE_VARIANT (0-3) and
// ATTN_QAT_DECODE_CHUNK (keys): the decode kernel's variant and chunk for A/B runs; other values keep the defaults.
// ATTN_QAT_WORK_ORDER: "index" runs packed calls' items in index order (their LPT tables ignored; A/B runs).
// ATTN_QAT_PAD_HEAD_DIMS: "0" never pads head dims for the Hopper kernels, "1" always (the CPU too).
// ATTN_QAT_SM90_D256: "1" lets the Hopper forward without O' take D = 256.
aq_kernel_options from_environment() {
    aq_kernel_options o = {1, AQ_TAIL_SPLIT_AUTO, 0, 0, -1, 0, 0, -1, 0};
    const char *sm90 = std::getenv("ATTN_QAT_SM90");
    o.sm90 = !(sm90 != nullptr && sm90[0] == '0');
    const char *split = std::getenv("ATTN_QAT_TAIL_SPLIT");
    long tail = 0, splits = 0;
    if (split != nullptr && split[0] != '\0')
        o.tail_split = std::sscanf(split, "%ld,%ld", &tail, &splits) == 2 ? AQ_TAIL_SPLIT_FORCED : AQ_TAIL_SPLIT_OFF;
    if (o.tail_split == AQ_TAIL_SPLIT_FORCED) o.forced_tail = tail, o.forced_splits = splits;
    const char *variant = std::getenv("ATTN_QAT_DECODE_VARIANT");
    int v = -1;
    if (variant != nullptr && std::sscanf(variant, "%d", &v) == 1 && v >= 0 && v < AQ_DECODE_VARIANTS)
        o.decode_variant = v;
    const char *chunk = std::getenv("ATTN_QAT_DECODE_CHUNK");
    long c = 0;
    if (chunk != nullptr && std::sscanf(chunk, "%ld", &c) == 1 && aq_decode_chunk_valid(c)) o.decode_chunk = c;
    const char *order = std::getenv("ATTN_QAT_WORK_ORDER");
    o.index_order = order != nullptr && std::strcmp(order, "index") == 0;
    const char *pad = std::getenv("ATTN_QAT_PAD_HEAD_DIMS");
    if (pad != nullptr && (std::strcmp(pad, "0") == 0 || std::strcmp(pad, "1") == 0)) o.pad_head_dims = pad[0] - '0';
    const char *d256 = std::getenv("ATTN_QAT_SM90_D256");
    o.sm90_d256 = d256 != nullptr && std::strcmp(d256, "1") == 0;
    return o;
}

std::mutex options_mutex; // the calls that plan may run on other threads than the one that sets
aq_kernel_options options = from_environment();

} // namespace

extern "C" aq_kernel_options aq_get_kernel_options(void) {
    std::lock_guard<std::mutex> lock(options_mutex);
    return options;
}

extern "C" void aq_set_kernel_options(const aq_kernel_options *o) {
    std::lock_guard<std::mutex> lock(options_mutex);
    options = *o;
}
