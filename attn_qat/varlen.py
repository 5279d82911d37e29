"""Packed-sequence ("varlen") attention: flash_attn_varlen_func's interface on attn_qat's kernels.

Several sequences packed along one token axis, q (total_q, H, D) and k, v (total_k, H_kv, D), with cumulative
lengths cu_seqlens_q and cu_seqlens_k, attend each within its own sequence. The result equals each sequence run alone
through `attn_qat.attention` (numerics.md §2, "Packed sequences"): the keys of the other sequences are hidden keys,
and the 16-element blocks of P and V are counted from each sequence's first key.

How it runs. The kernels see the packed tensors as a batch of one and learn which keys each token sees from two
small int32 tables (`_Plan`: the spans of csrc/attn_qat.h), so a query tile visits only the key tiles of its own
sequence and the cost is that of the sequences run as a batch. P and V are blocked along the keys' axis in blocks of
16 counted from key 0, so each sequence's keys must start at a multiple of 16: when every cu_seqlens_k entry is one,
the call runs on the tensors in place; otherwise K and V are copied into a packed layout whose sequences are padded
with zero rows to multiples of 16 (differentiable indexing, so autograd returns dK and dV of the original rows). The
queries are never copied: their blocks run along head_dim and their rows are independent.
"""
import functools
import math
import threading
import weakref
from typing import Optional, Sequence, Tuple, Union

import torch

from . import _C
from .attention import _EmptyAttention, _check_qkv, _output, _output_dtype, lse_from_stats
from .host_cache import version_of
from .ops import (CAUSAL_NONE, check_softmax_scale, makes_o_prime, mode_code, mode_has, ops, positive_scale,
                  v_along_tokens)

BLOCK = 16  # numerics.md §1: the tokens of a P or V block
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
# The Hopper kernels' tiles (csrc/sm90/tile_shapes.h): the dK/dV kernel's items are tiles of DKDV_KEYS keys of a KV
# head, which visit DKDV_Q_STEP queries a step; the forward's are query tiles over key tiles (_fwd_tiles).
DKDV_KEYS, DKDV_Q_STEP = _C.SM90_DKDV_KEYS, _C.SM90_DKDV_Q_STEP

__all__ = ["attention_varlen"]


def _alignment(causal, fn: str) -> Optional[str]:
    """None (not causal), "top_left" or "bottom_right"; True means bottom-right, as in flash_attn_varlen_func."""
    if causal is False or causal is None:
        return None
    if causal is True:
        return "bottom_right"
    if isinstance(causal, str) and causal in CAUSAL_ALIGNMENTS:
        return causal
    raise ValueError(f"attn_qat.{fn}: causal must be False, True (bottom-right, like flash_attn_varlen_func), "
                     f"'top_left' or 'bottom_right'; got {causal!r}")


def _check_packed(name: str, t, fn: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"attn_qat.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"attn_qat.{fn}: {name} must be 3-D (total tokens, heads, head_dim), got shape "
                         f"{tuple(t.shape)}")


def _check_cu_seqlens(name: str, cu, device: torch.device, fn: str):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"attn_qat.{fn}: {name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"attn_qat.{fn}: {name} must be int32 (as flash_attn_varlen_func takes it), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"attn_qat.{fn}: {name} must be 1-D with num_seqs + 1 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"attn_qat.{fn}: {name} is on {cu.device}, the query on {device}")


def _check_max_seqlen(name: str, value, fn: str):
    """A max_seqlen argument: an int, or a 0-d integer tensor (transformers passes cu_seq_lens.diff().max())."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"attn_qat.{fn}: {name} must be an int (or a one-element integer tensor), got a "
                            f"{value.dtype} tensor of shape {tuple(value.shape)}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"attn_qat.{fn}: {name} must be an int, got {type(value).__name__}")
    return None


def _check_lengths(name: str, cu: Sequence[int], total: int, fn: str) -> None:
    if cu[0] != 0:
        raise ValueError(f"attn_qat.{fn}: {name} must start at 0, got {cu[0]}")
    for s in range(len(cu) - 1):
        if cu[s + 1] < cu[s]:
            raise ValueError(f"attn_qat.{fn}: {name} must be non-decreasing, but entry {s + 1} ({cu[s + 1]}) is below "
                             f"entry {s} ({cu[s]})")
    if cu[-1] != total:
        raise ValueError(f"attn_qat.{fn}: the last entry of {name} ({cu[-1]}) must equal the number of packed tokens "
                         f"({total})")


def _check_max(name: str, value: int, lengths: Sequence[int], fn: str) -> None:
    longest = max(lengths, default=0)
    if value < longest:
        raise ValueError(f"attn_qat.{fn}: {name}={value} is below the longest sequence ({longest} tokens)")


def _needs_padding(cu_k: Sequence[int], mode: str) -> bool:
    """Blocks of P and V along the keys need every sequence's keys to start at a multiple of 16 (a mode that does not
    quantize has none): otherwise K and V run in the padded layout."""
    return mode_has(mode_code(mode), _C.QUANTIZES) and any(c % BLOCK for c in cu_k)


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _fwd_tiles(mode: str, head_dim: int, head_dim_v: int, need_grad: bool) -> Optional[Tuple[int, int]]:
    """(query rows, keys) of the Hopper forward kernel's tiles for this call, which the kernel picks by head_dim,
    whether the mode quantizes P, and whether the call makes O' (csrc/sm90/tile_shapes.h); None for head dims without
    a table here (other than 64 and 128): the mma.sync kernels, the Hopper ones on operands the binding pads
    (kernel_options' pad_head_dims), or the Hopper forward at 256 (sm90_d256) then run them in index order."""
    if head_dim != head_dim_v:
        return None
    code = mode_code(mode)
    return _C.SM90_FWD_TILES.get((head_dim, int(mode_has(code, _C.QUANTIZES)), int(makes_o_prime(code, need_grad))))


def _tile_work(span: torch.Tensor, n_other: int, rows: int, cols: int) -> torch.Tensor:
    """Per tile of `rows` tokens, the tiles (or steps) of `cols` tokens of the other axis that it visits, as the
    kernels count them (csrc/attention/mask.cuh's query_rows_key_range and key_rows_query_range, then
    attention_fwd_sm90.cu's tile_at and the dK/dV kernel's item): from the first row's span start, rounded down, to
    the last row's span end."""
    n = span.shape[0]
    first = torch.arange(0, n, rows)
    last = torch.clamp(first + rows, max=n) - 1
    lo = span[first, 0].clamp(0, n_other)
    hi = torch.maximum(lo, span[last, 1].clamp(0, n_other))
    begin = lo // cols * cols
    return (hi - begin + cols - 1).clamp_min(0) // cols


def _lpt_order(work: torch.Tensor, heads: int, device: torch.device) -> Optional[torch.Tensor]:
    """The items (head * tiles + tile) of `heads` heads of these tiles' work, the most work first, ties by head,
    then tile (a head's equal tiles stay side by side, reading the same operands from L2); None when every item has
    the same work, where index order is as good (a head-interleaved order lost there, performance.md)."""
    if work.numel() == 0 or bool((work == work[0]).all()):
        return None
    per_item = work.repeat(heads)
    order = torch.sort(-per_item, stable=True).indices
    return order.to(torch.int32).to(device)


class _Plan:
    """How one packing runs: the spans the kernels read (csrc/attn_qat.h) and, when K and V must be padded, where
    their rows go. Built on the host from the cumulative lengths, once per packing (functools.lru_cache)."""

    def __init__(self, cu_q: Tuple[int, ...], cu_k: Tuple[int, ...], alignment: Optional[str], pad: bool,
                 device: torch.device):
        num = len(cu_q) - 1
        starts_q = torch.tensor(cu_q[:-1], dtype=torch.int64)
        len_q = torch.tensor([cu_q[s + 1] - cu_q[s] for s in range(num)], dtype=torch.int64)
        len_k = torch.tensor([cu_k[s + 1] - cu_k[s] for s in range(num)], dtype=torch.int64)
        # where each sequence's keys start in the kernels' layout, and how many rows it has there
        rows_k = torch.tensor([_round_up(n) for n in len_k.tolist()], dtype=torch.int64) if pad else len_k
        starts_k = torch.cumsum(rows_k, 0) - rows_k
        self.total_k = int(rows_k.sum())
        # the key position a query's causal limit is counted from: row i of a sequence sees keys j <= i + offset
        offset = (len_k - len_q) if alignment == "bottom_right" else torch.zeros_like(len_q)

        # queries: sequence s's row r sees keys starts_k[s] + [0, limit), limit = len_k (or the causal one)
        seq_q = torch.repeat_interleave(torch.arange(num), len_q)
        row = torch.arange(cu_q[-1]) - starts_q[seq_q]
        limit = len_k[seq_q]
        if alignment is not None:
            limit = torch.minimum(limit, (row + offset[seq_q] + 1).clamp_min(0))
        lo = starts_k[seq_q]
        q_span = torch.stack((lo, lo + limit), dim=1)
        # keys (padding rows too): sequence s's key r is seen by queries starts_q[s] + [first, len_q); padding keys
        # and keys no query sees get the empty span at the sequence's end, which keeps both columns non-decreasing
        seq_k = torch.repeat_interleave(torch.arange(num), rows_k)
        key = torch.arange(self.total_k) - starts_k[seq_k]
        end = starts_q[seq_k] + len_q[seq_k]
        first = torch.zeros_like(key) if alignment is None else (key - offset[seq_k]).clamp_min(0)
        first = torch.where(key < len_k[seq_k], torch.minimum(starts_q[seq_k] + first, end), end)
        k_span = torch.stack((first, end), dim=1)
        self.q_span = q_span.to(torch.int32).contiguous().to(device)
        self.k_span = k_span.to(torch.int32).contiguous().to(device)
        # Work per tile for the kernels' orders: with head-major index order each head's longest tiles start one head
        # after another and the last heads' land in the last wave; longest first (LPT) ends the grid on short items.
        self._causal = alignment is not None
        self._q_span_host, self._device = q_span, device
        self._dkdv_work = None if self._causal else _tile_work(k_span, cu_q[-1], DKDV_KEYS, DKDV_Q_STEP)
        self._orders = {}
        # the padded layout's row of each original key row, and its padding rows
        self.k_rows = self.pad_rows = None
        if pad:
            seq = torch.repeat_interleave(torch.arange(num), len_k)
            k_rows = torch.arange(cu_k[-1]) - torch.tensor(cu_k[:-1], dtype=torch.int64)[seq] + starts_k[seq]
            is_pad = torch.ones(self.total_k, dtype=torch.bool)
            is_pad[k_rows] = False
            self.k_rows, self.pad_rows = k_rows.to(device), is_pad.nonzero().squeeze(1).to(device)

    def orders(self, heads_q: int, heads_kv: int, fwd_tiles: Optional[Tuple[int, int]]):
        """(forward order, dK/dV order) for the ops (csrc/attn_qat.h's work_order), each None where every
        item has the same work, and both None under a causal limit or without Hopper tiles. Cached per (heads,
        tiles)."""
        # causal: longest first was slower than index order there on the H100 (performance.md)
        if self._causal or fwd_tiles is None:
            return None, None
        key = (heads_q, heads_kv, fwd_tiles)
        if key not in self._orders:
            fwd_work = _tile_work(self._q_span_host, self.total_k, *fwd_tiles)
            self._orders[key] = (_lpt_order(fwd_work, heads_q, self._device),
                                 _lpt_order(self._dkdv_work, heads_kv, self._device))
        return self._orders[key]


@torch.compiler.disable  # host-side planning: torch.compile graphs stop here, as at the host read of cu_seqlens
@functools.lru_cache(maxsize=16)
def _plan(cu_q: Tuple[int, ...], cu_k: Tuple[int, ...], alignment: Optional[str], pad: bool,
          device: torch.device) -> _Plan:
    return _Plan(cu_q, cu_k, alignment, pad, device)


class _HostValues:
    """The host copies of the last cu_seqlens (and max_seqlen tensors) read, kept while those very tensors live
    unmodified: a model's layers pass the same tensors one after another, and only the first call then pays the
    device synchronisation of the read."""

    def __init__(self):
        self.tensors, self.versions, self.values = (), (), None

    def get(self, tensors: Tuple[torch.Tensor, ...]):
        alive = tuple(ref() for ref in self.tensors)
        if (len(alive) == len(tensors) and all(a is t for a, t in zip(alive, tensors))
                and self.versions == tuple(version_of(t) for t in tensors)):
            return self.values
        return None

    def put(self, tensors: Tuple[torch.Tensor, ...], values) -> None:
        self.tensors = tuple(weakref.ref(t) for t in tensors)
        self.versions = tuple(version_of(t) for t in tensors)
        self.values = values


_last_read = threading.local()


def _host_values(cu_q: torch.Tensor, cu_k: torch.Tensor, extra: Sequence[Optional[torch.Tensor]]) -> tuple:
    """(cu_seqlens_q, cu_seqlens_k as tuples, then each max_seqlen tensor's value or None) on the host, in one
    transfer (one device sync) unless the same unmodified tensors were read last time (_HostValues)."""
    tensors = (cu_q, cu_k) + tuple(t for t in extra if t is not None)
    cache = getattr(_last_read, "values", None)
    if cache is None:
        cache = _last_read.values = _HostValues()
    values = cache.get(tensors)
    if values is not None:
        return values
    parts = [cu_q, cu_k] + [t.reshape(1).to(cu_q.device, torch.int32) for t in extra if t is not None]
    flat = torch.cat(parts).cpu().tolist()
    n = cu_q.numel()
    rest = iter(flat[2 * n:])
    values = (tuple(flat[:n]), tuple(flat[n:2 * n])) + tuple(next(rest) if t is not None else None for t in extra)
    cache.put(tensors, values)  # tuples: what callers get back from the cache cannot be changed under it
    return values


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Union[int, torch.Tensor],
    max_seqlen_k: Union[int, torch.Tensor],
    *,
    causal: Union[bool, str] = False,
    softmax_scale: Optional[float] = None,
    mode: str = "attn_qat",
    v_block_axis: str = "auto",
    return_lse: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """4-bit attention over packed sequences, like `flash_attn_varlen_func`.

    q (total_q, H, D), k (total_k, H_kv, D) and v (total_k, H_kv, Dv): the sequences' tokens one after another, D
    and Dv multiples of 16 from 32 to 256, H a
    multiple of H_kv; dtypes (float32 runs in bfloat16 and comes back in float32) and strides as in
    `attn_qat.scaled_dot_product_attention`.
    cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,) on q's device, the cumulative lengths (0 first, the totals last;
    a sequence may be empty). max_seqlen_q, max_seqlen_k: ints at least the longest lengths (only checked). Sequence s
    is queries cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 attending to keys cu_seqlens_k[s] .. cu_seqlens_k[s+1] - 1,
    and its output equals `attn_qat.attention` on that sequence alone (P and V blocked from its first key,
    numerics.md §2). Returns (total_q, H, D); with `return_lse` also the natural-log log-sum-exp (H, total_q) float32,
    -inf for a query that sees no key, not differentiable.

    `causal`: False, True or "bottom_right" (key j of a sequence visible to its query i iff j <= i + len_k - len_q,
    as flash_attn_varlen_func), or "top_left" (j <= i, as torch's SDPA). `softmax_scale`, `mode` as in
    `attn_qat.attention`; `v_block_axis` "auto" blocks V along tokens (per sequence) when not causal, along head_dim
    when causal (numerics.md §2).

    The call reads cu_seqlens_q and cu_seqlens_k on the host (a device synchronisation), to check them and to plan
    the kernels' work, unless the previous call on this thread read the very same tensors, unmodified since (as a
    model's layers pass them): then it reuses what it read. Plans are cached per packing. When every cu_seqlens_k entry is a multiple of 16 the
    kernels run on q, k and v in place; otherwise K and V are copied into a layout whose sequences are padded with
    zero rows to multiples of 16 (the padding keys are hidden), which costs a copy of K and V (and of their
    gradients) per call. Queries are never copied.
    """
    fn = "attention_varlen"
    mode_code(mode)  # a bad mode fails here, before any work
    alignment = _alignment(causal, fn)
    along_tokens = v_along_tokens(v_block_axis, alignment is not None, fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_packed(name, t, fn)
    # (1, H, N, D) views of the packed (N, H, D) memory: the kernels' batch of one
    out_dtype = _output_dtype(q)
    q4, k4, v4 = _check_qkv(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), fn)
    device = q4.device
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device, fn)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device, fn)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"attn_qat.{fn}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; "
                         f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    max_tensors = [_check_max_seqlen("max_seqlen_q", max_seqlen_q, fn),
                   _check_max_seqlen("max_seqlen_k", max_seqlen_k, fn)]
    scale = 1.0 / math.sqrt(q4.shape[-1]) if softmax_scale is None else check_softmax_scale(softmax_scale,
                                                                                                 "softmax_scale", fn)
    cu_q, cu_k, max_q, max_k = _host_values(cu_seqlens_q, cu_seqlens_k, max_tensors)
    max_q = max_seqlen_q if max_q is None else max_q
    max_k = max_seqlen_k if max_k is None else max_k
    result = _attention_varlen(q4, k4, v4, cu_q, cu_k, max_q, max_k, alignment, scale, mode, along_tokens,
                               return_lse, fn)
    if return_lse:
        return _output(result[0], out_dtype), result[1]
    return _output(result, out_dtype)


def _attention_varlen(q4, k4, v4, cu_q: Sequence[int], cu_k: Sequence[int], max_q: int, max_k: int,
                      alignment: Optional[str], scale: float, mode: str, along_tokens: bool, return_lse: bool,
                      fn: str):
    """attention_varlen on checked (1, H, N, D) views and host cumulative lengths (the transformers integration
    enters here with lengths it read once per forward)."""
    _check_lengths("cu_seqlens_q", cu_q, q4.shape[2], fn)
    _check_lengths("cu_seqlens_k", cu_k, k4.shape[2], fn)
    _check_max("max_seqlen_q", max_q, [b - a for a, b in zip(cu_q, cu_q[1:])], fn)
    _check_max("max_seqlen_k", max_k, [b - a for a, b in zip(cu_k, cu_k[1:])], fn)
    if q4.numel() == 0 or k4.numel() == 0:
        # no query, or no key to see (numerics.md §6): zeros, -inf, zero gradients, as attn_qat.attention
        out = _EmptyAttention.apply(q4, k4, v4)[0].transpose(0, 1)
        lse = torch.full((q4.shape[1], q4.shape[2]), float("-inf"), dtype=torch.float32, device=q4.device)
        return (out, lse) if return_lse else out
    pad = _needs_padding(cu_k, mode)
    plan = _plan(tuple(cu_q), tuple(cu_k), alignment, pad, q4.device)
    if pad:
        def padded(t):  # (1, H, N, D) -> (1, H, N_padded, D), zero rows between the sequences
            # One pass over the tensor: zeros only in the padding rows, and index_copy_ in place (the out-of-place
            # index_copy first copies its whole input, and new_zeros writes every row once more).
            rows = t.squeeze(0).transpose(0, 1)
            out = rows.new_empty((plan.total_k,) + tuple(rows.shape[1:])).index_fill_(0, plan.pad_rows, 0)
            return out.index_copy_(0, plan.k_rows, rows).transpose(0, 1).unsqueeze(0)
        k4, v4 = padded(k4), padded(v4)
    need_grad = torch.is_grad_enabled() and (q4.requires_grad or k4.requires_grad or v4.requires_grad)
    qs, scale = positive_scale(q4, scale)
    fwd_tiles = _fwd_tiles(mode, q4.shape[-1], v4.shape[-1], need_grad)
    fwd_order, dkdv_order = plan.orders(q4.shape[1], k4.shape[1], fwd_tiles)
    out, _, frame, row_sum, *_ = ops.attention_forward(qs, k4, v4, None, scale, CAUSAL_NONE, mode_code(mode), need_grad,
                                                       along_tokens, plan.q_span, plan.k_span, fwd_order,
                                                       dkdv_order if need_grad else None)
    out = out.squeeze(0).transpose(0, 1)  # views both ways: indexing with [0] would make its backward a copy
    if not return_lse:
        return out
    return out, lse_from_stats(frame.detach(), row_sum.detach())[0]
