"""The C CPU kernels run their (batch, head) items on torch's threads (csrc/cpu/attention_cpu.c): the bits must not
depend on how many there are (torch.set_num_threads sets them)."""
import pytest
import torch

import attn_qat


@pytest.fixture
def torch_threads():
    """torch.set_num_threads for one test, undone when it ends."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _inputs(b, hq, hkv, nq, nk, d, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, n: torch.randn(b, h, n, d, generator=g).bfloat16().requires_grad_()  # noqa: E731
    return make(hq, nq), make(hkv, nk), make(hkv, nk), torch.randn(b, hq, nq, d, generator=g).bfloat16()


def _run(threads, set_threads, call, q, k, v, dout):
    set_threads(threads)
    for t in (q, k, v):
        t.grad = None
    out = call(q, k, v)
    out.backward(dout)
    return [out.detach().clone()] + [t.grad.clone() for t in (q, k, v)]


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim): items that outnumber the threads, GQA groups whose dK/dV
# sum over several query heads, one item, awkward lengths
SHAPES = [(2, 8, 2, 77, 93, 64), (1, 6, 1, 40, 130, 128), (1, 1, 1, 33, 17, 64), (3, 4, 4, 50, 50, 64)]
CALLS = {
    "causal": lambda q, k, v: attn_qat.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    "mask": lambda q, k, v: attn_qat.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.rand(q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(3)) > 0.3,
        enable_gqa=True),
    "high_precision_p": lambda q, k, v: attn_qat.attention(q, k, v, layout="bhsd", mode="high_precision_p"),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("call", CALLS)
def test_one_thread_and_many_give_the_same_bits(torch_threads, shape, call):
    q, k, v, dout = _inputs(*shape, seed=sum(shape))
    one = _run(1, torch_threads, CALLS[call], q, k, v, dout)
    many = _run(4, torch_threads, CALLS[call], q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), one, many):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name
    assert all(bool(t.isfinite().all()) for t in one)


def test_packed_sequences_same_bits_on_any_thread_count(torch_threads):
    q, k, v, dout = (t.detach()[0].transpose(0, 1).contiguous() for t in _inputs(1, 4, 2, 70, 70, 64, seed=7))
    dout = dout.detach()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, 20, 21, 70], dtype=torch.int32)
    call = lambda q, k, v: attn_qat.attention_varlen(q, k, v, cu, cu, 49, 49, causal=True)  # noqa: E731
    one, many = _run(1, torch_threads, call, q, k, v, dout), _run(3, torch_threads, call, q, k, v, dout)
    assert all(torch.equal(a, b) for a, b in zip(one, many))

