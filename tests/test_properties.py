"""Property-based tests (hypothesis): the attention forward and backward on drawn shapes, strides, masks, modes,
scales and dtypes against attn_qat.reference at numerics.md §7's tolerances. The C kernels on the CPU, bounded to
well under a minute; the same strategy drives the CUDA kernels (gpu marker, skipped without a GPU)."""
import math

import pytest
import torch

from conftest import importorskip

hypothesis = importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attn_qat  # noqa: E402
from attn_qat import reference  # noqa: E402
from test_attention import BWD_TOL, FWD_TOL, forward_error, poison_cuda_allocator  # noqa: E402

# derandomize: the same examples every run, so that CI fails only on a change of the code
PROPERTY_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def attention_cases(draw):
    """One call's arguments: shapes (grouped KV), memory layout, causal alignment or mask (bool or additive, of a
    shape that broadcasts), mode, softmax scale (None, 0, positive or negative) and dtype, plus a seed."""
    hkv = draw(st.integers(1, 2))
    case = dict(b=draw(st.integers(1, 2)), hkv=hkv, hq=hkv * draw(st.sampled_from([1, 2, 3])),
                nq=draw(st.integers(1, 70)), nk=draw(st.integers(1, 70)), d=draw(st.sampled_from([64, 128])),
                dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
                layout=draw(st.sampled_from(["bhsd", "bshd"])),
                causal=draw(st.sampled_from([None, "top_left", "bottom_right"])),
                mode=draw(st.sampled_from(attn_qat.MODES)), seed=draw(st.integers(0, 2**31 - 1)))
    # |scale| up to 0.2: larger ones make most rows one-hot (a single key near P = 1), which §7 does not cover
    case["scale"] = draw(st.one_of(st.none(), st.just(0.0), st.floats(0.02, 0.2), st.floats(-0.2, -0.02)))
    case["mask"] = None
    if case["causal"] is None:
        kind = draw(st.sampled_from([None, "bool", "additive"]))
        if kind is not None:
            # each of (B, H, Nq, Nk) kept or broadcast (1), and the leading ones maybe left out
            full = (case["b"], case["hq"], case["nq"], case["nk"])
            shape = tuple(n if draw(st.booleans()) else 1 for n in full)
            case["mask"] = (kind, shape[draw(st.integers(0, 2)):])
    return case


def make(case, device):
    g = torch.Generator().manual_seed(case["seed"])
    b, d, dtype = case["b"], case["d"], case["dtype"]

    def tensor(h, n):  # (B, H, S, D) views of (B, S, H, D) memory for bshd
        if case["layout"] == "bshd":
            return torch.randn(b, n, h, d, generator=g).to(dtype).to(device).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=g).to(dtype).to(device)

    q, k, v, dout = tensor(case["hq"], case["nq"]), tensor(case["hkv"], case["nk"]), tensor(case["hkv"], case["nk"]), \
        tensor(case["hq"], case["nq"])
    mask = None
    if case["mask"] is not None:
        kind, shape = case["mask"]
        mask = torch.rand(shape, generator=g) > 0.25 if kind == "bool" else torch.randn(shape, generator=g) * 2
        mask = mask.to(device)
    return q, k, v, dout, mask


def run(case, q, k, v, dout, mask):
    """Our forward and backward through the entry point that owns the case's causal alignment."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    poison_cuda_allocator()
    if case["causal"] == "bottom_right" or (case["causal"] is None and mask is None and case["seed"] % 2):
        layout = case["layout"]
        args = [t.transpose(1, 2) if layout == "bshd" else t for t in (qg, kg, vg)]
        out = attn_qat.attention(*args, causal=case["causal"] == "bottom_right", softmax_scale=case["scale"],
                                 layout=layout, mode=case["mode"])
        out = out.transpose(1, 2) if layout == "bshd" else out
    else:
        out = attn_qat.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, is_causal=case["causal"] == "top_left",
                                                    scale=case["scale"], enable_gqa=True, mode=case["mode"])
    poison_cuda_allocator()
    out.backward(dout)
    return out.detach(), qg.grad, kg.grad, vg.grad


def delta_slack(case, q, k, v, dout, out_for_delta):
    """Bounds on what D_i = dO_i · O'_i (numerics.md §4) taken from O' (O in the modes whose D uses O) as stored in
    the dtype changes in dQ and dK: e_i = dO_i · (O'_i rounded - O'_i), computed here, plus a few fp32 ulps of
    sum_d |dO_id| max_j |V_jd| (D and dP_ij are fp32 sums in different orders), moves dS_ij by up to P_ij e_i, so
    dQ_i by at most scale e_i max_j |K_j| and dK by at most scale e_i |Q_i| (P's rows sum to 1 or 0), twice over. Negligible against the gradient, except where dP_ij - D_i nearly cancels:
    a row whose one visible key makes dS exactly 0 in the reference (O' = V of that key), or two keys with P
    near 1 and dP alike, on tensors too small for the relative Frobenius norm of §7 to average it out."""
    scale = abs(1 / math.sqrt(case["d"]) if case["scale"] is None else case["scale"])
    group = case["hq"] // case["hkv"]
    o, do = out_for_delta.double(), dout.double().cpu()
    v_max = v.double().cpu().abs().amax(dim=2, keepdim=True).repeat_interleave(group, 1)  # (B, Hq, 1, D)
    e = (do * (o.to(case["dtype"]).double() - o)).sum(-1).abs() + 2.0**-19 * (do.abs() * v_max).sum(-1)
    rows = lambda t: t.double().cpu().norm(dim=-1)  # noqa: E731  row norms, (B, H, S)
    k_max = rows(k).amax(dim=-1).repeat_interleave(group, 1)[..., None]
    return 2 * scale * float((e * k_max).sum()), 2 * scale * float((e * rows(q)).sum())


def check(case, device):
    q, k, v, dout, mask = make(case, device)
    out, dq, dk, dv = run(case, q, k, v, dout, mask)
    qc, kc, vc, dc = (t.cpu() for t in (q, k, v, dout))
    mc = None if mask is None else mask.cpu()
    args = dict(attn_mask=mc, causal=case["causal"], scale=case["scale"])
    forward = reference.attention_forward(qc, kc, vc, quantize=case["mode"] != "bf16", **args)
    ref = forward["out"]
    grads = reference.attention_backward(qc, kc, vc, dc, mode=case["mode"], **args)
    error, flipped = forward_error(out, ref)
    assert error <= FWD_TOL, f"forward error {error} ({flipped} rows set aside)"
    prime = case["mode"] in ("attn_qat", "high_precision_p")
    slack = delta_slack(case, qc, kc, vc, dc, forward["out_prime" if prime else "out"]) + (0.0,)
    dout_norm = float(dc.double().norm())
    for name, ours, r, slack in zip(("dq", "dk", "dv"), (dq, dk, dv), grads, slack):
        assert ours.shape == r.shape
        diff, norm = float((ours.double().cpu() - r).norm()), float(r.norm())
        # A gradient that is 0 in exact arithmetic (one query seeing one key: dP = D) leaves only the kernels'
        # rounding, so it is measured against dO's size (the CUDA kernels: ~5e-4 of it at Nq = Nk = 1).
        bound = BWD_TOL * dout_norm if norm <= 1e-9 * dout_norm else BWD_TOL * norm + slack
        assert diff <= bound, f"{name}: |ours - ref| {diff}, |ref| {norm}, slack {slack}, |dO| {dout_norm}"


@settings(max_examples=300, **PROPERTY_SETTINGS)
@given(attention_cases())
def test_cpu_kernels_match_reference(case):
    check(case, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["sm90", "mma_sync"])
def test_cuda_kernels_match_reference(kernel_options, path):
    """The same strategy on the CUDA kernels, both paths (kernel_options(sm90=False) forces the mma.sync kernels)."""
    kernel_options(sm90=path == "sm90")

    @settings(max_examples=60, **PROPERTY_SETTINGS)
    @given(attention_cases())
    def cuda_case(case):
        check(case, "cuda")

    cuda_case()
