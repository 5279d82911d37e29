"""diffusers integration: an attention processor for Wan's `WanAttention`, and an "attn_qat" attention
backend for diffusers' dispatcher. Needs diffusers >= 0.35; tested with 0.35.0, 0.35.2 and 0.42.1.

Both go through diffusers' attention dispatcher (`dispatch_attention_fn`), to which attn_qat adds the "attn_qat"
backend; diffusers has no public way to add one, so this extends its private backend enum and registry (see
`_register_backend`). `prepare` installs `WanAttnQATProcessor` on the selected `WanAttention` modules through the
public `set_processor`: it runs diffusers' own `WanAttnProcessor` with its attention sent to that backend, and keeps
per-module state, so the self/cross choice, `enable`/`disable` and `convert` work. `register_diffusers_backend()`
makes `model.set_attention_backend("attn_qat")` work for every diffusers model that dispatches through
`dispatch_attention_fn`; `model.reset_attention_backend()` (which attn_qat wraps, `_wrap_reset_attention_backend`),
`model.set_attention_backend("native")` or `reset_diffusers_backend()` give the process-wide active backend back.
"""
import functools
import threading
from typing import Optional

import torch

from . import qk_transforms
from .config import (DIFFUSERS_MIN, AttentionState, QATConfig, install_state, module_state, plan_states,
                     require_version)
from .report import static_fallback
from .routing import run_sdpa, torch_sdpa

BACKEND = "attn_qat"


class _ProcessorCall:
    """A `WanAttnQATProcessor` call running on this thread: the module and its state, for the backend function
    (diffusers' dispatcher passes a backend only the attention's arguments), and how many attentions it dispatched."""

    def __init__(self, state: "AttentionState", module: torch.nn.Module):
        self.state, self.module, self.dispatched = state, module, 0


# Per thread: the WanAttnQATProcessor calls running, innermost last.
_processor_calls = threading.local()


class WanAttnQATProcessor:
    """Attention processor for diffusers' `WanAttention` (Wan 2.1/2.2 self- and cross-attention, with the
    I2V image-token branch) computing attention with attn_qat.

    It runs diffusers' own `WanAttnProcessor` — the projections (fused or not), RMS norms, rotary embedding and
    I2V split of the installed diffusers release — with its attention dispatched to attn_qat's "attn_qat" backend,
    which reads this module's state while the processor runs. The backend gets diffusers' (B, S, H, D) query, key
    and value and runs attn_qat on (B, H, S, D) views of them, so nothing is copied or made contiguous for
    attn_qat, and the output goes back (B, S, H, D) contiguous. `original` is the processor it replaces, which
    runs while the module is disabled or left out; calls attn_qat does not support fall back to PyTorch SDPA.
    `attn_qat.prepare` installs it and keeps the switches on the module (`AttentionState`); installed by
    hand (`module.set_processor(WanAttnQATProcessor(module.processor, config))`), `config` applies.
    """

    def __init__(self, original, config: Optional[QATConfig] = None):
        self.original = original
        self._state = AttentionState(config if config is not None else QATConfig())
        self._state.config.refuse_bf16_modules("attn_qat.WanAttnQATProcessor")
        if self._state.config.shift_k:  # its K shift is a buffer of the module, which attn_qat.prepare looks after
            raise NotImplementedError("attn_qat.WanAttnQATProcessor: shift_k needs attn_qat.prepare(model, config) "
                                      "(installed by hand, the processor has no module state to calibrate)")
        self._wan = _wan_processor()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        state = module_state(attn) or self._state
        if not state.active and state.calibration is None:
            if state.selected:
                state.record.count("disabled")
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        calls = getattr(_processor_calls, "stack", None)  # not __dict__.setdefault: torch < 2.12 cannot trace it
        if calls is None:
            calls = _processor_calls.stack = []
        call = _ProcessorCall(state, attn)
        calls.append(call)
        try:
            out = self._wan(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        finally:
            calls.pop()
        if call.dispatched == 0:
            raise RuntimeError("attn_qat: diffusers' WanAttnProcessor did not dispatch its attention to the attn_qat "
                               "backend (this diffusers release changed how it does); attn_qat.prepare does not "
                               "support it, use attn_qat.patch_sdpa")
        return out


def _wan_processor():
    """diffusers' own `WanAttnProcessor`, its attention dispatched to the "attn_qat" backend."""
    require_version("diffusers", DIFFUSERS_MIN, "attn_qat's diffusers integration")
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor
    processor = WanAttnProcessor()
    processor._attention_backend = _register_backend()
    return processor


def _wan_attention_class():
    require_version("diffusers", DIFFUSERS_MIN, "attn_qat's diffusers integration")
    from diffusers.models.transformers.transformer_wan import WanAttention
    return WanAttention


def prepare_diffusers(model: torch.nn.Module, config: QATConfig, filter_fn, warned, prefix: str = "") -> None:
    """Installs `WanAttnQATProcessor` on the selected `WanAttention` modules (see `attn_qat.prepare`; `prefix`: what
    the user's module names carry before `model`'s, config.plan_states)."""
    wan_attention = _wan_attention_class()
    candidates = [(name, module, (config.cross_attention if module.is_cross_attention else config.self_attention) and (
        filter_fn is None or filter_fn(module, name))) for name, module in model.named_modules()
        if isinstance(module, wan_attention)]
    found = bool(candidates)
    converted = 0
    for name, module, state in plan_states(candidates, config, prefix, warned) if found else ():
        selected = state.selected
        processor = module.processor
        if isinstance(processor, WanAttnQATProcessor):
            processor = processor.original
        if selected and getattr(processor, "_parallel_config", None) is not None:
            raise NotImplementedError(f"attn_qat.prepare: {name} runs with diffusers context parallelism, which the "
                                      "attn_qat processor does not support yet")
        install_state(module, state)
        if selected:
            head_dim = module.inner_dim // module.heads
            heads_kv = module.kv_inner_dim // head_dim  # fewer than heads with WanAttention's kv_heads
            qk_transforms.prepare_module(module, state.config, name, heads_kv, head_dim)
            state.record.static_fallback = static_fallback(module.heads, heads_kv, head_dim, head_dim)
        module.set_processor(WanAttnQATProcessor(processor))
        converted += selected
    if not found:
        raise TypeError(f"attn_qat.prepare: {type(model).__name__} has no WanAttention module; for other diffusers "
                        "models use attn_qat.register_diffusers_backend() and "
                        "model.set_attention_backend('attn_qat'), or attn_qat.patch_sdpa")
    if converted == 0:
        raise ValueError(f"attn_qat.prepare: no WanAttention module of {type(model).__name__} was selected (check "
                         "filter_fn and the config's self_attention / cross_attention)")


# The backend's state for calls outside a WanAttnQATProcessor (register_diffusers_backend's config), and the
# process-wide active backend it found when the "attn_qat" backend was registered (reset_diffusers_backend).
_backend_state = AttentionState(QATConfig())
_previous_active = None


def _attn_qat_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, _parallel_config=None):
    """diffusers backend function: (B, S, H, D) query/key/value in, (B, S, H, D) out, like diffusers'
    "native" backend (a (B, S_kv) mask broadcasts over heads and queries). Inside a `WanAttnQATProcessor` call
    it runs with that module's state, else with `register_diffusers_backend`'s config."""
    if _parallel_config is not None:
        raise NotImplementedError("attn_qat backend: diffusers context parallelism is not supported")
    if attn_mask is not None and attn_mask.ndim == 2:
        attn_mask = attn_mask[:, None, None, :]
    calls = getattr(_processor_calls, "stack", None)
    if calls:
        call = calls[-1]
        call.dispatched += 1
        state, inference, where = call.state, call.state.inference, "attn_qat (diffusers Wan processor)"
        if state.calibration is not None:  # calibrate_k_shift: record Q and K, attend as PyTorch's SDPA does
            qk_transforms.record_qk(state.calibration, query, key, heads_axis=2)
            return torch_sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p,
                              is_causal, scale, enable_gqa).transpose(1, 2)
        query, key = qk_transforms.transform_module_qk(call.module, query, key, state.config, heads_axis=2,
                                                       where=where)
    else:
        state, inference, where = _backend_state, False, "attn_qat (diffusers backend)"
    out = run_sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p, is_causal,
                   scale, enable_gqa, config=state.config, warned=state.warned, inference=inference, where=where,
                   record=state.record)
    return out.transpose(1, 2)


def _add_enum_member(enum_cls, name: str, value: str):
    """Adds a member to an existing `str` Enum, the way the Enum metaclass registers its own members
    (name map, value map, definition order). There is no public API for this."""
    member = str.__new__(enum_cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    member._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _set_active_backend(registry, backend) -> None:
    if hasattr(registry, "set_active_backend"):
        registry.set_active_backend(backend)
    else:  # diffusers 0.35 has no setter
        registry._active_backend = backend


def _register_backend():
    """Registers "attn_qat" with diffusers' dispatcher (idempotent) and returns its `AttentionBackendName` member.

    diffusers (0.35 to 0.42) validates backend names against its `AttentionBackendName` enum and keeps backend
    functions in the private `_AttentionBackendRegistry`; neither has a public extension point, so this adds an
    enum member and registers through the registry's own decorator. It checks the result and raises
    `RuntimeError` if a diffusers version changed those internals. It also notes the process-wide active backend
    it finds, unless that is "attn_qat" already, for `reset_diffusers_backend`."""
    global _previous_active
    require_version("diffusers", DIFFUSERS_MIN, "attn_qat's diffusers integration")
    from diffusers.models import attention_dispatch

    names = getattr(attention_dispatch, "AttentionBackendName", None)
    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    if names is None or not hasattr(names, "_value2member_map_") or not hasattr(registry, "register") or \
            not hasattr(registry, "_active_backend"):
        raise RuntimeError("attn_qat: this diffusers version has no attention backend registry that attn_qat knows "
                           "how to extend; use attn_qat.patch_sdpa")
    member = names._value2member_map_.get(BACKEND)
    if member is None:
        member = _add_enum_member(names, BACKEND.upper(), BACKEND)
    if registry._backends.get(member) is not _attn_qat_backend:
        registry.register(member, constraints=[])(_attn_qat_backend)
    if names(BACKEND) is not member or BACKEND not in {m.value for m in names.__members__.values()} or \
            registry._backends.get(member) is not _attn_qat_backend:
        raise RuntimeError("attn_qat: registering the attn_qat attention backend with diffusers failed (its "
                           "backend registry changed); use attn_qat.patch_sdpa")
    active = registry._active_backend
    if getattr(active, "value", active) != BACKEND:
        _previous_active = active
    _wrap_reset_attention_backend()
    return member


def _restore_active_backend() -> None:
    """When "attn_qat" is diffusers' process-wide active backend, makes the one active when attn_qat registered its
    backend (diffusers' default otherwise: "native", or the `DIFFUSERS_ATTN_BACKEND` environment variable) active
    again."""
    from diffusers.models import attention_dispatch

    registry, names = attention_dispatch._AttentionBackendRegistry, attention_dispatch.AttentionBackendName
    active = registry._active_backend
    if getattr(active, "value", active) == BACKEND:
        previous = _previous_active
        if previous is None:
            previous = names(attention_dispatch.DIFFUSERS_ATTN_BACKEND)
        _set_active_backend(registry, previous)


def _wrap_reset_attention_backend() -> None:
    """Makes diffusers' `ModelMixin.reset_attention_backend` undo `set_attention_backend("attn_qat")` (idempotent).

    diffusers' reset clears the backend the model's processors name, so that they follow the process-wide active
    backend; but `set_attention_backend` makes its backend the active one too (diffusers 0.42; 0.35 did not), so after
    `set_attention_backend("attn_qat")` the reset model, and every model built afterwards, kept running attn_qat.
    Wrapped, the reset also gives the active backend back (`_restore_active_backend`) when it is "attn_qat"; other
    backends' behaviour is diffusers' own. (`set_attention_backend("native")` needs no help: it names "native" in the
    model's processors and makes it the active backend.)"""
    from diffusers import ModelMixin

    reset = getattr(ModelMixin, "reset_attention_backend", None)
    if reset is None or getattr(reset, "_attn_qat_restores_active", False):
        return

    @functools.wraps(reset)
    def reset_attention_backend(self, *args, **kwargs):
        result = reset(self, *args, **kwargs)
        _restore_active_backend()
        return result

    reset_attention_backend._attn_qat_restores_active = True
    ModelMixin.reset_attention_backend = reset_attention_backend


def register_diffusers_backend(config: Optional[QATConfig] = None) -> None:
    """Registers "attn_qat" as a diffusers attention backend, so that `model.set_attention_backend("attn_qat")`
    and `with diffusers.attention_backend("attn_qat"):` run attn_qat (idempotent; `config` replaces the
    backend's config, default `QATConfig()`).

    The backend applies to every attention call of the model that goes through diffusers' dispatcher: it
    cannot tell self- from cross-attention, `enable`/`disable`/`convert` do not reach it, and diffusers'
    `set_attention_backend` also makes it the process-wide active backend, which models built afterwards use
    too: `model.reset_attention_backend()` or `model.set_attention_backend("native")` (or
    `reset_diffusers_backend()`) gives that back. Use `attn_qat.prepare` for per-module control. Calls
    attn_qat does not support fall back to PyTorch SDPA (diffusers' "native"). diffusers has no public way to
    add a backend: see `_register_backend`, which raises `RuntimeError` if a diffusers version changed what it
    relies on.
    """
    global _backend_state
    _register_backend()
    if config is not None:
        config.refuse_qk_transforms("attn_qat.register_diffusers_backend")
        config.refuse_bf16_modules("attn_qat.register_diffusers_backend")
        _backend_state = AttentionState(config)


def reset_diffusers_backend(*models: torch.nn.Module) -> None:
    """Undoes the process-wide effect of `model.set_attention_backend("attn_qat")`: when "attn_qat" is diffusers'
    active backend, makes the backend that was active when attn_qat registered its backend (diffusers' default
    otherwise: "native", or the `DIFFUSERS_ATTN_BACKEND` environment variable) the active one again, so that
    models built afterwards run it. The models given are reset too (diffusers' `model.reset_attention_backend()`:
    their processors follow the active backend again); other models set to "attn_qat" keep it, as do
    `WanAttnQATProcessor`s. The backend stays registered and keeps its config."""
    require_version("diffusers", DIFFUSERS_MIN, "attn_qat.reset_diffusers_backend")
    for model in models:
        model.reset_attention_backend()
    _restore_active_backend()
