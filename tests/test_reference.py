"""Tests of attn_qat.reference against a second, independent implementation of numerics.md.

The naive implementation below shares nothing with the reference: it works on Python floats, does
every fp32 rounding with exact rationals (fractions.Fraction), finds E4M3/E2M1 values by searching
tables built from the bit layouts, and computes attention with loops over rows and 16-key blocks.
"""

import bisect
import importlib.util
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch


def _load_reference():
    """attn_qat.reference, loaded from its file if the package itself cannot be imported yet."""
    try:
        from attn_qat import reference

        return reference
    except Exception:  # the package __init__ may need the C extension, which may not be built
        path = Path(__file__).resolve().parents[1] / "attn_qat" / "reference.py"
        spec = importlib.util.spec_from_file_location("attn_qat_reference", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


ref = _load_reference()

LOG2E = math.log2(math.e)
MODES = ("attn_qat", "high_precision_p", "low_precision_o", "drop_in", "bf16")


# ==============================================================================================
# Naive implementation
# ==============================================================================================

def round_float(value: Fraction, mantissa_bits: int, min_exponent: int) -> float:
    """Exact rational -> nearest binary float with that many stored significand bits, subnormals below
    2^min_exponent (ties to even); finite, no overflow."""
    if value == 0:
        return 0.0
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    while Fraction(2) ** exponent > magnitude:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    ulp = Fraction(2) ** (max(exponent, min_exponent) - mantissa_bits)
    rounded = float(round(magnitude / ulp) * ulp)  # round() on a Fraction is half-to-even
    return rounded if value > 0 else -rounded


def round_f32(value: Fraction) -> float:
    return round_float(value, 23, -126)


def round_f16(value: Fraction) -> float:
    return round_float(value, 10, -14)


def _e4m3_table() -> list[float]:
    """Every finite non-negative E4M3 value, indexed by its 7-bit code (exponent << 3 | mantissa)."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue  # the NaN encoding
            if exponent == 0:
                values.append(mantissa / 8 * 2.0**-6)
            else:
                values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values


E4M3_VALUES = _e4m3_table()
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_code(table: list[float], value: float) -> int:
    """Index of the table entry nearest to value (inside the table's range), ties to the even index."""
    i = bisect.bisect_left(table, value)
    if table[i] == value:
        return i
    below = Fraction(value) - Fraction(table[i - 1])
    above = Fraction(table[i]) - Fraction(value)
    if below != above:
        return i - 1 if below < above else i
    return i - 1 if (i - 1) % 2 == 0 else i


def naive_e4m3(v: float) -> float:
    if v >= E4M3_VALUES[-1]:
        return E4M3_VALUES[-1]
    return E4M3_VALUES[nearest_code(E4M3_VALUES, v)]


def naive_e2m1_code(y: float) -> int:
    magnitude = abs(y)
    index = 7 if magnitude >= 6.0 else nearest_code(E2M1_VALUES, magnitude)
    return index + (8 if math.copysign(1.0, y) < 0 else 0)


def naive_e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_VALUES[code & 7]


def naive_quantize_block(values: list[float]) -> tuple[float, list[int]]:
    """The §1 rule on one block of fp32 values (up to 16): (scale, codes)."""
    if not all(math.isfinite(x) for x in values):
        return math.nan, [0] * len(values)
    amax = max(abs(x) for x in values)
    scale = naive_e4m3(round_f32(Fraction(amax) / 6))
    if scale == 0:
        return 0.0, [0] * len(values)
    reciprocal = round_f32(1 / Fraction(scale))
    # r > 0, so y has x's sign; copysign keeps it for -0.0, which Fraction cannot represent.
    ys = [math.copysign(round_f32(Fraction(x) * Fraction(reciprocal)), x) for x in values]
    return scale, [naive_e2m1_code(y) for y in ys]


def naive_frame_value(t: float, frame: float) -> float:
    """§3's w = fp16(2^x) = P̂ * 2^11 for x = fp32(t - (M - 11)), with Python floats and exact rationals."""
    argument = t - (frame - 11)
    if math.isnan(argument) or math.isinf(argument):
        return math.nan if math.isnan(argument) else (0.0 if argument < 0 else math.inf)
    x = round_f32(Fraction(argument))
    return round_f16(Fraction(2.0**x))  # 2.0**x is far from an fp16 midpoint for every fp32 x here (the reference's)


def naive_p_block_f16(values: list[float]) -> tuple[float, list[int]]:
    """P's fp16 block rule of §3 on one block of w values (fp16 values >= 0): (scale, codes)."""
    if not all(math.isfinite(x) for x in values):
        return math.nan, [0] * len(values)
    scale = naive_e4m3(round_f32(Fraction(max(values)) / 6))
    if scale == 0:
        return 0.0, [0] * len(values)
    reciprocal = Fraction(round_f16(1 / Fraction(scale)))
    return scale, [naive_e2m1_code(round_f16(Fraction(w) * reciprocal)) for w in values]


def naive_fake_quantize(values: list[float]) -> list[float]:
    """Dequantized values of one vector, blocks of 16 from index 0, the last one possibly partial."""
    out = []
    for start in range(0, len(values), 16):
        scale, codes = naive_quantize_block(values[start:start + 16])
        out += [naive_e2m1_value(code) * scale for code in codes]
    return out


def naive_attention(q, k, v, *, mask=None, causal=None, scale=None, quantize=True):
    """§3 with loops. Returns per (b, h, i) nested lists of the outputs and the row intermediates."""
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    if mask is not None:
        mask = torch.broadcast_to(mask, (batch, heads_q, n_q, n_k)).tolist()
    if quantize:
        q_op = [[[naive_fake_quantize(row) for row in head] for head in b] for b in q.float().tolist()]
        k_op = [[[naive_fake_quantize(row) for row in head] for head in b] for b in k.float().tolist()]
        if mask is None and causal is None:  # §2: V along tokens only when every query sees every key
            v_op = [[naive_fake_quantize_along_tokens(head) for head in b] for b in v.float().tolist()]
        else:
            v_op = [[[naive_fake_quantize(row) for row in head] for head in b] for b in v.float().tolist()]
    else:
        q_op, k_op, v_op = q.double().tolist(), k.double().tolist(), v.double().tolist()

    rows = [[[naive_attention_row(q_op[b][h][i], k_op[b][h // group], v_op[b][h // group], i, n_q,
                                  mask[b][h][i] if mask is not None else None, causal, scale, quantize)
              for i in range(n_q)] for h in range(heads_q)] for b in range(batch)]
    result = {name: [[[row[name] for row in head] for head in b] for b in rows]
              for name in ("out", "out_prime", "frame", "row_sum", "lse")}
    result.update(rows=rows, q_op=q_op, k_op=k_op, v_op=v_op, scale=scale, group=group)
    return result


def naive_fake_quantize_along_tokens(tokens: list[list[float]]) -> list[list[float]]:
    """V's blocking: quantize each channel's column of tokens, then transpose back."""
    columns = [naive_fake_quantize(list(column)) for column in zip(*tokens)]
    return [list(token) for token in zip(*columns)]


def naive_attention_row(q_row, keys, values, i, n_q, mask_row, causal, scale, quantize):
    n_k, head_dim_v = len(keys), len(values[0])
    visible, t = [], {}
    for j in range(n_k):
        if causal == "top_left" and j > i:
            continue
        if causal == "bottom_right" and j > i + n_k - n_q:
            continue
        additive = 0.0
        if mask_row is not None:
            if isinstance(mask_row[j], bool):
                if not mask_row[j]:
                    continue
            elif mask_row[j] == -math.inf:
                continue
            else:
                additive = mask_row[j]
        score = sum(qd * kd for qd, kd in zip(q_row, keys[j]))
        visible.append(j)
        t[j] = (score * scale + additive) * LOG2E
    if not visible:
        zeros = [0.0] * head_dim_v
        return dict(out=zeros, out_prime=zeros, frame=-math.inf, row_sum=0.0, lse=-math.inf,
                    visible=[], p_hat={}, p_fq={})

    finite_or_inf = [t[j] for j in visible if not math.isnan(t[j])]
    row_max = max(finite_or_inf) if finite_or_inf else -math.inf
    frame = float(math.ceil(row_max)) if math.isfinite(row_max) else row_max
    if quantize:
        w = {j: naive_frame_value(t[j], frame) for j in visible}
        p_hat = {j: w[j] / 2048 for j in visible}
        p_fq = {}
        for start in range(0, n_k, 16):
            keys_in_block = range(start, min(start + 16, n_k))
            block = [w.get(j, 0.0) for j in keys_in_block]  # masked keys are 0 and do not raise the amax
            block_scale, codes = naive_p_block_f16(block)
            for j, code in zip(keys_in_block, codes):
                if j in p_hat:
                    p_fq[j] = naive_e2m1_value(code) * block_scale / 2048
    else:
        p_hat = {j: 2.0 ** (t[j] - frame) for j in visible}
        p_fq = dict(p_hat)
    row_sum = sum(p_hat.values())
    out = [sum(p_fq[j] * values[j][c] for j in visible) / row_sum for c in range(head_dim_v)]
    out_prime = [sum(p_hat[j] * values[j][c] for j in visible) / row_sum for c in range(head_dim_v)]
    lse = math.log(2) * (frame + math.log2(row_sum))
    return dict(out=out, out_prime=out_prime, frame=frame, row_sum=row_sum, lse=lse,
                visible=visible, p_hat=p_hat, p_fq=p_fq)


def naive_gradients(q, k, v, dout, *, mode, mask=None, causal=None, scale=None):
    """§4 / §5 element by element: (dq, dk, dv) as nested lists."""
    fp4 = naive_attention(q, k, v, mask=mask, causal=causal, scale=scale, quantize=mode != "bf16")
    if mode in ("drop_in", "bf16"):
        source = fp4 if mode == "bf16" else naive_attention(
            q, k, v, mask=mask, causal=causal, scale=scale, quantize=False)
    else:
        source = fp4
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k, head_dim_v = k.shape[1], k.shape[2], v.shape[3]
    dout = dout.double().tolist()
    scale, group = source["scale"], source["group"]
    dq = [[[[0.0] * head_dim for _ in range(n_q)] for _ in range(heads_q)] for _ in range(batch)]
    dk = [[[[0.0] * head_dim for _ in range(n_k)] for _ in range(heads_kv)] for _ in range(batch)]
    dv = [[[[0.0] * head_dim_v for _ in range(n_k)] for _ in range(heads_kv)] for _ in range(batch)]
    for b in range(batch):
        for h in range(heads_q):
            kv = h // group
            for i in range(n_q):
                row = source["rows"][b][h][i]
                if not row["visible"]:
                    continue
                do = dout[b][h][i]
                out_for_delta = (fp4["out_prime"] if mode in ("attn_qat", "high_precision_p")
                                 else fp4["out"])[b][h][i]
                delta = sum(x * y for x, y in zip(do, out_for_delta))
                for j in row["visible"]:
                    p = row["p_hat"][j] / row["row_sum"]
                    p_for_dv = p if mode in ("high_precision_p", "drop_in", "bf16") \
                        else row["p_fq"][j] / row["row_sum"]
                    v_j = source["v_op"][b][kv][j]
                    dp = sum(x * y for x, y in zip(do, v_j))
                    ds = p * (dp - delta)
                    for c in range(head_dim_v):
                        dv[b][kv][j][c] += p_for_dv * do[c]
                    for d in range(head_dim):
                        dq[b][h][i][d] += scale * ds * source["k_op"][b][kv][j][d]
                        dk[b][kv][j][d] += scale * ds * source["q_op"][b][h][i][d]
    return dq, dk, dv


# ==============================================================================================
# Helpers
# ==============================================================================================

def f64(nested) -> torch.Tensor:
    return torch.tensor(nested, dtype=torch.float64)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor):
    """Same values, NaN where NaN, and the same sign of zero."""
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(actual), torch.signbit(expected))


def make_qkv(seed, batch, heads_q, heads_kv, n_q, n_k, head_dim, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    # Q is scaled up so that softmax rows are peaked and the P blocks span many binades.
    q = 2.0 * torch.randn(batch, heads_q, n_q, head_dim, generator=gen)
    k = torch.randn(batch, heads_kv, n_k, head_dim, generator=gen)
    v = torch.randn(batch, heads_kv, n_k, head_dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def wide_range_blocks(seed, rows, n):
    """fp32 values with per-16 magnitudes from 2^-25 to 2^15: zero, subnormal and saturated scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen)
    exponents = torch.randint(-25, 16, (rows, -(-n // 16)), generator=gen).repeat_interleave(16, dim=1)
    return x * torch.exp2(exponents[:, :n].float())


# ==============================================================================================
# E4M3
# ==============================================================================================

def test_e4m3_representable_values_are_fixed_points():
    values = torch.tensor(E4M3_VALUES, dtype=torch.float32)
    assert_bitwise(ref.e4m3_round(values), values)


def test_e4m3_midpoints_round_to_even():
    lower, upper = E4M3_VALUES[:-1], E4M3_VALUES[1:]
    midpoints = [(a + b) / 2 for a, b in zip(lower, upper)]
    expected = [a if code % 2 == 0 else b for code, (a, b) in enumerate(zip(lower, upper))]
    assert expected == [naive_e4m3(m) for m in midpoints]
    assert_bitwise(ref.e4m3_round(torch.tensor(midpoints, dtype=torch.float32)), f64(expected))
    # Spot checks: 1.0625 lies between 1.0 (mantissa 0) and 1.125 (mantissa 1); 1.1875 between
    # 1.125 and 1.25 (mantissa 2); 3 * 2^-10 between the subnormals 2^-9 and 2^-8.
    spots = torch.tensor([1.0625, 1.1875, 3 * 2.0**-10])
    assert ref.e4m3_round(spots).tolist() == [1.0, 1.25, 2.0**-8]


def test_e4m3_saturates_at_448():
    big = torch.tensor([448.0, 449.0, 463.9, 464.0, 480.0, 1e6, 3e38])
    assert ref.e4m3_round(big).tolist() == [448.0] * 7


def test_e4m3_subnormals_and_flush_to_zero():
    subnormals = torch.tensor([m * 2.0**-9 for m in range(1, 8)])
    assert_bitwise(ref.e4m3_round(subnormals), subnormals)
    half_min = torch.tensor(2.0**-10)
    around = torch.stack([
        torch.tensor(0.0),
        torch.nextafter(half_min, torch.tensor(0.0)),
        half_min,  # a tie between 0 and 2^-9: to the even code, 0
        torch.nextafter(half_min, torch.tensor(1.0)),
        torch.tensor(2.0**-12),
        torch.tensor(1e-40),  # an fp32 subnormal
    ])
    assert ref.e4m3_round(around).tolist() == [0.0, 0.0, 0.0, 2.0**-9, 0.0, 0.0]


def test_e4m3_random_values_match_naive():
    gen = torch.Generator().manual_seed(101)
    values = torch.exp2(torch.empty(3000).uniform_(-12, 10, generator=gen))
    expected = f64([naive_e4m3(x) for x in values.tolist()])
    assert_bitwise(ref.e4m3_round(values), expected)


# ==============================================================================================
# E2M1
# ==============================================================================================

def test_e2m1_every_code_is_a_fixed_point():
    values = torch.tensor([naive_e2m1_value(code) for code in range(16)])
    assert_bitwise(ref.e2m1_round(values), values)


@pytest.mark.parametrize("tie, expected", [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
])
def test_e2m1_ties_go_to_the_even_code(tie, expected):
    result = ref.e2m1_round(torch.tensor([tie, -tie]))
    assert_bitwise(result, torch.tensor([expected, -expected]))
    assert naive_e2m1_value(naive_e2m1_code(tie)) == expected


def test_e2m1_saturation_and_signs():
    y = torch.tensor([6.0, 6.5, 7.0, 100.0, math.inf, -6.5, -1e30, -math.inf])
    assert ref.e2m1_round(y).tolist() == [6.0] * 5 + [-6.0] * 3
    zeros = ref.e2m1_round(torch.tensor([0.0, -0.0, 0.1, -0.1, -0.25]))
    assert_bitwise(zeros, torch.tensor([0.0, -0.0, 0.0, -0.0, -0.0]))


def test_e2m1_random_values_match_naive():
    gen = torch.Generator().manual_seed(102)
    y = 4.0 * torch.randn(3000, generator=gen)
    expected = f64([naive_e2m1_value(naive_e2m1_code(x)) for x in y.tolist()])
    assert_bitwise(ref.e2m1_round(y), expected)


# ==============================================================================================
# Block rule
# ==============================================================================================

def naive_quantize_rows(rows: list[list[float]]):
    """(codes, scales) of each row, blocks of 16 along the row."""
    codes, scales = [], []
    for row in rows:
        row_codes, row_scales = [], []
        for start in range(0, len(row), 16):
            scale, block_codes = naive_quantize_block(row[start:start + 16])
            row_codes += block_codes
            row_scales.append(scale)
        codes.append(row_codes)
        scales.append(row_scales)
    return torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales, dtype=torch.float32)


def test_quantize_blocks_matches_naive_bit_for_bit():
    x = wide_range_blocks(201, rows=24, n=64)
    codes, scales = ref.quantize_blocks(x)
    expected_codes, expected_scales = naive_quantize_rows(x.tolist())
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert torch.equal(codes, expected_codes)
    assert_bitwise(scales, expected_scales)
    # The draw covers zero scales, subnormal scales and saturated scales.
    assert (scales == 0).any() and ((scales > 0) & (scales < 2.0**-6)).any() and (scales == 448).any()
    # Dequantized values are exact in bf16 (numerics.md §1 step 5).
    dequantized = ref.fake_quantize(x)
    assert dequantized.dtype == torch.float64
    assert torch.equal(dequantized.to(torch.bfloat16).double(), dequantized)
    expected = [naive_fake_quantize(row) for row in x.tolist()]
    assert_bitwise(dequantized, f64(expected))


def test_quantize_blocks_from_bf16_and_float64_inputs():
    x = wide_range_blocks(202, rows=4, n=32).double()
    for dtype in (torch.bfloat16, torch.float64):
        xs = x.to(dtype)
        expected_codes, expected_scales = naive_quantize_rows(xs.float().tolist())
        codes, scales = ref.quantize_blocks(xs)
        assert torch.equal(codes, expected_codes)
        assert_bitwise(scales, expected_scales)


def test_block_rule_stays_on_the_inputs_device():
    """The quantizers make no tensor on the default device: a CUDA input (here the meta device, which fails the
    same way) used to meet a CPU padding, grid or code tensor."""
    x = torch.randn(3, 40, device="meta")
    codes, scales = ref.quantize_blocks(x, partial_last_block=True)
    assert codes.device.type == scales.device.type == "meta"
    assert ref.fake_quantize(x, partial_last_block=True).device.type == "meta"
    assert ref.e2m1_round(x).device.type == "meta"


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_attention_stays_on_the_inputs_device(causal):
    """The visibility of keys is made on q's device too, forward and backward (grouped KV heads, N_q != N_k)."""
    q, k, dout = (torch.randn(1, 4, 20, 64, device="meta"), torch.randn(1, 2, 30, 64, device="meta"),
                  torch.randn(1, 4, 20, 64, device="meta"))
    assert all(t.device.type == "meta" for t in ref.attention_forward(q, k, k, causal=causal).values())
    assert all(t.device.type == "meta" for t in ref.attention_backward(q, k, k, dout, causal=causal))


def test_zero_blocks_and_negative_zero():
    x = torch.zeros(3, 16)
    x[1, :] = 5.8 * 2.0**-10  # amax / 6 < 2^-10: the scale flushes to zero
    x[2, :] = torch.tensor([-0.0, 0.0, 1.0, -1.0] * 4)
    codes, scales = ref.quantize_blocks(x)
    # Row 2: s = e4m3(1/6) = 0.171875 and 1 / s = 5.82 rounds to 6 (code 7).
    assert scales.tolist() == [[0.0], [0.0], [0.171875]]
    assert codes[:2].eq(0).all()
    # A zero in a non-zero block keeps its sign bit: -0.0 -> code 8.
    assert codes[2, :4].tolist() == [8, 0, 7, 15]
    assert_bitwise(ref.fake_quantize(x)[:2], torch.zeros(2, 16))


def test_non_finite_blocks_become_nan():
    x = wide_range_blocks(203, rows=3, n=48)
    x[0, 5] = math.nan
    x[1, 20] = math.inf
    x[2, 47] = -math.inf
    codes, scales = ref.quantize_blocks(x)
    expected_codes, expected_scales = naive_quantize_rows(x.tolist())
    assert torch.equal(codes, expected_codes)
    assert_bitwise(scales, expected_scales)
    bad = torch.zeros(3, 3, dtype=torch.bool)
    bad[0, 0] = bad[1, 1] = bad[2, 2] = True
    assert torch.isnan(scales[bad]).all() and torch.isfinite(scales[~bad]).all()
    assert codes.view(3, 3, 16)[bad].eq(0).all()
    dequantized = ref.fake_quantize(x).view(3, 3, 16)
    assert torch.isnan(dequantized[bad]).all() and torch.isfinite(dequantized[~bad]).all()


def test_partial_last_block():
    x = wide_range_blocks(204, rows=5, n=37)
    x[0, 32:] = torch.tensor([1e-3, -2e-3, 3e-3, 0.0, 4e-3])  # tiny partial block: its own scale
    with pytest.raises(ValueError):
        ref.quantize_blocks(x)
    with pytest.raises(ValueError):
        ref.fake_quantize(x[:, :20])
    codes, scales = ref.quantize_blocks(x, partial_last_block=True)
    assert codes.shape == (5, 37) and scales.shape == (5, 3)
    expected_codes, expected_scales = naive_quantize_rows(x.tolist())
    assert torch.equal(codes, expected_codes)
    assert_bitwise(scales, expected_scales)
    assert scales[0, 2].item() == naive_e4m3(round_f32(Fraction(x[0, 36].item()) / 6))
    expected = [naive_fake_quantize(row) for row in x.tolist()]
    assert_bitwise(ref.fake_quantize(x, partial_last_block=True), f64(expected))


@pytest.mark.parametrize("block_axis", [0, 1, -2])
def test_block_axis_not_last(block_axis):
    gen = torch.Generator().manual_seed(205)
    x = torch.randn(48, 40, 3, generator=gen) * 10
    x = x[:, :32] if block_axis in (1, -2) else x
    codes, scales = ref.quantize_blocks(x, block_axis)
    moved = x.movedim(block_axis, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    expected_codes, expected_scales = naive_quantize_rows(flat.tolist())
    assert torch.equal(codes.movedim(block_axis, -1).reshape(flat.shape), expected_codes)
    assert_bitwise(scales.movedim(block_axis, -1).reshape(flat.shape[0], -1), expected_scales)
    expected_shape = list(x.shape)
    expected_shape[block_axis] //= 16
    assert list(scales.shape) == expected_shape


# ==============================================================================================
# P's fp16 path (numerics.md §3)
# ==============================================================================================

def test_fp16_round_matches_naive():
    gen = torch.Generator().manual_seed(401)
    exponents = torch.randint(-30, 14, (4000,), generator=gen)
    x = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.exp2(exponents)
    halfway = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 2.0**-14 * (1 - 2.0**-11),
                            65504 + 15.99, 2048 + 1, 2048 + 3], dtype=torch.float64)  # ties and edges
    x = torch.cat([x, halfway, -halfway])
    got = ref.fp16_round(x)
    assert_bitwise(got, f64([round_f16(Fraction(v)) for v in x.tolist()]))
    specials = ref.fp16_round(torch.tensor([65520.0, -1e6, math.inf, math.nan, 0.0, -0.0], dtype=torch.float64))
    assert specials[:3].tolist() == [math.inf, -math.inf, math.inf] and specials[3].isnan()
    assert_bitwise(specials[4:], torch.tensor([0.0, -0.0], dtype=torch.float64))


def test_p_frame_values_match_naive():
    gen = torch.Generator().manual_seed(402)
    x = (11.02 - 37 * torch.rand(3000, generator=gen)).float()
    x = torch.cat([x, torch.tensor([-25.0, -24.0, 0.0, 11.0, -math.inf])])
    got = ref.p_frame_values(x)
    # naive_frame_value takes (t, M): t = x + M - 11 with M = 11 gives back x
    assert_bitwise(got, f64([naive_frame_value(v, 11.0) for v in x.tolist()]))
    assert got[-5:].tolist() == [0.0, 2.0**-24, 1.0, 2048.0, 0.0]


def test_p_quantize_blocks_f16_matches_naive():
    gen = torch.Generator().manual_seed(403)
    # frame values of blocks spread over the whole range: zero, subnormal and normal scales
    x = (torch.rand(32, 80, generator=gen) * 4 - torch.randint(0, 40, (32, 5), generator=gen).repeat_interleave(16, 1)
         + 11).clamp(max=11).float()
    w = ref.p_frame_values(x)
    w[3, 17] = math.nan
    codes, scales = ref.p_quantize_blocks_f16(w)
    naive = [[naive_p_block_f16(row[j:j + 16]) for j in range(0, 80, 16)] for row in w.tolist()]
    assert_bitwise(scales, f64([[b[0] for b in row] for row in naive]))
    assert torch.equal(codes, torch.tensor([[c for b in row for c in b[1]] for row in naive], dtype=torch.uint8))
    assert (scales == 0).any() and ((scales > 0) & (scales < 2.0**-6)).any() and (scales > 1).any()
    assert scales[3, 1].isnan() and (codes[3, 16:32] == 0).all()
    # P^F * 2^11 = code value * scale has at most 6 significant bits: exact in bf16 and fp16
    values = ref.p_fake_quant_f16(w)
    finite = values[values.isfinite()]
    assert torch.equal(finite.to(torch.bfloat16).double(), finite)
    assert torch.equal(finite.to(torch.float16).double(), finite)


# ==============================================================================================
# Forward
# ==============================================================================================

def assert_forward_matches_naive(result, naive):
    for name in ("out", "out_prime", "row_sum", "lse"):
        torch.testing.assert_close(result[name], f64(naive[name]), rtol=1e-12, atol=1e-13,
                                   equal_nan=True, msg=name)
    # Exact integers (ceil of a score in (-1, 0) may be -0.0 on one side and 0.0 on the other).
    torch.testing.assert_close(result["frame"], f64(naive["frame"]), rtol=0, atol=0, equal_nan=True)


def forward_case(name):
    """Inputs and options of one small forward case; several run through the naive loops."""
    if name == "plain":
        q, k, v = make_qkv(301, 1, 2, 2, 9, 37, 32)
        return q, k, v, dict(scale=0.3)
    if name == "gqa_top_left":
        q, k, v = make_qkv(302, 1, 4, 2, 20, 33, 16, dtype=torch.bfloat16)
        return q, k, v, dict(causal="top_left")
    if name == "bottom_right":
        q, k, v = make_qkv(303, 2, 2, 1, 12, 40, 16)
        return q, k, v, dict(causal="bottom_right")
    if name == "bottom_right_more_queries":  # N_q > N_k: the first rows see no key
        q, k, v = make_qkv(304, 1, 2, 2, 20, 7, 16)
        return q, k, v, dict(causal="bottom_right")
    if name == "bool_mask":
        q, k, v = make_qkv(305, 1, 2, 2, 10, 35, 16)
        gen = torch.Generator().manual_seed(306)
        mask = torch.rand(1, 1, 10, 35, generator=gen) < 0.7
        mask[..., 3, :] = False  # an empty row
        return q, k, v, dict(mask=mask)
    if name == "additive_mask":
        q, k, v = make_qkv(307, 1, 2, 2, 10, 35, 16)
        gen = torch.Generator().manual_seed(308)
        mask = torch.randn(2, 10, 35, generator=gen).double() * 3
        mask[torch.rand(2, 10, 35, generator=gen) < 0.3] = -math.inf
        mask[1, 4, :] = -math.inf  # an empty row in head 1 only
        return q, k, v, dict(mask=mask)
    if name == "non_finite":
        q, k, v = make_qkv(309, 1, 1, 1, 20, 20, 16)
        q[0, 0, 2, 5] = math.nan  # row 2: every score NaN, not an empty row
        k[0, 0, 19, 0] = math.inf  # key 19: NaN scores, seen only by row 19
        v[0, 0, 18, 3] = math.nan  # token 18's block, its channels 0..15 (causal: V along D): NaN for rows >= 18
        return q, k, v, dict(causal="top_left")
    raise KeyError(name)


FORWARD_CASES = ["plain", "gqa_top_left", "bottom_right", "bottom_right_more_queries",
                 "bool_mask", "additive_mask", "non_finite"]


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("case", FORWARD_CASES)
def test_forward_matches_naive(case, quantize):
    q, k, v, options = forward_case(case)
    mask = options.pop("mask", None)
    result = ref.attention_forward(q, k, v, attn_mask=mask, quantize=quantize, **options)
    naive = naive_attention(q, k, v, mask=mask, quantize=quantize, **options)
    assert_forward_matches_naive(result, naive)
    if not quantize:
        torch.testing.assert_close(result["out_prime"], result["out"], rtol=0, atol=0, equal_nan=True)


def test_empty_rows():
    q, k, v, options = forward_case("bottom_right_more_queries")
    result = ref.attention_forward(q, k, v, **options)
    empty = slice(0, 13)  # row i sees keys j <= i - 13
    assert result["out"][..., empty, :].eq(0).all() and result["out_prime"][..., empty, :].eq(0).all()
    assert result["frame"][..., empty].eq(-math.inf).all()
    assert result["row_sum"][..., empty].eq(0).all()
    assert result["lse"][..., empty].eq(-math.inf).all()
    assert torch.isfinite(result["out"][..., 13:, :]).all()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(310))
    for mode in MODES:
        dq, dk, dv = ref.attention_backward(q, k, v, dout, mode=mode, **options)
        assert dq[..., empty, :].eq(0).all(), mode
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_non_finite_inputs_poison_only_the_rows_that_see_them():
    q, k, v, options = forward_case("non_finite")
    out = ref.attention_forward(q, k, v, **options)["out"][0, 0]
    assert torch.isnan(out[2]).all()  # the NaN query row
    assert torch.isnan(out[18:]).all()  # rows that see the NaN value of token 18 (and row 19 the infinite key)
    finite_rows = [i for i in range(18) if i != 2]  # rows 16, 17 share V's old token block with 18, but not its NaN
    assert torch.isfinite(out[finite_rows]).all()


def torch_attention(q, k, v, *, mask=None, causal=False, scale=None):
    """float64 attention with torch's SDPA, KV heads expanded for grouped queries."""
    group = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1),
        attn_mask=mask, is_causal=causal, scale=scale)


def test_unquantized_equals_torch_sdpa():
    q, k, v = make_qkv(311, 2, 4, 2, 24, 50, 64, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(312)
    bool_mask = torch.rand(2, 1, 24, 50, generator=gen) < 0.8
    additive = torch.randn(24, 50, generator=gen).double()
    checks = [
        (dict(), dict()),
        (dict(causal="top_left"), dict(causal=True)),
        (dict(attn_mask=bool_mask), dict(mask=bool_mask)),
        (dict(attn_mask=additive, scale=0.2), dict(mask=additive, scale=0.2)),
    ]
    for ours, theirs in checks:
        result = ref.attention_forward(q, k, v, quantize=False, **ours)
        torch.testing.assert_close(result["out"], torch_attention(q, k, v, **theirs),
                                   rtol=1e-12, atol=1e-12)
        assert torch.equal(result["out_prime"], result["out"])
        assert torch.equal(ref.attention(q, k, v, mode="bf16", **ours), result["out"])


def test_frame_is_an_integer_and_lse_is_the_logsumexp():
    q, k, v = make_qkv(313, 1, 2, 2, 30, 45, 64)
    result = ref.attention_forward(q, k, v, causal="bottom_right")
    frame = result["frame"]
    assert torch.equal(frame, torch.floor(frame))
    q_fq, k_fq = ref.fake_quantize(q), ref.fake_quantize(k)
    scores = (q_fq @ k_fq.transpose(-1, -2)) / 8.0
    visible = torch.arange(45) <= torch.arange(30).unsqueeze(-1) + 15
    scores = scores.masked_fill(~visible, -math.inf)
    # l sums P̂ rounded to fp16, each within 2^-11 of itself (2^-12 from the fp32 argument and fp16 rounding)
    torch.testing.assert_close(result["lse"], torch.logsumexp(scores, dim=-1), rtol=0, atol=2.0**-11)
    log2_max = scores.amax(-1) * LOG2E
    assert ((frame - log2_max >= 0) & (frame - log2_max < 1)).all()
    # without quantization P̂ = 2^(t - M) exactly, and LSE is the logsumexp to float64 rounding
    q_plain, k_plain = q_fq.float(), k_fq.float()
    plain = ref.attention_forward(q_plain, k_plain, v, causal="bottom_right", quantize=False)
    torch.testing.assert_close(plain["lse"], torch.logsumexp(scores, dim=-1), rtol=1e-12, atol=1e-12)


def test_out_prime_is_close_to_out_but_different():
    q, k, v = make_qkv(314, 1, 4, 4, 64, 96, 64)
    result = ref.attention_forward(q, k, v)
    out, out_prime = result["out"], result["out_prime"]
    relative = (out - out_prime).norm() / out.norm()
    assert 0 < relative < 0.1
    assert not torch.equal(out, out_prime)
    for mode in ("attn_qat", "high_precision_p", "low_precision_o", "drop_in"):
        assert torch.equal(ref.attention(q, k, v, mode=mode), out)


def test_bad_arguments():
    q, k, v = make_qkv(315, 1, 3, 2, 4, 4, 16)
    with pytest.raises(ValueError):
        ref.attention_forward(q, k, v)  # 3 query heads over 2 kv heads
    q, k, v = make_qkv(316, 1, 2, 2, 4, 4, 16)
    with pytest.raises(ValueError):
        ref.attention_forward(q, k, v, causal="top-left")
    with pytest.raises(ValueError):
        ref.attention_backward(q, k, v, q, mode="fp4")
    with pytest.raises(ValueError):
        ref.attention(q, k, v, mode="fp8")


# ==============================================================================================
# Backward
# ==============================================================================================

def test_bf16_backward_equals_autograd():
    q, k, v = make_qkv(401, 2, 4, 2, 17, 29, 32)
    gen = torch.Generator().manual_seed(402)
    dout = torch.randn(2, 4, 17, 32, generator=gen)
    additive = torch.randn(17, 29, generator=gen).double()
    for ours, theirs in [
        (dict(causal="top_left"), dict(causal=True)),
        (dict(attn_mask=additive, scale=0.4), dict(mask=additive, scale=0.4)),
    ]:
        leaves = [x.double().requires_grad_() for x in (q, k, v)]
        torch_attention(*leaves, **theirs).backward(dout.double())
        grads = ref.attention_backward(q, k, v, dout, mode="bf16", **ours)
        for ours_grad, leaf in zip(grads, leaves):
            torch.testing.assert_close(ours_grad, leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_naive(mode):
    q, k, v = make_qkv(403, 1, 2, 1, 6, 21, 16)
    gen = torch.Generator().manual_seed(404)
    dout = torch.randn(1, 2, 6, 16, generator=gen)
    mask = torch.rand(1, 2, 6, 21, generator=gen) < 0.8
    mask[0, 1, 2] = False  # an empty row
    options = dict(causal="bottom_right", scale=0.35)
    grads = ref.attention_backward(q, k, v, dout, mode=mode, attn_mask=mask, **options)
    expected = naive_gradients(q, k, v, dout, mode=mode, mask=mask, **options)
    for name, ours, theirs in zip(("dq", "dk", "dv"), grads, expected):
        torch.testing.assert_close(ours, f64(theirs), rtol=1e-10, atol=1e-12, msg=name)


def sum_of_dk_over_keys(mode, q, k, v, dout):
    """Σ_j dK_j = scale Σ_i (Σ_j dS_ij) q_i: zero when every row of dS sums to zero."""
    dk = ref.attention_backward(q, k, v, dout, mode=mode, causal="top_left")[1]
    return (dk.sum(dim=2).norm() / dk.norm()).item()


def test_ds_rows_sum_to_zero_only_with_the_right_correction():
    q, k, v = make_qkv(405, 1, 2, 2, 40, 40, 64)
    dout = torch.randn(1, 2, 40, 64, generator=torch.Generator().manual_seed(406))
    for mode in ("attn_qat", "high_precision_p", "bf16"):  # principle 2 holds
        assert sum_of_dk_over_keys(mode, q, k, v, dout) < 1e-12, mode
    for mode in ("low_precision_o", "drop_in"):  # D = dO·O with O != P·V
        assert sum_of_dk_over_keys(mode, q, k, v, dout) > 1e-4, mode


def test_high_precision_p_changes_only_dv():
    q, k, v = make_qkv(407, 1, 2, 2, 33, 48, 64)
    dout = torch.randn(1, 2, 33, 64, generator=torch.Generator().manual_seed(408))
    dq, dk, dv = ref.attention_backward(q, k, v, dout, mode="attn_qat")
    dq_hp, dk_hp, dv_hp = ref.attention_backward(q, k, v, dout, mode="high_precision_p")
    assert torch.equal(dq, dq_hp) and torch.equal(dk, dk_hp)
    relative = ((dv - dv_hp).norm() / dv.norm()).item()
    assert 0 < relative < 0.1


@pytest.mark.parametrize("mode", MODES)
def test_grouped_kv_gradients_sum_over_the_group(mode):
    q, k, v = make_qkv(409, 1, 4, 2, 19, 26, 32)
    dout = torch.randn(1, 4, 19, 32, generator=torch.Generator().manual_seed(410))
    dq, dk, dv = ref.attention_backward(q, k, v, dout, mode=mode, causal="top_left")
    k_expanded, v_expanded = (x.repeat_interleave(2, dim=1) for x in (k, v))
    dq_e, dk_e, dv_e = ref.attention_backward(q, k_expanded, v_expanded, dout, mode=mode,
                                              causal="top_left")
    torch.testing.assert_close(dq, dq_e, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dk, dk_e.view(1, 2, 2, 26, 32).sum(2), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dv, dv_e.view(1, 2, 2, 26, 32).sum(2), rtol=1e-12, atol=1e-14)
