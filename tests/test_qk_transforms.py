"""The score-preserving Q/K transforms (numerics.md §9: QATConfig rotate_qk and shift_k, attn_qat.calibrate_k_shift):
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
from conftest import DEVICES

transformers = pytest.importorskip("transformers")
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from attn_qat.integrations import transformers as tf_integration  # noqa: E402

VOCAB = 128
BOTH = QATConfig(rotate_qk=True, shift_k=True, strict=True)


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
    if calibrate and config.shift_k:
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
    shift = getattr(module, tf_integration.K_SHIFT_BUFFER)
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
    key = f"model.layers.1.self_attn.{tf_integration.K_SHIFT_BUFFER}"
    assert key in state
    fresh = prepared(base, calibrate=False)
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="shift_k=True"):
        attn_qat.calibrate_k_shift(prepared(base, QATConfig(rotate_qk=True)), calibration_batches(device))


def test_calibration_is_the_mean_of_the_keys():
    base = tiny_qwen3()
    model = attn_qat.prepare(copy.deepcopy(base), BOTH)
    recorded = {}  # calibration record -> the keys given to its module, in call order
    original = tf_integration._record_keys

    def spy(calibration, key):
        recorded.setdefault(id(calibration), []).append(key.double())
        original(calibration, key)

    tf_integration._record_keys = spy
    try:
        attn_qat.calibrate_k_shift(model, calibration_batches("cpu", 3))
    finally:
        tf_integration._record_keys = original
    first_layer = next(iter(recorded.values()))  # layer 0 attends first
    assert len(recorded) == 2 and len(first_layer) == 3
    keys = torch.cat([k.transpose(1, 2).reshape(-1, 2, 64) for k in first_layer])
    shift = getattr(model.model.layers[0].self_attn, tf_integration.K_SHIFT_BUFFER)
    assert torch.allclose(shift.double(), keys.mean(0), atol=1e-6)
    assert all(s.calibration is None for s in attn_qat.integrations.attention_states(model).values())


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_cache_generation_matches_the_fake_quant_recompute(device):
    """The cache stores the transformed keys and transforms each step's query: greedy decoding through it equals
    recomputing every step with the fake-quant forward (bit-identical on the CPU, where both run one C kernel)."""
    model = attn_qat.convert(prepared(tiny_qwen3(device=device)))
    prompts = torch.randint(0, VOCAB, (2, 12), device=device)
    cache = attn_qat.NVFP4Cache(model.config, max_cache_len=24)
    with torch.no_grad():
        keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        cached = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8, pad_token_id=0, **{keyword: cache})
        ids = prompts
        for _ in range(8):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    if device == "cpu":
        assert torch.equal(cached, ids)
    else:  # the decode kernel sums in another order (numerics.md §7): most steps agree
        assert (cached == ids).float().mean() > 0.8


def test_integrations_without_the_transforms_refuse_them():
    with pytest.raises(NotImplementedError, match="transformers integration only"):
        attn_qat.patch_sdpa(QATConfig(rotate_qk=True))
    with pytest.raises(NotImplementedError, match="transformers integration only"):
        attn_qat.register_diffusers_backend(QATConfig(shift_k=True))
