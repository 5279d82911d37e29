"""Ulysses sequence parallelism over two processes (gloo on the CPU; NCCL on two GPUs where present):
`ulysses_attention` against one process's `attn_qat.attention` on the whole sequence, and one training step of
the examples' tiny Wan 2.1 model under `ulysses_wan` against the same step in one process.

Each rank computes the one-process reference itself (same seed, same full inputs), so a worker checks its own
slice of the outputs and gradients."""
import copy
import importlib.util
import os
import pathlib
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attn_qat
from attn_qat.integrations import sequence_parallel
from conftest import importorskip, rel_error

REPO = pathlib.Path(__file__).resolve().parents[1]

# One Wan step, sharded against whole. The loss is the same to the bit on the CPU (every per-token layer computes a
# token's row alike whether it sees 16 tokens or 32, and the attention is the one-process attention). The
# gradients of weights that sum over tokens are not: each rank sums its 16 tokens' contributions in bf16 (autocast)
# and the halves are added in fp32, one bf16 rounding (2^-8 = 3.9e-3) that one process does not make. Measured on
# the CPU: at most 5.5e-3 relative (the condition embedder's, which sums over every token); the whole gradient
# 2.2e-3. On the GPU the per-token matmuls may also round differently (other kernels for 16 rows than for 32) and FP4
# turns an odd ulp into a step of Q, K, V or P: a looser bound there until dev/two_gpu.sh has measured it.
WAN_TOL = {"cpu": dict(loss=1e-5, grad=1e-2, total=5e-3), "cuda": dict(loss=1e-3, grad=3e-2, total=1e-2)}

# (batch, query tokens, key tokens, query heads, KV heads, head_dim, attention kwargs); tokens over both ranks
ATTENTION_CASES = [
    (2, 64, 64, 4, 4, 64, dict()),
    (1, 64, 64, 4, 2, 128, dict(causal=True)),                               # GQA, KV heads split
    (1, 48, 80, 4, 2, 64, dict(causal=True, return_lse=True)),                # bottom-right causal, Nq != Nk
    (1, 64, 64, 4, 4, 64, dict(mode="bf16", softmax_scale=0.1, return_lse=True)),
    (1, 64, 64, 4, 4, 64, dict(mode="high_precision_p", v_block_axis="head_dim")),
    (1, 64, 64, 4, 1, 64, dict(return_lse=True)),                             # KV heads replicated (H_kv < P)
]


def _device(rank, backend):
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device(f"cuda:{rank}")
    return torch.device("cpu")


def _check_attention(rank, world, device):
    """Output, LSE and dQ of every case bit for bit; dK and dV too unless KV heads are replicated (then each rank's
    partial sum is rounded to bf16 before the two are added)."""
    for b, nq, nk, hq, hkv, d, kwargs in ATTENTION_CASES:
        label = f"case {(b, nq, nk, hq, hkv, d, kwargs)}"
        g = torch.Generator().manual_seed(1234 + nq + hkv + d)
        q = (torch.randn(b, nq, hq, d, generator=g) * 1.5).to(device, torch.bfloat16).requires_grad_()
        k = torch.randn(b, nk, hkv, d, generator=g).to(device, torch.bfloat16).requires_grad_()
        v = torch.randn(b, nk, hkv, d, generator=g).to(device, torch.bfloat16).requires_grad_()
        dout = torch.randn(b, nq, hq, d, generator=g).to(device, torch.bfloat16)

        full = attn_qat.attention(q, k, v, **kwargs)
        full_out, full_lse = full if kwargs.get("return_lse") else (full, None)
        full_out.backward(dout)

        mq, mk = nq // world, nk // world
        sq, sk = slice(rank * mq, (rank + 1) * mq), slice(rank * mk, (rank + 1) * mk)
        q_loc, k_loc, v_loc = (t.detach()[:, s].clone().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        part = attn_qat.ulysses_attention(q_loc, k_loc, v_loc, **kwargs)
        out, lse = part if kwargs.get("return_lse") else (part, None)
        out.backward(dout[:, sq])

        assert out.shape == q_loc.shape and out.dtype == q.dtype, label
        assert torch.equal(out, full_out[:, sq]), f"{label}: output, rel error {rel_error(out, full_out[:, sq])}"
        if lse is not None:
            assert torch.equal(lse, full_lse[:, :, sq]), f"{label}: LSE"
        assert torch.equal(q_loc.grad, q.grad[:, sq]), f"{label}: dQ, rel error {rel_error(q_loc.grad, q.grad[:, sq])}"
        for name, mine, ref in (("dK", k_loc.grad, k.grad[:, sk]), ("dV", v_loc.grad, v.grad[:, sk])):
            if hkv % world == 0:
                assert torch.equal(mine, ref), f"{label}: {name}, rel error {rel_error(mine, ref)}"
            else:
                assert rel_error(mine, ref) < 1e-2, f"{label}: {name}, rel error {rel_error(mine, ref)}"

    q = torch.zeros(1, 8, 3, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="query heads"):
        attn_qat.ulysses_attention(q, q, q)
    q = torch.zeros(1, 8, 6, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="neither split among nor replicated"):
        attn_qat.ulysses_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(ValueError, match="layout"):
        attn_qat.ulysses_attention(q, q, q, layout="bhsd")


def _wan_step(model, batch, autocast_device):
    """The examples' flow-matching loss on the whole batch, and its backward."""
    videos, noise, t, captions = batch
    tb = t.view(-1, 1, 1, 1, 1)
    with torch.autocast(autocast_device, dtype=torch.bfloat16):
        pred = model(hidden_states=(1 - tb) * videos + tb * noise, timestep=t * 1000,
                     encoder_hidden_states=captions).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise - videos)
    loss.backward()
    return loss.detach()


def _check_wan(rank, world, device):
    """One training step of the examples' tiny Wan 2.1 (32 video tokens, 16 per rank; self- and text
    cross-attention in attn_qat, as train_wan.py's attn_qat arm with --cross-attention) under ulysses_wan against
    the step in one process: loss and every parameter gradient, the gradients summed over the ranks; the same with
    gradient checkpointing; the hooks' removal and the refusals."""
    sys.path.insert(0, str(REPO / "examples"))
    import train_wan

    args = train_wan.parse_args(["--size", "tiny", "--device", str(device)])
    config = attn_qat.QATConfig(mode="attn_qat", cross_attention=True, strict=True)
    model = attn_qat.prepare(train_wan.build_model(args), config)
    sharded = copy.deepcopy(model)
    gen = torch.Generator(device=device).manual_seed(7)
    videos, captions = train_wan.VideoSource(args.dims, map_seed=2, device=device).sample(2, gen)
    batch = (videos, torch.randn(videos.shape, generator=gen, device=device),
             torch.sigmoid(torch.randn(2, generator=gen, device=device)), captions)

    loss = _wan_step(model, batch, device.type)
    with attn_qat.ulysses_wan(sharded):
        sharded_loss = _wan_step(sharded, batch, device.type)
    attn_qat.all_reduce_gradients(sharded)
    tol = WAN_TOL[device.type]
    assert rel_error(sharded_loss, loss) < tol["loss"], f"loss {sharded_loss.item()} vs {loss.item()}"
    # A key bias adds q.b to every score of a row, which softmax ignores: its exact gradient is 0, and what autograd
    # computes for it is rounding noise, with no relative error to speak of.
    grads = {name: (p.grad, r.grad) for (name, p), r in zip(sharded.named_parameters(), model.parameters())
             if not name.endswith("to_k.bias")}
    assert all(g is not None and r is not None for g, r in grads.values())
    errors = {name: rel_error(g, r) for name, (g, r) in grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol["grad"], f"gradient of {worst}: rel error {errors[worst]}"
    total = rel_error(torch.cat([g.flatten() for g, _ in grads.values()]),
                      torch.cat([r.flatten() for _, r in grads.values()]))
    assert total < tol["total"], f"all gradients: rel error {total}"

    # Gradient checkpointing recomputes each block in the backward, through the hooks: so inside the with block,
    # and then the same step to the bit.
    checkpointed = copy.deepcopy(model)
    checkpointed.zero_grad(set_to_none=True)
    checkpointed.enable_gradient_checkpointing()
    with attn_qat.ulysses_wan(checkpointed):
        assert torch.equal(_wan_step(checkpointed, batch, device.type), sharded_loss)
    attn_qat.all_reduce_gradients(checkpointed)
    for (name, p), c in zip(sharded.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, c.grad), f"gradient checkpointing changed the gradient of {name}"

    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        x = batch[0]
        whole = model(hidden_states=x, timestep=batch[2] * 1000, encoder_hidden_states=captions).sample
        # the hooks are gone after the with block
        assert torch.equal(sharded(hidden_states=x, timestep=batch[2] * 1000, encoder_hidden_states=captions).sample,
                           whole)
        # a self-attention that bypasses attn_qat would attend over one rank's tokens: refused
        attn_qat.disable(sharded)
        with pytest.raises(RuntimeError, match="ran without attn_qat"), attn_qat.ulysses_wan(sharded):
            sharded(hidden_states=x, timestep=batch[2] * 1000, encoder_hidden_states=captions)
        attn_qat.enable(sharded)
        with pytest.raises(ValueError, match="do not divide"), attn_qat.ulysses_wan(sharded):
            sharded(hidden_states=x[:, :, :1, :6, :6], timestep=batch[2] * 1000, encoder_hidden_states=captions)
        assert sequence_parallel.current() is None


def _worker(rank, world, port, backend, parts, out):
    """Runs the parts in order on one rank and leaves `rank<r>.<part>.ok` in `out` for each part that passed; the
    first failure ends the rank (and the launcher ends the other, which may wait in a collective)."""
    torch.set_num_threads(1)
    # Bit-exact GPU attention needs the same reduction order in both calls: dQ summed without atomics, and no split
    # of a grid's last wave (which depends on the grid, so on the number of heads). Both are no-ops on the CPU.
    attn_qat.ops.kernel_options(tail_split=0)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = _device(rank, backend)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for part in parts:
            {"attention": _check_attention, "wan": _check_wan}[part](rank, world, device)
            dist.barrier()
            (pathlib.Path(out) / f"rank{rank}.{part}.ok").touch()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as in test_distributed.py: skip the interpreter's finalization, where gloo's threads may abort


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(backend, parts, out, world=2, timeout_s=180.0):
    """Both parts in one pair of processes (each process imports torch, attn_qat and diffusers once: most of the
    CPU run's time). Returns the first failure's traceback, or None."""
    hidden = backend == "gloo" and "CUDA_VISIBLE_DEVICES" not in os.environ
    if hidden:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        context = mp.start_processes(_worker, args=(world, _free_port(), backend, parts, str(out)), nprocs=world,
                                     join=False, start_method="spawn")
    finally:
        if hidden:
            del os.environ["CUDA_VISIBLE_DEVICES"]
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):  # re-raises a worker's exception with its traceback
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                return f"the ranks did not finish in {timeout_s:.0f} s"
    except Exception as error:  # noqa: BLE001 (reported by the tests of the parts that did not pass)
        return str(error)
    return None


BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.gpu(2)),
]


@pytest.fixture(scope="module", params=BACKENDS)
def two_ranks(request, tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    parts = ["attention"] + (["wan"] if importlib.util.find_spec("diffusers") is not None else [])
    out = tmp_path_factory.mktemp(f"ulysses_{request.param}")
    return out, _launch(request.param, parts, out)


def _passed(two_ranks, part, world=2):
    out, error = two_ranks
    if not all((out / f"rank{rank}.{part}.ok").exists() for rank in range(world)):
        pytest.fail(f"{part} did not pass on every rank:\n{error}")


@pytest.mark.slow
def test_ulysses_attention(two_ranks):
    _passed(two_ranks, "attention")


@pytest.mark.slow
def test_wan_training_step(two_ranks):
    importorskip("diffusers")
    _passed(two_ranks, "wan")


def test_one_process_is_plain_attention():
    """Without torch.distributed there is one rank: ulysses_attention is attention."""
    q = torch.randn(1, 32, 2, 64, dtype=torch.bfloat16)
    assert torch.equal(attn_qat.ulysses_attention(q, q, q, causal=True), attn_qat.attention(q, q, q, causal=True))
