"""NVFP4 quantizer bandwidth: quantize, fake-quantize and the attention Q/K/V pre-pass, in GB/s
(bytes read + written) against a device-to-device copy measured in the same process.

    python benchmarks/bench_quant.py [--out benchmarks/results/quant.json]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from common import median_ms, metadata, write_json  # noqa: E402

# (tokens, heads, head_dim) of a Wan 2.1 14B self-attention at 480p, in diffusers' (B, S, H, D) layout,
# and a smaller tensor that still spills out of the 50 MB L2.
SHAPES = {"wan14b_480p": (1, 32760, 40, 128), "medium": (8, 4096, 8, 128)}


def bench_shape(name, shape):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    rows = []
    copy_dst = torch.empty_like(x)
    copy_ms = median_ms(lambda: copy_dst.copy_(x))
    copy_gbs = 2 * 2 * n / copy_ms / 1e6

    def add(what, fn, bytes_moved):
        ms = median_ms(fn)
        gbs = bytes_moved / ms / 1e6
        rows.append({"shape": name, "dims": list(shape), "op": what, "ms": ms, "GB/s": gbs,
                     "fraction_of_copy": gbs / copy_gbs})

    rows.append({"shape": name, "dims": list(shape), "op": "copy (bf16)", "ms": copy_ms, "GB/s": copy_gbs,
                 "fraction_of_copy": 1.0})
    packed = n // 2 + n // 16  # code bytes + scale bytes
    add("quantize along head_dim", lambda: attn_qat.quantize(x, -1), 2 * n + packed)
    add("fake_quantize along head_dim", lambda: attn_qat.fake_quantize(x, -1), 4 * n)
    add("fake_quantize along tokens", lambda: attn_qat.fake_quantize(x, 1, partial_last_block=True), 4 * n)
    q = x.transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D) memory, as diffusers passes it
    add("Q/K/V pre-pass (3 tensors)", lambda: attn_qat.fake_quantize_qkv(q, q, q), 3 * 4 * n)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quant.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant needs a CUDA GPU")
    rows = []
    for name, shape in SHAPES.items():
        rows += bench_shape(name, shape)
    meta = metadata()
    print(f"\nGPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}")
    print("| shape | op | ms | GB/s | of copy |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} {tuple(r['dims'])} | {r['op']} | {r['ms']:.3f} | {r['GB/s']:.0f} | "
              f"{100 * r['fraction_of_copy']:.0f}% |")
    write_json(args.out, {**meta, "results": rows})


if __name__ == "__main__":
    main()
