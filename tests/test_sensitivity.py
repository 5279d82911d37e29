"""The sensitivity map and the precision knob (docs/integrations.md, "Sensitivity and the precision knob") on the
tiny Qwen3 and the tiny Wan: `attn_qat.sensitivity` ranks first a layer whose FP4 error was made large
(`make_noisy`); `QATConfig(bf16_modules=...)`
makes the kept layers compute exactly mode "bf16" in training, after `convert`, in packed batches and through an
`NVFP4Cache`; the plan survives `state_dict` / `load_state_dict`; unknown names raise."""
import copy
import json

import pytest
import torch

from conftest import importorskip, rel_error

transformers = importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

import attn_qat  # noqa: E402
from attn_qat import QATConfig  # noqa: E402
from attn_qat.integrations import attention_states  # noqa: E402
from attn_qat.integrations.config import KEEP_BF16_BUFFER  # noqa: E402

VOCAB = 128
LAYERS = 4
NOISY = 2  # the layer whose FP4 error the tests make large


def tiny_qwen3(layers=LAYERS, device="cpu", seed=0):
    """A random 4-layer Qwen3 in bfloat16 with a peaked LM head (so that the loss reacts to what attention does)."""
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=256,
                         attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


def make_noisy(model, layer=NOISY):
    """Makes one layer's FP4 error stand out: its Q and K twice as large (Qwen3's per-head Q/K norms: the scores 4x,
    and FP4's rounding of them with them) and the other layers' attention 20x weaker (their output projections), so
    that a random model's natural ranking (the first layer's errors pass through every later one) cannot win."""
    with torch.no_grad():
        for i, decoder_layer in enumerate(model.model.layers):
            attention = decoder_layer.self_attn
            if i == layer:
                attention.q_norm.weight.mul_(2)
                attention.k_norm.weight.mul_(2)
            else:
                attention.o_proj.weight.mul_(0.05)
    return model


def own_targets(model, device, batches=3, size=(4, 48)):
    """Held-out batches whose labels are the model's own greedy predictions under its bf16 attention: its loss is low
    there and every FP4 error raises it."""
    out = []
    for _ in range(batches):
        ids = torch.randint(0, VOCAB, size, device=device)
        with torch.no_grad():
            logits = model(ids).logits
        labels = torch.full_like(ids, -100)
        labels[:, 1:] = logits[:, :-1].argmax(-1)
        out.append({"input_ids": ids, "labels": labels})
    return out


def test_sensitivity_ranks_the_noisy_layer_first(device, tmp_path):
    model = make_noisy(tiny_qwen3(device=device))
    batches = own_targets(model, device)
    report = attn_qat.sensitivity(model, batches, resamples=2000)
    noisy = f"model.layers.{NOISY}.self_attn"
    assert report.layers == tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS))
    assert report.items == 12
    for by in ("single", "leave_one_out"):
        assert report.ranking(by)[0] == noisy
        effect = report.effects(by)[NOISY]
        assert effect.low > 0 and effect.low <= effect.mean <= effect.high
        others = [e.mean for i, e in enumerate(report.effects(by)) if i != NOISY]
        assert effect.mean > 3 * max(others)
    assert report.all_fp4.mean == pytest.approx(report.fp4_loss - report.bf16_loss)
    assert attn_qat.plan_precision(report, keep=1) == (noisy,)
    assert attn_qat.plan_precision(report, keep=0) == ()
    assert len(set(attn_qat.plan_precision(report, keep=LAYERS, by="single"))) == LAYERS
    with pytest.raises(ValueError, match="keep"):
        attn_qat.plan_precision(report, keep=LAYERS + 1)
    table = report.table()
    assert table.splitlines()[2].startswith(f"| 1 | `{noisy}` |") and "leave-one-out" in table
    json.dumps(report.to_dict())
    importorskip("matplotlib")
    report.plot(tmp_path / "sensitivity.png")
    assert (tmp_path / "sensitivity.png").stat().st_size > 0
    # the model is left as it was: prepared, every module enabled, in train mode
    assert model.training and all(s.enabled for s in attention_states(model).values())


def test_sensitivity_default_loss_and_token_batches():
    """Token-id batches go through the default next-token loss; without leave_one_out only single effects, and a
    kept module is not measured."""
    model = tiny_qwen3(layers=2)
    attn_qat.prepare(model, QATConfig(bf16_modules=("model.layers.0.self_attn",)))
    report = attn_qat.sensitivity(model, [torch.randint(0, VOCAB, (3, 40))], leave_one_out=False, resamples=100)
    assert report.layers == ("model.layers.1.self_attn",) and report.leave_one_out is None and report.items == 3
    with pytest.raises(ValueError, match="leave-one-out"):
        report.ranking("leave_one_out")
    assert attn_qat.plan_precision(report, keep=1) == ("model.layers.1.self_attn",)


@pytest.mark.filterwarnings("ignore::attn_qat.AttnQATFallbackWarning")
def test_sensitivity_prepares_a_plain_model_and_checks_its_inputs():
    model = tiny_qwen3(layers=2)
    with pytest.raises(ValueError, match="no batches"):
        attn_qat.sensitivity(model, [])
    with pytest.raises(TypeError, match="loss_fn"):
        attn_qat.sensitivity(model, [(1, 2)])
    with pytest.raises(TypeError, match="per-example losses"):
        attn_qat.sensitivity(model, [torch.zeros(1, 8, dtype=torch.long)], lambda m, b: 1.0)
    assert model.config._attn_implementation == "attn_qat"  # prepared (QATConfig()) and left so
    with pytest.warns(RuntimeWarning, match="changed no loss"):  # float64: every attention call falls back to SDPA
        attn_qat.sensitivity(model.double(), [torch.randint(0, VOCAB, (2, 16))], resamples=10)


# ------------------------------------------------------------------------------------------ the knob

def twin(model, **config):
    return attn_qat.prepare(copy.deepcopy(model), QATConfig(**config))


def attention_outputs(model, ids, **kwargs):
    """{layer: its attention module's output} of one forward."""
    outs, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0])))
    try:
        logits = model(ids, **kwargs).logits
    finally:
        for h in handles:
            h.remove()
    return logits, outs


ALL = tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS))


@pytest.mark.parametrize("inference", [False, True], ids=["training", "convert"])
def test_kept_layers_compute_bf16_attention(device, inference):
    torch.manual_seed(3)
    reference = make_noisy(tiny_qwen3(device=device))
    bf16, fp4 = twin(reference, mode="bf16"), twin(reference, rotate_qk=True)
    every, first = twin(reference, rotate_qk=True, bf16_modules=ALL), twin(reference, bf16_modules=ALL[:1])
    kept_state = attention_states(every)[ALL[0]]
    assert kept_state.config.mode == "bf16" and not kept_state.config.rotate_qk
    assert attention_states(first)[ALL[1]].config.mode == "attn_qat" and attention_states(first)[ALL[0]].kept_bf16
    models = (bf16, fp4, every, first)
    if inference:
        for m in models:
            attn_qat.convert(m)
    ids = torch.randint(0, VOCAB, (2, 40), device=device)
    with torch.set_grad_enabled(not inference):
        (l_bf16, o_bf16), (l_fp4, o_fp4), (l_every, o_every), (l_first, o_first) = (
            attention_outputs(m, ids) for m in models)
    assert torch.equal(l_every, l_bf16)  # every layer kept: the model is mode "bf16"
    assert torch.equal(o_first[0], o_bf16[0]) and not torch.equal(o_first[0], o_fp4[0])  # same input, bf16 attention
    assert not torch.equal(o_first[NOISY], o_bf16[NOISY])  # the other layers stay FP4
    if not inference:
        l_every.float().square().mean().backward()
        l_bf16.float().square().mean().backward()
        for (name, p), q in zip(every.named_parameters(), bf16.parameters()):
            # bit for bit on the CPU; a GPU backward may sum in another order from run to run
            assert torch.equal(p.grad, q.grad) if device == "cpu" else rel_error(p.grad, q.grad) < 1e-2, name


def test_kept_layers_in_packed_batches(device):
    """A padding-free batch (positions restarting in one row) runs kept layers as attention_varlen in mode bf16."""
    torch.manual_seed(4)
    reference = tiny_qwen3(layers=2, device=device)
    bf16, every = twin(reference, mode="bf16"), twin(reference, bf16_modules=ALL[:2])
    fp4 = twin(reference)
    lengths = (7, 20, 13)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), device=device)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    out = every(ids, position_ids=position_ids).logits
    assert torch.equal(out, bf16(ids, position_ids=position_ids).logits)
    assert not torch.equal(out, fp4(ids, position_ids=position_ids).logits)


def test_kept_layer_gets_a_bf16_cache_layer(device):
    """Greedy decoding through an NVFP4Cache: the kept layer's cache layer holds bf16 keys and values and attends
    as mode "bf16" does, the others stay NVFP4; the logits follow the same model recomputing every step."""
    from test_kv_cache_transformers import CACHE, PAD, PROMPT, recompute, trained

    model, docs = trained(64, device)
    kept = attn_qat.prepare(model, QATConfig(bf16_modules=("model.layers.0.self_attn",)))
    prompt = docs[:, :PROMPT]
    cache = attn_qat.NVFP4Cache(kept.config, max_cache_len=64)
    out = kept.generate(prompt, **{CACHE: cache}, max_new_tokens=8, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, pad_token_id=PAD)
    logits = torch.stack(out.logits, dim=1).float()
    assert cache.layers[0].bf16 and cache.layers[0].kv is None and cache.layers[0].keys.shape[2] == PROMPT + 7
    assert not cache.layers[1].bf16 and cache.layers[1].kv is not None
    expected_sequences, expected = recompute(kept, prompt, steps=8)
    assert torch.equal(out.sequences, expected_sequences)
    assert (logits - expected).abs().max() < 0.1
    # the same decoding with layer 0 in FP4 moves the logits
    fp4 = attn_qat.prepare(copy.deepcopy(model), QATConfig())
    _, fp4_logits = recompute(fp4, prompt, steps=8)
    assert (fp4_logits - expected).abs().max() > 1e-3
    cache.reset()  # a reset cache finds out again which layers are bf16
    assert not cache.layers[0].bf16
    kept.generate(prompt, **{CACHE: cache}, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    assert cache.layers[0].bf16


def test_plan_survives_the_state_dict():
    torch.manual_seed(5)
    reference = tiny_qwen3(layers=2)
    plan = ("model.layers.1.self_attn",)
    trained = twin(reference, shift_k=True, bf16_modules=plan)
    attn_qat.calibrate_k_shift(trained, [torch.randint(0, VOCAB, (2, 32))])
    state = trained.state_dict()
    assert f"{plan[0]}.{KEEP_BF16_BUFFER}" in state and f"{plan[0]}.attn_qat_k_shift" not in state
    ids = torch.randint(0, VOCAB, (2, 32))
    expected = trained(ids).logits
    same = twin(reference, shift_k=True, bf16_modules=plan)
    same.load_state_dict(state)
    assert torch.equal(same(ids).logits, expected)
    adopted = twin(reference, shift_k=True)  # prepared without a plan: the checkpoint's is adopted
    adopted.load_state_dict(state)
    assert attention_states(adopted)[plan[0]].kept_bf16 and torch.equal(adopted(ids).logits, expected)
    with pytest.raises(ValueError, match="checkpoint keeps model.layers.1.self_attn in bf16"):
        twin(reference, shift_k=True, bf16_modules=("model.layers.0.self_attn",)).load_state_dict(state)
    without = twin(reference).state_dict()
    with pytest.raises(RuntimeError, match=KEEP_BF16_BUFFER):  # the plan is missing from the checkpoint
        twin(reference, bf16_modules=plan).load_state_dict(without)
    again = attn_qat.prepare(same, QATConfig(shift_k=True))  # prepared again without the plan: no marker left
    assert not any(KEEP_BF16_BUFFER in k for k in again.state_dict())


def test_unknown_names_raise():
    model = tiny_qwen3(layers=2)
    with pytest.raises(ValueError, match=r"\['model.layers.2.self_attn'\] match no attention module.*"
                                         r"model.layers.0.self_attn"):
        twin(model, bf16_modules=("model.layers.2.self_attn",))
    with pytest.raises(ValueError, match="match no attention module"):
        twin(model, bf16_modules=("model.layers.0.mlp",))
    with pytest.raises(ValueError, match="leaves out"):
        attn_qat.prepare(copy.deepcopy(model), QATConfig(bf16_modules=ALL[:1]),
                         filter_fn=lambda module, name: name != ALL[0])
    assert model.config._attn_implementation == "sdpa"  # nothing was installed before the error
    with pytest.raises(TypeError, match="sequence of module names"):
        QATConfig(bf16_modules="model.layers.0.self_attn")
    assert QATConfig(bf16_modules=["a", "b", "a"]).bf16_modules == ("a", "b")
    with pytest.raises(ValueError, match="bf16_modules needs a model prepared"):
        attn_qat.patch_sdpa(QATConfig(bf16_modules=ALL[:1]))
    with pytest.raises(ValueError, match="bf16_modules needs a model prepared"):
        attn_qat.register_transformers(QATConfig(bf16_modules=ALL[:1]))


def test_peft_names():
    peft = importorskip("peft")
    model = peft.get_peft_model(tiny_qwen3(layers=2), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    name = "base_model.model.model.layers.0.self_attn"
    assert name in dict(model.named_modules())
    attn_qat.prepare(model, QATConfig(bf16_modules=(name,)))
    assert attention_states(model)[name].kept_bf16
    with pytest.raises(ValueError, match="base_model.model.model.layers.1.self_attn"):
        attn_qat.prepare(model, QATConfig(bf16_modules=("model.layers.0.self_attn",)))
    report = attn_qat.sensitivity(model, [torch.randint(0, VOCAB, (2, 24))], config=QATConfig(), resamples=100)
    assert report.layers == (name, "base_model.model.model.layers.1.self_attn")


# ------------------------------------------------------------------------------------------ Wan

def test_wan_sensitivity_and_knob(device):
    importorskip("diffusers")
    from test_integrations_diffusers import tiny_wan, wan_inputs

    torch.manual_seed(6)
    reference = tiny_wan(64, device)
    with torch.no_grad():
        reference.blocks[1].attn1.norm_k.weight[::16].mul_(30)
    inputs = [wan_inputs(device) for _ in range(2)]
    with torch.no_grad():
        targets = [reference(**x).sample for x in inputs]  # the bf16 model's own output

    def loss_fn(model, batch):
        x, target = batch
        return (model(**x).sample.float() - target.float()).square().flatten(1).mean(1)

    model = copy.deepcopy(reference)
    with pytest.raises(TypeError, match="no default loss"):
        attn_qat.sensitivity(model, list(zip(inputs, targets)))
    report = attn_qat.sensitivity(model, list(zip(inputs, targets)), loss_fn, resamples=200)
    assert report.layers == ("blocks.0.attn1", "blocks.1.attn1")
    assert report.ranking("single")[0] == report.ranking()[0] == "blocks.1.attn1"
    bf16 = attn_qat.prepare(copy.deepcopy(reference), QATConfig(mode="bf16"))
    kept = attn_qat.prepare(copy.deepcopy(reference), QATConfig(bf16_modules=report.layers))
    fp4 = attn_qat.prepare(copy.deepcopy(reference), QATConfig())
    with torch.no_grad():
        out = kept(**inputs[0]).sample
        assert torch.equal(out, bf16(**inputs[0]).sample) and not torch.equal(out, fp4(**inputs[0]).sample)
        attn_qat.convert(kept), attn_qat.convert(bf16)
        assert torch.equal(kept(**inputs[0]).sample, bf16(**inputs[0]).sample)
    with pytest.raises(ValueError, match="match no attention module"):
        attn_qat.prepare(copy.deepcopy(reference), QATConfig(bf16_modules=("blocks.0.ffn",)))
    with pytest.raises(ValueError, match="leaves out"):  # cross-attention is not converted by default
        attn_qat.prepare(copy.deepcopy(reference), QATConfig(bf16_modules=("blocks.0.attn1", "blocks.0.attn2")))
    with pytest.raises(ValueError, match="bf16_modules needs a model prepared"):
        attn_qat.WanAttnQATProcessor(None, QATConfig(bf16_modules=("blocks.0.attn1",)))
