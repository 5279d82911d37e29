"""Which library a model comes from, and the model a PEFT wrapper holds: what `prepare` and the calibration both
ask of a model before they walk its attention modules."""
import sys
from typing import Callable, Optional

import torch

FilterFn = Callable[[torch.nn.Module, str], bool]


def is_transformers_model(model: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def is_diffusers_model(model: torch.nn.Module) -> bool:
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(model, diffusers.ModelMixin)


def unwrap_peft(model: torch.nn.Module, filter_fn: Optional[FilterFn]):
    """(base, filter_fn, prefix): the model a PEFT `PeftModel` wraps (`get_base_model()`: for LoRA, the transformers
    or diffusers model whose linear layers carry the adapters), `filter_fn` adapted so that it still sees names in
    `model`, and what names in `model` carry before the base model's ("" or ending in ".")."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return model, filter_fn, ""
    base = model.get_base_model()
    prefix = next(name for name, module in model.named_modules() if module is base)
    dotted = prefix + "." if prefix else ""
    if filter_fn is None or not prefix:
        return base, filter_fn, dotted
    return base, lambda module, name: filter_fn(module, f"{prefix}.{name}" if name else prefix), dotted
