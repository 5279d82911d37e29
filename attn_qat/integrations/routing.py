"""One routine that runs an SDPA-shaped call through attn_qat or, for inputs attn_qat does not take, through
PyTorch's SDPA with a warning (or an error under `strict`); every integration calls it."""
import threading
import warnings
from typing import Optional, Set

import torch

# unsupported_reason: the input rules attn_qat.scaled_dot_product_attention raises from; here they decide fallbacks
from ..attention import scaled_dot_product_attention, unsupported_reason  # noqa: F401 (unsupported_reason re-exported)
from . import sequence_parallel
from .config import AttentionRecord, AttnQATFallbackWarning, QATConfig


# Per thread: how many fallbacks to PyTorch's SDPA are running, during which `patch_sdpa` lets the call through.
_fallbacks = threading.local()


def passing_through() -> bool:
    """Whether a fallback to PyTorch's SDPA runs on this thread now (`patch_sdpa` must not intercept it)."""
    return getattr(_fallbacks, "depth", 0) > 0


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """PyTorch's SDPA (`torch.nn.functional.scaled_dot_product_attention` as installed now), past every
    `patch_sdpa` active on this thread, so that a fallback never re-enters attn_qat; other torch function modes
    still see the call."""
    _fallbacks.depth = getattr(_fallbacks, "depth", 0) + 1
    try:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                                dropout_p=dropout_p, is_causal=is_causal,
                                                                scale=scale, enable_gqa=enable_gqa)
    finally:
        _fallbacks.depth -= 1


@torch.compiler.disable
def warn_once(message: str, warned: Set[str], category=AttnQATFallbackWarning, detail: str = "") -> None:
    """Warns once per distinct message per `warned` set (one set per patch_sdpa context, per prepared
    model); `detail` (the module that met it first) is added to the warning, not to what makes it distinct. Kept
    out of torch.compile graphs: it runs eagerly at every call, so the once-only bookkeeping holds in compiled code
    too. (Python's default warning filter may further show an identical message only once per process.)"""
    if message not in warned:
        warned.add(message)
        warnings.warn(f"attn_qat: {message}{detail}", category, stacklevel=3)


def fallback_detail(record: Optional[AttentionRecord]) -> str:
    """What a fallback warning adds about the module it came from: its name, and where to see the others."""
    if record is None or record.name is None:
        return ""
    return f" (first in {record.name}; attn_qat.attention_report(model) lists how every module's calls ran)"


def count_call(record: Optional[AttentionRecord], outcome: str) -> None:
    if record is not None:
        record.count(outcome)


FALLBACK = "fallback: "  # how the outcome of a call that fell back starts, the reason after it


def fallback_outcome(reason: str) -> str:
    return f"{FALLBACK}{reason}"


def attn_qat_outcome(mode: str) -> str:
    """The outcome a call that attn_qat ran is counted under: "fp4", or "bf16" for the unquantized mode."""
    return "bf16" if mode == "bf16" else "fp4"


def inference_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, mode, warned, v_block_axis="auto"):
    """The attention of a module that `convert` switched to inference.

    Today this is the training kernels' forward without autograd (no O', numerics.md §5 "inference").
    It is the single place where a real NVFP4 inference kernel will slot in. A converted attention is
    not differentiable: when a gradient was wanted, that is said once rather than silently dropped.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        warn_once("this attention was converted for inference (attn_qat.convert); its output carries no "
                  "gradient", warned, UserWarning)
    with torch.no_grad():
        return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                            scale=scale, enable_gqa=enable_gqa, mode=mode, v_block_axis=v_block_axis)


def run_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, config: QATConfig,
             warned: Set[str], inference: bool = False, where: str = "attn_qat",
             v_block_axis: Optional[str] = None, record: Optional[AttentionRecord] = None) -> torch.Tensor:
    """One SDPA-shaped call (torch's argument conventions, top-left causal) through attn_qat, or through
    PyTorch's SDPA when attn_qat does not support it: a warning once per reason, or, with
    `config.strict`, a `NotImplementedError` naming the reason. `v_block_axis` (default: the config's) lets an
    integration that knows the model is causal keep V blocked along head_dim in calls that hide no key.
    `record` (the module's, when an integration knows the module) counts how the call ran, and names the module in
    the warning. Inside a module that `ulysses_wan` runs sequence-parallel, the call goes through its all-to-all
    first."""
    ulysses = sequence_parallel.current()
    if ulysses is not None:
        return ulysses.sdpa(run_sdpa, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            config=config, warned=warned, inference=inference, where=where, v_block_axis=v_block_axis,
                            record=record)
    v_block_axis = config.v_block_axis if v_block_axis is None else v_block_axis
    reason = unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        if config.strict:
            raise NotImplementedError(f"{where}: {reason} (strict=True forbids falling back to PyTorch SDPA)")
        count_call(record, fallback_outcome(reason))
        warn_once(f"falling back to PyTorch scaled_dot_product_attention: {reason}", warned,
                  detail=fallback_detail(record))
        return torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    if inference:
        count_call(record, attn_qat_outcome(config.inference_mode))
        return inference_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                   config.inference_mode, warned, v_block_axis)
    count_call(record, attn_qat_outcome(config.mode))
    return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                        enable_gqa=enable_gqa, mode=config.mode, v_block_axis=v_block_axis)
