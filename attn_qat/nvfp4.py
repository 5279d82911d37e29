"""The NVFP4 format (numerics.md §1): 16-element blocks of FP4 E2M1 codes with one E4M3 scale each.

`quantize` packs a tensor into an `NVFP4Tensor` (two codes per byte, element 2k in the low nibble),
`dequantize` unpacks it, and `fake_quantize` does both at once, returning the values the FP4 tensor
stands for in the input's dtype (exactly representable in bf16 and fp16). CPU and CUDA kernels give
bit-identical results. A block containing NaN or Inf gets a NaN scale, so it dequantizes to NaN.
"""
from dataclasses import dataclass

import torch

from .ops import ops, v_along_tokens

BLOCK = 16
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_input(x: torch.Tensor, block_axis: int, what: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"attn_qat.{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"attn_qat.{what}: dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"attn_qat.{what}: cannot quantize a 0-dimensional tensor")
    if not -x.dim() <= block_axis < x.dim():
        raise IndexError(f"attn_qat.{what}: block_axis {block_axis} out of range for a {x.dim()}-D tensor")
    return block_axis % x.dim()


@dataclass
class NVFP4Tensor:
    """A tensor in NVFP4: `codes` (uint8, two E2M1 codes per byte along `block_axis`), `scales`
    (float8_e4m3fn, one per 16 elements along `block_axis`), the logical `shape`, and the `dtype`
    that `dequantize` returns by default (the quantized tensor's)."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    block_axis: int
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = None) -> torch.Tensor:
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return (f"NVFP4Tensor(shape={tuple(self.shape)}, block_axis={self.block_axis}, dtype={self.dtype}, "
                f"device={self.device})")


def quantize(x: torch.Tensor, block_axis: int = -1, *, partial_last_block: bool = False) -> NVFP4Tensor:
    """Quantize `x` to NVFP4 in blocks of 16 consecutive elements along `block_axis`, whose length
    must be a multiple of 16 unless `partial_last_block` (then the last block holds only the valid
    elements, as V's token blocks do, numerics.md §2). Any strides; float32, bfloat16 or float16; CPU or CUDA."""
    axis = _check_input(x, block_axis, "quantize")
    if x.shape[axis] % BLOCK and not partial_last_block:
        raise ValueError(f"attn_qat.quantize: the block axis has {x.shape[axis]} elements, not a multiple of "
                         f"{BLOCK}; pad it, or pass partial_last_block=True to end in a shorter block")
    codes, scales = ops.nvfp4_quantize(x.detach(), axis)
    return NVFP4Tensor(codes, scales, x.shape, axis, x.dtype)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = None) -> torch.Tensor:
    """The values an NVFP4Tensor stands for, as a contiguous tensor of `dtype` (default: t.dtype)."""
    dtype = t.dtype if dtype is None else dtype
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"attn_qat.dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    return ops.nvfp4_dequantize(t.codes, t.scales, t.block_axis, t.shape[t.block_axis], dtype)


def fake_quantize(x: torch.Tensor, block_axis: int = -1, *, partial_last_block: bool = False) -> torch.Tensor:
    """Quantize-dequantize `x` (same shape and dtype, contiguous). Differentiable with the
    straight-through estimator (the gradient passes unchanged). With `partial_last_block`, a block
    axis that is not a multiple of 16 ends in a shorter block holding only the valid elements."""
    axis = _check_input(x, block_axis, "fake_quantize")
    if x.shape[axis] % BLOCK and not partial_last_block:
        raise ValueError(f"attn_qat.fake_quantize: the block axis has {x.shape[axis]} elements, not a multiple "
                         f"of {BLOCK}; pass partial_last_block=True to end in a shorter block")
    return ops.nvfp4_fake_quantize(x, axis)


def fake_quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      v_block_axis: str = "auto"):
    """The attention pre-pass of numerics.md §2 on (batch, heads, tokens, head_dim) tensors: Q and K
    blocked along head_dim, V along tokens (its last block partial when tokens % 16 != 0) for attention
    in which every query sees every key, along head_dim when `causal` (pass it for any attention that
    hides keys from a query: causal or masked); `v_block_axis` "tokens" or "head_dim" forces V's axis.
    Outputs keep each input's memory layout; the gradient is passed straight through."""
    along_tokens = v_along_tokens(v_block_axis, causal, "fake_quantize_qkv")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_input(t, -1, "fake_quantize_qkv")
        if t.dim() != 4:
            raise ValueError(f"attn_qat.fake_quantize_qkv: {name} must be 4-D (batch, heads, tokens, head_dim)")
    return ops.fake_quantize_qkv(q, k, v, along_tokens)
