/* The Hopper kernels' tile shapes, in one place: the kernels are built from them (attention_fwd_sm90.cu,
   attention_bwd_sm90.cu), and binding/module.c exports them so that attn_qat/varlen.py sizes a work item as the
   kernels do. Plain C for the module; constexpr, host and device, for the kernels' templates. */
#pragma once

#if defined(__CUDACC__)
#define SM90_SHAPE static constexpr __host__ __device__
#elif defined(__cplusplus)
#define SM90_SHAPE static constexpr
#else
#define SM90_SHAPE static inline
#endif

/* Forward: consumer warpgroups of 64 query rows each. Three in bf16 mode at D = 128, where their 160 registers
   suffice and a third softmax hides more of the others' waits; two for the quantized kernels, whose P fake-quant
   needs the registers, and at D = 64 (performance.md records the measurements). */
SM90_SHAPE int sm90_consumer_warpgroups(int d, int quantize_p) { return !quantize_p && d == 128 ? 3 : 2; }

/* Forward: keys per tile. 128 fills the wgmma N for S; 64 with the second accumulator O' and its P̂ registers
   (128 spills there, at D = 64 too), with three consumer warpgroups (160 registers each), and at D = 256, where a
   ring of 128-key K and V tiles does not fit in shared memory beside Q. */
SM90_SHAPE int sm90_keys_per_tile(int d, int with_o_prime, int nwg) {
    return with_o_prime || nwg == 3 || d == 256 ? 64 : 128;
}

/* dK/dV: an item is a tile of BWD90_KEYS keys of a KV head, which visits its queries BWD90_Q_STEP at a time. */
#define BWD90_KEYS 128
#define BWD90_Q_STEP 64
