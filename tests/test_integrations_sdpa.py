"""attn_qat.patch_sdpa and QATConfig: routing of torch.nn.functional.scaled_dot_product_attention, the
fallbacks with their warnings, strict mode, nesting, restoring, torch.compile."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import attn_qat
from attn_qat import AttnQATFallbackWarning, QATConfig, patch_sdpa

_seed = [5000]


def randn(*shape, dtype=torch.bfloat16, device="cpu"):
    _seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(_seed[0])).to(dtype).to(device)


def fallback_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, AttnQATFallbackWarning)]


class recording:
    """Records every warning (no once-per-location filtering by Python), to count ours exactly."""

    def __enter__(self):
        self._cm = warnings.catch_warnings(record=True)
        self.record = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    @property
    def fallbacks(self):
        return fallback_warnings(self.record)


@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa", "unbatched"])
def test_supported_calls_run_attn_qat(device, case):
    b, hq, hkv, nq, nk, d = 2, 4, 4, 37, 53, 64
    if case == "gqa":
        hkv = 2
    q = randn(b, hq, nq, d, device=device)
    k, v = randn(b, hkv, nk, d, device=device), randn(b, hkv, nk, d, device=device)
    kwargs = {"enable_gqa": case == "gqa", "is_causal": case == "causal"}
    if case == "bool_mask":
        kwargs["attn_mask"] = torch.rand(b, 1, nq, nk, device=device) > 0.3
    if case == "float_mask":
        kwargs["attn_mask"] = torch.randn(nq, nk, device=device)
    if case == "unbatched":
        q, k, v = q[0], k[0], v[0]
    expected = attn_qat.scaled_dot_product_attention(q, k, v, **kwargs)
    with recording() as rec, patch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert not rec.fallbacks
    assert torch.equal(out, expected)


def test_gradients_flow_through_the_patch(device):
    q, k, v = (randn(1, 2, 40, 128, device=device).requires_grad_() for _ in range(3))
    dout = randn(1, 2, 40, 128, device=device)
    with patch_sdpa(mode="high_precision_p"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, mode="high_precision_p").backward(dout)
    assert all(torch.equal(g, t.grad) for g, t in zip(grads, (q, k, v)))


def _fallback_case(name, device):
    """(args, kwargs, words of the reason) of an SDPA call attn_qat does not take."""
    if name == "wan_vae":  # Wan's VAE: one head over the channels, head_dim 384
        x = randn(1, 1, 64, 384, device=device)
        return (x, x, x), {}, "head_dim 384"
    if name == "float32":
        x = randn(1, 2, 16, 64, dtype=torch.float32, device=device)
        return (x, x, x), {}, "dtype torch.float32"
    if name == "dropout":
        x = randn(1, 2, 16, 64, device=device)
        return (x, x, x), {"dropout_p": 0.5}, "dropout"
    if name == "head_dim_80":
        x = randn(1, 2, 16, 80, device=device)
        return (x, x, x), {}, "head_dim 80"
    if name == "mask_requires_grad":
        x = randn(1, 2, 16, 64, device=device)
        # the mask in the query's dtype: torch's own CUDA SDPA (the fallback) refuses a float32 mask for bf16 q
        mask = torch.zeros(16, 16, device=device, dtype=x.dtype, requires_grad=True)
        return (x, x, x), {"attn_mask": mask}, "requires grad"
    if name == "five_dims":
        x = randn(1, 2, 2, 16, 64, device=device)
        return (x, x, x), {}, "5-D"
    raise AssertionError(name)


FALLBACKS = ["wan_vae", "float32", "dropout", "head_dim_80", "mask_requires_grad", "five_dims"]


@pytest.mark.parametrize("name", FALLBACKS)
def test_unsupported_calls_fall_back_and_warn_once(device, name):
    args, kwargs, reason = _fallback_case(name, device)
    torch.manual_seed(0)  # dropout draws from the global generator: same seed, same mask
    expected = F.scaled_dot_product_attention(*args, **kwargs)
    with recording() as rec, patch_sdpa():
        torch.manual_seed(0)
        out = F.scaled_dot_product_attention(*args, **kwargs)
        F.scaled_dot_product_attention(*args, **kwargs)
    assert torch.equal(out, expected)
    assert len(rec.fallbacks) == 1 and reason in rec.fallbacks[0], rec.fallbacks
    with recording() as rec, patch_sdpa():  # once per context: a new context warns again
        F.scaled_dot_product_attention(*args, **kwargs)
    assert len(rec.fallbacks) == 1


@pytest.mark.parametrize("name", FALLBACKS)
def test_strict_raises_instead_of_falling_back(name):
    args, kwargs, reason = _fallback_case(name, "cpu")
    with patch_sdpa(QATConfig(strict=True)), pytest.raises(NotImplementedError, match=reason):
        F.scaled_dot_product_attention(*args, **kwargs)


def test_distinct_reasons_each_warn_once():
    with recording() as rec, patch_sdpa():
        for _ in range(2):
            for name in ("wan_vae", "float32"):
                args, kwargs, _ = _fallback_case(name, "cpu")
                F.scaled_dot_product_attention(*args, **kwargs)
    assert len(rec.fallbacks) == 2


def test_float32_under_autocast_runs_attn_qat():
    q, k, v = (randn(1, 2, 24, 64, dtype=torch.float32) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = attn_qat.scaled_dot_product_attention(q, k, v)
        with recording() as rec, patch_sdpa():
            out = F.scaled_dot_product_attention(q, k, v)
    assert not rec.fallbacks and out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_restores_on_exit_and_on_error():
    original = F.scaled_dot_product_attention
    with patch_sdpa():
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original
    with pytest.raises(KeyError), patch_sdpa():
        raise KeyError("boom")
    assert F.scaled_dot_product_attention is original


def test_nesting():
    original = F.scaled_dot_product_attention
    q, k, v = (randn(1, 2, 32, 64) for _ in range(3))
    with patch_sdpa(mode="bf16"):
        outer = F.scaled_dot_product_attention
        with patch_sdpa() as inner:
            # the inner patch falls back to torch's SDPA directly, never through the outer attn_qat wrapper
            assert F.scaled_dot_product_attention._attn_qat_fallback is original
            assert inner.config.mode == "attn_qat"
            assert torch.equal(F.scaled_dot_product_attention(q, k, v), attn_qat.scaled_dot_product_attention(q, k, v))
            with recording() as rec:
                F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            assert len(rec.fallbacks) == 1
        assert F.scaled_dot_product_attention is outer
        assert torch.equal(F.scaled_dot_product_attention(q, k, v),
                           attn_qat.scaled_dot_product_attention(q, k, v, mode="bf16"))
    assert F.scaled_dot_product_attention is original


def test_out_of_order_exit_is_an_error():
    original = F.scaled_dot_product_attention
    outer, inner = patch_sdpa(), patch_sdpa()
    outer.__enter__()
    inner.__enter__()
    for context in (outer, inner):
        with pytest.raises(RuntimeError, match="out of order"):
            context.__exit__(None, None, None)
        assert F.scaled_dot_product_attention is original


def test_as_decorator():
    q, k, v = (randn(1, 2, 32, 128) for _ in range(3))

    @patch_sdpa(mode="drop_in")
    def run():
        return F.scaled_dot_product_attention(q, k, v)

    assert torch.equal(run(), attn_qat.scaled_dot_product_attention(q, k, v, mode="drop_in"))


def test_torch_compile_traces_the_patch():
    """The function is looked up while tracing and dynamo guards on it: a graph traced inside the context
    runs attn_qat, and the same compiled function outside recompiles to torch's SDPA."""
    q, k, v = (randn(1, 2, 48, 64).requires_grad_() for _ in range(3))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    with patch_sdpa():
        out = compiled(q, k, v)
        out.sum().backward()
    assert torch.equal(out, attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(compiled(q, k, v), attend(q, k, v))


def test_config_validation():
    with pytest.raises(ValueError, match="mode"):
        QATConfig(mode="fp8")
    with pytest.raises(ValueError, match="nothing"):
        QATConfig(self_attention=False, cross_attention=False)
    assert patch_sdpa(QATConfig(mode="bf16"), strict=True).config == QATConfig(mode="bf16", strict=True)
    assert QATConfig(mode="drop_in").inference_mode == "attn_qat" and QATConfig(mode="bf16").inference_mode == "bf16"


def test_lifecycle_rejects_unsupported_models():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="patch_sdpa"):
        attn_qat.prepare(model)
    for fn in (attn_qat.convert, attn_qat.disable, attn_qat.enable):
        with pytest.raises(ValueError, match="prepare"):
            fn(model)


@pytest.mark.parametrize("nq, nk", [(0, 16), (16, 0), (0, 0)])
def test_empty_inputs_run_attn_qat(nq, nk):
    """Empty calls (no queries or no keys) are SDPA-compatible in attn_qat, so they no longer fall back."""
    q, k = randn(2, 2, nq, 64), randn(2, 2, nk, 64)
    with recording() as rec, patch_sdpa(QATConfig(strict=True)):
        out = F.scaled_dot_product_attention(q, k, k)
    assert not rec.fallbacks and out.shape == (2, 2, nq, 64) and not out.any()
    assert attn_qat.integrations.config.unsupported_reason(q, k, k) is None
