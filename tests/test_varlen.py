"""Packed-sequence attention (attn_qat.attention_varlen) against each sequence run alone: the float64 reference per
sequence at numerics.md §7's tolerances, and on the CPU bit for bit against attn_qat's own dense entry points per
sequence (the C kernels are deterministic, so a block of P or V that reached across a sequence boundary, or a hidden
key that moved anything, shows as a difference). The CUDA kernels (gpu marker) run the full list of lengths on both
paths (kernel_options(sm90=False) selects the mma.sync kernels), with the allocator poisoned so that an output row
the kernels forget to write shows as NaN."""
import contextlib
import math

import pytest
import torch

import attn_qat
from attn_qat import reference
from conftest import DEVICES, HAS_CUDA, rel_error
from test_attention import BWD_TOL, FWD_TOL, deterministic_algorithms, forward_error, poison_cuda_allocator

_seed = [5000]


def generator() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0])


def cu_seqlens(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()), dtype=torch.int32,
                        device=device)


def make(lens_q, lens_k, hq, hkv, d, dtype, device, g=None):
    """Packed q (total_q, Hq, D), k, v (total_k, Hkv, D) and dout like q."""
    g = g or generator()
    tq, tk = sum(lens_q), sum(lens_k)
    return tuple(torch.randn(n, h, d, generator=g).to(dtype).to(device)
                 for n, h in ((tq, hq), (tk, hkv), (tk, hkv), (tq, hq)))


def run_varlen(q, k, v, dout, lens_q, lens_k, **kwargs):
    """Our forward + backward on the packed tensors: (out, dq, dk, dv)."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    poison_cuda_allocator()
    out = attn_qat.attention_varlen(qg, kg, vg, cu_seqlens(lens_q, q.device), cu_seqlens(lens_k, q.device),
                                    max(lens_q, default=0), max(lens_k, default=0), **kwargs)
    poison_cuda_allocator()
    out.backward(dout)
    return out.detach(), qg.grad, kg.grad, vg.grad


def pieces(t, lengths):
    """The sequences of a packed tensor, each as (1, H, N, D)."""
    return [s.transpose(0, 1).unsqueeze(0) for s in torch.split(t, list(lengths))]


def unpack(parts):
    """(1, H, N, D) pieces back to one packed (total, H, D) tensor."""
    return torch.cat([p[0].transpose(0, 1) for p in parts])


def reference_packed(q, k, v, dout, lens_q, lens_k, causal=None, mode="attn_qat", v_block_axis="auto"):
    """The float64 reference of numerics.md run on each sequence alone, packed again: (out, dq, dk, dv)."""
    outs, dqs, dks, dvs = [], [], [], []
    for qs, ks, vs, ds in zip(*(pieces(t.cpu(), n) for t, n in ((q, lens_q), (k, lens_k), (v, lens_k),
                                                                 (dout, lens_q)))):
        if qs.shape[2] == 0 or ks.shape[2] == 0:  # no query, or no key: zeros (numerics.md §6)
            outs.append(torch.zeros(qs.shape, dtype=torch.float64))
            dqs.append(torch.zeros(qs.shape, dtype=torch.float64))
            dks.append(torch.zeros(ks.shape, dtype=torch.float64))
            dvs.append(torch.zeros(vs.shape, dtype=torch.float64))
            continue
        outs.append(reference.attention(qs, ks, vs, causal=causal, mode=mode, v_block_axis=v_block_axis))
        dq, dk, dv = reference.attention_backward(qs, ks, vs, ds, causal=causal, mode=mode, v_block_axis=v_block_axis)
        dqs.append(dq), dks.append(dk), dvs.append(dv)
    return tuple(unpack(p) for p in (outs, dqs, dks, dvs))


def check_against_reference(q, k, v, dout, lens_q, lens_k, causal=None, mode="attn_qat", **kwargs):
    ours = run_varlen(q, k, v, dout, lens_q, lens_k, causal=causal or False, mode=mode, **kwargs)
    ref = reference_packed(q, k, v, dout, lens_q, lens_k, causal=causal, mode=mode)
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert x.shape == r.shape and x.dtype == q.dtype, name
        assert x.isfinite().all(), f"{name}: {(~x.isfinite()).sum().item()} values not finite (an unwritten row?)"
    out_error, flipped = forward_error(ours[0].transpose(0, 1), ref[0].transpose(0, 1))
    errors = {"out": out_error, "flipped_rows": flipped}
    errors.update({name: rel_error(x, r) for name, x, r in zip(("dq", "dk", "dv"), ours[1:], ref[1:])})
    assert errors["out"] <= FWD_TOL, errors
    assert max(errors["dq"], errors["dk"], errors["dv"]) <= BWD_TOL, errors
    return ours


def dense_per_sequence(q, k, v, dout, lens_q, lens_k, causal=None, mode="attn_qat", v_block_axis="auto"):
    """attn_qat's dense entry points on each sequence alone (bottom-right through attention(), top-left through
    scaled_dot_product_attention()), packed again: (out, dq, dk, dv)."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs = []
    for qs, ks, vs in zip(pieces(qg, lens_q), pieces(kg, lens_k), pieces(vg, lens_k)):
        if causal == "top_left":
            outs.append(attn_qat.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, mode=mode,
                                                              v_block_axis=v_block_axis))
        else:
            outs.append(attn_qat.attention(qs, ks, vs, causal=causal == "bottom_right", layout="bhsd", mode=mode,
                                           v_block_axis=v_block_axis))
    out = unpack(outs)
    out.backward(dout)
    return out.detach(), qg.grad, kg.grad, vg.grad


# (name, query lengths, key lengths, heads_q, heads_kv, head_dim): lengths of 1, 15, 16, 17, odd ones and empty
# sequences in the middle; self-attention lengths and len_q != len_k
CASES = [
    ("mixed", [1, 17, 0, 15, 16, 40], [1, 17, 0, 15, 16, 40], 4, 2, 64),
    ("cross", [5, 30, 0, 16, 33], [20, 9, 7, 0, 48], 2, 1, 128),
    ("aligned", [16, 48, 32], [32, 16, 64], 4, 4, 64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_matches_reference_per_sequence(device, case, causal):
    _, lens_q, lens_k, hq, hkv, d = case
    q, k, v, dout = make(lens_q, lens_k, hq, hkv, d, torch.bfloat16, device)
    out = check_against_reference(q, k, v, dout, lens_q, lens_k, causal)[0]
    if causal == "bottom_right":  # a sequence with more queries than keys leaves its first rows without a key
        start = 0
        for nq, nk in zip(lens_q, lens_k):
            assert not out[start: start + max(nq - nk, 0)].any()
            start += nq


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_multi_query(device):
    lens_q, lens_k = [23, 1, 50], [40, 16, 3]
    q, k, v, dout = make(lens_q, lens_k, 4, 1, 128, torch.float16, device)
    check_against_reference(q, k, v, dout, lens_q, lens_k, "bottom_right")
    check_against_reference(q, k, v, dout, lens_q, lens_k, None)


@pytest.mark.parametrize("mode", attn_qat.MODES)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_cpu_equals_each_sequence_alone_bit_for_bit(mode, causal):
    """The C kernels sum in a fixed order, so packing must change nothing at all: not a P code, not a V block."""
    lens_q, lens_k = [1, 17, 0, 15, 16, 33, 5], [9, 17, 3, 0, 16, 20, 31]
    q, k, v, dout = make(lens_q, lens_k, 4, 2, 64, torch.bfloat16, "cpu")
    ours = run_varlen(q, k, v, dout, lens_q, lens_k, causal=causal or False, mode=mode)
    alone = dense_per_sequence(q, k, v, dout, lens_q, lens_k, causal, mode)
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, alone):
        assert torch.equal(x, r), f"{name}: packed and alone differ in {(x != r).sum().item()} values"


@pytest.mark.parametrize("v_block_axis", ["tokens", "head_dim"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_v_block_axis_override_cpu(v_block_axis, causal):
    lens = [7, 16, 25]
    q, k, v, dout = make(lens, lens, 2, 2, 64, torch.bfloat16, "cpu")
    ours = run_varlen(q, k, v, dout, lens, lens, causal=causal or False, v_block_axis=v_block_axis)
    alone = dense_per_sequence(q, k, v, dout, lens, lens, causal, v_block_axis=v_block_axis)
    for x, r in zip(ours, alone):
        assert torch.equal(x, r)
    # the default differs from the forced other axis: the choice reaches the kernels
    auto = run_varlen(q, k, v, dout, lens, lens, causal=causal or False)[0]
    assert torch.equal(auto, ours[0]) == ((v_block_axis == "tokens") == (causal is None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_hidden_keys_change_nothing(device, causal):
    """numerics.md §2: the keys of the other sequences are absent. NaN, Inf and huge values in every other sequence's
    K and V leave one sequence's output and gradients as they were (bit for bit on the CPU)."""
    lens = [20, 37, 16, 9]
    q, k, v, dout = make(lens, lens, 2, 1, 128, torch.bfloat16, device)
    clean = run_varlen(q, k, v, dout, lens, lens, causal=causal or False)
    k2, v2 = k.clone(), v.clone()
    k2[:20, 0, 3], v2[:20, 0, 5] = float("nan"), float("inf")  # sequence 0
    k2[57:73] *= 1000  # sequence 2, whole V blocks of it
    v2[57:73] *= 1000
    v2[73:, 0, :] = float("nan")  # sequence 3
    dirty = run_varlen(q, k2, v2, dout, lens, lens, causal=causal or False)
    rows = slice(20, 57)  # sequence 1
    for name, x, r in zip(("out", "dq", "dk", "dv"), dirty, clean):
        assert x[rows].isfinite().all(), f"{name}: another sequence's NaN or Inf leaked"
        if device == "cpu":
            assert torch.equal(x[rows], r[rows]), name
        else:  # the Hopper kernels flag the non-finite outputs and the mma.sync kernels redo the call
            assert rel_error(x[rows], r[rows]) < 1e-3, name


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_when_aligned(device, monkeypatch):
    """Every cu_seqlens_k entry a multiple of 16: the kernels get k and v themselves (no copy); otherwise the padded
    copy, and the gradients still come back for the original rows."""
    seen = []
    op = attn_qat.varlen.ops.attention_forward

    class Recorder:
        def __getattr__(self, name):
            return getattr(attn_qat.ops.ops, name)

        @staticmethod
        def attention_forward(q, k, v, *args):
            seen.append((q.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[2]))
            return op(q, k, v, *args)

    monkeypatch.setattr(attn_qat.varlen, "ops", Recorder())
    lens_q, lens_k = [3, 20], [32, 16]
    q, k, v, dout = make(lens_q, lens_k, 2, 2, 64, torch.bfloat16, device)
    attn_qat.attention_varlen(q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), 20, 32)
    assert seen[-1] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), 48)
    lens_k = [17, 31]
    q, k, v, dout = make(lens_q, lens_k, 2, 2, 64, torch.bfloat16, device)
    attn_qat.attention_varlen(q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), 20, 31)
    assert seen[-1][0] == q.data_ptr() and seen[-1][1] != k.data_ptr() and seen[-1][3] == 64
    # bf16 mode has no blocks: it runs in place whatever the lengths
    attn_qat.attention_varlen(q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), 20, 31, mode="bf16")
    assert seen[-1] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), 48)


@pytest.mark.parametrize("device", DEVICES)
def test_cu_seqlens_read_once_until_changed(device, monkeypatch):
    """A model's layers pass the same cu_seqlens tensors: only the first call reads them to the host (a device sync).
    Changing them in place, or passing other tensors with other values, is seen at once."""
    reads = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):  # _host_values gathers what it reads with one torch.cat
        if any(t.dtype == torch.int32 for t in tensors):
            reads.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(attn_qat.varlen.torch, "cat", counting_cat)
    lens = [5, 11]
    q, k, v, _ = make(lens, lens, 2, 2, 64, torch.bfloat16, device)
    cu = cu_seqlens(lens, device)
    first = attn_qat.attention_varlen(q, k, v, cu, cu, 11, 11, causal=True)
    again = attn_qat.attention_varlen(q, k, v, cu, cu, 11, 11, causal=True)
    assert len(reads) == 1 and torch.equal(first, again)
    cu.copy_(cu_seqlens([9, 7], device))  # in place: a new version of the same tensor
    moved = attn_qat.attention_varlen(q, k, v, cu, cu, 11, 11, causal=True)
    assert len(reads) == 2
    expected = attn_qat.attention_varlen(q, k, v, cu_seqlens([9, 7], device), cu_seqlens([9, 7], device), 9, 9,
                                         causal=True)
    assert len(reads) == 3 and torch.equal(moved, expected) and not torch.equal(moved, first)
    with torch.inference_mode():  # inference tensors have no version counter: read every time, never stale
        cu_inference = cu_seqlens([9, 7], device)
        for _ in range(2):
            assert torch.equal(attn_qat.attention_varlen(q, k, v, cu_inference, cu_inference, 9, 9, causal=True),
                               expected)
        cu_inference.copy_(cu_seqlens(lens, device))
        assert torch.equal(attn_qat.attention_varlen(q, k, v, cu_inference, cu_inference, 11, 11, causal=True), first)
    assert len(reads) == 6


@pytest.mark.parametrize("device", DEVICES)
def test_return_lse_and_layouts(device):
    lens_q, lens_k = [10, 0, 30], [5, 12, 40]
    q, k, v, _ = make(lens_q, lens_k, 4, 2, 64, torch.bfloat16, device)
    # strided inputs: q a slice of a fused projection, k and v (H, N, D) memory seen as (N, H, D)
    q = torch.cat([q, torch.zeros_like(q)], dim=-1)[..., :64]
    k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k, v))
    out, lse = attn_qat.attention_varlen(q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), 30, 40,
                                         causal=True, return_lse=True)
    assert out.shape == (40, 4, 64) and lse.shape == (4, 40) and lse.dtype == torch.float32
    for qs, ks, vs, rows in zip(pieces(q.cpu(), lens_q), pieces(k.cpu(), lens_k), pieces(v.cpu(), lens_k),
                                (slice(0, 10), slice(10, 10), slice(10, 40))):
        if qs.shape[2] == 0:
            continue
        expected = reference.attention_forward(qs, ks, vs, causal="bottom_right")["lse"][0]
        assert torch.allclose(lse[:, rows].double().cpu(), expected, rtol=0, atol=2e-3)
        assert rel_error(out[rows].transpose(0, 1), reference.attention(qs, ks, vs, causal="bottom_right")[0]) < FWD_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["no_sequence", "no_query", "no_key", "all_empty"])
def test_empty_inputs(device, empty):
    lens_q, lens_k = {"no_sequence": ([], []), "no_query": ([0, 0], [5, 7]), "no_key": ([3, 4], [0, 0]),
                      "all_empty": ([0, 0, 0], [0, 0, 0])}[empty]
    q, k, v, dout = make(lens_q, lens_k, 2, 2, 64, torch.bfloat16, device)
    out, dq, dk, dv = run_varlen(q, k, v, dout, lens_q, lens_k, causal=True)
    assert out.shape == q.shape and not out.any() and not dq.any() and not dk.any() and not dv.any()
    _, lse = attn_qat.attention_varlen(q, k, v, cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), 9, 9,
                                       return_lse=True)
    assert lse.shape == (2, sum(lens_q)) and torch.isneginf(lse).all()


def test_bad_inputs_raise_clear_errors():
    fn = attn_qat.attention_varlen
    q, k, v, _ = make([3, 5], [4, 4], 2, 2, 64, torch.bfloat16, "cpu")
    cq, ck = cu_seqlens([3, 5], "cpu"), cu_seqlens([4, 4], "cpu")
    fn(q, k, v, cq, ck, 5, 4)  # fine
    with pytest.raises(ValueError, match="q must be 3-D"):
        fn(q[None], k, v, cq, ck, 5, 4)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        fn(q, None, v, cq, ck, 5, 4)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        fn(q, k, v, cq.long(), ck, 5, 4)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        fn(q, k, v, cq, [0, 4, 8], 5, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k must be 1-D"):
        fn(q, k, v, cq, ck[None], 5, 4)
    with pytest.raises(ValueError, match="same number of sequences"):
        fn(q, k, v, cq, cu_seqlens([8], "cpu"), 5, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        fn(q, k, v, cq + 1, ck, 5, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        fn(q, k, v, cq, torch.tensor([0, 9, 8], dtype=torch.int32), 5, 9)
    with pytest.raises(ValueError, match="last entry of cu_seqlens_k"):
        fn(q, k, v, cq, cu_seqlens([4, 3], "cpu"), 5, 4)
    with pytest.raises(ValueError, match="max_seqlen_q=4 is below"):
        fn(q, k, v, cq, ck, 4, 4)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        fn(q, k, v, cq, ck, 5, 4.0)
    fn(q, k, v, cq, ck, torch.tensor(5), torch.tensor(4, dtype=torch.int32))  # transformers passes tensors
    with pytest.raises(ValueError, match="head_dim"):
        fn(q[..., :24], k[..., :24], v[..., :24], cq, ck, 5, 4)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fn(q[:, :1].expand(8, 3, 64), k, v, cq, ck, 5, 4)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        fn(q.double(), k.double(), v.double(), cq, ck, 5, 4)
    with pytest.raises(ValueError, match="causal must be"):
        fn(q, k, v, cq, ck, 5, 4, causal="top")
    with pytest.raises(ValueError, match="mode"):
        fn(q, k, v, cq, ck, 5, 4, mode="fp8")
    with pytest.raises(ValueError, match="v_block_axis"):
        fn(q, k, v, cq, ck, 5, 4, v_block_axis="rows")
    with pytest.raises(ValueError, match="softmax_scale"):
        fn(q, k, v, cq, ck, 5, 4, softmax_scale=float("inf"))
    if HAS_CUDA:
        with pytest.raises(ValueError, match="cu_seqlens_q is on"):
            fn(q.cuda(), k.cuda(), v.cuda(), cq, ck.cuda(), 5, 4)
    # the op itself refuses spans with a mask, a causal code or a batch
    spans = (torch.zeros(8, 2, dtype=torch.int32), torch.zeros(8, 2, dtype=torch.int32))
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    with pytest.raises(RuntimeError, match="causal none"):
        torch.ops.attn_qat.attention_forward(q4, k4, v4, None, 0.125, 1, 0, False, True, *spans)
    with pytest.raises(RuntimeError, match="q_span and k_span"):
        torch.ops.attn_qat.attention_forward(q4, k4, v4, None, 0.125, 0, 0, False, True, spans[0], None)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    lens_q, lens_k = [5, 19], [16, 9]
    q, k, v, dout = make(lens_q, lens_k, 4, 2, 64, torch.bfloat16, device)
    plan = attn_qat.varlen._plan((0, 5, 24), (0, 16, 25), "top_left", True, torch.device(device))
    q4 = q.transpose(0, 1)[None]
    k4, v4 = (t.new_zeros(plan.total_k, 2, 64).index_copy(0, plan.k_rows, t).transpose(0, 1)[None] for t in (k, v))
    fwd = torch.ops.attn_qat.attention_forward.default
    for mode, need_grad, along_tokens in ((0, True, False), (3, True, True), (4, False, False)):
        args = tuple(t.detach().requires_grad_(need_grad) for t in (q4, k4, v4)) + (
            None, 0.125, 0, mode, need_grad, along_tokens, plan.q_span, plan.k_span)
        torch.library.opcheck(fwd, args)
    out, out_prime, frame, row_sum, qf, kf, vf = fwd(q4, k4, v4, None, 0.125, 0, 0, True, False, plan.q_span,
                                                     plan.k_span)
    torch.library.opcheck(torch.ops.attn_qat.attention_backward.default,
                          (dout.transpose(0, 1)[None], qf, kf, vf, out, out_prime, None, frame, row_sum, 0.125, 0, 0,
                           False, False, True, plan.q_span, plan.k_span))
    # with work orders (reversed index order: 1 query tile x 4 heads, 1 key tile x 2 KV heads)
    fwd_order, dkdv_order = (torch.arange(n - 1, -1, -1, dtype=torch.int32, device=device) for n in (4, 2))
    args = tuple(t.detach().requires_grad_() for t in (q4, k4, v4)) + (
        None, 0.125, 0, 0, True, False, plan.q_span, plan.k_span, fwd_order, dkdv_order)
    torch.library.opcheck(fwd, args)
    torch.library.opcheck(torch.ops.attn_qat.attention_backward.default,
                          (dout.transpose(0, 1)[None], qf, kf, vf, out, out_prime, None, frame, row_sum, 0.125, 0, 0,
                           False, False, True, plan.q_span, plan.k_span, dkdv_order))


# mix16k of benchmarks/bench_varlen.py (issue 32)
MIX16K = [4096, 3001, 2500, 2011, 1777, 1203, 900, 555, 201, 140]


def tile_work_row_by_row(span, n_other, rows, cols):
    """The kernels' count of the other axis's tiles (or steps) a tile of rows visits, restated per tile: from the
    tile of its first row's span start to the tile holding its last row's span end."""
    span, n = span.tolist(), span.shape[0]
    work = []
    for r0 in range(0, n, rows):
        lo = min(max(span[r0][0], 0), n_other)
        hi = max(lo, min(max(span[min(r0 + rows, n) - 1][1], 0), n_other))
        work.append(math.ceil(hi / cols) - lo // cols)
    return work


@pytest.mark.parametrize("lengths, lengths_k, heads", [
    (MIX16K, MIX16K, (16, 16)), (MIX16K, MIX16K, (16, 4)), ([5, 300, 17, 1000, 64], [5, 301, 40, 900, 64], (3, 1))])
@pytest.mark.parametrize("mode, head_dim, need_grad", [
    ("attn_qat", 128, True), ("attn_qat", 128, False), ("bf16", 128, False), ("bf16", 64, True)])
def test_work_orders_are_longest_first(lengths, lengths_k, heads, mode, head_dim, need_grad):
    """The LPT tables are permutations of the kernels' items (head * tiles + tile) with non-increasing work, equal
    work in (head, tile) order, the work counted as the kernels count it."""
    cu = (0,) + tuple(torch.tensor(lengths).cumsum(0).tolist())
    cu_k = (0,) + tuple(torch.tensor(lengths_k).cumsum(0).tolist())
    plan = attn_qat.varlen._Plan(cu, cu_k, None, attn_qat.varlen._needs_padding(cu_k, mode), torch.device("cpu"))
    bm, bn = attn_qat.varlen._fwd_tiles(mode, head_dim, head_dim, need_grad)
    assert (bm, bn) == ((192, 64) if mode == "bf16" and head_dim == 128 else (128, 64 if need_grad and
                                                                              mode == "attn_qat" else 128))
    orders = plan.orders(*heads, (bm, bn))
    spans = (plan.q_span, plan.k_span)
    tiles = ((bm, bn), (attn_qat.varlen.DKDV_KEYS, attn_qat.varlen.DKDV_Q_STEP))
    for order, span, other, (rows, cols), h in zip(orders, spans, (plan.total_k, cu[-1]), tiles, heads):
        work = tile_work_row_by_row(span, other, rows, cols)
        if len(set(work)) == 1:
            assert order is None
            continue
        assert order is not None and order.dtype == torch.int32 and order.shape == (len(work) * h,)
        items = order.tolist()
        assert sorted(items) == list(range(len(work) * h))
        keys = [(-work[i % len(work)], i // len(work), i % len(work)) for i in items]
        assert keys == sorted(keys)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_packings_get_no_order(alignment):
    """Under a causal limit the items run in index order: longest first lost there (performance.md)."""
    cu = (0,) + tuple(torch.tensor(MIX16K).cumsum(0).tolist())
    plan = attn_qat.varlen._Plan(cu, cu, alignment, False, torch.device("cpu"))
    assert plan.orders(16, 4, attn_qat.varlen._fwd_tiles("attn_qat", 128, 128, True)) == (None, None)


def test_equal_items_get_no_order():
    """8 x 2048 not causal (the dense batch's tiles, all equal): index order, no table (performance.md). Not so the
    192-row tiles of bf16 mode at D = 128, some of which straddle two sequences: their forward gets one."""
    cu = tuple(range(0, 8 * 2048 + 1, 2048))
    plan = attn_qat.varlen._Plan(cu, cu, None, False, torch.device("cpu"))
    for mode, d, need_grad in (("attn_qat", 128, True), ("attn_qat", 64, False), ("bf16", 64, True)):
        assert plan.orders(16, 16, attn_qat.varlen._fwd_tiles(mode, d, d, need_grad)) == (None, None)
    fwd, dkdv = plan.orders(16, 16, attn_qat.varlen._fwd_tiles("bf16", 128, 128, True))
    assert fwd is not None and dkdv is None


def test_orders_reach_the_ops(monkeypatch):
    """attention_varlen passes the forward's table and, when training, the dK/dV kernel's (which autograd saves
    for the backward op), none under a causal limit; the CPU kernels ignore them."""
    lens = [300, 17, 129]
    q, k, v, dout = make(lens, lens, 2, 1, 64, torch.bfloat16, "cpu")
    seen = []

    class Recorder:
        def __getattr__(self, name):
            op = getattr(torch.ops.attn_qat, name)
            return lambda *args: seen.append((name, args)) or op(*args)

    monkeypatch.setattr(attn_qat.varlen, "ops", Recorder())
    out, dq, dk, dv = run_varlen(q, k, v, dout, lens, lens)
    (name, args), = seen
    assert name == "attention_forward" and args[-2].dtype == torch.int32 and args[-1].dtype == torch.int32
    assert all(t.isfinite().all() for t in (out, dq, dk, dv))
    with torch.no_grad():
        seen.clear()
        attn_qat.attention_varlen(q, k, v, cu_seqlens(lens, "cpu"), cu_seqlens(lens, "cpu"), 300, 300)
        assert seen[0][1][-2] is not None and seen[0][1][-1] is None
        seen.clear()
        attn_qat.attention_varlen(q, k, v, cu_seqlens(lens, "cpu"), cu_seqlens(lens, "cpu"), 300, 300, causal=True)
        assert seen[0][1][-2] is None and seen[0][1][-1] is None


def test_op_checks_work_orders():
    q, k, v, _ = make([3, 5], [4, 4], 2, 2, 64, torch.bfloat16, "cpu")
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    plan = attn_qat.varlen._plan((0, 3, 8), (0, 4, 8), None, False, torch.device("cpu"))
    order = torch.arange(2, dtype=torch.int32)
    fwd = torch.ops.attn_qat.attention_forward
    with pytest.raises(RuntimeError, match="work_order comes only with spans"):
        fwd(q4, k4, v4, None, 0.125, 0, 0, False, True, None, None, order)
    with pytest.raises(RuntimeError, match="contiguous 1-D int32"):
        fwd(q4, k4, v4, None, 0.125, 0, 0, False, True, plan.q_span, plan.k_span, order.long())
    with pytest.raises(RuntimeError, match="contiguous 1-D int32"):
        fwd(q4, k4, v4, None, 0.125, 0, 0, False, True, plan.q_span, plan.k_span, None, order[None])


def test_torch_compile():
    lens = [5, 20]
    q, k, v, dout = make(lens, lens, 2, 2, 64, torch.bfloat16, "cpu")
    cu = cu_seqlens(lens, "cpu")
    eager = attn_qat.attention_varlen(q, k, v, cu, cu, 20, 20, causal=True)
    compiled = torch.compile(attn_qat.attention_varlen, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, cu, cu, 20, 20, causal=True), eager)


# ---------------------------------------------------------------------------------------------------------------
# CUDA (both kernel paths)

# every length of the brief, a sequence of 4097 among short ones, tile boundaries of both kernel families around
GPU_LENGTHS = [1, 17, 0, 15, 16, 4097, 63, 64, 65, 127, 128, 129, 5, 200]


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["sm90", "mma_sync"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_matches_reference_per_sequence(kernel_options, path, causal, d):
    kernel_options(sm90=path == "sm90")
    lens_q = GPU_LENGTHS
    lens_k = GPU_LENGTHS if causal != "bottom_right" else [n + (7 if i % 2 else -min(n, 9)) for i, n in
                                                          enumerate(GPU_LENGTHS)]
    q, k, v, dout = make(lens_q, lens_k, 2, 1, d, torch.bfloat16, "cuda")
    ours = check_against_reference(q, k, v, dout, lens_q, lens_k, causal)
    # the dense kernels on each sequence alone compute the same numbers, up to fp32 summation order
    alone = dense_per_sequence(q, k, v, dout, lens_q, lens_k, causal)
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, alone):
        assert rel_error(x, r) < 2e-3, name


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fp16", "deterministic", "split", "drop_in", "bf16"])
def test_cuda_variants(kernel_options, variant):
    """fp16; the deterministic dQ kernel; a forced last-wave split (over each item's own key or query range, here
    with items of very different lengths); the modes whose backward runs another forward (drop_in) or none of the
    quantization (bf16, which runs unaligned lengths in place)."""
    lens_q = [300, 17, 1000, 1, 64, 450]
    lens_k = [300, 40, 900, 16, 64, 451]
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    mode = variant if variant in ("drop_in", "bf16") else "attn_qat"
    if variant == "split":
        kernel_options(tail_split=(7, 3))
    q, k, v, dout = make(lens_q, lens_k, 4, 2, 128, dtype, "cuda")
    with deterministic_algorithms() if variant == "deterministic" else contextlib.nullcontext():
        for causal in (None, "bottom_right"):
            check_against_reference(q, k, v, dout, lens_q, lens_k, causal, mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["training", "inference", "deterministic", "split", "bf16", "d64"])
def test_cuda_work_order_changes_no_bit(kernel_options, variant):
    """Longest first (the LPT tables) or index order: every output bit the same, as each item is computed alike
    wherever it runs and the split last wave keeps its items; only the fused dQ's fp32 sums may add in another
    order (as they may run to run)."""
    lens = [700, 33, 260, 1, 129, 1000, 64, 300]
    mode = "bf16" if variant == "bf16" else "attn_qat"
    d = 64 if variant == "d64" else 128
    if variant == "split":
        kernel_options(tail_split=(7, 3))
    q, k, v, dout = make(lens, lens, 4, 2, d, torch.bfloat16, "cuda")
    cu = (0,) + tuple(torch.tensor(lens).cumsum(0).tolist())
    plan = attn_qat.varlen._plan(cu, cu, None, attn_qat.varlen._needs_padding(cu, mode), torch.device("cuda"))
    assert all(o is not None for o in plan.orders(4, 2, attn_qat.varlen._fwd_tiles(mode, d, d, True)))
    results = {}
    for order in ("index", "lpt"):
        kernel_options(work_order=order)
        if variant == "inference":
            with torch.no_grad():
                results[order] = (attn_qat.attention_varlen(
                    q, k, v, cu_seqlens(lens, "cuda"), cu_seqlens(lens, "cuda"), 1000, 1000, mode=mode),)
            continue
        with deterministic_algorithms() if variant == "deterministic" else contextlib.nullcontext():
            results[order] = run_varlen(q, k, v, dout, lens, lens, mode=mode)
    for name, x, r in zip(("out", "dq", "dk", "dv"), results["lpt"], results["index"]):
        if name == "dq" and variant != "deterministic":
            assert rel_error(x, r) < 1e-3, name
        else:
            assert torch.equal(x, r), name


@pytest.mark.gpu
def test_cuda_work_order_of_the_wrong_length_fails():
    lens = [300, 17, 129]
    q, k, v, _ = make(lens, lens, 2, 2, 64, torch.bfloat16, "cuda")
    cu = (0,) + tuple(torch.tensor(lens).cumsum(0).tolist())
    plan = attn_qat.varlen._plan(cu, cu, None, True, torch.device("cuda"))
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    k4, v4 = (t.new_zeros(1, 2, plan.total_k, 64) for t in (k4, v4))
    with pytest.raises(RuntimeError, match="work_order must list"):
        torch.ops.attn_qat.attention_forward(q4, k4, v4, None, 0.125, 0, 0, False, True, plan.q_span, plan.k_span,
                                             torch.arange(3, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
def test_cuda_equal_sequences_match_the_dense_batch():
    """8 packed sequences of 256 are the dense (8, 256) batch: the same tiles, so the same numbers up to the order
    in which the backward's fused dQ adds its tiles."""
    b, n = 8, 256
    q, k, v, dout = make([n] * b, [n] * b, 4, 2, 128, torch.bfloat16, "cuda")
    for causal in (False, True):
        ours = run_varlen(q, k, v, dout, [n] * b, [n] * b, causal=causal)
        qd, kd, vd = (t.detach().view(b, n, *t.shape[1:]).requires_grad_() for t in (q, k, v))
        out = attn_qat.attention(qd, kd, vd, causal=causal)
        out.backward(dout.view(b, n, *dout.shape[1:]))
        dense = (out.detach(), qd.grad, kd.grad, vd.grad)
        for name, x, r in zip(("out", "dq", "dk", "dv"), ours, dense):
            assert rel_error(x, r.reshape(x.shape)) < 1e-3, name


@pytest.mark.gpu
def test_cpu_and_cuda_agree():
    lens = [33, 0, 16, 70]
    q, k, v, dout = make(lens, lens, 2, 2, 64, torch.bfloat16, "cpu")
    cpu = run_varlen(q, k, v, dout, lens, lens, causal=True)
    gpu = run_varlen(q.cuda(), k.cuda(), v.cuda(), dout.cuda(), lens, lens, causal=True)
    for a, b in zip(cpu, gpu):  # as test_attention's agreement: isolated P codes may flip (numerics.md §7)
        assert rel_error(b, a) < 5e-3
