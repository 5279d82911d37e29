"""Python side of the attn_qat ops: loads the C extension, and registers the fake (meta) kernels
for torch.compile and the autograd formulas. The ops themselves are declared in csrc/binding/registry.cpp; what they
decide (the modes' flags, the causal codes, the layout of new tensors) comes from csrc/attn_qat.h through _C."""
import math
import numbers
import struct

import torch

from . import _C  # loading the library registers torch.ops.attn_qat

ops = torch.ops.attn_qat

# numerics.md §5's modes by code, and what each one does (csrc/attn_qat.h's aq_mode_of)
MODES = _C.MODES
# The causal codes (csrc/attn_qat.h's aq_causal): none, top-left (SDPA), bottom-right (FlashAttention).
CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = _C.CAUSAL_NONE, _C.CAUSAL_TOP_LEFT, _C.CAUSAL_BOTTOM_RIGHT
# The axis V's blocks run along (numerics.md §2): "auto" picks by whether every query sees every key.
V_BLOCK_AXES = ("auto", "tokens", "head_dim")


def v_along_tokens(v_block_axis: str, hides_keys: bool, fn: str) -> bool:
    """Whether V is blocked along tokens (numerics.md §2): under "auto" only when no query is denied a key (no causal
    alignment, no mask), so that a key a query cannot see never sets a block scale of what it does see; "tokens" or
    "head_dim" forces the axis ("tokens" on a causal or masked call lets hidden values move visible outputs)."""
    if v_block_axis not in V_BLOCK_AXES:
        raise ValueError(f"attn_qat.{fn}: v_block_axis must be one of {', '.join(map(repr, V_BLOCK_AXES))}; "
                         f"got {v_block_axis!r}")
    return not hides_keys if v_block_axis == "auto" else v_block_axis == "tokens"


def mode_has(mode: int, flag: int) -> bool:
    """Whether the mode of this code has one of csrc/attn_qat.h's flags (_C.QUANTIZES, _C.DELTA_FROM_O_PRIME, ...)."""
    return bool(_C.MODE_FLAGS[mode] & flag)


def makes_o_prime(mode: int, need_grad: bool) -> bool:
    """Whether attention_forward makes O': for training (need_grad), when the mode's backward takes delta from it."""
    return need_grad and mode_has(mode, _C.DELTA_FROM_O_PRIME)


# csrc/attn_qat.h's aq_tail_split_mode
_TAIL_AUTO, _TAIL_OFF, _TAIL_FORCED = 0, 1, 2
# kernel_options' work_order: packed calls' items longest first without a causal limit (attn_qat/varlen.py), or index
# order
WORK_ORDERS = ("lpt", "index")


class kernel_options:
    """Which CUDA kernels the attention ops may use, for the whole process (README, "Kernel options").

    sm90: False keeps the Hopper (wgmma, TMA) kernels out, so the mma.sync kernels run on an H100 or H200 too; True
    lets the Hopper kernels run where they can (the default). tail_split: "auto" lets each call split a short last
    wave of a Hopper grid (the default), 0 never splits (a grid-independent reduction order), and (tail, parts) splits
    the last `tail` work items into `parts` parts each (for tests). decode_variant: the decode kernel's variant,
    0-3 (bit 0: the last CTA of a sequence's chunks merges them, else a combine kernel; bit 1: early start), or
    "auto" (3); decode_chunk: the keys a decode CTA takes, a multiple of 64 up to 4096, or "auto" (planned): both
    for A/B runs and tests. work_order: "lpt" (the default) hands packed calls' work items to the Hopper kernels
    longest first where there is no causal limit (attn_qat/varlen.py's tables), "index" in index order as dense
    calls (A/B runs: bench_varlen.py --orders); the outputs are the same either way. pad_head_dims: "auto" (the
    default) zero-pads the head dims of a call up to 128 that the Hopper kernels do not take (D != Dv, or other than
    64 and 128) to 64 or 128 on a device where they run, since the mma.sync kernels are several times slower there;
    True pads on every device (the CPU too: tests hold it to the unpadded result), False never. With sm90_d256 a
    forward that makes no O' (inference, modes without O', bf16) above 128 (192 / 128, say) is padded to 256.
    Padding columns are absent (numerics.md §6), so the results are those of the kernels that run. sm90_d256: True lets the Hopper forwards
    that keep no second accumulator for O' (inference; training in the modes that make no O', and "bf16") take D = Dv
    = 256, False (the default) leaves 256 to the mma.sync kernels: off until that kernel has run against the
    reference on a GPU. None leaves an option as it is.

    The call sets the options at once; as a context manager it restores, on exit, the ones in force before it. With
    no arguments it changes nothing, and its attributes tell the options in force. The environment variables
    ATTN_QAT_SM90, ATTN_QAT_TAIL_SPLIT, ATTN_QAT_DECODE_VARIANT, ATTN_QAT_DECODE_CHUNK, ATTN_QAT_WORK_ORDER,
    ATTN_QAT_PAD_HEAD_DIMS and ATTN_QAT_SM90_D256 give the options when the library loads."""

    def __init__(self, sm90=None, tail_split=None, decode_variant=None, decode_chunk=None, work_order=None,
                 pad_head_dims=None, sm90_d256=None):
        self._previous = _C.kernel_options()
        sm90_on, mode, tail, parts, variant, chunk, index_order, pad, d256 = self._previous
        if sm90 is not None:
            if not isinstance(sm90, bool):
                raise TypeError(f"attn_qat.ops.kernel_options: sm90 must be True, False or None, got {sm90!r}")
            sm90_on = int(sm90)
        if tail_split is not None:
            mode, tail, parts = self._tail_split_code(tail_split)
        if decode_variant is not None:
            variant = self._auto_or_int("decode_variant", decode_variant, -1, lambda v: 0 <= v < _C.DECODE_VARIANTS,
                                        f"an integer from 0 to {_C.DECODE_VARIANTS - 1}")
        if decode_chunk is not None:
            step, most = _C.DECODE_CHUNK_STEP, _C.DECODE_CHUNK_MAX
            chunk = self._auto_or_int("decode_chunk", decode_chunk, 0, lambda c: 0 < c <= most and c % step == 0,
                                      f"a multiple of {step} up to {most}")
        if work_order is not None:
            if work_order not in WORK_ORDERS:
                raise ValueError(f"attn_qat.ops.kernel_options: work_order must be one of "
                                 f"{', '.join(map(repr, WORK_ORDERS))}, got {work_order!r}")
            index_order = int(work_order == "index")
        if pad_head_dims is not None:
            if not (isinstance(pad_head_dims, bool) or (isinstance(pad_head_dims, str) and pad_head_dims == "auto")):
                raise ValueError(f"attn_qat.ops.kernel_options: pad_head_dims must be \"auto\", True or False, got "
                                 f"{pad_head_dims!r}")
            pad = -1 if pad_head_dims == "auto" else int(pad_head_dims)
        if sm90_d256 is not None:
            if not isinstance(sm90_d256, bool):
                raise TypeError(f"attn_qat.ops.kernel_options: sm90_d256 must be True, False or None, got "
                                f"{sm90_d256!r}")
            d256 = int(sm90_d256)
        _C.set_kernel_options(sm90_on, mode, tail, parts, variant, chunk, index_order, pad, d256)
        self.sm90 = bool(sm90_on)
        self.tail_split = "auto" if mode == _TAIL_AUTO else 0 if mode == _TAIL_OFF else (tail, parts)
        self.decode_variant = "auto" if variant < 0 else variant
        self.decode_chunk = "auto" if chunk == 0 else chunk
        self.work_order = "index" if index_order else "lpt"
        self.pad_head_dims = "auto" if pad < 0 else bool(pad)
        self.sm90_d256 = bool(d256)

    @staticmethod
    def _auto_or_int(name, value, auto, valid, allowed):
        if isinstance(value, str) and value == "auto":
            return auto
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and valid(int(value)):
            return int(value)
        raise ValueError(f"attn_qat.ops.kernel_options: {name} must be \"auto\" or {allowed}, got {value!r}")

    @staticmethod
    def _tail_split_code(value):
        if isinstance(value, str) and value == "auto":
            return _TAIL_AUTO, 0, 0
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == 0:
            return _TAIL_OFF, 0, 0
        if (isinstance(value, tuple) and len(value) == 2 and all(
                isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in value)):
            return _TAIL_FORCED, int(value[0]), int(value[1])
        raise ValueError(f"attn_qat.ops.kernel_options: tail_split must be \"auto\", 0 or a (tail, parts) pair of "
                         f"non-negative integers, got {value!r}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _C.set_kernel_options(*self._previous)
        return False


def mode_code(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"attn_qat: mode must be one of {', '.join(MODES)}; got {mode!r}")
    return MODES.index(mode)


def _float32(x: float) -> float:
    """x rounded to float32 as the kernels hold it (inf beyond float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def check_softmax_scale(scale, name: str, fn: str) -> float:
    """`scale` as a float, or a ValueError naming the argument `name` of `attn_qat.{fn}`: the kernels compute
    scale * log2(e) in float32 (csrc/binding/tensors.h's check_scale), so it must be finite and stay finite there."""
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"attn_qat.{fn}: {name} must be a real number or None, got {scale!r}") from None
    # float32 * float32 is exact in a double, so rounding the product once gives the float32 product
    if not math.isfinite(value) or not math.isfinite(_float32(_float32(abs(value)) * _C.LOG2E)):
        raise ValueError(f"attn_qat.{fn}: {name}={value!r} cannot be used: it must be finite and below about 2.35e38 "
                         f"in magnitude ({name} * log2(e) must fit a float32); pass None for 1/sqrt(head_dim)")
    return value


def positive_scale(q: torch.Tensor, scale: float):
    """(q, scale) for the attention ops, which take scale > 0 (their kernels find the row max on the raw scores
    and scale inside the exp, csrc/attention/mask.cuh's logit_map): a negative scale becomes the same logits
    from -q, since q.k * scale == (-q).k * (-scale) exactly and the NVFP4 block rule is symmetric in sign; a zero
    scale (every logit 0), or one too small for a float32, becomes zero queries with scale 1."""
    if _float32(abs(scale)) == 0:
        return q * 0, 1.0
    return (-q, -scale) if scale < 0 else (q, scale)


def _empty_like_layout(like: torch.Tensor, b: int, h: int, n: int, d: int) -> torch.Tensor:
    """As the ops make it: (B, H, N, D) views of (B, N, H, D) memory keep that layout (csrc/attn_qat.h's
    aq_token_major)."""
    if _C.token_major(like.size(1), like.size(2), like.stride(1), like.stride(2)):
        return like.new_empty(b, n, h, d).transpose(1, 2)
    return like.new_empty(b, h, n, d)


def _sizes_with_axis(x: torch.Tensor, axis: int, n: int) -> list:
    sizes = list(x.shape)
    sizes[axis] = n
    return sizes


@torch.library.register_fake("attn_qat::nvfp4_quantize")
def _(x, axis):
    n = x.shape[axis]
    codes = x.new_empty(_sizes_with_axis(x, axis, (n + 1) // 2), dtype=torch.uint8)
    scales = x.new_empty(_sizes_with_axis(x, axis, (n + 15) // 16), dtype=torch.float8_e4m3fn)
    return codes, scales


@torch.library.register_fake("attn_qat::nvfp4_fake_quantize")
def _(x, axis):
    return x.new_empty(x.shape)


@torch.library.register_fake("attn_qat::nvfp4_dequantize")
def _(codes, scales, axis, axis_len, dtype):
    return codes.new_empty(_sizes_with_axis(codes, axis, axis_len), dtype=dtype)


@torch.library.register_fake("attn_qat::fake_quantize_qkv")
def _(q, k, v, v_along_tokens):
    return tuple(_empty_like_layout(t, *t.shape) for t in (q, k, v))


@torch.library.register_fake("attn_qat::attention_forward")
def _(q, k, v, mask, scale, causal, mode, need_grad, v_along_tokens, q_span=None, k_span=None, fwd_order=None,
      dkdv_order=None):
    b, h, n, d = (*q.shape[:3], v.shape[3])  # the output has V's head dim
    out = _empty_like_layout(q, b, h, n, d)
    out_prime = _empty_like_layout(q, b, h, n, d) if makes_o_prime(mode, need_grad) else q.new_empty(0)
    frame = q.new_empty(b, h, n, dtype=torch.float32)
    with_operands = need_grad and mode_has(mode, _C.BACKWARD_THROUGH_FQ)
    operands = tuple(_empty_like_layout(t, *t.shape) if with_operands else q.new_empty(0) for t in (q, k, v))
    return (out, out_prime, frame, q.new_empty(b, h, n, dtype=torch.float32)) + operands


@torch.library.register_fake("attn_qat::attention_backward")
def _(dout, q, k, v, out, out_prime, mask, frame, row_sum, scale, causal, mode, deterministic, v_along_tokens,
      operands_quantized=False, q_span=None, k_span=None, dkdv_order=None):
    return (_empty_like_layout(q, *q.shape), _empty_like_layout(k, *k.shape), _empty_like_layout(v, *v.shape))


@torch.library.register_fake("attn_qat::attention_forward_prequantized")
def _(q, k, v, mask, scale, causal):
    b, h, n, d = (*q.shape[:3], v.shape[3])
    return (_empty_like_layout(q, b, h, n, d), q.new_empty(b, h, n, dtype=torch.float32),
            q.new_empty(b, h, n, dtype=torch.float32))


@torch.library.register_fake("attn_qat::p_fp16_path")
def _(x):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.register_fake("attn_qat::kv_cache_decode")
def _(q, k_codes, k_scales, v_codes, v_scales, lengths, block_table, max_length, scale, causal):
    return q.new_empty(q.shape)


@torch.library.register_fake("attn_qat::kv_cache_append")
def _(k, v, counts, lengths, block_table, k_codes, k_scales, v_codes, v_scales):
    return None  # writes the pools and lengths in place


# Straight-through estimator: the gradient of fake quantization is the identity.
def _fake_quantize_backward(ctx, grad):
    return grad, None


torch.library.register_autograd("attn_qat::nvfp4_fake_quantize", _fake_quantize_backward)


def _qkv_backward(ctx, grad_q, grad_k, grad_v):
    return grad_q, grad_k, grad_v, None


torch.library.register_autograd("attn_qat::fake_quantize_qkv", _qkv_backward)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, mask, scale, causal, mode, need_grad, v_along_tokens, *packed = inputs
    # packed calls (attn_qat/varlen.py): the spans and the work orders; the backward takes the dK/dV kernel's
    q_span, k_span, _, dkdv_order = tuple(packed) + (None,) * (4 - len(packed))
    out, out_prime, frame, row_sum, q_fq, k_fq, v_fq = output
    # The backward takes Q^F, K^F, V^F where the op returned them (the mode's flag).
    ctx.operands_quantized = need_grad and mode_has(mode, _C.BACKWARD_THROUGH_FQ)
    if ctx.operands_quantized:
        q, k, v = q_fq, k_fq, v_fq
    ctx.save_for_backward(q, k, v, out, out_prime, frame, row_sum, mask, q_span, k_span, dkdv_order)
    # only out carries a gradient; and without materialized gradients autograd passes None for the others
    # instead of zero-filling an O'-sized tensor every backward (marking them non-differentiable alone does not)
    ctx.mark_non_differentiable(out_prime, frame, row_sum, q_fq, k_fq, v_fq)
    ctx.set_materialize_grads(False)
    ctx.scale, ctx.causal, ctx.mode, ctx.v_along_tokens = scale, causal, mode, v_along_tokens


def _attention_backward(ctx, grad_out, *unused_grads):
    q, k, v, out, out_prime, frame, row_sum, mask, q_span, k_span, dkdv_order = ctx.saved_tensors
    if grad_out is None:  # only when autograd differentiates this backward itself (create_graph=True)
        raise RuntimeError("attn_qat: double backward (a gradient of the attention gradients) is not supported")
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    # Like PyTorch's own attention backward: dQ summed by atomics (fast) unless deterministic algorithms are
    # asked for (torch.use_deterministic_algorithms), then bit-identical run to run (csrc/attn_qat.h).
    # The gradients of Q^F, K^F, V^F are those of q, k, v: the straight-through estimator (numerics.md §4).
    dq, dk, dv = ops.attention_backward(grad_out.to(q.dtype), q, k, v, out, out_prime, mask, frame, row_sum,
                                        ctx.scale, ctx.causal, ctx.mode, torch.are_deterministic_algorithms_enabled(),
                                        ctx.v_along_tokens, ctx.operands_quantized, q_span, k_span, dkdv_order)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("attn_qat::attention_forward", _attention_backward,
                                setup_context=_attention_setup_context)
