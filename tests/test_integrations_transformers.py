"""transformers integration on a tiny Qwen3 built from its config (no downloads): the "attn_qat"
attention implementation against transformers' own "sdpa", masks and padding, generate(), training,
the lifecycle and torch.compile."""
import copy
import types
import warnings

import pytest
import torch

from conftest import importorskip

transformers = importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import attn_qat  # noqa: E402
from attn_qat import QATConfig  # noqa: E402
from attn_qat.integrations import AttentionState, attention_states  # noqa: E402
from attn_qat.integrations.config import STATE_ATTR  # noqa: E402
from attn_qat.integrations import transformers as tf_integration  # noqa: E402
from conftest import rel_error as _rel_error  # noqa: E402

VOCAB = 128
# bf16 mode computes exact attention with its own bf16 rounding: one attention call agrees with torch's
# SDPA to about 1e-3; through two random layers, RMS norms and the LM head the logits agree to ~7e-3.
BF16_LOGITS_TOL = 2e-2


def tiny_qwen3(head_dim=64, device="cpu", **overrides):
    """A fresh random 2-layer Qwen3 (4 query heads, 2 KV heads) in bfloat16 with its own config object (a
    shared config would make set_attn_implementation switch every model built from it)."""
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, vocab_size=VOCAB, max_position_embeddings=256,
                         attn_implementation="sdpa", **overrides)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def twin(model, config=None, **prepare_kwargs):
    """A copy of `model` prepared with attn_qat."""
    return attn_qat.prepare(copy.deepcopy(model), config, **prepare_kwargs)


def batch(device, padding=None, size=(3, 45)):
    """Token ids and a 2-D attention mask: no padding, left padding (generation) or right padding (training)."""
    ids = torch.randint(0, VOCAB, size, device=device)
    mask = torch.ones(size, dtype=torch.long, device=device)
    pads = [0, size[1] // 5, 2 * size[1] // 3][:size[0]]  # none, some, most of the row
    for row, pad in enumerate(pads):
        if pad and padding == "left":
            mask[row, :pad] = 0
        elif pad and padding == "right":
            mask[row, -pad:] = 0
    return ids, mask


def rel_error(out, ref):
    return _rel_error(out.detach(), ref.detach())


@pytest.fixture(params=[64, 128], ids=["d64", "d128"])
def head_dim(request):
    return request.param


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_bf16_mode_matches_sdpa(device, head_dim, padding):
    torch.manual_seed(head_dim)
    reference = tiny_qwen3(head_dim, device)
    model = twin(reference, QATConfig(mode="bf16"))
    ids, mask = batch(device, padding)
    valid = mask.bool()  # logits at padding positions mean nothing
    expected = reference(ids, attention_mask=mask).logits[valid]
    out = model(ids, attention_mask=mask).logits[valid]
    assert model.config._attn_implementation == "attn_qat" and reference.config._attn_implementation == "sdpa"
    assert rel_error(out, expected) < BF16_LOGITS_TOL


def test_attn_qat_mode_differs_slightly_and_trains(device, head_dim):
    torch.manual_seed(head_dim + 1)
    reference = tiny_qwen3(head_dim, device)
    model = twin(reference)
    ids, mask = batch(device, "right")
    valid = mask.bool()
    expected = reference(ids, attention_mask=mask).logits[valid]
    fp4_error = rel_error(model(ids, attention_mask=mask).logits[valid], expected)
    # 4-bit Q, K, V and P move the logits of a random model by ~15%: clearly not bf16, not garbage either.
    assert BF16_LOGITS_TOL < fp4_error < 0.5
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        loss = model(ids, attention_mask=mask, labels=ids.masked_fill(~valid, -100)).loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(grads) == len(list(model.parameters()))
        assert all(torch.isfinite(g).all() for g in grads)
        assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < losses[0]


def test_generate_with_left_padding(device):
    """Greedy decoding through the KV cache (one query against the cache per step, no causal flag) gives,
    at every step, the logits transformers' sdpa computes for the same tokens in one full forward."""
    torch.manual_seed(3)
    reference = tiny_qwen3(64, device)
    model = twin(reference, QATConfig(mode="bf16"))
    ids, mask = batch(device, "left", size=(2, 20))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences.shape == (2, 25)
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype, device=device)], dim=1)
    expected = reference(out.sequences, attention_mask=full_mask).logits[:, 19:24]
    assert rel_error(torch.stack(out.logits, dim=1), expected) < BF16_LOGITS_TOL
    fp4 = twin(reference).generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert fp4.shape == (2, 25) and bool((fp4 >= 0).all() and (fp4 < VOCAB).all())


class _Recorder:
    """Stands in for run_sdpa to see what the transformers integration passes to attn_qat."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = tf_integration.run_sdpa

        def record(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kwargs):
            self.calls.append(types.SimpleNamespace(query=query, key=key, mask=attn_mask, is_causal=is_causal,
                                                    scale=scale, enable_gqa=enable_gqa))
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, **kwargs)

        monkeypatch.setattr(tf_integration, "run_sdpa", record)


def test_grouped_kv_heads_are_not_expanded(device, monkeypatch):
    recorder = _Recorder(monkeypatch)
    model = twin(tiny_qwen3(128, device))
    model(*batch(device, None))
    assert len(recorder.calls) == 2
    for call in recorder.calls:
        assert call.query.shape[1] == 4 and call.key.shape[1] == 2 and call.enable_gqa
        assert call.is_causal and call.mask is None and call.scale == 128 ** -0.5


def _attention_module(is_causal=True, groups=2):
    return types.SimpleNamespace(is_causal=is_causal, num_key_value_groups=groups, layer_idx=0, training=False)


@pytest.mark.parametrize("case", ["prefill", "decode", "bool_mask", "not_causal", "cache_longer", "float_mask"])
def test_attention_function_follows_sdpa(device, case):
    """The registered function against transformers' sdpa_attention_forward on the same (B, H, S, D)
    inputs, in bf16 mode: same causal decision, same cropping, same (B, S, H, D) output layout."""
    nq, nk = {"decode": (1, 30), "cache_longer": (20, 32)}.get(case, (24, 24))
    module = _attention_module(is_causal=case != "not_causal")
    q = torch.randn(2, nq, 4, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)  # as the model passes it
    k, v = (torch.randn(2, 2, nk, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    mask = None
    if case == "bool_mask":
        mask = torch.ones(2, 1, nq, nk, dtype=torch.bool, device=device).tril()
        mask[1, :, :, :5] = False  # left padding: rows 0-4 of sample 1 see nothing
    if case == "float_mask":
        mask = torch.full((2, 1, nq, nk), torch.finfo(torch.bfloat16).min, device=device).triu(1).to(torch.bfloat16)
    setattr(module, STATE_ATTR, AttentionState(QATConfig(mode="bf16")))
    out, weights = tf_integration.attn_qat_attention_forward(module, q, k, v, mask, scaling=0.125)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
    assert weights is None and out.shape == (2, nq, 4, 64) and out.is_contiguous()
    if case == "bool_mask":
        # Rows 0-4 of sample 1 see no key: attn_qat's empty rows are 0 (numerics.md §6), while torch's SDPA
        # backends disagree among themselves there (NaN, 0 or a uniform average). Compare the other rows.
        assert not out[1, :5].any()
        out, expected = torch.cat([out[0], out[1, 5:]]), torch.cat([expected[0], expected[1, 5:]])
    # Two bf16 implementations, each rounding P for its P.V product and O on output: a few 1e-3 apart.
    assert rel_error(out, expected) < 5e-3


def test_sliding_window(device):
    """Sliding-window layers get the window from the mask, which the 'attn_qat' mask function builds as
    transformers' SDPA does; without a mask and with more keys than the window, it refuses."""
    torch.manual_seed(4)
    overrides = dict(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                     layer_types=["sliding_attention", "sliding_attention"])
    reference = tiny_qwen3(64, device, **overrides)
    model = twin(reference, QATConfig(mode="bf16"))
    ids, mask = batch(device, None, size=(2, 30))
    assert rel_error(model(ids).logits, reference(ids).logits) < BF16_LOGITS_TOL
    module = _attention_module()
    q = torch.randn(1, 4, 30, 64, device=device, dtype=torch.bfloat16)
    kv = torch.randn(1, 2, 30, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sliding_window"):
        tf_integration.attn_qat_attention_forward(module, q, kv, kv, None, sliding_window=8)


def test_set_attn_implementation_and_from_config():
    attn_qat.register_transformers()
    model = tiny_qwen3(64)
    model.set_attn_implementation("attn_qat")
    assert model.config._attn_implementation == "attn_qat"
    ids, _ = batch("cpu")
    # no prepare: modules run the default config, attn_qat mode
    expected = twin(model, QATConfig())(ids).logits
    assert torch.equal(model(ids).logits, expected)
    config = copy.deepcopy(model.config)
    built = Qwen3ForCausalLM._from_config(config, attn_implementation="attn_qat")
    assert built.config._attn_implementation == "attn_qat"


def test_filter_fn_and_lifecycle(device):
    torch.manual_seed(5)
    reference = tiny_qwen3(64, device)
    model = twin(reference, filter_fn=lambda module, name: name.startswith("model.layers.0."))
    states = attention_states(model)
    assert [s.selected for s in states.values()] == [True, False]
    ids, _ = batch(device)
    prepared = model(ids).logits
    attn_qat.disable(model)
    assert torch.equal(model(ids).logits, reference(ids).logits)  # transformers' sdpa, bit for bit
    attn_qat.enable(model)
    assert torch.equal(model(ids).logits, prepared)
    attn_qat.convert(model)
    assert all(s.inference for s in states.values() if s.selected)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, prepared)  # inference runs the forward it trained with
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(ids)
    assert any("converted for inference" in str(w.message) for w in record)


def test_dropout_falls_back_or_raises(device):
    torch.manual_seed(6)
    model = twin(tiny_qwen3(64, device, attention_dropout=0.1))
    model.train()
    ids, _ = batch(device)
    with pytest.warns(attn_qat.AttnQATFallbackWarning, match="dropout"):
        model(ids)
    strict = twin(tiny_qwen3(64, device, attention_dropout=0.1), QATConfig(strict=True))
    strict.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        strict(ids)
    strict.eval()  # no dropout in eval: runs attn_qat
    strict(ids)


def test_torch_compile_and_toggle():
    """Compiled models read the state while tracing; toggling recompiles and is honoured."""
    torch.manual_seed(7)
    reference = tiny_qwen3(64)
    model = twin(reference)
    ids, _ = batch("cpu")
    eager = model(ids).logits
    compiled = torch.compile(model, backend="aot_eager")
    assert torch.equal(compiled(ids).logits, eager)
    attn_qat.disable(model)
    assert torch.equal(compiled(ids).logits, reference(ids).logits)
    attn_qat.enable(model)
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(model.model.layers[1].self_attn.k_proj.weight.grad).all()


def _documents(device, lengths=(7, 20, 1, 33)):
    return [torch.randint(0, VOCAB, (n,), device=device) for n in lengths]


@pytest.mark.parametrize("source", ["position_ids", "flash_kwargs"])
def test_inference_mode(device, source):
    """Under torch.inference_mode the tensors a forward passes down (position_ids, cu_seq_lens, masks) have no
    version counter; the host copies attn_qat keeps of them must not need one."""
    from transformers import DataCollatorWithFlattening

    model = twin(tiny_qwen3(64, device)).eval()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=source == "flash_kwargs")
    batch = {name: t.to(device) if isinstance(t, torch.Tensor) else t
             for name, t in collator([{"input_ids": d.tolist()} for d in _documents(device)]).items()}
    one_row = batch["input_ids"][:, :20]
    with torch.no_grad():
        expected = model(**batch).logits, model(one_row).logits
    with torch.inference_mode():
        for _ in range(2):  # the second pass finds the first one's entries
            assert torch.equal(model(**batch).logits, expected[0])
            assert torch.equal(model(one_row).logits, expected[1])


@pytest.mark.parametrize("source", ["position_ids", "flash_kwargs"])
def test_packed_batch_equals_each_document_alone(device, source, monkeypatch):
    """A padding-free batch (documents one after another in one row, positions restarting, as
    DataCollatorWithFlattening makes it) runs each layer as attn_qat.attention_varlen, where transformers'
    FlashAttention path would run its varlen kernel: every document's logits are those of the document alone
    (bit for bit on the CPU: the C kernels, the linear layers and the norms work row by row), and it trains."""
    from transformers import DataCollatorWithFlattening

    torch.manual_seed(11)
    model = twin(tiny_qwen3(64, device))
    docs = _documents(device)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=source == "flash_kwargs")
    batch = {name: t.to(device) if isinstance(t, torch.Tensor) else t  # max_length_q, max_length_k are ints
             for name, t in collator([{"input_ids": d.tolist()} for d in docs]).items()}
    assert ("cu_seq_lens_q" in batch) == (source == "flash_kwargs")
    calls = []
    varlen = attn_qat.varlen._attention_varlen

    def record(*args, **kwargs):
        calls.append(args[3])  # cu_seqlens_q on the host
        return varlen(*args, **kwargs)

    monkeypatch.setattr(attn_qat.varlen, "_attention_varlen", record)
    out = model(**batch)
    assert calls == [[0, 7, 27, 28, 61]] * 2  # both layers, the boundaries read once
    alone = torch.cat([model(d[None]).logits[0] for d in docs])
    packed = out.logits[0]
    if device == "cpu":
        assert torch.equal(packed, alone)
    else:
        assert rel_error(packed, alone) < 2e-2
    # the masked SDPA path on the same batch is not the same computation: P's blocks there count from the row's
    # first key, not from each document's
    monkeypatch.setattr(tf_integration, "_packed_sequences", lambda *args: None)
    assert not torch.equal(model(**batch).logits[0], packed)
    out.loss.backward()
    grad = model.model.layers[0].self_attn.k_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_packed_routing_needs_the_packing_mask(device):
    """A mask that is not exactly the packing's (here one that also hides a key) keeps the SDPA path, which honours
    it; without positions that restart, nothing is packed."""
    module = _attention_module()
    setattr(module, STATE_ATTR, AttentionState(QATConfig()))
    lengths = [10, 14]
    q = torch.randn(1, 4, 24, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 24, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths)).to(device)
    mask = ((seq[:, None] == seq[None, :]) & torch.ones(24, 24, dtype=torch.bool, device=device).tril())[None, None]
    assert tf_integration._packed_sequences(q, k, v, mask, 0.0, True, {"position_ids": position_ids}) == (
        [0, 10, 24], [0, 10, 24])
    assert tf_integration._packed_sequences(q, k, v, None, 0.0, True, {"position_ids": position_ids}) is not None
    other = mask.clone()
    other[..., 20, 12] = False
    assert tf_integration._packed_sequences(q, k, v, other, 0.0, True, {"position_ids": position_ids}) is None
    assert tf_integration._packed_sequences(q, k, v, None, 0.0, True,
                                            {"position_ids": torch.arange(24, device=device)[None]}) is None
    # the packed call agrees with the masked one on the first sequence, whose blocks start at key 0 either way (up to
    # the masked path's logit rounding, numerics.md §8), and differs a little on the second, whose blocks do not
    packed, _ = tf_integration.attn_qat_attention_forward(module, q, k, v, mask, position_ids=position_ids)
    masked, _ = tf_integration.attn_qat_attention_forward(module, q, k, v, mask)  # no positions: not packed
    assert rel_error(packed[:, :10], masked[:, :10]) < 1e-2 and rel_error(packed, masked) < 0.1
