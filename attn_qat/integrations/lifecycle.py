"""The model lifecycle, after torchao's quantize-aware training flow: `prepare` installs FP4 attention,
the model trains, `convert` switches it to inference; `disable` / `enable` toggle it in between."""
from typing import Optional

import torch

from .config import QATConfig, module_state
from .models import FilterFn, is_diffusers_model, is_transformers_model, unwrap_peft
from .qk_transforms import LearnedQK
from .report import report_prepared


def prepare(model: torch.nn.Module, config: Optional[QATConfig] = None,
            filter_fn: Optional[FilterFn] = None) -> torch.nn.Module:
    """Installs attn_qat attention in a supported model, in place, and returns the model.

    - transformers `PreTrainedModel` (every model built on the AttentionInterface): registers the
      "attn_qat" attention implementation and switches the model to it.
    - diffusers Wan transformer (`WanTransformer3DModel`, anything holding `WanAttention` modules):
      installs `WanAttnQATProcessor` on the selected attention modules.

    `config.self_attention` / `config.cross_attention` pick the kinds of attention converted;
    `filter_fn(module, fully_qualified_name) -> bool` (torchao's convention) narrows the choice further.
    Modules left out keep the library's own attention (transformers' "sdpa", Wan's original processor).
    A PEFT `PeftModel` (`get_peft_model(model, LoraConfig(...))`) is prepared through the model it wraps;
    `filter_fn` still sees names in the PeftModel, and the lifecycle functions below take it too.
    `config.bf16_modules` keeps the attention modules it names (as `model.named_modules()` names them) in bf16, in
    training and inference; the plan is saved in the state dict (a marker buffer on each kept module).
    Calling `prepare` again replaces the configuration. For any other model, wrap the forward in
    `attn_qat.patch_sdpa`.

    It logs a per-module summary (logger "attn_qat", INFO) and warns (`AttnQATFallbackWarning`, naming the modules)
    when a selected module's shapes (its head_dim, say) are ones attn_qat does not take, so its calls will fall back;
    `attn_qat.attention_report(model)` tells, per module, that and how its calls ran since.
    """
    config = config if config is not None else QATConfig()
    warned = set()
    # config.bf16_modules names modules as `model` does; a PeftModel's names carry the path to the model it wraps
    base, base_filter_fn, prefix = unwrap_peft(model, filter_fn)
    if is_transformers_model(base):
        from .transformers import prepare_transformers
        prepare_transformers(base, config, base_filter_fn, warned, prefix)
    elif is_diffusers_model(base):
        from .diffusers import prepare_diffusers
        prepare_diffusers(base, config, base_filter_fn, warned, prefix)
    else:
        what = type(model).__name__ if base is model else f"{type(model).__name__} wraps a {type(base).__name__}, which"
        raise TypeError(f"attn_qat.prepare: {what} is neither a transformers PreTrainedModel nor a "
                        "diffusers model (for a pipeline, pass pipe.transformer); for other models wrap the forward "
                        "in `with attn_qat.patch_sdpa(config):`")
    report_prepared(model)
    return model


def _states(model: torch.nn.Module, fn: str):
    states = [s for s in (module_state(m) for m in model.modules()) if s is not None and s.selected]
    if not states:
        raise ValueError(f"attn_qat.{fn}: {type(model).__name__} has no attention prepared by attn_qat.prepare")
    return states


def convert(model: torch.nn.Module) -> torch.nn.Module:
    """Switches a prepared (and trained) model's attention to the inference path, in place; returns it.

    Inference runs the forward of numerics.md §3 without autograd: every FP4 training mode shares that
    forward, so the mode becomes "attn_qat" ("bf16" stays "bf16"); O' is not computed and nothing is
    saved for a backward. Today that is the training kernels' forward under no_grad, exactly what the
    model computed in training; a real NVFP4 inference kernel will replace it here without a change to
    user code. The converted attention has no gradient (a forward with grad enabled warns once).
    `convert` does not touch train/eval mode, weights or anything outside attention. Learned Q/K rotations are
    kept from their next computation on (`LearnedQK.freeze`; preparing again trains them again).
    """
    for state in _states(model, "convert"):
        state.inference = True
    for module in model.modules():
        if isinstance(module, LearnedQK):
            module.freeze()
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Runs the prepared attention modules with the library's own attention again (transformers' "sdpa",
    Wan's original processor) until `enable`; returns the model. Under torch.compile the switch is read
    while tracing, so toggling recompiles the affected graphs."""
    for state in _states(model, "disable"):
        state.enabled = False
    return model


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes `disable`: the prepared attention modules run attn_qat again; returns the model."""
    for state in _states(model, "enable"):
        state.enabled = True
    return model


def attention_states(model: torch.nn.Module) -> dict:
    """{module name: AttentionState} for the modules `prepare` configured (selected or not), to inspect."""
    return {name: state for name, m in model.named_modules() if (state := module_state(m)) is not None}

