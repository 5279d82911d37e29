"""diffusers integration on a tiny Wan 2.1 transformer built from its config (no downloads): the attn_qat
processor (self-attention by default, cross-attention and the I2V image branch on request) against
diffusers' own processor, forward and backward, the lifecycle, and the "attn_qat" backend."""
import copy
import logging

import pytest
import torch

from conftest import importorskip  # noqa: E402

diffusers = importorskip("diffusers")
from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor  # noqa: E402

import attn_qat  # noqa: E402
from attn_qat import QATConfig, WanAttnQATProcessor  # noqa: E402
from attn_qat.integrations import attention_states  # noqa: E402
from attn_qat.integrations import diffusers as df_integration  # noqa: E402
from conftest import rel_error as _rel_error  # noqa: E402

TEXT_TOKENS = 512  # Wan's I2V processor takes the last 512 cross-attention tokens as the text
# bf16 mode against diffusers' SDPA path: attention agrees to bf16 rounding (~1e-3); the tiny model's
# output to a few 1e-3.
BF16_TOL = 1e-2

logging.getLogger("diffusers").setLevel(logging.ERROR)  # the float32-module and experimental-backend notices


def rel_error(out, ref):
    return _rel_error(out.detach(), ref.detach())


def tiny_wan(head_dim=64, device="cpu", i2v=False):
    """A fresh random 2-block Wan 2.1 transformer with 2 heads, in bfloat16."""
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64,
        image_dim=48 if i2v else None, added_kv_proj_dim=2 * head_dim if i2v else None)
    return model.to(device=device, dtype=torch.bfloat16)


def wan_inputs(device, i2v=False, text_tokens=16):
    """Latents (B, C, F, H, W) of 2 frames of 8x8 (32 tokens after 1x2x2 patches), a timestep, text
    embeddings and, for I2V, image embeddings."""
    inputs = {
        "hidden_states": torch.randn(2, 4, 2, 8, 8, device=device, dtype=torch.bfloat16),
        "timestep": torch.tensor([100, 700], device=device),
        "encoder_hidden_states": torch.randn(2, TEXT_TOKENS if i2v else text_tokens, 32, device=device,
                                             dtype=torch.bfloat16),
    }
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(2, 20, 48, device=device, dtype=torch.bfloat16)
    return inputs


@pytest.fixture(params=[64, 128], ids=["d64", "d128"])
def head_dim(request):
    return request.param


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_bf16_mode_matches_diffusers(device, head_dim, i2v):
    reference = tiny_wan(head_dim, device, i2v)
    model = attn_qat.prepare(copy.deepcopy(reference), QATConfig(mode="bf16", cross_attention=True))
    inputs = wan_inputs(device, i2v)
    assert all(isinstance(m.processor, WanAttnQATProcessor) for m in model.modules() if isinstance(m, WanAttention))
    assert rel_error(model(**inputs).sample, reference(**inputs).sample) < BF16_TOL


def test_attn_qat_forward_and_backward(device, head_dim):
    reference = tiny_wan(head_dim, device)
    model = attn_qat.prepare(copy.deepcopy(reference))
    inputs = wan_inputs(device)
    out = model(**inputs).sample
    assert out.shape == inputs["hidden_states"].shape
    assert 0 < rel_error(out, reference(**inputs).sample) < 0.5
    out.float().square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["blocks.0.attn1.to_q.weight"].abs().sum() > 0


def test_default_config_converts_self_attention_only(device):
    reference = tiny_wan(64, device)
    model = attn_qat.prepare(copy.deepcopy(reference))
    selected = {name: state.selected for name, state in attention_states(model).items()}
    assert selected == {"blocks.0.attn1": True, "blocks.0.attn2": False, "blocks.1.attn1": True,
                        "blocks.1.attn2": False}
    # the cross-attention keeps diffusers' processor: bit for bit the same as the reference module
    hidden = torch.randn(2, 32, 128, device=device, dtype=torch.bfloat16)
    text = torch.randn(2, 16, 128, device=device, dtype=torch.bfloat16)
    assert torch.equal(model.blocks[0].attn2(hidden, text), reference.blocks[0].attn2(hidden, text))


def test_i2v_image_branch(device):
    """The I2V cross-attention adds attention over the image tokens (add_k_proj / add_v_proj): it must
    match diffusers' processor with the branch contributing far more than the tolerance."""
    reference = tiny_wan(64, device, i2v=True).blocks[0].attn2
    module = copy.deepcopy(reference)
    module.set_processor(WanAttnQATProcessor(module.processor, QATConfig(mode="bf16")))  # installed by hand
    hidden = torch.randn(2, 32, 128, device=device, dtype=torch.bfloat16)
    context = torch.randn(2, 20 + TEXT_TOKENS, 128, device=device, dtype=torch.bfloat16)
    expected = reference(hidden, context)
    assert rel_error(module(hidden, context), expected) < 5e-3
    without_image = copy.deepcopy(reference)
    torch.nn.init.zeros_(without_image.add_v_proj.weight)
    torch.nn.init.zeros_(without_image.add_v_proj.bias)
    assert rel_error(without_image(hidden, context), expected) > 0.05


def test_fused_projections(device):
    reference = tiny_wan(64, device, i2v=True)
    model = attn_qat.prepare(copy.deepcopy(reference), QATConfig(mode="bf16", cross_attention=True))
    model.fuse_qkv_projections()
    assert model.blocks[0].attn1.fused_projections and model.blocks[0].attn2.fused_projections
    inputs = wan_inputs(device, i2v=True)
    assert rel_error(model(**inputs).sample, reference(**inputs).sample) < BF16_TOL


def test_no_copies_into_attention(device, monkeypatch):
    """attn_qat gets (B, H, S, D) views of the (B, S, H, D) projections and returns an output that
    flattens to (B, S, H*D) without a copy."""
    seen = []
    original = df_integration.run_sdpa

    def record(query, key, value, *args, **kwargs):
        out = original(query, key, value, *args, **kwargs)
        seen.append((query, key, value, out))
        return out

    monkeypatch.setattr(df_integration, "run_sdpa", record)
    model = attn_qat.prepare(tiny_wan(128, device), QATConfig(cross_attention=True))
    model(**wan_inputs(device))
    assert len(seen) == 4
    for tensors in seen:
        for t in tensors:
            assert not t.is_contiguous() and t.transpose(1, 2).is_contiguous()


def test_lifecycle(device):
    reference = tiny_wan(64, device)
    model = attn_qat.prepare(copy.deepcopy(reference), QATConfig(cross_attention=True))
    inputs = wan_inputs(device)
    prepared = model(**inputs).sample
    attn_qat.disable(model)
    assert torch.equal(model(**inputs).sample, reference(**inputs).sample)
    attn_qat.enable(model)
    assert torch.equal(model(**inputs).sample, prepared)
    attn_qat.convert(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, prepared)
    with pytest.warns(UserWarning, match="converted for inference"):
        model(**inputs)


def test_filter_fn(device):
    model = attn_qat.prepare(tiny_wan(64, device), filter_fn=lambda module, name: name.startswith("blocks.1."))
    selected = [name for name, state in attention_states(model).items() if state.selected]
    assert selected == ["blocks.1.attn1"]
    with pytest.raises(ValueError, match="selected"):
        attn_qat.prepare(tiny_wan(64, device), filter_fn=lambda module, name: False)


def test_prepare_twice_keeps_the_original_processor(device):
    model = attn_qat.prepare(tiny_wan(64, device))
    attn_qat.prepare(model, QATConfig(mode="bf16"))
    processor = model.blocks[0].attn1.processor
    assert isinstance(processor, WanAttnQATProcessor) and isinstance(processor.original, WanAttnProcessor)


def set_active_backend(backend):
    if hasattr(_AttentionBackendRegistry, "set_active_backend"):
        _AttentionBackendRegistry.set_active_backend(backend)
    else:  # diffusers 0.35 has no setter
        _AttentionBackendRegistry._active_backend = backend


@pytest.fixture
def restore_active_backend():
    active = _AttentionBackendRegistry._active_backend
    yield
    set_active_backend(active)


def test_attention_backend(device, restore_active_backend):
    attn_qat.register_diffusers_backend(QATConfig(mode="bf16"))
    attn_qat.register_diffusers_backend(QATConfig(mode="bf16"))  # idempotent
    assert AttentionBackendName("attn_qat").value == "attn_qat"
    reference = tiny_wan(64, device, i2v=True)
    inputs = wan_inputs(device, i2v=True)
    expected = reference(**inputs).sample  # diffusers' native backend
    model = copy.deepcopy(reference)
    model.set_attention_backend("attn_qat")  # diffusers also makes it the process-wide active backend
    assert rel_error(model(**inputs).sample, expected) < BF16_TOL

    set_active_backend(AttentionBackendName.NATIVE)
    attn_qat.register_diffusers_backend(QATConfig())
    with diffusers.attention_backend("attn_qat"):
        fp4 = reference(**inputs).sample
    assert torch.equal(reference(**inputs).sample, expected)
    assert BF16_TOL < rel_error(fp4, expected) < 0.5
    fp4.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in reference.parameters() if p.grad is not None)


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_processor_is_diffusers_processor_with_attn_qat_attention(i2v, restore_active_backend):
    """The processor runs diffusers' own WanAttnProcessor and swaps only the attention: bit for bit what diffusers'
    processor computes on its native backend when every SDPA call in it runs attn_qat (patch_sdpa), forward and
    backward, in the FP4 mode."""
    set_active_backend(AttentionBackendName.NATIVE)
    reference = tiny_wan(64, "cpu", i2v)
    model = attn_qat.prepare(copy.deepcopy(reference), QATConfig(cross_attention=True))
    inputs = wan_inputs("cpu", i2v)
    out = model(**inputs).sample
    with attn_qat.patch_sdpa(QATConfig()):
        expected = reference(**inputs).sample
    assert torch.equal(out, expected)
    assert rel_error(out, copy.deepcopy(reference)(**inputs).sample) > BF16_TOL  # attn_qat did run
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad is None) == (grads[name].grad is None), name
        assert p.grad is None or torch.equal(p.grad, grads[name].grad), name


def test_processor_runs_diffusers_code(monkeypatch):
    """Projections, norms, rotary embedding and the I2V split are whatever diffusers' WanAttnProcessor does: the
    processor calls it (so a diffusers upgrade changes nothing here), and refuses to run if it stops dispatching its
    attention to attn_qat."""
    from diffusers.models.transformers import transformer_wan
    calls = []
    original_call = transformer_wan.WanAttnProcessor.__call__

    def recording_call(self, attn, *args, **kwargs):
        calls.append(attn)
        return original_call(self, attn, *args, **kwargs)

    monkeypatch.setattr(transformer_wan.WanAttnProcessor, "__call__", recording_call)
    model = attn_qat.prepare(tiny_wan(64), QATConfig(cross_attention=True))
    model(**wan_inputs("cpu"))
    assert len(calls) == 4 and all(isinstance(m.processor, WanAttnQATProcessor) for m in calls)

    monkeypatch.setattr(transformer_wan.WanAttnProcessor, "__call__", lambda self, attn, hidden, *args: hidden)
    with pytest.raises(RuntimeError, match="did not dispatch"):
        model(**wan_inputs("cpu"))


def test_processor_under_torch_compile():
    """The processor (diffusers' code, the backend reading the module's state) traces into one graph; a state flip
    recompiles and is honoured."""
    module = tiny_wan(64, i2v=True).blocks[0].attn2
    module.set_processor(WanAttnQATProcessor(module.processor, QATConfig()))
    hidden = torch.randn(2, 32, 128, dtype=torch.bfloat16)
    context = torch.randn(2, 20 + TEXT_TOKENS, 128, dtype=torch.bfloat16)
    eager = module(hidden, context)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(hidden, context), eager)
    module.processor._state.enabled = False  # installed by hand: the processor's own state
    assert torch.equal(compiled(hidden, context), module.processor.original(module, hidden, context))


@pytest.fixture
def sdpa_calls(monkeypatch):
    """A list that grows by one at each call the attn_qat backend routes (integrations/diffusers.py's run_sdpa)."""
    calls = []
    original = df_integration.run_sdpa
    monkeypatch.setattr(df_integration, "run_sdpa", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_reset_restores_the_active_backend(sdpa_calls, restore_active_backend):
    """set_attention_backend("attn_qat") makes attn_qat diffusers' process-wide active backend, which models built
    afterwards use; reset_diffusers_backend gives back the backend active before, and they run it again."""
    inputs = wan_inputs("cpu")
    set_active_backend(AttentionBackendName.NATIVE)
    torch.manual_seed(1)
    expected = tiny_wan(64)(**inputs).sample  # diffusers' default attention
    assert not sdpa_calls

    attn_qat.register_diffusers_backend(QATConfig(mode="bf16"))
    model = tiny_wan(64)
    model.set_attention_backend("attn_qat")
    if _AttentionBackendRegistry._active_backend.value != "attn_qat":  # diffusers 0.35 leaves the active one alone
        set_active_backend(AttentionBackendName("attn_qat"))
    torch.manual_seed(1)
    fresh = tiny_wan(64)  # never set to attn_qat, yet it runs attn_qat through the active backend
    assert not torch.equal(fresh(**inputs).sample, expected) and sdpa_calls

    attn_qat.reset_diffusers_backend()
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE
    sdpa_calls.clear()
    torch.manual_seed(1)
    assert torch.equal(tiny_wan(64)(**inputs).sample, expected) and not sdpa_calls
    model(**inputs)  # its processors still name attn_qat ...
    assert sdpa_calls
    sdpa_calls.clear()
    attn_qat.reset_diffusers_backend(model)  # ... until reset with it
    model(**inputs)
    assert not sdpa_calls

    # the backend active before is what comes back, whichever it was; a reset with another one active leaves it
    set_active_backend(AttentionBackendName._NATIVE_MATH)
    attn_qat.register_diffusers_backend()
    set_active_backend(AttentionBackendName("attn_qat"))
    attn_qat.reset_diffusers_backend()
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName._NATIVE_MATH
    set_active_backend(AttentionBackendName.NATIVE)
    attn_qat.reset_diffusers_backend()
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE


@pytest.mark.parametrize("undo", ["reset_attention_backend", "native"])
def test_diffusers_own_calls_undo_the_attn_qat_backend(sdpa_calls, restore_active_backend, undo):
    """model.reset_attention_backend() and model.set_attention_backend("native") give diffusers' attention back, bit
    for bit, in the model and in models built afterwards; other models set to attn_qat keep it."""
    inputs = wan_inputs("cpu")
    set_active_backend(AttentionBackendName.NATIVE)
    torch.manual_seed(2)
    expected = tiny_wan(64)(**inputs).sample
    attn_qat.register_diffusers_backend(QATConfig())
    torch.manual_seed(2)
    model, other = tiny_wan(64), tiny_wan(64)
    other.set_attention_backend("attn_qat")
    model.set_attention_backend("attn_qat")
    assert not torch.equal(model(**inputs).sample, expected) and sdpa_calls

    if undo == "native":
        model.set_attention_backend("native")
    else:
        model.reset_attention_backend()
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE
    sdpa_calls.clear()
    assert torch.equal(model(**inputs).sample, expected) and not sdpa_calls
    torch.manual_seed(2)
    assert torch.equal(tiny_wan(64)(**inputs).sample, expected) and not sdpa_calls  # a model built afterwards
    other(**inputs)  # its processors name attn_qat: it keeps it
    assert len(sdpa_calls) == 4
    model.reset_attention_backend()  # again, with another backend active: diffusers' reset alone
    assert _AttentionBackendRegistry._active_backend == AttentionBackendName.NATIVE
