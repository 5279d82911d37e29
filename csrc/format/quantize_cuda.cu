/* NVFP4 quantize / fake-quantize / dequantize on the GPU: one thread per 16-element block.
   Memory-bound; the block rule itself is nvfp4.h's, shared with the CPU kernels. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attn_qat.h"
#include "format/nvfp4.h"

// ----------------------------------------------------------------------------------------------
// CUDA kernels

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// An element's bits in the low bits of a 32-bit word, and back.
template <typename T> __device__ __forceinline__ T from_bits(uint32_t w);
template <> __device__ __forceinline__ float from_bits<float>(uint32_t w) { return __uint_as_float(w); }
template <> __device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(uint32_t w) { return __ushort_as_bfloat16((unsigned short)w); }
template <> __device__ __forceinline__ __half from_bits<__half>(uint32_t w) { return __ushort_as_half((unsigned short)w); }
template <typename T> __device__ __forceinline__ uint32_t to_bits(T x);
template <> __device__ __forceinline__ uint32_t to_bits<float>(float x) { return __float_as_uint(x); }
template <> __device__ __forceinline__ uint32_t to_bits<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
template <> __device__ __forceinline__ uint32_t to_bits<__half>(__half x) { return __half_as_ushort(x); }

// Raw storage of N bytes, for vector loads and stores.
template <int N> struct Bytes;
template <> struct Bytes<2> { using type = unsigned short; };
template <> struct Bytes<4> { using type = unsigned int; };
template <> struct Bytes<8> { using type = uint2; };
template <> struct Bytes<16> { using type = uint4; };

// Index arithmetic runs in I: uint32_t whenever the element count allows, because 64-bit division is a
// ~70-instruction subroutine on the GPU and would cost more than the quantization itself.
template <typename I>
__device__ __forceinline__ int64_t outer_offset(const aq_quantize_params &p, I o) {
    const I o1 = (I)p.outer[1], o2 = (I)p.outer[2];
    return (int64_t)(o / (o1 * o2)) * p.stride_outer[0] + (int64_t)(o / o2 % o1) * p.stride_outer[1] +
           (int64_t)(o % o2) * p.stride_outer[2];
}

// x viewed as (outer[0..2], axis_len, inner) with any strides, outer = their product; codes
// (outer, ceil(axis_len/2), inner), scales (outer, ceil(axis_len/16), inner), fake (outer, axis_len,
// inner), all contiguous.
//
// Blocked axis innermost and contiguous (Q, K along head_dim): one thread per 16-element block, read
// with 16-byte loads, its 8 code bytes and 16 fake values written at once. Needs axis_len % 16 == 0 and
// 16-byte alignment.
template <typename T, typename I>
__global__ void __launch_bounds__(256) quantize_rows_kernel(aq_quantize_params p) {
    constexpr int per_vec = 16 / sizeof(T);
    const I nblocks = (I)(p.axis_len / AQ_BLOCK);
    const I idx = blockIdx.x * (I)blockDim.x + threadIdx.x;
    if (idx >= (I)(p.outer[0] * p.outer[1] * p.outer[2]) * nblocks) return;
    const I blk = idx % nblocks, o = idx / nblocks;
    float v[AQ_BLOCK];
    const uint4 *src = (const uint4 *)((const T *)p.x + outer_offset(p, o) + (int64_t)blk * AQ_BLOCK);
    uint4 raw[AQ_BLOCK / per_vec];
#pragma unroll
    for (int c = 0; c < AQ_BLOCK / per_vec; c++) raw[c] = __ldg(src + c); // all loads in flight before use
#pragma unroll
    for (int c = 0; c < AQ_BLOCK / per_vec; c++)
#pragma unroll
        for (int i = 0; i < per_vec; i++) v[c * per_vec + i] = to_float<T>(((const T *)&raw[c])[i]);
    const float s = aq_block_scale(v, AQ_BLOCK);
    if (p.scales) p.scales[idx] = aq_e4m3_encode(s);
    if (p.codes) {
        uint8_t codes[AQ_BLOCK];
        aq_block_codes(v, AQ_BLOCK, s, codes);
        uint2 packed;
        uint8_t *b = (uint8_t *)&packed;
#pragma unroll
        for (int i = 0; i < 8; i++) b[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
        ((uint2 *)p.codes)[idx] = packed;
    }
    if (p.fake) {
        aq_block_fake_quantize(v, AQ_BLOCK, s);
#pragma unroll
        for (int c = 0; c < AQ_BLOCK / per_vec; c++) {
#pragma unroll
            for (int i = 0; i < per_vec; i++) ((T *)&raw[c])[i] = from_float<T>(v[c * per_vec + i]);
            ((uint4 *)p.fake)[(int64_t)idx * (AQ_BLOCK / per_vec) + c] = raw[c];
        }
    }
}

// One column (bits `shift` up of each 32-bit word) of a 16-row block of which the first n rows are real (N: n
// when known at compile time, else 0): quantized in registers, its scale and codes stored, raw updated in
// place with the fake-quantized values.
template <typename T, int N>
__device__ __forceinline__ void quantize_token_column(const aq_quantize_params &p, uint32_t (&raw)[AQ_BLOCK][1], int n,
                                                      int shift, int64_t scale_at, int64_t codes_at) {
    if (N) n = N;
    float v[AQ_BLOCK];
#pragma unroll
    for (int i = 0; i < AQ_BLOCK; i++) v[i] = to_float<T>(from_bits<T>(raw[i][0] >> shift)); // rows >= n are 0
    const float s = aq_block_scale(v, n);
    if (p.scales) p.scales[scale_at] = aq_e4m3_encode(s);
    if (p.codes) {
        uint8_t codes[AQ_BLOCK];
        aq_block_codes(v, n, s, codes);
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i += 2)
            if (i < n) p.codes[codes_at + i / 2 * p.inner] = (uint8_t)(codes[i] | (codes[i + 1] << 4));
    }
    if (p.fake) {
        aq_block_fake_quantize(v, n, s);
        const uint32_t keep = sizeof(T) == 4 ? 0u : ~(0xFFFFu << shift);
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i++) raw[i][0] = (raw[i][0] & keep) | (to_bits<T>(from_float<T>(v[i])) << shift);
    }
}

// The tokens layout's unit of work (quantize_tokens_kernel, fake_quantize_tokens_kernel): thread idx takes the
// 16-row block blk of outer index o, W 32-bit words of inner columns from in0 (4 W / sizeof(T) columns), n <= 16 rows.
template <typename I>
struct TokenBlock {
    I o, blk;
    int64_t a0, in0;
    int n;
};

// Thread idx's block (false past the end) and its rows' W words in raw (one load a row), 0 past row n.
template <typename T, typename I, int W>
__device__ __forceinline__ bool load_token_block(const aq_quantize_params &p, I nblocks, TokenBlock<I> *tb,
                                                 uint32_t (&raw)[AQ_BLOCK][W]) {
    using Vec = typename Bytes<4 * W>::type;
    constexpr int per_vec = 4 * W / sizeof(T);
    const I chunks = (I)(p.inner / per_vec);
    const I idx = blockIdx.x * (I)blockDim.x + threadIdx.x;
    if (idx >= (I)(p.outer[0] * p.outer[1] * p.outer[2]) * nblocks * chunks) return false;
    const I chunk = idx % chunks, ob = idx / chunks;
    tb->blk = ob % nblocks, tb->o = ob / nblocks;
    tb->a0 = (int64_t)tb->blk * AQ_BLOCK, tb->in0 = (int64_t)chunk * per_vec;
    tb->n = (int)min((int64_t)AQ_BLOCK, p.axis_len - tb->a0);
    const T *src = (const T *)p.x + outer_offset(p, tb->o) + tb->a0 * p.stride_axis + tb->in0;
#pragma unroll
    for (int i = 0; i < AQ_BLOCK; i++) {
        if (i < tb->n) {
            *(Vec *)raw[i] = __ldg((const Vec *)(src + i * p.stride_axis));
        } else {
#pragma unroll
            for (int w = 0; w < W; w++) raw[i][w] = 0u;
        }
    }
    return true;
}

// The block's rows back into p.fake ((outer, axis_len, inner) contiguous).
template <typename T, typename I, int W>
__device__ __forceinline__ void store_token_block(const aq_quantize_params &p, const TokenBlock<I> &tb,
                                                  const uint32_t (&raw)[AQ_BLOCK][W]) {
    using Vec = typename Bytes<4 * W>::type;
    T *dst = (T *)p.fake + ((int64_t)tb.o * p.axis_len + tb.a0) * p.inner + tb.in0;
#pragma unroll
    for (int i = 0; i < AQ_BLOCK; i++)
        if (i < tb.n) *(Vec *)(dst + i * p.inner) = *(const Vec *)raw[i];
}

// Blocked axis not innermost, inner axis contiguous (V along tokens): a thread takes one 16-row block of
// 4 bytes of inner columns (two 16-bit ones), reads its rows with 16 independent loads (a warp's loads of
// one row are contiguous), quantizes each column in registers and writes the rows back the same way. (A 16 x
// 256-column tile staged through shared memory per CTA left half its threads without a column at D = 128, and
// 16 bytes of columns a thread took too many registers: performance.md.) Needs
// inner and the strides multiples of 4 bytes, aligned pointers. Grid: ceil(outer * nblocks * inner / per_vec
// / 256).
template <typename T, typename I>
__global__ void __launch_bounds__(256) quantize_tokens_kernel(aq_quantize_params p) {
    constexpr int per_vec = 4 / sizeof(T);
    const I nblocks = (I)((p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK);
    TokenBlock<I> tb;
    uint32_t raw[AQ_BLOCK][1];
    if (!load_token_block<T, I, 1>(p, nblocks, &tb, raw)) return;
    const int64_t packed_len = (p.axis_len + 1) / 2;
#pragma unroll 1 /* one column at a time (two at once took 124 registers), picked out by shifts, not indexing */
    for (int c = 0; c < per_vec; c++) {
        const int64_t scale_at = ((int64_t)tb.o * nblocks + tb.blk) * p.inner + tb.in0 + c;
        const int64_t codes_at = ((int64_t)tb.o * packed_len + tb.a0 / 2) * p.inner + tb.in0 + c;
        if (tb.n == AQ_BLOCK) quantize_token_column<T, AQ_BLOCK>(p, raw, tb.n, 8 * (int)sizeof(T) * c, scale_at, codes_at);
        else quantize_token_column<T, 0>(p, raw, tb.n, 8 * (int)sizeof(T) * c, scale_at, codes_at);
    }
    if (p.fake) store_token_block<T, I, 1>(p, tb, raw);
}

// The V pre-pass's fake quantization (16-bit T, no codes or scales), laid out as quantize_tokens_kernel but with 16
// bytes of columns a thread (eight 16-bit columns, four 32-bit words a row: one 16-byte load and store a row). Each
// word's two columns at once, each value taken from and put back into its word: the amaxes of both from one 16x2-bit
// integer max a row (the bits of |x| order like the values, NaN above Inf), y = min(|x| r, 6) rounded by
// aq_e2m1_round_nonneg_unclamped, times s, and the sign back: fewer instructions an element than the general
// path's aq_fake_quantize_element, and nearer a copy's speed (performance.md v16, quantizers v7). Same
// values: zero blocks give +0 (the sign is kept only where s > 0), and a NaN or Inf in a block gives a NaN scale,
// hence NaN (r = 0 there; an Inf's Inf * 0 = NaN becomes 6 in fminf, within the rounding's domain, and its product
// with the NaN scale is NaN).
#define FAKE_TOKENS_WORDS 4 /* 32-bit words of columns a thread and row: the launcher's tokens checks allow 16 bytes */
template <typename T, typename I>
__global__ void __launch_bounds__(256) fake_quantize_tokens_kernel(aq_quantize_params p) {
    static_assert(sizeof(T) == 2, "two 16-bit columns a 32-bit word");
    constexpr int W = FAKE_TOKENS_WORDS;
    TokenBlock<I> tb;
    uint32_t raw[AQ_BLOCK][W];
    if (!load_token_block<T, I, W>(p, (I)((p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK), &tb, raw)) return;
#pragma unroll
    for (int w = 0; w < W; w++) {
        uint32_t amax2 = 0;
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i++) amax2 = __vmaxu2(amax2, raw[i][w] & 0x7FFF7FFFu);
        float s[2], r[2];
        uint32_t sign[2];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const float amax = to_float<T>(from_bits<T>(amax2 >> (16 * c) & 0xFFFFu));
            s[c] = aq_block_scale_from_amax_bits(__float_as_uint(amax));
            r[c] = s[c] > 0.0f ? __frcp_rn(s[c]) : 0.0f;
            sign[c] = s[c] > 0.0f ? 0x80000000u : 0u;
        }
        auto fake = [&](float x, int c) {
            const float q = aq_e2m1_round_nonneg_unclamped(fminf(__fmul_rn(fabsf(x), r[c]), 6.0f));
            return __uint_as_float(__float_as_uint(__fmul_rn(q, s[c])) | (__float_as_uint(x) & sign[c]));
        };
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i++) {
            const float lo = to_float<T>(from_bits<T>(raw[i][w] & 0xFFFFu)), hi = to_float<T>(from_bits<T>(raw[i][w] >> 16));
            raw[i][w] = to_bits<T>(from_float<T>(fake(lo, 0))) | (to_bits<T>(from_float<T>(fake(hi, 1))) << 16);
        }
    }
    store_token_block<T, I, W>(p, tb, raw);
}

// Any other layout: one thread per (outer, block, inner column), inner fastest.
template <typename T, typename I>
__global__ void __launch_bounds__(256) quantize_strided_kernel(aq_quantize_params p) {
    const int64_t nblocks = (p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK, packed_len = (p.axis_len + 1) / 2;
    const I inner = (I)p.inner, iblocks = (I)nblocks;
    const I idx = blockIdx.x * (I)blockDim.x + threadIdx.x;
    if (idx >= (I)(p.outer[0] * p.outer[1] * p.outer[2]) * iblocks * inner) return;
    const int64_t in = (int64_t)(idx % inner), blk = (idx / inner) % iblocks;
    const I o = idx / (inner * iblocks);
    const int64_t a0 = blk * AQ_BLOCK;
    const int n = (int)min((int64_t)AQ_BLOCK, p.axis_len - a0);
    const T *src = (const T *)p.x + outer_offset(p, o) + a0 * p.stride_axis + in * p.stride_inner;
    float v[AQ_BLOCK];
#pragma unroll
    for (int i = 0; i < AQ_BLOCK; i++) v[i] = i < n ? to_float<T>(src[i * p.stride_axis]) : 0.0f;
    const float s = aq_block_scale(v, n);
    if (p.scales) p.scales[(o * nblocks + blk) * p.inner + in] = aq_e4m3_encode(s);
    if (p.codes) {
        uint8_t codes[AQ_BLOCK];
        aq_block_codes(v, n, s, codes);
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i += 2)
            if (i < n) p.codes[(o * packed_len + (a0 + i) / 2) * p.inner + in] = (uint8_t)(codes[i] | (codes[i + 1] << 4));
    }
    if (p.fake) {
        aq_block_fake_quantize(v, n, s);
        T *dst = (T *)p.fake + (o * p.axis_len + a0) * p.inner + in;
#pragma unroll
        for (int i = 0; i < AQ_BLOCK; i++)
            if (i < n) dst[i * p.inner] = from_float<T>(v[i]);
    }
}

// Q and K (blocked along the innermost axis, inner 1, axis_len a multiple of 16): a thread per block, its 8 code
// bytes in one load and its 16 values in 16-byte stores. (The element-per-thread kernel below made the packed prefill
// slower than the bf16 one, with three such passes: performance.md.)
template <typename T>
__global__ void __launch_bounds__(256) dequantize_rows_kernel(aq_dequantize_params p) {
    const int64_t blk = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, nblocks = p.axis_len / AQ_BLOCK;
    if (blk >= p.outer * nblocks) return;
    const uint2 c = *(const uint2 *)(p.codes + blk * (AQ_BLOCK / 2));
    const float s = aq_e4m3_decode(p.scales[blk]);
    union {
        T x[AQ_BLOCK];
        uint4 vec[AQ_BLOCK * sizeof(T) / 16];
    } v;
#pragma unroll
    for (int i = 0; i < AQ_BLOCK; i++)
        v.x[i] = from_float<T>(aq_e2m1_value((uint8_t)(((i < 8 ? c.x : c.y) >> (4 * (i % 8))) & 15u)) * s);
    uint4 *dst = (uint4 *)((T *)p.out + blk * AQ_BLOCK);
#pragma unroll
    for (int i = 0; i < (int)(AQ_BLOCK * sizeof(T) / 16); i++) dst[i] = v.vec[i];
}

// V (blocked along an outer axis, inner a multiple of 4): a thread per code row (elements 2k and 2k + 1 along the
// axis) of 4 inner columns: one 4-byte load of codes and one of scales, two stores of 4 values.
template <typename T>
__global__ void __launch_bounds__(256) dequantize_tokens_kernel(aq_dequantize_params p) {
    const int64_t packed_len = (p.axis_len + 1) / 2, nblocks = (p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK, groups = p.inner / 4;
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= p.outer * packed_len * groups) return;
    const int64_t g = idx % groups, k = idx / groups % packed_len, o = idx / (groups * packed_len), in0 = 4 * g;
    const uint32_t c = *(const uint32_t *)(p.codes + (o * packed_len + k) * p.inner + in0);
    const uint32_t sc = *(const uint32_t *)(p.scales + (o * nblocks + 2 * k / AQ_BLOCK) * p.inner + in0);
    float s[4]; /* both elements of a code row are in the same block */
#pragma unroll
    for (int j = 0; j < 4; j++) s[j] = aq_e4m3_decode((uint8_t)(sc >> (8 * j)));
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int64_t a = 2 * k + half;
        if (a >= p.axis_len) break;
        struct alignas(4 * sizeof(T)) four { T x[4]; } out;
#pragma unroll
        for (int j = 0; j < 4; j++) out.x[j] = from_float<T>(aq_e2m1_value((uint8_t)((c >> (8 * j + 4 * half)) & 15u)) * s[j]);
        *(four *)((T *)p.out + (o * p.axis_len + a) * p.inner + in0) = out;
    }
}

// codes, scales as above -> out (outer, axis_len, inner) contiguous; one thread per element.
template <typename T>
__global__ void dequantize_kernel(aq_dequantize_params p) {
    const int64_t nblocks = (p.axis_len + AQ_BLOCK - 1) / AQ_BLOCK;
    const int64_t packed_len = (p.axis_len + 1) / 2;
    const int64_t total = p.outer * p.axis_len * p.inner;
    const int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (idx >= total) return;
    const int64_t in = idx % p.inner, a = (idx / p.inner) % p.axis_len, o = idx / (p.inner * p.axis_len);
    const uint8_t byte = p.codes[(o * packed_len + a / 2) * p.inner + in];
    const float s = aq_e4m3_decode(p.scales[(o * nblocks + a / AQ_BLOCK) * p.inner + in]);
    ((T *)p.out)[idx] = from_float<T>(aq_e2m1_value((uint8_t)((a & 1) ? byte >> 4 : byte & 15)) * s);
}

// ----------------------------------------------------------------------------------------------
// kernel launchers

static unsigned grid_for(int64_t work, int threads) { return (unsigned)((work + threads - 1) / threads); }

// launch(grid, index) for `work` threads, index a uint32_t when every thread index fits in 32 bits (cheaper index
// arithmetic in the memory-bound quantize kernels), else an int64_t: its type is the kernels' I.
template <typename Launch>
static void launch_indexed(int64_t work, int threads, Launch launch) {
    const unsigned grid = grid_for(work, threads);
    if (grid * (int64_t)threads < ((int64_t)1 << 32)) launch(grid, uint32_t());
    else launch(grid, int64_t());
}

template <typename T>
static void launch_quantize(const aq_quantize_params *p, cudaStream_t stream) {
    const int threads = 256;
    const int64_t outer = p->outer[0] * p->outer[1] * p->outer[2];
    const int64_t nblocks = (p->axis_len + AQ_BLOCK - 1) / AQ_BLOCK;
    bool aligned_outer = true;
    for (int i = 0; i < 3; i++) aligned_outer = aligned_outer && (p->stride_outer[i] * (int64_t)sizeof(T)) % 16 == 0;
    const bool rows = p->inner == 1 && p->stride_axis == 1 && p->axis_len % AQ_BLOCK == 0 && aligned_outer &&
                      (uintptr_t)p->x % 16 == 0 && (uintptr_t)p->codes % 8 == 0 && (uintptr_t)p->fake % 16 == 0;
    constexpr int per_vec = 16 / sizeof(T);
    const bool tokens = p->stride_inner == 1 && p->inner % per_vec == 0 && p->stride_axis % per_vec == 0 &&
                        aligned_outer && (uintptr_t)p->x % 16 == 0 && (uintptr_t)p->fake % 16 == 0;
    if (rows) {
        launch_indexed(outer * nblocks, threads, [&](unsigned grid, auto index) {
            quantize_rows_kernel<T, decltype(index)><<<grid, threads, 0, stream>>>(*p);
        });
    } else if (tokens) {
        if constexpr (sizeof(T) == 2) {
            if (p->fake && !p->codes && !p->scales) {
                static_assert(4 * FAKE_TOKENS_WORDS <= 16, "tokens checks 16-byte alignment, no more");
                launch_indexed(outer * nblocks * (p->inner / (4 * FAKE_TOKENS_WORDS / (int)sizeof(T))), threads,
                               [&](unsigned grid, auto index) {
                                   fake_quantize_tokens_kernel<T, decltype(index)><<<grid, threads, 0, stream>>>(*p);
                               });
                return;
            }
        }
        launch_indexed(outer * nblocks * (p->inner / (4 / (int)sizeof(T))), threads, [&](unsigned grid, auto index) {
            quantize_tokens_kernel<T, decltype(index)><<<grid, threads, 0, stream>>>(*p);
        });
    } else {
        launch_indexed(outer * nblocks * p->inner, threads, [&](unsigned grid, auto index) {
            quantize_strided_kernel<T, decltype(index)><<<grid, threads, 0, stream>>>(*p);
        });
    }
}

template <typename T>
static void launch_dequantize(const aq_dequantize_params *p, cudaStream_t stream) {
    const int threads = 256;
    const uintptr_t codes = (uintptr_t)p->codes, scales = (uintptr_t)p->scales, out = (uintptr_t)p->out;
    if (p->inner == 1 && p->axis_len % AQ_BLOCK == 0 && codes % 8 == 0 && out % 16 == 0) {
        dequantize_rows_kernel<T><<<grid_for(p->outer * (p->axis_len / AQ_BLOCK), threads), threads, 0, stream>>>(*p);
    } else if (p->inner % 4 == 0 && codes % 4 == 0 && scales % 4 == 0 && out % (4 * sizeof(T)) == 0) {
        const int64_t work = p->outer * ((p->axis_len + 1) / 2) * (p->inner / 4);
        dequantize_tokens_kernel<T><<<grid_for(work, threads), threads, 0, stream>>>(*p);
    } else {
        dequantize_kernel<T><<<grid_for(p->outer * p->axis_len * p->inner, threads), threads, 0, stream>>>(*p);
    }
}

extern "C" const char *aq_quantize_cuda(const aq_quantize_params *p, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    if (p->outer[0] * p->outer[1] * p->outer[2] * p->axis_len * p->inner == 0) return NULL;
    switch (p->dtype) {
    case AQ_FLOAT32: launch_quantize<float>(p, s); break;
    case AQ_BFLOAT16: launch_quantize<__nv_bfloat16>(p, s); break;
    case AQ_FLOAT16: launch_quantize<__half>(p, s); break;
    }
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}

extern "C" const char *aq_dequantize_cuda(const aq_dequantize_params *p, void *stream) {
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t work = p->outer * p->axis_len * p->inner;
    if (work == 0) return NULL;
    switch (p->dtype) {
    case AQ_FLOAT32: launch_dequantize<float>(p, s); break;
    case AQ_BFLOAT16: launch_dequantize<__nv_bfloat16>(p, s); break;
    case AQ_FLOAT16: launch_dequantize<__half>(p, s); break;
    }
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}
