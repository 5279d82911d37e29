"""Public attention API: an SDPA-compatible entry point and a FlashAttention-style one.

Both run the Attn-QAT forward (numerics.md §3: FP4 fake-quantized Q, K, V and P) and, under autograd,
the FP4-consistent backward (§4), or one of the ablation modes of §5.
"""
import math
from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import _C
from .ops import (CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT, check_softmax_scale, mode_code, ops,
                  positive_scale, v_along_tokens)

SUPPORTED_HEAD_DIMS = _C.HEAD_DIMS  # the head dims the kernels are built for (csrc/attn_qat.h)
_LN2 = math.log(2.0)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):  # ("meta" has no autocast)
        return torch.get_autocast_dtype(device_type)
    return None


def run_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype an operand is run in: a float32 one takes the autocast dtype under autocast, as autocast casts the
    operands of PyTorch's SDPA, and bfloat16 outside it (its output goes back to float32, `_prepare_operands`); any
    other stays as it is. Under autocast models mix them: transformers 5.24's Qwen3 RMSNorm returns q and k in
    float32 when its weights are float32, while v comes out of a linear layer in the autocast dtype. (`input_problem`
    checks the operands' dtypes by this rule.)"""
    if t.dtype != torch.float32:
        return t.dtype
    cast = _autocast_dtype(t.device.type)
    return torch.bfloat16 if cast is None else cast


class Problem(NamedTuple):
    """Why attn_qat cannot take an attention call: the reason (short: the integrations put it in their fallback
    warnings and warn once per distinct reason), the exception type the public functions raise for it, and the
    particulars (shapes, dtypes, a hint) their error message adds. (A named tuple of plain values, so that finding
    one traces under torch.compile.)"""

    reason: str
    error: type = ValueError
    details: str = ""

    def exception(self, fn: str) -> Exception:
        return self.error(f"attn_qat.{fn}: {self.reason}{self.details}")


def input_problem(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, *,
                  ndims: Tuple[int, ...] = (3, 4)) -> Optional[Problem]:
    """The one home of the input rules: what keeps attn_qat from running this attention call (arguments as for
    torch's SDPA: (..., heads, tokens, head_dim) operands, `ndims` the ranks accepted), or None when it can. The
    public functions raise `problem.exception(fn)` (`_check_qkv`); the integrations fall back to the framework's
    attention by `unsupported_reason`. It reads only metadata, so it traces under torch.compile; `mode`, `scale`
    and `v_block_axis` are not its business (no fallback would help with a bad one)."""
    if dropout_p != 0.0:
        return Problem("dropout_p > 0 is not supported", ValueError,
                       f" (dropout_p={dropout_p}); use dropout_p=0.0")
    if attn_mask is not None and is_causal:
        return Problem("attn_mask and is_causal=True were both given", ValueError,
                       "; pass either attn_mask or is_causal=True, not both (as in SDPA)")
    operands = (("query", query), ("key", key), ("value", value))
    for name, t in operands:
        if not isinstance(t, torch.Tensor):
            return Problem("query, key and value must all be tensors", TypeError,
                           f"; {name} must be a torch.Tensor, got {type(t).__name__}")
    if query.is_nested or key.is_nested or value.is_nested:
        return Problem("nested (jagged) tensors are not supported", NotImplementedError)
    allowed = " or ".join(f"{n}-D" for n in ndims)
    if not (query.dim() == key.dim() == value.dim()):
        return Problem("query, key and value have different numbers of dimensions", ValueError,
                       f"; they must all be {allowed}, got shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                       f"{tuple(value.shape)}")
    if query.dim() not in ndims:
        return Problem(f"{query.dim()}-D inputs are not supported ({allowed} only)", ValueError,
                       f"; got shape {tuple(query.shape)}")
    device = query.device
    if key.device != device or value.device != device:
        return Problem("query, key and value must be on one device", ValueError,
                       f"; got {query.device}, {key.device}, {value.device}")
    if device.type not in ("cpu", "cuda", "meta"):
        return Problem(f"device type {device.type!r} is not supported", NotImplementedError,
                       " (attn_qat has CPU and CUDA kernels)")
    # outside autocast the operands must share a dtype, as for PyTorch's SDPA; under it, the dtype they run in
    autocast = _autocast_dtype(device.type) is not None
    dtypes = [run_dtype(t) if autocast else t.dtype for _, t in operands]
    if not (dtypes[0] == dtypes[1] == dtypes[2]):
        return Problem("query, key and value have different dtypes", TypeError,
                       f"; they must have one dtype, got {dtypes[0]}, {dtypes[1]}, {dtypes[2]}")
    if run_dtype(query) not in (torch.bfloat16, torch.float16):
        return Problem(f"dtype {dtypes[0]} is not supported (bfloat16, float16 or float32)", TypeError,
                       "; cast them")
    d, d_v = query.shape[-1], value.shape[-1]
    for size in (d, d_v):
        if size not in SUPPORTED_HEAD_DIMS:
            return Problem(f"head_dim {size} is not supported ({_C.HEAD_DIMS_TEXT})", ValueError,
                           f"; got query, key and value head dims {d}, {key.shape[-1]}, {d_v}")
    if key.shape[-1] != d:
        return Problem("query and key must share head_dim", ValueError,
                       f"; got {d} and {key.shape[-1]} (value's may differ)")
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        return Problem("batch sizes differ", ValueError,
                       f"; got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-3:-1] != value.shape[-3:-1]:
        return Problem("key and value must have the same heads and tokens", ValueError,
                       f"; got {tuple(key.shape)} and {tuple(value.shape)}")
    heads_q, heads_kv = query.shape[-3], key.shape[-3]
    if (heads_kv == 0 and heads_q) or (heads_kv and heads_q % heads_kv):
        return Problem(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})", ValueError)
    if heads_q != heads_kv and not enable_gqa:
        return Problem(f"query heads ({heads_q}) and key/value heads ({heads_kv}) differ without enable_gqa=True",
                       ValueError, "; pass enable_gqa=True for grouped-query attention (as in SDPA)")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return Problem("attn_mask is not a tensor", TypeError,
                           f"; attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.device != device:
            return Problem("attn_mask is on a different device than the query", ValueError,
                           f"; attn_mask is on {attn_mask.device}, the query on {device}")
        if attn_mask.requires_grad:
            return Problem("attn_mask requires grad (gradients with respect to attn_mask are not supported)",
                           NotImplementedError)
        if not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            return Problem(f"attn_mask dtype {attn_mask.dtype} is not supported (bool or floating point)",
                           TypeError)
        # an unbatched call runs batched with a batch of 1 (as torch's SDPA does), so a leading 1 broadcasts too
        target = (*query.shape[:-3], heads_q, query.shape[-2], key.shape[-2])
        target = target if len(target) == 4 else (1, *target)
        if attn_mask.dim() > len(target) or any(
                m not in (1, t) for m, t in zip(reversed(attn_mask.shape), reversed(target))):
            return Problem("attn_mask does not broadcast to (batch, heads, query tokens, key tokens)", ValueError,
                           f"; got shape {tuple(attn_mask.shape)} for {target}")
    return None


def unsupported_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False, *,
                       ndims: Tuple[int, ...] = (3, 4)) -> Optional[str]:
    """Why attn_qat cannot run this attention call (`input_problem`'s reason), or None when it can."""
    problem = input_problem(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, ndims=ndims)
    return None if problem is None else problem.reason


def _prepare_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Accepted operands as the kernels take them: each in its `run_dtype` (float32 outside autocast: bfloat16; the
    output goes back to float32, `_output_dtype`, so that gradients come back in float32 too) with a contiguous last
    dimension (one copy of an operand whose last dimension is strided, cast and copy at once, as PyTorch's SDPA
    copies it)."""
    def prepared(t):
        dtype = run_dtype(t)
        if t.stride(-1) != 1 and t.shape[-1] > 1:  # (`to` with a memory format would return a transposed t as it is)
            return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)
        return t.to(dtype)
    return prepared(q), prepared(k), prepared(v)


def _output_dtype(query) -> Optional[torch.dtype]:
    """The dtype a call's output goes back in, None for the one it runs in: float32 for float32 operands outside
    autocast (under autocast the output is in the autocast dtype, as SDPA's is)."""
    if isinstance(query, torch.Tensor) and query.dtype == torch.float32 and _autocast_dtype(query.device.type) is None:
        return torch.float32
    return None


def _output(out: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return out if out_dtype is None else out.to(out_dtype)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn: str):
    """Checks (B, H, N, D) operands (grouped KV heads allowed) by `input_problem`'s rules, raising its exception,
    and returns them as the kernels take them (`_prepare_operands`)."""
    problem = input_problem(q, k, v, enable_gqa=True, ndims=(4,))
    if problem is not None:
        raise problem.exception(fn)
    return _prepare_operands(q, k, v)


# Additive mask values at or below this count as -inf. Models mask with torch.finfo(dtype).min, which
# overflows to -inf in the fp32 score anyway; a row masked entirely that way is then an empty row
# (output 0, zero gradients) rather than NaN.
MASKED_BELOW = -1e30


def _kernel_mask(attn_mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """An SDPA attn_mask (bool: True = attend, or additive float) that `input_problem` accepted, as the
    kernels' additive float32 mask, expanded (without copying) to (B, H, Nq, Nk)."""
    if attn_mask.dtype == torch.bool:
        additive = torch.zeros(attn_mask.shape, dtype=torch.float32, device=q.device)
        additive = additive.masked_fill(attn_mask.logical_not(), float("-inf"))
    else:
        additive = attn_mask.to(torch.float32)
        additive = additive.masked_fill(additive <= MASKED_BELOW, float("-inf"))
    return additive.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


class _EmptyAttention(torch.autograd.Function):
    """Attention with no batch, head, query or key: zeros of the output's shape (the query's, with the value's head
    dim), as torch's SDPA returns (a query with no key is 0 there and here, numerics.md §6), and zero gradients. The
    ops refuse empty operands."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.zeros_like(t) if need else None for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad))


def _is_empty(q, k, v) -> bool:
    return q.numel() == 0 or k.numel() == 0 or v.numel() == 0


def _run(q, k, v, mask, scale, causal, mode, along_tokens):
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    q, scale = positive_scale(q, scale)
    return ops.attention_forward(q, k, v, mask, scale, causal, mode_code(mode), need_grad, along_tokens)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    mode: str = "attn_qat",
    v_block_axis: str = "auto",
) -> torch.Tensor:
    """Drop-in replacement for `torch.nn.functional.scaled_dot_product_attention` with 4-bit attention.

    query and key (B, H, Nq, D), (B, H_kv, Nk, D), value (B, H_kv, Nk, Dv) (or without the batch dimension), D and
    Dv multiples of 16 from 32 to 256 (the output has Dv), any
    strides (an operand whose last dimension is strided is copied once, as SDPA copies it). bfloat16 or float16
    run as they are. float32 runs in bfloat16 (in the autocast dtype under autocast): the operands are cast at the
    call, the FP4 numerics are those of the 16-bit operands, and outside autocast the output comes back in float32
    and the gradients flow back to the float32 operands (under autocast the output is in the autocast dtype, as
    SDPA's is).
    `is_causal` aligns top-left like SDPA (key j visible to query i iff j <= i). `attn_mask` is bool
    (True = attend) or additive float, broadcastable to (B, H, Nq, Nk). H != H_kv needs
    `enable_gqa=True`, as in SDPA. Dropout is not supported. `mode` picks the numerics (numerics.md §5):
    "attn_qat" (default), "high_precision_p", "low_precision_o", "drop_in" or "bf16" (no quantization).
    `v_block_axis` ("auto", "tokens" or "head_dim") is the axis of V's 16-value blocks (numerics.md §2): "auto"
    blocks along tokens when every query sees every key and along head_dim under `is_causal` or `attn_mask`, so
    that a key a query cannot see changes nothing it computes; "tokens" under a mask lets hidden keys leak.
    """
    fn = "scaled_dot_product_attention"
    problem = input_problem(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if problem is not None:
        raise problem.exception(fn)
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    out_dtype = _output_dtype(query)
    query, key, value = _prepare_operands(query, key, value)
    mode_code(mode)  # a bad mode fails here, empty inputs or not
    along_tokens = v_along_tokens(v_block_axis, is_causal or attn_mask is not None, fn)
    mask = None if attn_mask is None else _kernel_mask(attn_mask, query, key)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else check_softmax_scale(scale, "scale", fn)
    if _is_empty(query, key, value):
        out = _EmptyAttention.apply(query, key, value)
    else:
        out = _run(query, key, value, mask, scale, CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE, mode,
                   along_tokens)[0]
    out = _output(out, out_dtype)
    return out.squeeze(0) if unbatched else out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    layout: str = "bshd",
    mode: str = "attn_qat",
    return_lse: bool = False,
    v_block_axis: str = "auto",
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention-style 4-bit attention.

    `layout="bshd"`: q (B, Nq, H, D), k (B, Nk, H_kv, D), v (B, Nk, H_kv, Dv), output (B, Nq, H, Dv), D and Dv
    multiples of 16 from 32 to 256; `layout="bhsd"`: the heads before the tokens. Grouped KV heads need
    H % H_kv == 0. dtypes (float32 runs in bfloat16 and comes back in float32) and strides as in
    `scaled_dot_product_attention`.
    `causal` aligns bottom-right like FlashAttention (key j visible to query i iff j <= i + Nk - Nq).
    With `return_lse`, also returns the natural-log log-sum-exp of the scores, (B, H, Nq) float32
    (-inf for a row with no visible key); it is not differentiable. `v_block_axis` as in
    `scaled_dot_product_attention`: "auto" blocks V along head_dim when `causal`, along tokens otherwise.
    """
    fn = "attention"
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"attn_qat.{fn}: layout must be 'bshd' or 'bhsd', got {layout!r}")
    mode_code(mode)  # a bad mode or axis fails here, before any work
    along_tokens = v_along_tokens(v_block_axis, causal, fn)
    if layout == "bshd":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"attn_qat.{fn}: {name} must be a 4-D (batch, tokens, heads, head_dim) tensor")
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out_dtype = _output_dtype(q)
    q, k, v = _check_qkv(q, k, v, fn)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else check_softmax_scale(softmax_scale,
                                                                                             "softmax_scale", fn)
    if _is_empty(q, k, v):
        out = _EmptyAttention.apply(q, k, v)
        # no key: the log-sum-exp of nothing, -inf, as for a row that sees no key
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    else:
        out, _, frame, row_sum, *_ = _run(q, k, v, None, scale, CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE, mode,
                                          along_tokens)
        lse = lse_from_stats(frame.detach(), row_sum.detach()) if return_lse else None
    out = _output(out, out_dtype)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def lse_from_stats(frame: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """LSE = ln2 * (M + log2 l) (numerics.md §3); -inf where l == 0."""
    return _LN2 * (frame + torch.log2(row_sum))
