"""transformers integration: an "attn_qat" attention implementation.

`register_transformers()` adds "attn_qat" to `transformers.AttentionInterface` (the attention function)
and to `transformers.masking_utils.AttentionMaskInterface` (its mask function: transformers' SDPA mask,
boolean, True = attend, or None when `is_causal` can stand in for it). Afterwards
`from_pretrained(..., attn_implementation="attn_qat")` and `model.set_attn_implementation("attn_qat")`
work for every model built on the AttentionInterface (Llama, Qwen2/3, Mistral, Gemma, ...).
Needs transformers >= 4.54; tested with 4.54.1, 4.56.2, 4.57.6, 5.17.0, 5.23.0 and 5.24.0.

Packed batches (padding-free training: `DataCollatorWithFlattening`, several documents in one batch-1 row) run as
`attn_qat.attention_varlen`, each document attending only to itself, where transformers' FlashAttention path would
run its varlen kernel: when the call brings `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q` and `max_length_k`
(`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`), or `position_ids` that restart inside the row (the
sequences then start where the position is the row's smallest, as `prepare_fa_kwargs_from_position_ids` reads them).
"""
from typing import List, Optional, Tuple

import torch

from ..host_cache import HostCache
from . import qk_transforms
from .config import (TRANSFORMERS_MIN, AttentionState, QATConfig, install_state, module_state, plan_states,
                     require_version)
from .report import static_fallback
from .routing import (attn_qat_outcome, count_call, fallback_detail, fallback_outcome, run_sdpa, unsupported_reason,
                      warn_once)

IMPLEMENTATION = "attn_qat"
# The tag an `attn_qat.NVFP4Cache` puts on the keys it returns (kv_cache_transformers.CACHE_LAYER_ATTR; kept
# here as a string so this module does not import the cache's, which subclasses transformers' Cache).
CACHE_LAYER_ATTR = "_attn_qat_nvfp4_cache_layer"

# The state of attention modules that `prepare` did not configure (a model loaded directly with
# attn_implementation="attn_qat"); `register_transformers(config)` replaces its config.
_default_state = AttentionState(QATConfig())


def register_transformers(config: Optional[QATConfig] = None) -> None:
    """Registers the "attn_qat" attention implementation with transformers (idempotent).

    `config` (default `QATConfig()`) applies to attention modules that `attn_qat.prepare` has not
    configured, i.e. to models loaded or switched with `attn_implementation="attn_qat"` directly.
    """
    require_version("transformers", TRANSFORMERS_MIN, "attn_qat's transformers integration")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    global _default_state
    if config is not None:
        if config.calibrated_qk:  # buffers that prepare makes and calibrate_k_shift fills, module by module
            raise ValueError("attn_qat.register_transformers: shift_k and balance_qk need attn_qat.prepare(model, "
                             "config) and attn_qat.calibrate_k_shift; a registered default config cannot hold their "
                             "calibrated values")
        if config.learn_qk_transforms:  # parameters that prepare gives each module
            raise ValueError("attn_qat.register_transformers: learn_qk_transforms needs attn_qat.prepare(model, "
                             "config), which gives each attention module its parameters; a registered default config "
                             "has none")
        config.refuse_bf16_modules("attn_qat.register_transformers")
        _default_state = AttentionState(config)
    AttentionInterface.register(IMPLEMENTATION, attn_qat_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def _sdpa_attention_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward


def attn_qat_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, **kwargs):
    """transformers attention function: (B, H, S, D) query and (B, H_kv, S_kv, D) key/value in, attention
    output (B, S, H, D) and no weights out, like transformers' "sdpa".

    Follows transformers' SDPA path: causal only without a mask, with more than one query and when the
    module is causal (top-left alignment, keys beyond the queries cropped as for an empty static cache);
    grouped KV heads go in unexpanded (enable_gqa); `scaling` is the softmax scale. Padding rows that are
    masked entirely give 0 (attn_qat counts mask values <= -1e30 as -inf), as torch's SDPA does.
    Modules left out by `prepare` or switched off by `attn_qat.disable` run transformers' "sdpa".
    Keys and values that an `attn_qat.NVFP4Cache` returned go to that cache (`_attend_nvfp4_cache`).
    """
    state = module_state(module) or _default_state
    cache_layer = getattr(key, CACHE_LAYER_ATTR, None)
    if cache_layer is not None and state.kept_bf16 and state.active:
        key, value = cache_layer.keep_bf16()  # a bf16 cache layer from now on; attention as with a DynamicCache
    elif cache_layer is not None:
        return _attend_nvfp4_cache(cache_layer, module, query, attention_mask, dropout, scaling, is_causal, state,
                                   kwargs)
    if state.calibration is not None:  # calibrate_k_shift: record Q and K, attend as the model's own attention does
        qk_transforms.record_qk(state.calibration, query, key, heads_axis=1)
    if not state.active or state.calibration is not None:
        if state.selected and state.calibration is None:
            count_call(state.record, "disabled")
        return _sdpa_attention_forward()(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("attn_qat attention does not support logit soft-capping (`softcap`); use attn_implementation="
                         "'eager' for this model")
    for name, reason in (("position_bias", "a learned additive position bias (`position_bias`) is not supported"),
                         ("cache", "a paged attention cache (continuous batching) is not supported")):
        if kwargs.get(name) is not None:
            if state.config.strict:
                raise NotImplementedError(f"attn_qat (transformers): {reason} (strict=True forbids falling back)")
            count_call(state.record, fallback_outcome(reason))
            warn_once(f"falling back to transformers' sdpa attention: {reason}", state.warned,
                      detail=fallback_detail(state.record))
            return _sdpa_attention_forward()(module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, is_causal=is_causal, **kwargs)
    if kwargs.get("output_attentions", False):
        warn_once("output_attentions=True is not supported; the attention weights are None", state.warned, UserWarning)

    query, key = module_qk_transform(module, query, key, state)
    module_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # A causal model's decoding step sees every cached key and comes without a mask, but V must stay blocked as in
    # the model's causal forward (numerics.md §2), or the step would not compute what the training forward did.
    v_block_axis = "head_dim" if module_causal and state.config.v_block_axis == "auto" else state.config.v_block_axis

    packed = _packed_sequences(query, key, value, attention_mask, dropout, module_causal, kwargs)
    if packed is not None:
        return _attend_packed(query, key, value, *packed, module_causal, scaling, state, v_block_axis), None

    q_length, kv_length = query.shape[2], key.shape[2]
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None and attention_mask is None and kv_length > sliding_window:
        # transformers' SDPA mask function materialises sliding windows whenever they cut keys; a missing
        # mask here means the caller built none, and causal alone would attend beyond the window.
        raise ValueError(f"attn_qat (transformers): sliding_window={sliding_window} with {kv_length} keys needs an "
                         "attention mask; build it with the 'attn_qat' (or 'sdpa') mask function")

    # Shape test first, as transformers does, so that dynamic shapes under torch.compile stay booleans.
    is_causal = q_length > 1 and attention_mask is None and module_causal
    if is_causal and kv_length > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]

    out = run_sdpa(query, key, value, attention_mask, dropout, is_causal, scaling, query.shape[1] != key.shape[1],
                   config=state.config, warned=state.warned, inference=state.inference,
                   where="attn_qat (transformers)", v_block_axis=v_block_axis, record=state.record)
    return out.transpose(1, 2).contiguous(), None


def module_qk_transform(module, query, key, state: Optional[AttentionState] = None):
    """(query, key) of a (B, H, S, D) / (B, H_kv, S, D) call after the module's Q/K transforms (numerics.md §9);
    unchanged without them. Code that quantizes a prepared module's Q and K itself (a custom attention function)
    applies this first."""
    state = state if state is not None else (module_state(module) or _default_state)
    if not state.selected:  # left out by prepare: the module keeps the library's attention, untransformed
        return query, key
    return qk_transforms.transform_module_qk(module, query, key, state.config, heads_axis=1,
                                             where="attn_qat (transformers)")


# Host copies of what a packed batch's sequence boundaries were read from (cu_seq_lens, position_ids), and whether a
# mask is exactly the packing's: every layer of one forward gets the same tensors, so each is read (a device sync) and
# checked once, not once a layer.
_host_lengths = HostCache()
_mask_checks = HostCache()


def _host_cu_seqlens(t) -> Optional[List[int]]:
    if not isinstance(t, torch.Tensor):
        return [int(x) for x in t]
    if t.dim() != 1 or t.is_floating_point():
        return None
    return _host_lengths.get(t, t.tolist)


def _cu_from_position_ids(position_ids: torch.Tensor, length: int) -> Optional[List[int]]:
    """Sequence boundaries of a batch-1 row whose positions restart, as transformers' FlashAttention path reads them
    (prepare_fa_kwargs_from_position_ids: a sequence starts wherever the position is the row's smallest); None for a
    row of one sequence, or positions of another shape."""
    if position_ids.numel() != length or position_ids.is_floating_point():
        return None
    def starts():
        positions = position_ids.reshape(-1).tolist()
        first = min(positions)
        found = [i for i, p in enumerate(positions) if p == first]
        return found + [length] if len(found) > 1 and found[0] == 0 else None

    return _host_lengths.get(position_ids, starts)


def _mask_is_packing(mask: torch.Tensor, cu_q: List[int], cu_k: List[int], causal: bool) -> bool:
    """Whether `mask` is exactly the boolean mask of the packed sequences (each query sees the keys of its own
    sequence, up to the bottom-right causal limit when causal): what transformers' mask functions build for an SDPA-
    style implementation from position_ids that restart. Checked once per mask tensor, in chunks of rows."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (cu_q[-1], cu_k[-1]):
        return False
    return _mask_checks.get(mask, lambda: _mask_matches(mask, cu_q, cu_k, causal), key=(tuple(cu_q), tuple(cu_k),
                                                                                          causal))


def _mask_matches(mask: torch.Tensor, cu_q: List[int], cu_k: List[int], causal: bool) -> bool:
    device = mask.device
    lens_q = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])], device=device)
    lens_k = torch.tensor([b - a for a, b in zip(cu_k, cu_k[1:])], device=device)
    seqs = torch.arange(len(lens_q), device=device)
    seq_q, seq_k = seqs.repeat_interleave(lens_q), seqs.repeat_interleave(lens_k)
    row_q = torch.arange(cu_q[-1], device=device) - torch.tensor(cu_q[:-1], device=device)[seq_q]
    row_k = torch.arange(cu_k[-1], device=device) - torch.tensor(cu_k[:-1], device=device)[seq_k]
    limit = row_q + (lens_k - lens_q)[seq_q]  # bottom-right: key r of the sequence visible iff r <= limit
    for i0 in range(0, cu_q[-1], 2048):
        i1 = min(i0 + 2048, cu_q[-1])
        expected = seq_q[i0:i1, None] == seq_k[None, :]
        if causal:
            expected &= row_k[None, :] <= limit[i0:i1, None]
        if not bool((mask[..., i0:i1, :] == expected).all()):
            return False
    return True


def _packed_sequences(query, key, value, attention_mask, dropout, causal, kwargs) -> Optional[Tuple[List[int],
                                                                                                    List[int]]]:
    """(cu_seqlens_q, cu_seqlens_k) on the host when this call is a packed batch that transformers' FlashAttention
    path would run as varlen attention (module docstring) and attn_qat can run it, else None (the call then goes the
    SDPA way). A mask that comes along must be exactly the packing's (transformers builds one from restarting
    position_ids for SDPA-style implementations); any other mask keeps the SDPA path, which honours it."""
    if query.dim() != 4 or query.shape[0] != 1 or kwargs.get("sliding_window") is not None:
        return None
    if unsupported_reason(query, key, value, None, dropout, False, True) is not None:
        return None  # the SDPA path falls back (or raises under strict) with its reason
    n_q, n_k = query.shape[2], key.shape[2]
    if all(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                        "max_length_k")):
        source = (kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    elif kwargs.get("position_ids") is not None and n_q == n_k and n_q > 1 and not torch.compiler.is_compiling():
        # Under torch.compile, restarting positions are left to the mask transformers builds from them (the SDPA path,
        # correct but without the per-sequence blocks): reading them here would break every layer's graph.
        source = kwargs["position_ids"]
    else:
        return None
    return _read_packing(source, n_q, n_k, attention_mask, causal)


@torch.compiler.disable  # reads device values on the host (once per forward, cached): torch.compile graphs stop here
def _read_packing(source, n_q: int, n_k: int, attention_mask, causal: bool) -> Optional[Tuple[List[int], List[int]]]:
    if isinstance(source, tuple):
        cu_q, cu_k = _host_cu_seqlens(source[0]), _host_cu_seqlens(source[1])
    else:
        cu_q = cu_k = _cu_from_position_ids(source, n_q)
    if cu_q is None or cu_k is None or len(cu_q) != len(cu_k) or len(cu_q) < 2:
        return None
    if cu_q[0] != 0 or cu_k[0] != 0 or cu_q[-1] != n_q or cu_k[-1] != n_k:
        return None
    if any(b < a for a, b in zip(cu_q, cu_q[1:])) or any(b < a for a, b in zip(cu_k, cu_k[1:])):
        return None
    if attention_mask is not None and not _mask_is_packing(attention_mask, cu_q, cu_k, causal):
        return None
    return cu_q, cu_k


def _attend_packed(query, key, value, cu_q, cu_k, causal, scaling, state, v_block_axis):
    """A packed batch through attn_qat.attention_varlen: query (1, H, S, D), key and value (1, H_kv, S_kv, D) hold
    the sequences one after another; returns (1, S, H, D). Causal sequences align bottom-right, as FlashAttention's
    varlen kernel (the same as top-left where each sequence has as many queries as keys)."""
    from ..attention import _check_qkv, _output, _output_dtype
    from ..ops import v_along_tokens
    from ..varlen import _attention_varlen

    fn = "attention_varlen (transformers)"
    mode = state.config.inference_mode if state.inference else state.config.mode
    out_dtype = _output_dtype(query)
    query, key, value = _check_qkv(query, key, value, fn)
    count_call(state.record, attn_qat_outcome(mode))
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    along_tokens = v_along_tokens(v_block_axis, causal, fn)
    run = lambda: _attention_varlen(query, key, value, cu_q, cu_k, max(lens_q), max(lens_k),  # noqa: E731
                                    "bottom_right" if causal else None, scale, mode, along_tokens, False, fn)
    if state.inference:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            warn_once("this attention was converted for inference (attn_qat.convert); its output carries no "
                      "gradient", state.warned, UserWarning)
        with torch.no_grad():
            out = run()
    else:
        out = run()
    return _output(out, out_dtype).unsqueeze(0)


def _attend_nvfp4_cache(cache_layer, module, query, attention_mask, dropout, scaling, is_causal, state, kwargs):
    """Attention of a layer whose keys and values live in an `attn_qat.NVFP4Cache`: the cache layer
    appends the step's K/V and attends (integrations/kv_cache_transformers.py). Inference only; every
    input the cache cannot honour raises, since no other attention can read NVFP4 storage."""
    where = "attn_qat (transformers, NVFP4Cache)"
    if not state.active:
        raise RuntimeError(f"{where}: this attention module is switched off (attn_qat.disable) or left out by prepare, "
                           "but its keys and values live in an NVFP4Cache, which only attn_qat attention can read; "
                           "enable it, or generate with another cache")
    if state.config.inference_mode == "bf16":
        raise ValueError(f"{where}: the model runs attn_qat in 'bf16' mode, but an NVFP4Cache computes 4-bit "
                         "attention; use a DynamicCache for a bf16 baseline")
    if state.config.v_block_axis == "tokens":
        cache_layer.pending = None  # the step's K/V go nowhere: the next update must not report them unread
        raise ValueError(f"{where}: the model blocks V along tokens (QATConfig v_block_axis='tokens'), but an "
                         "NVFP4Cache stores V blocked along head_dim, as causal attention does (numerics.md §2)")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{where}: logit soft-capping (`softcap`) is not supported")
    for name in ("position_bias", "cache"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{where}: `{name}` is not supported")
    if dropout:
        raise NotImplementedError(f"{where}: attention dropout is not supported (dropout={dropout}); call model.eval()")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"{where}: sliding-window attention is not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal and query.shape[2] > 1:
        raise NotImplementedError(f"{where}: the cache's attention is causal; this module is not")
    if kwargs.get("output_attentions", False):
        warn_once("output_attentions=True is not supported; the attention weights are None", state.warned, UserWarning)
    if torch.is_grad_enabled() and query.requires_grad:
        warn_once("attention through an NVFP4Cache is inference only; its output carries no gradient", state.warned,
                  UserWarning)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    count_call(state.record, "fp4")
    with torch.no_grad():
        if state.config.transforms_qk and cache_layer.pending is not None:  # the cache stores K as attention sees it
            key, value = cache_layer.pending
            try:
                query, key = module_qk_transform(module, query, key, state)
            except Exception:
                cache_layer.pending = None  # the step's K/V go nowhere: the next update must not report them unread
                raise
            cache_layer.pending = (key, value)
        out = cache_layer.attend(query, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def is_attention_module(module: torch.nn.Module) -> bool:
    """Attention modules of transformers models that dispatch through the AttentionInterface: by
    convention their class names end in "Attention" and they carry the model config."""
    return type(module).__name__.endswith("Attention") and hasattr(module, "config")


def _module_shape(module):
    """(query heads, KV heads, Q/K head_dim, V head_dim) of an attention module, from its attributes and the model
    config (None where they do not tell): multi-head latent attention (DeepSeek) has its own Q/K and V dims."""
    config = module.config
    heads = getattr(config, "num_attention_heads", None)
    heads_kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None) or \
        getattr(config, "head_dim", None)
    if head_dim is None and isinstance(heads, int) and heads and isinstance(getattr(config, "hidden_size", None), int):
        head_dim = config.hidden_size // heads
    return heads, heads_kv, head_dim, getattr(config, "v_head_dim", None) or head_dim


def prepare_transformers(model, config: QATConfig, filter_fn, warned, prefix: str = "") -> None:
    """Installs "attn_qat" in a transformers `PreTrainedModel` (see `attn_qat.prepare`; `prefix`: what the user's
    module names carry before `model`'s, config.plan_states)."""
    register_transformers()
    candidates = []
    for name, module in model.named_modules():
        if not is_attention_module(module):
            continue
        cross = bool(getattr(module, "is_cross_attention", False))
        candidates.append((name, module, (config.cross_attention if cross else config.self_attention) and (
            filter_fn is None or filter_fn(module, name))))
    converted = 0
    for name, module, state in plan_states(candidates, config, prefix, warned):
        selected = state.selected
        install_state(module, state)
        if selected:
            heads, heads_kv, head_dim, v_head_dim = _module_shape(module)
            qk_transforms.prepare_module(module, state.config, name, heads_kv, head_dim)
            state.record.static_fallback = static_fallback(heads, heads_kv, head_dim, v_head_dim)
        converted += selected
    if converted == 0:
        raise ValueError(f"attn_qat.prepare: no attention module of {type(model).__name__} was selected (looked for "
                         "modules whose class name ends in 'Attention'; check filter_fn and the config)")
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise TypeError(f"attn_qat.prepare: {type(model).__name__} cannot switch its attention implementation (it "
                        "does not dispatch through transformers' AttentionInterface); use attn_qat.patch_sdpa with "
                        "attn_implementation='sdpa' instead")
