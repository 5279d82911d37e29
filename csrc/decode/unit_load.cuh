/* A 16-token unit of the NVFP4 KV cache from its page pools into a warp's ring in shared memory: the unit's pool slot
   from the block table, then cp.async copies of its codes and scales (docs/kv_cache_layout.md, "Pages"). */
#pragma once

#include "decode/decode_geometry.cuh"

AQ_D void cp_async16(void *smem, const void *gmem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
AQ_D void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
AQ_D void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

/* The cache's four packed page pools. */
typedef struct {
    const uint8_t *k_codes, *k_scales, *v_codes, *v_scales;
} page_pools;

/* Pool unit of the sequence's unit u from its block-table entry `page`: (page * Hkv + hk) * page_units + the unit's
   place in its page, u % page_units = `in_page`. A page outside the pool is never read: the CTA reads pool unit 0
   instead and sets bad_page, so its results turn NaN (a corrupt block table must not give plausible output). */
AQ_D uint32_t unit_slot_of(const aq_decode_params &p, int32_t page, uint32_t in_page, int hk, uint32_t page_units,
                            bool &bad_page) {
    const bool ok = page >= 0 && page < p.num_pages;
    bad_page |= !ok;
    return ok ? ((uint32_t)page * (uint32_t)p.heads_kv + hk) * page_units + in_page : 0u;
}

/* Issues the cp.async copies of the unit stored at pool unit `slot` (all its bytes, 16 per copy, spread over the
   warp's lanes) into st. A pool unit is 16 tokens of one (page, KV head): its K and V codes are 8 D bytes each and
   its K and V scales D bytes each, at slot * 8 D and slot * D of the pools, and chunk c of every block is 16 c bytes
   in, so the lane's chunks lane + 32 j of all four buffers come from two offsets. In V's padded stage rows, chunk c
   is pair row c / (D/16), column 16 (c % (D/16)). */
template <int D>
AQ_D void load_unit(unsigned char *st, const page_pools &pools, uint32_t slot, int lane) {
    using U = UnitLayout<D>;
    constexpr int CHUNKS = 8 * D / 16 / 32, ROW_CHUNKS = D / 16; /* a lane's chunks of a code block; a V row's */
    const uint64_t codes = (uint64_t)slot * (8 * D) + 16 * lane, scales = (uint64_t)slot * D + 16 * lane;
    unsigned char *v_stage = st + U::V_CODES + (lane / ROW_CHUNKS) * U::V_ROW + 16 * (lane % ROW_CHUNKS);
#pragma unroll
    for (int j = 0; j < CHUNKS; j++) {
        cp_async16(st + U::K_CODES + 16 * lane + 512 * j, pools.k_codes + codes + 512 * j);
        cp_async16(v_stage + (32 / ROW_CHUNKS) * j * U::V_ROW, pools.v_codes + codes + 512 * j);
    }
    if (lane < D / 16) {
        cp_async16(st + U::K_SCALES + 16 * lane, pools.k_scales + scales);
        cp_async16(st + U::V_SCALES + 16 * lane, pools.v_scales + scales);
    }
}
