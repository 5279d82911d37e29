"""The cost of blocking V along head_dim (numerics.md §2) in causal attention: the same calls with
`v_block_axis="tokens"` (the rule before the change, which lets hidden keys set V's block scales) and "auto"
(head_dim under causal), alternating in one process over several rounds. Only the Q/K/V pre-pass differs
between the two: the attention kernels read the same bf16 V^F either way.

    python benchmarks/bench_v_block_axis.py [--out benchmarks/results/v_block_axis.json] [--quick]
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from bench_attention import make_sets  # noqa: E402
from common import metadata, parse_bench_args, selected_shapes, timed, write_json  # noqa: E402

# name: (batch, heads_q, heads_kv, tokens, head_dim); causal self-attention
SHAPES = {
    "qwen_gqa_causal": (4, 32, 8, 4096, 128),  # bench_attention.py's causal shape
    "causal_16k": (1, 32, 8, 16384, 128),
    "causal_4k_d64": (8, 16, 16, 4096, 64),
}
QUICK = ("qwen_gqa_causal",)
ROUNDS = 5
AXES = ("tokens", "auto")


def bench_shape(name, shape, repeat):
    b, hq, hkv, n, d = shape
    sets = make_sets(b, hq, hkv, n, n, d)

    def call(s, axis):
        q, k, v, _ = s
        return attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv,
                                                     v_block_axis=axis)

    def train(axis):
        def make(s):
            q, k, v, dout = s
            return lambda: torch.autograd.grad(call(s, axis), (q, k, v), dout)
        return make

    def infer(axis):
        def make(s):
            def fn():
                with torch.no_grad():
                    call(s, axis)
            return fn
        return make

    times = {(kind, axis): [] for kind in ("training fwd+bwd", "inference fwd") for axis in AXES}
    for _ in range(ROUNDS):
        for axis in AXES:  # alternating, so clock and thermal drift hit both alike
            times[("training fwd+bwd", axis)].append(timed(train(axis), sets, repeat))
            times[("inference fwd", axis)].append(timed(infer(axis), sets, repeat))
    rows = {f"{kind}, v_block_axis={axis}": {"ms_rounds": ms, "ms": statistics.median(ms)}
            for (kind, axis), ms in times.items()}
    ratios = {kind: rows[f"{kind}, v_block_axis=auto"]["ms"] / rows[f"{kind}, v_block_axis=tokens"]["ms"]
              for kind in ("training fwd+bwd", "inference fwd")}
    return {"shape": name, "dims": dict(zip(("B", "Hq", "Hkv", "N", "D"), shape)), "results": rows,
            "auto / tokens": ratios}


def main():
    args = parse_bench_args("v_block_axis", __doc__, 10, "only the Qwen causal shape")
    results = []
    for name, shape in selected_shapes(args, SHAPES, QUICK):
        r = bench_shape(name, shape, args.repeat)
        results.append(r)
        print(f"\n{name} {r['dims']}")
        for label, row in r["results"].items():
            print(f"  {label:42s} {row['ms']:.3f} ms  (rounds {', '.join(f'{x:.3f}' for x in row['ms_rounds'])})")
        for kind, ratio in r["auto / tokens"].items():
            print(f"  {kind}: head_dim / tokens = {ratio:.3f}")
    meta = metadata()
    print(f"\nGPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}")
    write_json(args.out, {**meta, "rounds": ROUNDS, "shapes": results})


if __name__ == "__main__":
    main()
