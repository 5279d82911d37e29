"""Attention on packed NVFP4 operands: the prefill of a model served in NVFP4.

    qp, kp, vp = attn_qat.quantize_qkv(q, k, v, causal=True)  # NVFP4Tensors: Q, K and (causal) V along D
    out = attn_qat.nvfp4_attention(qp, kp, vp, causal=True)    # == attention(q, k, v, causal=True) under no_grad

`nvfp4_attention` takes each of Q, K, V either packed (an `NVFP4Tensor` blocked as numerics.md §2
says: Q and K along head_dim, V along head_dim for causal attention and along tokens otherwise) or as a
bf16/fp16 tensor that it quantizes the same way, and returns the inference output of numerics.md §3:
exactly what `attn_qat.attention(..., mode="attn_qat")` returns under no_grad for the tensors the packed
operands stand for. Packing once
and attending many times is the point: a served model keeps K and V (and a diffusion model its
cross-attention K/V across steps) at 4.5 bits per value instead of 16.

The packed operands are dequantized to bf16/fp16 here and the forward kernel runs on them without
its quantizing pre-pass (the `attention_forward_prequantized` op): running the pre-pass again on
already-quantized values would NOT give them back in general (a block whose largest code is below 6,
e.g. with a subnormal E4M3 scale, gets a different scale the second time). So today the packed path
reads bf16-sized operands and allocates them for the call (the dequantization costs less than the bf16-input
forward's quantizing pre-pass, so this path is the faster of the two: benchmarks/RESULTS.md); a kernel that
dequantizes the codes in shared memory would read a quarter of the bytes, with the same API and numerics.
"""
import math
from typing import Optional, Tuple, Union

import torch

from . import _C
from .attention import SUPPORTED_HEAD_DIMS, attention
from .nvfp4 import BLOCK, NVFP4Tensor, dequantize, fake_quantize, quantize
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, ops, positive_scale, v_along_tokens

_DTYPES = (torch.bfloat16, torch.float16)
Operand = Union[torch.Tensor, NVFP4Tensor]


def _axes(layout: str, fn: str) -> Tuple[int, int]:
    """(token axis, head_dim axis) of a 4-D operand in `layout`."""
    if layout == "bshd":
        return 1, 3
    if layout == "bhsd":
        return 2, 3
    raise ValueError(f"attn_qat.{fn}: layout must be 'bshd' or 'bhsd', got {layout!r}")


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str = "bshd", causal: bool = False,
                 v_block_axis: str = "auto") -> Tuple[NVFP4Tensor, NVFP4Tensor, NVFP4Tensor]:
    """Packs attention operands as numerics.md §2 blocks them for attention that is `causal` or not: Q and K
    along head_dim, V along head_dim for causal attention and along tokens otherwise (its last block partial
    when the token count is not a multiple of 16); `v_block_axis` "tokens" or "head_dim" forces V's axis. The
    inputs' shapes and `layout` ("bshd": (batch, tokens, heads, head_dim); "bhsd": heads first) carry over to
    the NVFP4Tensors, ready for `nvfp4_attention` with the same `causal`. Not differentiable."""
    fn = "quantize_qkv"
    tokens, dim = _axes(layout, fn)
    along_tokens = v_along_tokens(v_block_axis, causal, fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"attn_qat.{fn}: {name} must be a 4-D tensor in layout {layout!r}")
    vp = quantize(v, block_axis=tokens, partial_last_block=True) if along_tokens else quantize(v, block_axis=dim)
    return quantize(q, block_axis=dim), quantize(k, block_axis=dim), vp


def _check_operand(name: str, t: Operand, block_axis: int, layout: str, fn: str, why: str = ""):
    """Metadata checks common to packed and plain operands; returns (shape, dtype, device)."""
    if isinstance(t, NVFP4Tensor):
        shape, dtype = tuple(t.shape), t.dtype
        if len(shape) != 4:
            raise ValueError(f"attn_qat.{fn}: {name} must be 4-D in layout {layout!r}, got shape {shape}")
        if t.block_axis != block_axis:
            along = "head_dim" if block_axis == 3 else "tokens"
            raise ValueError(f"attn_qat.{fn}: the packed {name} must be blocked along {along}{why} (block_axis "
                             f"{block_axis} in layout {layout!r}, numerics.md §2), got block_axis {t.block_axis}; "
                             "pack it with attn_qat.quantize_qkv and the same causal and v_block_axis")
        if dtype not in _DTYPES:
            raise TypeError(f"attn_qat.{fn}: the packed {name} stands for a {dtype} tensor; attention runs in "
                            "bfloat16 or float16, so quantize a bfloat16 or float16 tensor")
        return shape, dtype, t.device
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"attn_qat.{fn}: {name} must be a torch.Tensor or an attn_qat.NVFP4Tensor, got "
                        f"{type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"attn_qat.{fn}: {name} must be 4-D in layout {layout!r}, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"attn_qat.{fn}: {name} must be bfloat16 or float16, got {t.dtype}")
    return tuple(t.shape), t.dtype, t.device


def nvfp4_attention(q: Operand, k: Operand, v: Operand, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, layout: str = "bshd",
                    v_block_axis: str = "auto") -> torch.Tensor:
    """4-bit attention inference on packed NVFP4 operands (or bf16/fp16 ones, quantized here).

    `layout="bshd"`: q (B, Nq, H, D), k (B, Nk, H_kv, D), v (B, Nk, H_kv, Dv), output (B, Nq, H, Dv); `"bhsd"`:
    the heads before the tokens. Each of q, k, v is an `NVFP4Tensor` of that logical shape, Q and K blocked
    along D (block_axis 3), V along D when `causal` and along tokens otherwise (block_axis 1 in "bshd",
    2 in "bhsd"; `v_block_axis` "tokens" or "head_dim" forces one), as `quantize_qkv(..., causal=causal)`
    packs them, or a bfloat16/float16 tensor. All must stand for one dtype, which the output has. D in
    a multiple of 16 from 32 to 256, V's may differ from Q's and K's; grouped KV heads need H % H_kv == 0;
    `causal` aligns bottom-right like `attn_qat.attention`.
    The result equals `attn_qat.attention(q, k, v, causal=causal, mode="attn_qat")` under no_grad on the
    unpacked inputs (numerics.md §3); it carries no gradient (train with `attention`).
    """
    fn = "nvfp4_attention"
    tokens_axis, dim_axis = _axes(layout, fn)
    along_tokens = v_along_tokens(v_block_axis, causal, fn)
    v_axis = tokens_axis if along_tokens else dim_axis
    why = "" if v_block_axis != "auto" else (" for causal attention" if causal else " for attention without causal")
    (qs, qt, qd), (ks, kt, kd), (vs, vt, vd) = (
        _check_operand("q", q, dim_axis, layout, fn), _check_operand("k", k, dim_axis, layout, fn),
        _check_operand("v", v, v_axis, layout, fn, why))
    if not (qt == kt == vt):
        raise TypeError(f"attn_qat.{fn}: q, k and v must stand for one dtype; got {qt}, {kt}, {vt}")
    if not (qd == kd == vd):
        raise ValueError(f"attn_qat.{fn}: q, k and v must be on one device; got {qd}, {kd}, {vd}")
    heads_axis = 2 if layout == "bshd" else 1
    d = qs[dim_axis]
    if d not in SUPPORTED_HEAD_DIMS or vs[dim_axis] not in SUPPORTED_HEAD_DIMS or ks[dim_axis] != d:
        raise ValueError(f"attn_qat.{fn}: head_dim must be {_C.HEAD_DIMS_TEXT}, shared by q and k (v's may differ); "
                         f"got {qs[dim_axis]}, {ks[dim_axis]}, {vs[dim_axis]}")
    if ks[:dim_axis] + ks[dim_axis + 1:] != vs[:dim_axis] + vs[dim_axis + 1:]:
        raise ValueError(f"attn_qat.{fn}: k and v must have one shape but for head_dim, got {ks} and {vs}")
    if qs[0] != ks[0]:
        raise ValueError(f"attn_qat.{fn}: batch sizes differ: {qs[0]} and {ks[0]}")
    if qs[heads_axis] % ks[heads_axis]:
        raise ValueError(f"attn_qat.{fn}: query heads ({qs[heads_axis]}) must be a multiple of key/value heads "
                         f"({ks[heads_axis]})")
    if min(qs) == 0 or min(ks) == 0:
        raise ValueError(f"attn_qat.{fn}: empty operand (q {qs}, k {ks})")
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)

    if not any(isinstance(t, NVFP4Tensor) for t in (q, k, v)):
        # Nothing packed: the fused pre-pass quantizes, exactly as the training forward does.
        with torch.no_grad():
            return attention(q, k, v, causal=causal, softmax_scale=scale, layout=layout, mode="attn_qat",
                             v_block_axis=v_block_axis)

    with torch.no_grad():
        qf = dequantize(q) if isinstance(q, NVFP4Tensor) else fake_quantize(q, dim_axis)
        kf = dequantize(k) if isinstance(k, NVFP4Tensor) else fake_quantize(k, dim_axis)
        vf = dequantize(v) if isinstance(v, NVFP4Tensor) else fake_quantize(v, v_axis, partial_last_block=along_tokens)
        if layout == "bshd":  # (B, H, S, D) views of (B, S, H, D) memory, which the kernels take as they are
            qf, kf, vf = qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2)
        out = attention_prequantized(qf, kf, vf, scale, causal)
    return out.transpose(1, 2) if layout == "bshd" else out


def attention_prequantized(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, scale: float,
                           causal: bool) -> torch.Tensor:
    """The §3 inference forward on operands that already hold FP4 values (Q^F, K^F, V^F as bf16/fp16,
    (B, H, S, D) with any strides and a contiguous last dim): P is quantized, Q, K, V are not touched.
    Causal aligns bottom-right. Output (B, Hq, Nq, Dv) in the layout of qf."""
    qf, scale = positive_scale(qf, scale)
    return ops.attention_forward_prequantized(qf, kf, vf, None, scale,
                                              CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE)[0]


def packed_bytes(shape, block_axis: int) -> int:
    """Bytes of an NVFP4Tensor of `shape` blocked along `block_axis`: half a byte per code, one E4M3
    scale per 16 elements (partial last block included)."""
    n = shape[block_axis]
    rest = math.prod(shape) // n
    return rest * ((n + 1) // 2 + (n + BLOCK - 1) // BLOCK)
