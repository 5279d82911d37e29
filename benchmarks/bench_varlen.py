"""Packed-sequence attention speed: attn_qat.attention_varlen's training step (forward with O', then backward) on
packed sequences, against the dense batch of the same tokens and against other varlen kernels on the same tensors
(torch's FlashAttention varlen_attn, flash_attn's flash_attn_varlen_func and cuDNN through nested tensors, each when
it imports and takes the shape), in one process.

Shapes: 8 packed sequences of 2048 against the dense (8, 2048) batch (the same tiles: the packed call should cost
what the batch costs); a mix of lengths summing to 16384, most of them not multiples of 16 (so K and V are copied
into the padded layout, numerics.md §2), against the dense (8, 2048) batch of the same 16384 tokens (different
attention work: the mix's longest sequence alone is 4096 tokens); and the same two on grouped KV heads. D = 128,
bf16, causal and not. FLOPs count the visible work, 4 H sum_s Nq_s Nk_s D (halved when causal), backward 2.5x.
`varlen host part` is what a call does on the host before its kernels (the read of cu_seqlens, a sync, and the
cached plan), timed apart with the GPU idle.

    python benchmarks/bench_varlen.py [--out benchmarks/results/varlen.json] [--quick] [--only shape,...]
                                      [--orders index,lpt]

--orders adds attn_qat varlen rows for each work order (the work_order kernel option: "lpt", packed items longest
first, the default, or "index", the dense calls' order), in the order given (repeat names for more rounds), for
A/B runs in one process; both give the same bits. Causal packings have no table, so both rows run index order there.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_qat  # noqa: E402
from common import metadata, parse_bench_args, selected_shapes, timed, write_json  # noqa: E402

MIX_16K = [4096, 3001, 2500, 2011, 1777, 1203, 900, 555, 201, 140]  # 9 of 10 not multiples of 16
assert sum(MIX_16K) == 16384
# name: (sequence lengths, heads_q, heads_kv, head_dim, causal, the dense batch (B, N) to compare with)
SHAPES = {
    "8x2048": ([2048] * 8, 16, 16, 128, False, (8, 2048)),
    "8x2048_causal": ([2048] * 8, 16, 16, 128, True, (8, 2048)),
    "mix16k": (MIX_16K, 16, 16, 128, False, (8, 2048)),
    "mix16k_causal": (MIX_16K, 16, 16, 128, True, (8, 2048)),
    "8x2048_gqa_causal": ([2048] * 8, 32, 8, 128, True, (8, 2048)),
    "mix16k_gqa_causal": (MIX_16K, 32, 8, 128, True, (8, 2048)),
}
QUICK = ("8x2048", "8x2048_causal", "mix16k_causal")


def flops(lengths, hq, d, causal):
    return 4 * hq * sum(n * n for n in lengths) * d / (2 if causal else 1)


def make_sets(total, hq, hkv, d):
    def one():
        q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return q, k, v, torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
    return [one(), one()]


def other_varlen_kernels():
    """(label, fn(q, k, v, cu, max_len, causal) -> out) of the varlen kernels this machine has."""
    kernels = []
    try:
        from torch.nn.attention.varlen import varlen_attn

        def torch_fa(q, k, v, cu, n, causal):  # enable_gqa only where needed: torch 2.11's varlen_attn lacks it
            gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
            return varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0) if causal else (-1, -1), **gqa)
        kernels.append(("torch varlen_attn (FA)", torch_fa))
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        def fa2(q, k, v, cu, n, causal):
            return flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal)
        kernels.append(("flash_attn varlen (FA2)", fa2))
    except ImportError:
        pass

    def cudnn(q, k, v, cu, n, causal):  # nested (jagged) tensors through SDPA's cuDNN backend
        from torch.nn.attention import SDPBackend, sdpa_kernel
        offsets = cu.long()
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets, max_seqlen=n).transpose(1, 2) for t in (q, k, v)]
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("grouped KV heads: not through nested tensors")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(*nested, is_causal=causal)
        return out.transpose(1, 2).values()
    kernels.append(("cuDNN (nested tensors)", cudnn))
    return kernels


def host_ms(fn, repeat=20):
    """Host time of a call with the GPU idle (the planning part of attention_varlen)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def bench_shape(name, shape, repeat, orders=()):
    lengths, hq, hkv, d, causal, (b, n) = shape
    total = sum(lengths)
    assert b * n == total
    sets = make_sets(total, hq, hkv, d)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    longest = max(lengths)
    work = flops(lengths, hq, d, causal)
    dense_work = flops([n] * b, hq, d, causal)
    rows = {}

    def varlen_step(s):
        q, k, v, dout = s
        def fn():
            out = attn_qat.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)
            torch.autograd.grad(out, (q, k, v), dout)
        return fn

    def varlen_fwd(s):
        q, k, v, _ = s
        return lambda: attn_qat.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)

    def dense_step(s):
        q, k, v, dout = s
        qd, kd, vd = (t.detach().view(b, n, *t.shape[1:]).requires_grad_() for t in (q, k, v))
        dd = dout.view(b, n, *dout.shape[1:])
        def fn():
            out = attn_qat.attention(qd, kd, vd, causal=causal)
            torch.autograd.grad(out, (qd, kd, vd), dd)
        return fn

    def other_step(kernel):
        def make(s):
            q, k, v, dout = s
            def fn():
                out = kernel(q, k, v, cu, longest, causal)
                torch.autograd.grad(out, (q, k, v), dout)
            return fn
        return make

    cases = [("attn_qat varlen fwd+bwd", varlen_step, work),
             ("attn_qat varlen fwd (training)", varlen_fwd, work),
             (f"attn_qat dense ({b}, {n}) fwd+bwd", dense_step, dense_work)]
    cases += [(f"{label} fwd+bwd", other_step(kernel), work) for label, kernel in other_varlen_kernels()]
    for i, order in enumerate(orders):  # A/B rows: the option is read when each call plans its kernels
        suffix = f" (order {order}{'' if order not in orders[:i] else f' #{orders[:i].count(order) + 1}'})"
        cases += [(f"attn_qat varlen fwd+bwd{suffix}", varlen_step, work, order),
                  (f"attn_qat varlen fwd (training){suffix}", varlen_fwd, work, order)]
    for label, make, fl, *order in cases:
        try:
            with torch.set_grad_enabled(True), attn_qat.ops.kernel_options(work_order=(order or [None])[0]):
                ms = timed(make, sets, repeat)
            fwd_bwd = "fwd+bwd" in label
            rows[label] = {"ms": ms, "TFLOP/s": fl * (3.5 if fwd_bwd else 1) / ms / 1e9}
        except Exception as e:  # a kernel that does not take this shape, or is missing
            rows[label] = {"ms": None, "TFLOP/s": None, "error": str(e).splitlines()[0][:200] if str(e) else repr(e)}
        torch.cuda.empty_cache()

    def host_part():  # what attention_varlen does on the host before the kernels: read cu_seqlens, find the plan
        cu_q, cu_k, _, _ = attn_qat.varlen._host_values(cu, cu, [None, None])
        attn_qat.varlen._plan(tuple(cu_q), tuple(cu_k), "bottom_right" if causal else None,
                              attn_qat.varlen._needs_padding(cu_k, "attn_qat"), cu.device)
    rows["varlen host part (cu_seqlens read, cached plan)"] = {"ms": host_ms(host_part)}

    def ratio(a, r):
        a, r = rows[a]["ms"], rows[r]["ms"]
        return None if a is None or r is None else a / r
    dense = f"attn_qat dense ({b}, {n}) fwd+bwd"
    ratios = {f"varlen / dense ({b}, {n})": ratio("attn_qat varlen fwd+bwd", dense)}
    for label, _ in other_varlen_kernels():
        ratios[f"varlen / {label}"] = ratio("attn_qat varlen fwd+bwd", f"{label} fwd+bwd")
    for label in rows:
        if label.startswith("attn_qat varlen fwd+bwd ("):
            ratios[f"varlen{label[len('attn_qat varlen fwd+bwd'):]} / dense ({b}, {n})"] = ratio(label, dense)
    return {"shape": name, "dims": {"lengths": lengths, "Hq": hq, "Hkv": hkv, "D": d, "causal": causal,
                                    "dense": [b, n], "unaligned": sum(x % 16 != 0 for x in lengths)},
            "results": rows, "ratios": ratios}


def main():
    def add_orders(parser):
        parser.add_argument("--orders", default="", help="comma-separated work orders (lpt, index) to add rows for")
    args = parse_bench_args("varlen", __doc__, 10, "8x2048 (both) and the causal mix only", add_orders)
    orders = [o for o in args.orders.split(",") if o]
    bad = [o for o in orders if o not in attn_qat.ops.WORK_ORDERS]
    if bad:
        sys.exit(f"--orders: unknown order(s) {', '.join(bad)}; choose from {', '.join(attn_qat.ops.WORK_ORDERS)}")
    results = []
    for name, shape in selected_shapes(args, SHAPES, QUICK):
        results.append(bench_shape(name, shape, args.repeat, orders))
        r = results[-1]
        print(f"\n{name} {r['dims']}")
        for label, row in r["results"].items():
            if row["ms"] is None:
                print(f"  {label:40s} n/a ({row.get('error', '')})")
            else:
                tf = f"  {row['TFLOP/s']:.0f} TFLOP/s" if row.get("TFLOP/s") else ""
                print(f"  {label:40s} {row['ms']:.3f} ms{tf}")
        for label, value in r["ratios"].items():
            print(f"  {label:40s} {'n/a' if value is None else f'{value:.2f}x'}")
    meta = metadata()
    print(f"\nGPU {meta['gpu']}, commit {meta['commit']}, {meta['date']}, torch {meta['torch']}")
    write_json(args.out, {**meta, "flops": "4*H*sum(Nq*Nk)*D, halved when causal; fwd+bwd 3.5x", "shapes": results})


if __name__ == "__main__":
    main()
