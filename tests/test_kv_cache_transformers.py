"""attn_qat.NVFP4Cache with transformers' generate on a tiny Qwen3: greedy decoding through the NVFP4 KV
cache against the same model recomputing the whole sequence with attn_qat's fake-quant forward at every
step (no cache), left padding, and the errors for everything the cache does not support.

The model is a tiny Qwen3 (2 layers, hidden 128, 4 query / 2 KV heads, vocab 256) trained for 100 steps
to memorise two 48-token documents over a 16-token alphabet. A random model's top-2 logit margins are
~0.01, far below what 4-bit attention moves logits by, so its greedy tokens are a coin toss; the
memorising model's margins are > 6 while the cache moves logits by < 0.35. Its small alphabet makes every
token occur several times with different successors, so the predictions need attention to the context:
bf16 attention moves the logits by ~1.4, and a cache that forgets the new tokens' values derails decoding.
"""
import copy
import functools

import pytest
import torch

from conftest import importorskip

transformers = importorskip("transformers")
from packaging.version import Version  # noqa: E402

if Version(transformers.__version__) < Version("4.56"):
    pytest.skip("NVFP4Cache needs transformers >= 4.56 (test_integration_versions.py checks its error)",
                allow_module_level=True)
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import attn_qat  # noqa: E402
from attn_qat import QATConfig  # noqa: E402

VOCAB, ALPHABET, DOC_LEN, PROMPT, STEPS = 256, 16, 48, 27, 8
PAD = VOCAB - 1  # never in a document, so generate() builds no padding mask from it
# Largest |logit difference| allowed between decoding through the NVFP4 cache and the stepwise
# fake-quant recompute on the GPU. Both compute with the same Q^F, K^F, V^F and P^F (numerics.md §8,
# "Train = infer"); the decode kernel sums in another fp32 order than the forward kernel, which can flip an
# isolated P code. On the CPU the two are bit-identical (asserted). The top-2 margins of these models are > 6.
LOGIT_TOL = 0.75
# The same bound for decoding against the recompute, where only that summation order differs: a flipped P code
# moves a logit by a few hundredths (observed on the H100: 0.0 for both head dims and both caches).
DECODE_LOGIT_TOL = 0.1
# generate()'s keyword for the cache: transformers 5.24 renamed past_key_values to cache (the old name warns
# until 6.0, which drops it); the lent GPU machines have 5.17.
CACHE = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


def _train(head_dim: int, seed: int = 0):
    """The memorising tiny Qwen3 (float32 training on the CPU, deterministic), returned in bfloat16 with
    its two documents."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, vocab_size=VOCAB, max_position_embeddings=256,
                         attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config)
    docs = torch.randint(0, ALPHABET, (2, DOC_LEN), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        model(docs, labels=docs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.to(torch.bfloat16).eval(), docs


_trained = {}


def trained(head_dim: int, device):
    """A fresh copy (prepared with attn_qat, on `device`) of the memorising model for `head_dim`."""
    if head_dim not in _trained:
        _trained[head_dim] = _train(head_dim)
    model, docs = _trained[head_dim]
    return attn_qat.prepare(copy.deepcopy(model).to(device)), docs.to(device)


@pytest.fixture(params=[64, 128], ids=["d64", "d128"])
def head_dim(request):
    return request.param


def generate(model, ids, attention_mask=None, steps=STEPS, max_cache_len=64, static=False, **kwargs):
    """Greedy decoding through a fresh NVFP4Cache: (sequences, logits (B, steps, V) float32). A static cache runs eagerly
    unless a compile_config is given (on a GPU transformers would compile its steps)."""
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=max_cache_len, static=static)
    if static and "compile_config" not in kwargs:
        kwargs["disable_compile"] = True
    out = model.generate(ids, attention_mask=attention_mask, **{CACHE: cache}, max_new_tokens=steps,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1).float()


@torch.no_grad()
def recompute(model, ids, steps=STEPS):
    """The oracle: greedy decoding that recomputes the whole growing sequence with the model's own
    attention at every step, without a cache: (sequences, logits (B, steps, V) float32)."""
    logits = []
    for _ in range(steps):
        # logits_to_keep=1 as generate() does, so the LM head multiplies the same shapes (bitwise on GPUs too)
        step = model(ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        logits.append(step)
        ids = torch.cat([ids, step.argmax(-1, keepdim=True)], dim=1)
    return ids, torch.stack(logits, dim=1)


@torch.no_grad()
def logits_along(model, sequences, prompt_len):
    """The model's next-token logits at each generated position of fixed `sequences`, each from a
    recompute of its prefix (no cache)."""
    return torch.stack([model(sequences[:, :n], use_cache=False, logits_to_keep=1).logits[:, -1].float()
                        for n in range(prompt_len, sequences.shape[1])], dim=1)


def test_greedy_decoding_matches_fake_quant_recompute(device, head_dim):
    model, docs = trained(head_dim, device)
    prompt = docs[:, :PROMPT]
    sequences, logits = generate(model, prompt)
    expected_sequences, expected_logits = recompute(model, prompt)
    margins = expected_logits.topk(2, dim=-1).values
    assert float((margins[..., 0] - margins[..., 1]).min()) > 4 * LOGIT_TOL  # the oracle's choices are clear
    assert torch.equal(sequences, expected_sequences)  # token for token, 8 steps, both sequences
    difference = float((logits - expected_logits).abs().max())
    assert difference < DECODE_LOGIT_TOL, f"max |logit difference| {difference}"
    if device == "cpu":  # the same forward kernel on the same operands: train = infer, bit for bit
        assert difference == 0.0, f"max |logit difference| {difference}"
    # The prefill through the cache is the fake-quant forward itself: the first step's logits are identical.
    assert torch.equal(logits[:, 0], expected_logits[:, 0])
    # ... and 4-bit attention is what is being matched: bf16 attention on the same tokens is much further off.
    bf16 = copy.deepcopy(model)
    attn_qat.disable(bf16)
    bf16_difference = float((logits_along(bf16, sequences, PROMPT) - expected_logits).abs().max())
    assert bf16_difference > 2 * max(difference, LOGIT_TOL / 2), (bf16_difference, difference)


def test_bf16_cache_decoding_matches_fake_quant_recompute(device, head_dim):
    """With transformers' own cache the decoding steps come with one query, no mask and no causal flag, which
    alone would block V along tokens; the integration keeps a causal model's V along head_dim (numerics.md §2), so
    each step computes what the full causal forward computes: on the CPU bit for bit."""
    model, docs = trained(head_dim, device)
    prompt = docs[:, :PROMPT]
    out = model.generate(prompt, **{CACHE: DynamicCache()}, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=PAD)
    logits = torch.stack(out.logits, dim=1).float()
    expected_sequences, expected_logits = recompute(model, prompt)
    assert torch.equal(out.sequences, expected_sequences)
    difference = float((logits - expected_logits).abs().max())
    assert difference < DECODE_LOGIT_TOL, f"max |logit difference| {difference}"
    if device == "cpu":
        assert difference == 0.0, f"max |logit difference| {difference}"


def test_a_wrong_cache_is_caught(device, monkeypatch):
    """The comparison above can fail: a cache that loses the decoded tokens' values derails decoding."""
    model, docs = trained(64, device)
    prompt = docs[:, :PROMPT]
    expected_sequences, expected_logits = recompute(model, prompt)
    append = attn_qat.NVFP4KVCache.append

    def forgetful_append(self, k, v, lengths=None):
        return append(self, k, torch.zeros_like(v) if k.shape[2] == 1 else v, lengths)

    monkeypatch.setattr(attn_qat.NVFP4KVCache, "append", forgetful_append)
    sequences, logits = generate(model, prompt)
    assert float((logits - expected_logits).abs().max()) > 4 * LOGIT_TOL
    assert not torch.equal(sequences, expected_sequences)


def left_padded(docs, lengths=(PROMPT, PROMPT - 9)):
    """The documents' first `lengths` tokens as a left-padded batch: (prompt, attention_mask)."""
    prompt = torch.full((2, PROMPT), PAD, dtype=torch.long, device=docs.device)
    mask = torch.zeros(2, PROMPT, dtype=torch.long, device=docs.device)
    for row, n in enumerate(lengths):
        prompt[row, PROMPT - n:] = docs[row, :n]
        mask[row, PROMPT - n:] = 1
    return prompt, mask


@pytest.mark.parametrize("static", [False, True], ids=["host_lengths", "static"])
def test_left_padding(device, static):
    """A left-padded batch decodes each sequence as if it ran alone: the cache holds only real tokens,
    with P's 16-key blocks starting at each sequence's first token."""
    model, docs = trained(64, device)
    lengths = (PROMPT, PROMPT - 9)
    prompt, mask = left_padded(docs, lengths)
    sequences, logits = generate(model, prompt, attention_mask=mask, static=static)
    for row, n in enumerate(lengths):
        alone, alone_logits = recompute(model, docs[row:row + 1, :n])
        assert torch.equal(sequences[row, PROMPT:], alone[0, n:])
        assert float((logits[row] - alone_logits[0]).abs().max()) < LOGIT_TOL
        assert torch.equal(alone[0, n:], docs[row, n:n + STEPS])  # it recites its document
    # The padded prefill computes the lone prefill (the same tokens, the same P blocks): on the CPU bit for
    # bit; GPU GEMMs of other shapes (batch 2 against 1) may round differently.
    with torch.no_grad():
        alone_prefill = model(docs[1:2, :lengths[1]], logits_to_keep=1).logits[0, -1].float()
    if device == "cpu":
        assert torch.equal(logits[1, 0], alone_prefill)
    assert float((logits[1, 0] - alone_prefill).abs().max()) < LOGIT_TOL / 4


def test_batch_of_one_and_sampling(device):
    model, docs = trained(64, device)
    sequences, _ = generate(model, docs[:1, :PROMPT])
    expected, _ = recompute(model, docs[:1, :PROMPT])
    assert torch.equal(sequences, expected)
    torch.manual_seed(0)
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=40)
    sampled = model.generate(docs[:, :PROMPT], **{CACHE: cache}, max_new_tokens=5, do_sample=True, top_k=4,
                             pad_token_id=PAD)
    assert sampled.shape == (2, PROMPT + 5) and cache.get_seq_length() == PROMPT + 4


def test_reset_and_reuse(device):
    model, docs = trained(64, device)
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=64)
    first = model.generate(docs[:, :PROMPT], **{CACHE: cache}, max_new_tokens=4, do_sample=False,
                           pad_token_id=PAD)
    max_length = getattr(cache, "get_max_length", None) or cache.get_max_cache_shape  # transformers 4.x's name
    assert cache.get_seq_length() == PROMPT + 3 and max_length() == 64
    cache.reset()
    assert cache.get_seq_length() == 0
    again = model.generate(docs[:, :PROMPT], **{CACHE: cache}, max_new_tokens=4, do_sample=False,
                           pad_token_id=PAD)
    assert torch.equal(first, again)


def test_capacity(device):
    model, docs = trained(64, device)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate(model, docs[:, :PROMPT], max_cache_len=PROMPT + 3)  # room for 4 of the 8 new tokens
    with pytest.raises(ValueError, match="max_cache_len"):
        attn_qat.NVFP4Cache(model.config, max_cache_len=0)
    generate(model, docs[:, :PROMPT], max_cache_len=PROMPT + STEPS - 1)  # exactly enough: the last token is not fed


def test_needs_attn_qat_attention(device):
    """With another attention implementation the cache would hand it only the new tokens' keys; the
    first decoding step raises instead."""
    model, docs = trained(64, device)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="attn_implementation='attn_qat'"):
        generate(model, docs[:, :PROMPT])
    attn_qat.disable(model)
    model.set_attn_implementation("attn_qat")
    with pytest.raises(RuntimeError, match="switched off"):
        generate(model, docs[:, :PROMPT])


def test_unsupported_uses_raise(device):
    model, docs = trained(64, device)
    prompt = docs[:, :PROMPT]
    right = torch.ones_like(prompt)
    right[1, -5:] = 0
    with pytest.raises(NotImplementedError, match="left padding"):
        generate(model, prompt, attention_mask=right)
    with pytest.raises(NotImplementedError, match="beam search"):
        generate(model, prompt, num_beams=2)
    bf16 = attn_qat.prepare(copy.deepcopy(_trained[64][0]).to(device), QATConfig(mode="bf16"))
    with pytest.raises(ValueError, match="bf16"):
        generate(bf16, prompt)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        generate(copy.deepcopy(model).float(), prompt)
    sliding = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, use_sliding_window=True,
                          sliding_window=8, max_window_layers=0, layer_types=["sliding_attention"] * 2)
    with pytest.raises(NotImplementedError, match="full-attention"):
        attn_qat.NVFP4Cache(sliding, max_cache_len=64)
    # Other caches are untouched by the integration.
    out = model.generate(prompt, **{CACHE: DynamicCache()}, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    assert out.shape == (2, PROMPT + 2)


def test_mask_checks_read_the_host_once(monkeypatch):
    """The cache's check of an attention mask: every error it names, and each new mask read from the device once (a
    forward's one sync, at its first layer; later layers pass the same mask object)."""
    from attn_qat.integrations.kv_cache_transformers import _Padding
    batch, q_len, kv_len = 2, 4, 6
    keys = torch.arange(kv_len)
    pads = torch.tensor([0, 2])
    causal = keys <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    left = (causal & (keys >= pads[:, None, None]))[:, None]  # (batch, 1, q_len, kv_len), as transformers builds it
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    padding = _Padding()
    assert torch.equal(padding.of(left, batch, q_len, kv_len, prefill=True), pads)
    assert padding.host_pads == [0, 2] and len(reads) == 1
    assert padding.of(left, batch, q_len, kv_len, prefill=False) is padding.pads and len(reads) == 1  # same mask
    step = left[:, :, -1:].clone()
    padding.of(step, batch, 1, kv_len, prefill=False)
    assert len(reads) == 2
    additive = torch.zeros(left.shape).masked_fill(~left, float("-inf"))
    assert torch.equal(_Padding().of(additive, batch, q_len, kv_len, prefill=True), pads)
    for mask, err, match in [
        (additive + 0.5 * left, NotImplementedError, "additive"),
        (torch.cat([left, left & (keys < 5)], dim=1), NotImplementedError, "per-head"),
        (causal.expand(batch, 1, q_len, kv_len) & (keys < 4), NotImplementedError, "left padding"),  # right padding
        (causal.expand(batch, 1, q_len, kv_len) & (keys >= torch.tensor([0, kv_len])[:, None, None, None]), ValueError,
         "all padding"),
        (left.int(), TypeError, "dtype"),
        (left[:, :, :, :-1], ValueError, "shape"),
    ]:
        with pytest.raises(err, match=match):
            _Padding().of(mask, batch, q_len, kv_len, prefill=True)


# ----------------------------------------------------------------------------------------------
# NVFP4Cache(static=True): no host state that changes from step to step, so generate compiles the decoding steps


def test_static_cache_decodes_as_the_host_length_cache(device, head_dim):
    """Run eagerly, a static cache decodes what the default one does: the same tokens, on the CPU the same logits bit
    for bit (its attention reads the whole capacity, keys past a length absent); transformers' length is a tensor."""
    model, docs = trained(head_dim, device)
    prompt = docs[:, :PROMPT]
    expected_sequences, expected_logits = generate(model, prompt)
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=64, static=True)
    out = model.generate(prompt, **{CACHE: cache}, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=PAD, disable_compile=True)
    logits = torch.stack(out.logits, dim=1).float()
    assert torch.equal(out.sequences, expected_sequences)
    difference = float((logits - expected_logits).abs().max())
    assert difference < DECODE_LOGIT_TOL, difference
    if device == "cpu":
        assert difference == 0.0
    assert cache.is_compileable and int(cache.get_seq_length()) == PROMPT + STEPS - 1
    layer = cache.layers[0]
    addresses = [t.data_ptr() for t in (layer.seen, layer.kv.k_codes, layer.kv.v_scales, layer.kv.lengths)]
    cache.reset()  # in place: compiled steps of the next generate find the same buffers
    assert int(cache.get_seq_length()) == 0 and layer.kv.lengths.tolist() == [0, 0]
    again = model.generate(prompt, **{CACHE: cache}, max_new_tokens=STEPS, do_sample=False, pad_token_id=PAD,
                           disable_compile=True)
    assert torch.equal(again, expected_sequences)
    assert addresses == [t.data_ptr() for t in (layer.seen, layer.kv.k_codes, layer.kv.v_scales, layer.kv.lengths)]


@pytest.mark.parametrize("kept", [False, True], ids=["nvfp4", "layer0_bf16"])
def test_static_cache_compiles_the_steps_once(device, kept):
    """generate compiles a static cache's decoding steps (transformers does so on a GPU, with CUDA graphs; on the CPU
    the test asks for it, without inductor): one graph, no graph break, no recompilation for a second generate with a
    new cache, and the tokens the eager cache decodes; also with layer 0 kept in bf16 (StaticLayer-like buffers)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, docs = trained(64, device)
    if kept:
        model = attn_qat.prepare(model, QATConfig(bf16_modules=("model.layers.0.self_attn",)))
    prompt, mask = left_padded(docs)
    expected_sequences, expected_logits = generate(model, prompt, attention_mask=mask)
    if device == "cpu":
        config = CompileConfig(fullgraph=True, backend="eager", mode=None)
        if not hasattr(config, "_compile_all_devices"):
            pytest.skip("this transformers compiles generate's steps on GPUs only")
        config._compile_all_devices = True
    else:
        config = CompileConfig(fullgraph=True)  # transformers' default: inductor, CUDA graphs ("reduce-overhead")
    torch._dynamo.reset()
    counters.clear()
    for _ in range(2):
        sequences, logits = generate(model, prompt, attention_mask=mask, static=True, compile_config=config)
        assert torch.equal(sequences, expected_sequences)
        difference = float((logits - expected_logits).abs().max())
        if device == "cpu":  # the eager backend runs the same ops
            assert difference == 0.0, difference
        else:  # inductor fuses the model's other ops (norms, rotary) into other roundings
            assert difference < LOGIT_TOL, difference
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()


def test_static_cache_capacity_and_kept_layers():
    """The prefill's length is checked on the host; a decoding step past the capacity fails on the device (on the
    CPU a RuntimeError). A layer kept in bf16 keeps StaticLayer-like buffers and decodes as with the default cache."""
    model, docs = trained(64, "cpu")
    prompt = docs[:, :PROMPT]
    with pytest.raises(ValueError, match="max_cache_len"):
        generate(model, prompt, max_cache_len=PROMPT - 1, static=True)
    with pytest.raises(RuntimeError, match="past max_cache_len=30"):
        generate(model, prompt, max_cache_len=30, static=True)
    right = torch.ones_like(prompt)
    right[1, -5:] = 0
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=64, static=True)
    with pytest.raises(NotImplementedError, match="left padding"):
        model.generate(prompt, attention_mask=right, **{CACHE: cache}, max_new_tokens=2, pad_token_id=PAD,
                       disable_compile=True)
    assert not any(layer.filled for layer in cache.layers)  # a rejected prefill leaves the layers empty
    from transformers import CompileConfig, GenerationConfig
    if hasattr(GenerationConfig(), "prefill_chunk_size"):  # transformers compiles a chunked prefill's chunks
        for fullgraph in (True, False):
            torch._dynamo.reset()
            config = CompileConfig(fullgraph=fullgraph, backend="eager", mode=None)
            config._compile_all_devices = True
            run = functools.partial(generate, model, prompt, static=True, compile_config=config, prefill_chunk_size=16)
            if fullgraph:
                with pytest.raises(Exception, match="prefill_chunk_size"):
                    run()
            else:  # dynamo runs the prefill's frames eagerly instead
                assert torch.equal(run()[0], generate(model, prompt)[0])
        torch._dynamo.reset()
    with pytest.raises(TypeError, match="static"):
        attn_qat.NVFP4Cache(model.config, max_cache_len=64, static="yes")
    kept = attn_qat.prepare(model, QATConfig(bf16_modules=("model.layers.0.self_attn",)))
    expected_sequences, expected_logits = generate(kept, prompt)
    cache = attn_qat.NVFP4Cache(kept.config, max_cache_len=64, static=True)
    out = kept.generate(prompt, **{CACHE: cache}, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=PAD)
    assert cache.layers[0].bf16 and cache.layers[0].keys.shape[2] == 64 and cache.layers[1].kv is not None
    assert torch.equal(out.sequences, expected_sequences)
    assert torch.equal(torch.stack(out.logits, dim=1).float(), expected_logits)
