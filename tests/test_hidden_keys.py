"""A key a query cannot see never changes that query's output (issue "a key a query cannot see never changes
its output"). V blocked along 16 consecutive tokens mixes, under causal attention or a mask, keys a query sees
with keys it cannot: the hidden keys' values set the block's E4M3 scale and leak into the visible outputs. So V is
blocked along head_dim whenever some query does not see every key (causal, either alignment; any attn_mask),
along tokens only when every query sees every key (`v_block_axis="auto"`, the default).

Each case changes only hidden keys' K and V (times 8, NaN, +Inf) and asserts:
- the outputs of every query row that sees none of the changed keys are bit-identical (training forward and
  the no-grad forward);
- dQ of those rows is bit-identical (dQ_i = scale * sum_j P_ij (dO_i . v_j - dO_i . O'_i) k_j reads row i's
  visible keys only);
- dK and dV of the unchanged keys, where the math allows: with x8 poisoning, dO is set to zero on every row that
  sees a changed key, so those rows contribute exact zeros (dS_ij = P_ij (0 - 0), dV_j += P^F_ij * 0) and every
  unchanged key's dK, dV must be bit-identical. With NaN/Inf the rows that see a changed key legitimately carry
  NaN (O' and D_i = dO_i . O'_i are NaN even where dO_i is 0), and through those rows NaN reaches every key
  they see; so only keys seen by no such row are compared (none under plain causal attention, the other
  sequences' keys for padding and packed sequences).

On CUDA a call whose hidden terms hold NaN/Inf may be redone by the mma.sync kernels (numerics.md §8), which sum
in another order than the Hopper kernels; the NaN/Inf cases therefore run both the clean and the poisoned call
on the mma.sync kernels (kernel_options(sm90=False)). Gradients are taken under
torch.use_deterministic_algorithms (the default Hopper dQ is summed with atomics).
"""
import contextlib
import math

import pytest
import torch

import attn_qat
from attn_qat import reference
from conftest import importorskip, rel_error
from test_attention import FWD_TOL, deterministic_algorithms, forward_error
HOWS = ["x8", "nan", "inf"]
MASKED_BELOW = -1e30  # numerics.md §8: additive mask values at or below this count as -inf


def axis_kwargs(v_block_axis):
    """The v_block_axis keyword, passed only when it is not the default, so that on a tree that predates the
    keyword the default calls run (and show the leak) rather than raise TypeError."""
    return {} if v_block_axis == "auto" else {"v_block_axis": v_block_axis}


def make_inputs(b, hq, hkv, nq, nk, d, dtype, seed):
    """q (B, Hq, Nq, D), k, v (B, Hkv, Nk, D), dout like q; on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk), (hq, nq)))


def visibility(b, hq, nq, nk, *, causal=None, mask=None):
    """Which keys each query sees, (B, Hq, Nq, Nk) bool, as numerics.md §6 and §8 define it."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)
    visible = {None: torch.ones(nq, nk, dtype=torch.bool), "top_left": j <= i,
               "bottom_right": j <= i + nk - nq}[causal]
    if mask is not None:
        mask = mask.cpu()
        visible = visible & (mask if mask.dtype == torch.bool else mask.float() > MASKED_BELOW)
    return visible.expand(b, hq, nq, nk)


def reference_mask(mask):
    """An SDPA mask as the reference takes it: additive values <= -1e30 as -inf (the entry points convert them)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    mask = mask.cpu().double()
    return mask.masked_fill(mask <= MASKED_BELOW, -math.inf)


def poison(t, keys, how):
    """t (B, Hkv, Nk, D) with the rows of `keys` (B, Hkv, Nk) bool multiplied by 8 or replaced by NaN or +Inf."""
    sel = keys[..., None].to(t.device)
    bad = {"x8": t * 8, "nan": torch.full_like(t, math.nan), "inf": torch.full_like(t, math.inf)}[how]
    return torch.where(sel, bad, t)


def straddles(keys):
    """Whether some 16-token block of some KV head mixes changed and unchanged keys: only then does blocking V
    along tokens leak, so only then does a case test the change."""
    nk = keys.shape[-1]
    padded = torch.nn.functional.pad(keys, (0, -nk % 16)).view(*keys.shape[:-1], -1, 16)
    valid = torch.nn.functional.pad(torch.ones(nk, dtype=torch.bool), (0, -nk % 16)).view(-1, 16)
    return bool(((padded & valid).any(-1) & (~padded & valid).any(-1)).any())


def forward_backward(call, q, k, v, dout, device):
    """(out, no-grad out, dq, dk, dv) of call(q, k, v) on `device`, returned on the CPU."""
    qg, kg, vg = (t.detach().to(device).clone().requires_grad_() for t in (q, k, v))
    with deterministic_algorithms():
        out = call(qg, kg, vg)
        out.backward(dout.to(device))
        with torch.no_grad():
            inference = call(*(t.detach() for t in (qg, kg, vg)))
    return tuple(t.detach().cpu() for t in (out, inference, qg.grad, kg.grad, vg.grad))


def check_hidden_keys(kernel_options, device, call, q, k, v, dout, changed, how, *, causal=None, mask=None):
    """Runs call(q, k, v) (causal / mask describe what it hides) on clean inputs and on inputs whose `changed`
    keys (B, Hkv, Nk) bool are poisoned with `how`, and compares what must not move (module docstring)."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    visible = visibility(b, hq, nq, nk, causal=causal, mask=mask)
    changed_q = changed.repeat_interleave(group, dim=1)[:, :, None, :]  # (B, Hq, 1, Nk)
    dirty_rows = (visible & changed_q).any(-1)  # rows that see a changed key: (B, Hq, Nq)
    clean_rows = ~dirty_rows
    assert clean_rows.any() and straddles(changed), "the case tests nothing"
    if how == "x8":
        dout = torch.where(dirty_rows[..., None], torch.zeros_like(dout), dout)
        checked_keys = ~changed
    else:
        seen_by_dirty = (visible & dirty_rows[..., None]).any(2).view(b, hkv, group, nk).any(2)
        checked_keys = ~changed & ~seen_by_dirty
    if how != "x8" and device == "cuda":
        kernel_options(sm90=False)  # both calls on the mma.sync kernels (module docstring)

    clean = forward_backward(call, q, k, v, dout, device)
    dirty = forward_backward(call, q, poison(k, changed, how), poison(v, changed, how), dout, device)

    # the clean call is the reference's (whatever axis "auto" picks there)
    ref = reference.attention(q, k, v, attn_mask=reference_mask(mask), causal=causal)
    assert forward_error(clean[0], ref)[0] <= FWD_TOL, "the clean call does not match the reference"
    if dirty_rows.any():
        assert not torch.equal(clean[0][dirty_rows], dirty[0][dirty_rows]), "the poison reached no output"
    for name, index, a, z in (("out", clean_rows, clean[0], dirty[0]), ("no-grad out", clean_rows, clean[1], dirty[1]),
                              ("dq", clean_rows, clean[2], dirty[2]), ("dk", checked_keys, clean[3], dirty[3]),
                              ("dv", checked_keys, clean[4], dirty[4])):
        a, z = a[index], z[index]
        if not torch.equal(a, z):
            moved = (a != z).any(-1)
            pytest.fail(f"{name}: {int(moved.sum())} of {len(a)} rows that cannot see a changed key moved "
                        f"(changed keys x {how}; largest difference {float((a.double() - z.double()).abs().max())})")


# ----------------------------------------------------------------------------------------------------------------
# Causal attention, both entry points
# ----------------------------------------------------------------------------------------------------------------

# (id, dtype, head_dim, heads_q, heads_kv, n_q, n_k, cut): keys >= cut are changed
TOP_LEFT = [
    ("bf16-d64-gqa", torch.bfloat16, 64, 4, 2, 80, 80, 37),
    ("fp16-d128-nq<nk", torch.float16, 128, 2, 2, 60, 90, 37),
]
BOTTOM_RIGHT = [
    ("bf16-d128-mqa-nq<nk", torch.bfloat16, 128, 4, 1, 50, 90, 75),  # rows 0..34 clean
    ("fp16-d64-nq>nk", torch.float16, 64, 2, 2, 70, 45, 30),  # rows 0..24 empty, 25..54 clean
    ("bf16-d64-gqa-decode4", torch.bfloat16, 64, 4, 2, 4, 100, 97),  # row 0 clean; trailing partial V block
]


# Each causal alignment through the entry point that takes it: SDPA top-left, attention() bottom-right.
CAUSAL_CASES = [("top_left", 2, c) for c in TOP_LEFT] + [("bottom_right", 1, c) for c in BOTTOM_RIGHT]
CAUSAL_CALLS = {
    "top_left": lambda q, k, v: attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    "bottom_right": lambda q, k, v: attn_qat.attention(q, k, v, causal=True, layout="bhsd"),
}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("alignment, batch, case", CAUSAL_CASES, ids=[f"{a}-{c[0]}" for a, _, c in CAUSAL_CASES])
def test_causal(kernel_options, device, alignment, batch, case, how):
    _, dtype, d, hq, hkv, nq, nk, cut = case
    seed = nq + d if alignment == "top_left" else nk + d
    q, k, v, dout = make_inputs(batch, hq, hkv, nq, nk, d, dtype, seed=seed)
    changed = (torch.arange(nk) >= cut).expand(batch, hkv, nk)
    check_hidden_keys(kernel_options, device, CAUSAL_CALLS[alignment], q, k, v, dout, changed, how, causal=alignment)


# ----------------------------------------------------------------------------------------------------------------
# Masks: boolean, additive float, padding, packed sequences
# ----------------------------------------------------------------------------------------------------------------

CHANGED_KEYS = [19, 20, 45, 70, 71, 72]  # inside V token blocks 16..31, 32..47 and 64..79


def masked_case(kind, seed):
    """A random mask (B, 1, 64, 96) hiding CHANGED_KEYS from every third row (the rows checked); the other rows
    see them at random. Bool or additive float (bf16: random biases, -inf and finfo.min for the hidden keys)."""
    b, nq, nk = 2, 64, 96
    g = torch.Generator().manual_seed(seed)
    visible = torch.rand(b, 1, nq, nk, generator=g) > 0.25
    hidden_rows = torch.arange(nq) % 3 == 0
    cols = torch.tensor(CHANGED_KEYS)
    visible[:, :, hidden_rows[:, None] & torch.isin(torch.arange(nk), cols)] = False
    if kind == "bool":
        return visible
    bias = torch.randn(b, 1, nq, nk, generator=g) * 2
    lowest = torch.full_like(bias, torch.finfo(torch.bfloat16).min)
    hidden = torch.where(torch.arange(nk) % 2 == 0, lowest, torch.full_like(bias, -math.inf))
    return torch.where(visible, bias, hidden).to(torch.bfloat16)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask(kernel_options, device, kind, how):
    dtype, d = (torch.float16, 128) if kind == "bool" else (torch.bfloat16, 64)
    q, k, v, dout = make_inputs(2, 4, 2, 64, 96, d, dtype, seed=7 + d)
    mask = masked_case(kind, seed=11)
    changed = torch.isin(torch.arange(96), torch.tensor(CHANGED_KEYS)).expand(2, 2, 96)

    def call(q, k, v):
        return attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), enable_gqa=True)

    check_hidden_keys(kernel_options, device, call, q, k, v, dout, changed, how, mask=mask)


PAD_LENGTHS = [72, 53, 21]  # real tokens per sample of 72


def padding_case(side, causal):
    """transformers' padding mask (B, 1, N, N): causal & key is real, or the key padding mask (B, 1, 1, N) of an
    encoder; and the pad keys (B, N)."""
    n = 72
    pos = torch.arange(n)
    lengths = torch.tensor(PAD_LENGTHS)[:, None]
    real = pos < lengths if side == "right" else pos >= n - lengths
    mask = real[:, None, None, :]
    if causal:
        mask = mask & (pos[None, :] <= pos[:, None])
    return mask, ~real


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("side,causal", [("right", True), ("left", True), ("right", False)],
                         ids=["right-causal", "left-causal", "right-keymask"])
def test_padding_sdpa(kernel_options, device, side, causal, how):
    q, k, v, dout = make_inputs(3, 4, 2, 72, 72, 64, torch.bfloat16, seed=21)
    mask, pads = padding_case(side, causal)

    def call(q, k, v):
        return attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), enable_gqa=True)

    check_hidden_keys(kernel_options, device, call, q, k, v, dout, pads[:, None].expand(3, 2, 72), how, mask=mask)


SEGMENTS = [0, 21, 50, 77, 96]  # packed sequences; boundaries not multiples of 16


def packed_mask(causal):
    segment = torch.bucketize(torch.arange(SEGMENTS[-1]), torch.tensor(SEGMENTS[1:]), right=True)
    mask = segment[:, None] == segment[None, :]
    if causal:
        mask = mask & mask.tril()
    return mask[None, None], segment


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_sequences(kernel_options, device, causal, how):
    n = SEGMENTS[-1]
    q, k, v, dout = make_inputs(1, 4, 2, n, n, 128, torch.float16, seed=31)
    mask, segment = packed_mask(causal)
    changed = (segment == 1).expand(1, 2, n)  # the second sequence, tokens 21..49

    def call(q, k, v):
        return attn_qat.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), enable_gqa=True)

    check_hidden_keys(kernel_options, device, call, q, k, v, dout, changed, how, mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# transformers: a tiny Qwen3 with attn_implementation="attn_qat", pad tokens changed
# ----------------------------------------------------------------------------------------------------------------

VOCAB = 128


def tiny_qwen3(device, config=None, seed=0):
    """A fresh random 2-layer Qwen3 (4 query heads, 2 KV heads, head_dim 64) in bfloat16, prepared with attn_qat
    (attn_implementation "attn_qat"), as in tests/test_integrations_transformers.py."""
    transformers = importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=256,
                                   attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    model = attn_qat.prepare(model, config)
    assert model.config._attn_implementation == "attn_qat"
    return model


def padded_batch(device, side):
    """Token ids (3, 45) and their 2-D attention mask; pads 0, 9 and 30 tokens (V blocks straddle the pads)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (3, 45), generator=g)
    mask = torch.ones(3, 45, dtype=torch.long)
    for row, pad in enumerate([0, 9, 30]):
        if pad:
            if side == "right":
                mask[row, -pad:] = 0
            else:
                mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def other_pad_ids(ids, mask):
    """The same batch with other token ids at the pad positions."""
    return torch.where(mask.bool(), ids, (ids * 7 + 13) % VOCAB)


@contextlib.contextmanager
def nan_pad_embeddings(model, mask):
    """Pad positions' embeddings replaced by NaN: every layer's pad K and V (and Q) are NaN."""
    handle = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: out.masked_fill(~mask.bool()[..., None], math.nan))
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("poison_with", ["ids", "nan"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_transformers_padding_forward(kernel_options, device, side, poison_with):
    model = tiny_qwen3(device)
    ids, mask = padded_batch(device, side)
    real = mask.bool()
    if poison_with == "nan" and device == "cuda":
        kernel_options(sm90=False)
    with torch.no_grad():
        clean = model(ids, attention_mask=mask).logits
        if poison_with == "ids":
            dirty = model(other_pad_ids(ids, mask), attention_mask=mask).logits
        else:
            with nan_pad_embeddings(model, mask):
                dirty = model(ids, attention_mask=mask).logits
    assert not torch.equal(clean[~real], dirty[~real]), "the pads did not change"
    moved = (clean[real] != dirty[real]).any(-1)
    assert not moved.any(), f"{int(moved.sum())} of {int(real.sum())} real tokens' logits moved with the pads"


@pytest.mark.parametrize("side", ["right", "left"])
def test_transformers_padding_backward(device, side):
    """The training forward and backward: logits and input-embedding gradients of the real tokens do not depend on
    the pad tokens' ids. The loss reads real tokens only, so every pad position's gradient is exactly 0 through
    every layer and contributes exact zeros to the real keys' dK and dV."""
    model = tiny_qwen3(device, seed=1)
    ids, mask = padded_batch(device, side)
    real = mask.bool()
    weights = torch.randn(int(real.sum()), VOCAB, generator=torch.Generator().manual_seed(3)).to(device)
    results = []
    for batch_ids in (ids, other_pad_ids(ids, mask)):
        embeds = model.model.embed_tokens(batch_ids).detach().requires_grad_()
        with deterministic_algorithms():
            logits = model(inputs_embeds=embeds, attention_mask=mask).logits
            (logits[real].float() * weights).sum().backward()
        results.append((logits.detach()[real], embeds.grad[real]))
    (clean_logits, clean_grad), (dirty_logits, dirty_grad) = results
    assert torch.equal(clean_logits, dirty_logits), "real tokens' logits moved with the pads"
    assert torch.equal(clean_grad, dirty_grad), "real tokens' gradients moved with the pads"


def test_transformers_config_v_block_axis(device):
    """QATConfig(v_block_axis=...) reaches the attention: "tokens" brings the leak back under right padding,
    "head_dim" (and the default) does not."""
    ids, mask = padded_batch(device, "right")
    real = mask.bool()
    moved = {}
    for axis in ("tokens", "head_dim", "auto"):
        model = tiny_qwen3(device, attn_qat.QATConfig(**axis_kwargs(axis)), seed=2)
        with torch.no_grad():
            clean = model(ids, attention_mask=mask).logits[real]
            dirty = model(other_pad_ids(ids, mask), attention_mask=mask).logits[real]
        moved[axis] = not torch.equal(clean, dirty)
    assert moved == {"tokens": True, "head_dim": False, "auto": False}


# ----------------------------------------------------------------------------------------------------------------
# v_block_axis: "tokens" when every query sees every key, and explicitly
# ----------------------------------------------------------------------------------------------------------------

def test_unmasked_default_blocks_v_along_tokens(device):
    """Without causal or mask every query sees every key: V stays blocked along tokens (the hardware FP4 P.V
    axis). The default call matches the reference with v_block_axis="tokens" at numerics.md §7's tolerance and
    is far from the one with "head_dim"; the reference's "auto" is "tokens" here, bit for bit."""
    q, k, v, _ = make_inputs(1, 2, 2, 40, 70, 64, torch.bfloat16, seed=41)  # 70 keys: a trailing partial block
    along_tokens = reference.fake_quantize(v, -2, partial_last_block=True)
    along_head_dim = reference.fake_quantize(v, -1)
    assert (along_tokens != along_head_dim).double().mean() > 0.2, "the two blockings barely differ"
    ref = {axis: reference.attention_forward(q, k, v, **axis_kwargs(axis))["out"] for axis in ("tokens", "head_dim")}
    assert torch.equal(reference.attention_forward(q, k, v)["out"], ref["tokens"])
    distance = rel_error(ref["head_dim"], ref["tokens"])
    assert distance > 10 * FWD_TOL, f"the axes' outputs differ by only {distance}"
    qd, kd, vd = (t.to(device) for t in (q, k, v))
    outs = {"sdpa": attn_qat.scaled_dot_product_attention(qd, kd, vd),
            "attention": attn_qat.attention(qd, kd, vd, layout="bhsd"),
            "sdpa tokens": attn_qat.scaled_dot_product_attention(qd, kd, vd, v_block_axis="tokens")}
    for name, out in outs.items():
        assert forward_error(out, ref["tokens"])[0] <= FWD_TOL, name
        assert rel_error(out, ref["head_dim"]) > 5 * FWD_TOL, f"{name} looks blocked along head_dim"
    head_dim = attn_qat.scaled_dot_product_attention(qd, kd, vd, v_block_axis="head_dim")
    assert forward_error(head_dim, ref["head_dim"])[0] <= FWD_TOL
    assert rel_error(head_dim, ref["tokens"]) > 5 * FWD_TOL


@pytest.mark.parametrize("axis", ["tokens", "head_dim", "auto"])
@pytest.mark.parametrize("api", ["sdpa", "attention", "reference"])
def test_tokens_axis_under_causal_brings_the_leak_back(device, axis, api):
    """Causal, V row 20 scaled by 8: along tokens its block 16..31 gets another scale and rows 16..19, which
    cannot see key 20, move (numerics.md §8's known leak); along head_dim (and "auto", which picks it under
    causal) nothing a row can see changes, and rows 0..19 stay bit-identical."""
    if api == "reference" and device != "cpu":
        pytest.skip("the reference runs on the CPU")
    q, k, v, _ = make_inputs(1, 2, 2, 48, 48, 64, torch.bfloat16, seed=51)
    v8 = v.clone()
    v8[:, :, 20] *= 8
    kwargs = axis_kwargs(axis)

    def call(v):
        q_, k_, v_ = (t.to(device) for t in (q, k, v))
        if api == "sdpa":
            return attn_qat.scaled_dot_product_attention(q_, k_, v_, is_causal=True, **kwargs)
        if api == "attention":  # Nq == Nk: bottom-right is top-left
            return attn_qat.attention(q_, k_, v_, causal=True, layout="bhsd", **kwargs)
        return reference.attention_forward(q_, k_, v_, causal="top_left", **kwargs)["out"]

    before, after = call(v).cpu(), call(v8).cpu()
    assert torch.equal(before[:, :, :16], after[:, :, :16])  # another V block: unaffected either way
    leaked = not torch.equal(before[:, :, 16:20], after[:, :, 16:20])
    assert leaked == (axis == "tokens"), f"v_block_axis={axis!r}: rows 16..19 {'moved' if leaked else 'did not move'}"


def test_reference_auto_picks_the_axis():
    """reference "auto": "head_dim" under causal (either alignment) or any mask, "tokens" otherwise."""
    q, k, v, dout = make_inputs(1, 2, 2, 30, 40, 64, torch.bfloat16, seed=61)
    mask = torch.rand(30, 40, generator=torch.Generator().manual_seed(62)) > 0.3
    for kwargs in (dict(causal="top_left"), dict(causal="bottom_right"), dict(attn_mask=mask),
                   dict(attn_mask=torch.zeros(30, 40)), dict()):
        expected = "tokens" if not kwargs else "head_dim"
        auto = reference.attention_forward(q, k, v, **kwargs)
        explicit = reference.attention_forward(q, k, v, v_block_axis=expected, **kwargs)
        other_axis = "head_dim" if expected == "tokens" else "tokens"
        other = reference.attention_forward(q, k, v, v_block_axis=other_axis, **kwargs)
        assert torch.equal(auto["out"], explicit["out"]) and not torch.equal(auto["out"], other["out"]), kwargs
        assert torch.equal(reference.attention(q, k, v, **kwargs),
                           reference.attention(q, k, v, v_block_axis=expected, **kwargs)), kwargs
        for a, e in zip(reference.attention_backward(q, k, v, dout, **kwargs),
                        reference.attention_backward(q, k, v, dout, v_block_axis=expected, **kwargs)):
            assert torch.equal(a, e), kwargs


def test_bad_v_block_axis_raises():
    q, k, v, _ = make_inputs(1, 2, 2, 20, 20, 64, torch.bfloat16, seed=71)
    with pytest.raises(ValueError, match="v_block_axis"):
        attn_qat.scaled_dot_product_attention(q, k, v, v_block_axis="channels")
    with pytest.raises(ValueError, match="v_block_axis"):
        attn_qat.attention(q, k, v, layout="bhsd", v_block_axis="channels")
    with pytest.raises(ValueError, match="v_block_axis"):
        reference.attention_forward(q, k, v, v_block_axis="channels")
    with pytest.raises(ValueError, match="v_block_axis"):
        attn_qat.QATConfig(v_block_axis="channels")


# ----------------------------------------------------------------------------------------------------------------
# The reference alone
# ----------------------------------------------------------------------------------------------------------------

def reference_cases():
    """(id, q, k, v, dout, causal, mask, changed keys) with V token blocks straddling visible and hidden keys."""
    cases = []
    q, k, v, dout = make_inputs(1, 4, 2, 50, 50, 64, torch.bfloat16, seed=81)
    cases.append(("top_left", q, k, v, dout, "top_left", None, (torch.arange(50) >= 27).expand(1, 2, 50)))
    q, k, v, dout = make_inputs(1, 2, 2, 30, 60, 128, torch.float16, seed=82)
    cases.append(("bottom_right", q, k, v, dout, "bottom_right", None, (torch.arange(60) >= 45).expand(1, 2, 60)))
    changed = torch.isin(torch.arange(96), torch.tensor(CHANGED_KEYS)).expand(2, 2, 96)
    for kind in ("bool", "additive"):
        q, k, v, dout = make_inputs(2, 2, 2, 64, 96, 64, torch.bfloat16, seed=83)
        cases.append((kind, q, k, v, dout, None, reference_mask(masked_case(kind, seed=84)), changed))
    q, k, v, dout = make_inputs(1, 2, 2, 96, 96, 64, torch.bfloat16, seed=85)
    mask, segment = packed_mask(True)
    cases.append(("packed", q, k, v, dout, None, mask, (segment == 1).expand(1, 2, 96)))
    return cases


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", reference_cases(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_reference_hidden_keys_invariant(case, how):
    _, q, k, v, dout, causal, mask, changed = case
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    visible = visibility(b, hq, nq, nk, causal=causal, mask=mask)
    dirty_rows = (visible & changed.repeat_interleave(group, dim=1)[:, :, None, :]).any(-1)
    clean_rows = ~dirty_rows
    assert clean_rows.any() and dirty_rows.any() and straddles(changed)
    if how == "x8":
        dout = torch.where(dirty_rows[..., None], torch.zeros_like(dout), dout)
        checked_keys = ~changed
    else:
        checked_keys = ~changed & ~(visible & dirty_rows[..., None]).any(2).view(b, hkv, group, nk).any(2)
    kp, vp = poison(k, changed, how), poison(v, changed, how)
    clean = reference.attention_forward(q, k, v, causal=causal, attn_mask=mask)
    dirty = reference.attention_forward(q, kp, vp, causal=causal, attn_mask=mask)
    for name in ("out", "out_prime", "frame", "row_sum", "lse"):
        assert torch.equal(clean[name][clean_rows], dirty[name][clean_rows]), name
    clean_grads = reference.attention_backward(q, k, v, dout, causal=causal, attn_mask=mask)
    dirty_grads = reference.attention_backward(q, kp, vp, dout, causal=causal, attn_mask=mask)
    for name, index, a, z in zip(("dq", "dk", "dv"), (clean_rows, checked_keys, checked_keys), clean_grads,
                                 dirty_grads):
        assert torch.equal(a[index], z[index]), name
