"""torch.library.opcheck on every op of torch.ops.attn_qat (csrc/binding/registry.cpp's registry): the schema
(test_schema: no undeclared mutation or aliasing), the autograd registration, the fake kernels of attn_qat/ops.py
against the real ones (test_faketensor: shapes, dtypes, strides) and AOT dispatch with dynamic shapes. Small shapes,
a few seconds on the CPU; the same on CUDA under the gpu marker. An op without a CPU kernel (kv_cache_decode) is
checked on CUDA only, one without a CUDA kernel (p_fp16_path) on the CPU only; a new op without cases here fails
test_every_op_has_cases."""
import pytest
import torch

import attn_qat
from attn_qat.ops import MODES
from conftest import DEVICES

ops = torch.ops.attn_qat
ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# test_schema perturbs the inputs arithmetically, which float8 tensors do not support
NO_FLOAT8_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _randn(*shape, device, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _qkv(b, hq, hkv, nq, nk, d, device, layout):
    """(B, H, N, D) operands, contiguous ("bhsd") or (B, H, N, D) views of (B, N, H, D) memory ("bshd")."""
    shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))
    if layout == "bshd":
        return tuple(_randn(s[0], s[2], s[1], s[3], device=device, seed=i).transpose(1, 2)
                     for i, s in enumerate(shapes))
    return tuple(_randn(*s, device=device, seed=i) for i, s in enumerate(shapes))


def _grad(tensors, on=True):
    return tuple(t.detach().requires_grad_(on) for t in tensors)


def nvfp4_quantize_cases(device):
    x = _randn(3, 32, 16, device=device)
    yield (x, 1), ALL_UTILS
    yield (x.float(), 2), ALL_UTILS  # the last axis, float32
    yield (_randn(4, 20, 8, device=device).transpose(0, 1), 0), ALL_UTILS  # strided, a partial last block


def nvfp4_fake_quantize_cases(device):
    x = _randn(3, 32, 16, device=device)
    yield (x.float().requires_grad_(), 2), ALL_UTILS
    yield (x.transpose(1, 2).requires_grad_(), 2), ALL_UTILS  # a strided input gives a contiguous output
    yield (_randn(5, 20, device=device, dtype=torch.float16), 1), ALL_UTILS  # a partial last block


def nvfp4_dequantize_cases(device):
    x = _randn(3, 32, 16, device=device)
    codes, scales = ops.nvfp4_quantize(x, 1)
    yield (codes, scales, 1, 32, torch.float16), NO_FLOAT8_SCHEMA
    codes, scales = ops.nvfp4_quantize(x, 2)
    yield (codes, scales, 2, 16, torch.float32), NO_FLOAT8_SCHEMA


def fake_quantize_qkv_cases(device):
    for layout, along_tokens in (("bshd", True), ("bhsd", False), ("bhsd", True)):
        yield _grad(_qkv(2, 2, 2, 20, 20, 64, device, layout)) + (along_tokens,), ALL_UTILS


def attention_forward_cases(device):
    q, k, v = _qkv(1, 4, 2, 24, 40, 64, device, "bshd")
    mask = torch.zeros(1, 4, 24, 40, device=device)
    # (mode, need_grad, v_along_tokens): need_grad=False returns no O' or Q^F, K^F, V^F, so nothing
    # differentiates through such a call
    for mode, need_grad, along_tokens in ((0, True, False), (1, True, False), (2, True, True), (3, True, False),
                                          (4, True, False), (0, False, True)):
        yield _grad((q, k, v), need_grad) + (mask, 0.125, 1, mode, need_grad, along_tokens), ALL_UTILS
    q, k, v = _qkv(2, 2, 2, 17, 33, 128, device, "bhsd")  # contiguous, head_dim 128, bottom-right causal
    yield _grad((q, k, v)) + (None, 0.1, 2, 0, True, False), ALL_UTILS
    yield _grad((q, k, v)) + (None, 0.1, 0, 0, True, True), ALL_UTILS


def attention_backward_cases(device):
    fwd = ops.attention_forward
    for layout, mode, causal, operands_quantized in (("bshd", 0, 2, False), ("bshd", 0, 2, True),
                                                     ("bhsd", 2, 1, True), ("bhsd", 3, 0, False),
                                                     ("bshd", 4, 1, False)):
        q, k, v = _qkv(1, 4, 2, 24, 40, 64, device, layout)
        mask = torch.zeros(1, 4, 24, 40, device=device) if causal == 0 else None
        out, out_prime, frame, row_sum, qf, kf, vf = fwd(q, k, v, mask, 0.125, causal, mode, True, False)
        dout = _randn(*out.shape, device=device, seed=7)
        if operands_quantized:
            q, k, v = qf, kf, vf
        # the backward op has no double backward: its inputs do not require grad
        yield (dout, q, k, v, out, out_prime, mask, frame, row_sum, 0.125, causal, mode, False, False,
               operands_quantized), ALL_UTILS


def attention_forward_prequantized_cases(device):
    for layout, causal, masked in (("bshd", 2, False), ("bhsd", 0, True), ("bshd", 0, False)):
        q, k, v = (attn_qat.fake_quantize(t, -1) for t in _qkv(2, 4, 2, 19, 35, 64, device, layout))
        if layout == "bshd":  # keep (B, H, N, D) views of (B, N, H, D) memory, as nvfp4_attention passes them
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        mask = torch.zeros(2, 4, 19, 35, device=device) if masked else None
        yield (q, k, v, mask, 0.125, causal), ALL_UTILS


def kv_cache_decode_cases(device):
    for page_size, tokens_q, causal in ((None, 1, True), (16, 3, True), (16, 2, False)):
        kwargs = {} if page_size is None else {"page_size": page_size, "num_pages": 12}
        cache = attn_qat.NVFP4KVCache(2, 2, 64, 80, device=device, **kwargs)
        cache.append(_randn(2, 2, 37, 64, device=device, seed=1), _randn(2, 2, 37, 64, device=device, seed=2),
                     lengths=[37, 21])
        q = _randn(2, 4, tokens_q, 64, device=device, seed=3)
        yield (q, cache.k_codes, cache.k_scales, cache.v_codes, cache.v_scales, cache.lengths, cache.block_table, 37,
               0.125, causal), ALL_UTILS


def kv_cache_append_cases(device):
    # unpaged, one token to all; paged, unequal counts crossing a page, (B, N, H, D) views as the models pass them
    for page_size, tokens, counts, layout in ((None, 1, None, "bhsd"), (16, 5, [5, 2], "bshd"),
                                              (16, 12, [0, 12], "bhsd")):
        kwargs = {} if page_size is None else {"page_size": page_size, "num_pages": 12}
        cache = attn_qat.NVFP4KVCache(2, 2, 64, 80, device=device, **kwargs)
        cache.append(_randn(2, 2, 37, 64, device=device, seed=1), _randn(2, 2, 37, 64, device=device, seed=2),
                     lengths=[37, 21])
        k, v, _ = _qkv(2, 2, 2, tokens, tokens, 64, device, layout)
        per_sequence = None if counts is None else torch.tensor(counts, device=device)
        yield (k, v, per_sequence, cache.lengths, cache.block_table, cache.k_codes, cache.k_scales, cache.v_codes,
               cache.v_scales), ALL_UTILS


def p_fp16_path_cases(device):
    x = -30 * torch.rand(3, 40, generator=torch.Generator().manual_seed(0)) + 11  # a partial last block
    yield (x.to(device),), ALL_UTILS


CASES = {
    "nvfp4_quantize": nvfp4_quantize_cases,
    "nvfp4_fake_quantize": nvfp4_fake_quantize_cases,
    "nvfp4_dequantize": nvfp4_dequantize_cases,
    "fake_quantize_qkv": fake_quantize_qkv_cases,
    "attention_forward": attention_forward_cases,
    "attention_backward": attention_backward_cases,
    "attention_forward_prequantized": attention_forward_prequantized_cases,
    "kv_cache_decode": kv_cache_decode_cases,
    "kv_cache_append": kv_cache_append_cases,
    "p_fp16_path": p_fp16_path_cases,
}
CUDA_ONLY = {"kv_cache_decode"}  # no CPU kernel: NVFP4KVCache.attention takes a composite path on the CPU
CPU_ONLY = {"p_fp16_path"}  # the CPU kernels' P path, exposed for tests (the CUDA kernels' own is not an op)


def registered_ops():
    return sorted(s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("attn_qat::"))


def test_every_op_has_cases():
    assert registered_ops() == sorted(CASES), "an op of csrc/binding/registry.cpp has no cases here (or one went away)"
    for name in registered_ops():
        on_cpu = torch._C._dispatch_has_kernel_for_dispatch_key(f"attn_qat::{name}", "CPU")
        assert on_cpu == (name not in CUDA_ONLY), f"{name}: a CPU kernel {'appeared' if on_cpu else 'is missing'}"
    assert len(MODES) == 5  # attention_forward_cases covers each mode code


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name, device):
    if device == "cpu" and name in CUDA_ONLY:
        pytest.skip(f"{name} has no CPU kernel (checked on CUDA)")
    if device == "cuda" and name in CPU_ONLY:
        pytest.skip(f"{name} has no CUDA kernel (checked on the CPU)")
    op = getattr(ops, name).default
    checked = 0
    for args, test_utils in CASES[name](device):
        torch.library.opcheck(op, args, test_utils=test_utils)
        checked += 1
    assert checked


def test_ops_reject_tensors_the_kernels_cannot_take():
    """The ops are public: a direct call with tensors that disagree, or sizes no kernel takes, is a RuntimeError
    from the binding's checks (csrc/binding/attention_ops.cpp, csrc/attn_qat.h), never a read out of bounds."""
    q, k, v = _qkv(1, 2, 1, 20, 24, 64, "cpu", "bhsd")
    fwd, bwd = ops.attention_forward, ops.attention_backward
    out, out_prime, frame, row_sum, *_ = fwd(q, k, v, None, 0.125, 0, 0, True, True)
    bad_forwards = {
        "a multiple of 16 from 32 to 256": (q[..., :24], k[..., :24], v[..., :24]),
        "must agree": (q, k, v[:, :, :20]),
        "same dtype": (q, k.half(), v),
        "multiple of the key/value heads": (q[:, :1], torch.cat([k, k], 1)[:, :2], torch.cat([v, v], 1)[:, :2]),
        "bfloat16 or float16": (q.float(), k.float(), v.float()),
        "last dimension": (q, k.transpose(2, 3).contiguous().transpose(2, 3), v),
    }
    for match, (bq, bk, bv) in bad_forwards.items():
        with pytest.raises(RuntimeError, match=match):
            fwd(bq, bk, bv, None, 0.125, 0, 0, False, True)
    with pytest.raises(RuntimeError, match="bad mode code"):
        fwd(q, k, v, None, 0.125, 0, len(MODES), False, True)
    with pytest.raises(RuntimeError, match="bad causal code"):
        fwd(q, k, v, None, 0.125, 3, 0, False, True)
    dout = torch.randn_like(out)
    bad_backwards = {  # (dout, out_prime, frame)
        "grad_output must have the output's shape": (dout[:, :, :10], out_prime, frame),
        "out_prime must have the output's shape": (dout, out_prime.transpose(2, 3), frame),
        "frame and row_sum": (dout, out_prime, frame[:, :, :10]),
    }
    for match, (bd, bp, bf) in bad_backwards.items():
        with pytest.raises(RuntimeError, match=match):
            bwd(bd, q, k, v, out, bp, None, bf, row_sum, 0.125, 0, 0, False, True)
