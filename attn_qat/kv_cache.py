"""NVFP4 KV cache for decoding: keys and values stored as 4-bit E2M1 codes with E4M3 block scales,
3.56x smaller than bf16, and attention computed on them.

Storage (numerics.md §2: a decoding query does not see every key, so K and V are both blocked along head_dim,
16 channels of one token, E4M3 scales), in pages of `page_size` tokens (a multiple of 16):

- K: ``k_codes`` (num_pages, Hkv, page_size, D/2) uint8 (channel 2i in the low nibble, 2i+1 in the high one) and
  ``k_scales`` (num_pages, Hkv, page_size, D/16) uint8 E4M3 bytes.
- V: the same per-token codes and scales, arranged for the decode kernel (csrc/attn_qat.h): ``v_codes``
  (num_pages, Hkv, page_size/2, D) holds tokens 2p and 2p+1 in row p, interleaved by 16-bit halves (half 0 of
  token 2p, half 0 of token 2p+1, half 1 of token 2p, ...), and ``v_scales`` (num_pages, Hkv, page_size/16, D)
  holds each 16-token unit's scales block-major, its tokens in the order 0, 1, 8, 9, 2, 3, 10, 11, ....
  `dequantized` undoes the arrangement.
- Each token is quantized once, when it is appended, and never again: the cache holds exactly the K^F and V^F the
  training forward of a causal model computes with. One op (`kv_cache_append`, csrc/decode/kv_append.h, CPU and CUDA)
  quantizes the new tokens, scatters them into the pages and advances the lengths on the device.
- ``block_table`` (B, capacity / page_size) int32: token j of sequence b lives at token j % page_size of page
  block_table[b, j // page_size] (-1: no page yet).

Unpaged (the default), each sequence owns one page of `capacity` tokens, page b for sequence b, so the buffers
are (B, Hkv, capacity, ...). Paged (`page_size=`), the sequences draw pages from a shared pool of `num_pages` as
they grow and give them back on `reset`: memory follows the tokens held, not batch x capacity.

Numerics: `attention` computes numerics.md §3 (inference, no O') on Q^F (the queries fake-quantized along
D), K^F and V^F: P is quantized as in training (fq16(P̂ * 2^11) * 2^-11 in 16-key blocks counted from the
sequence's first key). For a causal prefix it is the training forward's O (`attn_qat.attention(...,
causal=True)`), up to the fp32 summation order of the kernels. `attn_qat.reference.attention_forward(...,
operands_quantized=True)` is the float64 definition the tests compare with.

Static (`static=True`, unpaged): the cache keeps no host copy of the lengths, so appending and attending read
and write device memory only: a step is capturable by CUDA graphs and traceable by torch.compile with no graph
break and no recompilation (`attn_qat.NVFP4Cache(..., static=True)` is transformers' compiled decoding on it).
Attention then plans for `capacity` keys (the kernel skips a sequence's empty part), and an append past the
capacity fails on the device (`torch._assert_async`; on CUDA a device-side assert, fatal to the process's CUDA
context, as an out-of-range index is): size `capacity` for the prompt plus every token to be generated.

Paths: on CUDA with 1 to 16 query tokens the decode kernel (csrc/decode/decode_cuda.cu) reads the packed cache
directly: split over the context, the query heads of a KV group on the tensor cores. Otherwise (the CPU,
or more than 16 query tokens) a composite path dequantizes K and V into dtype buffers and runs the
attention forward kernel on them, with a mask for the per-sequence lengths: correct, but it reads the
cache at bf16 size.
"""
import math
from typing import Optional, Sequence, Union

import torch

from . import _C
from .ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, ops, positive_scale

BLOCK = 16
DECODE_HEAD_DIMS = _C.DECODE_HEAD_DIMS  # the CUDA decode kernel's head dims; others take the composite path
MAX_KERNEL_QUERIES = 16  # query tokens the CUDA decode kernel takes; more use the composite path


def mark_static(*tensors: torch.Tensor) -> None:
    """Tells torch.compile that these buffers keep their addresses from call to call, so that CUDA graphs read and
    write them in place instead of copying them in and out (as transformers' StaticLayer marks its own)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"attn_qat.NVFP4KVCache: {name} must be a positive int, got {value!r}")
    return value


class NVFP4KVCache:
    """A preallocated NVFP4 KV cache for `batch` sequences of up to `capacity` tokens (rounded up to a
    multiple of 16, or of `page_size`), `heads_kv` heads of `head_dim` (a multiple of 16 from 32 to 256)
    channels, appended to in `dtype` (bfloat16 or float16). Sequences grow independently: `lengths` (int64
    (batch,) on the cache's device; read it, do not modify it) says how many tokens each holds. No autograd.

    With `page_size` (a multiple of 16) the cache is paged: a pool of `num_pages` pages (default: enough for
    every sequence to reach `capacity`) that sequences take from as they grow and return with `reset`; a pool
    smaller than batch * capacity serves sequences of unequal lengths in less memory, and an append that finds
    no free page raises.

    With `static=True` (unpaged only) the lengths live on the device alone: no call reads them back, so `append`
    (with `lengths` None or a device tensor: a list is copied from the host) and `attention` can be captured in a
    CUDA graph or compiled; the module docstring says what that costs."""

    def __init__(self, batch: int, heads_kv: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: Union[str, torch.device, None] = None,
                 page_size: Optional[int] = None, num_pages: Optional[int] = None, static: bool = False):
        if not isinstance(static, bool):
            raise TypeError(f"attn_qat.NVFP4KVCache: static must be a bool, got {static!r}")
        if static and page_size is not None:
            raise ValueError("attn_qat.NVFP4KVCache: a static cache is unpaged (pages are allotted on the host); "
                             "leave page_size unset")
        self.static = static
        self.batch = _positive_int("batch", batch)
        self.heads_kv = _positive_int("heads_kv", heads_kv)
        capacity = _positive_int("capacity", capacity)
        if head_dim not in _C.HEAD_DIMS:
            raise ValueError(f"attn_qat.NVFP4KVCache: head_dim must be {_C.HEAD_DIMS_TEXT}, got {head_dim!r}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"attn_qat.NVFP4KVCache: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.head_dim, self.dtype = head_dim, dtype
        self.device = torch.empty(0, device=device).device  # the default device for None; "cuda" gets its index
        self.paged = page_size is not None
        if self.paged:
            if _positive_int("page_size", page_size) % BLOCK:
                raise ValueError(f"attn_qat.NVFP4KVCache: page_size must be a multiple of {BLOCK}, got {page_size}")
            pages_per_seq = -(-capacity // page_size)
            num_pages = self.batch * pages_per_seq if num_pages is None else _positive_int("num_pages", num_pages)
        else:
            if num_pages is not None:
                raise ValueError("attn_qat.NVFP4KVCache: num_pages needs page_size (a paged cache)")
            page_size, pages_per_seq, num_pages = -(-capacity // BLOCK) * BLOCK, 1, self.batch
        self.page_size, self.num_pages = page_size, num_pages
        self.capacity = pages_per_seq * page_size
        p, h, n, d = num_pages, self.heads_kv, page_size, head_dim
        zeros = dict(dtype=torch.uint8, device=self.device)
        self.k_codes = torch.zeros(p, h, n, d // 2, **zeros)
        self.k_scales = torch.zeros(p, h, n, d // BLOCK, **zeros)
        self.v_codes = torch.zeros(p, h, n // 2, d, **zeros)
        self.v_scales = torch.zeros(p, h, n // BLOCK, d, **zeros)
        self._lengths = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        # The same numbers on the host, so no call needs to read them back from the device (None when static: the
        # device alone knows them), and their maximum, which every decode call passes (a static cache passes capacity).
        self._host_lengths = None if static else [0] * self.batch
        self._max_length = self.capacity if static else 0
        # The pages of each sequence in token order (host copy of block_table's rows), and the free pages.
        self._pages = [[] for _ in range(self.batch)] if self.paged else [[b] for b in range(self.batch)]
        self._free = list(range(num_pages - 1, -1, -1)) if self.paged else []  # pop() takes the lowest first
        self.block_table = torch.full((self.batch, pages_per_seq), -1, dtype=torch.int32, device=self.device)
        self._sync_block_table()
        if static:
            mark_static(self.k_codes, self.k_scales, self.v_codes, self.v_scales, self._lengths, self.block_table)

    # ------------------------------------------------------------------------------------------
    # State

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens stored per sequence, int64 (batch,) on the cache's device."""
        return self._lengths

    def reset(self, sequences: Optional[Sequence[int]] = None) -> None:
        """Empties the given sequences (default: all); a paged cache returns their pages to the pool. The buffers
        keep their memory and stale contents, which nothing reads."""
        chosen = range(self.batch) if sequences is None else list(sequences)
        if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.batch for b in chosen):
            raise ValueError(f"attn_qat.NVFP4KVCache.reset: sequences must be ints in [0, {self.batch}), "
                             f"got {sequences!r}")
        if self.static:
            if sequences is None:
                self._lengths.zero_()
            else:
                self._not_capturing("reset(sequences) copies the sequence numbers from the host; reset() does not")
                self._lengths[torch.tensor(chosen, dtype=torch.long, device=self.device)] = 0
            return
        for b in chosen:
            self._host_lengths[b] = 0
            if self.paged:
                self._free.extend(reversed(self._pages[b]))
                self._pages[b] = []
        self._max_length = max(self._host_lengths)
        self._lengths.copy_(self._staged(self._host_lengths, torch.long), non_blocking=True)
        self._sync_block_table()

    @property
    def free_pages(self) -> int:
        """Pages of the pool no sequence holds (0 for an unpaged cache, whose pages are all owned)."""
        return len(self._free)

    def _sync_block_table(self) -> None:
        rows = [pages + [-1] * (self.block_table.shape[1] - len(pages)) for pages in self._pages]
        self.block_table.copy_(self._staged(rows, torch.int32), non_blocking=True)

    def _staged(self, values, dtype: torch.dtype) -> torch.Tensor:
        """`values` as a host tensor to copy to the cache's device. On a GPU it is pinned, so that the copy is queued
        on the stream (from pageable memory CUDA first waits for the stream to drain; torch's pinned-memory
        allocator keeps the buffer alive until the copy is done)."""
        host = torch.tensor(values, dtype=dtype)
        return host.pin_memory() if self.device.type == "cuda" else host

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the cache holds."""
        return sum(t.numel() * t.element_size() for t in
                   (self.k_codes, self.k_scales, self.v_codes, self.v_scales, self._lengths, self.block_table))

    @property
    def bytes_per_token(self) -> int:
        """Packed bytes one token of one sequence takes (K and V codes and scales, all KV heads): 9/32 of
        bf16's, or 3.56x smaller."""
        return self.heads_kv * 2 * (self.head_dim // 2 + self.head_dim // BLOCK)

    def __repr__(self) -> str:
        return (f"NVFP4KVCache(batch={self.batch}, heads_kv={self.heads_kv}, head_dim={self.head_dim}, "
                f"capacity={self.capacity}, dtype={self.dtype}, device={self.device}, "
                + (f"page_size={self.page_size}, num_pages={self.num_pages}, free_pages={self.free_pages}, "
                   if self.paged else "") + ("static=True)" if self.static else f"lengths={self._host_lengths})"))

    # ------------------------------------------------------------------------------------------
    # Append

    def _check_new(self, name: str, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"attn_qat.NVFP4KVCache.append: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.dtype:
            raise TypeError(f"attn_qat.NVFP4KVCache.append: {name} has dtype {x.dtype}, the cache holds {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"attn_qat.NVFP4KVCache.append: {name} is on {x.device}, the cache on {self.device}")
        if x.dim() != 4 or x.shape[0] != self.batch or x.shape[1] != self.heads_kv or x.shape[3] != self.head_dim:
            raise ValueError(f"attn_qat.NVFP4KVCache.append: {name} must be (batch, heads_kv, tokens, head_dim) = "
                             f"({self.batch}, {self.heads_kv}, T, {self.head_dim}), got {tuple(x.shape)}")

    def _counts(self, lengths, tokens: int) -> Optional[list]:
        """The tokens each sequence appends, or None when every sequence appends all `tokens`."""
        if lengths is None:
            return None
        if isinstance(lengths, torch.Tensor):
            if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex():
                raise ValueError("attn_qat.NVFP4KVCache.append: lengths must be a 1-D integer tensor or a list")
            lengths = lengths.tolist()
        counts = list(lengths)
        if len(counts) != self.batch or any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
            raise ValueError(f"attn_qat.NVFP4KVCache.append: lengths must hold {self.batch} ints, got {lengths!r}")
        bad = [c for c in counts if not 0 <= c <= tokens]
        if bad:
            raise ValueError(f"attn_qat.NVFP4KVCache.append: lengths must be in [0, {tokens}] (the tokens passed), "
                             f"got {counts}")
        return None if all(c == tokens for c in counts) else counts

    def append(self, k: torch.Tensor, v: torch.Tensor, lengths: Union[torch.Tensor, Sequence[int], None] = None):
        """Appends new tokens: k, v (batch, heads_kv, T, head_dim) in the cache's dtype and device.
        `lengths` (int tensor or list, (batch,)) says how many of the T tokens are real for each sequence
        (the first lengths[b]; default all T), so sequences can grow unequally. Each token's key and value are
        quantized at once, along head_dim."""
        self._check_new("k", k)
        self._check_new("v", v)
        if k.shape != v.shape:
            raise ValueError(f"attn_qat.NVFP4KVCache.append: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        if self.static:
            self._append_static(k, v, lengths)
            return
        tokens = k.shape[2]
        counts = self._counts(lengths, tokens)
        held = self._host_lengths
        if counts is None:  # every sequence appends all T (a decode step): no per-sequence list to check
            if tokens == 0:
                return
            grown = [n + tokens for n in held]
            full = self._max_length + tokens > self.capacity
        else:
            if not any(counts):
                return
            grown = [n + c for n, c in zip(held, counts)]
            full = max(grown) > self.capacity
        if full:
            b = next(b for b, n in enumerate(grown) if n > self.capacity)
            raise ValueError(f"attn_qat.NVFP4KVCache.append: sequence {b} holds {held[b]} tokens; {grown[b] - held[b]} "
                             f"more exceed the capacity of {self.capacity}")
        new_pages = None  # pages each sequence takes from the pool, when any does
        if self.paged:
            needed = [max(0, -(-n // self.page_size) - len(pages)) for n, pages in zip(grown, self._pages)]
            if any(needed):
                if sum(needed) > len(self._free):
                    raise ValueError(f"attn_qat.NVFP4KVCache.append: out of pages: the append needs {sum(needed)} "
                                     f"more pages of {self.page_size} tokens, {len(self._free)} of the pool's "
                                     f"{self.num_pages} are free (reset finished sequences, or make num_pages larger)")
                for pages, extra in zip(self._pages, needed):
                    pages.extend(self._free.pop() for _ in range(extra))
                self._sync_block_table()
                new_pages = needed
        try:
            self._store(k, v, counts)
        except BaseException:  # a failed store (out of memory, say) gives its pages back: the append changed nothing
            self._lengths.copy_(self._staged(self._host_lengths, torch.long))  # in case the device's moved on
            if new_pages is not None:
                for pages, extra in zip(self._pages, new_pages):
                    for _ in range(extra):
                        self._free.append(pages.pop())
                self._sync_block_table()
            raise
        self._host_lengths = grown
        self._max_length = max(grown)

    def _append_static(self, k: torch.Tensor, v: torch.Tensor, lengths) -> None:
        """`append` with no host state: a device `lengths` tensor is checked on the device, and so is the capacity
        (before anything is written), by `torch._assert_async`."""
        tokens = k.shape[2]
        if isinstance(lengths, torch.Tensor):
            if lengths.shape != (self.batch,) or lengths.is_floating_point() or lengths.is_complex() \
                    or lengths.dtype == torch.bool:
                raise ValueError(f"attn_qat.NVFP4KVCache.append: lengths must be an integer ({self.batch},) tensor, "
                                 f"got {lengths.dtype} {tuple(lengths.shape)}")
            if lengths.device != self.device:
                raise ValueError(f"attn_qat.NVFP4KVCache.append: a static cache takes lengths on its device "
                                 f"({self.device}), got {lengths.device}")
            counts = lengths.to(torch.long).contiguous()
            torch._assert_async(((counts >= 0) & (counts <= tokens)).all(),
                                f"attn_qat.NVFP4KVCache.append: lengths must be in [0, {tokens}] (the tokens passed)")
            grown = self._lengths + counts
        else:
            listed = self._counts(lengths, tokens)
            if listed is not None:
                self._not_capturing("a list of lengths is copied from the host; pass a device tensor")
            counts = None if listed is None else self._staged(listed, torch.long).to(self.device, non_blocking=True)
            grown = self._lengths + (tokens if counts is None else counts)
        torch._assert_async((grown <= self.capacity).all(),
                            f"attn_qat.NVFP4KVCache.append: an append exceeds the static cache's capacity of "
                            f"{self.capacity} tokens a sequence")
        with torch.no_grad():
            ops.kv_cache_append(k, v, counts, self._lengths, self.block_table, self.k_codes, self.k_scales,
                                self.v_codes, self.v_scales)

    def _not_capturing(self, why: str) -> None:
        """Raises when the current CUDA stream is being captured into a graph, whose replays could not redo a copy
        from the host."""
        capturing = self.device.type == "cuda" and not torch.compiler.is_compiling()
        if capturing and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attn_qat.NVFP4KVCache: inside a CUDA graph capture: {why}")

    def _store(self, k: torch.Tensor, v: torch.Tensor, counts: Optional[list]) -> None:
        """Quantizes the first counts[b] tokens of each sequence (all of them for None) along head_dim and stores them
        at positions lengths[b] onwards, then advances lengths, on the device (csrc/decode/kv_append.h): one op, and
        when every sequence appends all its tokens (a decode step) no host-to-device copy either."""
        per_sequence = None if counts is None else \
            self._staged(counts, torch.long).to(self.device, non_blocking=True)
        with torch.no_grad():
            ops.kv_cache_append(k, v, per_sequence, self._lengths, self.block_table, self.k_codes, self.k_scales,
                                self.v_codes, self.v_scales)

    # ------------------------------------------------------------------------------------------
    # Attention

    def attention(self, q: torch.Tensor, *, softmax_scale: Optional[float] = None, causal: bool = True) -> torch.Tensor:
        """Attention of q (batch, heads_q, Tq, head_dim), heads_q a multiple of heads_kv (query head h reads KV
        head h // (heads_q // heads_kv)), to the cached tokens. The Tq queries are the last Tq tokens of each
        sequence (already appended): with `causal` (bottom-right aligned per sequence) query t of sequence b
        sees keys j <= lengths[b] - Tq + t, else all lengths[b] keys; a query with no visible key (a sequence
        shorter than Tq) gets 0. `softmax_scale` defaults to 1/sqrt(head_dim). Returns (batch, heads_q, Tq,
        head_dim) in q's dtype, which must be the cache's. Any Tq >= 1; above 16, on the CPU, or at head dims
        other than 64 and 128 (the decode kernel's) it takes the composite path. V is blocked along head_dim whether
        or not `causal` (the cache stores it so), unlike `attn_qat.attention(..., causal=False)`, which blocks it
        along tokens (numerics.md §2)."""
        fn = "attn_qat.NVFP4KVCache.attention"
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"{fn}: q must be a torch.Tensor, got {type(q).__name__}")
        if q.dim() != 4 or q.shape[0] != self.batch or q.shape[3] != self.head_dim or q.shape[2] < 1:
            raise ValueError(f"{fn}: q must be (batch, heads_q, Tq >= 1, head_dim) with batch {self.batch} and "
                             f"head_dim {self.head_dim}, got {tuple(q.shape)}")
        if q.shape[1] < 1 or q.shape[1] % self.heads_kv:
            raise ValueError(f"{fn}: query heads ({q.shape[1]}) must be a multiple of the cache's KV heads "
                             f"({self.heads_kv})")
        if q.dtype != self.dtype:
            raise TypeError(f"{fn}: q has dtype {q.dtype}, the cache holds {self.dtype}")
        if q.device != self.device:
            raise ValueError(f"{fn}: q is on {q.device}, the cache on {self.device}")
        scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        with torch.no_grad():
            if q.is_cuda and q.shape[2] <= MAX_KERNEL_QUERIES and _C.with_cuda and self.head_dim in DECODE_HEAD_DIMS:
                q, scale = positive_scale(q, scale)  # the kernel takes scale > 0 (ops.positive_scale)
                return ops.kv_cache_decode(q, self.k_codes, self.k_scales, self.v_codes, self.v_scales, self._lengths,
                                           self.block_table, self._max_length, scale, bool(causal))
            return self._attention_composite(q, scale, bool(causal))

    def dequantized(self):
        """(K, V) as (batch, heads_kv, max(lengths), head_dim) tensors in the cache's dtype: K^F and V^F. Positions
        at or past a sequence's length hold stale values; a static cache returns all `capacity` positions."""
        n = self._max_length if self.static else max(self._host_lengths)
        b, h, d = self.batch, self.heads_kv, self.head_dim
        if n == 0:
            return tuple(torch.empty(b, h, 0, d, dtype=self.dtype, device=self.device) for _ in range(2))
        pairs, units = -(-n // 2), -(-n // BLOCK)
        v_codes = self._by_sequence(self.v_codes, pairs).reshape(b, h, pairs, d // 4, 2, 2).transpose(3, 4)
        v_scales = self._by_sequence(self.v_scales, units).reshape(b, h, units, d // BLOCK, 4, 2, 2)
        v_scales = v_scales.permute(0, 1, 2, 5, 4, 6, 3)  # (b, h, unit, r // 8, (r % 8) // 2, r % 2, block)
        per_token = ((self._by_sequence(self.k_codes, n), self._by_sequence(self.k_scales, n)),
                     (v_codes.reshape(b, h, 2 * pairs, d // 2)[:, :, :n],
                      v_scales.reshape(b, h, BLOCK * units, d // BLOCK)[:, :, :n]))
        return tuple(ops.nvfp4_dequantize(codes.contiguous(), scales.contiguous().view(torch.float8_e4m3fn), 3, d,
                                          self.dtype) for codes, scales in per_token)

    def _by_sequence(self, pool: torch.Tensor, rows: int) -> torch.Tensor:
        """The first `rows` rows of each sequence from a pool buffer (num_pages, Hkv, rows a page, X), as
        (batch, Hkv, rows, X): the pages of each sequence in order (page 0, stale, where it has none yet)."""
        if not self.paged:
            return pool[:, :, :rows]
        per_page = pool.shape[2]
        count = -(-rows // per_page)
        table = torch.tensor([(pages + [0] * count)[:count] for pages in self._pages], device=self.device)
        x = pool[table].transpose(1, 2)  # (batch, Hkv, pages, rows a page, X)
        return x.reshape(self.batch, self.heads_kv, count * per_page, -1)[:, :, :rows]

    def _attention_composite(self, q: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
        """The attention forward kernel on the dequantized cache: with the causal flag alone when every sequence
        holds the same number of tokens (the call the training forward makes, so on the CPU the result is that
        forward's bit for bit), else (and always in a static cache) with a mask carrying the lengths."""
        n = self._max_length if self.static else max(self._host_lengths)
        if n == 0:
            return q.new_zeros(q.shape)
        k, v = self.dequantized()
        q_fq, scale = positive_scale(ops.nvfp4_fake_quantize(q, 3), scale)
        if not self.static and min(self._host_lengths) == n:
            return ops.attention_forward_prequantized(q_fq, k, v, None, scale,
                                                      CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE)[0]
        batch, heads_q, tq, _ = q.shape
        keys = torch.arange(n, device=self.device)
        length = self._lengths[:, None, None]
        visible = keys < length  # (batch, 1, n)
        if causal:
            visible = visible & (keys <= length - tq + torch.arange(tq, device=self.device)[:, None])
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=self.device).masked_fill(~visible, float("-inf"))
        mask = mask[:, None].expand(batch, heads_q, tq, n)
        return ops.attention_forward_prequantized(q_fq, k, v, mask, scale, CAUSAL_NONE)[0]
