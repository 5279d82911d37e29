"""NVFP4 quantizers (numerics.md §1): bit-exact against attn_qat.reference on CPU and CUDA."""
import pytest
import torch

import attn_qat
from attn_qat import reference
from conftest import DEVICES

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def unpack(codes: torch.Tensor, axis: int, n: int) -> torch.Tensor:
    """Packed bytes -> one code per element along axis (element 2k in the low nibble)."""
    codes = codes.movedim(axis, -1)
    both = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)[..., :n]
    return both.movedim(-1, axis)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including NaN positions and the sign of zero."""
    a, b = a.float().cpu(), b.float().cpu()
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) or (
        torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        and torch.equal(torch.signbit(a), torch.signbit(b)))


def check_against_reference(x: torch.Tensor, axis: int):
    t = attn_qat.quantize(x, axis)
    ref_codes, ref_scales = reference.quantize_blocks(x.cpu(), axis)
    n = x.shape[axis]
    assert torch.equal(unpack(t.codes.cpu(), axis % x.dim(), n), ref_codes), "E2M1 codes differ from the reference"
    assert same_bits(t.scales.float(), ref_scales), "E4M3 scales differ from the reference"
    fq = attn_qat.fake_quantize(x, axis)
    assert fq.dtype == x.dtype and fq.shape == x.shape
    assert same_bits(fq, reference.fake_quantize(x.cpu(), axis)), "fake_quantize differs from the reference"
    assert same_bits(t.dequantize(), fq), "dequantize(quantize(x)) differs from fake_quantize(x)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_blocks_match_reference(device, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 3, 64, generator=g) * torch.logspace(-4, 3, 64)).to(dtype).to(device)
    check_against_reference(x, -1)
    y = torch.randn(48, 5, 33, generator=g).to(dtype).to(device)
    check_against_reference(y, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_every_e2m1_code_and_tie(device):
    # Scale 1 (amax 6 -> 6/6 = 1 exactly): the block's values are the E2M1 inputs themselves.
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    values = [6.0] + list(ties) + [0.5, 1.5, 3.0, 0.26, 0.74, 5.01, 4.99]
    x = torch.tensor(values + [0.0] * (16 - len(values)), device=device)
    out = attn_qat.fake_quantize(torch.cat([x, -x]).view(2, 16)).cpu()
    expected = [6.0] + list(ties.values()) + [0.5, 1.5, 3.0, 0.5, 0.5, 6.0, 4.0] + [0.0] * (16 - len(values))
    assert out[0].tolist() == expected
    assert out[1].tolist() == [-e for e in expected]
    for code, mag in enumerate(E2M1_MAGNITUDES):
        block = torch.full((16,), mag, device=device)
        block[0] = 6.0
        t = attn_qat.quantize(block)
        assert int(unpack(t.codes, 0, 16)[1]) == code


@pytest.mark.parametrize("device", DEVICES)
def test_scale_rounding_saturation_subnormal_zero(device):
    amaxes = torch.tensor([6 * 448.0, 6 * 1000.0, 1e30, 6 * 2.0**-9, 6 * 3 * 2.0**-9, 6 * 2.0**-10,
                           6 * 1.01 * 2.0**-10, 6 * 0.99 * 2.0**-10, 6 * 0.015625, 6 * 1.0625, 0.0])
    expected = [448.0, 448.0, 448.0, 2.0**-9, 3 * 2.0**-9, 0.0, 2.0**-9, 0.0, 0.015625, 1.0, 0.0]
    x = torch.zeros(len(amaxes), 16)
    x[:, 3] = amaxes
    x[:, 4] = amaxes / 3
    t = attn_qat.quantize(x.to(device))
    assert t.scales.float().flatten().cpu().tolist() == expected
    check_against_reference(x.to(device), -1)
    zero_block = attn_qat.fake_quantize(torch.zeros(2, 32, device=device))
    assert not zero_block.any()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_blocks_become_nan(device):
    x = torch.randn(4, 32)
    x[0, 3] = float("nan")
    x[1, 20] = float("inf")
    x[2, 0] = float("-inf")
    out = attn_qat.fake_quantize(x.to(device)).cpu()
    assert torch.isnan(out[0, :16]).all() and torch.isfinite(out[0, 16:]).all()
    assert torch.isnan(out[1, 16:]).all() and torch.isfinite(out[1, :16]).all()
    assert torch.isnan(out[2, :16]).all()
    assert torch.isfinite(out[3]).all()
    check_against_reference(x.to(device), -1)


@pytest.mark.parametrize("device", DEVICES)
def test_packing_order(device):
    # Element 2k in the low nibble, 2k+1 in the high nibble; scale 1 makes the codes predictable.
    x = torch.tensor([6.0, 0.5, 1.0, -1.5] + [0.0] * 12, device=device)
    t = attn_qat.quantize(x)
    assert t.codes.cpu().tolist()[:2] == [7 | (1 << 4), 2 | ((8 | 3) << 4)]
    assert t.codes.shape == (8,) and t.scales.shape == (1,) and t.nbytes == 9


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 64, 40, generator=g).to(torch.bfloat16).to(device)
    for view, axis in [(base.transpose(1, 2), 2), (base[:, :, ::2], 1), (base[::2].permute(2, 0, 1), 2),
                       (base[:, :32].expand(2, 6, 32, 40).transpose(0, 3), 2)]:
        expected = attn_qat.fake_quantize(view.contiguous(), axis)
        assert torch.equal(attn_qat.fake_quantize(view, axis), expected)
        check_against_reference(view, axis)


@pytest.mark.parametrize("device", DEVICES)
def test_partial_last_block(device):
    x = torch.randn(3, 37, 8).to(device)
    with pytest.raises(ValueError, match="multiple"):
        attn_qat.fake_quantize(x, 1)
    with pytest.raises(ValueError, match="multiple"):
        attn_qat.quantize(x, 1)
    out = attn_qat.fake_quantize(x, 1, partial_last_block=True)
    ref = reference.fake_quantize(x.cpu(), 1, partial_last_block=True)
    assert same_bits(out, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_fake_quantize_qkv_axes(device):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 40, 64, generator=g).to(torch.bfloat16).to(device)
    kv_memory = torch.randn(2, 37, 3, 64, generator=g).to(torch.bfloat16).to(device)  # (B, N, H, D) memory
    k = kv_memory.transpose(1, 2)
    qf, kf, vf = attn_qat.fake_quantize_qkv(q, k, k)
    assert same_bits(qf, reference.fake_quantize(q.cpu(), -1))
    assert same_bits(kf, reference.fake_quantize(k.cpu(), -1))
    assert same_bits(vf, reference.fake_quantize(k.cpu(), 2, partial_last_block=True))
    assert vf.stride(1) < vf.stride(2), "the pre-pass keeps a token-major input token-major"
    # causal attention blocks V along head_dim (numerics.md §2), like K; either axis can be forced
    _, _, vf_causal = attn_qat.fake_quantize_qkv(q, k, k, causal=True)
    assert same_bits(vf_causal, kf) and vf_causal.stride(1) < vf_causal.stride(2)
    assert same_bits(attn_qat.fake_quantize_qkv(q, k, k, v_block_axis="head_dim")[2], kf)
    assert same_bits(attn_qat.fake_quantize_qkv(q, k, k, causal=True, v_block_axis="tokens")[2], vf)
    with pytest.raises(ValueError, match="v_block_axis"):
        attn_qat.fake_quantize_qkv(q, k, k, v_block_axis="channels")


def test_bad_inputs():
    with pytest.raises(TypeError, match="dtype"):
        attn_qat.quantize(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(IndexError):
        attn_qat.quantize(torch.zeros(16), block_axis=3)
    with pytest.raises(TypeError):
        attn_qat.fake_quantize([1.0] * 16)
    with pytest.raises(TypeError, match="dtype"):
        attn_qat.dequantize(attn_qat.quantize(torch.zeros(16)), torch.int8)


def test_straight_through_gradient():
    x = torch.randn(4, 32, requires_grad=True)
    g = torch.randn(4, 32)
    attn_qat.fake_quantize(x).backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_and_cuda_bit_identical(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 8, 256, generator=g) * torch.logspace(-6, 4, 256)).to(dtype)
    x[0, 0, 5] = float("nan")
    x[1, 2, 200] = float("inf")
    for axis in (2, 0):
        cpu, gpu = attn_qat.quantize(x, axis), attn_qat.quantize(x.cuda(), axis)
        assert torch.equal(cpu.codes, gpu.codes.cpu())
        assert torch.equal(cpu.scales.view(torch.uint8), gpu.scales.cpu().view(torch.uint8))
        assert same_bits(attn_qat.fake_quantize(x, axis), attn_qat.fake_quantize(x.cuda(), axis))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_dequantize_layouts(dtype):
    """The CUDA dequantizers (a block a thread along the innermost axis; a code row of 4 columns along an outer
    axis; an element a thread otherwise) give the CPU's values and fake_quantize's: odd lengths, a partial last
    block, a NaN block, the allocator poisoned."""
    g = torch.Generator().manual_seed(6)
    for shape, axis in [((5, 3, 64), -1), ((2, 37, 8), 1), ((33, 12), 0), ((3, 37, 6), 1)]:
        x = (torch.randn(shape, generator=g) * 10).to(dtype)
        x.view(-1)[7] = float("nan")
        cpu = attn_qat.quantize(x, axis, partial_last_block=True).dequantize()
        packed = attn_qat.quantize(x.cuda(), axis, partial_last_block=True)
        torch.full(x.shape, float("nan"), dtype=dtype, device="cuda")  # freed, then handed out to the output
        gpu = packed.dequantize()
        assert same_bits(gpu, cpu), f"{shape} axis {axis}"
        assert same_bits(gpu, attn_qat.fake_quantize(x, axis, partial_last_block=True)), f"{shape} axis {axis}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_tokens_fake_quantize_every_16_bit_value(dtype):
    """The V pre-pass's kernel (blocks along an outer axis, eight 16-bit columns a thread: fake_quantize_tokens_kernel
    in quantize_cuda.cu, with its own rounding path) on every 16-bit pattern (NaN, Inf, subnormals, -0), in blocks
    of neighbouring magnitudes and of mixed ones, then a block of -0 and a partial last block, the output poisoned
    first: bit for bit the CPU kernel's values."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).view(2048, 32)
    mixed = x.flatten()[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(8))].view(2048, 32)
    tail = torch.cat([torch.full((16, 32), -0.0), torch.randn(5, 32, generator=torch.Generator().manual_seed(9))])
    for t in (x, mixed, tail.to(dtype)):
        on_gpu = t.cuda()
        torch.full_like(on_gpu, float("nan"))  # freed, then handed out again to the output (same size, same pool)
        gpu = attn_qat.fake_quantize(on_gpu, 0, partial_last_block=True)
        assert same_bits(gpu, attn_qat.fake_quantize(t, 0, partial_last_block=True))


@pytest.mark.gpu
def test_cuda_matches_reference_on_many_random_values():
    # Wide dynamic range so every scale exponent, subnormal scales and flushed blocks all occur.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 16, generator=g) * torch.exp2(torch.randint(-40, 20, (4096, 1), generator=g).float())
    check_against_reference(x.cuda(), -1)
