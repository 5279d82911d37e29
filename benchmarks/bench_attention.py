"""Attention speed: attn_qat's training forward (with O'), inference forward, backward, the `low_precision_o` mode
(D from O, so no O' in its forward: numerics.md §5) and `bf16` mode, against torch SDPA's cuDNN and FlashAttention-2
backends on the same tensors, in one process.

FLOPs: forward 2·B·H·Nq·Nk·(D + Dv) (4·B·H·Nq·Nk·D when V's head dim is D), backward 2.5× that, halved when
causal. Times are medians of back-to-back calls
timed between CUDA events (common.median_ms); inputs alternate between two sets so no run reads the previous run's
inputs from L2. Each shape's cases run in --rounds rounds, one after another in each (in reverse order every other
round), and a case's time is its median over the rounds.

    python benchmarks/bench_attention.py [--out benchmarks/results/attention.json] [--quick] [--rounds 3]
"""
import os
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from common import forward_flops, metadata, parse_bench_args, selected_shapes, timed, write_json  # noqa: E402

# name: (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal[, V's head_dim when it differs])
SHAPES = {
    "wan14b_self": (1, 40, 40, 32760, 32760, 128, False),
    "wan1.3b_self": (1, 12, 12, 32760, 32760, 128, False),
    "wan14b_cross": (1, 40, 40, 32760, 512, 128, False),
    "b2_h16_16k": (2, 16, 16, 16384, 16384, 128, False),
    "b8_h16_4k": (8, 16, 16, 4096, 4096, 128, False),
    "b16_h16_1k": (16, 16, 16, 1024, 1024, 128, False),
    "qwen_gqa_causal": (4, 32, 8, 4096, 4096, 128, True),
    "b8_h16_4k_d64": (8, 16, 16, 4096, 4096, 64, False),
    # head dims the Hopper kernels do not take (the mma.sync kernels run them): Gemma's and Qwen3-Next's 256,
    # Phi-3's 96, Phi-2's 80, DeepSeek MLA's 192 / 128
    "b4_h16_4k_d256": (4, 16, 16, 4096, 4096, 256, False),
    "b8_h16_4k_d96": (8, 16, 16, 4096, 4096, 96, False),
    "b8_h16_4k_d80": (8, 16, 16, 4096, 4096, 80, False),
    "b4_h16_4k_d192_128": (4, 16, 16, 4096, 4096, 192, True, 128),
}
QUICK = ("b8_h16_4k", "b16_h16_1k", "qwen_gqa_causal", "b8_h16_4k_d64")


def make_sets(b, hq, hkv, nq, nk, d, d_v):
    def one():
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, hkv, nk, d_v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return q, k, v, torch.randn(b, hq, nq, d_v, device="cuda", dtype=torch.bfloat16)
    return [one(), one()]


def bench_shape(name, shape, repeat, rounds):
    b, hq, hkv, nq, nk, d, causal, *rest = shape
    d_v = rest[0] if rest else d
    sets = make_sets(b, hq, hkv, nq, nk, d, d_v)
    fwd_flops = forward_flops(b, hq, nq, nk, (d + d_v) / 2, causal)
    rows = {}

    def ours(mode, grad):
        def make(s):
            q, k, v, _ = s
            def fn():
                with torch.set_grad_enabled(grad):
                    attn_qat.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv, mode=mode)
            return fn
        return make

    def ours_backward(mode):
        def make(s):
            q, k, v, dout = s
            out = attn_qat.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv, mode=mode)
            return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return make

    def sdpa(backend, backward):
        def make(s):
            q, k, v, dout = s
            if hq != hkv:  # expanded K/V: the SDPA backends' own GQA support varies across versions
                k, v = (t.detach().repeat_interleave(hq // hkv, dim=1).requires_grad_() for t in (k, v))
            def forward():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if not backward:
                return lambda: forward().detach()
            out = forward()
            return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return make

    cases = [
        ("attn_qat fwd (training, with O')", ours("attn_qat", True), fwd_flops),
        ("attn_qat fwd (inference)", ours("attn_qat", False), fwd_flops),
        ("attn_qat bwd", ours_backward("attn_qat"), 2.5 * fwd_flops),
        ("low_precision_o fwd (training, no O')", ours("low_precision_o", True), fwd_flops),
        ("low_precision_o bwd", ours_backward("low_precision_o"), 2.5 * fwd_flops),
        ("bf16 mode fwd", ours("bf16", False), fwd_flops),
        ("bf16 mode bwd", ours_backward("bf16"), 2.5 * fwd_flops),
        ("cuDNN fwd", sdpa(SDPBackend.CUDNN_ATTENTION, False), fwd_flops),
        ("cuDNN bwd", sdpa(SDPBackend.CUDNN_ATTENTION, True), 2.5 * fwd_flops),
        ("FA2 fwd", sdpa(SDPBackend.FLASH_ATTENTION, False), fwd_flops),
        ("FA2 bwd", sdpa(SDPBackend.FLASH_ATTENTION, True), 2.5 * fwd_flops),
    ]
    # Rounds over all the cases, each case's median over them, the order reversed every other round: times drift
    # within a process as the GPU heats (at its power cap, one backward took 21.3 ms, then 24.0 ms seconds later,
    # at b2_h16_16k on the H100), and cases timed one after the other would carry that drift into their ratios.
    times = {label: [] for label, _, _ in cases}
    errors = {}
    for r in range(rounds):
        for label, make, _ in (cases if r % 2 == 0 else cases[::-1]):
            if label in errors:
                continue
            try:
                times[label].append(timed(make, sets, repeat))
            except RuntimeError as e:  # a backend that does not take this shape (or ran out of memory)
                errors[label] = str(e).splitlines()[0][:200]
            torch.cuda.empty_cache()
    for label, _, flops in cases:
        if label in errors:  # no time, even if earlier rounds had one: the rounds' times stay for inspection
            rows[label] = {"ms": None, "ms_rounds": times[label], "TFLOP/s": None, "error": errors[label]}
        else:
            ms = statistics.median(times[label])
            rows[label] = {"ms": ms, "ms_rounds": times[label], "TFLOP/s": flops / ms / 1e9}

    def ratio(ours_labels, ref_labels):
        a = [rows[x]["ms"] for x in ours_labels]
        r = [rows[x]["ms"] for x in ref_labels]
        return None if None in a or None in r else sum(a) / sum(r)

    ratios = {
        "attn_qat fwd+bwd / cuDNN fwd+bwd": ratio(["attn_qat fwd (training, with O')", "attn_qat bwd"],
                                                  ["cuDNN fwd", "cuDNN bwd"]),
        "attn_qat inference fwd / cuDNN fwd": ratio(["attn_qat fwd (inference)"], ["cuDNN fwd"]),
        "low_precision_o fwd+bwd / cuDNN fwd+bwd": ratio(
            ["low_precision_o fwd (training, no O')", "low_precision_o bwd"], ["cuDNN fwd", "cuDNN bwd"]),
        "bf16 mode fwd+bwd / cuDNN fwd+bwd": ratio(["bf16 mode fwd", "bf16 mode bwd"], ["cuDNN fwd", "cuDNN bwd"]),
        "FA2 fwd+bwd / cuDNN fwd+bwd": ratio(["FA2 fwd", "FA2 bwd"], ["cuDNN fwd", "cuDNN bwd"]),
    }
    return {"shape": name, "dims": dict(zip(("B", "Hq", "Hkv", "Nq", "Nk", "D", "causal", "Dv"), shape)),
            "results": rows, "ratios": ratios}


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(results[0]["ratios"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        vals = [r["ratios"][key] or 0 for r in results]
        ax.bar([x + i * width for x in range(len(results))], vals, width, label=key)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(results))], [r["shape"] for r in results],
                  rotation=20)
    ax.set_ylabel("time / cuDNN time (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    args = parse_bench_args("attention", __doc__, 10, "only the 4k and 1k shapes", lambda parser: parser.add_argument(
        "--rounds", type=int, default=3, help="rounds over every case of a shape, each case's median over them "
        "(default 3)"))
    if args.rounds < 1:
        sys.exit("bench_attention: --rounds must be at least 1")
    results = []
    for name, shape in selected_shapes(args, SHAPES, QUICK):
        results.append(bench_shape(name, shape, args.repeat, args.rounds))
        r = results[-1]
        print(f"\n{name} {r['dims']}")
        for label, row in r["results"].items():
            ms = "n/a" if row["ms"] is None else f"{row['ms']:.3f} ms  {row['TFLOP/s']:.0f} TFLOP/s"
            print(f"  {label:34s} {ms}")
        for label, value in r["ratios"].items():
            print(f"  {label:34s} {'n/a' if value is None else f'{value:.2f}x'}")
    meta = metadata()
    print(f"\nGPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}")
    labels = list(results[0]["results"])
    print("| shape | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
    for r in results:
        cells = [("n/a" if r["results"][x]["ms"] is None else f"{r['results'][x]['ms']:.2f} ms / "
                  f"{r['results'][x]['TFLOP/s']:.0f}") for x in labels]
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    write_json(args.out, {**meta, "rounds": args.rounds,
                          "flops": "forward 2*B*H*Nq*Nk*(D + Dv), backward 2.5x, halved when causal",
                          "shapes": results})
    plot(results, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
