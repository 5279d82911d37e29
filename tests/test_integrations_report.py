"""Fallbacks that cannot go unnoticed (integrations/report.py): `prepare` tells from a module's shapes that its calls
will fall back (and warns, naming the modules), the integrations count how every call of every module ran, and
`attn_qat.attention_report(model)` shows both; on tiny transformers (Qwen3) and diffusers (Wan) models."""
import logging
import warnings

import pytest
import torch

import attn_qat
from attn_qat import AttnQATFallbackWarning, QATConfig
from attn_qat.integrations.report import static_fallback
from conftest import importorskip

# a head dim no kernel takes (below 32), as the reason the input rules give
HEAD_DIM_24 = f"head_dim 24 is not supported ({attn_qat._C.HEAD_DIMS_TEXT})"


def fallback_messages(record):
    return [str(w.message) for w in record if issubclass(w.category, AttnQATFallbackWarning)]


def test_static_fallback_reads_the_input_rules():
    assert static_fallback(4, 2, 64) is None
    assert static_fallback(4, 2, 128, 128) is None
    assert static_fallback(4, 2, None) is None  # shapes unknown: nothing to say before a call
    assert static_fallback(4, 4, 24) == HEAD_DIM_24
    assert static_fallback(4, 4, 80) is None and static_fallback(4, 4, 256) is None
    assert static_fallback(4, 3, 64) == "query heads (4) must be a multiple of key/value heads (3)"


# ------------------------------------------------------------------------------------------------- transformers

def _qwen3(head_dim, dtype=torch.bfloat16):
    transformers = importorskip("transformers")
    torch.manual_seed(head_dim)
    config = transformers.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=64,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.Qwen3ForCausalLM(config).to(dtype)


def test_transformers_prepare_warns_and_reports_head_dim_fallback(caplog):
    model = _qwen3(24)
    with warnings.catch_warnings(record=True) as record, caplog.at_level(logging.INFO, logger="attn_qat"):
        warnings.simplefilter("always")
        attn_qat.prepare(model)
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    [message] = [m for m in fallback_messages(record) if m.startswith("attn_qat.prepare")]
    assert "2 of 2 selected attention modules cannot run attn_qat" in message and HEAD_DIM_24 in message
    assert all(name in message for name in names)
    assert f"{names[0]}: fallback: {HEAD_DIM_24}" in caplog.text  # the summary, logged

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(torch.randint(0, 64, (2, 20)))
        model(torch.randint(0, 64, (2, 20)))
    # the call's warning, once per reason, names the module that met it first
    [message] = fallback_messages(record)
    assert HEAD_DIM_24 in message and f"first in {names[0]}" in message
    report = attn_qat.attention_report(model)
    assert report.fallbacks == {name: [HEAD_DIM_24] for name in names}
    assert [m.calls for m in report.modules] == [{f"fallback: {HEAD_DIM_24}": 2}] * 2
    assert f"{names[1]}: fallback: {HEAD_DIM_24}; calls: fallback: {HEAD_DIM_24} x2" in str(report)


def test_transformers_report_counts_fp4_calls_and_the_lifecycle():
    model = _qwen3(64, dtype=torch.float32)  # float32 outside autocast runs attn_qat (in bfloat16), not SDPA
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnQATFallbackWarning)
        attn_qat.prepare(model, filter_fn=lambda module, name: name != "model.layers.1.self_attn")
        ids = torch.randint(0, 64, (2, 20))
        model(ids)
        attn_qat.disable(model)
        model(ids)
        attn_qat.enable(model)
        attn_qat.convert(model)
        with torch.no_grad():
            model(ids)
    report = attn_qat.attention_report(model)
    assert [(m.name, m.status, m.calls) for m in report.modules] == [
        ("model.layers.0.self_attn", "converted", {"fp4": 2, "disabled": 1}),
        ("model.layers.1.self_attn", "left out", {})]
    assert report.fallbacks == {}


def test_report_shows_the_modules_kept_in_bf16():
    model = _qwen3(64)
    attn_qat.prepare(model, QATConfig(bf16_modules=("model.layers.1.self_attn",)))
    model(torch.randint(0, 64, (2, 20)))
    report = attn_qat.attention_report(model)
    assert [(m.name, m.status, m.calls) for m in report.modules] == [
        ("model.layers.0.self_attn", "attn_qat", {"fp4": 1}), ("model.layers.1.self_attn", "kept bf16", {"bf16": 1})]
    assert "1 on attn_qat, 1 kept in bf16, 0 falling back" in str(report)


def test_transformers_runtime_fallback_is_counted_per_module():
    """A reason only a call shows (dropout in training) is counted in every module that met it."""
    model = _qwen3(64)
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    attn_qat.prepare(model)
    model.train()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(torch.randint(0, 64, (2, 20)))
    [message] = fallback_messages(record)
    assert "dropout_p > 0" in message and "first in model.layers.0.self_attn" in message
    report = attn_qat.attention_report(model)
    assert sorted(report.fallbacks) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(m.status == "attn_qat" for m in report.modules)  # nothing was known at prepare


def test_report_of_an_unprepared_model_raises():
    with pytest.raises(ValueError, match="no attention prepared"):
        attn_qat.attention_report(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------------ diffusers

def _wan(head_dim):
    diffusers = importorskip("diffusers")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    torch.manual_seed(head_dim)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64)
    inputs = {"hidden_states": torch.randn(1, 4, 2, 8, 8, dtype=torch.bfloat16), "timestep": torch.tensor([100]),
              "encoder_hidden_states": torch.randn(1, 16, 32, dtype=torch.bfloat16)}
    return model.to(torch.bfloat16), inputs


def test_diffusers_prepare_warns_and_reports_head_dim_fallback():
    model, inputs = _wan(24)
    with pytest.warns(AttnQATFallbackWarning, match="2 of 2 selected attention modules cannot run") as record:
        attn_qat.prepare(model)
    assert "blocks.0.attn1" in str(record[0].message) and "blocks.1.attn1" in str(record[0].message)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(**inputs)
    assert any("first in blocks.0.attn1" in m for m in fallback_messages(record))
    report = attn_qat.attention_report(model)
    assert sorted(report.fallbacks) == ["blocks.0.attn1", "blocks.1.attn1"]
    assert {m.name: m.status for m in report.modules}["blocks.0.attn2"] == "left out"  # cross-attention: opt-in


def test_diffusers_report_counts_fp4_calls():
    model, inputs = _wan(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnQATFallbackWarning)
        attn_qat.prepare(model, QATConfig(cross_attention=True))
        model(**inputs)
    report = attn_qat.attention_report(model)
    assert [m.name for m in report.modules] == ["blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1",
                                                "blocks.1.attn2"]
    assert all(m.status == "attn_qat" and m.calls == {"fp4": 1} for m in report.modules)


def test_compiled_calls_are_not_counted_and_do_not_recompile():
    """Counting inside a compiled graph would put the count in dynamo's guards (a recompile at every call, then
    eager after the recompile limit): compiled calls compile once and are not counted; eager ones are."""
    import torch._dynamo
    model, inputs = _wan(64)
    attn_qat.prepare(model)
    module = model.blocks[0].attn1
    hidden = torch.randn(1, 32, 128, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            compiled(hidden)
    assert attn_qat.attention_report(model).modules[0].calls == {}
    module(hidden)
    assert attn_qat.attention_report(model).modules[0].calls == {"fp4": 1}
