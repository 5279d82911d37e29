"""Which attention modules of a prepared model run attn_qat and which fall back, so that no module of a model whose
attention attn_qat cannot take trains outside FP4 unnoticed.

Two views, both per module: what `prepare` can tell from the module's shapes (`static_fallback`: the input rules on
meta tensors of its heads and head dims, so a head_dim the kernels lack is known before any call), and how its calls
ran (`AttentionRecord.calls`, counted by the integrations). `prepare` logs the first and warns with an
`AttnQATFallbackWarning` naming the modules whose calls will fall back; `attention_report(model)` returns both.
"""
import dataclasses
import logging
import warnings
from typing import Dict, List, Optional

import torch

from ..attention import unsupported_reason
from .config import AttnQATFallbackWarning, module_state
from .routing import FALLBACK, fallback_outcome

logger = logging.getLogger("attn_qat")

# The tokens of the stand-in call: any count the kernels take; the rules that depend on it are not about shapes.
_PROBE_TOKENS = 16


def static_fallback(heads_q, heads_kv, head_dim_qk, head_dim_v=None) -> Optional[str]:
    """Why every call of an attention module of these shapes will fall back (the reason the input rules give for a
    bfloat16 call of them), or None when attn_qat takes them or a shape is unknown (not a positive int)."""
    head_dim_v = head_dim_qk if head_dim_v is None else head_dim_v
    shapes = (heads_q, heads_kv, head_dim_qk, head_dim_v)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shapes):
        return None
    probe = lambda heads, dim: torch.empty(1, heads, _PROBE_TOKENS, dim, device="meta",  # noqa: E731
                                           dtype=torch.bfloat16)
    return unsupported_reason(probe(heads_q, head_dim_qk), probe(heads_kv, head_dim_qk), probe(heads_kv, head_dim_v),
                              enable_gqa=heads_q != heads_kv)


@dataclasses.dataclass
class ModuleReport:
    """One attention module `prepare` saw: `status` is "attn_qat" (selected, its shapes supported or unknown),
    "fallback: <reason>" (selected, but its shapes fall back), "left out" (filter_fn or the self/cross choice),
    "disabled" (`attn_qat.disable`), "kept bf16" (`QATConfig.bf16_modules`) or "converted" (`attn_qat.convert`);
    `calls` counts its eager calls per outcome: "fp4", "bf16" (mode "bf16"), "fallback: <reason>", "disabled"."""

    name: str
    status: str
    calls: Dict[str, int]

    @property
    def fallback_reasons(self) -> List[str]:
        """Why the module's calls fall back: known from its shapes, or met in a call (sorted; empty if they don't)."""
        outcomes = [self.status, *self.calls]
        return sorted({o[len(FALLBACK):] for o in outcomes if o.startswith(FALLBACK)})


@dataclasses.dataclass
class AttentionReport:
    """`attention_report(model)`: a ModuleReport per attention module `prepare` saw, in module order."""

    modules: List[ModuleReport]

    @property
    def fallbacks(self) -> Dict[str, List[str]]:
        """{module name: the reasons its calls fall back} for the modules that do (or will)."""
        return {m.name: m.fallback_reasons for m in self.modules if m.fallback_reasons}

    def __str__(self) -> str:
        lines = [f"attn_qat: {len(self.modules)} attention modules, "
                 f"{sum(m.status == 'attn_qat' for m in self.modules)} on attn_qat, "
                 f"{sum(m.status == 'kept bf16' for m in self.modules)} kept in bf16, "
                 f"{len(self.fallbacks)} falling back"]
        for m in self.modules:
            calls = ", ".join(f"{outcome} x{n}" for outcome, n in m.calls.items())
            lines.append(f"  {m.name}: {m.status}" + (f"; calls: {calls}" if calls else ""))
        return "\n".join(lines)


def attention_report(model: torch.nn.Module) -> AttentionReport:
    """Per attention module of a model `attn_qat.prepare` prepared: whether it runs attn_qat or falls back and why
    (from its shapes, at prepare), and how its calls ran since (FP4, or fallback with the reason, counted per eager
    call; not inside torch.compile graphs). `print(attn_qat.attention_report(model))` shows a table; `.fallbacks` maps the names
    of the modules that fall back to their reasons."""
    modules = []
    for name, module in model.named_modules():
        state = module_state(module)
        if state is None:
            continue
        if not state.selected:
            status = "left out"
        elif state.record.static_fallback is not None:
            status = fallback_outcome(state.record.static_fallback)
        elif not state.enabled:
            status = "disabled"
        elif state.kept_bf16:
            status = "kept bf16"
        else:
            status = "converted" if state.inference else "attn_qat"
        modules.append(ModuleReport(name, status, dict(state.record.calls)))
    if not modules:
        raise ValueError(f"attn_qat.attention_report: {type(model).__name__} has no attention prepared by "
                         "attn_qat.prepare")
    return AttentionReport(modules)


def _names(names: List[str], shown: int = 4) -> str:
    listed = ", ".join(names[:shown])
    return listed if len(names) <= shown else f"{listed} and {len(names) - shown} more"


def report_prepared(model: torch.nn.Module) -> AttentionReport:
    """What `prepare` says about the model it prepared: names each module's record, logs the report (INFO), and
    warns once per reason (an `AttnQATFallbackWarning`) naming the modules whose shapes fall back."""
    for name, module in model.named_modules():
        state = module_state(module)
        if state is not None:
            state.record.name = name
    report = attention_report(model)
    logger.info("%s", report)
    by_reason: Dict[str, List[str]] = {}
    for m in report.modules:
        if m.status.startswith(FALLBACK):
            by_reason.setdefault(m.status[len(FALLBACK):], []).append(m.name)
    selected = sum(m.status != "left out" for m in report.modules)
    for reason, names in by_reason.items():
        warnings.warn(f"attn_qat.prepare: {len(names)} of {selected} selected attention modules cannot run attn_qat "
                      f"(their calls fall back to the library's attention, nothing trains in FP4 there; under "
                      f"strict=True they raise): {reason}: {_names(names)}; attn_qat.attention_report(model) tells "
                      "how each module's calls ran", AttnQATFallbackWarning, stacklevel=3)
    return report
