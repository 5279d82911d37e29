"""Building blocks for sequence-parallel (ring / context-parallel) attention on top of
`attn_qat.attention(..., return_lse=True)`."""
from typing import Tuple

import torch


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                           *, layout: str = "bshd") -> Tuple[torch.Tensor, torch.Tensor]:
    """Combines attention over two disjoint sets of keys into attention over their union.

    out_a, out_b: the outputs of `attn_qat.attention` for the same queries over keys A and keys B, in
    `layout` ("bshd": (B, Nq, H, D), or "bhsd"); lse_a, lse_b: their log-sum-exps, (B, H, Nq) float32.
    Returns (out, lse): out = w_a * out_a + w_b * out_b with w_x = exp(lse_x - lse) and
    lse = log(exp(lse_a) + exp(lse_b)), computed in float32; out has the promoted dtype of out_a and out_b,
    so a ring loop that keeps its running output in float32 accumulates in float32. A query that sees no
    key in either part gets out = 0 and lse = -inf (numerics.md §6).

    Folding the parts of a ring one at a time gives attention over all keys: exactly in real arithmetic,
    and for attn_qat's FP4 modes up to the per-call quantization frame (see tests/test_distributed.py), when
    every part blocks V as the whole attention does (`v_block_axis="head_dim"` for every part of a causal
    ring: numerics.md §2) and chunks hold multiples of 16 keys.
    The LSEs carry no gradient (attn_qat returns them detached), so autograd through the merge covers
    out_a and out_b only, not the weights: enough for inference and for checking numerics; a
    context-parallel backward needs the global LSE in each part's backward, which is not built yet.
    """
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"attn_qat.merge_attention_states: layout must be 'bshd' or 'bhsd', got {layout!r}")
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"attn_qat.merge_attention_states: the two parts differ in shape: outputs {tuple(out_a.shape)}"
                         f" and {tuple(out_b.shape)}, LSEs {tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    b, h, n = lse_a.shape
    expected = (b, n, h) if layout == "bshd" else (b, h, n)
    if out_a.dim() != 4 or tuple(out_a.shape[:3]) != expected:
        raise ValueError(f"attn_qat.merge_attention_states: outputs of shape {tuple(out_a.shape)} do not match LSEs of "
                         f"shape {tuple(lse_a.shape)} in layout {layout!r}")
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # Rows with no visible key at all: weights 0 instead of exp(-inf - -inf) = NaN.
    reference = lse.masked_fill(lse == float("-inf"), 0.0)
    w_a, w_b = torch.exp(lse_a - reference), torch.exp(lse_b - reference)
    if layout == "bshd":
        w_a, w_b = w_a.transpose(1, 2), w_b.transpose(1, 2)
    out = w_a.unsqueeze(-1) * out_a.float() + w_b.unsqueeze(-1) * out_b.float()
    return out.to(torch.promote_types(out_a.dtype, out_b.dtype)), lse
