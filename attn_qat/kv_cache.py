"""NVFP4 KV cache for decoding: keys and values stored as 4-bit E2M1 codes with E4M3 block scales,
3.56x smaller than bf16, and attention computed on them (issue 5).

Storage (numerics.md §2; blocks of 16 along the contraction axis of each product, E4M3 scales, the
layout Blackwell's block-scaled FP4 MMA consumes):

- K, blocked along head_dim, one token at a time: ``k_codes`` (B, Hkv, capacity, D/2) uint8 (channel 2i in
  the low nibble, 2i+1 in the high one) and ``k_scales`` (B, Hkv, capacity, D/16) uint8 E4M3 bytes.
- V, blocked along tokens: ``v_codes`` (B, Hkv, capacity/2, D) uint8 (token 2k of a channel in the low
  nibble, token 2k+1 in the high one) and ``v_scales`` (B, Hkv, capacity/16, D). A block is quantized once,
  when its 16th token arrives, and never again; until then the sequence's incomplete last block stays
  unquantized in ``v_tail`` (B, Hkv, 16, D), in the cache's dtype.

Numerics: `attention` computes numerics.md §3 (inference, no O') on Q^F (the queries fake-quantized along
D), K^F and a V whose complete blocks are V^F and whose incomplete last block is the raw values: P is
quantized as in training (fq16(P̂ * 2^11) * 2^-11 in 16-key blocks counted from key 0). It is the training
forward's O except for the tail block, which the training forward would quantize (numerics.md §8 explains
why a cache cannot reproduce that exactly). `attn_qat.reference.attention_forward(...,
operands_quantized=True)` is the float64 definition the tests compare with.

Paths: on CUDA with 1 to 16 query tokens the decode kernel (csrc/decode_cuda.cu) reads the packed cache
directly: split over the context, the query heads of a KV group on the tensor cores. Otherwise (the CPU,
or more than 16 query tokens) a composite path dequantizes K and V into dtype buffers and runs the
attention forward kernel on them, with a mask for the per-sequence lengths: correct, but it reads the
cache at bf16 size. There is no paged variant (block table) yet: each sequence owns `capacity` tokens.
"""
import math
from typing import Optional, Sequence, Union

import torch

from . import _C
from .attention import SUPPORTED_HEAD_DIMS
from .ops import CAUSAL_NONE, ops

BLOCK = 16
MAX_KERNEL_QUERIES = 16  # query tokens the CUDA decode kernel takes; more use the composite path


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"attn_qat.NVFP4KVCache: {name} must be a positive int, got {value!r}")
    return value


class NVFP4KVCache:
    """A preallocated NVFP4 KV cache for `batch` sequences of up to `capacity` tokens (rounded up to a
    multiple of 16), `heads_kv` heads of `head_dim` (64 or 128) channels, appended to in `dtype`
    (bfloat16 or float16). Sequences grow independently: `lengths` (int64 (batch,) on the cache's
    device; read it, do not modify it) says how many tokens each holds. No autograd."""

    def __init__(self, batch: int, heads_kv: int, head_dim: int, capacity: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: Union[str, torch.device, None] = None):
        self.batch = _positive_int("batch", batch)
        self.heads_kv = _positive_int("heads_kv", heads_kv)
        capacity = _positive_int("capacity", capacity)
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"attn_qat.NVFP4KVCache: head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim!r}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"attn_qat.NVFP4KVCache: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        self.head_dim, self.dtype = head_dim, dtype
        self.capacity = -(-capacity // BLOCK) * BLOCK
        self.device = torch.empty(0, device=device).device  # the default device for None; "cuda" gets its index
        b, h, n, d = self.batch, self.heads_kv, self.capacity, head_dim
        zeros = dict(dtype=torch.uint8, device=self.device)
        self.k_codes = torch.zeros(b, h, n, d // 2, **zeros)
        self.k_scales = torch.zeros(b, h, n, d // BLOCK, **zeros)
        self.v_codes = torch.zeros(b, h, n // 2, d, **zeros)
        self.v_scales = torch.zeros(b, h, n // BLOCK, d, **zeros)
        self.v_tail = torch.zeros(b, h, BLOCK, d, dtype=dtype, device=self.device)
        self._lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        self._host_lengths = [0] * b  # the same numbers, so no call needs to read them back from the device

    # ------------------------------------------------------------------------------------------
    # State

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens stored per sequence, int64 (batch,) on the cache's device."""
        return self._lengths

    def reset(self) -> None:
        """Empties every sequence (the buffers keep their memory and stale contents, which nothing reads)."""
        self._host_lengths = [0] * self.batch
        self._lengths.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes of device memory the cache holds."""
        return sum(t.numel() * t.element_size() for t in
                   (self.k_codes, self.k_scales, self.v_codes, self.v_scales, self.v_tail, self._lengths))

    @property
    def bytes_per_token(self) -> int:
        """Packed bytes one token of one sequence takes (K and V codes and scales, all KV heads): 9/32 of
        bf16's, or 3.56x smaller."""
        return self.heads_kv * 2 * (self.head_dim // 2 + self.head_dim // BLOCK)

    def __repr__(self) -> str:
        return (f"NVFP4KVCache(batch={self.batch}, heads_kv={self.heads_kv}, head_dim={self.head_dim}, "
                f"capacity={self.capacity}, dtype={self.dtype}, device={self.device}, "
                f"lengths={self._host_lengths})")

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

    def _counts(self, lengths, tokens: int) -> list:
        if lengths is None:
            return [tokens] * self.batch
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
        return counts

    def append(self, k: torch.Tensor, v: torch.Tensor, lengths: Union[torch.Tensor, Sequence[int], None] = None):
        """Appends new tokens: k, v (batch, heads_kv, T, head_dim) in the cache's dtype and device.
        `lengths` (int tensor or list, (batch,)) says how many of the T tokens are real for each sequence
        (the first lengths[b]; default all T), so sequences can grow unequally. Keys are quantized at once;
        values join their sequence's unquantized tail and are quantized one full 16-token block at a time."""
        self._check_new("k", k)
        self._check_new("v", v)
        if k.shape != v.shape:
            raise ValueError(f"attn_qat.NVFP4KVCache.append: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        counts = self._counts(lengths, k.shape[2])
        held = self._host_lengths
        over = [(b, held[b], c) for b, c in enumerate(counts) if held[b] + c > self.capacity]
        if over:
            b, held, c = over[0]
            raise ValueError(f"attn_qat.NVFP4KVCache.append: sequence {b} holds {held} tokens; {c} more exceed the "
                             f"capacity of {self.capacity}")
        if not any(counts):
            return
        with torch.no_grad():
            self._store(k, v, counts)
        self._host_lengths = [n + c for n, c in zip(self._host_lengths, counts)]
        self._lengths.copy_(torch.tensor(self._host_lengths, dtype=torch.long))

    def _store(self, k: torch.Tensor, v: torch.Tensor, counts: list) -> None:
        held = self._host_lengths
        rem = [n % BLOCK for n in held]  # tokens in each tail
        # Every real (sequence, token) pair: its place in k / v, in the cache, and in the tail-plus-new buffer.
        pairs = [(b, t, held[b] + t, rem[b] + t) for b, c in enumerate(counts) for t in range(c)]
        b_idx, t_idx, cache_pos, work_pos = torch.tensor(pairs, dtype=torch.long).t().to(self.device).unbind(0)

        codes, scales = ops.nvfp4_quantize(k, 3)
        self.k_codes[b_idx, :, cache_pos] = codes[b_idx, :, t_idx]
        self.k_scales[b_idx, :, cache_pos] = scales.view(torch.uint8)[b_idx, :, t_idx]

        full = [(r + c) // BLOCK for r, c in zip(rem, counts)]  # blocks completed per sequence
        if not any(full):  # the new values only extend the tails
            self.v_tail[b_idx, :, work_pos] = v[b_idx, :, t_idx]
            return
        # work[b] = tail tokens, then the new ones; its first full[b] blocks are quantized and stored, what
        # follows them is the new tail. Blocks past full[b] hold stale or zero values and are not stored.
        width = BLOCK * (max(full) + 1)
        work = v.new_zeros(self.batch, self.heads_kv, width, self.head_dim)
        work[:, :, :BLOCK] = self.v_tail
        work[b_idx, :, work_pos] = v[b_idx, :, t_idx]
        codes, scales = ops.nvfp4_quantize(work, 2)
        blocks = [(b, j, held[b] // BLOCK + j) for b in range(self.batch) for j in range(full[b])]
        b_blk, src_blk, dst_blk = torch.tensor(blocks, dtype=torch.long).t().to(self.device).unbind(0)
        pair_rows = BLOCK // 2  # rows of two tokens per block
        by_block = (self.batch, self.heads_kv, -1, pair_rows, self.head_dim)
        self.v_codes.view(by_block)[b_blk, :, dst_blk] = codes.view(by_block)[b_blk, :, src_blk]
        self.v_scales[b_blk, :, dst_blk] = scales.view(torch.uint8)[b_blk, :, src_blk]
        start = torch.tensor([BLOCK * f for f in full], dtype=torch.long).to(self.device)
        tail_pos = (start[:, None] + torch.arange(BLOCK, device=self.device))[:, None, :, None]
        self.v_tail.copy_(work.gather(2, tail_pos.expand(self.batch, self.heads_kv, BLOCK, self.head_dim)))

    # ------------------------------------------------------------------------------------------
    # Attention

    def attention(self, q: torch.Tensor, *, softmax_scale: Optional[float] = None, causal: bool = True) -> torch.Tensor:
        """Attention of q (batch, heads_q, Tq, head_dim), heads_q a multiple of heads_kv (query head h reads KV
        head h // (heads_q // heads_kv)), to the cached tokens. The Tq queries are the last Tq tokens of each
        sequence (already appended): with `causal` (bottom-right aligned per sequence) query t of sequence b
        sees keys j <= lengths[b] - Tq + t, else all lengths[b] keys; a query with no visible key (a sequence
        shorter than Tq) gets 0. `softmax_scale` defaults to 1/sqrt(head_dim). Returns (batch, heads_q, Tq,
        head_dim) in q's dtype, which must be the cache's. Any Tq >= 1; above 16 (or on the CPU) it takes the
        composite path."""
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
            if q.is_cuda and q.shape[2] <= MAX_KERNEL_QUERIES and _C.with_cuda:
                return ops.kv_cache_decode(q, self.k_codes, self.k_scales, self.v_codes, self.v_scales, self.v_tail,
                                           self._lengths, max(self._host_lengths), scale, bool(causal))
            return self._attention_composite(q, scale, bool(causal))

    def dequantized(self):
        """(K, V) as (batch, heads_kv, max(lengths), head_dim) tensors in the cache's dtype: K^F, and V^F for
        the complete blocks followed by each sequence's unquantized tail. Positions at or past a sequence's
        length hold stale values."""
        n = max(self._host_lengths)
        b, h, d = self.batch, self.heads_kv, self.head_dim
        if n == 0:
            return (self.v_tail.new_empty(b, h, 0, d),) * 2
        k = ops.nvfp4_dequantize(self.k_codes[:, :, :n], self.k_scales[:, :, :n].view(torch.float8_e4m3fn), 3, d,
                                 self.dtype)
        blocks = -(-n // BLOCK)
        v = ops.nvfp4_dequantize(self.v_codes[:, :, :blocks * BLOCK // 2],
                                 self.v_scales[:, :, :blocks].view(torch.float8_e4m3fn), 2, blocks * BLOCK, self.dtype)
        v = torch.cat([v, v.new_zeros(b, h, BLOCK, d)], dim=2)  # room for a tail that starts at `blocks`
        start = torch.tensor([BLOCK * (m // BLOCK) for m in self._host_lengths], dtype=torch.long).to(self.device)
        tail_pos = (start[:, None] + torch.arange(BLOCK, device=self.device))[:, None, :, None]
        v.scatter_(2, tail_pos.expand(b, h, BLOCK, d), self.v_tail)
        return k, v[:, :, :n]

    def _attention_composite(self, q: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
        """The attention forward kernel on the dequantized cache, a mask carrying the lengths."""
        n = max(self._host_lengths)
        if n == 0:
            return q.new_zeros(q.shape)
        k, v = self.dequantized()
        batch, heads_q, tq, _ = q.shape
        keys = torch.arange(n, device=self.device)
        length = self._lengths[:, None, None]
        visible = keys < length  # (batch, 1, n)
        if causal:
            visible = visible & (keys <= length - tq + torch.arange(tq, device=self.device)[:, None])
        mask = torch.zeros(visible.shape, dtype=torch.float32, device=self.device).masked_fill(~visible, float("-inf"))
        mask = mask[:, None].expand(batch, heads_q, tq, n)
        q_fq = ops.nvfp4_fake_quantize(q, 3)
        return ops.attention_forward_prequantized(q_fq, k, v, mask, scale, CAUSAL_NONE)[0]
