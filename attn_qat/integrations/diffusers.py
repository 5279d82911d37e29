"""diffusers integration: an attention processor for Wan's `WanAttention`, and an "attn_qat" attention
backend for diffusers' dispatcher. Needs diffusers >= 0.35; tested with 0.35.0, 0.35.2 and 0.42.1.

`prepare` installs `WanAttnQATProcessor` on the selected `WanAttention` modules through the public
`set_processor`; it keeps per-module state, so the self/cross choice, `enable`/`disable` and `convert`
work. `register_diffusers_backend()` makes `model.set_attention_backend("attn_qat")` work for every
diffusers model that dispatches through `dispatch_attention_fn`; diffusers has no public way to add a
backend, so it extends diffusers' private backend enum and registry (see its docstring).
"""
from typing import Optional

import torch

from .config import DIFFUSERS_MIN, AttentionState, QATConfig, STATE_ATTR, module_state, require_version, run_sdpa

BACKEND = "attn_qat"

# Wan 2.1 I2V feeds [image tokens, text tokens] to the cross-attention; the text part is the last 512
# tokens (the text encoder's fixed context length), as in diffusers' WanAttnProcessor.
WAN_TEXT_CONTEXT_LENGTH = 512


def _wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on (B, S, H, D): channel pairs (2i, 2i+1) rotate by angle i, whose cosine and
    sine diffusers repeats over both channels of the pair; computed in the frequencies' dtype (float32)
    and rounded once to x's dtype."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 0::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class WanAttnQATProcessor:
    """Attention processor for diffusers' `WanAttention` (Wan 2.1/2.2 self- and cross-attention, with the
    I2V image-token branch) computing attention with attn_qat.

    The projections, RMS norms, rotary embedding and I2V split are Wan's; the attention runs on (B, H, S, D)
    views of the (B, S, H, D) projections, so nothing is copied or made contiguous for attn_qat, and the
    output comes back (B, S, H, D) contiguous. `original` is the processor it replaces, which runs while
    the module is disabled or left out; calls attn_qat does not support fall back to PyTorch SDPA.
    `attn_qat.prepare` installs it and keeps the switches on the module (`AttentionState`); installed by
    hand (`module.set_processor(WanAttnQATProcessor(module.processor, config))`), `config` applies.
    """

    def __init__(self, original, config: Optional[QATConfig] = None):
        self.original = original
        self._state = AttentionState(config if config is not None else QATConfig())

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        state = module_state(attn) or self._state
        if not state.active:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)

        image_states = None
        if attn.add_k_proj is not None:
            image_length = encoder_hidden_states.shape[1] - WAN_TEXT_CONTEXT_LENGTH
            image_states = encoder_hidden_states[:, :image_length]
            encoder_hidden_states = encoder_hidden_states[:, image_length:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states

        if attn.fused_projections and not attn.is_cross_attention:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        elif attn.fused_projections:
            query = attn.to_q(hidden_states)
            key, value = attn.to_kv(context).chunk(2, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _wan_rotary(query, *rotary_emb), _wan_rotary(key, *rotary_emb)

        out = self._attention(state, query, key, value, attention_mask)
        if image_states is not None:
            if attn.fused_projections:
                key_image, value_image = attn.to_added_kv(image_states).chunk(2, dim=-1)
            else:
                key_image, value_image = attn.add_k_proj(image_states), attn.add_v_proj(image_states)
            key_image = attn.norm_added_k(key_image).unflatten(2, (attn.heads, -1))
            value_image = value_image.unflatten(2, (attn.heads, -1))
            out = out + self._attention(state, query, key_image, value_image, None)

        out = attn.to_out[0](out)
        return attn.to_out[1](out)

    @staticmethod
    def _attention(state: AttentionState, query, key, value, attention_mask) -> torch.Tensor:
        """(B, S, H, D) in, (B, S, H*D) in the query's dtype out."""
        out = run_sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attention_mask, 0.0, False,
                       None, False, config=state.config, warned=state.warned, inference=state.inference,
                       where="attn_qat (diffusers Wan processor)")
        return out.transpose(1, 2).flatten(2, 3).type_as(query)


def _wan_attention_class():
    require_version("diffusers", DIFFUSERS_MIN, "attn_qat's diffusers integration")
    from diffusers.models.transformers.transformer_wan import WanAttention
    return WanAttention


def prepare_diffusers(model: torch.nn.Module, config: QATConfig, filter_fn, warned) -> None:
    """Installs `WanAttnQATProcessor` on the selected `WanAttention` modules (see `attn_qat.prepare`)."""
    wan_attention = _wan_attention_class()
    converted, found = 0, False
    for name, module in model.named_modules():
        if not isinstance(module, wan_attention):
            continue
        found = True
        selected = (config.cross_attention if module.is_cross_attention else config.self_attention) and (
            filter_fn is None or filter_fn(module, name))
        processor = module.processor
        if isinstance(processor, WanAttnQATProcessor):
            processor = processor.original
        if selected and getattr(processor, "_parallel_config", None) is not None:
            raise NotImplementedError(f"attn_qat.prepare: {name} runs with diffusers context parallelism, which the "
                                      "attn_qat processor does not support yet")
        setattr(module, STATE_ATTR, AttentionState(config, selected=selected, warned=warned))
        module.set_processor(WanAttnQATProcessor(processor))
        converted += selected
    if not found:
        raise TypeError(f"attn_qat.prepare: {type(model).__name__} has no WanAttention module; for other diffusers "
                        "models use attn_qat.register_diffusers_backend() and "
                        "model.set_attention_backend('attn_qat'), or attn_qat.patch_sdpa")
    if converted == 0:
        raise ValueError(f"attn_qat.prepare: no WanAttention module of {type(model).__name__} was selected (check "
                         "filter_fn and the config's self_attention / cross_attention)")


_backend_state = AttentionState(QATConfig())


def _attn_qat_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, _parallel_config=None):
    """diffusers backend function: (B, S, H, D) query/key/value in, (B, S, H, D) out, like diffusers'
    "native" backend (a (B, S_kv) mask broadcasts over heads and queries)."""
    if _parallel_config is not None:
        raise NotImplementedError("attn_qat backend: diffusers context parallelism is not supported")
    if attn_mask is not None and attn_mask.ndim == 2:
        attn_mask = attn_mask[:, None, None, :]
    out = run_sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p, is_causal,
                   scale, enable_gqa, config=_backend_state.config, warned=_backend_state.warned,
                   where="attn_qat (diffusers backend)")
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


def register_diffusers_backend(config: Optional[QATConfig] = None) -> None:
    """Registers "attn_qat" as a diffusers attention backend, so that `model.set_attention_backend("attn_qat")`
    and `with diffusers.attention_backend("attn_qat"):` run attn_qat (idempotent; `config` replaces the
    backend's config, default `QATConfig()`).

    The backend applies to every attention call of the model that goes through diffusers' dispatcher: it
    cannot tell self- from cross-attention, `enable`/`disable`/`convert` do not reach it, and diffusers'
    `set_attention_backend` also makes it the process-wide active backend. Use `attn_qat.prepare` for
    per-module control. Calls attn_qat does not support fall back to PyTorch SDPA (diffusers' "native").

    diffusers (0.42) validates backend names against its `AttentionBackendName` enum and keeps backend
    functions in the private `_AttentionBackendRegistry`; neither has a public extension point, so this
    adds an enum member and registers through the registry's own decorator. It checks the result and
    raises `RuntimeError` if a diffusers version changed those internals.
    """
    require_version("diffusers", DIFFUSERS_MIN, "attn_qat.register_diffusers_backend")
    from diffusers.models import attention_dispatch

    global _backend_state
    if config is not None:
        _backend_state = AttentionState(config)
    names = getattr(attention_dispatch, "AttentionBackendName", None)
    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    if names is None or not hasattr(names, "_value2member_map_") or not hasattr(registry, "register"):
        raise RuntimeError("attn_qat.register_diffusers_backend: this diffusers version has no attention backend "
                           "registry that attn_qat knows how to extend; use attn_qat.prepare (Wan) or "
                           "attn_qat.patch_sdpa")
    member = names._value2member_map_.get(BACKEND)
    if member is None:
        member = _add_enum_member(names, BACKEND.upper(), BACKEND)
    registry.register(member, constraints=[])(_attn_qat_backend)
    if names(BACKEND) is not member or BACKEND not in {m.value for m in names.__members__.values()} or \
            registry._backends.get(member) is not _attn_qat_backend:
        raise RuntimeError("attn_qat.register_diffusers_backend: registering the backend with diffusers failed "
                           "(its backend registry changed); use attn_qat.prepare or attn_qat.patch_sdpa")
