"""The score-preserving Q/K transforms (numerics.md §9: QATConfig rotate_qk, shift_k and balance_qk,
attn_qat.calibrate_k_shift):
exact scores, FP4 computed on the transformed operands, no hidden key reaching a visible output, calibration and
its buffer, the NVFP4 cache, and clear errors where they are not supported."""
import copy
import inspect
import math

import pytest
import torch

import attn_qat
from attn_qat import QATConfig
from attn_qat.transforms import qk_rotation, transform_qk
from conftest import DEVICES, importorskip

transformers = importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from attn_qat.integrations import qk_transforms as qk  # noqa: E402
from attn_qat.integrations import transformers as tf_integration  # noqa: E402

VOCAB = 128
BOTH = QATConfig(rotate_qk=True, shift_k=True, strict=True)
ALL = QATConfig(rotate_qk=True, shift_k=True, balance_qk=0.5, strict=True)


def tiny_qwen3(head_dim=64, device="cpu"):
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=head_dim, vocab_size=VOCAB, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def calibration_batches(device, count=2):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, 40), generator=generator).to(device) for _ in range(count)]


def prepared(model, config=BOTH, calibrate=True):
    model = attn_qat.prepare(copy.deepcopy(model), config)
    if calibrate and config.calibrated_qk:
        attn_qat.calibrate_k_shift(model, calibration_batches(next(model.parameters()).device))
    return model


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotation_is_a_fixed_signed_hadamard(head_dim):
    r = qk_rotation(head_dim).double()
    assert torch.allclose(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    assert torch.equal((r.abs() * math.sqrt(head_dim)).round(), torch.ones(head_dim, head_dim, dtype=torch.float64))
    assert torch.equal(qk_rotation(head_dim), qk_rotation(head_dim))
    with pytest.raises(ValueError, match="power-of-two"):
        qk_rotation(96)


def test_transforms_keep_the_softmax_exactly():
    """In float64 and without quantization the attention output does not move: q.k is rotation invariant and the
    shift adds a per-row constant to the scores."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 64, generator=g, dtype=torch.float64) for _ in range(3))
    shift = torch.randn(3, 1, 64, generator=g, dtype=torch.float64) * 4
    q2, k2 = transform_qk(q, k, rotate=True, k_shift=shift)
    assert q2.dtype == torch.float64 and not torch.allclose(k2, k)
    exact = torch.softmax(q @ k.transpose(-1, -2), -1) @ v
    moved = torch.softmax(q2 @ k2.transpose(-1, -2), -1) @ v
    assert torch.allclose(moved, exact, atol=1e-10, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_attention_function_quantizes_the_transformed_operands(device):
    """The module's attention is attn_qat's on (qR, (k - mu)R), with the module's calibrated mu."""
    model = prepared(tiny_qwen3(device=device))
    module = model.model.layers[0].self_attn
    shift = getattr(module, qk.K_SHIFT_BUFFER)
    assert shift.shape == (2, 64) and shift.dtype == torch.float32 and bool(shift.isfinite().all())
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 33, 64, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(1, 2, 33, 64, generator=g).to(device, torch.bfloat16) for _ in range(2))
    out, _ = tf_integration.attn_qat_attention_forward(module, q, k, v, None, scaling=0.125)
    qt, kt = transform_qk(q, k, rotate=True, k_shift=shift[:, None, :])
    expected = attn_qat.scaled_dot_product_attention(qt, kt, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert torch.equal(out, expected.transpose(1, 2))
    plain = attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert not torch.equal(out, plain.transpose(1, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_mode_is_unchanged_and_fp4_changes(device):
    base = tiny_qwen3(device=device)
    ids = torch.randint(0, VOCAB, (2, 45), device=device)
    with torch.no_grad():
        plain16 = prepared(base, QATConfig(mode="bf16"))(ids).logits.float()
        moved16 = prepared(base, QATConfig(mode="bf16", rotate_qk=True, shift_k=True))(ids).logits.float()
        plain4 = prepared(base, QATConfig())(ids).logits.float()
        moved4 = prepared(base, BOTH)(ids).logits.float()
    assert (moved16 - plain16).abs().max() < 2e-2  # bf16 rounding of the transformed operands only
    assert not torch.equal(moved4, plain4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_later_token_never_reaches_earlier_logits(device):
    """The shift is fixed: a token changes no logit before it, bit for bit (a shift by the call's own key mean
    would let it). Its gradients of earlier rows stay put too."""
    model = prepared(tiny_qwen3(device=device))
    ids = torch.randint(0, VOCAB, (2, 40), device=device)
    other = ids.clone()
    other[:, -5:] = (other[:, -5:] + 17) % VOCAB
    with torch.no_grad():
        a, b = model(ids).logits, model(other).logits
    assert torch.equal(a[:, :-5], b[:, :-5])
    model.train()
    grads = []
    for x in (ids, other):
        model.zero_grad()
        model(x).logits[:, :20].float().square().sum().backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("device", DEVICES)
def test_calibration_buffer_and_checkpoint(device):
    base = tiny_qwen3(device=device)
    uncalibrated = prepared(base, calibrate=False)
    ids = torch.randint(0, VOCAB, (1, 20), device=device)
    with pytest.raises(RuntimeError, match="calibrate_k_shift"):
        uncalibrated(ids)
    model = prepared(base)
    state = model.state_dict()
    key = f"model.layers.1.self_attn.{qk.K_SHIFT_BUFFER}"
    assert key in state
    fresh = prepared(base, calibrate=False)
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="shift_k=True"):
        attn_qat.calibrate_k_shift(prepared(base, QATConfig(rotate_qk=True)), calibration_batches(device))


def test_transform_runs_in_float32_under_autocast():
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 2, 5, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    shift = torch.randn(2, 1, 128, generator=g)
    plain = transform_qk(q, k, rotate=True, k_shift=shift)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = transform_qk(q, k, rotate=True, k_shift=shift)
    assert all(torch.equal(a, b) for a, b in zip(plain, under))


def test_calibration_under_inference_mode_and_in_place():
    """Calibrating under torch.inference_mode leaves a usable model; a second calibration writes the means into
    the same buffer tensor (wrappers such as DDP hold it)."""
    model = attn_qat.prepare(tiny_qwen3(), BOTH)
    placeholder = getattr(model.model.layers[0].self_attn, qk.K_SHIFT_BUFFER)
    with torch.inference_mode():
        attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    shift = getattr(model.model.layers[0].self_attn, qk.K_SHIFT_BUFFER)
    assert shift is placeholder and not shift.is_inference() and bool(shift.isfinite().all())
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        first = model(ids).logits
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, first)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu", 1))
    assert getattr(model.model.layers[0].self_attn, qk.K_SHIFT_BUFFER) is placeholder


def test_configs_that_cannot_work_are_refused():
    for name in ("rotate_qk", "shift_k"):
        with pytest.raises(TypeError, match=f"{name} must be True or False"):
            QATConfig(**{name: "false"})
    for config in (QATConfig(shift_k=True), QATConfig(balance_qk=0.5)):
        with pytest.raises(ValueError, match="need attn_qat.prepare"):
            attn_qat.register_transformers(config)
    for alpha in (0, -0.5, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="balance_qk must be None or a number in"):
            QATConfig(balance_qk=alpha)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        attn_qat.prepare(tiny_qwen3(head_dim=96), QATConfig(rotate_qk=True))


def test_a_module_left_out_is_not_transformed():
    model = attn_qat.prepare(tiny_qwen3(), BOTH, filter_fn=lambda module, name: "layers.0." in name)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    left_out = model.model.layers[1].self_attn
    assert not hasattr(left_out, qk.K_SHIFT_BUFFER)
    q, k = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64)
    out_q, out_k = tf_integration.module_qk_transform(left_out, q, k)
    assert out_q is q and out_k is k


def test_calibration_is_the_mean_of_the_keys(monkeypatch):
    base = tiny_qwen3()
    model = attn_qat.prepare(copy.deepcopy(base), BOTH)
    recorded = {}  # calibration record -> the keys given to its module, in call order
    original = qk.record_qk

    def spy(calibration, query, key, heads_axis):
        recorded.setdefault(id(calibration), []).append(key.double())
        original(calibration, query, key, heads_axis)

    monkeypatch.setattr(qk, "record_qk", spy)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu", 3))
    first_layer = next(iter(recorded.values()))  # layer 0 attends first
    assert len(recorded) == 2 and len(first_layer) == 3
    keys = torch.cat([k.transpose(1, 2).reshape(-1, 2, 64) for k in first_layer])
    shift = getattr(model.model.layers[0].self_attn, qk.K_SHIFT_BUFFER)
    assert torch.allclose(shift.double(), keys.mean(0), atol=1e-6)
    assert all(s.calibration is None for s in attn_qat.integrations.attention_states(model).values())


def greedy_through_cache_and_recomputed(model, prompts, new_tokens=8):
    """(greedy tokens through `generate` with an NVFP4Cache, the same recomputed from scratch every step)."""
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=prompts.shape[1] + 2 * new_tokens)
    with torch.no_grad():
        keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cached = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                do_sample=False, min_new_tokens=new_tokens, pad_token_id=0, **{keyword: cache})
        ids = prompts
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return cached, ids


@pytest.mark.parametrize("config", [BOTH, ALL], ids=["rotate_shift", "rotate_shift_balance"])
@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_cache_generation_matches_the_fake_quant_recompute(device, config):
    """The cache stores the transformed keys and transforms each step's query: greedy decoding through it equals
    recomputing every step with the fake-quant forward (bit-identical on the CPU, where both run one C kernel)."""
    model = attn_qat.convert(prepared(tiny_qwen3(device=device), config))
    cached, ids = greedy_through_cache_and_recomputed(model, torch.randint(0, VOCAB, (2, 12), device=device))
    if device == "cpu":
        assert torch.equal(cached, ids)
    else:  # the decode kernel sums in another order (numerics.md §7): most steps agree
        assert (cached == ids).float().mean() > 0.8


def test_integrations_without_a_module_refuse_them():
    for config in (QATConfig(rotate_qk=True), QATConfig(balance_qk=0.5)):
        with pytest.raises(NotImplementedError, match="attn_qat.prepare"):
            attn_qat.patch_sdpa(config)
    importorskip("diffusers")
    with pytest.raises(NotImplementedError, match="attn_qat.prepare"):
        attn_qat.register_diffusers_backend(QATConfig(shift_k=True))
    with pytest.raises(NotImplementedError, match="attn_qat.prepare"):
        attn_qat.WanAttnQATProcessor(None, QATConfig(shift_k=True))


# ------------------------------------------------------------------------------------------------ Wan (diffusers)

def tiny_wan_and_inputs(device, head_dim=64):
    diffusers = importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64).to(device, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    inputs = {"hidden_states": torch.randn(2, 4, 2, 8, 8, generator=g).to(device, torch.bfloat16),
              "timestep": torch.tensor([100, 700], device=device),
              "encoder_hidden_states": torch.randn(2, 16, 32, generator=g).to(device, torch.bfloat16)}
    return model, inputs


@pytest.mark.parametrize("device", DEVICES)
def test_wan_self_attention_transforms(device, monkeypatch):
    """prepare + calibrate_k_shift on a Wan transformer: each self-attention module's shift is the mean of the keys
    it saw, its calls quantize the transformed operands, bf16 mode stays put and FP4 moves."""
    base, inputs = tiny_wan_and_inputs(device)
    model = attn_qat.prepare(copy.deepcopy(base), BOTH)
    seen = {}
    record = qk.record_qk

    def spy(calibration, query, key, heads_axis):
        seen.setdefault(id(calibration), []).append(key.double())
        record(calibration, query, key, heads_axis)

    monkeypatch.setattr(qk, "record_qk", spy)
    attn_qat.calibrate_k_shift(model, [inputs])
    monkeypatch.setattr(qk, "record_qk", record)
    attn1 = model.blocks[0].attn1
    shift = getattr(attn1, qk.K_SHIFT_BUFFER)
    assert shift.shape == (2, 64) and len(seen) == 2  # the two blocks' self-attention; cross-attention not selected
    keys = next(iter(seen.values()))[0]  # (B, S, H, D)
    assert torch.allclose(shift.double(), keys.mean(dim=(0, 1)), atol=1e-6)
    assert not hasattr(model.blocks[0].attn2, qk.K_SHIFT_BUFFER)

    got = {}
    from attn_qat.integrations import diffusers as df_integration
    run = df_integration.run_sdpa

    def capture(query, key, *args, **kwargs):
        got.setdefault("qk", (query, key))
        return run(query, key, *args, **kwargs)

    monkeypatch.setattr(df_integration, "run_sdpa", capture)
    calls = {}
    transform = qk.transform_module_qk

    def capture_in(module, query, key, *args, **kwargs):
        calls.setdefault("in", (query, key))
        return transform(module, query, key, *args, **kwargs)

    monkeypatch.setattr(qk, "transform_module_qk", capture_in)
    with torch.no_grad():
        moved4 = model(**inputs).sample.float()
    q_in, k_in = calls["in"]
    q_expected, k_expected = transform_qk(q_in, k_in, rotate=True, k_shift=shift)
    assert torch.equal(got["qk"][0], q_expected.transpose(1, 2))
    assert torch.equal(got["qk"][1], k_expected.transpose(1, 2))
    monkeypatch.setattr(df_integration, "run_sdpa", run)
    monkeypatch.setattr(qk, "transform_module_qk", transform)

    with torch.no_grad():
        plain4 = attn_qat.prepare(copy.deepcopy(base))(**inputs).sample.float()
        plain16 = attn_qat.prepare(copy.deepcopy(base), QATConfig(mode="bf16"))(**inputs).sample.float()
        moved16_model = attn_qat.prepare(copy.deepcopy(base), QATConfig(mode="bf16", rotate_qk=True, shift_k=True))
        attn_qat.calibrate_k_shift(moved16_model, [inputs])
        moved16 = moved16_model(**inputs).sample.float()
    assert (moved16 - plain16).norm() / plain16.norm() < 1e-2
    assert not torch.equal(moved4, plain4)


# ---- the Q/K balance (QATConfig(balance_qk=alpha))

def test_balance_keeps_the_softmax_exactly():
    """q_c s_c times k_c / s_c is q_c k_c: with the shift and the rotation too, the float64 output does not move."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 37, 64, generator=g, dtype=torch.float64)  # 4 query heads on 2 KV heads
    k, v = (torch.randn(2, 2, 37, 64, generator=g, dtype=torch.float64) for _ in range(2))
    shift = torch.randn(2, 1, 64, generator=g, dtype=torch.float64)
    s = torch.rand(2, 64, generator=g, dtype=torch.float64) * 8 + 0.01
    q2, k2 = transform_qk(q, k, rotate=True, k_shift=shift,
                          balance=(s.repeat_interleave(2, 0)[:, None, :], s[:, None, :]))
    assert not torch.allclose(q2, q @ qk_rotation(64).double())
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    exact = torch.softmax(q @ kk.transpose(-1, -2), -1) @ vv
    moved = torch.softmax(q2 @ k2.repeat_interleave(2, 1).transpose(-1, -2), -1) @ vv
    assert torch.allclose(moved, exact, atol=1e-10, rtol=0)


def test_balance_calibration_is_the_ratio_of_the_largest_values(monkeypatch):
    """s = (max|k| / max|q|)^alpha per (KV head, channel), the query heads of a KV head together, over every
    calibration call; and the module's call transforms with that s."""
    model = attn_qat.prepare(tiny_qwen3(), ALL)
    recorded = {}
    original = qk.record_qk

    def spy(calibration, query, key, heads_axis):
        recorded.setdefault(id(calibration), []).append((query.double(), key.double()))
        original(calibration, query, key, heads_axis)

    monkeypatch.setattr(qk, "record_qk", spy)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu", 3))
    calls = next(iter(recorded.values()))  # layer 0
    q_max = torch.stack([q.abs().amax(dim=(0, 2)) for q, _ in calls]).amax(0).view(2, 2, 64).amax(1)
    k_max = torch.stack([k.abs().amax(dim=(0, 2)) for _, k in calls]).amax(0)
    module = model.model.layers[0].self_attn
    s = getattr(module, qk.QK_BALANCE_BUFFER)
    assert s.dtype == torch.float32 and s.shape == (2, 64)
    assert torch.allclose(s.double(), (k_max / q_max) ** 0.5, rtol=1e-6)
    assert torch.allclose(getattr(module, qk.K_SHIFT_BUFFER).double(),
                          torch.cat([k.transpose(1, 2).reshape(-1, 2, 64) for _, k in calls]).mean(0), atol=1e-6)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 33, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 33, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    out, _ = tf_integration.attn_qat_attention_forward(module, q, k, v, None, scaling=0.125)
    shift = getattr(module, qk.K_SHIFT_BUFFER)
    qt, kt = transform_qk(q, k, rotate=True, k_shift=shift[:, None, :],
                          balance=(s.repeat_interleave(2, 0)[:, None, :], s[:, None, :]))
    expected = attn_qat.scaled_dot_product_attention(qt, kt, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert torch.equal(out, expected.transpose(1, 2))


def test_balance_scales_of_empty_channels_are_one():
    stats = qk.QKStats(k_max=torch.tensor([[4.0, 0.0, 1.0, float("inf")]], dtype=torch.float64),
                       q_max=torch.tensor([[1.0, 3.0, 0.0, 1.0]], dtype=torch.float64))
    assert torch.equal(qk.balance_scales(stats, 0.5), torch.tensor([[2.0, 1.0, 1.0, 1.0]]))


def test_balance_buffer_checkpoint_and_errors():
    base = tiny_qwen3()
    ids = torch.randint(0, VOCAB, (1, 20))
    with pytest.raises(RuntimeError, match="Q/K balance"):
        prepared(base, QATConfig(balance_qk=0.5), calibrate=False)(ids)
    model = prepared(base, ALL)
    state = model.state_dict()
    assert f"model.layers.1.self_attn.{qk.QK_BALANCE_BUFFER}" in state
    fresh = prepared(base, ALL, calibrate=False)
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
        bf16 = prepared(base, QATConfig(mode="bf16"))(ids).logits.float()
        balanced16 = prepared(base, QATConfig(mode="bf16", balance_qk=0.5))(ids).logits.float()
        assert (balanced16 - bf16).abs().max() < 2e-2  # bf16 rounding of the transformed operands only
        assert not torch.equal(model(ids).logits, prepared(base, BOTH)(ids).logits)


@pytest.mark.parametrize("device", DEVICES)
def test_wan_balance(device):
    """The Wan processor calibrates and applies the Q/K balance: one scale per (head, channel), bf16 mode stays put."""
    base, inputs = tiny_wan_and_inputs(device)
    model = attn_qat.prepare(copy.deepcopy(base), ALL)
    attn_qat.calibrate_k_shift(model, [inputs])
    s = getattr(model.blocks[0].attn1, qk.QK_BALANCE_BUFFER)
    assert s.shape == (2, 64) and bool(s.isfinite().all()) and not torch.equal(s, torch.ones_like(s))
    bf16 = attn_qat.prepare(copy.deepcopy(base), QATConfig(mode="bf16", balance_qk=0.5))
    attn_qat.calibrate_k_shift(bf16, [inputs])
    with torch.no_grad():
        out = model(**inputs).sample.float()
        moved16 = bf16(**inputs).sample.float()
        plain16 = base(**inputs).sample.float()
    assert bool(out.isfinite().all()) and (moved16 - plain16).abs().max() < 5e-2
