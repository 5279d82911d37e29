"""Attention forward and backward against attn_qat.reference (float64) at numerics.md §7's tolerances,
across the coverage matrix of the training issue, on fresh random inputs with poisoned outputs."""
import contextlib
import json
import math
import os
import struct
import warnings

import pytest
import torch

import attn_qat
from attn_qat import reference
from conftest import DEVICES, HAS_CUDA, rel_error

try:
    import triton
    import triton.language as tl
except ImportError:  # only the GPU check of ex2's monotonicity needs it
    triton = None

FWD_TOL, BWD_TOL = 3e-3, 1e-2
# numerics.md §7 lets isolated P codes flip where the kernel's fp32 scores land on the other side of a
# rounding boundary than the float64 reference's; one flip moves its row by a few percent. The forward
# check sets aside up to this fraction of the rows (at least one), each within FLIP_ROW_TOL.
FLIP_ROW_FRACTION, FLIP_ROW_TOL = 0.01, 0.25

# (name, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
SHAPES = [
    ("square", 2, 2, 2, 128, 128, 128),
    ("odd", 1, 3, 3, 77, 93, 64),
    ("gqa", 1, 4, 2, 100, 130, 128),
    ("mqa", 2, 4, 1, 33, 200, 64),
    ("one_query", 1, 2, 2, 1, 50, 128),
    ("cross", 1, 2, 2, 190, 17, 64),  # many queries, few keys, like Wan's text cross-attention
]
_seed = [1000]


def fresh_generator() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0])


def make_inputs(b, hq, hkv, nq, nk, d, dtype, device, layout="bhsd", g=None):
    """q (B, Hq, Nq, D), k, v (B, Hkv, Nk, D), dout like q; `layout="bshd"` returns (B, H, S, D) views of
    (B, S, H, D) memory, as diffusers and transformers pass them."""
    g = g or fresh_generator()

    def make(h, n):
        t = torch.randn(b, n, h, d, generator=g) if layout == "bshd" else torch.randn(b, h, n, d, generator=g)
        t = t.to(dtype).to(device)
        return t.transpose(1, 2) if layout == "bshd" else t

    return make(hq, nq), make(hkv, nk), make(hkv, nk), make(hq, nq)


def poison_cuda_allocator():
    """Fill the blocks the caching allocator will hand out next with NaN, so an output element the
    kernel forgets to write shows up as NaN instead of a stale plausible value."""
    if HAS_CUDA:
        for mb in (1, 4, 16, 64):
            torch.full((mb << 18,), float("nan"), device="cuda")
        torch.cuda.synchronize()


def run(q, k, v, dout, *, mode="attn_qat", mask=None, causal=None, api="sdpa"):
    """Our forward + backward; returns (out, dq, dk, dv) in (B, H, S, D)."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    # keep the caller's layout (clone keeps strides)
    poison_cuda_allocator()
    if api == "sdpa":
        out = attn_qat.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=causal == "top_left",
                                                    enable_gqa=True, mode=mode)
    else:
        out = attn_qat.attention(qg, kg, vg, causal=causal == "bottom_right", layout="bhsd", mode=mode)
    poison_cuda_allocator()
    out.backward(dout)
    return out.detach(), qg.grad, kg.grad, vg.grad


def log_errors(q, k, mode, causal, mask, api, label, errors):
    """With ATTN_QAT_ERROR_LOG set, append each case's measured errors (JSON lines) for the coverage report."""
    path = os.environ.get("ATTN_QAT_ERROR_LOG")
    if not path:
        return
    case = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "label": label,
            "device": q.device.type, "dtype": str(q.dtype).replace("torch.", ""),
            "shape": [q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]],
            "mode": mode, "causal": causal, "mask": None if mask is None else str(mask.dtype).replace("torch.", ""),
            "api": api, "errors": errors}
    with open(path, "a") as f:
        f.write(json.dumps(case) + "\n")


def forward_error(out: torch.Tensor, ref: torch.Tensor):
    """(relative Frobenius error of O over the rows left after setting aside isolated flips, rows set aside)."""
    out, ref = out.double().cpu().flatten(0, -2), ref.double().cpu().flatten(0, -2)
    diff = (out - ref).norm(dim=-1)
    row_error = diff / ref.norm(dim=-1).clamp_min(1e-30)
    budget = max(1, int(FLIP_ROW_FRACTION * len(row_error)))
    worst = row_error.nan_to_num(float("inf")).topk(budget).indices
    flipped = worst[(row_error[worst] > 4 * FWD_TOL) & (row_error[worst] <= FLIP_ROW_TOL)]
    keep = torch.ones(len(row_error), dtype=torch.bool)
    keep[flipped] = False
    return float(diff[keep].norm() / ref[keep].norm().clamp_min(1e-30)), len(flipped)


def check(q, k, v, dout, *, mode="attn_qat", mask=None, causal=None, api="sdpa", label=""):
    out, dq, dk, dv = run(q, k, v, dout, mode=mode, mask=mask, causal=causal, api=api)
    qc, kc, vc, dc = (t.cpu() for t in (q, k, v, dout))
    mc = None if mask is None else mask.cpu()
    ref = reference.attention(qc, kc, vc, attn_mask=mc, causal=causal, mode=mode)
    grads = reference.attention_backward(qc, kc, vc, dc, mode=mode, attn_mask=mc, causal=causal)
    out_error, flipped_rows = forward_error(out, ref)
    errors = {"out": out_error, "flipped_rows": flipped_rows}
    errors.update({name: rel_error(ours, r) for name, ours, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads)})
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and dq.shape == q.shape and dk.shape == k.shape
    assert dv.shape == v.shape
    log_errors(q, k, mode, causal, mask, api, label, errors)
    assert errors["out"] <= FWD_TOL, f"{label} forward error {errors}"
    assert max(errors["dq"], errors["dk"], errors["dv"]) <= BWD_TOL, f"{label} backward error {errors}"
    return errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_shapes_and_causal(device, shape, causal):
    _, b, hq, hkv, nq, nk, d = shape
    if causal == "bottom_right" and nq > nk:
        pytest.skip("covered by test_empty_rows")
    q, k, v, dout = make_inputs(b, hq, hkv, nq, nk, d, torch.bfloat16, device)
    check(q, k, v, dout, causal=causal, api="attention" if causal == "bottom_right" else "sdpa", label=shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", attn_qat.MODES)
@pytest.mark.parametrize("d", [64, 128])
def test_modes(device, mode, d):
    q, k, v, dout = make_inputs(1, 4, 2, 70, 110, d, torch.bfloat16, device)
    check(q, k, v, dout, mode=mode, causal="top_left", label=mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fp16_and_token_major_layout(device, layout):
    q, k, v, dout = make_inputs(2, 4, 2, 90, 75, 128, torch.float16, device, layout=layout)
    check(q, k, v, dout, label=layout)
    out, dq, dk, dv = run(q, k, v, dout)
    if layout == "bshd":  # outputs and gradients keep the inputs' memory layout: no hidden copies
        assert out.stride(1) < out.stride(2) and dq.stride(1) < dq.stride(2) and dk.stride(1) < dk.stride(2)


@pytest.mark.parametrize("device", DEVICES)
def test_bool_padding_mask(device):
    b, h, n = 3, 2, 96
    q, k, v, dout = make_inputs(b, h, h, n, n, 64, torch.bfloat16, device)
    lengths = torch.tensor([96, 50, 17])
    mask = (torch.arange(n)[None, :] < lengths[:, None]).view(b, 1, 1, n).to(device)  # transformers' padding mask
    check(q, k, v, dout, mask=mask, label="padding")


@pytest.mark.parametrize("device", DEVICES)
def test_additive_mask(device):
    g = fresh_generator()
    q, k, v, dout = make_inputs(2, 2, 2, 65, 80, 128, torch.bfloat16, device, g=g)
    mask = (torch.randn(2, 1, 65, 80, generator=g) * 2).to(device)
    mask[:, :, :, 70:] = float("-inf")
    check(q, k, v, dout, mask=mask, label="additive")
    check(q, k, v, dout, mask=mask.to(torch.bfloat16), label="additive bf16")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows(device):
    # Bottom-right causal with more queries than keys leaves the first Nq - Nk rows with no key.
    q, k, v, dout = make_inputs(1, 2, 2, 40, 24, 64, torch.bfloat16, device)
    errors = check(q, k, v, dout, causal="bottom_right", api="attention", label="bottom-right, Nq > Nk")
    out, dq, _, _ = run(q, k, v, dout, causal="bottom_right", api="attention")
    assert not out[:, :, :16].any() and not dq[:, :, :16].any()
    assert errors["out"] <= FWD_TOL
    _, lse = attn_qat.attention(q, k, v, causal=True, layout="bhsd", return_lse=True)
    assert torch.isneginf(lse[:, :, :16]).all() and torch.isfinite(lse[:, :, 16:]).all()
    # A bool mask row with no True entry.
    mask = torch.ones(40, 24, dtype=torch.bool, device=device)
    mask[5] = False
    out, dq, _, _ = run(q, k, v, dout, mask=mask)
    assert not out[:, :, 5].any() and not dq[:, :, 5].any() and torch.isfinite(out).all()


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k) with something empty
EMPTY_SHAPES = {"batch": (0, 2, 2, 5, 7), "heads": (1, 0, 0, 5, 7), "queries": (1, 4, 2, 0, 7),
                "keys": (1, 4, 2, 5, 0), "both": (1, 2, 2, 0, 0)}


def torch_sdpa_of_empty(q, k, v, **kwargs):
    """torch's SDPA on empty operands, where torch has a result: with no heads torch 2.11's CPU SDPA divides by the
    head count (SIGFPE), so the empty result stands in, tied to q, k and v for their (empty) gradients; its CUDA SDPA
    returns None for an empty batch, so its CPU result stands in."""
    if q.shape[-3] == 0:
        return q * 0 + (k.sum() + v.sum()) * 0
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    if out is None:
        cpu = {key: x.cpu() if isinstance(x, torch.Tensor) else x for key, x in kwargs.items()}
        out = torch.nn.functional.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), **cpu).to(q.device)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", EMPTY_SHAPES)
def test_empty_inputs_match_sdpa(device, empty):
    """Empty operands give what torch's SDPA gives: an empty output, or zeros where queries have no key, and zero
    gradients; attention() does the same in either layout, with an LSE of -inf for queries without keys."""
    b, hq, hkv, nq, nk = EMPTY_SHAPES[empty]
    q, k, v, dout = make_inputs(b, hq, hkv, nq, nk, 64, torch.bfloat16, device)
    for causal in (False, True):
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        theirs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attn_qat.scaled_dot_product_attention(*ours, is_causal=causal, enable_gqa=True)
        expected = torch_sdpa_of_empty(*theirs, is_causal=causal, enable_gqa=True)
        assert out.shape == expected.shape and out.dtype == expected.dtype and torch.equal(out, expected)
        out.backward(dout)
        expected.backward(dout)
        for mine, torch_t in zip(ours, theirs):
            assert mine.grad.shape == torch_t.grad.shape and torch.equal(mine.grad.cpu(), torch_t.grad.cpu())
    mask = torch.ones(nq, nk, dtype=torch.bool, device=device)
    expected = torch_sdpa_of_empty(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), expected)
    if b:  # unbatched
        assert attn_qat.scaled_dot_product_attention(q[0], k[0], v[0], enable_gqa=True).shape == q.shape[1:]
    for layout in ("bhsd", "bshd"):
        args = (q, k, v) if layout == "bhsd" else (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out, lse = attn_qat.attention(*args, causal=True, layout=layout, return_lse=True)
        assert out.shape == args[0].shape and not out.any()
        assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32 and torch.isneginf(lse).all()


def test_empty_inputs_are_still_checked():
    q, k, v, _ = make_inputs(1, 2, 2, 0, 7, 64, torch.bfloat16, "cpu")
    sdpa = attn_qat.scaled_dot_product_attention
    with pytest.raises(ValueError, match="head_dim"):
        sdpa(q[..., :40], k[..., :40], v[..., :40])
    with pytest.raises(ValueError, match="mode"):
        sdpa(q, k, v, mode="fp8")
    with pytest.raises(ValueError, match="broadcast"):
        sdpa(q, k, v, attn_mask=torch.ones(3, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="scale"):
        sdpa(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="multiple"):
        sdpa(torch.zeros(1, 2, 5, 64, dtype=torch.bfloat16), k[:, :0], v[:, :0], enable_gqa=True)


@pytest.mark.parametrize("device", DEVICES)
def test_finfo_min_mask_rows_are_empty_not_nan(device):
    # transformers masks with torch.finfo(dtype).min; a fully masked (padding) query row must not
    # produce NaN, which would poison every gradient through the backward.
    q, k, v, dout = make_inputs(2, 2, 2, 24, 24, 64, torch.bfloat16, device)
    mask = torch.zeros(2, 1, 24, 24, device=device)
    mask[1, :, :, 10:] = torch.finfo(torch.bfloat16).min
    mask[1, :, 20:, :] = torch.finfo(torch.bfloat16).min
    out, dq, dk, dv = run(q, k, v, dout, mask=mask)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    assert not out[1, :, 20:].any() and not dq[1, :, 20:].any()
    inf_mask = mask.masked_fill(mask < -1e30, float("-inf"))
    check(q, k, v, dout, mask=inf_mask, label="finfo.min as -inf")
    assert torch.equal(out, run(q, k, v, dout, mask=inf_mask)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_lse_matches_reference(device):
    q, k, v, _ = make_inputs(2, 4, 2, 50, 70, 128, torch.bfloat16, device)
    for mode, quantize in (("attn_qat", True), ("bf16", False)):
        out, lse = attn_qat.attention(q, k, v, causal=True, layout="bhsd", mode=mode, return_lse=True)
        ref = reference.attention_forward(q.cpu(), k.cpu(), v.cpu(), causal="bottom_right", quantize=quantize)
        assert lse.shape == (2, 4, 50) and lse.dtype == torch.float32
        assert rel_error(lse, ref["lse"]) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_nan_row_is_not_finite_garbage(device):
    q, k, v, dout = make_inputs(1, 2, 2, 48, 48, 64, torch.bfloat16, device)
    q = q.clone()
    q[0, 1, 7, 3] = float("nan")
    out = attn_qat.scaled_dot_product_attention(q, k, v)
    assert torch.isnan(out[0, 1, 7]).all()
    bad = ~torch.isfinite(out)
    bad[0, 1, 7] = False
    assert not bad.any(), "NaN leaked into other rows"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["attn_qat", "bf16", "deterministic", "split"])
@pytest.mark.parametrize("hide", ["causal", "mask"])
@pytest.mark.parametrize("where", ["v", "k", "q", "dout"])
def test_nonfinite_values_under_hidden_terms(kernel_options, device, variant, hide, where):
    # docs/numerics.md §8: a term no query can see contributes nothing, even where the key, value, query or gradient
    # row behind it holds NaN or Inf. The Hopper kernels multiply such terms by a P of 0 and, where an output comes out
    # non-finite, have the mma.sync kernels redo the call: every output must come out finite and the reference's.
    # The poisoned rows are hidden from every query (keys past the last query's causal reach or masked for all rows,
    # queries with no visible key), so any NaN or Inf that reaches an output is a leak. Variants: the bf16-mode
    # kernels, the deterministic dQ kernel, and (masked only: the split is not causal) a forced last-wave split.
    if hide == "causal":
        # top-left with 144 queries and 160 keys: keys 144..159 (one whole V block) are nobody's; bottom-right with
        # 176 queries: rows 0..15 see no key
        nq, nk, causal, api = (144, 160, "top_left", "sdpa") if where in ("v", "k") else (176, 160, "bottom_right",
                                                                                         "attention")
        mask = None
    else:
        nq, nk, causal, api = 176, 160, None, "sdpa"
        mask = torch.ones(nq, nk, dtype=torch.bool)
        mask[:, 96:112] = False  # keys 96..111 (a whole V block) hidden from every row
        mask[5] = False  # row 5 sees no key
    q, k, v, dout = make_inputs(1, 2, 2, nq, nk, 128, torch.bfloat16, "cpu")
    t, row = {"v": (v, 150 if hide == "causal" else 100), "k": (k, 150 if hide == "causal" else 100),
              "q": (q, 5), "dout": (dout, 5)}[where]
    t[0, 0, row, 5] = float("nan")
    t[0, 1, row, 9] = float("inf")
    mode = "bf16" if variant == "bf16" else "attn_qat"
    if variant == "split":
        kernel_options(tail_split=(2, 2))
    with deterministic_algorithms() if variant == "deterministic" else contextlib.nullcontext():
        ours = run(*(x.to(device) for x in (q, k, v, dout)), mode=mode, mask=None if mask is None else mask.to(device),
                   causal=causal, api=api)
    ref = (reference.attention(q, k, v, attn_mask=mask, causal=causal, mode=mode),) + tuple(
        reference.attention_backward(q, k, v, dout, attn_mask=mask, causal=causal, mode=mode))
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        x = x.double().cpu()
        assert r.isfinite().all(), f"the case hides nothing: the reference's {name} is not finite"
        assert x.isfinite().all(), f"{name}: a hidden NaN or Inf leaked into {(~x.isfinite()).sum().item()} values"
        assert rel_error(x, r) <= (FWD_TOL if name == "out" else BWD_TOL), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["v", "k", "q", "dout"])
def test_nonfinite_values_seen_spread_like_the_reference(device, where):
    # The other side of §8: NaN and Inf that some query does see reach exactly the outputs the reference says
    # (causal, so the same rows are also hidden from earlier queries), and the finite values are the reference's.
    n = 160
    q, k, v, dout = make_inputs(1, 2, 2, n, n, 128, torch.bfloat16, "cpu")
    t, row = {"v": (v, 130), "k": (k, 130), "q": (q, 70), "dout": (dout, 70)}[where]
    t[0, 0, row, 5] = float("nan")
    t[0, 1, row, 9] = float("inf")
    ours = run(*(x.to(device) for x in (q, k, v, dout)), causal="top_left")
    ref = (reference.attention(q, k, v, causal="top_left"),) + tuple(
        reference.attention_backward(q, k, v, dout, causal="top_left"))
    for name, x, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        x = x.double().cpu()
        # Which non-finite value is not the contract's: a visible P^F of 0 times an Inf in dO is NaN in the reference,
        # and the CPU kernel, which sums only the nonzero terms, gives Inf. A NaN value leaves no dK finite (delta
        # spreads it to every later row, each of which sees every earlier key).
        finite = r.isfinite()
        assert torch.equal(x.isfinite(), finite), f"{name}: non-finite where the reference is finite, or the reverse"
        assert not finite.any() or rel_error(x[finite], r[finite]) <= (FWD_TOL if name == "out" else BWD_TOL), name
    assert ours[0].isfinite().any() and any(x.isnan().any() for x in ours), "the case tests nothing"


@contextlib.contextmanager
def deterministic_algorithms(on: bool = True):
    """torch.use_deterministic_algorithms(on) for the block: with it the backward sums dQ without atomics."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_deterministic(device):
    q, k, v, dout = make_inputs(1, 4, 1, 130, 140, 64, torch.bfloat16, device)
    with deterministic_algorithms():
        first = run(q, k, v, dout, causal="top_left")
        second = run(q, k, v, dout, causal="top_left")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES[:4], ids=[s[0] for s in SHAPES[:4]])
@pytest.mark.parametrize("mode", ["attn_qat", "bf16"])
def test_deterministic_backward(device, shape, mode):
    """The deterministic backward (dQ from its own kernel) against the reference; the default one (dQ summed
    by atomics on Hopper) is what every other test checks."""
    _, b, hq, hkv, nq, nk, d = shape
    q, k, v, dout = make_inputs(b, hq, hkv, nq, nk, d, torch.bfloat16, device)
    with deterministic_algorithms():
        check(q, k, v, dout, mode=mode, causal="top_left", label=shape[0])


@pytest.mark.parametrize("device", DEVICES)
def test_inference_matches_training_forward(device):
    q, k, v, _ = make_inputs(1, 2, 2, 64, 64, 128, torch.bfloat16, device)
    with torch.no_grad():
        inference = attn_qat.scaled_dot_product_attention(q, k, v)
    training = attn_qat.scaled_dot_product_attention(q.requires_grad_(), k, v)
    assert torch.equal(inference, training.detach())


def test_unbatched_input_like_sdpa():
    q, k, v, _ = make_inputs(1, 2, 2, 20, 30, 64, torch.bfloat16, "cpu")
    out = attn_qat.scaled_dot_product_attention(q[0], k[0], v[0])
    assert out.shape == (2, 20, 64)
    assert torch.equal(out, attn_qat.scaled_dot_product_attention(q, k, v)[0])


def test_bshd_api_matches_sdpa():
    q, k, v, _ = make_inputs(2, 4, 2, 30, 30, 64, torch.bfloat16, "cpu", layout="bshd")
    out = attn_qat.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="bshd")
    assert out.shape == (2, 30, 4, 64)
    assert torch.equal(out.transpose(1, 2), attn_qat.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_autocast_casts_fp32_inputs():
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn_qat.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, attn_qat.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()))


def test_autocast_casts_the_float32_ones_of_mixed_inputs():
    """transformers' Qwen3 (5.2x, float32 weights under autocast) hands over q and k in float32 and v in bfloat16;
    autocast would cast all three for PyTorch's SDPA, and so does attn_qat, in the integrations' check too."""
    from attn_qat.integrations.routing import unsupported_reason
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert unsupported_reason(q, k, v.bfloat16(), None, 0.0, True, False) is None
        out = attn_qat.scaled_dot_product_attention(q, k, v.bfloat16(), is_causal=True)
    assert torch.equal(out, attn_qat.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                                  is_causal=True))
    assert unsupported_reason(q, k, v.bfloat16(), None, 0.0, True, False) == \
        "query, key and value have different dtypes"  # outside autocast: an error, as before
    with pytest.raises(TypeError, match="one dtype"):
        attn_qat.scaled_dot_product_attention(q, k, v.bfloat16())


def test_bad_inputs_raise_clear_errors():
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.bfloat16, "cpu")
    sdpa = attn_qat.scaled_dot_product_attention
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        sdpa(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head_dim"):
        sdpa(q[..., :40].contiguous(), k[..., :40].contiguous(), v[..., :40].contiguous())
    with pytest.raises(ValueError, match="head_dim"):
        x = torch.randn(1, 2, 20, 272, dtype=torch.bfloat16)
        sdpa(x, x, x)
    with pytest.raises(ValueError, match="one device"):
        sdpa(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="dropout"):
        sdpa(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="multiple"):
        sdpa(torch.randn(1, 3, 20, 64, dtype=torch.bfloat16), k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="broadcast"):
        sdpa(q, k, v, attn_mask=torch.ones(3, 20, dtype=torch.bool))
    with pytest.raises(ValueError, match="not both"):
        sdpa(q, k, v, attn_mask=torch.ones(20, 20, dtype=torch.bool), is_causal=True)
    with pytest.raises(TypeError, match="bool or floating"):
        sdpa(q, k, v, attn_mask=torch.ones(20, 20, dtype=torch.int64))
    with pytest.raises(TypeError, match="one dtype"):
        sdpa(q, k.half(), v)
    with pytest.raises(ValueError, match="mode"):
        sdpa(q, k, v, mode="fp8")
    with pytest.raises(ValueError, match="layout"):
        attn_qat.attention(q, k, v, layout="sbhd")
    with pytest.raises(NotImplementedError, match="attn_mask"):
        sdpa(q, k, v, attn_mask=torch.zeros(20, 20, requires_grad=True))


class TinyAttention(torch.nn.Module):
    def __init__(self, d_model=128, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).unbind(2)
        out = attn_qat.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=True)
        return out.transpose(1, 2).reshape(b, n, -1)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    model = TinyAttention().to(device, torch.bfloat16)
    x = torch.randn(2, 40, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out = compiled(x)
    out.sum().backward()
    ref = model(x.detach())
    assert torch.equal(out, ref)


@pytest.mark.gpu
def test_cuda_graph_capture():
    q, k, v, dout = make_inputs(1, 2, 2, 100, 100, 64, torch.bfloat16, "cuda")
    q.requires_grad_()
    eager_out, eager_dq, _, _ = run(q, k, v, dout)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as torch's docs ask
        attn_qat.scaled_dot_product_attention(q, k, v).backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    q.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn_qat.scaled_dot_product_attention(q, k, v)
        out.backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(q.grad, eager_dq)


@pytest.mark.gpu
def test_cpu_and_cuda_agree():
    q, k, v, dout = make_inputs(1, 4, 2, 70, 90, 128, torch.bfloat16, "cpu")
    cpu = run(q, k, v, dout, causal="top_left")
    gpu = run(q.cuda(), k.cuda(), v.cuda(), dout.cuda(), causal="top_left")
    for a, b in zip(cpu, gpu):
        assert rel_error(b, a) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 2049])
def test_longer_sequences_cuda(n):
    q, k, v, dout = make_inputs(1, 2, 1, n, n, 128, torch.bfloat16, "cuda")
    check(q, k, v, dout, causal="top_left", label=f"n={n}")
    check(q, k, v, dout, label=f"n={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
def test_fused_dq_chunks_complete(d, causal):
    """The fused dQ (dK/dV kernel adding each key tile's dS K into fp32 chunks of 64 queries, then converted) under
    causal masks, where each key tile's loop starts at another chunk, and bottom-right with Nq > Nk leaves whole
    chunks that no key tile reaches (here the first 384 rows: 400 see no key), whose dQ must still be written as
    zeros (the allocator is poisoned). The deterministic dQ kernel must agree."""
    for nq, nk in ((1000, 600), (600, 1000)):
        q, k, v, dout = make_inputs(2, 6, 2, nq, nk, d, torch.bfloat16, "cuda")
        api = "sdpa" if causal == "top_left" else "attention"
        check(q, k, v, dout, causal=causal, api=api, label=f"fused dQ, {nq} x {nk}")
        dq = run(q, k, v, dout, causal=causal, api=api)[1]
        with deterministic_algorithms():
            dq_deterministic = run(q, k, v, dout, causal=causal, api=api)[1]
        assert rel_error(dq, dq_deterministic) < 1e-3
        if causal == "bottom_right" and nq > nk:
            assert not dq[:, :, : nq - nk].any()


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["default", "deterministic", "mma_sync"])
def test_causal_backward_order_covers_every_tile(kernel_options, kernels):
    """A short causal backward grid goes longest first across chunks of heads (work_item_at in
    csrc/attention/scheduler.cuh), the last chunk smaller: on 132 SMs, 5 x 7 heads of 1000 tokens make chunks of 18
    and 17 heads (Hopper's 128-key and 128-query tiles; 12, 12 and 11 for mma.sync's 64-key tiles). Every gradient row
    (the allocator poisoned before the run) must match the reference."""
    q, k, v, dout = make_inputs(5, 7, 7, 1000, 1000, 64, torch.bfloat16, "cuda",
                                g=torch.Generator().manual_seed(77))
    kernel_options(sm90=kernels != "mma_sync")
    with deterministic_algorithms() if kernels == "deterministic" else contextlib.nullcontext():
        check(q, k, v, dout, causal="top_left", label=f"causal order, {kernels}")


def forward_op(q, k, v):
    """The attention op's (out, O', frame, row sum) for the training forward of attn_qat mode, no mask."""
    return torch.ops.attn_qat.attention_forward(q, k, v, None, q.shape[-1] ** -0.5, 0, attn_qat.MODES.index("attn_qat"),
                                                True, True)[:4]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mode", ["attn_qat", "bf16"])
@pytest.mark.parametrize("case", ["plain", "masked", "deterministic"])
def test_split_last_wave(kernel_options, d, mode, case):
    """The last wave's items split over parts of their reduction axis and merged (tail_split, planned by
    csrc/attention/dispatch.cu), forced with kernel_options(tail_split=(5, 3)) on a grid of 24 items: the forward's
    last 5 query tiles of 128 (one partial) over 3 parts of 700 keys ([0, 256), [256, 512), [512, 700)), and the
    dK/dV kernel's last 5 key tiles of 128 (one partial) over 3 parts of the 2 group heads x 5 query steps (the
    second part crosses heads).
    Masked: rows whose keys of one part are all hidden, and one row with none visible. Against the reference with
    the allocator poisoned; the inference forward agrees with the training forward, split the same way."""
    g = torch.Generator().manual_seed(4242 + d)
    q, k, v, dout = make_inputs(2, 4, 2, 300, 700, d, torch.bfloat16, "cuda", g=g)
    mask = None
    if case == "masked":
        mask = torch.rand(2, 1, 300, 700, generator=g) > 0.2
        mask[:, :, 250:290, 256:512] = False  # the middle part sees none of these rows' keys
        mask[1, :, 299] = False  # no visible key at all: O = 0, zero gradients
        mask = mask.cuda()
    kernel_options(tail_split=(5, 3))
    with deterministic_algorithms() if case == "deterministic" else contextlib.nullcontext():
        check(q, k, v, dout, mode=mode, mask=mask, label=f"split last wave, {case}")
        split = run(q, k, v, dout, mode=mode, mask=mask)
        with torch.no_grad():
            inference = attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, mode=mode)
        split_stats = forward_op(q, k, v)
        kernel_options(tail_split=0)
        whole = run(q, k, v, dout, mode=mode, mask=mask)
        whole_stats = forward_op(q, k, v)
    # The inference forward (128-key tiles) and the training forward (64-key tiles) agree to bf16 rounding, not
    # bit for bit: where their running frames differ, the exponent arguments round differently (without a split
    # too: 70 of 6.1 M outputs differ by an ulp at (2, 8, 3000, 128) at commit becbb42).
    assert rel_error(inference, split[0]) < 1e-4, "inference and training forwards split differently"
    # The frames merge exactly (integers); the row sums are fp32 sums in another order, so that the forward's
    # split shows in their last bits (the bf16 outputs may round alike), and the dK/dV kernel's in dK's (these
    # inputs are fixed and both kernels deterministic). The Hopper kernels split; the others ignore the setting.
    assert torch.equal(split_stats[2], whole_stats[2])
    assert rel_error(split_stats[3], whole_stats[3]) < 1e-5
    if torch.cuda.get_device_capability() == (9, 0):
        assert not torch.equal(split_stats[3], whole_stats[3]), "the forward did not split"
        assert not torch.equal(split[2], whole[2]), "the dK/dV kernel did not split"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["attn_qat", "bf16"])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=[s[0] for s in SHAPES[:4]])
def test_mma_sync_kernels_on_any_gpu(kernel_options, shape, mode):
    """The mma.sync kernels (A100-class GPUs, and the fallback on Hopper) against the reference, forced with
    kernel_options(sm90=False) so that a Hopper machine tests them too; then the Hopper kernels on the same inputs agree
    with them (the same numerics, up to fp32 summation order)."""
    _, b, hq, hkv, nq, nk, d = shape
    q, k, v, dout = make_inputs(b, hq, hkv, nq, nk, d, torch.bfloat16, "cuda")
    kernel_options(sm90=False)
    check(q, k, v, dout, mode=mode, causal="top_left", label=f"mma.sync {shape[0]}")
    mma_sync = run(q, k, v, dout, mode=mode, causal="top_left")
    kernel_options(sm90=True)
    default = run(q, k, v, dout, mode=mode, causal="top_left")
    for name, a, c in zip(("out", "dq", "dk", "dv"), default, mma_sync):
        assert rel_error(a, c) < 1e-3, f"{name}: default kernels and mma.sync kernels disagree"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0], ids=["0.3", "negative", "zero"])
def test_softmax_scale_against_reference(device, scale):
    # The kernels scale inside the exp's fma and take the row max on raw scores, so a negative scale reaches
    # them as -q, and zero as zero queries (ops.positive_scale); causal and not, GQA, against the float64 reference.
    q, k, v, dout = make_inputs(1, 4, 2, 70, 90, 64, torch.bfloat16, device)
    for causal in (None, "top_left"):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        poison_cuda_allocator()
        out = attn_qat.scaled_dot_product_attention(qg, kg, vg, is_causal=causal == "top_left", scale=scale,
                                                    enable_gqa=True)
        out.backward(dout)
        qc, kc, vc, dc = (t.cpu() for t in (q, k, v, dout))
        ref = reference.attention(qc, kc, vc, causal=causal, scale=scale)
        grads = reference.attention_backward(qc, kc, vc, dc, causal=causal, scale=scale)
        assert forward_error(out.detach(), ref)[0] <= FWD_TOL, f"scale {scale}, causal {causal}"
        for name, ours, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), grads):
            assert rel_error(ours, r) <= BWD_TOL, f"{name}, scale {scale}, causal {causal}"
    with pytest.raises(RuntimeError, match="scale > 0"):  # the op's own check stays
        attn_qat.ops.ops.attention_forward(q, k, v, None, -0.5, 0, 0, False, True)
    for unusable in (1e-50, 1e39):  # 0 as a float; scale * log2(e) not finite as a float
        with pytest.raises(RuntimeError, match="outside what the kernels take as a float"):
            attn_qat.ops.ops.attention_forward(q, k, v, None, unusable, 0, 0, False, True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 2.4e38, -1e39], ids=str)
def test_bad_scale_is_a_value_error_naming_the_argument(bad):
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: scale=.* must be finite"):
        attn_qat.scaled_dot_product_attention(q, k, v, scale=bad)
    with pytest.raises(ValueError, match=r"attention: softmax_scale=.* must be finite"):
        attn_qat.attention(q, k, v, softmax_scale=bad, layout="bhsd")
    with pytest.raises(TypeError, match="scale must be a real number"):
        attn_qat.scaled_dot_product_attention(q, k, v, scale=[0.1])


def test_largest_and_tiniest_usable_scales():
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.bfloat16, "cpu")
    # the kernels take it (the logits overflow, as they would in torch's SDPA): no error
    assert attn_qat.scaled_dot_product_attention(q, k, v, scale=2.3e38).shape == q.shape
    # 1e-50 is 0 as a float32: every logit 0, as scale=0 gives
    assert torch.equal(attn_qat.scaled_dot_product_attention(q, k, v, scale=1e-50),
                       attn_qat.scaled_dot_product_attention(q, k, v, scale=0.0))


def test_scale_default_is_inverse_sqrt_d():
    q, k, v, _ = make_inputs(1, 1, 1, 16, 16, 64, torch.bfloat16, "cpu")
    assert torch.equal(attn_qat.scaled_dot_product_attention(q, k, v),
                       attn_qat.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(64)))



def test_double_backward_raises():
    # the backward is not itself differentiable: a gradient of the gradients must fail loudly, not come out zero
    # (its own generator: the values do not matter, and the shared seed sequence of the other tests stays put)
    q, k, v, _ = make_inputs(1, 2, 2, 32, 32, 64, torch.bfloat16, "cpu", g=torch.Generator().manual_seed(0))
    q.requires_grad_()
    out = attn_qat.scaled_dot_product_attention(q, k, v)
    (g,) = torch.autograd.grad(out.float().pow(2).sum(), q, create_graph=True)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="double backward"):
        warnings.simplefilter("ignore")  # torch's note that the backward op has no autograd kernel
        torch.autograd.grad(g.float().sum(), q)

if triton is not None:
    @triton.jit
    def _ex2_approx_kernel(y_ptr, first_bits, step, n, BLOCK: tl.constexpr):
        """y[i] = ex2.approx.ftz.f32 of the fp32 value whose bits are first_bits + step * i."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        bits = (first_bits + step * offs.to(tl.int64)).to(tl.uint32)
        x = bits.to(tl.float32, bitcast=True)
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)


@pytest.mark.gpu
@pytest.mark.skipif(triton is None, reason="optional package triton missing")
def test_ex2_approx_is_monotonic():
    """The Hopper kernels take a P block's amax as w at the block's largest logit (block_amax_w_from_logit in
    csrc/attention/softmax.cuh), which gives the block rule's amax exactly only if ex2.approx.ftz.f32, the kernels' exp,
    never decreases. PTX does not promise that, so check it on this GPU for every fp32 input from -inf to +inf in
    increasing order (the kernels' arguments t - M are <= 0 up to half an ulp of t). The instruction is lowered to
    one MUFU.EX2 here (Triton's ptxas) as in the extension."""
    chunk = 1 << 27
    y = torch.empty(chunk + 1, device="cuda", dtype=torch.float32)

    def ex2(bits):  # 2^x in float64 for the fp32 x with these bits: 0 for -inf, inf from 128
        x = struct.unpack("<f", struct.pack("<I", bits))[0]
        return 0.0 if x == -math.inf else math.inf if x >= 128 else 2.0 ** x

    # first, that the kernel computes 2^x at all (a constant would be monotonic too)
    for x in torch.arange(-8, 8, 0.25).tolist():
        _ex2_approx_kernel[(1,)](y, struct.unpack("<I", struct.pack("<f", x))[0], 1, 1, BLOCK=1024)
        assert abs(float(y[0]) - 2.0 ** x) <= 2.0 ** x * 2 ** -21, f"ex2({x}) = {float(y[0])}"
    # negative inputs: bits 0xFF800000 (-inf) down to 0x80000000 (-0); then +0 up to 0x7F800000 (+inf)
    for first, last, step in ((0xFF800000, 0x80000000, -1), (0x00000000, 0x7F800000, 1)):
        count = abs(last - first) + 1
        for start in range(0, count - 1, chunk):
            n = min(chunk + 1, count - start)  # each chunk overlaps the next by one input
            y.fill_(float("nan"))  # so that a launch that wrote nothing fails below
            _ex2_approx_kernel[(triton.cdiv(n, 1024),)](y, first + step * start, step, n, BLOCK=1024)
            ys = y[:n]
            assert not ys.isnan().any(), f"NaN in the chunk from bits {first + step * start:#010x}"
            for i in (0, n - 1):  # the chunk's ends against exp2 (within ex2.approx's error, flushed below 2^-126)
                bits = (first + step * (start + i)) & 0xFFFFFFFF
                want, got = ex2(bits), float(ys[i])
                want = 0.0 if want < 2.0 ** -126 else want
                assert got == want or abs(got - want) <= want * 2 ** -21, f"ex2 of bits {bits:#010x}: {got}"
            bad = (ys[1:] < ys[:-1]).nonzero()
            if len(bad):
                i = int(bad[0])
                pytest.fail(f"ex2.approx decreases after the input with bits {first + step * (start + i):#010x}: "
                            f"{float(ys[i])!r} > {float(ys[i + 1])!r}")
