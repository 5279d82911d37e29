"""P's fp16 path (numerics.md §3): the CPU kernels' code bit for bit against attn_qat.reference, the facts about
fp16 rounding its definition rests on, its independence of the tiling (a running integer frame gives the two-pass
P^F), and, on a GPU, how far the kernels' cvt.rn.f16(ex2.approx.ftz.f32(x)) strays from fp16(2^x)."""
import math

import pytest
import torch

import attn_qat  # noqa: F401  (registers torch.ops.attn_qat)
from attn_qat import reference as ref

try:
    import triton
    import triton.language as tl
except ImportError:  # only the GPU check needs it
    triton = None

p_fp16_path = torch.ops.attn_qat.p_fp16_path

# the 126 positive finite E4M3 values: 2^-6 * m / 8 (subnormal), 2^(e - 7) * (1 + m / 8)
E4M3_SCALES = torch.tensor(sorted({m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                                   for e in range(16) for m in range(8) if not (e == 15 and m == 7)} - {0.0}),
                           dtype=torch.float64)


def fp16_values(lo, hi):
    """Every finite fp16 value in [lo, hi], as float64."""
    h = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    h = h[torch.isfinite(h)]
    return torch.unique(h[(h >= lo) & (h <= hi)])


def same_bits(a, b):
    """Equal values, NaN at the same places."""
    a, b = a.double(), b.double()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def check_cpu_path(x):
    w, w_fq = p_fp16_path(x)
    want_w = ref.p_frame_values(x)
    assert same_bits(w, want_w), "frame values w = fp16(2^x) differ from the reference"
    assert same_bits(w_fq, ref.p_fake_quant_f16(want_w)), "P^F * 2^11 differs from the reference"
    return w, w_fq


def test_cpu_path_matches_reference_on_random_arguments():
    g = torch.Generator().manual_seed(0)
    x = (11.05 - 37 * torch.rand(4000, 77, generator=g)).float()  # partial last block: 77 = 4 * 16 + 13
    hidden = torch.rand(x.shape, generator=g) < 0.1
    x[hidden] = -math.inf  # hidden keys: w = 0, no amax
    x[7] = -math.inf  # a row with no visible key
    x[8, 20] = math.nan  # a NaN score: its block NaN, the others untouched
    x[9, :16] = torch.arange(-25, -9).float()  # powers of two, 2^-25 a tie that rounds to 0
    # arguments just around 0 and 11, as the kernels' fma can leave them
    x[10] = 11 + (torch.arange(77) - 38).float() * 2.0**-20
    x[11] = (torch.arange(77) - 38).float() * 2.0**-23
    w, w_fq = check_cpu_path(x)
    assert (w[7] == 0).all() and (w_fq[7] == 0).all() and (w[x == -math.inf] == 0).all()
    assert w_fq[8, 16:32].isnan().all() and not w_fq[8, :16].isnan().any()
    assert w[9, 0] == 0 and w[9, 1] == 2.0**-24


def test_cpu_path_on_every_fp16_frame_value():
    # x = fp32(log2(w)) gives back exactly w for every positive fp16 w <= 2048 (2^x is within 2^-20 of w, the
    # nearest midpoint 2^-12 away), so this reaches each frame value, and in blocks of 16 consecutive ones every
    # scale and E2M1 rounding boundary the values span.
    w = fp16_values(2.0**-24, 2048.0)
    x = torch.log2(w).float()
    got, _ = check_cpu_path(x.unsqueeze(0))
    assert torch.equal(got[0].double(), w)
    # the same values shuffled, rows of 128: blocks whose amax and elements lie binades apart
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    check_cpu_path(x[perm][: len(x) // 128 * 128].reshape(-1, 128))


def c_scores(q, k, scale):
    """The C kernel's fp32 log2 scores (..., Nq, Nk): t = fp32(sum_d q_d k_d, summed in order) * fp32(scale * log2(e))."""
    q32, k32 = q.float(), k.float()
    s = torch.zeros(*q.shape[:-1], k.shape[-2], dtype=torch.float32)
    for d in range(q.shape[-1]):  # bf16 * bf16 is exact in fp32, each addition rounds as the C loop's does
        s = s + q32[..., d:d + 1] * k32[..., d].unsqueeze(-2)
    scale_log2 = torch.tensor(scale, dtype=torch.float32) * torch.tensor(math.log2(math.e), dtype=torch.float32)
    return s * scale_log2


@pytest.mark.parametrize("causal", [0, 1])
def test_cpu_attention_forward_is_the_fp16_path(causal):
    """The CPU forward end to end: given its own fp32 scores, the frame, l, O are the reference's P path bit for bit.
    (O's double sums are exact: P^F v products are multiples of 2^-31 below 2^12, fewer than 2^10 of them.)"""
    g = torch.Generator().manual_seed(11 + causal)
    q, k, v = (torch.randn(1, 2, 150, 64, generator=g) * c for c in (2, 1, 1))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    scale = 0.125
    out, out_prime, frame, row_sum, qf, kf, vf = torch.ops.attn_qat.attention_forward(
        q, k, v, None, scale, causal, 0, True, causal == 0)
    t = c_scores(qf, kf, scale).double()
    visible = torch.ones(150, 150, dtype=torch.bool)
    if causal:
        visible = torch.arange(150) <= torch.arange(150).unsqueeze(-1)
    t = torch.where(visible, t, -math.inf)
    want_frame = torch.ceil(t.amax(-1))
    assert torch.equal(frame.double(), want_frame)
    x = (t.float() - (want_frame.float().unsqueeze(-1) - 11)).double()  # one fp32 rounding, as in the C code
    w = torch.where(visible, ref.p_frame_values(x), 0.0)
    l = (w / 2048).sum(-1, keepdim=True)
    assert torch.equal(row_sum.double(), l.squeeze(-1).float().double())
    o = ((ref.p_fake_quant_f16(w) / 2048) @ vf.double()) / l
    assert torch.equal(out.double(), o.float().bfloat16().double())
    o_prime = ((w / 2048) @ vf.double()) / l  # not exact in double: within a bf16 rounding
    torch.testing.assert_close(out_prime.double(), o_prime, rtol=2.0**-8, atol=0)


def test_e2m1_ties_in_fp16():
    # amax 6 gives s = 1 and r = 1, so y = w: the block holds every E2M1 tie and the values either side of it
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for tie in ties:
        below = float(torch.tensor(tie, dtype=torch.float16).nextafter(torch.tensor(0.0, dtype=torch.float16)))
        above = float(torch.tensor(tie, dtype=torch.float16).nextafter(torch.tensor(8.0, dtype=torch.float16)))
        block = torch.tensor([6.0, tie, below, above] + [0.0] * 12, dtype=torch.float64)
        got = ref.p_fake_quant_f16(block)
        assert got[1] == ref.e2m1_round(torch.tensor(tie)), tie  # to the even code
        _, w_fq = check_cpu_path(torch.log2(block).float().unsqueeze(0))
        assert torch.equal(w_fq[0].double(), got)


def test_reciprocal_is_rounded_once():
    # r = fp16(1 / s); the kernels and the C code form it as fp16(fp32(1 / s)): the same value for every scale
    assert len(E4M3_SCALES) == 126
    assert torch.equal(ref.fp16_round((1.0 / E4M3_SCALES).float()), ref.fp16_round(1.0 / E4M3_SCALES))


def test_scale_from_an_fp16_quotient():
    # s = e4m3(fp32(amax / 6)) (§1). A kernel may form amax / 6 in fp16 instead (then cvt.rn.satfinite.e4m3x2.f16x2)
    # provided the quotient is correctly rounded: then e4m3 of it is s for every fp16 amax.
    amax = fp16_values(0.0, 2100.0)
    want = ref.e4m3_round((amax / 6).float())
    # amax / 6 in float64 is within 2^-53 of the quotient, whose fp16 rounding is never that close to a tie
    # (amax has 11 significant bits: amax / 3 is exact or has a repeating 01 pattern)
    assert torch.equal(ref.e4m3_round(ref.fp16_round(amax / 6).float()), want)
    # two blocks at once in f16x2: q0 = amax * fp16(1/6), then one Markstein correction by fma.rn.f16x2 (the fma is
    # exact in float64 here, then rounded once). Its quotient misses fp16(amax / 6) only where that is subnormal, far
    # below the smallest scale, so the scales agree; the bare product q0 does not suffice.
    sixth = ref.fp16_round(torch.tensor(1 / 6, dtype=torch.float64))
    q0 = ref.fp16_round(amax * sixth)
    q = ref.fp16_round(q0 + ref.fp16_round(amax - 6 * q0) * sixth)
    assert torch.equal(ref.e4m3_round(q.float()), want)
    assert not torch.equal(ref.e4m3_round(q0.float()), want)


def test_f16x2_e2m1_sequence():
    # The kernels' E2M1 rounding in f16x2 (b = max(y, 1) & 0x7C00, fma(b, 512, y) - 512 b, each rounded to fp16:
    # y + 512 b rounds to the multiples of b / 2, E2M1's spacing in y's binade, ties to even) then min(., 6): the
    # E2M1 value of y for every fp16 y in [0, 8].
    y = fp16_values(0.0, 8.0)
    b = torch.exp2(torch.floor(torch.log2(torch.clamp(y, min=1.0))))
    q = ref.fp16_round(ref.fp16_round(b * 512 + y) - b * 512)
    assert torch.equal(torch.clamp(q, max=6.0), ref.e2m1_round(torch.clamp(y, max=6.0)).double())


def one_pass(t, tile, rule):
    """P^F * 2^11 * 2^(m - M) evaluated tile by tile in the running integer frame m = ceil(max of t so far), as a
    one-pass kernel does (it rescales the tile's contribution by 2^(m - M) when the frame moves on), and the block
    amax of the two-pass evaluation in the final frame M."""
    final = torch.ceil(t.amax(-1))
    running = torch.full_like(final, -math.inf)
    parts = []
    for j0 in range(0, t.shape[-1], tile):
        sl = slice(j0, j0 + tile)
        running = torch.maximum(running, torch.ceil(t[..., sl].amax(-1)))
        parts.append(rule(t[..., sl], running) * torch.exp2(running - final).unsqueeze(-1))
    return torch.cat(parts, -1), rule(t, final)


@pytest.mark.parametrize("peaked", [False, True])
def test_running_frame_gives_the_two_pass_p(peaked):
    """numerics.md §3's integer-frame argument for the fp16 path: a power-of-two frame step commutes with every
    rounding (fp32 argument, fp16(2^x), amax, the scale while amax / 6 stays in E4M3's normal range, fp16(1 / s),
    fp16(w r), E2M1), so a running-frame evaluation gives the two-pass P^F in every such block whatever the tile size.
    Scores on a 2^-12 grid make the fp32 argument exact in every frame, as the definition's is."""
    g = torch.Generator().manual_seed(5 + peaked)
    n = 1024
    t = torch.randn(64, n, generator=g, dtype=torch.float64) * (6.0 if peaked else 2.0)
    t = t + torch.linspace(0, 12 if peaked else 3, n, dtype=torch.float64)  # the maximum keeps moving on
    t = torch.round(t * 4096) / 4096

    def rule(tt, m):
        w = ref.p_frame_values((tt - (m.unsqueeze(-1) - 11)).float())
        return ref.p_fake_quant_f16(w)

    final = torch.ceil(t.amax(-1))
    w_final = ref.p_frame_values((t - (final.unsqueeze(-1) - 11)).float())
    amax = w_final.unflatten(-1, (-1, 16)).amax(-1)
    normal = (amax / 6 >= 2.0**-6).repeat_interleave(16, dim=-1)
    for tile in (16, 64, 128, 176):
        got, want = one_pass(t, tile, rule)
        assert torch.equal(got[normal], want[normal]), f"tile {tile}"
        # blocks below E4M3's normal range (amax under 2^-14.4 of the frame) may differ, by at most their scale
        assert (got - want).abs().max() <= 2.0**-6 * 8, f"tile {tile}"
    assert normal.double().mean() > 0.5 and (~normal).any() == peaked  # peaked rows have both kinds of block


@pytest.mark.gpu
@pytest.mark.skipif(triton is None, reason="optional package triton missing")
def test_ex2_approx_then_cvt_against_fp16_of_exp2():
    """The kernels evaluate w = fp16(2^x) as cvt.rn.f16.f32(ex2.approx.ftz.f32(x)). ex2.approx is within about 2 fp32
    ulps, so the two differ only where 2^x lies that close to an fp16 rounding midpoint (at most about 1e-3 of the
    arguments, dev/p_fp16_numerics.py exhaustive). Check every fp32 x in [-25, 11.01]: where they differ, by one fp16
    ulp, and rarely; the count is what the kernels' P̂ deviates from the definition (numerics.md §7)."""

    @triton.jit
    def kernel(y_ptr, first_bits, step, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        bits = (first_bits + step * offs.to(tl.int64)).to(tl.uint32)
        x = bits.to(tl.float32, bitcast=True)
        y = tl.inline_asm_elementwise(
            "{ .reg .f32 e; .reg .b16 h; ex2.approx.ftz.f32 e, $1; cvt.rn.f16.f32 h, e; cvt.f32.f16 $0, h; }",
            "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)

    chunk = 1 << 26
    y = torch.empty(chunk, device="cuda", dtype=torch.float32)
    total = differ = 0
    # -0 (bits 0x80000000) down to -25 (0xC1C80000); +0 up to 11.01 (0x41302900)
    for first, last, step in ((0x80000000, 0xC1C80000, 1), (0x00000000, 0x41302900, 1)):
        count = last - first + 1
        for start in range(0, count, chunk):
            n = min(chunk, count - start)
            y.fill_(float("nan"))
            kernel[(triton.cdiv(n, 1024),)](y, first + start, step, n, BLOCK=1024)
            bits = torch.arange(first + start, first + start + n, device="cuda", dtype=torch.int64)
            x = bits.to(torch.int32).view(torch.float32)  # wraps to the negative bit patterns as intended
            want = ref.fp16_round(torch.exp2(x.double()))
            got = y[:n].double()
            bad = got != want
            if bad.any():
                spacing = torch.ldexp(torch.ones_like(want), torch.clamp(torch.frexp(want)[1] - 11, min=-24))
                assert ((got - want).abs()[bad] <= spacing[bad]).all(), "more than one fp16 ulp off"
            total += n
            differ += int(bad.sum())
    print(f"cvt.rn.f16(ex2.approx.ftz.f32(x)) != fp16(2^x) for {differ} of {total} fp32 x ({differ / total:.2e})")
    assert differ <= 1e-3 * total


def random_arguments(rows=4000, n=77, seed=0):
    """Exponent arguments as the kernels form them, hidden keys, a NaN, powers of two, values near 0 and 11."""
    g = torch.Generator().manual_seed(seed)
    x = (11.05 - 37 * torch.rand(rows, n, generator=g)).float()
    x[torch.rand(x.shape, generator=g) < 0.1] = -math.inf
    x[7] = -math.inf
    x[8, 20] = math.nan
    x[9, :16] = torch.arange(-25, -9).float()
    x[10] = 11 + (torch.arange(n) - n // 2).float() * 2.0**-20
    x[11] = (torch.arange(n) - n // 2).float() * 2.0**-23
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["random", "every_fp16_frame_value"])
def test_cuda_path_matches_reference(case):
    """The CUDA kernels' device functions for P's path (p_frame_value, p_block_scale, p_fake_quantize_element, run by
    the op on the GPU) against attn_qat.reference: w = fp16(2^x) but where ex2.approx leaves 2^x within its error of
    an fp16 midpoint (one fp16 ulp, rarely: test_ex2_approx_then_cvt_against_fp16_of_exp2), and P's block rule on
    the GPU's own w bit for bit."""
    if case == "random":
        x = random_arguments()
    else:  # x = fp32(log2(w)) is 2^-20 from w, far from any midpoint: every w exactly, in shuffled rows of 128
        w = fp16_values(2.0**-24, 2048.0)
        x = torch.log2(w).float()
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
        x = torch.cat([x[: len(x) // 16 * 16].unsqueeze(0).reshape(1, -1),
                       x[perm][: len(x) // 16 * 16].unsqueeze(0).reshape(1, -1)])
    w_gpu, w_fq_gpu = (t.cpu() for t in p_fp16_path(x.cuda()))
    want_w = ref.p_frame_values(x)
    differ = ~((w_gpu.double() == want_w.double()) | (w_gpu.isnan() & want_w.double().isnan()))
    if case == "every_fp16_frame_value":
        assert not differ.any(), "w = fp16(2^x) missed on an argument far from any midpoint"
    else:
        spacing = torch.ldexp(torch.ones_like(want_w.double()),
                              torch.clamp(torch.frexp(want_w.double())[1] - 11, min=-24))
        assert ((w_gpu.double() - want_w.double()).abs()[differ] <= spacing[differ]).all(), "w more than an ulp off"
        assert differ.double().mean() <= 1e-3
    assert same_bits(w_fq_gpu, ref.p_fake_quant_f16(w_gpu)), "P's block rule on the GPU differs from the reference"
    # and the CPU op still gives the reference's exactly
    check_cpu_path(x)
