"""P's fp16 path (docs/numerics.md §3, issue 30) on the CPU: the exhaustive checks its definition rests on, and what it
changes against the fp32 path it replaced.

    python dev/p_fp16_numerics.py exhaustive [--ex2-table DIR]   # ~1 min: every input each claim covers
    python dev/p_fp16_numerics.py measure [--quick] [--json FILE]  # ~10 min (--quick ~3): codes, errors, tiling
    python dev/p_fp16_numerics.py summary FILE                    # the tables of a measure run's JSON

`exhaustive` checks, for every input concerned:
  - 2^x for every fp32 x in [-25, 11.01] against the fp16 rounding midpoints (how far the closest one is: any float64
    exp2 then gives the correctly rounded fp16 value; and how many lie within an fp32 ex2.approx error of one, which
    bounds how often a kernel's cvt.rn.f16(ex2.approx.ftz.f32(x)) can differ from the definition);
  - fp16(fp32(1 / s)) == fp16(1 / s) for the 126 positive E4M3 scales s;
  - e4m3(fp16(amax / 6)) == e4m3(fp32(amax / 6)) for every fp16 amax (a kernel may form the scale in fp16 if its
    quotient is correctly rounded), and how often multiplying by fp16(1/6) instead breaks it;
  - the f16x2 E2M1 sequence (b = max(y, 1) & 0x7C00, fma(b, 512, y), fma(b, -512, .)) == e2m1(y) for every fp16 y
    in [0, 8];
  - fp16(w * fp16(1 / s)) against fp16(w / s) (why the definition names the product);
  - with --ex2-table DIR (ex2_f16.bin, ex2_bf16.bin: uint16 little-endian, entry i the H100's ex2.approx.f16 /
    ex2.approx.ftz.bf16 of the input with bits i): which rounding rule the hardware's 16-bit exponentials follow.
`measure` runs the old path (fp32 P̂, §1's fp32 block rule on P̂ * 2^11) and the candidate fp16 paths on the same
float64 scores of bf16 inputs, D = 64 and 128, N = 256..2048, three input kinds at three temperatures, and reports
the fraction of P's E2M1 codes and block scales that change, how far O moves, the FP4-vs-exact error of O
(relative Frobenius, cosine against float64 softmax attention on the same bf16 inputs) of each path, and whether
a one-pass (running frame) evaluation reproduces the two-pass P^F.
"""
import argparse
import json
import math
import sys
import time
import zlib
from fractions import Fraction
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_qat import reference as ref  # noqa: E402

HEADROOM = 2.0**11


# ----------------------------------------------------------------------------------------------
# Roundings (float64 tensors in and out)
# ----------------------------------------------------------------------------------------------

def rn32(v):
    return v.float().double()


def trunc16(v):
    """Toward zero onto the fp16 grid, v >= 0 (subnormals kept)."""
    _, e = torch.frexp(torch.where(torch.isfinite(v), v, 0.0))
    spacing = torch.ldexp(torch.ones_like(v), torch.clamp(e - 11, min=-24))
    return torch.where(torch.isfinite(v), torch.floor(v / spacing) * spacing, v)


def ex2_f16(xh):
    """ex2.approx.f16 as measured on the H100 (see `exhaustive --ex2-table`): trunc16(fp32(2^x)), except that
    x = -2^-24 gives 1."""
    out = trunc16(rn32(torch.exp2(xh)))
    return torch.where(xh == -(2.0**-24), 1.0, out)


def from_bits16(dtype):
    """The 65536 values of a 16-bit dtype in bit order, as float64."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).roll(-(1 << 15)).view(dtype).double()


def all_fp16(lo, hi):
    """Every finite fp16 value in [lo, hi], as float64."""
    h = from_bits16(torch.float16)
    h = h[torch.isfinite(h)]
    return torch.unique(h[(h >= lo) & (h <= hi)])


# the 126 positive finite E4M3 values: 2^-6 * m / 8 (subnormal), 2^(e - 7) * (1 + m / 8)
E4M3_SCALES = torch.tensor(sorted({m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                                   for e in range(16) for m in range(8) if not (e == 15 and m == 7)} - {0.0}),
                           dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# exhaustive
# ----------------------------------------------------------------------------------------------

def midpoint_distances():
    """Relative distance of 2^x from the nearest fp16 rounding midpoint for every fp32 x in [-25, 11.01] with
    |x| >= 2^-20 (closer to 0, 2^x is within 2^-20 of 1 while the midpoints next to 1 are 2^-12 and 2^-11 away)."""
    ks = list(range(16, 54))
    counts = [0] * len(ks)
    total, closest = 0, []
    for sign in (0, 1):
        for e in range(127 - 20, 127 + 5):
            lo = (sign << 31) | (e << 23)
            for part in range(4):
                bits = torch.arange(lo + part * (1 << 21), lo + (part + 1) * (1 << 21), dtype=torch.int64)
                x = bits.to(torch.int32).view(torch.float32).double()
                x = x[(x >= -25.0) & (x <= 11.01)]
                if len(x) == 0:
                    continue
                v = torch.exp2(x)
                _, ex = torch.frexp(v)
                scaled = torch.ldexp(v, -torch.clamp(ex - 11, min=-24))  # v / (fp16 spacing at v)
                d = (scaled - torch.floor(scaled) - 0.5).abs() / scaled
                total += len(x)
                ds = torch.sort(d).values
                for i, k in enumerate(ks):
                    counts[i] += int(torch.searchsorted(ds, torch.tensor(2.0**-k, dtype=torch.float64)))
                top = torch.topk(d, min(3, len(d)), largest=False)
                closest += [(float(a), float(x[i])) for a, i in zip(top.values, top.indices)]
    closest.sort()
    return total, dict(zip(ks, counts)), closest[:4]


def exhaustive(args):
    out = {}
    t0 = time.time()
    total, counts, closest = midpoint_distances()
    ties = [c for c in closest if c[0] == 0.0]
    others = [c for c in closest if c[0] > 0.0]
    out["exp2_midpoints"] = dict(inputs=total, exact_ties=[c[1] for c in ties],
                                 closest_other_log2=math.log2(others[0][0]), closest_other_x=others[0][1],
                                 within={f"2^-{k}": c for k, c in counts.items() if k in (20, 21, 22, 23, 24, 30)})
    print(f"2^x, fp32 x in [-25, 11.01] ({total} inputs): exact fp16 ties at x = {out['exp2_midpoints']['exact_ties']};"
          f" every other 2^x is >= 2^{out['exp2_midpoints']['closest_other_log2']:.1f} of itself from an fp16 midpoint"
          f" (closest at x = {others[0][1]!r}); within 2^-22: {counts[22]} ({counts[22] / total:.2e}), within 2^-21:"
          f" {counts[21]} ({counts[21] / total:.2e})  [{time.time() - t0:.0f} s]")

    s = E4M3_SCALES
    bad = (ref.fp16_round(rn32(1.0 / s)) != ref.fp16_round(1.0 / s)).sum()
    out["reciprocal_double_rounding"] = int(bad)
    print(f"fp16(fp32(1/s)) != fp16(1/s): {int(bad)} of {len(s)} E4M3 scales")

    amax = all_fp16(0.0, 2100.0)
    want = ref.e4m3_round(rn32(amax / 6.0))
    exact_q = torch.tensor([float(Fraction(a) / 6) for a in amax.tolist()], dtype=torch.float64)  # RN of the exact
    via_f16 = ref.e4m3_round(ref.fp16_round(exact_q))
    one_mul = ref.e4m3_round(ref.fp16_round(amax * ref.fp16_round(torch.tensor(1 / 6, dtype=torch.float64))))
    sixth = ref.fp16_round(torch.tensor(1 / 6, dtype=torch.float64))
    q0 = ref.fp16_round(amax * sixth)
    markstein = ref.e4m3_round(ref.fp16_round(q0 + ref.fp16_round(amax - 6 * q0) * sixth))
    out["scale_from_fp16_markstein_mismatches"] = int((markstein != want).sum())
    print(f"e4m3 of the f16x2 Markstein quotient (q0 = amax * fp16(1/6), one fma correction) != e4m3(fp32(amax/6)): "
          f"{out['scale_from_fp16_markstein_mismatches']} of {len(amax)}")
    out["scale_from_fp16_quotient_mismatches"] = int((via_f16 != want).sum())
    out["scale_from_fp16_times_sixth_mismatches"] = int((one_mul != want).sum())
    print(f"e4m3(fp16(amax/6)) != e4m3(fp32(amax/6)): {int((via_f16 != want).sum())} of {len(amax)} fp16 amax; "
          f"with amax * fp16(1/6) instead: {int((one_mul != want).sum())}")

    y = all_fp16(0.0, 8.0)
    b = ref.fp16_round(torch.maximum(y, torch.ones_like(y)))
    b = torch.exp2(torch.floor(torch.log2(b)))  # the exponent bits alone (& 0x7C00)
    q = ref.fp16_round(ref.fp16_round(b * 512 + y) - b * 512)
    e2m1 = ref.e2m1_round(torch.clamp(y, max=6.0)).double()
    out["e2m1_f16x2_sequence_mismatches"] = int((torch.clamp(q, max=6.0) != e2m1).sum())
    print(f"f16x2 E2M1 sequence != e2m1 for fp16 y in [0, 8]: {out['e2m1_f16x2_sequence_mismatches']} of {len(y)}")

    pairs = diff = 0
    w_all = all_fp16(0.0, 2100.0)
    for sc in s.tolist():
        w = w_all[w_all <= 7 * sc]
        r = ref.fp16_round(torch.tensor(1.0 / sc, dtype=torch.float64))
        prod = ref.fp16_round(w * r)
        quot = torch.tensor([float(Fraction(a) / Fraction(sc)) for a in w.tolist()], dtype=torch.float64)
        quot = ref.fp16_round(quot)  # the float64 quotient is never within 2^-53 of an fp16 tie it is not on
        pairs += len(w)
        diff += int((prod != quot).sum())
    out["product_vs_quotient"] = dict(pairs=pairs, differ=diff)
    print(f"fp16(w * fp16(1/s)) != fp16(w / s): {diff} of {pairs} (w <= 7s): the definition names the product")

    if args.ex2_table:
        tab = Path(args.ex2_table)
        for name, dtype in (("ex2_f16.bin", torch.float16), ("ex2_bf16.bin", torch.bfloat16)):
            raw = torch.frombuffer(bytearray((tab / name).read_bytes()), dtype=torch.int16)
            got = raw.view(dtype).double()
            xs = from_bits16(dtype)
            sel = (xs >= -24) & (xs <= 1)
            exact = torch.exp2(xs[sel])
            if dtype == torch.float16:
                rn, tr = ref.fp16_round(exact), trunc16(rn32(exact))
            else:
                rn = exact.to(torch.bfloat16).double()  # float64 -> bf16 via fp32: double rounding is harmless here
                f32 = rn32(exact)
                bits = f32.float().view(torch.int32) & ~0xFFFF
                tr = bits.view(torch.float32).double()
            g = got[sel]
            res = dict(inputs=int(sel.sum()), rn=float((g == rn).double().mean()),
                       trunc_of_fp32=float((g == tr).double().mean()),
                       trunc_exceptions=[float(v) for v in xs[sel][g != tr].tolist()[:8]])
            out[name] = res
            print(f"{name}: x in [-24, 1], {res['inputs']} inputs: RN matches {res['rn']:.1%}, "
                  f"trunc(fp32(2^x)) {res['trunc_of_fp32']:.2%}, exceptions {res['trunc_exceptions']}")
    return out


# ----------------------------------------------------------------------------------------------
# measure
# ----------------------------------------------------------------------------------------------

def make_inputs(kind, n, d, sigma, heads, seed):
    """bf16 q, k, v (1, heads, n, d) whose logits q.k / sqrt(d) have standard deviation about sigma.
    gauss: independent normals. rope: a shared direction under rotary position embedding, so each query
    prefers nearby keys (language-model-like local attention). sink: gauss plus one key that every query
    likes (an attention sink, which sets the row's frame and leaves the other keys' blocks small)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)
    if kind == "rope":
        common = torch.randn(1, heads, 1, d, generator=g, dtype=torch.float64)
        q, k = 0.6 * q + common, 0.6 * k + common
        pos = torch.arange(n, dtype=torch.float64)[:, None]
        freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos * freq
        cos, sin = torch.cos(ang), torch.sin(ang)

        def rot(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

        q, k = rot(q), rot(k)
    if kind == "sink":
        # queries share a direction mu; key 0 points along it, its logit about 4 standard deviations up
        mean_q = torch.randn(1, heads, 1, d, generator=g, dtype=torch.float64)
        q = q + 0.7 * mean_q
        k[:, :, 0] = 7.0 * mean_q[:, :, 0] / mean_q[:, :, 0].norm(dim=-1, keepdim=True)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    q = q * (sigma / logits.std())
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def p_variants(t, frame, visible):
    """w = P̂ * 2^11 of each design from float64 log2 scores t and the integer frame, hidden keys 0."""
    M = frame.unsqueeze(-1)
    arg0 = rn32(t - M)
    arg11 = rn32(t - (M - 11))
    designs = {
        # chosen: the argument t - M + 11 in fp32 (the kernels' fma), 2^x rounded once to fp16
        "fp16 result, +11 in the fp32 argument (chosen)": ref.fp16_round(torch.exp2(arg11)),
        "fp16 result, then * 2^11 in fp16": ref.fp16_round(torch.exp2(arg0)) * HEADROOM,
        "fp16 argument, ex2.approx.f16, then * 2^11": ex2_f16(ref.fp16_round(arg0)) * HEADROOM,
        "fp16 argument with +11, ex2.approx.f16": ex2_f16(ref.fp16_round(arg11)),
    }
    return {name: torch.where(visible, w, 0.0) for name, w in designs.items()}


def old_path(t, frame, visible):
    """The definition this change replaced: P̂ = 2^(t - M) (float64), §1's fp32 rule on fp32(P̂ * 2^11)."""
    p_hat = torch.where(visible, torch.exp2(t - frame.unsqueeze(-1)), 0.0)
    codes, scales = ref.quantize_blocks(p_hat * HEADROOM, -1, partial_last_block=True)
    return p_hat, codes, scales


def values_of(codes, scales):
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)[(codes & 7).long()]
    n = codes.shape[-1]
    return mags * scales.double().repeat_interleave(16, dim=-1)[..., :n]


def attention_out(p_num, p_hat, v):
    return (p_num @ v) / p_hat.sum(-1, keepdim=True)


def errors(o, exact):
    diff = (o - exact).norm() / exact.norm()
    cos = (o * exact).sum() / (o.norm() * exact.norm())
    return float(diff), float(cos)


def one_pass(t, tile, path):
    """P^F * 2^11 * 2^(m - M) of a running-frame evaluation: tiles of `tile` keys, each quantized in the frame
    m = ceil(max of t so far). path(t_tile, m) -> (P^F * 2^11, block amax) in that frame. Returns (values, stale)
    with stale marking the keys evaluated in a frame below the final one."""
    n = t.shape[-1]
    running = torch.full(t.shape[:-1], -math.inf, dtype=torch.float64)
    parts, stale = [], []
    final = torch.ceil(t.amax(-1))
    for j0 in range(0, n, tile):
        sl = slice(j0, min(j0 + tile, n))
        running = torch.maximum(running, torch.ceil(t[..., sl].amax(-1)))
        fq, _ = path(t[..., sl], running)  # path -> (P^F * 2^11, block amax)
        parts.append(fq * torch.exp2(running - final).unsqueeze(-1))
        stale.append((running < final).unsqueeze(-1).expand_as(fq))
    return torch.cat(parts, -1), torch.cat(stale, -1)


def measure(args):
    dims = (64, 128)
    lengths = (256, 1024) if args.quick else (256, 512, 1024, 2048)
    kinds = ("gauss", "rope", "sink")
    sigmas = (1.0, 2.5, 5.0)
    heads = 2 if args.quick else 4
    rows = []
    t_start = time.time()
    for kind in kinds:
        for d in dims:
            for n in lengths:
                for sigma in sigmas:
                    seed = zlib.crc32(f"{kind}/{d}/{n}/{sigma}".encode())
                    q, k, v = make_inputs(kind, n, d, sigma, heads, seed)
                    nq = min(n, 256 if args.quick else 512)
                    q = q[:, :, :nq]
                    scale = 1.0 / math.sqrt(d)
                    exact = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1) @ v.double()
                    qf, kf = ref.fake_quantize(q, -1), ref.fake_quantize(k, -1)
                    vf = ref.fake_quantize(v, -2, partial_last_block=True)  # no mask, no causal: V along tokens
                    t = (qf @ kf.transpose(-1, -2)) * scale * ref.LOG2E
                    visible = torch.ones_like(t, dtype=torch.bool)
                    frame = torch.ceil(t.amax(-1))
                    p_old, codes_old, scales_old = old_path(t, frame, visible)
                    pf_old = values_of(codes_old, scales_old) / HEADROOM
                    o_old = attention_out(pf_old, p_old, vf)
                    err_old = errors(o_old, exact)
                    probs = p_old / p_old.sum(-1, keepdim=True)
                    eff_keys = float(torch.exp(-(probs * torch.log(probs.clamp_min(1e-300))).sum(-1)).mean())
                    row = dict(kind=kind, d=d, n=n, nq=nq, heads=heads, sigma=sigma, effective_keys=eff_keys,
                               err_old=err_old[0], cos_old=err_old[1], designs={})
                    for name, w in p_variants(t, frame, visible).items():
                        codes, scales = ref.p_quantize_blocks_f16(w)
                        pf = values_of(codes, scales) / HEADROOM
                        p_hat = w / HEADROOM
                        o = attention_out(pf, p_hat, vf)
                        err = errors(o, exact)
                        row["designs"][name] = dict(o_change=float((o - o_old).norm() / o_old.norm()),
                            code_diff=float((codes != codes_old).double().mean()),
                            scale_diff=float((scales.double() != scales_old.double()).double().mean()),
                            value_diff=float((pf != pf_old).double().mean()),
                            err=err[0], cos=err[1], err_change=err[0] / err_old[0] - 1,
                            l_rel_diff=float(((p_hat.sum(-1) - p_old.sum(-1)) / p_old.sum(-1)).abs().max()))
                    rows.append(row)
                    ch = row["designs"]["fp16 result, +11 in the fp32 argument (chosen)"]
                    print(f"{kind:5s} D={d:3d} N={n:4d} sigma={sigma:3.1f} keys~{eff_keys:7.1f}: codes differ "
                          f"{ch['code_diff']:.2e}, scales {ch['scale_diff']:.2e}, O moves {ch['o_change']:.2e}; "
                          f"err old {err_old[0]:.5f} new "
                          f"{ch['err']:.5f} ({ch['err_change']:+.3%}), cos {err_old[1]:.6f} -> {ch['cos']:.6f}"
                          f"  [{time.time() - t_start:.0f} s]", flush=True)
    tiling = measure_tiling(args)
    return dict(rows=rows, tiling=tiling)


def measure_tiling(args):
    """One-pass (running integer frame, tiles of 16..176 keys) against the two-pass P^F of each design: the fraction of
    P^F values that differ, all of them and those in blocks whose final-frame amax / 6 is in E4M3's normal range,
    the largest difference (in units of the row's frame, P̂ <= 1) and what it does to O."""
    out = {}
    n, d, heads = (512, 128, 2) if args.quick else (2048, 128, 4)
    for kind, sigma in (("gauss", 2.5), ("sink", 2.5), ("rope", 5.0)):
        q, k, v = make_inputs(kind, n, d, sigma, heads, seed=7)
        q = q[:, :, :256]
        qf, kf = ref.fake_quantize(q, -1), ref.fake_quantize(k, -1)
        vf = ref.fake_quantize(v, -2, partial_last_block=True)
        t = (qf @ kf.transpose(-1, -2)) * (1.0 / math.sqrt(d)) * ref.LOG2E

        def quantized(w, rule):
            codes, scales = rule(w)
            amax = torch.nn.functional.pad(w, (0, -n % 16)).unflatten(-1, (-1, 16)).amax(-1)
            return values_of(codes, scales), amax

        def chosen(exact_args):
            def path(tt, m):
                arg = tt - (m.unsqueeze(-1) - 11)
                w = ref.fp16_round(torch.exp2(arg if exact_args else rn32(arg)))
                return quantized(w, ref.p_quantize_blocks_f16)
            return path

        def fp16_arg(tt, m):
            w = ex2_f16(ref.fp16_round(rn32(tt - m.unsqueeze(-1)))) * HEADROOM
            return quantized(w, ref.p_quantize_blocks_f16)

        def old(exact_args):
            def path(tt, m):
                arg = tt - m.unsqueeze(-1)
                w = rn32(torch.exp2(arg if exact_args else rn32(arg)) * HEADROOM)
                return quantized(w, lambda x: ref.quantize_blocks(x, -1, partial_last_block=True))
            return path

        frame = torch.ceil(t.amax(-1))
        l_row = torch.exp2(t - frame.unsqueeze(-1)).sum(-1, keepdim=True)
        for name, path in (("chosen, exact arguments", chosen(True)),
                           ("chosen, fp32 arguments (a kernel)", chosen(False)),
                           ("fp16 argument + ex2.approx.f16", fp16_arg),
                           ("old fp32 path, exact arguments", old(True)),
                           ("old fp32 path, fp32 arguments (a kernel)", old(False))):
            two_pass, amax = path(t, frame)
            # amax / 6 in E4M3's normal range: the scale's rounding commutes with a power-of-two frame step
            normal = (amax / 6 >= 2.0**-6).repeat_interleave(16, dim=-1)[..., :n]
            o_two = (two_pass / HEADROOM) @ vf / l_row
            worst = None
            for tile in (16, 64, 128, 176):
                vals, stale = one_pass(t, tile, path)
                differ = vals != two_pass
                o_one = (vals / HEADROOM) @ vf / l_row
                res = dict(differ=float(differ.double().mean()),
                           differ_normal_scale=float((differ & normal).double().mean()),
                           max_diff=float((vals - two_pass).abs().max() / HEADROOM),
                           o_rel_change=float((o_one - o_two).norm() / o_two.norm()),
                           stale=float(stale.double().mean()))
                out[f"{kind}/{name}/tile{tile}"] = res
                if worst is None or res["differ"] > worst["differ"]:
                    worst = dict(res, tile=tile)
            print(f"tiling {kind:5s} {name:42s}: worst tile {worst['tile']:3d}: P^F values differing "
                  f"{worst['differ']:.2e} (normal-scale blocks {worst['differ_normal_scale']:.2e}), largest "
                  f"{worst['max_diff']:.1e} of the frame, O moves {worst['o_rel_change']:.1e}; stale keys "
                  f"{worst['stale']:.1%}", flush=True)
    return out


def summary(result):
    """Markdown tables of a `measure` run (docs/results/p_fp16/README.md quotes them)."""
    rows = result["rows"]
    names = list(rows[0]["designs"])
    chosen = names[0]
    print("| inputs | D | sigma | effective keys | E2M1 codes differ | block scales differ | O moves | "
          "FP4 error before -> after | change | cosine before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in ("gauss", "rope", "sink"):
        for d in (64, 128):
            for sigma in (1.0, 2.5, 5.0):
                sel = [r for r in rows if r["kind"] == kind and r["d"] == d and r["sigma"] == sigma]
                if not sel:
                    continue
                c = [r["designs"][chosen] for r in sel]

                def span(values, fmt):
                    return f"{fmt(min(values))} - {fmt(max(values))}"

                print(f"| {kind} | {d} | {sigma} | {span([r['effective_keys'] for r in sel], lambda v: f'{v:.0f}')} | "
                      f"{span([x['code_diff'] for x in c], lambda v: f'{v:.1e}')} | "
                      f"{span([x['scale_diff'] for x in c], lambda v: f'{v:.1e}')} | "
                      f"{span([x['o_change'] for x in c], lambda v: f'{v:.1e}')} | "
                      f"{span([r['err_old'] for r in sel], lambda v: f'{v:.4f}')} -> "
                      f"{span([x['err'] for x in c], lambda v: f'{v:.4f}')} | "
                      f"{span([x['err_change'] for x in c], lambda v: f'{v:+.3%}')} | "
                      f"{min(r['cos_old'] for r in sel):.5f} -> {min(x['cos'] for x in c):.5f} |")
    print()
    print("| design | FP4 error change (mean, min, max) | codes differ | O moves | one-pass P^F differing in "
          "normal-scale blocks (worst) |")
    print("|---|---|---|---|---|")
    tiling = result.get("tiling", {})
    tiling_names = {names[0]: "chosen, fp32 arguments (a kernel)", names[2]: "fp16 argument + ex2.approx.f16"}
    for name in names:
        ch = [r["designs"][name]["err_change"] for r in rows]
        cd = [r["designs"][name]["code_diff"] for r in rows]
        oc = [r["designs"][name]["o_change"] for r in rows]
        t = tiling_names.get(name)
        worst = max((v["differ_normal_scale"] for k, v in tiling.items() if t and f"/{t}/" in k), default=None)
        print(f"| {name} | {sum(ch) / len(ch):+.3%}, {min(ch):+.3%}, {max(ch):+.3%} | {min(cd):.1e} - {max(cd):.1e} | "
              f"{min(oc):.1e} - {max(oc):.1e} | {'' if worst is None else f'{worst:.1e}'} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("exhaustive", "measure", "all", "summary"))
    parser.add_argument("file", nargs="?", help="summary: the JSON of a measure run")
    parser.add_argument("--ex2-table", help="folder with ex2_f16.bin and ex2_bf16.bin measured on the GPU")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.what == "summary":
        summary(json.loads(Path(args.file).read_text())["measure"])
        return
    result = {}
    if args.what in ("exhaustive", "all"):
        result["exhaustive"] = exhaustive(args)
    if args.what in ("measure", "all"):
        result["measure"] = measure(args)
        summary(result["measure"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
