/* Does compute-sanitizer's initcheck count global memory written by the bulk copy engine (TMA) as initialized?
   The Hopper forward writes O and O' with cp.async.bulk.tensor stores (hopper.cuh, tma_store_warp_rows), and
   initcheck reported the delta kernel's reads of them (docs/sanitizers.md). This program writes a buffer one of four
   ways, then a second kernel reads every element of it:
     plain      st.global from registers (the control that must be clean)
     bulk       cp.async.bulk.global.shared::cta (no tensor map)
     tensor     cp.async.bulk.tensor.4d.global.shared::cta through a 128-byte-swizzled bf16 tensor map built as
                make_tensor_map builds the attention outputs' (the forward's instruction, box 64 columns x 16 rows)
     unwritten  nothing (the control that initcheck must flag: it is watching)
   and checks on the host that the writes landed (the sum of the values read), so that a clean initcheck on a mode
   means the tool saw the write, not that nothing was read.

   nvcc -O2 -arch=sm_90a -o /tmp/initcheck_tma dev/initcheck_tma.cu
   for m in plain bulk tensor unwritten; do compute-sanitizer --tool initcheck --error-exitcode 1 /tmp/initcheck_tma $m; done
   A tool limitation shows as: plain clean, unwritten flagged, tensor (or bulk) flagged; exit status 2 is a wrong sum. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define COLS 64   /* one 128-byte swizzled panel of 16-bit values, as SM90_PANEL */
#define ROWS 32   /* two CTAs of 16 rows: the forward's per-warp store box */
#define BOX_ROWS 16

#define CHECK(x)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

/* element (r, c) holds r * COLS + c + 1: the reader's sum tells whether every element arrived */
__device__ uint16_t value_at(int r, int c) { return (uint16_t)(r * COLS + c + 1); }

__global__ void write_plain(uint16_t *g) {
    const int r = (int)blockIdx.x * BOX_ROWS + (int)threadIdx.x / 4;
    for (int c = (int)threadIdx.x % 4; c < COLS; c += 4) g[r * COLS + c] = value_at(r, c);
}

/* The CTA's 16 rows staged in shared memory (plainly, or with TMA's 128-byte swizzle: 16-byte chunk ^ row % 8),
   then stored by one thread through the bulk copy engine, as tma_store_warp_rows does. */
template <bool TENSOR>
__global__ void write_bulk(uint16_t *g, const __grid_constant__ CUtensorMap map) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ __align__(1024) uint16_t tile[BOX_ROWS * COLS];
    const int row0 = (int)blockIdx.x * BOX_ROWS;
    for (int i = (int)threadIdx.x; i < BOX_ROWS * COLS; i += (int)blockDim.x) {
        const int r = i / COLS, c = i % COLS, chunk = TENSOR ? ((c / 8) ^ (r % 8)) : c / 8;
        tile[r * COLS + chunk * 8 + c % 8] = value_at(row0 + r, c);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t s = (uint32_t)__cvta_generic_to_shared(tile);
        if (TENSOR)
            asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                             (uint64_t)&map),
                         "r"(s), "r"(0), "r"(row0), "r"(0), "r"(0)
                         : "memory");
        else
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(g + row0 * COLS), "r"(s),
                         "r"(BOX_ROWS * COLS * 2)
                         : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
    }
#endif
}

__global__ void read_all(const uint16_t *g, unsigned long long *sum) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < ROWS * COLS) atomicAdd(sum, (unsigned long long)g[i]);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    const bool plain = !strcmp(mode, "plain"), bulk = !strcmp(mode, "bulk"), tensor = !strcmp(mode, "tensor"),
               unwritten = !strcmp(mode, "unwritten");
    if (!plain && !bulk && !tensor && !unwritten) {
        fprintf(stderr, "usage: %s plain|bulk|tensor|unwritten\n", argv[0]);
        return 64;
    }
    uint16_t *buf = NULL;
    unsigned long long *sum = NULL, host_sum = 0;
    CHECK(cudaMalloc(&buf, ROWS * COLS * 2));
    CHECK(cudaMalloc(&sum, sizeof(*sum)));
    CHECK(cudaMemset(sum, 0, sizeof(*sum)));

    /* the attention outputs' map (sm90/tensor_map.h, make_tensor_map) over a (1, 1, ROWS, COLS) bf16 tensor */
    CUtensorMap map;
    memset(&map, 0, sizeof(map));
    if (tensor) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult found;
        CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess) {
            fprintf(stderr, "no cuTensorMapEncodeTiled\n");
            return 1;
        }
        const cuuint64_t dims[4] = {COLS, ROWS, 1, 1}, strides[3] = {COLS * 2, ROWS * COLS * 2, ROWS * COLS * 2};
        const cuuint32_t box[4] = {COLS, BOX_ROWS, 1, 1}, elem_strides[4] = {1, 1, 1, 1};
        if (((PFN_cuTensorMapEncodeTiled_v12000)fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, buf, dims, strides, box,
                                                     elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                     CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
            fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
            return 1;
        }
    }
    if (plain) write_plain<<<ROWS / BOX_ROWS, 64>>>(buf);
    if (bulk) write_bulk<false><<<ROWS / BOX_ROWS, 128>>>(buf, map);
    if (tensor) write_bulk<true><<<ROWS / BOX_ROWS, 128>>>(buf, map);
    CHECK(cudaGetLastError());
    read_all<<<(ROWS * COLS + 255) / 256, 256>>>(buf, sum);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(&host_sum, sum, sizeof(host_sum), cudaMemcpyDeviceToHost));
    const unsigned long long n = ROWS * COLS, expected = n * (n + 1) / 2;
    printf("initcheck_tma %s: sum %llu (expected %llu%s)\n", mode, host_sum, expected,
           unwritten ? ", not checked: nothing was written" : "");
    CHECK(cudaFree(buf));
    CHECK(cudaFree(sum));
    return unwritten || host_sum == expected ? 0 : 2;
}
