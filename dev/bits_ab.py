"""Bit-for-bit A/B of two builds of attn_qat on one GPU: outputs and gradients of a fixed set of attention calls.

A kernel change that should move no bit (a new work order, a new register layout, a reordered pipeline) is checked
by running the same calls under each build, in two processes (each build is its own `attn_qat/_C`), and comparing:

    PYTHONPATH=/tmp/base python dev/bits_ab.py save /tmp/base.pt     # e.g. a tree from dev/branch_trees.sh
    PYTHONPATH=/tmp/new  python dev/bits_ab.py save /tmp/new.pt
    python dev/bits_ab.py compare /tmp/base.pt /tmp/new.pt          # exit status 1 if some bit differs

`save` runs every case twice: a tensor that differs between the two runs of one build (the fused dQ's fp32 atomics
outside deterministic mode) is compared by its largest relative difference instead of its bits. The cases are the
awkward ones of docs/numerics.md: every mode, D = 64 and 128, grouped KV heads, N not a multiple of the tile,
N_q != N_k, causal in both alignments, bool masks with fully masked rows, additive masks, packed sequences, a forced
last-wave split with and without deterministic algorithms, NaN in one key and in one query, and a huge scale.
`--only` picks cases by substring; `--list` names them.
"""
import argparse
import contextlib
import sys

import torch

DEVICE = ["cuda"]  # set by --device
MODES = ("attn_qat", "drop_in", "high_precision_p", "low_precision_o", "bf16")


def inputs(seed, b, hq, hkv, nq, nk, d, dtype=torch.bfloat16):
    g = torch.Generator(device=DEVICE[0]).manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g, device=DEVICE[0], dtype=torch.float32).to(dtype)

    return t(b, hq, nq, d), t(b, hkv, nk, d), t(b, hkv, nk, d), t(b, hq, nq, d)


def dense_case(b, hq, hkv, nq, nk, d, mode="attn_qat", causal=None, mask=None, scale=None, poison=None, seed=0):
    """A call of scaled_dot_product_attention (causal "top_left") or attention (causal "bottom_right")."""
    def run():
        import attn_qat
        q, k, v, dout = inputs(seed, b, hq, hkv, nq, nk, d)
        if poison == "k":
            k[0, 0, nk // 2] = float("nan")
        elif poison == "q":
            q[0, 0, nq // 2] = float("nan")
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        m = mask() if mask else None
        if causal == "bottom_right":
            out = attn_qat.attention(q, k, v, causal=True, softmax_scale=scale, layout="bhsd", mode=mode)
        else:
            out = attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal == "top_left",
                                                        scale=scale, enable_gqa=hq != hkv, mode=mode)
        out.backward(dout)
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return run


def varlen_case(lengths_q, lengths_k, hq, hkv, d, mode="attn_qat", causal=False, seed=0):
    def run():
        import attn_qat
        g = torch.Generator(device=DEVICE[0]).manual_seed(seed)
        tq, tk = sum(lengths_q), sum(lengths_k)

        def t(n, h):
            return torch.randn(n, h, d, generator=g, device=DEVICE[0]).to(torch.bfloat16)

        q, k, v, dout = t(tq, hq), t(tk, hkv), t(tk, hkv), t(tq, hq)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE[0])
        out = attn_qat.attention_varlen(q, k, v, cu(lengths_q), cu(lengths_k), max(lengths_q), max(lengths_k),
                                        causal=causal, mode=mode)
        out.backward(dout)
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return run


def bool_mask(b, hq, nq, nk, empty_rows=(3, 77)):
    def make():
        g = torch.Generator(device=DEVICE[0]).manual_seed(7)
        m = torch.rand(b, 1, nq, nk, generator=g, device=DEVICE[0]) > 0.3
        m[..., list(empty_rows), :] = False  # rows that see no key: output and gradients 0
        return m.expand(b, hq, nq, nk)
    return make


def additive_mask(b, nq, nk):
    def make():
        g = torch.Generator(device=DEVICE[0]).manual_seed(8)
        return (torch.randn(b, 1, nq, nk, generator=g, device=DEVICE[0]) * 2).to(torch.bfloat16)
    return make


def cases():
    c = {}
    for mode in MODES:
        for d in (64, 128):
            c[f"{mode}_d{d}_gqa_odd"] = (dense_case(2, 8, 2, 301, 301, d, mode), {})
            c[f"{mode}_d{d}_causal_br_nq_ne_nk"] = (dense_case(1, 4, 4, 190, 517, d, mode, "bottom_right"), {})
        c[f"{mode}_d128_causal_tl"] = (dense_case(1, 4, 2, 517, 517, 128, mode, "top_left"), {})
        c[f"{mode}_varlen"] = (varlen_case([300, 17, 1000, 1], [300, 40, 900, 16], 4, 2, 128, mode), {})
        c[f"{mode}_varlen_causal"] = (varlen_case([300, 17, 1000, 1], [300, 17, 1000, 1], 4, 2, 128, mode, True), {})
    for d in (64, 128):
        c[f"bool_mask_empty_rows_d{d}"] = (dense_case(2, 4, 4, 200, 333, d, mask=bool_mask(2, 4, 200, 333)), {})
        c[f"additive_mask_d{d}"] = (dense_case(2, 4, 4, 200, 333, d, mask=additive_mask(2, 200, 333)), {})
        c[f"nan_key_d{d}"] = (dense_case(1, 4, 4, 256, 256, d, poison="k"), {})
        c[f"nan_query_d{d}"] = (dense_case(1, 4, 4, 256, 256, d, poison="q"), {})
        c[f"huge_scale_d{d}"] = (dense_case(1, 4, 4, 256, 256, d, scale=1e30), {})
    for det in (False, True):
        name = "tail_split_5_3" + ("_deterministic" if det else "")
        c[name] = (dense_case(2, 16, 4, 2048, 2048, 128), {"tail_split": (5, 3), "deterministic": det})
        c[name + "_varlen"] = (varlen_case([2048, 700, 1], [2048, 700, 1], 16, 4, 128),
                               {"tail_split": (5, 3), "deterministic": det})
    return c


def run_case(fn, opts):
    import attn_qat.ops
    split = {"tail_split": opts["tail_split"]} if "tail_split" in opts else {}
    det = torch.use_deterministic_algorithms if opts.get("deterministic") else None
    with attn_qat.ops.kernel_options(**split):
        if det:
            det(True)
        try:
            return {k: v.detach().cpu() for k, v in fn().items()}
        finally:
            if det:
                det(False)


def save(path, only):
    results = {}
    for name, (fn, opts) in cases().items():
        if only and not any(s in name for s in only):
            continue
        try:
            a, b = run_case(fn, opts), run_case(fn, opts)
            stable = {k: torch.equal(bits(a[k]), bits(b[k])) for k in a}
            results[name] = {"tensors": a, "stable": stable}
            print(f"{name}: " + ", ".join(f"{k}{'' if s else ' (run to run unstable)'}" for k, s in stable.items()))
        except Exception as e:  # recorded, so that the other build's result can be compared with it
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {results[name]['error']}")
    torch.save(results, path)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def compare(path_a, path_b):
    a, b = torch.load(path_a), torch.load(path_b)
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'A' if name in a else 'B'}")
            continue
        ra, rb = a[name], b[name]
        if "error" in ra or "error" in rb:
            same = ra.get("error") == rb.get("error")
            bad += not same
            print(f"{name}: {'same error' if same else 'DIFFERS'}: A {ra.get('error')!r}, B {rb.get('error')!r}")
            continue
        parts = []
        for k, ta in ra["tensors"].items():
            tb = rb["tensors"][k]
            if not (ra["stable"][k] and rb["stable"][k]):  # fp32 atomics: compare values
                both = torch.isfinite(ta) & torch.isfinite(tb)
                rel = ((ta.double() - tb.double()).abs()[both].max() / tb.double().abs()[both].max().clamp_min(1e-30)
                       if both.any() else torch.tensor(0.0))
                same_nonfinite = torch.equal(ta.isnan(), tb.isnan())
                parts.append(f"{k} unstable, max rel diff {float(rel):.1e}{'' if same_nonfinite else ', NaN MOVED'}")
                bad += not same_nonfinite
                continue
            n = int((bits(ta) != bits(tb)).sum())
            bad += n > 0
            parts.append(f"{k} {'identical' if n == 0 else f'{n} of {ta.numel()} DIFFER'}")
        print(f"{name}: " + "; ".join(parts))
    print("every bit the same" if bad == 0 else f"{bad} differences")
    return 1 if bad else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="run the cases with the attn_qat on PYTHONPATH and save what they return")
    s.add_argument("path")
    s.add_argument("--only", default="", help="comma-separated substrings of case names")
    s.add_argument("--device", default="cuda", help="cuda (the point), or cpu to try the script itself")
    c = sub.add_parser("compare", help="compare two saved files")
    c.add_argument("a")
    c.add_argument("b")
    sub.add_parser("list", help="the case names")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(cases()))
        return 0
    if args.cmd == "compare":
        return compare(args.a, args.b)
    DEVICE[0] = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bits_ab.py save needs a CUDA GPU (or --device cpu)")
    with contextlib.suppress(Exception):
        torch.backends.cuda.matmul.allow_tf32 = False
    save(args.path, [s for s in args.only.split(",") if s])
    return 0


if __name__ == "__main__":
    sys.exit(main())
