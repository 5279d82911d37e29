"""The learned Q/K transforms (numerics.md §9, QATConfig(learn_qk_transforms=True)): they start at the fixed
transforms bit for bit, keep the scores for every value of their parameters, the rotation stays orthogonal, the
gradients of attn_qat's attention reach them, and training, `convert`, the NVFP4 cache and a checkpoint all run
the same transformed operands; clear errors where they cannot work."""
import copy
import json

import pytest
import torch

import attn_qat
from attn_qat import QATConfig
from attn_qat.transforms import learned_rotation, qk_rotation
from conftest import DEVICES, importorskip

importorskip("transformers")
from attn_qat.integrations import qk_transforms as qk  # noqa: E402
from attn_qat.integrations import transformers as tf_integration  # noqa: E402
from test_qk_transforms import (ALL, VOCAB, calibration_batches, greedy_through_cache_and_recomputed,  # noqa: E402
                                prepared, tiny_qwen3, tiny_wan_and_inputs)

LEARN = QATConfig(rotate_qk=True, shift_k=True, balance_qk=0.5, learn_qk_transforms=True, strict=True)
NO_SHIFT = QATConfig(rotate_qk=True, balance_qk=0.5, learn_qk_transforms=True, strict=True)


def learned(module) -> qk.LearnedQK:
    return getattr(module, qk.LEARNED_QK_MODULE)


def train_steps(model, steps=3, lr=0.05, seed=0):
    """A few Adam steps on the learned transforms alone (the model's weights frozen), the FP4 next-token loss."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = attn_qat.learned_qk_parameters(model, requires_grad=True)
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    device = next(iter(params.values())).device
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 40), generator=g).to(device)
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    return model


def test_learned_rotation_is_orthogonal_and_starts_at_the_hadamard():
    assert torch.equal(learned_rotation(torch.zeros(64, 64)), qk_rotation(64))
    g = torch.Generator().manual_seed(0)
    generator = torch.randn(64, 64, generator=g, dtype=torch.float64)
    r = learned_rotation(generator)
    assert r.dtype == torch.float64
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12, rtol=0)
    assert not torch.allclose(r, qk_rotation(64).double(), atol=0.1)
    # only the strictly lower triangle counts (A − Aᵀ)
    assert torch.equal(learned_rotation(generator.tril(-1)), r)
    with pytest.raises(ValueError, match="square"):
        learned_rotation(torch.zeros(4, 8))


def test_at_the_start_the_learned_transforms_are_the_fixed_ones():
    """Parameters at 0: the same logits as the fixed transforms with the same calibration, bit for bit."""
    base = tiny_qwen3()
    fixed = prepared(base, ALL)
    model = attn_qat.prepare(copy.deepcopy(base), LEARN)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    module = model.model.layers[0].self_attn
    assert learned(module).log_balance.shape == (2, 64) and learned(module).rotation_generator.shape == (64, 64)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in attn_qat.learned_qk_parameters(model).values())
    ids = torch.randint(0, VOCAB, (2, 45))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fixed(ids).logits)


@pytest.mark.parametrize("steps", [0, 3])
def test_scores_are_kept_in_float64(steps):
    """q'·k' = q·k (float64) with the module's learned balance and rotation, at the start and after optimiser
    steps; the rotation stays orthogonal, and the steps did move the parameters."""
    model = attn_qat.prepare(tiny_qwen3(), NO_SHIFT)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    train_steps(model, steps)
    module = model.model.layers[1].self_attn
    params = learned(module)
    if steps:
        assert params.log_balance.abs().max() > 1e-2 and params.rotation_generator.abs().max() > 1e-2
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 21, 64, generator=g, dtype=torch.float64) * 3
    k = torch.randn(2, 2, 21, 64, generator=g, dtype=torch.float64) * 3
    with torch.no_grad():
        q2, k2 = tf_integration.module_qk_transform(module, q, k)
    assert q2.dtype == torch.float64 and not torch.allclose(q2, q, atol=0.1)
    exact = q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    moved = q2 @ k2.repeat_interleave(2, 1).transpose(-1, -2)
    assert torch.allclose(moved, exact, atol=1e-9 * exact.abs().max(), rtol=0)
    r = params.rotation(torch.float64)
    assert torch.allclose(r @ r.T, torch.eye(64, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_reach_the_parameters_through_attn_qat(device):
    model = attn_qat.prepare(tiny_qwen3(device=device), LEARN)
    attn_qat.calibrate_k_shift(model, calibration_batches(device))
    model.train()
    ids = torch.randint(0, VOCAB, (2, 40), device=device)
    calls = []
    original = tf_integration.run_sdpa
    tf_integration.run_sdpa = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        tf_integration.run_sdpa = original
    assert len(calls) == 2  # both layers through attn_qat's FP4 attention
    params = attn_qat.learned_qk_parameters(model)
    assert len(params) == 4 and all(n.endswith(("log_balance", "rotation_generator")) for n in params)
    for name, p in params.items():
        assert p.grad is not None and bool(p.grad.isfinite().all()) and p.grad.abs().sum() > 0, name


def test_training_convert_and_the_cache_run_the_same_operands():
    """After training steps: the transformed operands of a training call (gradients on) equal those after
    `convert` (no gradients, the rotation cached), and greedy decoding through NVFP4Cache equals the fake-quant
    recompute, bit for bit on the CPU."""
    model = attn_qat.prepare(tiny_qwen3(), LEARN)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    train_steps(model)
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 17, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2, 17, 64, generator=g).to(torch.bfloat16)
    trained = tf_integration.module_qk_transform(module, q, k)
    assert trained[0].requires_grad  # the training call's graph reaches the parameters
    attn_qat.convert(model)
    with torch.no_grad():
        converted = tf_integration.module_qk_transform(module, q, k)
        again = tf_integration.module_qk_transform(module, q, k)  # the cached rotation
    assert all(torch.equal(a.detach(), b) for a, b in zip(trained, converted))
    assert all(torch.equal(a, b) for a, b in zip(converted, again))

    cached, ids = greedy_through_cache_and_recomputed(model, torch.randint(0, VOCAB, (2, 12)))
    assert torch.equal(cached, ids)


def test_the_rotation_follows_the_parameters_until_convert():
    """Without gradients the rotation is computed at every call, so parameter writes that leave no trace (a fused
    optimiser step, EMA weights copied through .data) are seen at once; a converted model keeps it, and loading a
    state dict, moving the module or preparing again drops what it kept."""
    model = attn_qat.prepare(tiny_qwen3(), NO_SHIFT)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    params = learned(model.model.layers[0].self_attn)
    generator = params.rotation_generator
    optimizer = torch.optim.AdamW([generator], lr=0.1, fused=True)
    with torch.no_grad():
        first = params.rotation(torch.float32)
    generator.grad = torch.ones_like(generator)
    optimizer.step()  # a fused step does not bump the parameter's version
    with torch.no_grad():
        stepped = params.rotation(torch.float32)
        assert not torch.equal(stepped, first)
        assert torch.equal(stepped, learned_rotation(generator.detach()))
        generator.data.copy_(generator.detach() + 0.01)  # EMA weights copied in
        assert torch.equal(params.rotation(torch.float32), learned_rotation(generator.detach()))
    attn_qat.convert(model)
    with torch.no_grad():
        kept = params.rotation(torch.float32)
        assert params.rotation(torch.float32) is kept and torch.equal(kept, learned_rotation(generator.detach()))
        state = {name: t + 0.01 for name, t in params.state_dict().items()}
    params.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(params.rotation(torch.float32), learned_rotation(generator.detach()))
    params.double()
    with torch.no_grad():
        assert params.rotation(torch.float32).dtype == torch.float64
    params.float()
    attn_qat.prepare(model, NO_SHIFT)  # trains again: computed at every call
    assert not params.frozen
    # computed under inference mode, then a training step with the rotation frozen (a backward saves it)
    generator.requires_grad_(False)
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.inference_mode():
        model(ids)
    model(ids, labels=ids).loss.backward()
    assert params.log_balance.grad is not None


def test_state_dict_round_trip():
    base = tiny_qwen3()
    model = attn_qat.prepare(copy.deepcopy(base), LEARN)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    train_steps(model)
    state = model.state_dict()
    prefix = f"model.layers.1.self_attn.{qk.LEARNED_QK_MODULE}."
    assert prefix + "log_balance" in state and prefix + "rotation_generator" in state
    fresh = attn_qat.prepare(copy.deepcopy(base), LEARN)  # NaN buffers, zero parameters until loaded
    fresh.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, 33))
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(fresh(ids).logits, expected)
        fixed = attn_qat.prepare(copy.deepcopy(base), ALL)
        with pytest.raises(RuntimeError, match="Unexpected key"):
            fixed.load_state_dict(state)
        fixed.load_state_dict(state, strict=False)  # the fixed transforms: other numbers than the trained model's
        assert not torch.equal(fixed(ids).logits, expected)


def test_prepare_again_keeps_or_drops_the_parameters():
    model = attn_qat.prepare(tiny_qwen3(), LEARN)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    train_steps(model, 1)
    params = learned(model.model.layers[0].self_attn)
    attn_qat.prepare(model, LEARN)
    assert learned(model.model.layers[0].self_attn) is params  # what it learned stays
    attn_qat.prepare(model, QATConfig(rotate_qk=True, learn_qk_transforms=True))  # no balance to learn: new ones
    assert learned(model.model.layers[0].self_attn).log_balance is None
    attn_qat.prepare(model, ALL)
    assert not hasattr(model.model.layers[0].self_attn, qk.LEARNED_QK_MODULE)
    with pytest.raises(ValueError, match="no learned Q/K transform"):
        attn_qat.learned_qk_parameters(model)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="rotate_qk=True and/or balance_qk"):
        QATConfig(learn_qk_transforms=True)
    with pytest.raises(ValueError, match="rotate_qk=True and/or balance_qk"):
        QATConfig(shift_k=True, learn_qk_transforms=True)
    with pytest.raises(TypeError, match="learn_qk_transforms must be True or False"):
        QATConfig(rotate_qk=True, learn_qk_transforms="true")
    with pytest.raises(NotImplementedError, match="attn_qat.prepare"):
        attn_qat.patch_sdpa(QATConfig(rotate_qk=True, learn_qk_transforms=True))
    with pytest.raises(ValueError, match="learn_qk_transforms needs attn_qat.prepare"):  # no module to learn in
        attn_qat.register_transformers(QATConfig(rotate_qk=True, learn_qk_transforms=True))
    model = attn_qat.prepare(tiny_qwen3(), LEARN)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    module = model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 8, 64), torch.randn(1, 2, 8, 64)
    with pytest.raises(ValueError, match="does not fit its keys"):
        tf_integration.module_qk_transform(module, torch.randn(1, 4, 8, 128), torch.randn(1, 2, 8, 128))
    delattr(module, qk.LEARNED_QK_MODULE)
    with pytest.raises(RuntimeError, match="no learned Q/K transform"):
        tf_integration.module_qk_transform(module, q, k)
    module.attn_qat_learned_qk = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="not attn_qat's learned Q/K transform"):
        attn_qat.prepare(model, LEARN)
    with pytest.raises(ValueError, match="no learned Q/K transform"):
        attn_qat.learned_qk_parameters(attn_qat.prepare(tiny_qwen3(), ALL))


def test_a_module_kept_in_bf16_learns_nothing():
    """A module the plan keeps in bf16 has no learned transform, also where a checkpoint's plan is adopted."""
    base = tiny_qwen3()
    config = QATConfig(rotate_qk=True, balance_qk=0.5, learn_qk_transforms=True,
                       bf16_modules=("model.layers.1.self_attn",))
    model = attn_qat.prepare(copy.deepcopy(base), config)
    attn_qat.calibrate_k_shift(model, calibration_batches("cpu"))
    assert hasattr(model.model.layers[0].self_attn, qk.LEARNED_QK_MODULE)
    assert not hasattr(model.model.layers[1].self_attn, qk.LEARNED_QK_MODULE)
    adopted = attn_qat.prepare(copy.deepcopy(base), QATConfig(rotate_qk=True, balance_qk=0.5,
                                                              learn_qk_transforms=True))
    adopted.load_state_dict(model.state_dict())  # strict: the kept module's parameters go with its transforms
    assert not hasattr(adopted.model.layers[1].self_attn, qk.LEARNED_QK_MODULE)
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert torch.equal(adopted(ids).logits, model(ids).logits)


def test_peft_keeps_them_trainable():
    """prepare on a PeftModel leaves the new parameters trainable; a PeftModel made from a prepared model froze
    them, and learned_qk_parameters(requires_grad=True) trains them again."""
    peft = importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    wrapped = attn_qat.prepare(peft.get_peft_model(tiny_qwen3(), lora), LEARN)
    attn_qat.calibrate_k_shift(wrapped, calibration_batches("cpu"))
    names = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    learned_names = set(attn_qat.learned_qk_parameters(wrapped))
    assert learned_names and learned_names <= names and all(n.startswith("base_model.model.") for n in learned_names)

    late = peft.get_peft_model(attn_qat.prepare(tiny_qwen3(), LEARN), lora)
    attn_qat.calibrate_k_shift(late, calibration_batches("cpu"))
    params = attn_qat.learned_qk_parameters(late)
    assert not any(p.requires_grad for p in params.values())
    attn_qat.learned_qk_parameters(late, requires_grad=True)
    ids = torch.randint(0, VOCAB, (2, 30))
    late(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())


def test_wan_learns_them_too():
    base, inputs = tiny_wan_and_inputs("cpu")
    model = attn_qat.prepare(copy.deepcopy(base), LEARN)
    attn_qat.calibrate_k_shift(model, [inputs])
    fixed = attn_qat.prepare(copy.deepcopy(base), ALL)
    attn_qat.calibrate_k_shift(fixed, [inputs])
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, fixed(**inputs).sample)  # the start is the fixed transforms
    params = attn_qat.learned_qk_parameters(model)
    assert len(params) == 4  # the two blocks' self-attention; cross-attention not selected
    model(**inputs).sample.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values())


# ---- examples/finetune_lm.py --learn-qk (the fair test's switch)

def test_finetune_lm_learn_qk_options():
    from test_finetune import load_example
    lm = load_example("finetune_lm")
    common = load_example("finetune_common")
    args = lm.parse_args(["--device", "cpu", "--balance-qk", "0.3", "--learn-qk", "--learn-qk-lr", "0.01"])
    assert args.learn_qk and args.learn_qk_lr == 0.01
    config = common.qat_config("attn_qat_qk", args.balance_qk, args.learn_qk)
    assert config.learn_qk_transforms and config.balance_qk == 0.3 and config.rotate_qk
    assert not common.qat_config("attn_qat", args.balance_qk, args.learn_qk).learn_qk_transforms
    for bad in (["--learn-qk-lr", "0.01"], ["--learn-qk", "--learn-qk-lr", "0"]):
        with pytest.raises(SystemExit):
            lm.parse_args(["--device", "cpu", *bad])
    # the learned transforms' own peak learning rate: a second AdamW group, scheduled alike
    model = attn_qat.prepare(tiny_qwen3(), LEARN)
    own = list(attn_qat.learned_qk_parameters(model).values())
    optimizer = common.MasterWeightAdamW(model.parameters(), lr=1e-4, own_lr=(own, 0.01))
    groups = optimizer.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-4, 0.01] and len(groups[1]["params"]) == len(own) == 4
    assert sum(p.numel() for g in groups for p in g["params"]) == sum(p.numel() for p in model.parameters())


def test_finetune_lm_smoke_learns_them(tmp_path):
    importorskip("scipy")
    importorskip("accelerate")
    from test_finetune import run_script, sha256, write_tiny_llama_gguf
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path)
    out = tmp_path / "lm"
    run_script(["examples/finetune_lm.py", "--preset", "smoke", "--device", "cpu", "--gguf", str(path),
                "--gguf-sha256", sha256(path), "--out", str(out), "--arms", "bf16,attn_qat_qk", "--balance-qk", "0.3",
                "--learn-qk", "--learn-qk-lr", "0.01"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["learn_qk"] is True and summary["config"]["learn_qk_lr"] == 0.01
    assert "recovered" in summary["entries"]["attn_qat_qk"]
