/* Hopper (sm_90a) primitives for the attention kernels: mbarriers, TMA tile loads, warpgroup MMA (wgmma) and
   its shared-memory matrix descriptors, register reallocation. Thin inline-PTX wrappers, named after the PTX they
   emit (PTX ISA 8.x: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate", "Tensor Copy", "mbarrier").
   Device code only, each function needing sm_90a: callers compile them only where AQ_SM90_ENABLED is 1 (the host
   side of the Hopper kernels: sm90/tensor_map.h, attention/dispatch.cu). */
#pragma once

#include <stdint.h>

#include "attention/fragments.cuh"

/* Device code for sm_90a (wgmma, setmaxnreg) is generated only in the sm_90a pass of nvcc; the host pass and the
   passes for other targets see the kernels' bodies as empty. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define AQ_SM90_ENABLED 1
#else
#define AQ_SM90_ENABLED 0
#endif

#define SM90_PANEL 64 /* 16-bit columns per 128-byte swizzled panel (one TMA box row, one wgmma swizzle atom) */

AQ_D uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* ------------------------------------------------------------------------------------------------
   mbarrier: a shared-memory barrier that completes a phase when `count` arrivals and the expected transaction
   bytes (TMA) have both come in. Waiters name the parity of the phase they wait for (0, 1, 0, ... per round). */

AQ_D void mbar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

/* Makes the initialised barriers visible to the async proxy (TMA) before any thread uses them. */
AQ_D void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

AQ_D void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

/* One arrival that also announces `bytes` of TMA data to come. */
AQ_D void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

/* Announces `bytes` of TMA data to come without arriving: for a producer that starts the copy first and arrives
   later, after its own writes into the stage. */
AQ_D void mbar_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

/* Spins until the phase of the given parity has completed. A fresh barrier counts its phase "1" as completed,
   so a producer's first wait on an empty slot (parity 1) passes at once. */
AQ_D void mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}

/* ------------------------------------------------------------------------------------------------
   TMA: copies a box of a 4-D tensor (coordinates innermost first) into shared memory and signals `bar` with its
   byte count. Out-of-bounds elements arrive as zeros, and nothing outside the tensor is read. */
AQ_D void tma_load_4d(void *smem_dst, const void *tensor_map, uint64_t *bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(smem_addr(smem_dst)),
        "l"((uint64_t)tensor_map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
        : "memory");
}

AQ_D void tma_prefetch_descriptor(const void *tensor_map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)tensor_map) : "memory");
}

/* ------------------------------------------------------------------------------------------------
   Register reallocation between warpgroups (setmaxnreg): the producer gives registers back, the consumers take
   them. All warps of a warpgroup execute the same one. */
template <int N>
AQ_D void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
AQ_D void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads'. */
AQ_D void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/* Arrive at named barrier `id` without waiting: the other side of a named_barrier_sync of `threads` in all. */
AQ_D void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/* Four 8x8 16-bit matrices from the registers of a warp (each lane holds row lane / 4, columns 2 (lane % 4) and +1
   of matrix i in r[i], the mma.sync fragment layout) to shared memory: lane l gives the address of row l % 8 of
   matrix l / 8. */
AQ_D void stmatrix_x4(const void *row, const uint32_t r[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row)), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

/* Orders this thread's earlier shared-memory writes before later reads by the async proxy (wgmma operands, TMA
   stores); a barrier then extends the order to the threads that issue those. */
AQ_D void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* Bulk copy engine (the TMA unit, without a tensor map): g[0 .. bytes/4) += the floats at s in shared memory, as one
   asynchronous reduction (bytes and both addresses multiples of 16). commit closes a group of them; wait_read<N>
   returns when at most N groups still read shared memory, wait_all<N> when at most N are still in flight. */
AQ_D void bulk_reduce_add_f32(float *g, const void *s, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(g),
                 "r"(smem_addr(s)), "r"(bytes)
                 : "memory");
}
AQ_D void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
AQ_D void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
AQ_D void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

/* ------------------------------------------------------------------------------------------------
   wgmma shared-memory operands. Every tile here is stored the way TMA writes it with 128-byte swizzling: panels
   of 64 16-bit columns, each panel [rows][64] with row r at byte 128 r and its eight 16-byte chunks permuted by
   chunk ^= r % 8; panels 1024-byte aligned. The descriptor of such a tile (PTX "Matrix Descriptor Format"):
   start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29, stride byte offset >> 4 in 32-45,
   swizzle mode 1 (128 B) in bits 62-63.
   K-major operand (the contraction runs along the 64 columns: Q and K in S = Q K^T): start = panel + 32 bytes per
     16 columns; stride byte offset = 1024 (from one 8-row group to the next); leading byte offset unused.
   MN-major operand (the contraction runs along the rows: V in O = P V): start = panel + 16 rows * 128 bytes per
     k-step; stride byte offset = 1024 (8 rows); leading byte offset = the distance between 64-column panels. */
AQ_D uint64_t smem_descriptor(const void *start, uint32_t leading_bytes, uint32_t stride_bytes) {
    return (uint64_t)((smem_addr(start) & 0x3FFFFu) >> 4) | ((uint64_t)(leading_bytes >> 4) << 16) |
           ((uint64_t)(stride_bytes >> 4) << 32) | (1ull << 62);
}

/* The dynamic shared memory base rounded up to the 1024 bytes the swizzled panels need (allocate 1024 more). */
AQ_D unsigned char *align1024(unsigned char *p) { return p + ((1024 - (smem_addr(p) & 1023)) & 1023); }

/* A descriptor moved `bytes` further into its tile: only the start address field changes, and it cannot carry out
   (shared addresses are below 2^18). The helpers below build a tile's descriptor once and add constants to it, so
   that ptxas keeps the base in a uniform register and issues a wgmma after one uniform add instead of rebuilding the
   masked and shifted address (about ten instructions and a register-to-uniform move per wgmma). */
AQ_D uint64_t desc_plus(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

/* Rows [row0, row0 + 64) x columns [16 kk, 16 kk + 16) of a K-major tile of `rows` rows. */
AQ_D uint64_t k_major_desc(const unsigned char *tile, int rows, int row0, int kk) {
    return desc_plus(smem_descriptor(tile + row0 * 128, 16, 1024), (kk / 4) * rows * 128 + (kk % 4) * 32);
}

/* Rows [16 kb, 16 kb + 16) x all columns of an MN-major tile of `rows` rows (its panels rows * 128 bytes apart). */
AQ_D uint64_t mn_major_desc(const unsigned char *tile, int rows, int kb) {
    return desc_plus(smem_descriptor(tile, rows * 128, 1024), kb * 16 * 128);
}

/* The warpgroup of this thread, broadcast from lane 0 so that the compiler knows it is the same across the warp
   and keeps what derives from it (tile offsets, descriptors) in uniform registers. */
AQ_D int warpgroup_index() { return __shfl_sync(0xFFFFFFFFu, (int)threadIdx.x / 128, 0); }

/* TMA of token rows [row0, row0 + rows) of head h, batch b (a 4-D map with boxes of 64 columns x rows) into a tile
   of D / 64 panels, all signalling `bar`. */
template <int D>
AQ_D void tma_load_rows(unsigned char *tile, const void *map, uint64_t *bar, int rows, int row0, int h, int b) {
#pragma unroll
    for (int pn = 0; pn < D / SM90_PANEL; pn++) tma_load_4d(tile + pn * rows * 128, map, bar, pn * SM90_PANEL, row0, h, b);
}

/* The reverse of tma_load_4d: a box of shared memory, laid out as tma_load_4d would have written it, to the tensor
   at the given coordinates; elements outside the tensor are not written. Asynchronous (bulk groups): the shared
   memory must stay as it is until bulk_wait_read says the copy has read it. */
AQ_D void tma_store_4d(const void *tensor_map, const void *smem_src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                     (uint64_t)tensor_map),
                 "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

/* A warp's 16 x D fp32 C fragments (acc[n] = columns 8n .. 8n+7), as DT, into rows row0 .. row0 + 15 of a tile of
   `rows` rows in shared memory laid out as TMA writes one (tma_load_rows): one stmatrix per 16 columns. The swizzle
   (chunk ^ row % 8) is TMA's only when the tile is 1024-byte aligned and rows and row0 are multiples of 8, as at
   every call. */
template <int D, aq_dtype DT>
AQ_D void stage_fragment_rows(const float (&acc)[D / 8][4], unsigned char *tile, int rows, int row0) {
    const int lane = (int)threadIdx.x & 31, mat = lane / 8, row = row0 + (mat & 1) * 8 + (lane & 7);
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
        const uint32_t r[4] = {pack2<DT>(acc[n][0], acc[n][1]), pack2<DT>(acc[n][2], acc[n][3]),
                               pack2<DT>(acc[n + 1][0], acc[n + 1][1]), pack2<DT>(acc[n + 1][2], acc[n + 1][3])};
        const int block = n + (mat >> 1); /* the 8-column block (16 bytes) this lane's row address is in */
        stmatrix_x4(tile + (block / 8 * rows + row) * 128 + (((block % 8) ^ (row & 7)) << 4), r);
    }
}

/* Then those 16 rows of the tile to global rows row0_global .. + 15 of (b, h) through `map` (tensor map with boxes
   of 16 rows: make_tensor_map): rows past the tensor's end are not written. Lane 0 issues the copies as one bulk
   group; the tile must stay untouched until its bulk_wait_read. Writing through the copy engine is what makes this
   cheaper than stores from registers: 4-byte stores of 16 rows x D fill only half of each 32-byte sector they touch,
   and a warp's stores then wait on the memory pipe (performance.md v18). */
template <int D>
AQ_D void tma_store_warp_rows(const void *map, const unsigned char *tile, int rows, int row0, int row0_global, int h,
                              int b) {
    fence_proxy_async_shared();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int pn = 0; pn < D / SM90_PANEL; pn++)
            tma_store_4d(map, tile + (pn * rows + row0) * 128, pn * SM90_PANEL, row0_global, h, b);
        bulk_commit();
    }
}

/* Ordering of wgmma with the registers and shared memory around it: fence before the first wgmma that reads
   registers written since the last one; commit closes a group; wait_group<N> waits until at most N groups are
   in flight. */
AQ_D void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
AQ_D void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
AQ_D void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* The accumulators of an in-flight wgmma are written behind the compiler's back: after wgmma_wait, this makes
   every register of acc look freshly defined, so no read of it is scheduled before the wait. */
template <int R>
AQ_D void fence_registers(float (&acc)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(acc[i][e])::"memory");
}

/* The same for a register A operand: after the wait, so that its registers stay live (and unreused) for as long
   as the wgmma that reads them may still be running. */
template <int R>
AQ_D void fence_registers(uint32_t (&a)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(a[i][e])::"memory");
}

/* wgmma.mma_async m64nNk16 with fp32 accumulation, one definition for every shape N and element type DT:
   d (64 x N, fp32) = (accumulate ? d : 0) + A (64 x 16) * B (16 x N, shared; K-major, or MN-major when TRANS_B).
   wgmma_ss: A in shared memory (K-major, or MN-major when TRANS_A); wgmma_rs: A in registers, each warp holding its
   16 rows as the mma.sync m16n8k16 A fragment. In the inline PTX, d's N / 2 registers are operands %0 .. %(N/2 - 1)
   (AQ_WGMMA_D<N> lists them, AQ_WGMMA_R<N> names them); the instruction's other operands follow them, so each shape
   spells out their numbers, from N / 2 on (the preprocessor cannot add). */
#define AQ_WGMMA_D4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define AQ_WGMMA_D32 AQ_WGMMA_D4(0), AQ_WGMMA_D4(1), AQ_WGMMA_D4(2), AQ_WGMMA_D4(3)
#define AQ_WGMMA_D64 AQ_WGMMA_D32, AQ_WGMMA_D4(4), AQ_WGMMA_D4(5), AQ_WGMMA_D4(6), AQ_WGMMA_D4(7)
#define AQ_WGMMA_D128                                                                                               \
    AQ_WGMMA_D64, AQ_WGMMA_D4(8), AQ_WGMMA_D4(9), AQ_WGMMA_D4(10), AQ_WGMMA_D4(11), AQ_WGMMA_D4(12), AQ_WGMMA_D4(13), \
        AQ_WGMMA_D4(14), AQ_WGMMA_D4(15)
#define AQ_WGMMA_D256                                                                                               \
    AQ_WGMMA_D128, AQ_WGMMA_D4(16), AQ_WGMMA_D4(17), AQ_WGMMA_D4(18), AQ_WGMMA_D4(19), AQ_WGMMA_D4(20),             \
        AQ_WGMMA_D4(21), AQ_WGMMA_D4(22), AQ_WGMMA_D4(23), AQ_WGMMA_D4(24), AQ_WGMMA_D4(25), AQ_WGMMA_D4(26),         \
        AQ_WGMMA_D4(27), AQ_WGMMA_D4(28), AQ_WGMMA_D4(29), AQ_WGMMA_D4(30), AQ_WGMMA_D4(31)
#define AQ_WGMMA_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define AQ_WGMMA_R64 AQ_WGMMA_R32 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define AQ_WGMMA_R128                                                                                               \
    AQ_WGMMA_R64 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"                 \
                 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define AQ_WGMMA_R256                                                                                               \
    AQ_WGMMA_R128 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"                \
                  ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"                \
                  ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"    \
                  ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

/* The instruction of shape N in element type TYPE: A_B, the text of the A and B operands; P, the accumulate flag's
   operand; TRANS, the transpose immediates'; then the input operands. AQ_WGMMA_DT picks TYPE from DT. */
#define AQ_WGMMA(N, TYPE, A_B, P, TRANS, ...)                                                                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                                                      \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " "                                 \
                 "{" AQ_WGMMA_R##N "}, " A_B ", p, 1, 1, " TRANS ";\n}\n"                                           \
                 : AQ_WGMMA_D##N                                                                                   \
                 : __VA_ARGS__)
#define AQ_WGMMA_DT(N, A_B, P, TRANS, ...)                                                                          \
    if constexpr (DT == AQ_BFLOAT16) AQ_WGMMA(N, "bf16", A_B, P, TRANS, __VA_ARGS__);                               \
    else AQ_WGMMA(N, "f16", A_B, P, TRANS, __VA_ARGS__)

/* A and B by descriptor: operands desc_a, desc_b, accumulate, TRANS_B, TRANS_A numbered A, B, P, TB, TA. */
#define AQ_WGMMA_SS(N, A, B, P, TB, TA)                                                                             \
    AQ_WGMMA_DT(N, "%" #A ", %" #B, "%" #P, "%" #TA ", %" #TB, "l"(desc_a), "l"(desc_b), "r"(accumulate),           \
                "n"(TRANS_B), "n"(TRANS_A))

/* A from registers: operands a[0 .. 3], desc_b, accumulate, TRANS_B numbered A0 .. A3, B, P, TB. */
#define AQ_WGMMA_RS(N, A0, A1, A2, A3, B, P, TB)                                                                    \
    AQ_WGMMA_DT(N, "{%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B, "%" #P, "%" #TB, "r"(a[0]), "r"(a[1]),          \
                "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))

template <int N, aq_dtype DT, int TRANS_B, int TRANS_A = 0>
AQ_D void wgmma_ss(float (&d)[N / 8][4], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    static_assert(N == 32 || N == 64 || N == 128, "wgmma_ss N: 32, 64 or 128");
    if constexpr (N == 32) {
        AQ_WGMMA_SS(32, 16, 17, 18, 19, 20);
    } else if constexpr (N == 64) {
        AQ_WGMMA_SS(64, 32, 33, 34, 35, 36);
    } else {
        AQ_WGMMA_SS(128, 64, 65, 66, 67, 68);
    }
}

template <int N, aq_dtype DT, int TRANS_B>
AQ_D void wgmma_rs(float (&d)[N / 8][4], const uint32_t a[4], uint64_t desc_b, int accumulate) {
    static_assert(N == 64 || N == 128 || N == 256, "wgmma N: 64, 128 or 256");
    if constexpr (N == 64) {
        AQ_WGMMA_RS(64, 32, 33, 34, 35, 36, 37, 38);
    } else if constexpr (N == 256) {
        AQ_WGMMA_RS(256, 128, 129, 130, 131, 132, 133, 134);
    } else {
        AQ_WGMMA_RS(128, 64, 65, 66, 67, 68, 69, 70);
    }
}

#undef AQ_WGMMA_RS
#undef AQ_WGMMA_SS
#undef AQ_WGMMA_DT
#undef AQ_WGMMA
#undef AQ_WGMMA_R256
#undef AQ_WGMMA_R128
#undef AQ_WGMMA_R64
#undef AQ_WGMMA_R32
#undef AQ_WGMMA_D256
#undef AQ_WGMMA_D128
#undef AQ_WGMMA_D64
#undef AQ_WGMMA_D32
#undef AQ_WGMMA_D4
