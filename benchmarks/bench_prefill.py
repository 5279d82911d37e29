"""Prefill on packed NVFP4 operands: `attn_qat.nvfp4_attention` on Q, K, V packed by `quantize_qkv`,
against attn_qat's inference forward on the bf16 tensors (the fused pre-pass quantizes them) and torch
SDPA's cuDNN and FlashAttention-2 backends on the same bf16 tensors, in one process.

Besides time it reports what packing buys: the bytes of the operands (packed: half a byte per code plus
one E4M3 scale per 16 values; bf16: two bytes per value), K+V bytes per token (what a KV cache holds per
token and layer), and each call's peak of extra device memory. Times are medians of back-to-back calls
timed between CUDA events (common.median_ms) over inputs alternating between two sets, so no run reads the previous run's inputs from L2.

    python benchmarks/bench_prefill.py [--out benchmarks/results/prefill.json] [--quick] [--repeat 10]
"""
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from common import forward_flops, metadata, parse_bench_args, selected_shapes, timed, write_json  # noqa: E402

# name: (batch, heads_q, heads_kv, tokens, head_dim, causal); self-attention, Nq = Nk
SHAPES = {
    "wan14b_self": (1, 40, 40, 32760, 128, False),
    "b2_h16_16k": (2, 16, 16, 16384, 128, False),
    "b8_h16_4k": (8, 16, 16, 4096, 128, False),
    "qwen_gqa_causal": (4, 32, 8, 4096, 128, True),
}
QUICK = ("b8_h16_4k", "qwen_gqa_causal")
PACKED = "nvfp4_attention (packed Q, K, V)"
OURS_BF16 = "attn_qat inference fwd (bf16 in)"
CUDNN, FA2 = "cuDNN fwd (bf16)", "FA2 fwd (bf16)"


def make_set(b, hq, hkv, n, d, causal):
    """One input set in (B, S, H, D) layout, bf16 and packed (V blocked as `causal` attention blocks it)."""
    q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    return {"bf16": (q, k, v), "packed": attn_qat.quantize_qkv(q, k, v, causal=causal)}


def peak_extra_mib(fn) -> float:
    """Device memory one call allocates beyond what is already allocated (its output included), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def bench_shape(name, shape, repeat):
    b, hq, hkv, n, d, causal = shape
    sets = [make_set(b, hq, hkv, n, d, causal) for _ in range(2)]
    flops = forward_flops(b, hq, n, n, d, causal)

    def packed(s):
        return lambda: attn_qat.nvfp4_attention(*s["packed"], causal=causal)

    def ours_bf16(s):
        def fn():
            with torch.no_grad():
                return attn_qat.attention(*s["bf16"], causal=causal, mode="attn_qat")
        return fn

    def sdpa(backend):
        def make(s):
            q, k, v = (t.transpose(1, 2) for t in s["bf16"])  # (B, H, S, D) views, as models pass them
            if hq != hkv:  # expanded K/V: the SDPA backends' own GQA support varies across versions
                k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))

            def fn():
                with sdpa_kernel(backend), torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return fn
        return make

    rows = {}
    for label, make in ((PACKED, packed), (OURS_BF16, ours_bf16), (CUDNN, sdpa(SDPBackend.CUDNN_ATTENTION)),
                        (FA2, sdpa(SDPBackend.FLASH_ATTENTION))):
        try:
            ms = timed(make, sets, repeat)
            rows[label] = {"ms": ms, "TFLOP/s": flops / ms / 1e9, "peak_extra_MiB": peak_extra_mib(make(sets[0]))}
        except RuntimeError as e:  # a backend that does not take this shape
            rows[label] = {"ms": None, "TFLOP/s": None, "peak_extra_MiB": None, "error": str(e).splitlines()[0][:200]}
        torch.cuda.empty_cache()

    # Packing is paid once per operand (a KV cache or a diffusion model's cross-attention K/V reuse it).
    pack_ms = timed(lambda s: (lambda: attn_qat.quantize_qkv(*s["bf16"], causal=causal)), sets, repeat)
    # Sanity: the packed path computes the inference forward (the same kernel; fp32 order may differ).
    with torch.no_grad():
        expected = attn_qat.attention(*sets[0]["bf16"], causal=causal, mode="attn_qat")
    got = attn_qat.nvfp4_attention(*sets[0]["packed"], causal=causal)
    agreement = float((got.float() - expected.float()).norm() / expected.float().norm())

    q, k, v = sets[0]["bf16"]
    qp, kp, vp = sets[0]["packed"]
    bf16_bytes = 2 * (q.numel() + k.numel() + v.numel())
    packed_bytes = qp.nbytes + kp.nbytes + vp.nbytes
    kv_token_bf16 = 2 * 2 * hkv * d  # K and V of one token and layer
    kv_token_packed = (kp.nbytes + vp.nbytes) / (b * n)

    def ratio(a, r):
        return None if rows[a]["ms"] is None or rows[r]["ms"] is None else rows[a]["ms"] / rows[r]["ms"]

    return {
        "shape": name, "dims": dict(zip(("B", "Hq", "Hkv", "N", "D", "causal"), shape)),
        "results": rows, "quantize_qkv_ms": pack_ms, "rel_diff_packed_vs_inference": agreement,
        "bytes": {"operands_bf16": bf16_bytes, "operands_packed": packed_bytes,
                  "kv_per_token_bf16": kv_token_bf16, "kv_per_token_packed": kv_token_packed,
                  "bf16 / packed": bf16_bytes / packed_bytes},
        "ratios": {"packed / cuDNN": ratio(PACKED, CUDNN), "packed / FA2": ratio(PACKED, FA2),
                   "attn_qat bf16-in / cuDNN": ratio(OURS_BF16, CUDNN),
                   "packed / attn_qat bf16-in": ratio(PACKED, OURS_BF16)},
    }


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = ["packed / cuDNN", "attn_qat bf16-in / cuDNN", "packed / FA2"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1.2]})
    width = 0.8 / len(keys)
    xs = range(len(results))
    for i, key in enumerate(keys):
        ax.bar([x + i * width for x in xs], [r["ratios"][key] or 0 for r in results], width, label=key)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.15, color="gray", linewidth=0.8, linestyle="--", label="goal: 1.15x cuDNN")
    ax.set_xticks([x + width for x in xs], [r["shape"] for r in results], rotation=15)
    ax.set_ylabel("time / reference time (lower is better)")
    ax.legend(fontsize=8)
    ax.set_title("prefill time")
    r = results[0]["bytes"]
    bx.bar(["bf16", "NVFP4"], [r["kv_per_token_bf16"], r["kv_per_token_packed"]], color=["tab:gray", "tab:green"])
    bx.set_ylabel("bytes")
    bx.set_title(f"K+V per token and layer ({results[0]['shape']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    args = parse_bench_args("prefill", __doc__, 10, "only the 4k shapes")
    results = []
    for name, shape in selected_shapes(args, SHAPES, QUICK):
        results.append(bench_shape(name, shape, args.repeat))
        r = results[-1]
        print(f"\n{name} {r['dims']}")
        for label, row in r["results"].items():
            ms = "n/a" if row["ms"] is None else (f"{row['ms']:.3f} ms  {row['TFLOP/s']:.0f} TFLOP/s  "
                                                  f"+{row['peak_extra_MiB']:.0f} MiB")
            print(f"  {label:34s} {ms}")
        print(f"  {'quantize_qkv (packing, once)':34s} {r['quantize_qkv_ms']:.3f} ms")
        by = r["bytes"]
        print(f"  operands: bf16 {by['operands_bf16'] / 2 ** 20:.0f} MiB, packed {by['operands_packed'] / 2 ** 20:.0f} "
              f"MiB ({by['bf16 / packed']:.2f}x); K+V per token: {by['kv_per_token_bf16']} B bf16, "
              f"{by['kv_per_token_packed']:.0f} B packed")
        for label, value in r["ratios"].items():
            print(f"  {label:34s} {'n/a' if value is None else f'{value:.2f}x'}")
        print(f"  packed vs inference forward: relative difference {r['rel_diff_packed_vs_inference']:.1e}")
    meta = metadata()
    print(f"\nGPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}")
    labels = list(results[0]["results"])
    print("| shape | " + " | ".join(labels) + " | packed / cuDNN |\n|---|" + "---|" * (len(labels) + 1))
    for r in results:
        cells = [("n/a" if r["results"][x]["ms"] is None else f"{r['results'][x]['ms']:.2f} ms") for x in labels]
        ratio = r["ratios"]["packed / cuDNN"]
        print(f"| {r['shape']} | " + " | ".join(cells) + f" | {'n/a' if ratio is None else f'{ratio:.2f}x'} |")
    write_json(args.out, {**meta, "flops": "forward 4*B*H*N*N*D, halved when causal",
                          "implementation": "dequantize to bf16, then the forward kernel without its pre-pass "
                                            "(attention_forward_prequantized)",
                          "shapes": results})
    plot(results, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
