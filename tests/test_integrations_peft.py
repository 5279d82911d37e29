"""PEFT (LoRA) models through the lifecycle: `prepare` / `convert` / `enable` / `disable` take the PeftModel that
`get_peft_model` returns and act on the transformers model it wraps."""
import pytest
import torch

from conftest import importorskip

importorskip("transformers")
peft = importorskip("peft")

import attn_qat  # noqa: E402
from attn_qat import QATConfig  # noqa: E402
from attn_qat.integrations import attention_states  # noqa: E402
from test_integrations_transformers import batch, rel_error, tiny_qwen3  # noqa: E402

# peft 0.21 calls transformers 5.24's deprecated is_gradient_checkpointing; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             init_lora_weights=False)  # nonzero B: the adapters change the output from the start
    return peft.get_peft_model(model, config)


def test_prepare_peft_model_trains_lora(device):
    torch.manual_seed(11)
    wrapped = lora(tiny_qwen3(64, device))
    ids, _ = batch(device)
    with torch.no_grad():
        expected = wrapped(ids).logits  # transformers' sdpa
    assert attn_qat.prepare(wrapped) is wrapped
    base = wrapped.get_base_model()
    assert base.config._attn_implementation == "attn_qat"
    assert all(s.selected for s in attention_states(wrapped).values()) and len(attention_states(wrapped)) == 2
    calls = []
    original = attn_qat.integrations.transformers.run_sdpa
    attn_qat.integrations.transformers.run_sdpa = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        loss = wrapped(ids, labels=ids).loss
    finally:
        attn_qat.integrations.transformers.run_sdpa = original
    assert len(calls) == 2  # both layers' attention ran through attn_qat
    loss.backward()
    lora_params = {n: p for n, p in wrapped.named_parameters() if "lora_" in n}
    assert len(lora_params) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_params.values())
    assert all(p.grad is None for n, p in wrapped.named_parameters() if "lora_" not in n)  # base weights frozen
    with torch.no_grad():
        # FP4 attention moves the logits of a random model by ~15%
        assert 2e-2 < rel_error(wrapped(ids).logits, expected) < 0.5


def test_lifecycle_on_peft_model(device):
    torch.manual_seed(12)
    wrapped = lora(tiny_qwen3(64, device))
    ids, _ = batch(device)
    with torch.no_grad():
        sdpa = wrapped(ids).logits
        attn_qat.prepare(wrapped, QATConfig(), filter_fn=lambda module, name: ".layers.0." in name)
        assert [s.selected for s in attention_states(wrapped).values()] == [True, False]
        prepared = wrapped(ids).logits
        assert attn_qat.disable(wrapped) is wrapped
        assert torch.equal(wrapped(ids).logits, sdpa)
        assert attn_qat.enable(wrapped) is wrapped
        assert torch.equal(wrapped(ids).logits, prepared)
        assert attn_qat.convert(wrapped) is wrapped
        assert torch.equal(wrapped(ids).logits, prepared)


def test_filter_fn_sees_names_in_the_model_passed():
    wrapped = lora(tiny_qwen3(64))
    names = []
    attn_qat.prepare(wrapped, filter_fn=lambda module, name: names.append(name) or True)
    assert names == [name for name in attention_states(wrapped)]
    assert names[0] == "base_model.model.model.layers.0.self_attn"


def test_peft_model_of_an_unsupported_model_says_what_it_wraps():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.q_proj(x)

    wrapped = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="PeftModel wraps a Tiny, which is neither a transformers"):
        attn_qat.prepare(wrapped)
