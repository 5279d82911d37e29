"""attn_qat: trainable 4-bit (NVFP4) attention for PyTorch (Attn-QAT, arXiv 2603.00040).

    import attn_qat
    out = attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True)   # like F.sdpa
    out = attn_qat.attention(q, k, v, causal=True, layout="bshd")          # like flash_attn_func
    out = attn_qat.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,   # like flash_attn_varlen_func
                                    max_seqlen_q, max_seqlen_k, causal=True)

The numerics are fixed by docs/numerics.md; `attn_qat.reference` is their float64 executable form.
"""
from . import nvfp4, ops
from .attention import SUPPORTED_HEAD_DIMS, attention, scaled_dot_product_attention
from .integrations import (AttnQATFallbackWarning, QATConfig, SensitivityReport, WanAttnQATProcessor,
                           all_reduce_gradients, attention_report, calibrate_k_shift, convert,
                           disable, enable, learned_qk_parameters, merge_attention_states, patch_sdpa,
                           plan_precision, prepare, register_diffusers_backend, register_transformers,
                           reset_diffusers_backend, sensitivity, ulysses_attention, ulysses_wan)
from .kv_cache import NVFP4KVCache
from .nvfp4 import NVFP4Tensor, dequantize, fake_quantize, fake_quantize_qkv, quantize
from .ops import MODES
from .prefill import nvfp4_attention, quantize_qkv
from .varlen import attention_varlen

__version__ = "0.1.0"

__all__ = [
    "MODES", "NVFP4KVCache", "NVFP4Tensor", "SUPPORTED_HEAD_DIMS", "attention", "attention_varlen", "dequantize",
    "fake_quantize", "fake_quantize_qkv", "nvfp4", "nvfp4_attention", "ops", "quantize", "quantize_qkv",
    "scaled_dot_product_attention",
    # integrations (docs/integrations.md)
    "AttnQATFallbackWarning", "QATConfig", "SensitivityReport", "WanAttnQATProcessor", "all_reduce_gradients",
    "attention_report", "calibrate_k_shift", "convert", "disable", "enable", "learned_qk_parameters",
    "merge_attention_states", "patch_sdpa", "plan_precision", "prepare", "register_diffusers_backend",
    "register_transformers", "reset_diffusers_backend",
    "sensitivity", "ulysses_attention", "ulysses_wan",
]


def __getattr__(name):
    # NVFP4Cache (docs/integrations.md) subclasses transformers' Cache, so transformers is imported only when it
    # is first used; for the same reason it is not in __all__.
    if name == "NVFP4Cache":
        from .integrations.kv_cache_transformers import NVFP4Cache
        return NVFP4Cache
    raise AttributeError(f"module 'attn_qat' has no attribute {name!r}")
