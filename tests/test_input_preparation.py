"""What the public entry points accept beyond the kernels' own layout (attention.py's `_prepare_operands`): float32
operands run in bfloat16 (the autocast dtype under autocast) and come back in float32, with float32 gradients; a
strided last dimension is copied once, as PyTorch's SDPA copies it. The numerics are those of the 16-bit call."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import attn_qat
from attn_qat import AttnQATFallbackWarning
from conftest import DEVICES


def _x(*shape, seed, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _grads(call, operands, dout):
    leaves = [t.detach().clone().requires_grad_() for t in operands]
    out = call(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


ENTRY_POINTS = {
    "sdpa": (lambda q, k, v: attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
             (1, 4, 37, 64), (1, 2, 37, 64)),
    "attention": (lambda q, k, v: attn_qat.attention(q, k, v, causal=True), (2, 29, 4, 64), (2, 45, 2, 64)),
    "varlen": (lambda q, k, v: attn_qat.attention_varlen(
        q, k, v, *(torch.tensor([0, 13, 40], dtype=torch.int32, device=q.device),) * 2, 27, 27, causal=True),
        (40, 4, 128), (40, 2, 128)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_float32_runs_as_bfloat16_and_comes_back_in_float32(device, entry):
    call, q_shape, kv_shape = ENTRY_POINTS[entry]
    q, k, v = _x(*q_shape, seed=1, device=device), _x(*kv_shape, seed=2, device=device), \
        _x(*kv_shape, seed=3, device=device)
    dout = _x(*q_shape, seed=4, device=device)
    out, grads = _grads(call, (q, k, v), dout)
    out16, grads16 = _grads(call, (q.bfloat16(), k.bfloat16(), v.bfloat16()), dout.bfloat16())
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    # the float32 call is the bfloat16 call: the cast to bfloat16 and back are the only steps added
    assert torch.equal(out, out16.float())
    for g, g16 in zip(grads, grads16):
        assert torch.equal(g, g16.float())


def test_float32_under_autocast_runs_in_the_autocast_dtype():
    q, k, v = (_x(1, 2, 24, 64, seed=s) for s in (5, 6, 7))
    with torch.autocast("cpu", dtype=torch.float16):
        out = attn_qat.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.float16
    assert torch.equal(out, attn_qat.scaled_dot_product_attention(q.half(), k.half(), v.half()))


def test_mixed_float32_and_bfloat16_outside_autocast_still_raise():
    q = _x(1, 2, 24, 64, seed=8)
    with pytest.raises(TypeError, match="different dtypes"):
        attn_qat.scaled_dot_product_attention(q, q, q.bfloat16())
    with pytest.raises(TypeError, match="float64"):
        attn_qat.attention(q.double(), q.double(), q.double())


@pytest.mark.parametrize("device", DEVICES)
def test_strided_last_dimension_is_copied_once(device):
    """A last dimension with stride > 1 (here: a (B, H, D, N) tensor transposed) is accepted, as torch's SDPA
    accepts it, and gives the bits of its contiguous copy, gradients included."""
    q, k, v, dout = (_x(1, 2, 64, 33, seed=s, dtype=torch.bfloat16, device=device) for s in (9, 10, 11, 12))
    strided = [t.transpose(2, 3) for t in (q, k, v)]
    assert all(t.stride(-1) != 1 for t in strided)
    call = lambda q, k, v: attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    out, grads = _grads(call, strided, dout.transpose(2, 3))
    expected, expected_grads = _grads(call, [t.contiguous() for t in strided], dout.transpose(2, 3))
    assert torch.equal(out, expected) and all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
    # the flash-style and packed entry points too
    bshd = [t.permute(0, 3, 1, 2) for t in (q, k, v)]  # (B, N, H, D) views, last dimension strided
    assert torch.equal(attn_qat.attention(*bshd), attn_qat.attention(*(t.contiguous() for t in bshd)))
    packed = [t[0].permute(2, 0, 1) for t in (q, k, v)]  # (N, H, D), last dimension strided
    cu = torch.tensor([0, 10, 33], dtype=torch.int32, device=device)
    assert torch.equal(attn_qat.attention_varlen(*packed, cu, cu, 23, 23),
                       attn_qat.attention_varlen(*(t.contiguous() for t in packed), cu, cu, 23, 23))


def test_patch_sdpa_runs_float32_calls_in_attn_qat():
    """The integrations took float32 outside autocast to PyTorch's SDPA; now attn_qat runs them, no warning."""
    q, k, v = (_x(1, 2, 24, 64, seed=s) for s in (13, 14, 15))
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnQATFallbackWarning)
        with attn_qat.patch_sdpa(strict=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.float32
    assert torch.equal(out, attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert not torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
