"""Small calls through every CUDA kernel of attn_qat, for compute-sanitizer (docs/sanitizers.md).

Each case checks its results against attn_qat.reference (numerics.md §7, the tests' tolerances), so that a run
without a sanitizer is a quick functional check and a run under one exercises exactly the launches the tests
trust. Cases run on both kernel paths in one process, switched by attn_qat.ops.kernel_options: the Hopper wgmma/TMA
kernels (sm90=True) and the mma.sync kernels (sm90=False). Sizes are tiny because the sanitizers slow
kernels 10-100x; each one is picked for a code path (see the case's label), not for coverage by volume.

    python dev/sanitize.py                  # both paths, every case (seconds)
    python dev/sanitize.py --path mma_sync --only decode
    dev/sanitize.sh                         # the same under memcheck, racecheck, synccheck and initcheck

Exit status 0 when every case passed, 1 when one failed, 2 when there is no CUDA GPU.
"""
import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import attn_qat  # noqa: E402
from attn_qat import reference  # noqa: E402
from conftest import rel_error  # noqa: E402
from test_attention import (BWD_TOL, FWD_TOL, deterministic_algorithms, forward_error,  # noqa: E402
                            poison_cuda_allocator)

PATHS = {"sm90": True, "mma_sync": False}
_seed = [5000]


def generator():
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0])


def randn(*shape, dtype=torch.bfloat16, g):
    return torch.randn(*shape, generator=g).to(dtype).cuda()


def poison():
    """NaN into the blocks the caching allocator hands out next (the tests' poison_cuda_allocator), so that an
    output element no kernel writes fails the comparison; without the caching allocator (as under dev/sanitize.sh,
    PYTORCH_NO_CUDA_MEMORY_CACHING=1) every tensor is a fresh cudaMalloc that initcheck watches instead."""
    if "PYTORCH_NO_CUDA_MEMORY_CACHING" not in os.environ:
        poison_cuda_allocator()


def same_bits(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ------------------------------------------------------------------------------------------------
# quantizers: quantize_rows (block axis innermost), quantize_tokens and fake_quantize_tokens (block axis outer,
# inner contiguous), quantize_strided (anything else), and the three dequantize kernels

def quantizers():
    g = generator()
    cases = [  # (x, block axis, partial last block)
        (randn(5, 3, 64, g=g), -1, False),                      # rows, bf16
        (randn(2, 3, 64, dtype=torch.float16, g=g), -1, False),  # rows, fp16
        (randn(2, 40, 64, g=g), 1, True),                        # tokens, partial last block
        (randn(3, 37, 5, dtype=torch.float32, g=g), 1, True),    # strided: 5 inner columns
        (randn(64, 3, g=g).t(), -1, False),                      # strided: block axis not contiguous
    ]
    for x, axis, partial in cases:
        poison()
        t = attn_qat.quantize(x, axis, partial_last_block=partial)
        fq = attn_qat.fake_quantize(x, axis, partial_last_block=partial)
        ref = reference.fake_quantize(x.cpu(), axis, partial_last_block=partial)
        assert same_bits(fq, ref), f"fake_quantize {tuple(x.shape)} axis {axis}"
        assert same_bits(attn_qat.dequantize(t), ref), f"dequantize {tuple(x.shape)} axis {axis}"
    q, k, v = randn(1, 2, 40, 64, g=g), randn(1, 2, 40, 64, g=g), randn(1, 2, 40, 64, g=g)
    for causal in (False, True):
        qf, kf, vf = attn_qat.fake_quantize_qkv(q, k, v, causal=causal)
        assert same_bits(qf, reference.fake_quantize(q.cpu(), -1))
        assert same_bits(kf, reference.fake_quantize(k.cpu(), -1))
        v_axis, partial = (-1, False) if causal else (2, True)
        assert same_bits(vf, reference.fake_quantize(v.cpu(), v_axis, partial_last_block=partial)), "V"
    return "rows, tokens, strided; fake_quantize_qkv"


# ------------------------------------------------------------------------------------------------
# training forward + backward

def training(b, hq, hkv, nq, nk, d, *, dtype=torch.bfloat16, causal=None, mask=None, mode="attn_qat",
             layout="bhsd", api="sdpa", scale=None, det=False):
    g = generator()

    def make(h, n):
        t = torch.randn(b, n, h, d, generator=g) if layout == "bshd" else torch.randn(b, h, n, d, generator=g)
        t = t.to(dtype).cuda()
        return t.transpose(1, 2) if layout == "bshd" else t  # (B, H, S, D) views either way

    q, k, v, dout = make(hq, nq), make(hkv, nk), make(hkv, nk), make(hq, nq)
    if mask == "bool":
        m = torch.rand(nq, nk, generator=g) > 0.3  # broadcast over batch and heads
        m[nq // 2] = False  # a row with no visible key
        mask = m.cuda()
    elif mask == "additive":
        mask = (torch.randn(b, 1, nq, nk, generator=g) * 2).cuda()
    with deterministic_algorithms(det):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        poison()
        if api == "sdpa":
            out = attn_qat.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal == "top_left",
                                                        scale=scale, enable_gqa=True, mode=mode)
        else:
            out = attn_qat.attention(qg, kg, vg, causal=causal == "bottom_right", softmax_scale=scale, layout="bhsd",
                                     mode=mode)
        poison()
        out.backward(dout)
    qc, kc, vc, dc = (t.cpu() for t in (q, k, v, dout))
    mc = None if mask is None else mask.cpu()
    ref = reference.attention(qc, kc, vc, attn_mask=mc, causal=causal, scale=scale, mode=mode)
    grads = reference.attention_backward(qc, kc, vc, dc, mode=mode, attn_mask=mc, causal=causal, scale=scale)
    errors = {"out": forward_error(out.detach(), ref)[0]}
    # Where a gradient is exactly 0 in exact arithmetic (one query that sees one key: dP = D), the kernels' fp32
    # rounding is all that is left: measured against dO's size instead.
    errors.update({n: rel_error(x, r) if r.norm() > 0 else float(x.double().norm() / dout.double().norm())
                   for n, x, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), grads)})
    assert errors["out"] <= FWD_TOL and max(errors["dq"], errors["dk"], errors["dv"]) <= BWD_TOL, errors
    return " ".join(f"{n} {e:.1e}" for n, e in errors.items())


def varlen(lens_q, lens_k, hq, hkv, d, causal=False):
    """attention_varlen forward + backward on packed sequences (lengths off the 16-key grid: the padded copy), each
    sequence against the reference run alone."""
    g = generator()
    tq, tk = sum(lens_q), sum(lens_k)
    q, dout = randn(tq, hq, d, g=g).cuda(), randn(tq, hq, d, g=g).cuda()
    k, v = randn(tk, hkv, d, g=g).cuda(), randn(tk, hkv, d, g=g).cuda()
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()  # noqa: E731
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    poison()
    out = attn_qat.attention_varlen(qg, kg, vg, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                    causal="bottom_right" if causal else False)
    poison()
    out.backward(dout)
    worst, i0, j0 = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}, 0, 0
    for nq, nk in zip(lens_q, lens_k):
        part = lambda t, a, n: t[a:a + n].transpose(0, 1)[None].cpu()  # noqa: E731  (1, H, n, D)
        args = (part(q, i0, nq), part(k, j0, nk), part(v, j0, nk))
        c = "bottom_right" if causal else None
        ref = reference.attention(*args, causal=c)
        grads = reference.attention_backward(*args, part(dout, i0, nq), causal=c)
        ours = (part(out.detach(), i0, nq), part(qg.grad, i0, nq), part(kg.grad, j0, nk), part(vg.grad, j0, nk))
        worst["out"] = max(worst["out"], forward_error(ours[0], ref)[0])
        for n, x, r in zip(("dq", "dk", "dv"), ours[1:], grads):
            if r.norm() > 0:
                worst[n] = max(worst[n], rel_error(x, r))
        i0, j0 = i0 + nq, j0 + nk
    assert worst["out"] <= FWD_TOL and max(worst["dq"], worst["dk"], worst["dv"]) <= BWD_TOL, worst
    return " ".join(f"{n} {e:.1e}" for n, e in worst.items())


# ------------------------------------------------------------------------------------------------
# inference: packed prefill, and decode on the NVFP4 KV cache

def prefill(b, hq, hkv, nq, nk, d, causal, layout):
    g = generator()
    shape = (lambda h, n: (b, n, h, d)) if layout == "bshd" else (lambda h, n: (b, h, n, d))
    q, k, v = randn(*shape(hq, nq), g=g), randn(*shape(hkv, nk), g=g), randn(*shape(hkv, nk), g=g)
    poison()
    packed = attn_qat.quantize_qkv(q, k, v, layout=layout, causal=causal)
    out = attn_qat.nvfp4_attention(*packed, causal=causal, layout=layout)
    bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    ref = reference.attention(*(bhsd(t).cpu() for t in (q, k, v)), causal="bottom_right" if causal else None)
    error = forward_error(bhsd(out), ref)[0]
    assert error <= FWD_TOL, error
    return f"out {error:.1e}"


DECODE_VARIANTS = (0, 1, 2, 3)  # the decode_variant kernel option: combine kernel or last-CTA merge, x early start


def decode(b, hq, hkv, d, lengths, tq, page_size=None, dtype=torch.bfloat16, chunk=None):
    """Appends in two pieces (sequences growing unequally), then attention of tq query tokens (the CUDA decode
    kernel takes up to 16) against the reference on the fake-quantized cache, bottom-right causal per sequence;
    every kernel variant (DECODE_VARIANTS) must give the same bits. `chunk` sets the decode_chunk kernel option."""
    g = generator()
    capacity = max(lengths)
    paging = {} if page_size is None else {"page_size": page_size}
    cache = attn_qat.NVFP4KVCache(b, hkv, d, capacity, dtype=dtype, device="cuda", **paging)
    k = torch.randn(b, hkv, capacity, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, capacity, d, generator=g).to(dtype)
    first = [n // 2 for n in lengths]
    cache.append(k[:, :, : max(first)].cuda(), v[:, :, : max(first)].cuda(), first)
    rest = [n - f for n, f in zip(lengths, first)]
    tail = torch.stack([torch.cat([k[i, :, f:], k[i, :, :f]], dim=1) for i, f in enumerate(first)])
    tail_v = torch.stack([torch.cat([v[i, :, f:], v[i, :, :f]], dim=1) for i, f in enumerate(first)])
    cache.append(tail[:, :, : max(rest)].cuda(), tail_v[:, :, : max(rest)].cuda(), rest)
    q = randn(b, hq, tq, d, dtype=dtype, g=g)
    outs = []
    with attn_qat.ops.kernel_options(decode_chunk=chunk or "auto"):
        for variant in DECODE_VARIANTS:
            with attn_qat.ops.kernel_options(decode_variant=variant):
                poison()
                outs.append(cache.attention(q))
    out = outs[0]
    for variant, other in zip(DECODE_VARIANTS, outs):
        assert torch.equal(other.view(torch.int16), out.view(torch.int16)), f"variant {variant} differs"
    worst = 0.0
    for i, n in enumerate(lengths):
        if n == 0:  # no key: O = 0
            assert not out[i].any()
            continue
        fq = lambda t, n=n: reference.fake_quantize(t[:, :n], -1)[None]  # noqa: E731
        ref = reference.attention_forward(reference.fake_quantize(q[i].cpu(), -1)[None], fq(k[i]), fq(v[i]),
                                          causal="bottom_right", operands_quantized=True)["out"]
        worst = max(worst, forward_error(out[i : i + 1], ref)[0])
    assert worst <= FWD_TOL, worst
    return f"out {worst:.1e}"


# ------------------------------------------------------------------------------------------------

def cases():
    """(name, label, fn): every registered CUDA kernel family, small."""
    t = training
    return [
        ("quantize", "quantizers", quantizers),
        # causal both alignments, grouped KV, odd N; 130 queries x group 2 = 6 dK/dV steps: the 3-slot ring wraps
        ("causal_top_left_gqa", "B1 Hq4 Hkv2 N77x93 D64 top-left", lambda: t(1, 4, 2, 77, 93, 64, causal="top_left")),
        ("causal_bottom_right", "B2 Hq2 Hkv1 N130x300 D128 fp16 bottom-right",
         lambda: t(2, 2, 1, 130, 300, 128, dtype=torch.float16, causal="bottom_right", api="attention")),
        ("bottom_right_dead_rows", "N70x33 D64: 37 rows see no key",
         lambda: t(1, 2, 2, 70, 33, 64, causal="bottom_right", api="attention")),
        ("one_query", "N1x1 D128", lambda: t(1, 2, 1, 1, 1, 128)),
        ("one_query_many_keys", "N1x50 D64 bottom-right",
         lambda: t(1, 2, 2, 1, 50, 64, causal="bottom_right", api="attention")),
        ("bool_mask", "(Nq, Nk) bool mask broadcast, N65x80 D128", lambda: t(1, 2, 2, 65, 80, 128, mask="bool")),
        ("additive_mask", "(B, 1, Nq, Nk) additive mask, N40x72 D64", lambda: t(2, 2, 1, 40, 72, 64, mask="additive")),
        ("token_major", "bshd memory, N96x96 D128", lambda: t(1, 4, 2, 96, 96, 128, layout="bshd")),
        ("negative_scale", "scale -0.2, N33x47 D64", lambda: t(1, 2, 2, 33, 47, 64, scale=-0.2)),
        ("deterministic_dq", "deterministic dQ kernel, N150x280 D128 top-left",
         lambda: t(1, 4, 2, 150, 280, 128, causal="top_left", det=True)),
        ("deterministic_dq_d64", "deterministic dQ kernel, N70x70 D64 fp16",
         lambda: t(1, 2, 1, 70, 70, 64, dtype=torch.float16, det=True)),
        ("mode_high_precision_p", "N50x60 D64", lambda: t(1, 2, 2, 50, 60, 64, mode="high_precision_p")),
        ("mode_low_precision_o", "N50x60 D128 top-left",
         lambda: t(1, 2, 2, 50, 60, 128, mode="low_precision_o", causal="top_left")),
        ("mode_drop_in", "N50x60 D64 mask", lambda: t(1, 2, 2, 50, 60, 64, mode="drop_in", mask="bool")),
        ("mode_bf16", "N100x130 D128 top-left", lambda: t(1, 4, 2, 100, 130, 128, mode="bf16", causal="top_left")),
        ("mode_bf16_d64", "N77x93 D64", lambda: t(1, 2, 2, 77, 93, 64, mode="bf16")),
        # a forced split of the last wave: the Hopper tail kernels and both merge kernels
        ("tail_split", "tail_split=(2, 3), N300x400 D64", lambda: split(lambda: t(1, 2, 2, 300, 400, 64))),
        ("tail_split_d128", "tail_split=(2, 3), N200x300 D128 mask",
         lambda: split(lambda: t(1, 2, 1, 200, 300, 128, mask="bool"))),
        ("varlen", "packed 33 + 1 + 70 keys (padded copy) D64 GQA",
         lambda: varlen([20, 1, 70], [33, 1, 70], 4, 2, 64)),
        ("varlen_causal", "packed 40 + 17 + 128, causal bottom-right D128",
         lambda: varlen([40, 17, 128], [40, 30, 128], 2, 2, 128, causal=True)),
        ("prefill", "N77x93 D64 bshd", lambda: prefill(1, 2, 1, 77, 93, 64, False, "bshd")),
        ("prefill_causal", "N50x130 D128 bhsd causal", lambda: prefill(2, 2, 2, 50, 130, 128, True, "bhsd")),
        ("decode", "Tq1 D128 lengths 37, 5", lambda: decode(2, 4, 2, 128, [37, 5], 1)),
        ("decode_3", "Tq3 D64 lengths 70, 2 (one row sees no key)", lambda: decode(2, 2, 1, 64, [70, 2], 3)),
        ("decode_paged", "Tq1 D64 pages of 16, lengths 40, 17", lambda: decode(2, 2, 2, 64, [40, 17], 1, page_size=16)),
        ("decode_group3", "Tq1 D64, 9 query heads over 3 KV heads (SmolLM2's shape)",
         lambda: decode(1, 9, 3, 64, [90], 1)),
        ("decode_paged_3", "Tq3 D128 fp16 pages of 32, lengths 65, 30",
         lambda: decode(2, 4, 1, 128, [65, 30], 3, page_size=32, dtype=torch.float16)),
        # the last-CTA merge: up to 40 chunks a sequence (more than a warp's lanes), an empty and a one-chunk one
        ("decode_merge", "Tq1 D128 chunks of 64, lengths 2500, 0, 40",
         lambda: decode(3, 8, 2, 128, [2500, 0, 40], 1, chunk=64)),
        ("decode_merge_tiles", "Tq5 D64 pages of 16, 16 q heads a KV head (5 row tiles), chunks of 128, L 700, 300",
         lambda: decode(2, 16, 1, 64, [700, 300], 5, page_size=16, chunk=128)),
    ]


def split(fn):
    with attn_qat.ops.kernel_options(tail_split=(2, 3)):
        return fn()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=["both", *PATHS], default="both", help="kernel path(s) to run")
    parser.add_argument("--only", action="append", default=[], help="run cases whose name contains this (repeatable)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("dev/sanitize.py: no CUDA GPU: nothing to check", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    hopper = torch.cuda.get_device_capability() == (9, 0)
    print(f"dev/sanitize.py on {name}; its sm90 path runs the mma.sync kernels too" if not hopper
          else f"dev/sanitize.py on {name}")
    failed, start = [], time.time()
    for path in PATHS if args.path == "both" else [args.path]:
        with attn_qat.ops.kernel_options(sm90=PATHS[path]):
            for case, label, fn in cases():
                if args.only and not any(o in case for o in args.only):
                    continue
                t0 = time.time()
                try:
                    result = fn()
                    torch.cuda.synchronize()
                    print(f"ok    {path:8} {case:24} {label}: {result} ({time.time() - t0:.1f} s)", flush=True)
                except Exception:  # a case that fails is reported; the others still run
                    failed.append(f"{path} {case}")
                    print(f"FAIL  {path:8} {case:24} {label}\n{traceback.format_exc()}", flush=True)
    print(f"dev/sanitize.py: {len(failed)} failed ({time.time() - start:.0f} s){': ' if failed else ''}"
          f"{', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
