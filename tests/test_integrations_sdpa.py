"""attn_qat.patch_sdpa and QATConfig: routing of torch.nn.functional.scaled_dot_product_attention (a torch function
mode: names imported earlier too, this thread only), the fallbacks with their warnings, strict mode, nesting,
restoring, the decorator, torch.compile."""
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

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
    if name == "float64":
        x = randn(1, 2, 16, 64, dtype=torch.float64, device=device)
        return (x, x, x), {}, "dtype torch.float64"
    if name == "dropout":
        x = randn(1, 2, 16, 64, device=device)
        return (x, x, x), {"dropout_p": 0.5}, "dropout"
    if name == "head_dim_72":
        x = randn(1, 2, 16, 72, device=device)
        return (x, x, x), {}, "head_dim 72"
    if name == "mask_requires_grad":
        x = randn(1, 2, 16, 64, device=device)
        # the mask in the query's dtype: torch's own CUDA SDPA (the fallback) refuses a float32 mask for bf16 q
        mask = torch.zeros(16, 16, device=device, dtype=x.dtype, requires_grad=True)
        return (x, x, x), {"attn_mask": mask}, "requires grad"
    if name == "five_dims":
        x = randn(1, 2, 2, 16, 64, device=device)
        return (x, x, x), {}, "5-D"
    raise AssertionError(name)


FALLBACKS = ["wan_vae", "float64", "dropout", "head_dim_72", "mask_requires_grad", "five_dims"]


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
            for name in ("wan_vae", "float64"):
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


def active_patches():
    """The patch_sdpa contexts on this thread's torch function mode stack, innermost last."""
    return [m for m in _get_current_function_mode_stack() if isinstance(m, patch_sdpa)]


def runs_attn_qat(sdpa=F.scaled_dot_product_attention, **expected_kwargs):
    """Whether a call of `sdpa` runs attn_qat (with `expected_kwargs`) rather than torch's SDPA: the FP4 output
    differs from torch's by far more than bf16 rounding."""
    q, k, v = (randn(1, 2, 32, 64) for _ in range(3))
    out = sdpa(q, k, v)
    if torch.equal(out, attn_qat.scaled_dot_product_attention(q, k, v, **expected_kwargs)):
        return True
    assert torch.equal(out, torch._C._nn.scaled_dot_product_attention(q, k, v))
    return False


def test_restores_on_exit_and_on_error():
    assert not active_patches() and not runs_attn_qat()
    with patch_sdpa() as context:
        assert active_patches() == [context] and runs_attn_qat()
    assert not active_patches() and not runs_attn_qat()
    with pytest.raises(KeyError), patch_sdpa():
        raise KeyError("boom")
    assert not active_patches() and not runs_attn_qat()


def test_intercepts_names_imported_before_the_context():
    """A torch function mode sees the function itself, however the caller got hold of it."""
    assert imported_sdpa is F.scaled_dot_product_attention  # bound at this file's import, before any context
    with patch_sdpa():
        assert runs_attn_qat(imported_sdpa)
        assert runs_attn_qat(torch._C._nn.scaled_dot_product_attention)
        assert runs_attn_qat(lambda q, k, v: imported_sdpa(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0))
    assert not runs_attn_qat(imported_sdpa)


def test_other_threads_are_not_affected():
    """Modes are per thread: while one thread is inside a context, another runs torch's SDPA, and the reverse."""
    entered, checked = threading.Barrier(2, timeout=60), threading.Barrier(2, timeout=60)
    seen = {}

    def worker():
        seen["worker, before"] = runs_attn_qat()
        with patch_sdpa(mode="bf16"):
            entered.wait()  # the main thread has its own context now
            seen["worker, inside"] = runs_attn_qat(mode="bf16")
            checked.wait()
        seen["worker, after"] = runs_attn_qat()

    with patch_sdpa():
        thread = threading.Thread(target=worker)
        thread.start()
        entered.wait()
        seen["main, inside"] = runs_attn_qat()  # attn_qat mode, not the worker's bf16
        checked.wait()
    seen["main, while the worker is inside"] = runs_attn_qat()
    thread.join()
    assert seen == {"worker, before": False, "worker, inside": True, "main, inside": True,
                    "main, while the worker is inside": False, "worker, after": False}

    def other_thread():
        seen["other"] = runs_attn_qat()

    with patch_sdpa():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["other"] is False


def test_nesting():
    q, k, v = (randn(1, 2, 32, 64) for _ in range(3))
    with patch_sdpa(mode="bf16") as outer:
        with patch_sdpa() as inner:
            assert active_patches() == [outer, inner] and inner.config.mode == "attn_qat"
            assert runs_attn_qat()  # the innermost context decides
            # a fallback runs torch's SDPA directly, never through the outer attn_qat context: one warning, the inner's
            with recording() as rec:
                out = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            assert len(rec.fallbacks) == 1 and torch.equal(out, torch._C._nn.scaled_dot_product_attention(
                q.double(), k.double(), v.double()))
        assert active_patches() == [outer] and runs_attn_qat(mode="bf16")
    assert not active_patches()


def test_fallbacks_pass_other_modes():
    """Only attn_qat contexts step aside for a fallback; another torch function mode below still sees the call."""
    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.sdpa_calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.sdpa_calls += func is F.scaled_dot_product_attention
            return func(*args, **(kwargs or {}))

    x = randn(1, 2, 16, 72)
    with Recorder() as recorder, recording(), patch_sdpa():
        F.scaled_dot_product_attention(x, x, x)  # head_dim 72: falls back
    assert recorder.sdpa_calls == 1


def test_out_of_order_exit_is_an_error():
    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    outer, other, inner = patch_sdpa(), Other(), patch_sdpa()
    outer.__enter__()
    other.__enter__()
    inner.__enter__()
    try:
        with pytest.raises(RuntimeError, match="out of order"):
            outer.__exit__(None, None, None)
        # every attn_qat context is gone from the thread's stack, the other mode stays
        assert _get_current_function_mode_stack() == [other] and not runs_attn_qat()
        with pytest.raises(RuntimeError, match="out of order"):
            inner.__exit__(None, None, None)
        assert _get_current_function_mode_stack() == [other]
    finally:
        other.__exit__(None, None, None)
    assert not _get_current_function_mode_stack()


def test_a_context_is_entered_once():
    context = patch_sdpa()
    with context:
        with pytest.raises(RuntimeError, match="already active"):
            context.__enter__()
    with context:  # again after it exited
        assert runs_attn_qat()


def test_as_decorator():
    q, k, v = (randn(1, 2, 32, 128) for _ in range(3))

    @patch_sdpa(mode="drop_in")
    def run():
        return F.scaled_dot_product_attention(q, k, v)

    assert torch.equal(run(), attn_qat.scaled_dot_product_attention(q, k, v, mode="drop_in"))
    assert not active_patches()


def test_decorator_enters_a_fresh_context_per_call():
    """Recursion nests, other threads get their own context, and each call warns afresh."""
    x = randn(1, 2, 16, 72)  # head_dim 72: falls back with a warning

    @patch_sdpa()
    def run(depth):
        F.scaled_dot_product_attention(x, x, x)
        return [len(active_patches())] + (run(depth - 1) if depth else [])

    with recording() as rec:
        assert run(2) == [1, 2, 3]
    assert len(rec.fallbacks) == 3  # three contexts, one warning each
    depths = []
    threads = [threading.Thread(target=lambda: depths.append(run(0))) for _ in range(4)]
    with recording():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert depths == [[1]] * 4 and not active_patches()


def test_torch_compile_traces_the_patch():
    """Dynamo traces the mode's __torch_function__: a graph traced inside the context runs attn_qat, and the same
    compiled function outside gets its own graph with torch's SDPA."""
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


def test_torch_compile_with_the_context_inside():
    """The context entered inside the compiled function (or decorating it) is traced too, in one graph."""
    q, k, v = (randn(1, 2, 48, 64) for _ in range(3))
    expected = attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True)

    def attend(q, k, v):
        with patch_sdpa():
            return imported_sdpa(q, k, v, is_causal=True)

    assert torch.equal(torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v), expected)
    decorated = patch_sdpa()(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert torch.equal(torch.compile(decorated, backend="aot_eager")(q, k, v), expected)
    assert not active_patches()


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
    assert attn_qat.integrations.routing.unsupported_reason(q, k, k) is None
