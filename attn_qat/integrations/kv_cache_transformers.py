"""transformers integration of the NVFP4 KV cache: `NVFP4Cache`, a transformers `Cache` whose layers keep
their keys and values in an `attn_qat.NVFP4KVCache` (4-bit codes and E4M3 scales, 3.56x smaller than
bf16), read by the "attn_qat" attention implementation.

    attn_qat.register_transformers()
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="attn_qat")
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=prompt_len + max_new_tokens)
    out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens)  # < 5.24: past_key_values=

How a step runs. transformers calls the cache's `update(k, v, layer_idx)` and hands what it returns to
the attention function. `update` cannot quantize yet: which tokens are padding is only known from the
attention mask, which reaches the attention function, not the cache. So `update` keeps the step's bf16
K/V pending and returns them tagged with the layer; the "attn_qat" attention function finds the tag
and calls `NVFP4CacheLayer.attend`, which appends to the NVFP4KVCache and attends:

- prefill (empty cache): the step's bf16 K/V go through attn_qat's fake-quant inference forward
  (numerics.md §3), causal, exactly what the model computes without a cache; then they are appended.
- later steps (decode, or further chunks): append, then `NVFP4KVCache.attention` with the step's queries
  as the last tokens of each sequence (bottom-right causal). K and V are blocked along head_dim, one token
  at a time, as the causal fake-quant forward blocks them (numerics.md §2), so a step computes what the
  model computes without a cache, up to the kernels' fp32 summation order.

Left padding (batched `generate` with a padding mask) is supported: the prefill moves each sequence's
tokens to the front of its rows, so the cache holds only real tokens with per-sequence lengths. Each
sequence is then computed as if it had been run alone; the fake-quant forward on the padded batch
differs from that only where P's 16-key blocks, counted from the padded position 0, straddle the
padding (padding values set no scale). Other masks (right padding, packed sequences, custom masks)
raise `NotImplementedError`: the cache's attention is causal per sequence by construction.

A layer whose attention module `QATConfig.bf16_modules` keeps in bf16 finds that out at its prefill (`keep_bf16`):
from then on it stores bf16 keys and values, as transformers' DynamicLayer does, and its attention runs exactly as
it would with a DynamicCache, mode "bf16".

Static (`NVFP4Cache(..., static=True)`): the layers keep no host state that changes from step to step (the
lengths live on the device, `get_seq_length` is a device tensor and the mask spans `max_cache_len`, as
transformers' StaticCache), so `generate` compiles its decoding steps (torch.compile, CUDA graphs by default on
a GPU) and a step replays without host work. The prefill runs eagerly (transformers compiles the chunks of a
`prefill_chunk_size` prefill: torch.compile then falls back to eager, or raises under fullgraph=True) and checks the
mask as above; the decoding steps do not look at the mask again
(transformers extends it by one visible token a step), and a layer kept in bf16 stores its keys in a
`max_cache_len` buffer as StaticLayer does. A step past `max_cache_len` fails on the device (`torch._assert_async`).
`reset` keeps every buffer, and each layer's kind (NVFP4 or bf16), so that the compiled steps of the next
`generate` find them at the same addresses.

A returned tag that nobody consumed means the model's attention is not "attn_qat" (it would have read
the step's keys only); the next `update` of that layer raises instead of letting it compute garbage.
"""
from typing import List, Optional, Tuple

import torch

from .config import TRANSFORMERS_CACHE_MIN, require_version

# checked before importing cache_utils, whose layer classes older releases lack or build differently
require_version("transformers", TRANSFORMERS_CACHE_MIN, "attn_qat.NVFP4Cache")
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
try:
    from transformers.configuration_utils import PreTrainedConfig  # noqa: E402
except ImportError:  # transformers 4.x spells it PretrainedConfig
    from transformers.configuration_utils import PretrainedConfig as PreTrainedConfig

from .. import _C
from ..attention import MASKED_BELOW, attention
from ..kv_cache import NVFP4KVCache, mark_static
# The attribute of the key tensor `update` returns that names the layer whose pending step it is; the
# "attn_qat" attention function reads it.
from .transformers import CACHE_LAYER_ATTR

_WHERE = "attn_qat.NVFP4Cache"


class _Padding:
    """What the layers of one cache share: each sequence's count of left-padding tokens, read from the
    attention mask once per forward (all layers get the same mask object) and kept for later steps."""

    def __init__(self):
        self.pads: Optional[torch.Tensor] = None  # (batch,) long, or None when no sequence is padded
        self.host_pads: Optional[List[int]] = None  # the same counts on the host
        self._checked: Optional[Tuple[torch.Tensor, int]] = None  # (mask, total length) last validated

    def reset(self):
        self.pads, self.host_pads, self._checked = None, None, None

    def of(self, mask: Optional[torch.Tensor], batch: int, q_len: int, kv_len: int, prefill: bool,
           mask_len: Optional[int] = None):
        """Left-padding counts (or None) for a step of `q_len` queries whose keys are the `kv_len` tokens
        (padding included) seen so far; validates that `mask` is transformers' causal + left-padding mask, of
        `mask_len` keys (default kv_len; a static cache's spans max_cache_len, and its first kv_len are checked).
        Every check of a mask comes to the host in one read (a forward's one sync, at its first layer)."""
        if mask is None:
            if self.pads is not None and not prefill:
                raise ValueError(f"{_WHERE}: the prompt was left-padded but this step has no attention mask; pass "
                                 "the attention_mask (extended by one per generated token) on every step")
            if prefill:
                self.pads, self.host_pads = None, None
            return self.pads
        checked = self._checked
        if checked is not None and checked[0] is mask and checked[1] == kv_len:
            return self.pads
        width = kv_len if mask_len is None else mask_len
        if mask.dim() != 4 or mask.shape[-2] != q_len or mask.shape[-1] != width or mask.shape[0] not in (1, batch):
            raise ValueError(f"{_WHERE}: expected an attention mask of shape (batch, heads, {q_len}, {width}), got "
                             f"{tuple(mask.shape)}")
        mask_in = mask
        mask = mask[..., :kv_len]
        if mask.dtype == torch.bool:
            visible, bias = mask, None
        elif mask.is_floating_point():
            visible = mask > MASKED_BELOW
            bias = mask.masked_fill(~visible, 0).any()
        else:
            raise TypeError(f"{_WHERE}: attention mask dtype {mask.dtype} is not supported (bool or float)")
        per_head = (visible != visible[:, :1]).any()
        visible = visible[:, 0].expand(batch, q_len, kv_len)
        keys = torch.arange(kv_len, device=mask.device)
        if prefill:
            # The last query is a real token in a left-padded batch; the keys it cannot see are the padding.
            pads = kv_len - visible[:, -1].sum(-1)
        else:
            pads = self.pads if self.pads is not None else torch.zeros(batch, dtype=torch.long, device=mask.device)
        pads = pads.to(device=mask.device, dtype=torch.long)
        positions = torch.arange(q_len, device=mask.device) + (kv_len - q_len)  # each query's own position
        expected = (keys >= pads[:, None, None]) & (keys <= positions[:, None])
        real_query = positions[None, :] >= pads[:, None]  # rows of padding queries are not looked at
        other = ((visible != expected) & real_query[..., None]).any()
        flags = [per_head, other] + ([] if bias is None else [bias])
        read = torch.cat([torch.stack(flags).long()] + ([pads] if prefill else [])).tolist()
        if bias is not None and read[2]:
            raise NotImplementedError(f"{_WHERE}: additive attention biases are not supported, only masks")
        if read[0]:
            raise NotImplementedError(f"{_WHERE}: per-head attention masks are not supported")
        if read[1]:
            raise NotImplementedError(
                f"{_WHERE}: only causal attention with left padding is supported (the mask transformers builds "
                "for a left-padded batch); this attention mask has another structure (right padding, packed "
                "sequences or a custom mask)")
        if prefill:
            host_pads = read[len(flags):]
            if any(p >= kv_len for p in host_pads):
                raise ValueError(f"{_WHERE}: a sequence of the batch is all padding")
            self.pads, self.host_pads = (pads, host_pads) if any(host_pads) else (None, None)
        self._checked = (mask_in, kv_len)
        return self.pads


class NVFP4CacheLayer(CacheLayerMixin):
    """One attention layer of `NVFP4Cache`: an `attn_qat.NVFP4KVCache` of `max_cache_len` tokens per
    sequence, allocated at the first `update` (batch, KV heads, head_dim, dtype and device from it); with `static`,
    one whose steps keep no host state (the module docstring)."""

    is_croppable = False
    is_sliding = False

    def __init__(self, max_cache_len: int, padding: Optional[_Padding] = None, static: bool = False):
        super().__init__()
        self.is_initialized = False  # transformers 4.56's CacheLayerMixin does not set it
        self.max_cache_len = max_cache_len
        self.padding = padding if padding is not None else _Padding()
        self.static = self.is_compileable = static
        self.kv = None  # the NVFP4KVCache
        self.filled = False  # the prefill has run: later steps append to the cache and attend to it
        # Tokens passed through update, padding included (transformers' notion of the length): an int, or for a
        # static layer a device tensor (allocated with the storage), as transformers' StaticLayer keeps it.
        self.seen = 0
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.bf16 = False  # the layer's module is kept in bf16 (keep_bf16): self.keys / self.values hold its cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads_kv, _, head_dim = key_states.shape
        if key_states.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{_WHERE}: keys and values must be bfloat16 or float16 (load the model in one of them), "
                            f"got {key_states.dtype}")
        if head_dim not in _C.HEAD_DIMS or value_states.shape[-1] != head_dim:
            raise ValueError(f"{_WHERE}: head_dim must be {_C.HEAD_DIMS_TEXT}, one for keys and values, got "
                             f"{head_dim} and {value_states.shape[-1]}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, self.head_dim = batch, heads_kv, head_dim
        capacity = -(-self.max_cache_len // 16) * 16  # whole 16-token units; `update` enforces max_cache_len itself
        self.kv = NVFP4KVCache(batch, heads_kv, head_dim, capacity, dtype=self.dtype, device=self.device,
                               static=self.static)
        if self.static:
            self.seen = torch.zeros((), dtype=torch.long, device=self.device)
            mark_static(self.seen)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Keeps the step's K/V pending for `attend` and returns them, the key tagged with this layer."""
        if self.pending is not None:
            self.pending = None
            raise RuntimeError(f"{_WHERE}: the keys and values of the previous step were never read by attn_qat "
                               "attention. NVFP4Cache only works with attn_implementation='attn_qat' (attn_qat."
                               "register_transformers(), or attn_qat.prepare(model)) on every attention layer")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        steps = key_states.shape[-2]
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_heads:
            raise ValueError(f"{_WHERE}: this cache holds batch {self.batch_size} with {self.num_heads} KV heads, got "
                             f"keys of shape {tuple(key_states.shape)}; reset() it or make a new one")
        if self.static:  # the host checks the prefill, the device the later steps
            if not self.filled:
                if torch.compiler.is_compiling():
                    raise NotImplementedError(f"{_WHERE}: a static cache's prefill runs eagerly; a compiled prefill "
                                              "(transformers' prefill_chunk_size) is not supported")
                if steps > self.max_cache_len:
                    raise ValueError(f"{_WHERE}: {steps} tokens exceed max_cache_len={self.max_cache_len}")
            positions = self.seen + torch.arange(steps, device=self.device) if self.bf16 else None
            self.seen.add_(steps)
            torch._assert_async(self.seen <= self.max_cache_len,
                                f"{_WHERE}: a step goes past max_cache_len={self.max_cache_len}; make the cache with "
                                "max_cache_len >= prompt length (padding included) + max_new_tokens")
            if self.bf16:  # as transformers' StaticLayer: the keys and values at their positions, untagged
                self.keys.index_copy_(2, positions, key_states)
                self.values.index_copy_(2, positions, value_states)
                self.filled = True
                return self.keys, self.values
        else:
            if self.seen + steps > self.max_cache_len:
                raise ValueError(f"{_WHERE}: {self.seen} cached + {steps} new tokens exceed max_cache_len="
                                 f"{self.max_cache_len}; make the cache with max_cache_len >= prompt length (padding "
                                 "included) + max_new_tokens")
            self.seen += steps
            if self.bf16:  # as transformers' DynamicLayer: every key and value so far, untagged
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
                return self.keys, self.values
        self.pending = (key_states, value_states)
        tagged = key_states.view_as(key_states)  # a fresh tensor object, so the tag stays ours
        setattr(tagged, CACHE_LAYER_ATTR, self)
        return tagged, value_states

    def keep_bf16(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Makes this a bf16 layer (its attention module is kept in bf16, QATConfig.bf16_modules) at its prefill:
        returns the step's keys and values, which it keeps, and later steps' `update` returns all of them."""
        if self.pending is None or self.filled:
            self.pending = None
            raise RuntimeError(f"{_WHERE}: a layer kept in bf16 (QATConfig.bf16_modules) must be so from its first "
                               "step; this one stored NVFP4 keys and values already (prepare the model before "
                               "generating, or reset() the cache)")
        keys, values = self.pending
        self.pending, self.kv, self.bf16, self.filled = None, None, True, True  # no NVFP4 storage for this layer
        if self.static:  # StaticLayer's buffers: the mask spans max_cache_len keys
            shape = (self.batch_size, self.num_heads, self.max_cache_len, self.head_dim)
            self.keys, self.values = keys.new_zeros(shape), values.new_zeros(shape)
            self.keys[:, :, :keys.shape[2]] = keys
            self.values[:, :, :values.shape[2]] = values
            mark_static(self.keys, self.values)
        else:
            self.keys, self.values = keys, values
        return self.keys, self.values

    def attend(self, query: torch.Tensor, attention_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        """Appends the pending step and attends to the cache: (B, H, Tq, D) queries -> (B, H, Tq, D)."""
        if self.pending is None:
            raise RuntimeError(f"{_WHERE}: attention ran without a preceding update of this layer")
        key, value = self.pending
        self.pending = None
        batch, _, q_len, _ = query.shape
        steps = key.shape[2]
        if q_len != steps:
            raise NotImplementedError(f"{_WHERE}: {q_len} queries for {steps} new keys (only self-attention over the "
                                      "tokens just appended is supported)")
        if not self.filled:
            mask_len = self.max_cache_len if self.static else None
            pads = self.padding.of(attention_mask, batch, q_len, steps, True, mask_len)
            self.filled = True  # once the mask passed: a rejected prefill leaves the layer empty
            return self._prefill(query, key, value, pads, scale)
        if not self.static:  # a static step trusts transformers' mask: reading it would stop the step on the host
            self.padding.of(attention_mask, batch, q_len, self.seen, False)
        self.kv.append(key, value)
        return self.kv.attention(query, softmax_scale=scale, causal=True)

    def _prefill(self, query, key, value, pads, scale):
        """The first step: fake-quant inference forward on the step's bf16 K/V (what the model computes
        without a cache), then the K/V go into the cache. Left-padded rows are first shifted so each
        sequence starts at token 0, with its padding at the end, hidden from every real query."""
        if pads is None:
            self.kv.append(key, value)
            return attention(query, key, value, causal=True, softmax_scale=scale, layout="bhsd", mode="attn_qat")
        steps = key.shape[2]
        tokens = torch.arange(steps, device=key.device)
        lengths = steps - pads
        gather = (tokens[None, :] + pads[:, None]).clamp(max=steps - 1)  # row b, slot t <- token t + pads[b]
        real = tokens[None, :] < lengths[:, None]

        def to_front(x):
            moved = x.gather(2, gather[:, None, :, None].expand_as(x))
            return moved.masked_fill(~real[:, None, :, None], 0)

        q_front, k_front, v_front = to_front(query), to_front(key), to_front(value)
        self.kv.append(k_front, v_front, lengths=[steps - p for p in self.padding.host_pads])  # no device read
        out = attention(q_front, k_front, v_front, causal=True, softmax_scale=scale, layout="bhsd", mode="attn_qat")
        back = (tokens[None, :] - pads[:, None]).clamp(min=0)  # slot t <- front slot t - pads[b]
        out = out.gather(2, back[:, None, :, None].expand_as(out))
        return out.masked_fill(~(tokens[None, :] >= pads[:, None])[:, None, :, None], 0)

    def get_mask_sizes(self, query_length) -> Tuple[int, int]:
        if self.static:  # every step's mask spans the whole cache, so a compiled step keeps its shapes
            return self.max_cache_len, 0
        # transformers 4.x passes the step's cache_position tensor, 5.x the query length
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:  # transformers 4.x's name for get_max_length
        return self.max_cache_len

    def reset(self) -> None:
        if self.kv is not None:
            self.kv.reset()
        if self.static:  # in place, the kind kept: compiled steps hold the buffers' addresses
            if self.is_initialized:
                self.seen.zero_()
        else:
            if self.bf16:  # the next prefill finds out again which kind of layer this is
                self.bf16, self.keys, self.values, self.is_initialized = False, None, None, False
            self.seen = 0
        self.pending, self.filled = None, False
        self.padding.reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError(f"{_WHERE}: crop (assisted or speculative decoding) is not supported: NVFP4 V "
                                      "blocks cannot give tokens back")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(f"{_WHERE}: beam search is not supported; use greedy decoding or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.filled:
            raise NotImplementedError(f"{_WHERE}: expanding a filled cache is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.filled:
            raise NotImplementedError(f"{_WHERE}: selecting sequences of a filled cache is not supported")

    def offload(self):
        raise NotImplementedError(f"{_WHERE}: offloading is not supported")

    def prefetch(self):
        raise NotImplementedError(f"{_WHERE}: offloading is not supported")


class NVFP4Cache(Cache):
    """A transformers `Cache` that keeps each attention layer's keys and values in NVFP4
    (`attn_qat.NVFP4KVCache`, one per layer) for models running the "attn_qat" attention implementation.

    config: the model's config (its decoder part is read): the number of layers; every layer must be a
        full-attention layer (sliding-window, chunked and linear-attention layers are not supported).
    max_cache_len: tokens per sequence the cache holds, the prompt (with its padding) plus the generated
        tokens; storage is allocated up front at the first step, and exceeding it raises.

    static: layers whose decoding steps keep no host state, so that `generate` compiles them (torch.compile
        with CUDA graphs on a GPU, as for transformers' StaticCache): the first `generate` pays the compilation,
        later steps replay; reuse the cache (`reset()`) to keep them. A step past max_cache_len then fails on the
        device instead of raising a ValueError.

    Greedy decoding and sampling with batches of any size, with or without left padding; not beam search,
    assisted generation or offloading. Inference only (no gradients). See the module docstring for how prefill
    and decode steps are computed.
    """

    def __init__(self, config: PreTrainedConfig, max_cache_len: int, static: bool = False):
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"{_WHERE}: max_cache_len must be a positive int, got {max_cache_len!r}")
        if not isinstance(static, bool):
            raise TypeError(f"{_WHERE}: static must be a bool, got {static!r}")
        config = config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        others = sorted(set(layer_types) - {"full_attention"})
        if others:
            raise NotImplementedError(f"{_WHERE}: only full-attention layers are supported; this model has {others}")
        padding = _Padding()
        super().__init__(layers=[NVFP4CacheLayer(max_cache_len, padding, static) for _ in layer_types])
        # Some transformers 5.x releases (5.17) define Cache.max_cache_len as a read-only property that reads the
        # layers' max_cache_len, which the layers above already carry; later ones expect a plain attribute.
        if not isinstance(getattr(type(self), "max_cache_len", None), property):
            self.max_cache_len = max_cache_len
