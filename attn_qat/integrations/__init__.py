"""Model integrations: a config and lifecycle (`prepare`, `convert`, `enable`, `disable`), a drop-in
patch of `torch.nn.functional.scaled_dot_product_attention`, transformers' "attn_qat" attention
implementation, a diffusers Wan processor and backend, ring-attention merging and Ulysses sequence
parallelism.

transformers and diffusers are imported only when an integration for them is used. See
docs/integrations.md.
"""
from .config import AttentionState, AttnQATFallbackWarning, QATConfig
from .diffusers import WanAttnQATProcessor, register_diffusers_backend, reset_diffusers_backend
from .distributed import merge_attention_states
from .lifecycle import attention_states, convert, disable, enable, prepare
from .sdpa_patch import patch_sdpa
from .sequence_parallel import all_reduce_gradients, ulysses_attention, ulysses_wan
from .qk_transforms import calibrate_k_shift, learned_qk_parameters
from .report import AttentionReport, ModuleReport, attention_report
from .sensitivity_map import SensitivityReport, plan_precision, sensitivity
from .transformers import register_transformers

__all__ = [
    "AttentionReport", "AttentionState", "AttnQATFallbackWarning", "ModuleReport", "QATConfig", "WanAttnQATProcessor",
    "all_reduce_gradients", "attention_report", "attention_states", "calibrate_k_shift", "convert", "disable",
    "enable", "learned_qk_parameters", "merge_attention_states", "patch_sdpa", "plan_precision", "prepare",
    "register_diffusers_backend", "register_transformers", "reset_diffusers_backend", "SensitivityReport",
    "sensitivity", "ulysses_attention", "ulysses_wan",
]
