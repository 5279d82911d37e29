"""Decode speed on an NVFP4 KV cache (attn_qat.NVFP4KVCache.attention, csrc/decode/decode_cuda.cu) against torch SDPA
in bf16 on a bf16 cache of the same tokens, in one process.

Bytes: the decode kernel reads each sequence's packed K and V (codes + E4M3 scales, 144 bytes per token and KV
head at D = 128); SDPA reads the bf16 K and V (512 bytes per token and KV head).
GB/s counts those bytes, and is compared with a bf16 device-to-device copy measured in the same process and
with the GPU's nominal HBM bandwidth (--peak-gbs). SDPA runs with enable_gqa=True (bottom-right causal mask when
Tq > 1); for one query token it also runs with the query heads of a KV group folded into the query rows, the
fastest way to call it for GQA decode, and the ratio uses the faster of the two. SDPA reads every sequence
at full context (no mask); the NVFP4 cache's last sequence is 13 tokens shorter, so it ends in a partial unit.
Times are CUDA-event medians of the replay of a CUDA graph of CALLS calls alternating between two caches, so no
call finds the previous call's cache in L2 and neither side's host launch overhead is counted (common.graph_ms):
on the lent H100 machines a decode call spends 50-60 us in Python checks and op dispatch, more than the kernels
take at 4k context, and eager timing then measures the host. Serving stacks replay decode steps as graphs too.

    python benchmarks/bench_decode.py [--out benchmarks/results/decode.json] [--quick] [--only shape,...]
                                      [--peak-gbs GB/s] [--variants 0,1,2,3] [--chunks 512,1024,2048]

--variants and --chunks add a row for each kernel variant and chunk length (the decode_variant and decode_chunk
kernel options: csrc/decode/decode_cuda.cu), for A/B runs in one process on the same caches.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from common import graph_ms, median_ms, metadata, timed, write_json  # noqa: E402

CALLS = 10  # calls per captured CUDA graph, alternating between the two caches (module docstring)

# name: (batch, heads_q, heads_kv, context, query tokens, head_dim)
SHAPES = {
    "b8_32k_q1": (8, 32, 8, 32768, 1, 128),  # 32k context, batch 8: the headline decode shape (README)
    "b8_32k_q4": (8, 32, 8, 32768, 4, 128),
    "b8_4k_q1": (8, 32, 8, 4096, 1, 128),
    "b8_4k_q4": (8, 32, 8, 4096, 4, 128),
    "b1_32k_q1": (1, 32, 8, 32768, 1, 128),  # one sequence: the context split alone fills the GPU
    "b8_32k_q1_d64": (8, 32, 8, 32768, 1, 64),
}
QUICK = ("b8_32k_q1", "b8_4k_q1")
APPEND_CHUNK = 4096  # tokens per append while filling (bounds the bf16 staging memory)
PAGE_SIZE = 16  # the paged cache's pages, vLLM's default block size: the most block-table entries per token


def make_caches(b, hkv, ctx, d, copies=2):
    """`copies` tuples of (NVFP4 cache, paged NVFP4 cache, bf16 K, bf16 V) holding the same random tokens; the
    last sequence is 13 tokens shorter, so it ends in a partial 16-token unit."""
    lengths = [ctx] * (b - 1) + [ctx - 13] if b > 1 else [ctx - 13]
    out = []
    for _ in range(copies):
        k = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
        cache = attn_qat.NVFP4KVCache(b, hkv, d, ctx, device="cuda")
        paged = attn_qat.NVFP4KVCache(b, hkv, d, ctx, device="cuda", page_size=PAGE_SIZE)
        for start in range(0, ctx, APPEND_CHUNK):
            step = [max(0, min(APPEND_CHUNK, n - start)) for n in lengths]
            for c in (cache, paged):
                c.append(k[:, :, start:start + APPEND_CHUNK], v[:, :, start:start + APPEND_CHUNK], lengths=step)
        out.append((cache, paged, k, v))
    torch.cuda.synchronize()
    return out, lengths


# Nominal HBM bandwidth by GPU name (the first entry whose key the name contains), GB/s; None: varies by model
# (GH200 with HBM3 or HBM3e), pass --peak-gbs.
NOMINAL_HBM_GBS = (("GH200", None), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0))


def bench_shape(name, shape, repeat, copy_gbs, peak_gbs, variants=(), chunks=()):
    b, hq, hkv, ctx, tq, d = shape
    caches, lengths = make_caches(b, hkv, ctx, d)
    qs = [torch.randn(b, hq, tq, d, device="cuda", dtype=torch.bfloat16) for _ in caches]
    cache = caches[0][0]
    packed_bytes = sum(lengths) * cache.bytes_per_token
    rows = {}

    def add(label, fns, nbytes, graph=True):
        try:  # the composite path copies host data into its mask, which a graph capture does not allow; it
            # takes milliseconds, so eager timing (one call per sample, the caches alternating) is fair for it
            ms = graph_ms(fns, calls=CALLS, repeat=repeat) if graph else timed(lambda fn: fn, fns, repeat)
            gbs = nbytes / ms / 1e6
            rows[label] = {"ms": ms, "bytes": nbytes, "GB/s": gbs, "of_copy": gbs / copy_gbs, "of_peak": gbs / peak_gbs}
        except RuntimeError as e:  # a backend that does not take this shape
            rows[label] = {"ms": None, "error": str(e).splitlines()[0][:200]}
        torch.cuda.empty_cache()

    add("attn_qat decode kernel", [lambda c=c, q=q: c.attention(q) for (c, _, _, _), q in zip(caches, qs)],
        packed_bytes)
    for variant in variants or [None]:  # the A/B rows: the plan reads the overrides when the graph is captured
        for chunk in chunks or [None]:
            if variant is None and chunk is None:
                continue
            settings = {k: v for k, v in (("variant", variant), ("chunk", chunk)) if v is not None}
            with attn_qat.ops.kernel_options(decode_variant=variant, decode_chunk=chunk):
                label = ", ".join(f"{k} {v}" for k, v in settings.items())
                add(f"attn_qat decode kernel ({label})",
                    [lambda c=c, q=q: c.attention(q) for (c, _, _, _), q in zip(caches, qs)], packed_bytes)
    add(f"attn_qat decode kernel, paged ({PAGE_SIZE}-token pages)",
        [lambda c=c, q=q: c.attention(q) for (_, c, _, _), q in zip(caches, qs)], packed_bytes)
    add("attn_qat composite (dequantize + forward)",
        [lambda c=c, q=q: c._attention_composite(q, d ** -0.5, True) for (c, _, _, _), q in zip(caches, qs)],
        packed_bytes, graph=False)

    # SDPA on the bf16 cache, all `ctx` keys of every sequence (no mask, so its fastest kernels run; the 13
    # extra keys of the last sequence are counted in its bytes); bottom-right causal for Tq > 1.
    mask = None if tq == 1 else causal_lower_right(tq, ctx)
    bf16_bytes = b * ctx * hkv * d * 2 * 2

    def sdpa_gqa(q, k, v):
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    add("torch SDPA bf16 (enable_gqa)", [sdpa_gqa(q, k, v) for (_, _, k, v), q in zip(caches, qs)], bf16_bytes)
    if tq == 1:  # the group's query heads as query rows of their KV head: one plain attention per KV head
        def sdpa_folded(q, k, v):
            qf = q.reshape(b, hkv, hq // hkv, d)
            return lambda: F.scaled_dot_product_attention(qf, k, v)

        add("torch SDPA bf16 (GQA folded into rows)", [sdpa_folded(q, k, v) for (_, _, k, v), q in zip(caches, qs)],
            bf16_bytes)
    sdpa_ms = [r["ms"] for label, r in rows.items() if label.startswith("torch SDPA") and r["ms"] is not None]
    ours = rows["attn_qat decode kernel"]["ms"]
    result = {"shape": name, "dims": dict(zip(("B", "Hq", "Hkv", "context", "Tq", "D"), shape)), "lengths": lengths,
              "results": rows,
              "speedup_vs_best_sdpa": min(sdpa_ms) / ours if sdpa_ms and ours else None,
              "memory_per_token": {"nvfp4_bytes": cache.bytes_per_token, "bf16_bytes": hkv * d * 2 * 2,
                                   "ratio": hkv * d * 2 * 2 / cache.bytes_per_token},
              "cache_nbytes": cache.nbytes}
    del caches, qs
    torch.cuda.empty_cache()
    return result


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [lab for lab in results[0]["results"] if lab != "torch SDPA bf16 (GQA folded into rows)"]
    width = 0.8 / len(labels)
    x = range(len(results))
    for i, lab in enumerate(labels):
        ax_t.bar([p + i * width for p in x], [r["results"][lab].get("ms") or 0 for r in results], width, label=lab)
        ax_b.bar([p + i * width for p in x], [r["results"][lab].get("GB/s") or 0 for r in results], width, label=lab)
    for ax, title in ((ax_t, "time (ms, lower is better)"), (ax_b, "GB/s of the bytes each reads")):
        ax.set_xticks([p + width for p in x], [r["shape"] for r in results], rotation=20)
        ax.set_title(title)
    ax_t.set_yscale("log")
    ax_b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "decode.json"))
    parser.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK))
    parser.add_argument("--only", default="", help="comma-separated shapes: " + ", ".join(SHAPES))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--variants", default="", help="comma-separated decode_variant kernel options (0-3) to add rows for")
    parser.add_argument("--chunks", default="", help="comma-separated decode_chunk kernel options (keys) to add rows for")
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="nominal HBM GB/s (default: from the GPU's name, " +
                        ", ".join(f"{k} {v:.0f}" for k, v in NOMINAL_HBM_GBS if v) + ")")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode needs a CUDA GPU")
    if args.peak_gbs is None:
        name = torch.cuda.get_device_name(0)  # the device metadata() names
        args.peak_gbs = next((v for k, v in NOMINAL_HBM_GBS if k in name), None)
        if args.peak_gbs is None:
            sys.exit(f"bench_decode: no nominal HBM bandwidth known for {name}; pass --peak-gbs")
    src = torch.empty(1 << 29, device="cuda", dtype=torch.uint8)  # 512 MB, far beyond L2
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    del src, dst
    print(f"bf16 device copy: {copy_gbs:.0f} GB/s (read + write)")
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SHAPES]
    if unknown:
        sys.exit(f"bench_decode: unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    variants = [int(v) for v in args.variants.split(",") if v]
    chunks = [int(c) for c in args.chunks.split(",") if c]
    results = []
    for name, shape in SHAPES.items():
        if (args.quick and name not in QUICK) or (only and name not in only):
            continue
        r = bench_shape(name, shape, args.repeat, copy_gbs, args.peak_gbs, variants, chunks)
        results.append(r)
        print(f"\n{name} {r['dims']}")
        for label, row in r["results"].items():
            cell = ("n/a " + row.get("error", "")) if row["ms"] is None else (
                f"{row['ms']:.3f} ms  {row['GB/s']:.0f} GB/s  {100 * row['of_copy']:.0f}% of copy, "
                f"{100 * row['of_peak']:.0f}% of {args.peak_gbs:.0f}")
            print(f"  {label:48s} {cell}")
        s = r["speedup_vs_best_sdpa"]
        print(f"  {'speed-up vs the faster SDPA':48s} {'n/a' if s is None else f'{s:.2f}x'}")
        print(f"  {'memory per token (NVFP4 / bf16 bytes)':48s} {r['memory_per_token']['nvfp4_bytes']} / "
              f"{r['memory_per_token']['bf16_bytes']} ({r['memory_per_token']['ratio']:.2f}x smaller)")
    meta = metadata()
    print(f"\nGPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}")
    print("| shape | decode kernel ms | GB/s (of copy) | best SDPA ms | speed-up |\n|---|---|---|---|---|")
    for r in results:
        k = r["results"]["attn_qat decode kernel"]
        sdpa = [x["ms"] for lab, x in r["results"].items() if lab.startswith("torch SDPA") and x["ms"] is not None]
        print(f"| {r['shape']} | {k['ms']:.3f} | {k['GB/s']:.0f} ({100 * k['of_copy']:.0f}%) | "
              f"{min(sdpa) if sdpa else float('nan'):.3f} | {r['speedup_vs_best_sdpa'] or float('nan'):.2f}x |")
    write_json(args.out, {**meta, "copy_GB/s": copy_gbs, "peak_GB/s": args.peak_gbs,
                          "bytes": "packed K and V codes + scales (decode), bf16 K and V (SDPA)",
                          "shapes": results})
    plot(results, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
