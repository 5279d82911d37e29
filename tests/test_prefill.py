"""attn_qat.nvfp4_attention (attention on packed NVFP4 operands) against attn_qat.reference (float64) and
against the inference forward on the unpacked inputs, at awkward sizes, and its errors for misuse."""
import pytest
import torch

import attn_qat
from attn_qat import reference
from attn_qat.prefill import packed_bytes
from conftest import rel_error
from test_attention import FWD_TOL, forward_error, fresh_generator

# (name, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
SHAPES = [
    ("odd", 1, 3, 3, 77, 93, 64),
    ("gqa", 2, 4, 2, 100, 130, 128),
    ("mqa_partial_v", 1, 4, 1, 33, 49, 64),
    ("one_query", 2, 2, 2, 1, 50, 128),
    ("cross", 1, 2, 2, 190, 17, 64),
    ("blocks", 1, 2, 1, 64, 128, 128),
]


def make(b, hq, hkv, nq, nk, d, device, layout="bshd", dtype=torch.bfloat16, g=None):
    g = g or fresh_generator()

    def one(h, n):
        shape = (b, n, h, d) if layout == "bshd" else (b, h, n, d)
        return torch.randn(shape, generator=g).to(dtype).to(device)

    return one(hq, nq), one(hkv, nk), one(hkv, nk)


def bhsd(t, layout):
    return t.transpose(1, 2) if layout == "bshd" else t


def reference_out(q, k, v, layout, causal):
    """Float64 reference on the unpacked inputs, in `layout`."""
    qc, kc, vc = (bhsd(t, layout).cpu() for t in (q, k, v))
    out = reference.attention(qc, kc, vc, causal="bottom_right" if causal else None)
    return bhsd(out, layout)


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_packed_matches_reference_and_inference_forward(device, shape, causal, layout):
    _, b, hq, hkv, nq, nk, d = shape
    q, k, v = make(b, hq, hkv, nq, nk, d, device, layout)
    packed = attn_qat.quantize_qkv(q, k, v, layout=layout, causal=causal)
    out = attn_qat.nvfp4_attention(*packed, causal=causal, layout=layout)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    error, _ = forward_error(out, reference_out(q, k, v, layout, causal))
    assert error <= FWD_TOL, error
    with torch.no_grad():
        inference = attn_qat.attention(q, k, v, causal=causal, layout=layout, mode="attn_qat")
    assert torch.equal(out, inference)  # the same kernel on the same FP4 values
    # bf16 operands take the fused pre-pass: exactly the inference forward.
    assert torch.equal(attn_qat.nvfp4_attention(q, k, v, causal=causal, layout=layout), inference)


def test_mixed_operands_fp16_and_scale(device):
    q, k, v = make(1, 4, 2, 45, 70, 128, device, dtype=torch.float16)
    qp, kp, vp = attn_qat.quantize_qkv(q, k, v, causal=True)
    all_packed = attn_qat.nvfp4_attention(qp, kp, vp, causal=True, softmax_scale=0.05)
    assert all_packed.dtype == torch.float16
    for operands in ((q, kp, vp), (qp, k, vp), (qp, kp, v)):
        assert torch.equal(attn_qat.nvfp4_attention(*operands, causal=True, softmax_scale=0.05), all_packed)
    qc, kc, vc = (t.transpose(1, 2).cpu() for t in (q, k, v))
    expected = reference.attention(qc, kc, vc, causal="bottom_right", scale=0.05).transpose(1, 2)
    assert forward_error(all_packed, expected)[0] <= FWD_TOL


def test_packed_operands_are_not_requantized(device):
    """Quantizing FP4 values again does not give them back when a block's largest code is below 6 (here:
    small K and V, whose E4M3 block scales are subnormal). The packed path must use the values as they are."""
    q, k, v = make(1, 2, 2, 40, 40, 64, device, layout="bhsd")
    q, k, v = q * 2.0 ** 7, k * 2.0 ** -7, v * 2.0 ** -7  # the same scores; K and V blocks with subnormal scales
    kf = attn_qat.fake_quantize(k, -1)
    assert not torch.equal(attn_qat.fake_quantize(kf, -1), kf)  # the pre-pass is not idempotent here
    packed = attn_qat.quantize_qkv(q, k, v, layout="bhsd")
    out = attn_qat.nvfp4_attention(*packed, layout="bhsd")
    expected = reference.attention(q.cpu(), k.cpu(), v.cpu())
    assert forward_error(out, expected)[0] <= FWD_TOL
    with torch.no_grad():
        requantized = attn_qat.attention(*(t.dequantize() for t in packed), layout="bhsd")
    assert rel_error(requantized, expected) > 3 * rel_error(out, expected)


def test_empty_rows_and_one_key(device):
    q, k, v = make(1, 2, 2, 40, 24, 64, device)
    out = attn_qat.nvfp4_attention(*attn_qat.quantize_qkv(q, k, v, causal=True), causal=True)
    assert not out[:, :16].any() and torch.isfinite(out).all()  # bottom-right: the first 16 queries see no key
    assert forward_error(out, reference_out(q, k, v, "bshd", True))[0] <= FWD_TOL
    q, k, v = make(2, 2, 2, 5, 1, 128, device)
    out = attn_qat.nvfp4_attention(*attn_qat.quantize_qkv(q, k, v))
    assert forward_error(out, reference_out(q, k, v, "bshd", False))[0] <= FWD_TOL


def test_quantize_qkv_layout_and_bytes():
    q, k, v = make(2, 4, 2, 33, 37, 128, "cpu")
    qp, kp, vp = attn_qat.quantize_qkv(q, k, v)
    assert (qp.block_axis, kp.block_axis, vp.block_axis) == (3, 3, 1)
    assert vp.shape == v.shape and vp.scales.shape == (2, 3, 2, 128)  # 37 tokens: blocks of 16, 16 and 5
    assert torch.equal(vp.dequantize(), attn_qat.fake_quantize(v, 1, partial_last_block=True))
    for t, axis in ((qp, 3), (kp, 3), (vp, 1)):
        assert t.nbytes == packed_bytes(t.shape, axis)
    assert vp.nbytes == 2 * 2 * 128 * (19 + 3)
    assert 3.5 < q.numel() * 2 / qp.nbytes < 3.6  # 4.5 bits per value: 3.56x smaller than bf16
    _, _, vb = attn_qat.quantize_qkv(*(t.transpose(1, 2) for t in (q, k, v)), layout="bhsd")
    assert vb.block_axis == 2
    # causal attention blocks V along head_dim, like K (numerics.md §2); either axis can be forced
    _, kc, vc = attn_qat.quantize_qkv(q, k, v, causal=True)
    assert vc.block_axis == 3 and torch.equal(vc.dequantize(), attn_qat.fake_quantize(v, 3))
    assert attn_qat.quantize_qkv(q, k, v, v_block_axis="head_dim")[2].block_axis == 3
    assert attn_qat.quantize_qkv(q, k, v, causal=True, v_block_axis="tokens")[2].block_axis == 1


def test_no_gradient():
    q, k, v = make(1, 2, 2, 20, 20, 64, "cpu")
    q.requires_grad_()
    out = attn_qat.nvfp4_attention(q, *attn_qat.quantize_qkv(q.detach(), k, v)[1:])
    assert not out.requires_grad


def test_errors():
    q, k, v = make(1, 4, 2, 20, 24, 64, "cpu")
    qp, kp, vp = attn_qat.quantize_qkv(q, k, v)
    along_d = attn_qat.quantize(v, block_axis=-1)
    with pytest.raises(ValueError, match="blocked along tokens for attention without causal"):
        attn_qat.nvfp4_attention(qp, kp, along_d)
    with pytest.raises(ValueError, match="blocked along head_dim for causal attention"):
        attn_qat.nvfp4_attention(qp, kp, vp, causal=True)
    with pytest.raises(ValueError, match="v_block_axis"):
        attn_qat.nvfp4_attention(qp, kp, vp, v_block_axis="keys")
    with pytest.raises(ValueError, match="blocked along head_dim"):
        attn_qat.nvfp4_attention(qp, attn_qat.quantize(k, block_axis=1, partial_last_block=True), vp)
    with pytest.raises(ValueError, match="blocked along tokens"):  # a bshd-packed V read as bhsd
        attn_qat.nvfp4_attention(qp, kp, vp, layout="bhsd")
    with pytest.raises(TypeError, match="one dtype"):
        attn_qat.nvfp4_attention(q.half(), kp, vp)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        attn_qat.nvfp4_attention(q, attn_qat.quantize(k.float(), -1), vp)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        attn_qat.nvfp4_attention(q.float(), k.float(), v.float())
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        attn_qat.nvfp4_attention(q, kp, [1, 2])
    with pytest.raises(ValueError, match="head_dim"):
        attn_qat.nvfp4_attention(*attn_qat.quantize_qkv(*(torch.randn(1, 16, 2, 288).bfloat16() for _ in range(3))))
    with pytest.raises(ValueError, match="one shape"):
        attn_qat.nvfp4_attention(qp, kp, attn_qat.quantize_qkv(q, k[:, :16], v[:, :16])[2])
    with pytest.raises(ValueError, match="multiple"):
        attn_qat.nvfp4_attention(attn_qat.quantize(q[:, :, :3], -1), kp, vp)
    with pytest.raises(ValueError, match="batch"):
        attn_qat.nvfp4_attention(attn_qat.quantize(torch.cat([q, q]), -1), kp, vp)
    with pytest.raises(ValueError, match="4-D"):
        attn_qat.nvfp4_attention(q[0], kp, vp)
    with pytest.raises(ValueError, match="layout"):
        attn_qat.nvfp4_attention(qp, kp, vp, layout="sbhd")
    with pytest.raises(ValueError, match="partial_last_block"):
        attn_qat.quantize(v, block_axis=1)  # 24 tokens: quantize_qkv allows V's partial last block, quantize asks
