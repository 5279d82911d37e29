"""attn_qat.NVFP4KVCache: its storage and append semantics, its errors for misuse, and its attention (the CUDA
decode kernel and the composite path) against the float64 reference at numerics.md §7's tolerance, on fresh
random inputs with poisoned outputs.

The reference of the cache's attention is attn_qat.reference.attention_forward(..., operands_quantized=True) on
Q^F, K^F and V^F (K and V blocked along head_dim, numerics.md §2), per sequence with bottom-right causal alignment
(query t of a sequence of L tokens sees keys j <= L - Tq + t)."""
import pytest
import torch

import attn_qat
from attn_qat import NVFP4KVCache, reference
from attn_qat.ops import ops
from conftest import DEVICES, rel_error
from test_attention import FWD_TOL, forward_error, fresh_generator, poison_cuda_allocator


class Filled:
    """A cache plus every token appended to it, kept raw on the CPU for the reference."""

    def __init__(self, batch, heads_kv, head_dim, capacity, dtype, device, **paging):
        self.cache = NVFP4KVCache(batch, heads_kv, head_dim, capacity, dtype=dtype, device=device, **paging)
        self.k = [[] for _ in range(batch)]
        self.v = [[] for _ in range(batch)]
        self.g = fresh_generator()

    def append(self, tokens, lengths=None, k=None, v=None):
        c = self.cache
        shape = (c.batch, c.heads_kv, tokens, c.head_dim)
        k = torch.randn(shape, generator=self.g).to(c.dtype) if k is None else k
        v = torch.randn(shape, generator=self.g).to(c.dtype) if v is None else v
        c.append(k.to(c.device), v.to(c.device), lengths)
        counts = [tokens] * c.batch if lengths is None else list(lengths)
        for b, n in enumerate(counts):
            self.k[b].append(k[b, :, :n].cpu())
            self.v[b].append(v[b, :, :n].cpu())
        return self

    def raw(self, b):
        return torch.cat(self.k[b], dim=1), torch.cat(self.v[b], dim=1)

    def query(self, heads_q, tokens):
        c = self.cache
        return torch.randn(c.batch, heads_q, tokens, c.head_dim, generator=self.g).to(c.dtype).to(c.device)

    def reference(self, q, causal=True, scale=None):
        """float64 O (B, Hq, Tq, D) of the cache's attention."""
        outs = []
        for b in range(self.cache.batch):
            k, v = self.raw(b)
            n = k.shape[1]
            if n == 0:
                outs.append(torch.zeros(q.shape[1:], dtype=torch.float64))
                continue
            q_fq = reference.fake_quantize(q[b].cpu(), -1)
            out = reference.attention_forward(q_fq[None], reference.fake_quantize(k, -1)[None],
                                              reference.fake_quantize(v, -1)[None],
                                              causal="bottom_right" if causal else None, scale=scale,
                                              operands_quantized=True)["out"]
            outs.append(out[0])
        return torch.stack(outs)


def fill(batch, heads_kv, head_dim, steps, dtype=torch.bfloat16, device="cpu", capacity=None, **paging):
    """A cache filled by `steps`: a list of (tokens, lengths or None) appends."""
    total = sum(t for t, _ in steps)
    f = Filled(batch, heads_kv, head_dim, capacity or total, dtype, device, **paging)
    for tokens, lengths in steps:
        f.append(tokens, lengths)
    return f


def check(f, q, causal=True, label="", scale=None):
    poison_cuda_allocator()
    out = f.cache.attention(q, softmax_scale=scale, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    ref = f.reference(q, causal, scale)
    error, flipped = forward_error(out, ref)
    assert error <= FWD_TOL, f"{label}: error {error} ({flipped} rows set aside)"
    return out, ref


# Appends with unequal lengths per sequence: prompts of 37, 16, 5 tokens (odd, one full unit, partial), then
# single decode steps, then a few tokens at a time, so the 16-token units the kernel reads fill and start again.
UNEQUAL = [(37, [37, 16, 5]), (1, None), (1, [1, 0, 1]), (12, [12, 3, 11]), (1, None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tq", [1, 3, 16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_matches_reference(device, dtype, head_dim, tq, causal):
    f = fill(3, 2, head_dim, UNEQUAL + [(tq, None)], dtype, device)
    check(f, f.query(8, tq), causal, f"tq={tq}")  # 4 query heads per KV head


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tq", [1, 4])
def test_groups_of_three_heads_d64(device, tq):
    """SmolLM2-135M's shape (9 query heads over 3 KV heads, head_dim 64), where greedy decoding through NVFP4Cache on
    the H100 disagreed with the fake-quant recompute (docs/results.md)."""
    f = fill(3, 3, 64, UNEQUAL + [(tq, None)], device=device)
    check(f, f.query(9, tq), label=f"9/3 heads, tq={tq}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", [[1], [15], [16], [17], [33], [100], [1, 200]], ids=str)
def test_lengths(device, lengths):
    f = fill(len(lengths), 1, 128, [(max(lengths), lengths)], device=device)
    for tq in (1, 4):
        check(f, f.query(3, tq), label=f"lengths {lengths}, tq={tq}")  # MQA, 3 query heads


@pytest.mark.parametrize("device", DEVICES)
def test_more_than_16_queries(device):
    f = fill(2, 2, 64, [(50, [50, 41]), (20, None)], device=device)
    check(f, f.query(4, 20), label="20 queries")
    check(f, f.query(4, 20), causal=False, label="20 queries, full")


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_scale(device):
    f = fill(2, 2, 128, [(40, [40, 29])], device=device)
    check(f, f.query(4, 2), scale=0.3, label="scale 0.3")
    # The kernel takes scale > 0; attention passes a negative one as -q and a zero one as zero queries. Hidden
    # keys (past the length, the causal edge, the absent second unit of a step) must still count as absent.
    for length in (20, 32, 77):
        f = fill(2, 2, 64, [(length, [length, length - 7])], device=device)
        for tq in (1, 3):
            for scale in (-0.088, 0.0):
                check(f, f.query(4, tq), scale=scale, label=f"scale {scale}, L {length}, Tq {tq}")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows(device):
    # A sequence shorter than the queries leaves its first Tq - L rows with no visible key: 0, like the
    # forward's empty rows; an empty sequence gives 0 everywhere.
    f = fill(3, 1, 64, [(5, [2, 0, 5])], device=device)
    out, _ = check(f, f.query(2, 4), label="short sequences")
    assert not out[0, :, :2].any() and out[0, :, 2:].isfinite().all() and out[0, :, 2:].any()
    assert not out[1].any()
    empty = NVFP4KVCache(2, 1, 64, 16, device=device)
    assert not empty.attention(torch.randn(2, 2, 1, 64, dtype=torch.bfloat16, device=device)).any()


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_block_scales(device):
    # Channels and tokens spanning E4M3's range: subnormal scales (amax < 6 * 2^-6), zero blocks, saturated
    # scales (amax > 2688), so every dequantization case of the kernel meets the reference.
    g = fresh_generator()
    f = Filled(2, 2, 128, 64, torch.bfloat16, device)
    magnitudes = torch.tensor([0.0, 1e-4, 3e-3, 0.05, 1.0, 30.0, 3000.0, 1.0])
    channel_scale = magnitudes.repeat_interleave(16)  # one magnitude per 16-channel block of K
    token_scale = magnitudes.repeat(8)[:50, None]     # one magnitude per V token, times a spread over channels
    k = (torch.randn(2, 2, 50, 128, generator=g) * channel_scale * 0.01).bfloat16()
    v = (torch.randn(2, 2, 50, 128, generator=g) * token_scale * torch.rand(128, generator=g)).bfloat16()
    f.append(50, [50, 37], k=k, v=v)
    check(f, f.query(4, 1), label="extreme scales")
    check(f, f.query(4, 5), label="extreme scales, 5 queries")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["v_partial_unit", "k_partial_unit", "v_full_unit"])
def test_nonfinite_values_under_hidden_keys(device, where):
    # numerics.md §8: a key a query cannot see contributes nothing, even when its value or key is NaN. Token
    # 19 (in the partial last unit of a 20-token sequence) or 31 (in the last full unit of a 32-token one) is
    # hidden from the first 3 of 4 causal queries; with V blocked along head_dim its NaN reaches no other token.
    n = 32 if where == "v_full_unit" else 20
    f = Filled(1, 1, 64, 32, torch.bfloat16, device)
    g = fresh_generator()
    k = torch.randn(1, 1, n, 64, generator=g).bfloat16()
    v = torch.randn(1, 1, n, 64, generator=g).bfloat16()
    (k if where == "k_partial_unit" else v)[0, 0, n - 1, 5] = float("nan")
    f.append(n, k=k, v=v)
    q = f.query(2, 4)
    out = f.cache.attention(q).cpu()
    ref = f.reference(q)
    assert torch.equal(out.isnan(), ref.isnan()), f"NaN pattern {out.isnan().any(-1)} vs {ref.isnan().any(-1)}"
    assert out[:, :, :3].isfinite().all() and out[:, :, 3].isnan().any()  # only the row that sees the NaN
    finite = ref.isfinite()
    assert rel_error(out[finite], ref[finite]) <= FWD_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_append_equals_single_append(device):
    g = fresh_generator()
    k = torch.randn(3, 2, 70, 64, generator=g).bfloat16().to(device)
    v = torch.randn(3, 2, 70, 64, generator=g).bfloat16().to(device)
    final = [70, 33, 48]
    once = NVFP4KVCache(3, 2, 64, 70, device=device)
    once.append(k, v, lengths=final)
    pieces = NVFP4KVCache(3, 2, 64, 70, device=device)
    done = [0, 0, 0]
    for step in ([1, 0, 5], [15, 16, 11], [1, 1, 0], [20, 0, 16], [33, 16, 16]):
        take = [min(s, f - d) for s, f, d in zip(step, final, done)]
        width = max(take)
        # each sequence's next `take` tokens at the front of a `width`-token step, garbage after them
        ks = torch.full((3, 2, width, 64), float("nan"), dtype=torch.bfloat16, device=device)
        vs = ks.clone()
        for b in range(3):
            ks[b, :, :take[b]] = k[b, :, done[b]:done[b] + take[b]]
            vs[b, :, :take[b]] = v[b, :, done[b]:done[b] + take[b]]
        pieces.append(ks, vs, lengths=torch.tensor(take, device=device))
        done = [d + t for d, t in zip(done, take)]
    assert done == final and pieces.lengths.tolist() == final
    for pool in ("k_codes", "k_scales", "v_codes", "v_scales"):  # every byte, written or still zero
        assert torch.equal(getattr(once, pool), getattr(pieces, pool)), pool
    q = torch.randn(3, 4, 2, 64, generator=g).bfloat16().to(device)
    assert torch.equal(once.attention(q), pieces.attention(q))


# Largest relative error between the CUDA decode kernel and the training forward on the same causal prefix: the two
# kernels sum the same fp32 products in different orders (numerics.md §8, "Train = infer"); on the CPU they are
# bit-identical.
DECODE_VS_TRAINING_TOL = 2e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_causal_prefix_train_equals_infer(device, head_dim):
    """numerics.md §8: for a causal prefix (45 tokens, so units and P blocks end mid-way; 8 query / 2 KV heads),
    the training forward, nvfp4_attention on the packed prefix, and the cache's attention after one append or
    after 45 one-token appends give the same rows; the two caches hold the same bytes."""
    g = fresh_generator()
    b, hq, hkv, n, d = 2, 8, 2, 45, head_dim
    q = torch.randn(b, hq, n, d, generator=g).bfloat16().to(device)
    k, v = (torch.randn(b, hkv, n, d, generator=g).bfloat16().to(device) for _ in range(2))
    training = attn_qat.attention(q.clone().requires_grad_(), k, v, causal=True, layout="bhsd").detach()
    with torch.no_grad():
        packed = attn_qat.nvfp4_attention(*attn_qat.quantize_qkv(q, k, v, layout="bhsd", causal=True), causal=True,
                                          layout="bhsd")
    assert torch.equal(packed, training)  # the same forward kernel on the same FP4 values

    once, stepwise = NVFP4KVCache(b, hkv, d, 64, device=device), NVFP4KVCache(b, hkv, d, 64, device=device)
    once.append(k, v)
    rows = []
    for t in range(n):
        stepwise.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        rows.append(stepwise.attention(q[:, :, t:t + 1]))  # decoding token t
    for pool in ("k_codes", "k_scales", "v_codes", "v_scales"):
        assert torch.equal(getattr(once, pool), getattr(stepwise, pool)), pool
    decoded = {"token by token": torch.cat(rows, dim=2)}
    for tq in (1, 5, 16):
        decoded[f"last {tq}"] = once.attention(q[:, :, n - tq:])
    for label, out in decoded.items():
        expected = training[:, :, n - out.shape[2]:]
        if device == "cpu":
            assert torch.equal(out, expected), label
        else:
            assert rel_error(out, expected) <= DECODE_VS_TRAINING_TOL, (label, rel_error(out, expected))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefix_reused_pages_train_equals_infer(device):
    """The paged form of the test above, unequal lengths (45 and 30 tokens, units and P blocks ending mid-way) on
    pages that an earlier, longer sequence filled with NaN: its stale tokens past the new lengths sit in the
    partial last units and must stay absent. Each sequence's rows match the training forward run on it alone."""
    g = fresh_generator()
    hq, hkv, d, lengths = 4, 2, 64, (45, 30)
    cache = NVFP4KVCache(2, hkv, d, 64, device=device, page_size=16, num_pages=8)
    poison = torch.full((2, hkv, 64, d), float("nan"), dtype=torch.bfloat16, device=device)
    cache.append(poison, poison)  # every page of the pool holds NaN codes and scales
    cache.reset()
    k, v = (torch.randn(2, hkv, 45, d, generator=g).bfloat16().to(device) for _ in range(2))
    q = torch.randn(2, hq, 45, d, generator=g).bfloat16().to(device)
    cache.append(k, v, lengths=list(lengths))
    for tq in (1, 3):
        out = cache.attention(torch.stack([q[b, :, n - tq:n] for b, n in enumerate(lengths)]))
        for b, n in enumerate(lengths):
            alone = attn_qat.attention(q[b:b + 1, :, :n].clone().requires_grad_(), k[b:b + 1, :, :n],
                                       v[b:b + 1, :, :n], causal=True, layout="bhsd").detach()[0, :, n - tq:]
            assert out[b].isfinite().all(), (tq, b)
            # not bit for bit on the CPU either: its composite path masks the unequal lengths, and masked scores
            # round once more than causal ones (numerics.md §8)
            assert rel_error(out[b], alone) <= DECODE_VS_TRAINING_TOL, (tq, b, rel_error(out[b], alone))


def test_storage_is_the_nvfp4_format():
    # K and V blocked along head_dim per token (numerics.md §2), as attn_qat.quantize packs them; V's bytes arranged
    # as csrc/attn_qat.h says (tokens 2p, 2p + 1 interleaved by 16-bit halves; each unit's scales block-major).
    g = fresh_generator()
    k = torch.randn(1, 2, 40, 64, generator=g).bfloat16()
    v = torch.randn(1, 2, 40, 64, generator=g).bfloat16()
    cache = NVFP4KVCache(1, 2, 64, 48)
    cache.append(k[:, :, :7], v[:, :, :7])
    cache.append(k[:, :, 7:], v[:, :, 7:])
    codes, scales = ops.nvfp4_quantize(k, 3)
    assert torch.equal(cache.k_codes[:, :, :40], codes)
    assert torch.equal(cache.k_scales[:, :, :40], scales.view(torch.uint8))
    codes, scales = ops.nvfp4_quantize(v, 3)
    for j in range(40):
        pair_row = cache.v_codes[0, :, j // 2].view(2, 16, 2, 2)  # (heads, halves, token parity, bytes)
        assert torch.equal(pair_row[:, :, j % 2], codes[0, :, j].view(2, 16, 2)), j
        unit = cache.v_scales[0, :, j // 16].view(2, 4, 16)  # (heads, 16-channel blocks, the unit's tokens)
        r = j % 16
        assert torch.equal(unit[:, :, 4 * (r % 8 // 2) + 2 * (r // 8) + r % 2], scales.view(torch.uint8)[0, :, j]), j
    k_deq, v_deq = cache.dequantized()
    assert torch.equal(k_deq.double(), reference.fake_quantize(k, -1))
    assert torch.equal(v_deq.double(), reference.fake_quantize(v, -1))


def test_sizes():
    cache = NVFP4KVCache(8, 8, 128, 1000)
    assert cache.capacity == 1008  # rounded up to whole 16-token units
    assert cache.bytes_per_token == 8 * 2 * (64 + 8)
    assert abs(8 * 2 * 128 * 2 / cache.bytes_per_token - 3.56) < 0.01  # vs a bf16 cache
    packed = 8 * 1008 * cache.bytes_per_token
    assert cache.nbytes == packed + 8 * 8 + 8 * 4  # + lengths, block table


@pytest.mark.parametrize("device", DEVICES)
def test_reset(device):
    f = fill(2, 1, 64, [(30, [30, 12])], device=device)
    f.cache.reset()
    assert f.cache.lengths.tolist() == [0, 0]
    f.k, f.v = [[], []], [[], []]  # what the reference sees: nothing before the reset
    f.append(20, [7, 20])
    check(f, f.query(2, 3), label="after reset")


def test_misuse_raises_clear_errors():
    for args, err in [((0, 1, 64, 16), ValueError), ((1, 1, 72, 16), ValueError), ((1, 1, 64, 0), ValueError),
                      ((1, 2.0, 64, 16), ValueError)]:
        with pytest.raises(err):
            NVFP4KVCache(*args)
    with pytest.raises(TypeError, match="dtype"):
        NVFP4KVCache(1, 1, 64, 16, dtype=torch.float32)

    cache = NVFP4KVCache(2, 2, 64, 20)  # capacity 32
    ok = torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        cache.append(ok.half(), ok.half())
    with pytest.raises(ValueError, match="head_dim"):
        cache.append(torch.zeros(2, 2, 3, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 3, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="heads_kv"):
        cache.append(torch.zeros(2, 1, 3, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 3, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="differ"):
        cache.append(ok, torch.zeros(2, 2, 4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lengths"):
        cache.append(ok, ok, lengths=[1, 4])
    with pytest.raises(ValueError, match="lengths"):
        cache.append(ok, ok, lengths=[1])
    cache.append(ok, ok, lengths=[3, 1])
    big = torch.zeros(2, 2, 30, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="capacity"):
        cache.append(big, big)
    assert cache.lengths.tolist() == [3, 1]  # a failed append changes nothing
    cache.append(big, big, lengths=[29, 30])
    with pytest.raises(ValueError, match="capacity"):
        cache.append(ok[:, :, :1], ok[:, :, :1])

    q = torch.zeros(2, 4, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        cache.attention(q.half())
    with pytest.raises(ValueError, match="multiple"):
        cache.attention(torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="head_dim"):
        cache.attention(torch.zeros(2, 4, 1, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="batch"):
        cache.attention(torch.zeros(3, 4, 1, 64, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_device_mismatch_raises():
    cache = NVFP4KVCache(1, 1, 64, 16, device="cuda")
    x = torch.zeros(1, 1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cuda"):
        cache.append(x, x)
    with pytest.raises(ValueError, match="cuda"):
        cache.attention(x)


# ----------------------------------------------------------------------------------------------
# Paged caches: sequences draw pages of a shared pool as they grow


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [16, 48, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tq", [1, 5])
def test_paged_matches_reference_and_unpaged(device, page_size, head_dim, tq):
    # UNEQUAL's appends interleave the sequences' page grabs, so each sequence's pages are scattered in the pool,
    # and units and pages end at different tokens.
    paged = Filled(3, 2, head_dim, 80, torch.bfloat16, device, page_size=page_size)
    unpaged = Filled(3, 2, head_dim, 80, torch.bfloat16, device)
    unpaged.g.set_state(paged.g.get_state())  # the same tokens in both
    for tokens, lengths in UNEQUAL + [(tq, None)]:
        paged.append(tokens, lengths)
        unpaged.append(tokens, lengths)
    pages = [p for row in paged.cache.block_table.tolist() for p in row if p >= 0]
    assert len(set(pages)) == len(pages) and paged.cache.free_pages == paged.cache.num_pages - len(pages)
    for causal in (True, False):
        q = paged.query(8, tq)
        out, _ = check(paged, q, causal, f"page_size={page_size} tq={tq} causal={causal}")
        assert torch.equal(out, unpaged.cache.attention(q, causal=causal))  # same numbers, same kernel split


@pytest.mark.parametrize("device", DEVICES)
def test_paged_reset_returns_pages_for_reuse(device):
    # A pool too small for both sequences at once: the first must give its pages back before the second grows,
    # and the second then reads pages full of the first one's stale codes.
    f = Filled(2, 2, 64, 96, torch.bfloat16, device, page_size=32, num_pages=4)
    f.append(70, [70, 20])  # 3 + 1 pages
    assert f.cache.free_pages == 0
    with pytest.raises(ValueError, match="out of pages"):
        f.append(20, [0, 20])
    assert f.cache.lengths.tolist() == [70, 20] and f.cache.free_pages == 0  # a failed append changes nothing
    check(f, f.query(4, 2), label="full pool")
    f.cache.reset([0])
    f.k[0], f.v[0] = [], []
    assert f.cache.free_pages == 3 and f.cache.lengths.tolist() == [0, 20]
    assert f.cache.block_table[0].tolist() == [-1, -1, -1]
    f.append(75, [1, 75])  # sequence 1 takes the pages sequence 0 gave back
    assert f.cache.free_pages == 0 and f.cache.lengths.tolist() == [1, 95]
    check(f, f.query(4, 3), label="reused pages")
    with pytest.raises(ValueError, match="sequences"):
        f.cache.reset([2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [None, 16], ids=["unpaged", "paged"])
def test_decode_steps_copy_nothing_from_the_host(device, page_size, monkeypatch):
    # Steps in which every sequence appends the same tokens into pages it already holds find their slots on the
    # device: a host-to-device copy from pageable memory waits for the stream to drain, once per layer and step.
    paging = {} if page_size is None else {"page_size": page_size}
    f = fill(3, 2, 64, [(37, [37, 16, 5])], device=device, capacity=64, **paging)
    staged = []
    monkeypatch.setattr(f.cache, "_staged", lambda *args: staged.append(args) or NVFP4KVCache._staged(f.cache, *args))
    for tokens in (1, 1, 3, 1):  # 37 -> 43, 16 -> 22 (a new page at 17 once paged), 5 -> 11
        before = len(staged)
        f.append(tokens)
        lengths = f.cache.lengths.tolist()
        new_page = page_size is not None and any(-(-n // page_size) > -(-(n - tokens) // page_size) for n in lengths)
        assert len(staged) - before == (1 if new_page else 0), f"after {tokens} tokens: {staged[before:]}"
    assert f.cache.lengths.tolist() == [43, 22, 11]
    check(f, f.query(4, 3), label="after device-side appends")


@pytest.mark.parametrize("device", DEVICES)
def test_paged_failed_store_gives_pages_back(device, monkeypatch):
    # An append that fails after taking its pages (the store runs out of memory, say) leaves the pool as it was.
    f = Filled(2, 1, 64, 64, torch.bfloat16, device, page_size=16, num_pages=4)
    f.append(20, [20, 5])  # 2 + 1 pages
    table, free = f.cache.block_table.clone(), f.cache.free_pages

    def fail(*args):
        raise RuntimeError("store failed")

    monkeypatch.setattr(f.cache, "_store", fail)
    with pytest.raises(RuntimeError, match="store failed"):
        f.cache.append(*(torch.zeros(2, 1, 12, 64, dtype=torch.bfloat16, device=device),) * 2)
    assert f.cache.free_pages == free and torch.equal(f.cache.block_table, table)
    assert f.cache.lengths.tolist() == [20, 5]
    monkeypatch.undo()
    f.append(12)  # the pages are there to take
    check(f, f.query(2, 1), label="after a failed append")


def test_paged_sizes_and_misuse():
    unpaged = NVFP4KVCache(8, 8, 128, 4096)
    pool = NVFP4KVCache(8, 8, 128, 4096, page_size=256, num_pages=40)  # room for 10k tokens, not 32k
    assert pool.capacity == 4096 and pool.block_table.shape == (8, 16)
    assert pool.bytes_per_token == unpaged.bytes_per_token
    assert pool.nbytes < unpaged.nbytes * 40 / 128 + 1024
    assert NVFP4KVCache(2, 1, 64, 100, page_size=48).capacity == 144  # whole pages
    with pytest.raises(ValueError, match="page_size"):
        NVFP4KVCache(2, 1, 64, 100, page_size=24)
    with pytest.raises(ValueError, match="page_size"):
        NVFP4KVCache(2, 1, 64, 100, page_size=0)
    with pytest.raises(ValueError, match="num_pages"):
        NVFP4KVCache(2, 1, 64, 100, num_pages=4)
    with pytest.raises(ValueError, match="num_pages"):
        NVFP4KVCache(2, 1, 64, 100, page_size=16, num_pages=0)


# ----------------------------------------------------------------------------------------------
# The append op (csrc/decode/kv_append.h) against the chain of torch ops it replaced, byte for byte


class TorchOpsCache(NVFP4KVCache):
    """An NVFP4KVCache that stores as it did before the append op: nvfp4_quantize of K and V, then index_put of their
    codes and scales into the pools' layouts, and the lengths advanced by torch ops. The definition of the layout the
    op must write, bit for bit."""

    def _store(self, k, v, counts):
        tokens, ps = k.shape[2], self.page_size
        if counts is None:
            t = torch.arange(tokens, device=self.device)
            position = self._lengths[:, None] + t
            page = self.block_table.gather(1, position // ps).long()
            b_idx = torch.arange(self.batch, device=self.device)[:, None].expand_as(position)
            b_idx, t_idx, page, slot = (x.reshape(-1) for x in (b_idx, t.expand_as(position), page, position % ps))
        else:
            held = self._host_lengths
            pairs = [(b, t, self._pages[b][(held[b] + t) // ps], (held[b] + t) % ps)
                     for b, c in enumerate(counts) for t in range(c)]
            b_idx, t_idx, page, slot = torch.tensor(pairs, device=self.device).t().unbind(0)
        codes, scales = ops.nvfp4_quantize(k, 3)
        self.k_codes[page, :, slot] = codes[b_idx, :, t_idx]
        self.k_scales[page, :, slot] = scales.view(torch.uint8)[b_idx, :, t_idx]
        codes, scales = ops.nvfp4_quantize(v, 3)
        n, h, d = b_idx.shape[0], self.heads_kv, self.head_dim
        v_codes = self.v_codes.view(self.num_pages, h, ps // 2, d // 4, 2, 2)  # (.., halves, token parity, bytes)
        v_codes[page, :, slot // 2, :, slot % 2] = codes[b_idx, :, t_idx].view(n, h, d // 4, 2)
        r = slot % 16  # token r of its unit sits at 4 * ((r % 8) // 2) + 2 * (r // 8) + r % 2 of each block's row
        v_scales = self.v_scales.view(self.num_pages, h, ps // 16, d // 16, 4, 2, 2)
        v_scales[page, :, slot // 16, :, r % 8 // 2, r // 8, r % 2] = scales.view(torch.uint8)[b_idx, :, t_idx]
        self._lengths += torch.tensor([tokens] * self.batch if counts is None else counts, device=self.device)


def poison_pools(*caches):
    """The same random bytes in every pool of each cache, so a byte written that should not be (or not written that
    should) shows."""
    g = fresh_generator()
    for buffers in zip(*((c.k_codes, c.k_scales, c.v_codes, c.v_scales) for c in caches)):
        noise = torch.randint(0, 256, buffers[0].shape, generator=g, dtype=torch.uint8)
        for b in buffers:
            b.copy_(noise)


def new_tokens(shape, dtype, layout, g, special=False):
    """(B, H, T, D) K or V values in `layout`: "bhsd" (contiguous), "bshd" (views of (B, T, H, D) memory, as the
    models pass them), "unaligned" (rows 2 elements off 16-byte alignment: the kernel's scalar loads), "strided" (every
    other channel: the op copies them first). `special` mixes in zeros, subnormals, huge values, Inf and NaN."""
    b, h, t, d = shape
    x = torch.randn(b, t, h, d, generator=g) if layout == "bshd" else torch.randn(shape, generator=g)
    x = x * torch.exp2(torch.randint(-12, 12, x.shape[:-1], generator=g))[..., None]  # each block its own scale
    if special:
        pick = torch.rand(x.shape, generator=g)
        x = torch.where(pick < 0.02, torch.zeros(()), x)
        x = torch.where((pick >= 0.02) & (pick < 0.03), torch.full((), 3e-8), x)
        x = torch.where((pick >= 0.03) & (pick < 0.035), torch.full((), 6e4), x)
        x = torch.where((pick >= 0.035) & (pick < 0.037), torch.full((), float("inf")), x)
        x = torch.where((pick >= 0.037) & (pick < 0.039), torch.full((), float("nan")), x)
        x[0, 0, 0, :16] = 0  # one all-zero block
    x = x.to(dtype)
    if layout == "bshd":
        return x.transpose(1, 2)
    if layout == "unaligned":
        return torch.cat([torch.zeros(2, dtype=dtype), x.reshape(-1)])[2:].view(shape)
    if layout == "strided":
        return torch.stack([x, x], dim=-1).reshape(b, h, t, 2 * d)[..., ::2]
    return x


def on_device(x, layout, device):
    """x moved to `device` keeping its layout (a plain .to() would not keep the 2-element offset)."""
    if layout == "unaligned":
        flat = torch.cat([torch.zeros(2, dtype=x.dtype), x.contiguous().reshape(-1)]).to(device)
        return flat[2:].view(x.shape)
    if layout == "strided":
        return torch.stack([x, x], dim=-1).reshape(*x.shape[:-1], 2 * x.shape[-1]).to(device)[..., ::2]
    if layout == "bshd":
        return x.transpose(1, 2).contiguous().to(device).transpose(1, 2)
    return x.to(device)


# Appends at awkward places: unequal prompts (odd, a whole unit, short), single tokens to all and to some, a few
# tokens crossing units and pages, a sequence appending nothing, longer chunks.
APPENDS = [(37, [37, 16, 5]), (1, None), (1, [1, 0, 1]), (12, [12, 3, 11]), (1, None), (17, None), (3, [0, 3, 2]),
           (1, None), (31, [31, 30, 29]), (1, None)]
LAYOUTS = ("bhsd", "bshd", "unaligned", "strided")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [None, 16, 48], ids=["unpaged", "page16", "page48"])
def test_append_op_writes_what_the_torch_ops_wrote(device, dtype, head_dim, page_size):
    paging = {} if page_size is None else {"page_size": page_size}
    caches = [cls(3, 2, head_dim, 160, dtype=dtype, device=device, **paging) for cls in (NVFP4KVCache, TorchOpsCache)]
    poison_pools(*caches)
    g = fresh_generator()
    for i, (tokens, lengths) in enumerate(APPENDS):
        layout = LAYOUTS[i % len(LAYOUTS)]
        k, v = (new_tokens((3, 2, tokens, head_dim), dtype, layout, g, special=i % 3 == 0) for _ in "kv")
        k, v = on_device(k, layout, device), on_device(v, layout, device)
        for c in caches:
            c.append(k, v, lengths)
        label = f"append {i} ({tokens} tokens, lengths {lengths}, {layout})"
        ours, theirs = caches
        assert ours.lengths.tolist() == theirs.lengths.tolist() == ours._host_lengths, label
        assert torch.equal(ours.block_table, theirs.block_table), label
        for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), f"{label}: {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_append_op_cuda_equals_cpu_at_scale(dtype, head_dim):
    # The benchmark's shape (batch 8, 8 KV heads) with a long prompt of unequal lengths across 256-token pages, then
    # decode steps: the CUDA op's bytes are the C kernel's.
    g = fresh_generator()
    caches = [NVFP4KVCache(8, 8, head_dim, 1100, dtype=dtype, device=dev, page_size=256) for dev in ("cpu", "cuda")]
    poison_pools(*caches)
    lengths = [1000, 999, 1, 0, 256, 257, 512, 777]
    for tokens, counts in [(1000, lengths), (1, None), (1, None), (16, None), (5, [5, 0, 5, 1, 2, 3, 4, 5])]:
        k, v = (new_tokens((8, 8, tokens, head_dim), dtype, "bshd", g, special=True) for _ in "kv")
        for c in caches:
            c.append(on_device(k, "bshd", c.device), on_device(v, "bshd", c.device), counts)
        cpu, cuda = caches
        assert cpu.lengths.tolist() == cuda.lengths.tolist()
        for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
            assert torch.equal(getattr(cpu, name), getattr(cuda, name).cpu()), f"{tokens} tokens: {name}"


def test_append_op_rejects_bad_input():
    c = NVFP4KVCache(2, 2, 64, 32)
    k = torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16)
    pools = (c.k_codes, c.k_scales, c.v_codes, c.v_scales)
    with pytest.raises(RuntimeError, match="pools"):
        ops.kv_cache_append(k[:, :1], k[:, :1], None, c.lengths, c.block_table, *pools)  # heads differ from the pools'
    with pytest.raises(RuntimeError, match="lengths"):
        ops.kv_cache_append(k, k, None, c.lengths.int(), c.block_table, *pools)
    with pytest.raises(RuntimeError, match="counts"):
        ops.kv_cache_append(k, k, torch.ones(3, dtype=torch.long), c.lengths, c.block_table, *pools)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.kv_cache_append(k, k.half(), None, c.lengths, c.block_table, *pools)
    assert c.lengths.tolist() == [0, 0] and not any(p.any() for p in pools)  # nothing written
    ops.kv_cache_append(k, k, torch.tensor([3, 1]), c.lengths, c.block_table, *pools)
    assert c.lengths.tolist() == [3, 1]


@pytest.mark.gpu
def test_append_op_replays_in_a_cuda_graph():
    # A decode step's append has no host sync and no allocation: captured once, replayed with new keys and values
    # (reading the lengths it advances), it writes what eager appends write.
    g = fresh_generator()
    graphed, eager = (NVFP4KVCache(4, 8, 128, 64, device="cuda") for _ in range(2))
    k0, v0 = (on_device(new_tokens((4, 8, 20, 128), torch.bfloat16, "bshd", g), "bshd", "cuda") for _ in "kv")
    for c in (graphed, eager):
        c.append(k0, v0, [20, 3, 17, 0])
    k, v = (torch.zeros(4, 8, 1, 128, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    c = graphed
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.kv_cache_append(k, v, None, c.lengths, c.block_table, c.k_codes, c.k_scales, c.v_codes, c.v_scales)
    assert graphed.lengths.tolist() == [20, 3, 17, 0]  # capturing ran nothing
    for step in range(16):  # sequences 0 and 2 cross the unit boundary at token 32
        new_k, new_v = (new_tokens((4, 8, 1, 128), torch.bfloat16, "bhsd", g).cuda() for _ in "kv")
        k.copy_(new_k)
        v.copy_(new_v)
        graph.replay()
        eager.append(new_k, new_v)
        torch.cuda.synchronize()
        assert graphed.lengths.tolist() == eager.lengths.tolist(), step
        for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), f"step {step}: {name}"


# ----------------------------------------------------------------------------------------------
# The CUDA decode kernel itself (the tests above run it through NVFP4KVCache.attention on CUDA)


def kernel(f, q, causal=True, block_table=None, scale=None):
    c = f.cache
    poison_cuda_allocator()
    return ops.kv_cache_decode(q, c.k_codes, c.k_scales, c.v_codes, c.v_scales, c.lengths,
                               c.block_table if block_table is None else block_table, max(c.lengths.tolist()),
                               q.shape[-1] ** -0.5 if scale is None else scale, causal)


@pytest.mark.gpu
def test_kernel_rejects_nonpositive_scale():
    # The kernel finds the row max on raw scores and scales inside the exp: the op itself takes scale > 0 only.
    f = fill(1, 1, 64, [(20, [20])], device="cuda")
    for scale in (-0.1, 0.0, float("nan")):
        with pytest.raises(RuntimeError, match="scale > 0"):
            kernel(f, f.query(2, 1), scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_long_context_many_splits(dtype, head_dim):
    # ~5k keys of unequal lengths: many chunks per sequence, the merges across warps and chunks, a partial
    # last unit in the middle of a chunk; 32 query / 8 KV heads as in the benchmark.
    f = fill(2, 8, head_dim, [(5000, [5000, 3333]), (1, None)], dtype, "cuda")
    q = f.query(32, 1)
    out = kernel(f, q)
    error, _ = forward_error(out, f.reference(q))
    assert error <= FWD_TOL
    composite = f.cache._attention_composite(q, head_dim ** -0.5, True)
    assert forward_error(out, composite)[0] <= FWD_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [1, 7, 16])
def test_kernel_many_row_tiles(tq):
    # 8 query heads per KV head x up to 16 tokens = up to 128 rows: several 16-row tiles per KV group.
    f = fill(2, 2, 128, [(300, [300, 181]), (tq, None)], device="cuda")
    for causal in (True, False):
        q = f.query(16, tq)
        error, _ = forward_error(kernel(f, q, causal), f.reference(q, causal))
        assert error <= FWD_TOL, f"tq={tq} causal={causal}: {error}"


@pytest.mark.gpu
def test_kernel_is_deterministic_and_matches_composite():
    f = fill(3, 2, 128, UNEQUAL + [(4, None)], device="cuda")
    q = f.query(8, 4)
    out = kernel(f, q)
    assert torch.equal(out, kernel(f, q))
    assert forward_error(out, f.cache._attention_composite(q, 128 ** -0.5, True))[0] <= FWD_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 272])
def test_kernel_paged_long_context(page_size):
    # Chunks of up to 4096 keys spanning up to 256 pages (page_size 16) or starting mid-page (272 = 17 units).
    f = Filled(2, 8, 128, 5001, torch.bfloat16, "cuda", page_size=page_size)
    unpaged = Filled(2, 8, 128, 5001, torch.bfloat16, "cuda")
    unpaged.g.set_state(f.g.get_state())
    for filled in (f, unpaged):
        filled.append(5000, [5000, 3333]).append(1)
    q = f.query(32, 1)
    out = kernel(f, q)
    assert forward_error(out, f.reference(q))[0] <= FWD_TOL
    assert torch.equal(out, kernel(unpaged, q))


@pytest.mark.gpu
def test_misaligned_query_view():
    # A contiguous q whose storage starts 6 bytes into a buffer: the kernel reads 16-byte rows, so the cache copies it.
    f = fill(2, 2, 64, [(40, [40, 33])], device="cuda")
    q = f.query(4, 1)
    flat = torch.empty(q.numel() + 3, dtype=q.dtype, device="cuda")
    shifted = flat[3:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 and shifted.is_contiguous()
    assert torch.equal(f.cache.attention(shifted), f.cache.attention(q))


@pytest.mark.gpu
def test_kernel_block_table_outside_the_pool_gives_nan():
    # The block table is the cache's own, but the op takes it as an argument: a page index outside the pool
    # must not read outside it, nor give plausible numbers.
    f = fill(2, 2, 64, [(40, [40, 33])], device="cuda", page_size=16)
    q = f.query(4, 1)
    good = kernel(f, q)
    for bad_page in (-1, f.cache.num_pages, 2**31 - 1):
        table = f.cache.block_table.clone()
        table[1, 1] = bad_page
        out = kernel(f, q, block_table=table)
        assert out[1].isnan().all() and torch.equal(out[0], good[0])


# The chunks' merge: by default the last CTA of a sequence's chunks merges them (csrc/decode/decode_cuda.cu,
# merge_chunks), with counters that must be 0 at every call; decode_variant=0 keeps the separate combine
# kernel, whose output the other variants, and "auto" (the default, variant 3), must give bit for bit.
DECODE_VARIANTS = (0, 1, 2, 3)


def bits(t):
    """The output's bit patterns (NaN included), for bit-for-bit comparisons."""
    return t.view(torch.int16)


def kernel_variants(f, q, causal=True, block_table=None, chunk=None):
    """{variant: output} of the kernel under each decode_variant kernel option and under "auto" (the default), twice
    each: the second call finds the counters the first left."""
    outs = {}
    with attn_qat.ops.kernel_options(decode_chunk=chunk if chunk is not None else "auto"):
        for variant in DECODE_VARIANTS + ("auto",):
            with attn_qat.ops.kernel_options(decode_variant=variant):
                first = kernel(f, q, causal, block_table)
                again = kernel(f, q, causal, block_table)
            assert torch.equal(bits(first), bits(again)), f"variant {variant}: a second call differs"
            outs[variant] = first
    return outs


MERGE_CASES = {
    # 32 query / 8 KV heads, ~5k keys: many chunks a sequence, one that ends mid-unit
    "long": lambda: (fill(2, 8, 128, [(5000, [5000, 3333]), (1, None)], device="cuda"), 32, 1),
    # an empty sequence and a one-chunk one beside a long one, D = 64, three causal query tokens
    "empty_and_one_chunk": lambda: (fill(3, 2, 64, [(3000, [3000, 0, 40])], device="cuda"), 4, 3),
    # 8 query heads a KV head x 16 tokens: 8 row tiles, each merged by its own last CTA
    "many_row_tiles": lambda: (fill(2, 2, 128, [(300, [300, 181]), (16, None)], device="cuda"), 16, 16),
    # 16-token pages: a chunk's units from 64-256 pages
    "paged": lambda: (Filled(2, 8, 128, 5001, torch.bfloat16, "cuda", page_size=16).append(5000, [5000, 3333])
                      .append(1), 32, 1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", MERGE_CASES)
@pytest.mark.parametrize("chunk", [None, 64], ids=["planned_chunks", "chunks_of_64"])
def test_kernel_variants_are_bit_identical(case, chunk):
    # Chunks of 64 keys give up to 79 chunks a sequence: more than a warp's lanes and than a merge batch.
    f, heads_q, tq = MERGE_CASES[case]()
    q = f.query(heads_q, tq)
    for causal in (True, False):
        outs = kernel_variants(f, q, causal, chunk=chunk)
        for variant, out in outs.items():
            assert torch.equal(bits(out), bits(outs[0])), f"variant {variant} differs from the combine kernel"
        assert forward_error(outs[0], f.reference(q, causal))[0] <= FWD_TOL
    if case == "empty_and_one_chunk":
        assert not outs[0][1].any() and outs[0][2].isfinite().all()


@pytest.mark.gpu
def test_kernel_variants_agree_on_a_block_table_outside_the_pool():
    # The NaN rows of a sequence that meets a bad page, in a chunk that is not its last; the calls after it find
    # the counters at 0 again and give the good output.
    f = fill(2, 2, 64, [(700, [700, 500])], device="cuda", page_size=16)
    q = f.query(4, 1)
    good = kernel_variants(f, q, chunk=64)
    table = f.cache.block_table.clone()
    table[1, 3] = f.cache.num_pages
    bad = kernel_variants(f, q, block_table=table, chunk=64)
    for variant in DECODE_VARIANTS:
        assert bad[variant][1].isnan().all() and torch.equal(bad[variant][0], good[0][0])
        assert torch.equal(bits(bad[variant]), bits(bad[0]))
    for variant, out in kernel_variants(f, q, chunk=64).items():  # the default ("auto", 3) among them
        assert torch.equal(bits(out), bits(good[0])), f"variant {variant} after the bad page"


# merge_chunks stages the chunks' factors in shared memory a window at a time: 160 chunks at D = 64, 320 at D = 128
# (its WINDOW: the rings' shared memory over 16 rows, whatever the tile's rows or a thread's items). Chunks of 64
# keys, the smallest, reach the windows' edges at modest lengths.
WINDOW = {64: 160, 128: 320}
CHUNK = 64


def chunks(length):
    return -(-length // CHUNK)


def check_variants(f, q, causal=True, ref=None):
    """kernel_variants with chunks of 64: every variant and the default give variant 0's bits, which meet the float64
    reference (`ref`, or f.reference(q, causal))."""
    outs = kernel_variants(f, q, causal, chunk=CHUNK)
    for variant, out in outs.items():
        assert torch.equal(bits(out), bits(outs[0])), f"variant {variant} differs from the combine kernel"
    error, flipped = forward_error(outs[0], f.reference(q, causal) if ref is None else ref)
    assert error <= FWD_TOL, f"causal={causal}: error {error} ({flipped} rows set aside)"
    return outs


# (head_dim, full chunks, keys after them) of the long sequence: exactly one window, one window and one key (a second
# window of one chunk of one key), exactly two windows
WINDOW_EDGES = {"d64_160": (64, 160, 0), "d64_161": (64, 160, 1), "d64_320": (64, 320, 0),
                "d128_320": (128, 320, 0), "d128_321": (128, 320, 1)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", WINDOW_EDGES)
def test_kernel_merge_window_edges(case):
    # Beside the long sequence, one of a chunk fewer whose last chunk ends mid-unit (59 keys); 4 query heads over
    # one KV head and one token: a tile of 4 rows, whose causal and full attention are the same.
    head_dim, full, extra = WINDOW_EDGES[case]
    n = full + (extra > 0)
    lengths = [full * CHUNK + extra, (n - 1) * CHUNK - 5]
    f = fill(2, 1, head_dim, [(lengths[0], lengths)], device="cuda")
    assert [chunks(length) for length in f.cache.lengths.tolist()] == [n, n - 1]
    q = f.query(4, 1)
    ref = f.reference(q)
    for causal in (True, False):
        check_variants(f, q, causal, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_q, tq", [(16, 1), (8, 2), (16, 2), (4, 1), (3, 1)],
                         ids=["16_rows", "16_rows_2_tokens", "two_tiles_of_16", "4_rows", "3_rows"])
def test_kernel_merge_windows_d128_rows_a_tile(heads_q, tq):
    # D = 128, one KV head, 322 chunks (two windows) beside 11: tiles of 16 rows (4 items a thread, two n-blocks),
    # two such tiles merged by their own last CTAs, tiles of 4 or 3 rows (one item, one n-block). Causal only, as
    # the reference of 16 or 32 rows over 20k keys is most of the test's time (the merge's sums are the same without).
    f = fill(2, 1, 128, [(20600, [20600, 700])], device="cuda")
    assert [chunks(length) for length in f.cache.lengths.tolist()] == [322, 11]
    check_variants(f, f.query(heads_q, tq))


# Causal, 3 query tokens: query t sees keys up to L - 3 + t, so rows t = 0, 1 see no key of a last chunk of one key
# (their frame there is -inf) and row 0 none of a last chunk of two. Lengths (at D = 64; D = 128's window is twice
# as long): 161 chunks (the last, one key, alone in the second window), 160 (the last, one key, ending the first
# window), 161 (the last of two keys), and 2 keys (one chunk; query 0 sees no key at all: 0). One KV head; 4 or 2
# query heads at D = 64 (12 or 6 rows), 2 or 5 at D = 128 (6 or 15 rows).
CAUSAL_EDGES = {"d64_12_rows": (64, 4), "d64_6_rows": (64, 2), "d128_6_rows": (128, 2), "d128_15_rows": (128, 5)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", CAUSAL_EDGES)
def test_kernel_merge_windows_causal_rows_without_keys_in_a_chunk(case):
    head_dim, heads_q = CAUSAL_EDGES[case]
    w, tq = WINDOW[head_dim], 3
    lengths = [w * CHUNK + 1, (w - 1) * CHUNK + 1, w * CHUNK + 2, 2]
    assert [chunks(length) for length in lengths] == [w + 1, w, w + 1, 1]
    blind = [[t for t in range(tq) if length - tq + t < (chunks(length) - 1) * CHUNK] for length in lengths]
    assert blind == [[0, 1], [0, 1], [0], [0]]  # rows of each sequence that see no key of its last chunk
    f = fill(4, 1, head_dim, [(max(lengths), lengths)], device="cuda")
    q = f.query(heads_q, tq)
    out = check_variants(f, q)[0]
    assert not out[3, :, 0].any() and out[3, :, 1:].isfinite().all() and out[:3].isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("where", ["first_window", "second_window", "last_chunk"])
def test_kernel_merge_windows_block_table_outside_the_pool(head_dim, where):
    # 64-token pages, so block-table entry c is chunk c's page. Sequence 1 (two windows) meets a page outside the
    # pool in chunk 3 (its NaN mark must hold for the items summed in the second window), in the second window, or
    # in its last, partial chunk: all its rows NaN in every variant; sequence 0 as without the bad page; the calls
    # after it find the counters at 0 again and give the good output.
    w = WINDOW[head_dim]
    lengths = [(w + 20) * CHUNK - 7, (w + 40) * CHUNK - 7]
    f = fill(2, 1, head_dim, [(lengths[1], lengths)], device="cuda", page_size=CHUNK)
    q = f.query(4, 1)
    good = check_variants(f, q)
    chunk = {"first_window": 3, "second_window": w + 10, "last_chunk": chunks(lengths[1]) - 1}[where]
    for bad_page in (f.cache.num_pages, -1):
        table = f.cache.block_table.clone()
        assert table[1, chunk] >= 0
        table[1, chunk] = bad_page
        bad = kernel_variants(f, q, block_table=table, chunk=CHUNK)
        for variant, out in bad.items():
            assert out[1].isnan().all() and torch.equal(bits(out[0]), bits(good[0][0])), f"variant {variant}"
            assert torch.equal(bits(out), bits(bad[0])), f"variant {variant} differs from the combine kernel"
        for variant, out in kernel_variants(f, q, chunk=CHUNK).items():
            assert torch.equal(bits(out), bits(good[0])), f"variant {variant} after the bad page"


@pytest.mark.gpu
def test_kernel_graph_replays_with_new_lengths():
    # A CUDA graph captured on a fresh stream (the merge's counters for it are allocated during the capture), then
    # replayed with lengths that change each sequence's number of chunks: every replay must find the counters at 0
    # and write every row (the output is poisoned before each replay).
    f = fill(3, 8, 128, [(5000, [5000, 3333, 2000]), (1, None)], device="cuda")
    c = f.cache
    q = f.query(32, 1)
    lengths = c.lengths.clone()
    max_length = max(c.lengths.tolist())  # fixes the chunks, as a graph's baked-in argument does

    def decode():
        return ops.kv_cache_decode(q, c.k_codes, c.k_scales, c.v_codes, c.v_scales, lengths, c.block_table, max_length,
                                   128 ** -0.5, True)

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        out = decode()
    for new in ([5001, 3334, 0], [4000, 65, 1], [5001, 0, 2001], [30, 3334, 2001], [5001, 3334, 2001]):
        lengths.copy_(torch.tensor(new))
        out.fill_(float("nan"))
        graph.replay()
        expected = decode()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(expected)), f"lengths {new}"
        assert out.isfinite().all() and not out[[b for b, n in enumerate(new) if n == 0]].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_store_changes_nothing(device, monkeypatch):
    """A store that fails after the op ran (the op's lengths advanced on the device) leaves the cache as it was:
    lengths on the device and the host, pages, and the next append's positions."""
    f = Filled(2, 2, 64, 64, torch.bfloat16, device, page_size=16)
    f.append(5, [5, 3])
    before = (f.cache.lengths.tolist(), f.cache.free_pages, f.cache.block_table.tolist())
    real_store = NVFP4KVCache._store

    def store_then_fail(self, *args):
        real_store(self, *args)
        raise MemoryError("out of memory")

    monkeypatch.setattr(NVFP4KVCache, "_store", store_then_fail)
    k = torch.zeros(2, 2, 20, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(MemoryError):
        f.cache.append(k, k)
    assert (f.cache.lengths.tolist(), f.cache.free_pages, f.cache.block_table.tolist()) == before
    monkeypatch.undo()
    f.append(4, [4, 4])
    check(f, f.query(4, 1), True, "after a failed store")


# ----------------------------------------------------------------------------------------------
# Static caches: the lengths on the device alone, so a step can be compiled or captured in a CUDA graph


def twins(batch, heads_kv, head_dim, capacity, device, steps, tensor_lengths=False):
    """A host-length cache and a static one filled with the same tokens by `steps` (as `fill`'s); with
    `tensor_lengths` every other per-sequence append gives the static cache its lengths as a device tensor."""
    g = fresh_generator()
    host, static = (Filled(batch, heads_kv, head_dim, capacity, torch.bfloat16, device, static=flag)
                    for flag in (False, True))
    for i, (tokens, lengths) in enumerate(steps):
        k, v = (torch.randn(batch, heads_kv, tokens, head_dim, generator=g).to(torch.bfloat16) for _ in "kv")
        host.append(tokens, lengths, k, v)
        on_device = tensor_lengths and lengths is not None and i % 2
        static.append(tokens, torch.tensor(lengths, device=device) if on_device else lengths, k, v)
    return host, static


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("tq", [1, 5, 17])
def test_static_cache_matches_reference_and_host_length_cache(device, head_dim, tq):
    """The same appends (lists, device tensors) into a static cache store the same bytes and lengths; its attention,
    planned for the whole capacity, matches the reference, and on the CPU the host-length cache bit for bit (the
    composite path's keys past a length are absent)."""
    f, s = twins(3, 2, head_dim, 100, device, UNEQUAL, tensor_lengths=True)
    assert s.cache.capacity == 112 and torch.equal(s.cache.lengths, f.cache.lengths)
    for name in ("k_codes", "k_scales", "v_codes", "v_scales"):
        ours, theirs = getattr(s.cache, name), getattr(f.cache, name)
        for b, n in enumerate(f.cache.lengths.tolist()):  # the rows appended; the rest is never written
            rows = {"k_codes": n, "k_scales": n, "v_codes": (n + 1) // 2, "v_scales": -(-n // 16)}[name]
            assert torch.equal(ours[b, :, :rows], theirs[b, :, :rows]), (name, b)
    for causal in (True, False):
        q = s.query(6, tq)
        out, _ = check(s, q, causal, f"static tq={tq} causal={causal}")
        if device == "cpu":
            assert torch.equal(out, f.cache.attention(q, causal=causal))


@pytest.mark.parametrize("device", DEVICES)
def test_static_cache_reset(device):
    f = Filled(3, 1, 64, 48, torch.bfloat16, device, static=True)
    f.append(30, [30, 12, 5])
    f.cache.reset([0, 2])
    assert f.cache.lengths.tolist() == [0, 12, 0]
    f.k[0], f.v[0], f.k[2], f.v[2] = [], [], [], []
    f.append(9, [9, 4, 1])
    check(f, f.query(2, 1), label="after a partial reset")
    f.cache.reset()
    assert f.cache.lengths.tolist() == [0, 0, 0] and "static=True" in repr(f.cache)


def test_static_cache_misuse():
    with pytest.raises(ValueError, match="unpaged"):
        NVFP4KVCache(2, 1, 64, 64, page_size=16, static=True)
    with pytest.raises(TypeError, match="static"):
        NVFP4KVCache(2, 1, 64, 64, static=1)
    cache = NVFP4KVCache(2, 1, 64, 32, static=True)
    ok = torch.zeros(2, 1, 20, 64, dtype=torch.bfloat16)
    cache.append(ok, ok, lengths=torch.tensor([20, 3]))
    with pytest.raises(RuntimeError, match="capacity of 32"):  # on a GPU: a device-side assert, not tested here
        cache.append(ok, ok)
    assert cache.lengths.tolist() == [20, 3]  # checked before anything is written
    for bad, err, match in [(torch.tensor([21, 0]), RuntimeError, r"\[0, 20\]"),
                            (torch.tensor([-1, 0]), RuntimeError, r"\[0, 20\]"),
                            (torch.tensor([1.0, 2.0]), ValueError, "integer"),
                            (torch.tensor([1, 2, 3]), ValueError, "integer"),
                            ([1, 30], ValueError, "lengths must be in")]:
        with pytest.raises(err, match=match):
            cache.append(ok, ok, lengths=bad)
    assert cache.lengths.tolist() == [20, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_static_step_compiles_once_without_graph_breaks(device):
    """A decode step (append, then attend) on a static cache traces into one graph that later steps reuse: nothing in
    it depends on host state that changes from step to step."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    batch, heads_kv, head_dim = 2, 2, 64
    compiled_cache, eager_cache = (NVFP4KVCache(batch, heads_kv, head_dim, 80, device=device, static=True)
                                   for _ in range(2))

    def step(cache, q, k, v):
        cache.append(k, v)
        return cache.attention(q)

    compiled = torch.compile(step, fullgraph=True, backend="eager" if device == "cpu" else "inductor")
    g = fresh_generator()
    prompt = [torch.randn(batch, heads_kv, 37, head_dim, generator=g).to(torch.bfloat16).to(device) for _ in "kv"]
    for c in (compiled_cache, eager_cache):
        c.append(*prompt, lengths=[37, 21])
    for i in range(6):
        q = torch.randn(batch, 8, 1, head_dim, generator=g).to(torch.bfloat16).to(device)
        k, v = (torch.randn(batch, heads_kv, 1, head_dim, generator=g).to(torch.bfloat16).to(device) for _ in "kv")
        out = compiled(compiled_cache, q, k, v)
        expected = step(eager_cache, q, k, v)
        assert torch.equal(out, expected), i
    assert compiled_cache.lengths.tolist() == [43, 27]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_static_step_replays_in_a_cuda_graph(head_dim):
    """Append and attention on a static cache captured once in a CUDA graph and replayed with new tokens give what the
    same calls give eagerly, bit for bit (one plan: both attend over the capacity), and match the reference."""
    batch, heads_kv, heads_q = 3, 2, 8
    g = fresh_generator()
    graphed, eager = (Filled(batch, heads_kv, head_dim, 300, torch.bfloat16, "cuda", static=True) for _ in range(2))
    prompt = [torch.randn(batch, heads_kv, 150, head_dim, generator=g).to(torch.bfloat16) for _ in "kv"]
    for f in (graphed, eager):
        f.append(150, [150, 37, 1], *prompt)
    q, k, v = (torch.zeros(batch, h, 1, head_dim, dtype=torch.bfloat16, device="cuda")
               for h in (heads_q, heads_kv, heads_kv))
    c = graphed.cache
    c.attention(q)  # a first call outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.append(k, v)
        out = c.attention(q)
    assert c.lengths.tolist() == [150, 37, 1]  # capturing ran nothing
    for step in range(20):  # the short sequences cross 16-token units and the decode plan's chunk edges
        new_q = torch.randn(batch, heads_q, 1, head_dim, generator=g).to(torch.bfloat16).cuda()
        new_k, new_v = (torch.randn(batch, heads_kv, 1, head_dim, generator=g).to(torch.bfloat16) for _ in "kv")
        q.copy_(new_q)
        k.copy_(new_k.cuda())
        v.copy_(new_v.cuda())
        graph.replay()
        eager.append(1, k=new_k, v=new_v)
        expected = eager.cache.attention(new_q)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), step
        assert c.lengths.tolist() == eager.cache.lengths.tolist()
    error, flipped = forward_error(out, eager.reference(new_q))
    assert error <= FWD_TOL, f"error {error} ({flipped} rows set aside)"
