"""Float64 reference of the attn_qat numerics contract.

This module is the executable form of numerics.md, the numerics contract: the NVFP4 block rule
(E4M3 block scales, E2M1 codes, blocks of 16), the 4-bit attention forward with its power-of-two
frame and P's path in fp16 with 2^11 headroom, the straight-through backward of every training mode,
and the edge cases (masks, causal alignments, grouped KV heads, empty rows, non-finite inputs). It is
written to be obviously correct rather than fast: pure PyTorch on CPU, every fp32 and fp16 rounding
of the block rule and of P's path reproduced exactly, everything after the quantizers in float64. The
CPU and CUDA kernels are tested against it; it depends on nothing else in the package.
"""

from __future__ import annotations  # `X | None` annotations on Python 3.9 (pyproject allows it)

import math

import torch
from torch import Tensor

__all__ = [
    "e4m3_round",
    "e2m1_round",
    "quantize_blocks",
    "fake_quantize",
    "fp16_round",
    "p_frame_values",
    "p_quantize_blocks_f16",
    "p_fake_quant_f16",
    "attention_forward",
    "attention_backward",
    "attention",
]

BLOCK = 16
E4M3_MAX = 448.0
P_HEADROOM = 2.0**11
P_HEADROOM_LOG2 = 11  # P's exponent argument is t - M + 11, so that 2^x is P̂ * 2^11 (numerics.md §3)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MODES = ("attn_qat", "high_precision_p", "low_precision_o", "drop_in", "bf16")
CAUSAL_ALIGNMENTS = (None, "top_left", "bottom_right")
V_BLOCK_AXES = ("auto", "tokens", "head_dim")

# E2M1 magnitudes indexed by the 3-bit magnitude code.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------------------------
# fp32 arithmetic
#
# The block rule rounds three results to fp32: amax / 6, 1 / s and x * r. Each is computed here in
# float64 and then rounded once to fp32. That is exactly the correctly rounded fp32 result: a product
# of two fp32 values is exact in float64 (48 <= 53 significant bits), and for a quotient the double
# rounding is innocuous because 53 >= 2 * 24 + 2. Going through float64 keeps the result independent
# of how torch's fp32 kernels are vectorised (e.g. a division by a scalar done as a multiplication).
# ----------------------------------------------------------------------------------------------

def _fp32_div(a: Tensor, b: Tensor) -> Tensor:
    """Correctly rounded fp32 quotient of fp32 tensors a / b."""
    return torch.div(a.double(), b.double()).float()


def _fp32_mul(a: Tensor, b: Tensor) -> Tensor:
    """Correctly rounded fp32 product of fp32 tensors a * b."""
    return (a.double() * b.double()).float()


# ----------------------------------------------------------------------------------------------
# fp16 arithmetic
#
# P's path (numerics.md §3) rounds to fp16: the frame values 2^x, the reciprocal of the block scale and
# the scaled values. fp16_round rounds a float64 value once, like the hardware's cvt.rn.f16x2.f32 does an
# fp32 one. torch's own float64 -> float16 conversion goes through fp32 (two roundings), so it is not used.
# ----------------------------------------------------------------------------------------------

def fp16_round(v: Tensor) -> Tensor:
    """The fp16 value nearest to each element of v (float64 result): ties to even, fp16 subnormals kept
    (spacing 2^-24 below 2^-14), magnitudes from 65520 on to +-Inf, NaN stays NaN."""
    v64 = v.double()
    magnitude = v64.abs()
    # fp16 keeps 11 significant bits: in [2^(e-1), 2^e) the spacing is 2^(e-11), at least 2^-24.
    _, exponent = torch.frexp(torch.where(torch.isfinite(v64), v64, 0.0))
    spacing = torch.ldexp(torch.ones_like(v64), torch.clamp(exponent - 11, min=-24))
    rounded = torch.round(v64 / spacing) * spacing  # exact scalings; torch.round is half-to-even
    rounded = torch.where(magnitude >= 65520.0, torch.copysign(torch.full_like(v64, math.inf), v64), rounded)
    return torch.where(torch.isnan(v64), v64, rounded)


# ----------------------------------------------------------------------------------------------
# Element formats
# ----------------------------------------------------------------------------------------------

def e4m3_round(v: Tensor) -> Tensor:
    """Round finite v >= 0 to the nearest E4M3 value (float32 result).

    Round to nearest, ties to even; saturates at 448; values up to and including 2^-10 (half the
    smallest subnormal 2^-9) become 0. Same as ``cvt.rn.satfinite.e4m3x2.f32``. Input of another dtype
    is first converted to float32, as the block rule always works on fp32.
    """
    # Saturating first changes nothing (448 is the largest value and every v above it rounds to it or
    # beyond) and keeps the exponents below small.
    v64 = torch.clamp(v.float().double(), max=E4M3_MAX)
    # E4M3 has 3 mantissa bits, so the spacing of values in [2^e, 2^(e+1)) is 2^(e-3); below the
    # smallest normal 2^-6 the spacing stays 2^-9 (subnormals). frexp gives v = m * 2^exp with
    # m in [0.5, 1), i.e. e = exp - 1.
    _, exponent = torch.frexp(v64)
    spacing = torch.ldexp(torch.ones_like(v64), torch.clamp(exponent - 4, min=-9))
    # v / spacing and the product back are exact (powers of two); torch.round is half-to-even.
    rounded = torch.round(v64 / spacing) * spacing
    return rounded.float()


def _e2m1_magnitude_code(y: Tensor) -> Tensor:
    """Magnitude code 0..7 of the E2M1 value nearest to |y|, ties to the even code, saturating.

    NaN gives code 0; callers that can see NaN handle it themselves.
    """
    magnitude = y.double().abs()
    code = torch.zeros(y.shape, dtype=torch.long, device=y.device)
    # Walk up the grid: |y| passes the midpoint between codes c and c + 1 when it is above it, or
    # exactly on it if c + 1 is the even code. Beyond the last midpoint everything stays at code 7 (6).
    for c in range(len(_E2M1_MAGNITUDES) - 1):
        midpoint = (_E2M1_MAGNITUDES[c] + _E2M1_MAGNITUDES[c + 1]) / 2
        passed = magnitude > midpoint if c % 2 == 0 else magnitude >= midpoint
        code += passed.long()
    return code


def e2m1_round(y: Tensor) -> Tensor:
    """Round y to the nearest E2M1 value in {0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6} (float32 result).

    Ties go to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), magnitudes
    beyond 6 saturate to 6, and the sign is kept even when the magnitude rounds to 0 (-0.1 -> -0.0).
    NaN stays NaN (E2M1 has no NaN; the block rule never feeds it one).
    """
    y32 = y.float()
    grid = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=y32.device)
    magnitude = grid[_e2m1_magnitude_code(y32)]
    rounded = torch.copysign(magnitude, y32)
    return torch.where(torch.isnan(y32), y32, rounded)


# ----------------------------------------------------------------------------------------------
# The NVFP4 block rule (numerics.md §1)
# ----------------------------------------------------------------------------------------------

def _blocks_and_scales(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (..., n) cut into zero-padded blocks of 16 along its last axis, (..., ceil(n / 16), 16) in x's dtype, with
    §1's block scales e4m3(fp32(amax / 6)) (float32; NaN where the block holds a NaN or Inf) and whether each block
    is quantized (a finite, nonzero scale). Zero padding leaves a partial block's amax unchanged."""
    n = x.shape[-1]
    num_blocks = -(-n // BLOCK)
    padding = x.new_zeros(*x.shape[:-1], num_blocks * BLOCK - n)
    blocks = torch.cat([x, padding], dim=-1).reshape(*x.shape[:-1], num_blocks, BLOCK)
    amax = blocks.abs().amax(dim=-1).float()  # NaN propagates through amax
    finite = torch.isfinite(amax)
    scale = e4m3_round(_fp32_div(torch.where(finite, amax, 0.0), torch.full_like(amax, 6.0)))
    scale = torch.where(finite, scale, torch.nan)
    return blocks, scale, finite & (scale > 0)


def quantize_blocks(
    x: Tensor, block_axis: int = -1, *, partial_last_block: bool = False
) -> tuple[Tensor, Tensor]:
    """Quantize x to NVFP4 in blocks of 16 consecutive elements along ``block_axis``.

    Returns ``(codes, scales)``. ``codes`` is uint8 with x's shape, one unpacked 4-bit code per
    element: ``sign << 3 | magnitude code`` with magnitude codes indexing [0, .5, 1, 1.5, 2, 3, 4, 6].
    ``scales`` is float32 (exact E4M3 values) with x's shape except ``ceil(n / 16)`` entries along
    ``block_axis``. A block whose amax is NaN or Inf gets scale NaN and codes 0, so it dequantizes to
    NaN; a block whose scale rounds to 0 has codes 0.

    If n is not a multiple of 16, the trailing partial block (its amax taken over its valid elements
    only) is allowed with ``partial_last_block=True``; otherwise it raises ValueError.
    """
    x32 = x.float().movedim(block_axis, -1)
    n = x32.shape[-1]
    if n % BLOCK != 0 and not partial_last_block:
        raise ValueError(
            f"block axis has {n} elements, not a multiple of {BLOCK}; pass partial_last_block=True "
            "to allow a trailing partial block"
        )
    blocks, scale, quantized = _blocks_and_scales(x32)

    reciprocal = _fp32_div(torch.ones_like(scale), torch.where(quantized, scale, 1.0))
    y = _fp32_mul(blocks, reciprocal.unsqueeze(-1))
    codes = torch.signbit(y).long() * 8 + _e2m1_magnitude_code(y)
    codes = torch.where(quantized.unsqueeze(-1), codes, 0)

    codes = codes.reshape(*x32.shape[:-1], blocks.shape[-2] * BLOCK)[..., :n]
    return codes.to(torch.uint8).movedim(-1, block_axis), scale.movedim(-1, block_axis)


def fake_quantize(x: Tensor, block_axis: int = -1, *, partial_last_block: bool = False) -> Tensor:
    """Quantize then dequantize x (code value times block scale), as float64 with x's shape.

    Same blocking and arguments as :func:`quantize_blocks`; a non-finite block comes back all NaN.
    """
    codes, scales = quantize_blocks(x, block_axis, partial_last_block=partial_last_block)
    codes = codes.movedim(block_axis, -1).long()
    n = codes.shape[-1]
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float64, device=codes.device)[codes & 7]
    values = torch.where(codes >= 8, -magnitudes, magnitudes)
    element_scales = scales.movedim(block_axis, -1).double().repeat_interleave(BLOCK, dim=-1)[..., :n]
    return (values * element_scales).movedim(-1, block_axis)


# ----------------------------------------------------------------------------------------------
# P's path in fp16 (numerics.md §3)
# ----------------------------------------------------------------------------------------------

def p_frame_values(x: Tensor) -> Tensor:
    """w = fp16(2^x) = P̂ * 2^11 for fp32 exponent arguments x = fp32(t - M + 11), as float64.

    2^x is taken in float64 and rounded once to fp16. For every fp32 x in [-25, 11.01] (all that P's path
    meets: x <= 11 up to the kernels' fma rounding, and 2^x < 2^-25 rounds to 0) 2^x lies at least 2^-39
    of itself from every fp16 rounding midpoint, x = -25 (2^-25, a tie, to 0) aside, so any float64 exp2
    within a few ulps gives the correctly rounded value (dev/p_fp16_numerics.py checks every such x).
    """
    return fp16_round(torch.exp2(x.float().double()))


def p_quantize_blocks_f16(w: Tensor) -> tuple[Tensor, Tensor]:
    """P's block rule in fp16 (numerics.md §3) on w = P̂ * 2^11, blocks of 16 along the last axis counted
    from index 0, the trailing block possibly partial. w holds fp16 values >= 0 (or NaN).

    amax and the scale s = e4m3(fp32(amax / 6)) are §1's (amax, an fp16 value, is exact in fp32); then
    r = fp16(1 / s), y = fp16(w * r) (the product of two fp16 values, rounded once) and the E2M1 code of y
    (ties to the even code, saturating at 6). Returns ``(codes, scales)`` like :func:`quantize_blocks`: a
    block with a NaN gets scale NaN and codes 0, a block whose scale rounds to 0 codes 0.
    """
    w64 = w.double()
    n = w64.shape[-1]
    blocks, scale, quantized = _blocks_and_scales(w64)  # amax, an fp16 value, is exact in fp32

    # fp16(fp32(1 / s)) is fp16(1 / s) for every E4M3 s (checked for all 126 by tests/test_reference.py).
    reciprocal = fp16_round(_fp32_div(torch.ones_like(scale), torch.where(quantized, scale, 1.0)))
    y = fp16_round(blocks * reciprocal.unsqueeze(-1))
    codes = torch.signbit(y).long() * 8 + _e2m1_magnitude_code(y)
    codes = torch.where(quantized.unsqueeze(-1), codes, 0)
    codes = codes.reshape(*w64.shape[:-1], blocks.shape[-2] * BLOCK)[..., :n]
    return codes.to(torch.uint8), scale


def p_fake_quant_f16(w: Tensor) -> Tensor:
    """P^F * 2^11 = e2m1 code value times block scale of :func:`p_quantize_blocks_f16` (float64, w's shape);
    a block with a NaN comes back all NaN."""
    codes, scales = p_quantize_blocks_f16(w)
    n = codes.shape[-1]
    magnitudes = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float64, device=codes.device)[(codes & 7).long()]
    values = torch.where(codes >= 8, -magnitudes, magnitudes)
    return values * scales.double().repeat_interleave(BLOCK, dim=-1)[..., :n]


# ----------------------------------------------------------------------------------------------
# Attention (numerics.md §3 to §6)
# ----------------------------------------------------------------------------------------------

def _matmul_visible(a: Tensor, visible: Tensor, b: Tensor) -> Tensor:
    """a @ b where the terms with visible False are absent rather than 0 * b.

    Masked keys contribute nothing (numerics.md §2, §6), even when the operand row they would meet is
    NaN or Inf; a plain matmul would turn 0 * NaN into NaN. A non-finite b meeting a visible term still
    makes that output element NaN (the spec asks for non-finite, so Inf is reported as NaN).
    """
    finite = torch.isfinite(b)
    out = torch.where(visible, a, 0.0) @ torch.where(finite, b, 0.0)
    poisoned = (visible.double() @ (~finite).double()) > 0
    return torch.where(poisoned, torch.nan, out)


def _visibility(attn_mask, causal, batch, heads, n_q, n_k, device) -> tuple[Tensor, Tensor | None]:
    """Which keys each query sees, shape (B, Hq, Nq, Nk), and the float64 additive mask if any."""
    if causal not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal must be one of {CAUSAL_ALIGNMENTS}, got {causal!r}")
    i = torch.arange(n_q, device=device).unsqueeze(-1)
    j = torch.arange(n_k, device=device)
    if causal == "top_left":
        visible = j <= i
    elif causal == "bottom_right":
        visible = j <= i + (n_k - n_q)
    else:
        visible = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    visible = visible.expand(batch, heads, n_q, n_k)

    additive = None
    if attn_mask is not None:
        attn_mask = torch.broadcast_to(attn_mask, (batch, heads, n_q, n_k))
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            additive = attn_mask.double()
            visible = visible & (additive != -math.inf)
    return visible, additive


def v_along_tokens(v_block_axis: str, attn_mask, causal) -> bool:
    """numerics.md §2: V is blocked along tokens only when every query sees every key (no causal alignment, no
    mask), along head_dim otherwise; "tokens" or "head_dim" overrides the rule."""
    if v_block_axis not in V_BLOCK_AXES:
        raise ValueError(f"v_block_axis must be one of {V_BLOCK_AXES}, got {v_block_axis!r}")
    if v_block_axis == "auto":
        return causal is None and attn_mask is None
    return v_block_axis == "tokens"


def _forward(q, k, v, attn_mask, causal, scale, quantize, operands_quantized=False, v_block_axis="auto") -> dict:
    """The forward of numerics.md §3 with every intermediate the backward needs.

    Operands come back with the KV heads already expanded to the query heads (float64). With
    ``operands_quantized`` q, k, v are used as given and ``quantize`` applies to P alone.
    """
    along_tokens = v_along_tokens(v_block_axis, attn_mask, causal)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (batch, heads, tokens, head_dim)")
    batch, heads_q, n_q, head_dim = q.shape
    heads_kv, n_k = k.shape[1], k.shape[2]
    if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if heads_q % heads_kv != 0:
        raise ValueError(f"query heads {heads_q} is not a multiple of kv heads {heads_kv}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)

    if quantize and not operands_quantized:
        q_op = fake_quantize(q, -1)
        k_op = fake_quantize(k, -1)
        v_op = fake_quantize(v, -2, partial_last_block=True) if along_tokens else fake_quantize(v, -1)
    else:
        q_op, k_op, v_op = q.double(), k.double(), v.double()
    # Query head h reads kv head h // group: repeat_interleave lays the heads out that way.
    group = heads_q // heads_kv
    k_op = k_op.repeat_interleave(group, dim=1)
    v_op = v_op.repeat_interleave(group, dim=1)

    visible, additive = _visibility(attn_mask, causal, batch, heads_q, n_q, n_k, q.device)
    scores = (q_op @ k_op.transpose(-1, -2)) * scale
    if additive is not None:
        scores = scores + additive
    t = torch.where(visible, scores * LOG2E, -math.inf)

    # The frame ignores NaN scores so that NaN reaches l and O instead of hiding in M; a visible row
    # whose scores are all NaN (or all -inf) gets M = -inf and then NaN everywhere, not an empty row.
    empty = ~visible.any(dim=-1)
    frame = torch.ceil(torch.where(torch.isnan(t), -math.inf, t).amax(dim=-1))
    if quantize:
        # numerics.md §3: x = t - M + 11 rounded once to fp32, w = fp16(2^x) = P̂ * 2^11, and P's block rule in
        # fp16 on w. P̂ is that fp16 value (times 2^-11) everywhere: in l, O' and the backward's P.
        x = (t - (frame - P_HEADROOM_LOG2).unsqueeze(-1)).float()
        w = torch.where(visible, p_frame_values(x), 0.0)
        p_hat = w / P_HEADROOM
        p_fq = p_fake_quant_f16(w) / P_HEADROOM
    else:
        p_hat = torch.where(visible, torch.exp2(t - frame.unsqueeze(-1)), 0.0)
        p_fq = p_hat
    # Exact: the terms are multiples of 2^-35 below 2 (fp16 values times 2^-11), fewer than 2^17 of them.
    row_sum = p_hat.sum(dim=-1)

    # Empty rows have l = 0 and no terms: divide by 1 there, giving O = 0 instead of 0 / 0.
    divisor = torch.where(empty, 1.0, row_sum).unsqueeze(-1)
    out = _matmul_visible(p_fq, visible, v_op) / divisor
    out_prime = _matmul_visible(p_hat, visible, v_op) / divisor if quantize else out
    lse = LN2 * (frame + torch.log2(row_sum))  # -inf + -inf = -inf for empty rows
    return dict(
        q_op=q_op, k_op=k_op, v_op=v_op, visible=visible, empty=empty, scale=scale,
        p_hat=p_hat, p_fq=p_fq, divisor=divisor,
        out=out, out_prime=out_prime, frame=frame, row_sum=row_sum, lse=lse,
    )


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    causal: str | None = None,
    scale: float | None = None,
    quantize: bool = True,
    operands_quantized: bool = False,
    v_block_axis: str = "auto",
) -> dict:
    """Attention forward of numerics.md §3, in float64.

    q is (B, Hq, Nq, D); k, v are (B, Hkv, Nk, D) with Hq a multiple of Hkv (query head h uses kv head
    h // (Hq // Hkv)); any float dtype. ``causal`` is None, "top_left" (key j visible to query i iff
    j <= i) or "bottom_right" (j <= i + Nk - Nq). ``attn_mask`` is boolean (True = attend) or additive
    float, broadcastable to (B, Hq, Nq, Nk). ``scale`` defaults to 1 / sqrt(D).

    With ``quantize`` Q and K are fake-quantized along D, V as numerics.md §2 says (``v_block_axis``:
    "auto" blocks it along tokens, trailing partial block allowed, when there is neither a causal
    alignment nor a mask, along D otherwise; "tokens" or "head_dim" forces one) and P by §3's fp16 path:
    P̂ = fp16(2^fp32(t - M + 11)) * 2^-11 and P^F = P's fp16 block rule on P̂ * 2^11, times 2^-11, in
    blocks of 16 keys counted from key 0. Without it this is plain attention with the same frame and
    normaliser (P̂ = 2^(t - M) in float64).

    ``operands_quantized`` says q, k, v already hold the values the kernel computes with, so they are
    used as given and only P is quantized (with ``quantize``): the decode of an NVFP4 KV cache
    (attn_qat.NVFP4KVCache), or attention on packed operands.

    Returns a dict of float64 tensors: ``out`` O (B, Hq, Nq, D), ``out_prime`` O' (computed with
    unquantized P̂; equals O without quantize), ``frame`` M, ``row_sum`` l and ``lse`` (B, Hq, Nq).
    A row with no visible key has O = O' = 0, M = -inf, l = 0, LSE = -inf.
    """
    result = _forward(q, k, v, attn_mask, causal, scale, quantize, operands_quantized, v_block_axis)
    return {name: result[name] for name in ("out", "out_prime", "frame", "row_sum", "lse")}


def _sum_over_query_groups(grad: Tensor, heads_kv: int) -> Tensor:
    """Fold a gradient of expanded KV heads (B, Hq, Nk, D) back to (B, Hkv, Nk, D)."""
    batch, heads_q = grad.shape[:2]
    return grad.reshape(batch, heads_kv, heads_q // heads_kv, *grad.shape[2:]).sum(dim=2)


def attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    *,
    mode: str = "attn_qat",
    attn_mask: Tensor | None = None,
    causal: str | None = None,
    scale: float | None = None,
    v_block_axis: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv), float64, of the original q, k, v for a training mode of numerics.md §5.

    ``attn_qat``: §4. ``high_precision_p``: §4 with dV from the unquantized P. ``low_precision_o``: §4
    with D = dO·O. ``drop_in``: the plain softmax backward on the unquantized q, k, v, with D = dO·O
    where O is the FP4 forward's output. ``bf16``: plain attention backward, no quantization anywhere.
    The quantizers pass gradients straight through; with grouped KV heads dk, dv sum over the query
    heads of each group; masks get no gradient; rows with no visible key get zero gradients. V is
    blocked as in :func:`attention_forward` (``v_block_axis``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    forward = _forward(q, k, v, attn_mask, causal, scale, quantize=mode != "bf16", v_block_axis=v_block_axis)

    if mode in ("drop_in", "bf16"):
        # Softmax backward of unquantized attention; only the correction D sees the FP4 output.
        plain = forward if mode == "bf16" else _forward(q, k, v, attn_mask, causal, scale, False)
        prob = plain["p_hat"] / plain["divisor"]
        prob_for_dv = prob
        operands = plain
        out_for_delta = forward["out"]
    else:
        prob = forward["p_hat"] / forward["divisor"]
        prob_fq = forward["p_fq"] / forward["divisor"]
        prob_for_dv = prob if mode == "high_precision_p" else prob_fq
        operands = forward
        out_for_delta = forward["out"] if mode == "low_precision_o" else forward["out_prime"]

    q_op, k_op, v_op = operands["q_op"], operands["k_op"], operands["v_op"]
    visible, scale = forward["visible"], forward["scale"]
    visible_t = visible.transpose(-1, -2)
    dout = dout.double()

    dv = _matmul_visible(prob_for_dv.transpose(-1, -2), visible_t, dout)
    dp = dout @ v_op.transpose(-1, -2)
    delta = (dout * out_for_delta).sum(dim=-1, keepdim=True)
    ds = torch.where(visible, prob * (dp - delta), 0.0)
    dq = scale * _matmul_visible(ds, visible, k_op)
    dk = scale * _matmul_visible(ds.transpose(-1, -2), visible_t, q_op)

    heads_kv = k.shape[1]
    return dq, _sum_over_query_groups(dk, heads_kv), _sum_over_query_groups(dv, heads_kv)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    causal: str | None = None,
    scale: float | None = None,
    mode: str = "attn_qat",
    v_block_axis: str = "auto",
) -> Tensor:
    """Forward output O (float64) of a mode: "bf16" is unquantized, every other mode is §3."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return attention_forward(
        q, k, v, attn_mask=attn_mask, causal=causal, scale=scale, quantize=mode != "bf16", v_block_axis=v_block_axis
    )["out"]
