"""Head dims other than 64 and 128, and V's head dim differing from Q's and K's (DeepSeek's 192 / 128): every
multiple of 16 from 32 to 256, against attn_qat.reference at the awkward sizes of test_attention.py, on the CPU
kernels and on the GPU (the mma.sync kernels, which take the head dims the Hopper kernels do not)."""
import os

import pytest
import torch

import attn_qat
from attn_qat import reference
from conftest import DEVICES, rel_error
from test_attention import check, fresh_generator, run

# (Q/K head dim, V head dim): the ones models use (Phi-2 80, Phi-3 96, Gemma and Qwen3-Next 256, DeepSeek MLA
# 192 / 128), the smallest, a few odd multiples of 16, and V's wider and narrower than Q's.
DIMS = [(32, 32), (48, 48), (80, 80), (96, 96), (112, 112), (160, 160), (192, 128), (256, 256), (64, 128),
        (128, 64), (144, 208)]
CPU_DIMS = [(32, 32), (80, 80), (192, 128), (256, 256), (64, 128)]


def make_inputs(b, hq, hkv, nq, nk, d, d_v, dtype, device, g=None):
    g = g or fresh_generator()

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return t(b, hq, nq, d), t(b, hkv, nk, d), t(b, hkv, nk, d_v), t(b, hq, nq, d_v)


# the CPU kernels take every head dim by one loop and cost N^2 D: a few dims there, all on the GPU
CASES = ([pytest.param("cpu", d, id=f"cpu-{d[0]}-{d[1]}") for d in CPU_DIMS] +
         [pytest.param("cuda", d, id=f"cuda-{d[0]}-{d[1]}", marks=pytest.mark.gpu) for d in DIMS])


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("device, dims", CASES)
def test_head_dims_against_reference(device, dims, causal):
    """GQA, N_q != N_k, neither a multiple of a tile, both causal alignments."""
    d, d_v = dims
    q, k, v, dout = make_inputs(1, 4, 2, 77, 93, d, d_v, torch.bfloat16, device)
    check(q, k, v, dout, causal=causal, api="attention" if causal == "bottom_right" else "sdpa",
          label=f"D {d}, Dv {d_v}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", attn_qat.MODES)
def test_every_mode_at_192_128(device, mode):
    q, k, v, dout = make_inputs(2, 2, 1, 40, 70, 192, 128, torch.bfloat16, device)
    check(q, k, v, dout, mode=mode, causal="top_left", label=mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [96, 256])
def test_masks_fp16_and_empty_rows(device, d):
    g = fresh_generator()
    q, k, v, dout = make_inputs(2, 2, 2, 50, 70, d, d, torch.float16, device, g=g)
    mask = (torch.randn(2, 1, 50, 70, generator=g) * 2).to(device)
    mask[:, :, :, 60:] = float("-inf")
    mask[0, :, 7] = float("-inf")  # a row with no visible key
    check(q, k, v, dout, mask=mask, label="additive")
    out, dq, _, _ = run(q, k, v, dout, mask=mask)
    assert not out[0, :, 7].any() and not dq[0, :, 7].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dims", [(80, 80), (192, 128)], ids=str)
def test_packed_sequences(device, dims):
    """attention_varlen (no Hopper tiles at these dims: no work order) equals each sequence on its own: bit for bit
    on the CPU, whose kernels sum in a fixed order, to fp32 summation order on the GPU."""
    d, d_v = dims
    g = fresh_generator()
    cu = torch.tensor([0, 37, 38, 98], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(98, h, dim, generator=g).to(torch.bfloat16).to(device) for h, dim in ((4, d), (2, d),
                                                                                                   (2, d_v)))
    out = attn_qat.attention_varlen(q, k, v, cu, cu, 60, 60, causal=True)
    assert out.shape == (98, 4, d_v)
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = attn_qat.attention(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], causal=True)[0]
        if device == "cpu":
            assert torch.equal(out[lo:hi], alone)
        else:
            assert rel_error(out[lo:hi], alone) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256), (192, 128)], ids=str)
def test_gpu_matches_cpu(dims):
    """The CUDA kernels and the C CPU kernels follow one contract: their outputs agree to fp32 summation order (the
    bound of test_attention.py's test_cpu_and_cuda_agree; the H100 gave 3.5e-3 for dQ at 64)."""
    d, d_v = dims
    q, k, v, dout = make_inputs(1, 2, 2, 45, 60, d, d_v, torch.bfloat16, "cpu")
    cpu = run(q, k, v, dout, causal="top_left")
    gpu = run(*(t.cuda() for t in (q, k, v, dout)), causal="top_left")
    for name, a, c in zip(("out", "dq", "dk", "dv"), gpu, cpu):
        assert rel_error(a.cpu(), c) < 5e-3, name


@pytest.mark.gpu
def test_non_finite_values_and_strided_operands_at_256():
    """A NaN in a hidden key's V row stays out (the scrub of a 256-wide tile takes two columns a thread), and
    operands whose rows are not 16-byte aligned take the unvectorised loads."""
    g = fresh_generator()
    q, k, v, dout = make_inputs(1, 2, 2, 30, 40, 256, 256, torch.bfloat16, "cuda", g=g)
    v[0, :, 35, 200] = float("nan")  # key 35 is hidden from queries 0..34 (top-left causal)
    out = attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.isfinite(out[:, :, :35]).all() and torch.isnan(out[:, :, 35:, 200]).all()
    # bf16 mode: the kernels read the operands themselves (no pre-pass copy), here rows 8-byte aligned
    wide = torch.randn(1, 2, 40, 264, generator=g).to(torch.bfloat16).cuda()[..., 4:260]
    ref = reference.attention(q.cpu(), wide.cpu(), wide.cpu(), mode="bf16")
    assert rel_error(attn_qat.scaled_dot_product_attention(q, wide, wide, mode="bf16").cpu(), ref) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dims, where", [((256, 256), "dout"), ((256, 256), "k"), ((256, 256), "v"),
                                         ((192, 128), "q")], ids=str)
def test_non_finite_values_in_the_second_column_slice(dims, where):
    """NaN and Inf in the second 128-column slice of an operand (columns 150 and 200 / 140), which the mma.sync
    kernels scrub and poison per slice: non-finite exactly where the float64 reference is (test_attention.py's
    test_nonfinite_values_seen_spread_like_the_reference), the reference's values elsewhere."""
    d, d_v = dims
    q, k, v, dout = make_inputs(1, 2, 2, 96, 96, d, d_v, torch.bfloat16, "cpu")
    t, row = {"v": (v, 70), "k": (k, 70), "q": (q, 40), "dout": (dout, 40)}[where]
    t[0, 0, row, 150] = float("nan")
    t[0, 1, row, min(200, t.shape[-1] - 1)] = float("inf")
    ours = run(*(x.cuda() for x in (q, k, v, dout)), causal="top_left")
    ref = (reference.attention(q, k, v, causal="top_left"),
           *reference.attention_backward(q, k, v, dout, causal="top_left"))
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        x, finite = x.double().cpu(), r.isfinite()
        assert torch.equal(x.isfinite(), finite), f"{name}: non-finite where the reference is finite, or the reverse"
        assert not finite.any() or rel_error(x[finite], r[finite]) < 1e-2, name
    assert ours[0].isfinite().any() and any(x.isnan().any() for x in ours), "the case tests nothing"


@pytest.mark.gpu
def test_backward_reads_unaligned_rows_at_256():
    """Operands whose rows are 8-byte aligned take the unvectorised loads, in the backward too (bf16 mode)."""
    g = fresh_generator()
    q, _, _, dout = make_inputs(1, 2, 2, 30, 40, 256, 256, torch.bfloat16, "cuda", g=g)
    wide = torch.randn(1, 2, 40, 264, generator=g).to(torch.bfloat16).cuda()[..., 4:260]
    ours = run(q, wide, wide, dout, mode="bf16")
    ref = (reference.attention(q.cpu(), wide.cpu(), wide.cpu(), mode="bf16"),
           *reference.attention_backward(q.cpu(), wide.cpu(), wide.cpu(), dout.cpu(), mode="bf16"))
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_error(x.cpu(), r) < 1e-2, name


def test_value_head_dim_may_differ_but_key_may_not():
    q = torch.randn(1, 2, 10, 64, dtype=torch.bfloat16)
    assert attn_qat.scaled_dot_product_attention(q, q, q[..., :32].contiguous()).shape == (1, 2, 10, 32)
    with pytest.raises(ValueError, match="query and key must share head_dim"):
        attn_qat.scaled_dot_product_attention(q, q[..., :32].contiguous(), q)
    for bad in (16, 72, 272):
        x = torch.randn(1, 2, 10, bad, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=f"head_dim {bad} is not supported"):
            attn_qat.scaled_dot_product_attention(q, q, x)
    assert attn_qat.SUPPORTED_HEAD_DIMS == tuple(range(32, 257, 16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [32, 80, 256])
def test_kv_cache_at_other_head_dims(device, head_dim):
    """NVFP4KVCache takes every head dim; those the CUDA decode kernel does not (64 and 128 only) take the
    composite path (dequantize, then the attention kernels), paged too, against the float64 reference."""
    from test_kv_cache import UNEQUAL, Filled
    from test_kv_cache import check as check_cache
    f = Filled(3, 2, head_dim, 80, torch.bfloat16, device, page_size=48)
    for tokens, lengths in UNEQUAL:
        f.append(tokens, lengths)
    for tq, causal in ((1, True), (5, True), (3, False)):
        check_cache(f, f.query(4, tq), causal, f"D {head_dim}, Tq {tq}")


@pytest.mark.parametrize("head_dim", [96, 256])
def test_transformers_model_at_other_head_dims_trains_in_fp4(head_dim):
    """A Qwen3-shaped model with head_dim 96 or 256 (Phi-3's, Gemma's) runs every attention call in FP4 after
    `prepare`, no fallback warned, and its gradients flow."""
    import warnings
    from test_integrations_report import _qwen3
    model = _qwen3(head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error", attn_qat.AttnQATFallbackWarning)
        attn_qat.prepare(model)
        model(torch.randint(0, 64, (2, 20)), labels=torch.randint(0, 64, (2, 20))).loss.backward()
    report = attn_qat.attention_report(model)
    assert [m.calls for m in report.modules] == [{"fp4": 1}] * 2 and report.fallbacks == {}
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)


def profiled(fn, cuda=False):
    """fn()'s result and what it ran as the profiler names it (torch ops, or with `cuda` CUDA kernels), each name's
    total time in microseconds."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
    return result, times


def pads(fn):
    """Whether fn() zero-pads a tensor (the binding's torch::stable::pad shows in the profiler as aten::pad)."""
    return "aten::pad" in profiled(fn)[1]


@pytest.mark.parametrize("mode", ["attn_qat", "drop_in", "bf16"])
@pytest.mark.parametrize("dims", [(32, 32), (80, 80), (96, 64), (64, 128), (112, 48), (192, 128), (160, 160),
                                  (256, 128)], ids=str)
def test_padded_head_dims_change_nothing(kernel_options, dims, mode):
    """kernel_options(pad_head_dims=True) zero-pads head dims up to 128 that the Hopper kernels do not take to 64 or
    128, and with sm90_d256 a forward without O' above 128 to 256, on the CPU too: the C kernels sum in a fixed order
    and the padding columns add exact zeros, so outputs and gradients are bit for bit the unpadded ones (the forward,
    the backward, the drop-in backward's rerun forward, the packed path and the forward on prequantized operands). On
    an H100 "auto" pads there, to run the Hopper kernels."""
    d, d_v = dims
    kernel_options(sm90_d256=True)
    q, k, v, dout = make_inputs(2, 4, 2, 37, 50, d, d_v, torch.bfloat16, "cpu")
    cu_q, cu_k = torch.tensor([0, 37, 74], dtype=torch.int32), torch.tensor([0, 50, 100], dtype=torch.int32)
    packed = [t.transpose(1, 2).flatten(0, 1) for t in (q, k, v)]  # the batch's sequences one after another

    def calls():
        varlen = attn_qat.attention_varlen(*packed, cu_q, cu_k, 37, 50, causal=True, mode=mode)
        return (run(q, k, v, dout, mode=mode, causal="top_left"),
                attn_qat.prefill.attention_prequantized(q, k, v, 0.3, True), varlen)

    def prequantized():
        return attn_qat.prefill.attention_prequantized(q, k, v, 0.3, True)

    kernel_options(pad_head_dims=False)
    plain, plain_pre, plain_varlen = calls()
    assert not pads(prequantized)
    kernel_options(pad_head_dims=True)
    padded, padded_pre, padded_varlen = calls()
    assert pads(prequantized)  # so the comparisons below compare something
    for name, a, b in zip(("out", "dq", "dk", "dv"), padded, plain):
        assert a.shape == b.shape and torch.equal(a, b), name
    assert torch.equal(padded_pre, plain_pre) and torch.equal(padded_varlen, plain_varlen)
    if max(dims) > 128:  # only a forward without O' goes to 256: sm90_d256 off pads nothing
        kernel_options(sm90_d256=False)
        assert not pads(prequantized)


def test_pad_head_dims_option_checks_its_value():
    with pytest.raises(ValueError, match="pad_head_dims"):
        attn_qat.ops.kernel_options(pad_head_dims="yes")
    with attn_qat.ops.kernel_options(pad_head_dims=True) as options:
        assert options.pad_head_dims is True
    assert attn_qat.ops.kernel_options().pad_head_dims == "auto"


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(80, 80), (96, 64), (32, 32)], ids=str)
def test_padded_hopper_kernels_agree_with_the_mma_sync_ones(kernel_options, dims):
    """On a GPU where the Hopper kernels run, "auto" pads these head dims for them; the mma.sync kernels take them
    unpadded (pad_head_dims=False): the same numerics, to fp32 summation order."""
    d, d_v = dims
    q, k, v, dout = make_inputs(2, 4, 2, 200, 170, d, d_v, torch.bfloat16, "cuda")
    padded = run(q, k, v, dout, causal="top_left")
    kernel_options(pad_head_dims=False)
    plain = run(q, k, v, dout, causal="top_left")
    for name, a, b in zip(("out", "dq", "dk", "dv"), padded, plain):
        assert rel_error(a, b) < 5e-3, name


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_padded_calls_return_the_layouts_of_unpadded_ones(kernel_options, layout):
    """The ops' outputs and gradients of a padded call have the sizes and strides the unpadded call (and the fake
    kernels, which torch.compile plans from) give them: (B, H, S, D) views of (B, S, H, D) memory stay so."""
    g = fresh_generator()
    shape = (2, 30, 4, 80) if layout == "bshd" else (2, 4, 30, 80)
    q, k, v, dout = (torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(4))
    if layout == "bshd":
        q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))
    results = {}
    for pad in (False, True):
        kernel_options(pad_head_dims=pad)
        results[pad] = run(q, k, v, dout)
        fwd = attn_qat.ops.ops.attention_forward(q, k, v, None, 0.1, 0, 0, True, True)
        results[pad] += tuple(t for t in fwd if t.numel())
    for a, b in zip(results[True], results[False]):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_opcheck_of_a_padded_call(kernel_options, layout):
    """torch.library.opcheck (schema, fake kernel against the real one, autograd registration, AOT dispatch) of the
    training forward on a padded call: what torch.compile relies on holds with the padding too."""
    kernel_options(pad_head_dims=True)
    g = fresh_generator()

    def t(h, d):
        if layout == "bshd":
            return torch.randn(1, 24, h, d, generator=g).to(torch.bfloat16).transpose(1, 2).requires_grad_()
        return torch.randn(1, h, 24, d, generator=g).to(torch.bfloat16).requires_grad_()

    torch.library.opcheck(attn_qat.ops.ops.attention_forward.default, (t(4, 80), t(2, 80), t(2, 48), None, 0.1, 0, 0,
                                                                      True, True))


def test_sm90_d256_option_checks_its_value():
    with pytest.raises(TypeError, match="sm90_d256"):
        attn_qat.ops.kernel_options(sm90_d256=1)
    with attn_qat.ops.kernel_options(sm90_d256=True) as options:
        assert options.sm90_d256 is True
    if os.environ.get("ATTN_QAT_SM90_D256") != "1":  # off until it has run against the reference on a GPU
        assert attn_qat.ops.kernel_options().sm90_d256 is False


def hopper_forward_at_256(names):
    return any("attention_fwd_sm90_kernel<256," in n for n in names)


def mma_sync_forward_us(times):
    """The mma.sync forward kernels' time at D = 256 (with hidden keys launched behind the Hopper kernel, which they
    leave alone unless it flagged a non-finite output)."""
    return sum(t for n, t in times.items() if "attention_fwd_kernel<256," in n)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["attn_qat", "bf16"])
@pytest.mark.parametrize("case", ["plain", "causal", "masked", "split", "fp16", "many_items", "many_items_causal"])
def test_hopper_forward_at_256(kernel_options, mode, case):
    """kernel_options(sm90_d256=True): the Hopper forwards that keep no second accumulator for O' (inference; training
    in modes without O', and bf16) take D = 256 in 64-key tiles. Against the reference at awkward sizes (GQA, N_q !=
    N_k, neither a tile multiple), causal, a mask with an empty row, a forced tail split, fp16, more items than SMs
    (the persistent bf16 kernel's loop), the allocator poisoned; against the mma.sync kernels (the option off) to fp32
    summation order; on an H100 the Hopper kernel is what ran. With hidden keys a non-finite Hopper output would be
    redone by the mma.sync kernel (launched behind it either way, idle unless flagged), whose bits the Hopper kernel's
    often equal: so the redo is looked for in that kernel's time. The training forward and backward run too (check)."""
    from test_attention import FWD_TOL, forward_error, poison_cuda_allocator
    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    g = fresh_generator()
    b, hq, hkv, nq, nk = (2, 16, 4, 600, 517) if case.startswith("many_items") else (2, 4, 2, 300, 333)
    q, k, v, dout = make_inputs(b, hq, hkv, nq, nk, 256, 256, dtype, "cuda", g=g)
    mask = None
    if case == "masked":
        mask = torch.rand(b, 1, nq, nk, generator=g) > 0.3
        mask[1, :, 17] = False  # a row with no visible key: O = 0
        mask = mask.cuda()
    if case == "split":
        kernel_options(tail_split=(5, 3))
    is_causal = case in ("causal", "many_items_causal")

    def inference():
        poison_cuda_allocator()
        with torch.no_grad():
            return attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                         enable_gqa=True, mode=mode)

    kernel_options(sm90_d256=True)
    out, names = profiled(inference, cuda=True)
    if torch.cuda.get_device_capability() == (9, 0):
        assert hopper_forward_at_256(names), "the Hopper forward did not run at D = 256"
    ref = reference.attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=None if mask is None else mask.cpu(),
                              causal="top_left" if is_causal else None, mode=mode)
    error, flipped = forward_error(out, ref)
    assert error <= FWD_TOL, f"error {error} ({flipped} rows set aside)"
    if case == "masked":
        assert not out[1, :, 17].any()
    kernel_options(sm90_d256=False)
    plain, plain_names = profiled(inference, cuda=True)
    assert not hopper_forward_at_256(plain_names)
    assert rel_error(out, plain) < 1e-3
    if torch.cuda.get_device_capability() == (9, 0):  # the two often agree bit for bit, so the redo shows in time
        assert mma_sync_forward_us(names) < 0.5 * mma_sync_forward_us(plain_names), "the Hopper output was redone"
    if case in ("plain", "causal"):
        kernel_options(sm90_d256=True)
        for training_mode in (mode, "low_precision_o", "drop_in") if mode == "attn_qat" else (mode,):
            check(q, k, v, dout, mode=training_mode, causal="top_left" if is_causal else None,
                  label=f"training at 256 with sm90_d256, {training_mode}")


@pytest.mark.gpu
def test_hopper_forward_at_256_packed_and_cache(kernel_options):
    """With sm90_d256 the packed path (attention_varlen: spans, no work order at 256) and the NVFP4 KV cache's
    composite path (a mask of the lengths) reach the Hopper forward at 256 too: they agree with the option off."""
    g = fresh_generator()
    cu = torch.tensor([0, 300, 301, 700], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(700, h, 256, generator=g).to(torch.bfloat16).cuda() for h in (4, 2, 2))
    cache = attn_qat.NVFP4KVCache(2, 2, 256, 64, device="cuda")
    cache.append(*(torch.randn(2, 2, 50, 256, generator=g).to(torch.bfloat16).cuda() for _ in "kv"), lengths=[50, 23])
    query = torch.randn(2, 8, 20, 256, generator=g).to(torch.bfloat16).cuda()  # > 16 queries: the composite path

    def calls():
        with torch.no_grad():
            return (attn_qat.attention_varlen(q, k, v, cu, cu, 400, 400, causal=True), cache.attention(query))

    kernel_options(sm90_d256=True)
    (packed, cached), names = profiled(calls, cuda=True)
    if torch.cuda.get_device_capability() == (9, 0):
        assert hopper_forward_at_256(names)
    kernel_options(sm90_d256=False)
    plain_packed, plain_cached = calls()
    assert rel_error(packed, plain_packed) < 1e-3 and rel_error(cached, plain_cached) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(192, 128), (160, 160)], ids=str)
def test_hopper_forward_at_256_takes_padded_head_dims(kernel_options, dims):
    """With sm90_d256 an inference forward above 128 (DeepSeek's 192 / 128) is zero-padded to 256 for the Hopper
    forward ("auto" padding): against the reference, and against the mma.sync kernels (the option off)."""
    from test_attention import FWD_TOL, forward_error
    d, d_v = dims
    q, k, v, _ = make_inputs(2, 4, 2, 300, 333, d, d_v, torch.bfloat16, "cuda")

    def inference():
        with torch.no_grad():
            return attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    kernel_options(sm90_d256=True)
    out, names = profiled(inference, cuda=True)
    if torch.cuda.get_device_capability() == (9, 0):
        assert hopper_forward_at_256(names)
    assert out.shape == (2, 4, 300, d_v)
    error, flipped = forward_error(out, reference.attention(q.cpu(), k.cpu(), v.cpu(), causal="top_left"))
    assert error <= FWD_TOL, f"error {error} ({flipped} rows set aside)"
    kernel_options(sm90_d256=False)
    assert rel_error(out, inference()) < 1e-3
