/* Work order and last-wave split: work_item_at (backwards), tail_split (sm90/'s split last wave). */
#pragma once

#include "attention/fragments.cuh"

typedef struct {
    int tile, h, b;
} work_item;

/* The backward kernels' work items: tile w.tile (the dK/dV kernel's key tile, or the dQ kernel's query tile) of head
   w.h and batch entry w.b, for block t of a 1-D grid of n_tiles x heads x batch. Blocks start in index order. By
   default each head's tiles go side by side (they read the same Q and dO, or K and V, from L2), and under a causal
   mask the longest first (the first key tile, or the last query tile: last_longest). But then each head's longest
   item comes once more near the end, and when the grid is short (under ~13 waves of `sms` items) and the items long
   (grouped heads: a dK/dV item covers the group's query heads), the last wave holds long items. There the tiles go
   longest first across chunks of consecutive heads (h + heads b) of about two waves of items. On a long grid the
   model gains less and L2 loses more (more heads in flight), so grids over 13 waves keep head-major order. The
   forward keeps it too: a short item at the end moves it little, and this index arithmetic held across its loop
   made the quantized forward spill (performance.md, "Measurements behind choices in the code"). */
AQ_D work_item work_item_at(int t, int n_tiles, int heads, int batch, int causal, bool last_longest, int sms) {
    const int n_hb = heads * batch;
    int tile, hb;
    if (causal && n_hb * n_tiles <= 13 * sms) {
        const int want = (2 * sms + n_tiles - 1) / n_tiles, n_chunks = (n_hb + want - 1) / want;
        const int chunk = (n_hb + n_chunks - 1) / n_chunks; /* equal chunks, the last up to n_chunks - 1 smaller */
        const int first = t / (chunk * n_tiles) * chunk, r = t - first * n_tiles, size = min(chunk, n_hb - first);
        tile = r / size, hb = first + r % size;
    } else {
        tile = t % n_tiles, hb = t / n_tiles;
    }
    work_item w;
    w.tile = causal && last_longest ? n_tiles - 1 - tile : tile;
    w.h = hb % heads, w.b = hb / heads;
    return w;
}

/* The last wave of a grid of equal work items, split (host plan, kernel argument). A grid of W items on an SM each
   takes ceil(W / sms) item times; when the last wave holds only a few items, the rest of the GPU waits for them
   (4096 items on 132 SMs: 32 waves for 31.03 of work, 3% of the kernel). Split, the first main_items run as before
   and each of the last tail_items runs as `splits` CTAs over parts of its reduction axis (key tiles in the
   forward, query tiles in the dK/dV kernel), writing fp32 partial results to `part`, which a small kernel then
   merges in a fixed order. splits <= 1: no split. */
typedef struct {
    int main_items, tail_items, splits;
    float *part;
} tail_split;

/* The units [*u0, *u1) of part `split` of an item's `units` (nonempty while splits <= units). */
AQ_D void tail_split_units(int split, int splits, int units, int *u0, int *u1) {
    *u0 = (int)((int64_t)units * split / splits), *u1 = (int)((int64_t)units * (split + 1) / splits);
}

/* Item t of a grid handed out in a packed call's work order (attn_qat.h's work_order: longest first), or t without
   one. An entry outside [0, items) runs item t: the table is the caller's, and no item may index past the tensors. */
AQ_D int ordered_item(const int32_t *order, int t, int items) {
    if (order == NULL) return t;
    const int item = __ldg(order + t);
    return (unsigned)item < (unsigned)items ? item : t;
}
