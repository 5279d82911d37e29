"""`python -m attn_qat`: print the environment, check the kernels against the float64 reference on
every device present, and show what 4-bit attention does to the output of a realistic attention."""
import os
import platform
import sys
import time

import torch

import attn_qat
from attn_qat import _C, reference


REBUILD_WITH_CUDA = "ATTN_QAT_CUDA=1 python -m pip install --no-build-isolation -e ."


def environment():
    print(f"attn_qat {attn_qat.__version__}  torch {torch.__version__}  python {platform.python_version()}")
    gpu = torch.cuda.is_available()
    if _C.with_cuda:
        print("  CUDA kernels built: yes (sm_90a)")
    elif gpu:
        print("  CUDA kernels built: NO: this build has the C CPU kernels only, so the GPU below goes unused; "
              f"rebuild with them\n    (needs nvcc): {REBUILD_WITH_CUDA}")
    else:
        print("  CUDA kernels built: no (the C CPU kernels only: the default build skips the CUDA kernels where no "
              f"GPU is visible);\n    to build them anyway (needs nvcc): {REBUILD_WITH_CUDA}")
    if gpu:
        p = torch.cuda.get_device_properties(0)
        print(f"  GPU: {p.name}, compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
    else:
        print("  GPU: none (running on the CPU)")


def rel_error(out, ref):
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def self_check(device: str, seed: int) -> bool:
    """Quantizer bit-exactness and attention forward/backward against attn_qat.reference."""
    g = torch.Generator().manual_seed(seed)
    ok = True

    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 128)
    fq = attn_qat.fake_quantize(x.to(device)).cpu()
    exact = torch.equal(fq, reference.fake_quantize(x).float())
    ok &= exact
    print(f"  [{device}] NVFP4 fake-quantize bit-exact vs reference: {'yes' if exact else 'NO'}")

    b, hq, hkv, nq, nk, d = 1, 4, 2, 77, 93, 64
    q = torch.randn(b, hq, nq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, hkv, nk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, hkv, nk, d, generator=g).to(torch.bfloat16)
    dout = torch.randn(b, hq, nq, d, generator=g).to(torch.bfloat16)
    qd, kd, vd = (t.detach().clone().to(device).requires_grad_() for t in (q, k, v))
    out = attn_qat.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
    out.backward(dout.to(device))
    ref = reference.attention_forward(q, k, v, causal="top_left")["out"]
    grads = reference.attention_backward(q, k, v, dout, causal="top_left")
    err_fwd = rel_error(out.detach(), ref)
    err_bwd = max(rel_error(t.grad, r) for t, r in zip((qd, kd, vd), grads))
    passed = err_fwd <= 3e-3 and err_bwd <= 1e-2
    ok &= passed
    print(f"  [{device}] attention (GQA 4/2 heads, causal, Nq={nq}, Nk={nk}, D={d}): forward rel. error "
          f"{err_fwd:.1e} (<= 3e-3), backward {err_bwd:.1e} (<= 1e-2): {'ok' if passed else 'FAILED'}")

    # Decode on a paged NVFP4 KV cache: two sequences of unequal lengths in 16-token pages, one query token.
    lengths = (45, 30)
    kc = torch.randn(2, hkv, max(lengths), d, generator=g).to(torch.bfloat16)
    vc = torch.randn(2, hkv, max(lengths), d, generator=g).to(torch.bfloat16)
    qc = torch.randn(2, hq, 1, d, generator=g).to(torch.bfloat16)
    cache = attn_qat.NVFP4KVCache(2, hkv, d, 64, page_size=16, device=device)
    cache.append(kc.to(device), vc.to(device), lengths=list(lengths))
    out = cache.attention(qc.to(device))
    err_dec = 0.0
    for i, n in enumerate(lengths):  # the cache holds K^F and V^F, both blocked along head_dim
        ref = reference.attention_forward(qc[i][None], kc[i, :, :n][None], vc[i, :, :n][None],
                                          causal="bottom_right")["out"][0]
        err_dec = max(err_dec, rel_error(out[i], ref))
    passed = err_dec <= 3e-3
    ok &= passed
    print(f"  [{device}] decode on a paged NVFP4 KV cache (lengths {lengths}, 16-token pages): rel. error "
          f"{err_dec:.1e} (<= 3e-3): {'ok' if passed else 'FAILED'}")
    return ok


DEMO_SEED = 0


def demo(device: str):
    """FP4 attention against exact attention on inputs with the structure of real attention: keys that
    share a direction with some queries, so softmax rows are peaked rather than uniform."""
    g = torch.Generator().manual_seed(DEMO_SEED)
    b, h, n, d = (1, 8, 4096, 128) if device == "cuda" else (1, 2, 512, 128)
    topics = torch.randn(16, d, generator=g)
    q = topics[torch.randint(0, 16, (b, h, n), generator=g)] + 0.5 * torch.randn(b, h, n, d, generator=g)
    k = topics[torch.randint(0, 16, (b, h, n), generator=g)] + 0.5 * torch.randn(b, h, n, d, generator=g)
    v = torch.randn(b, h, n, d, generator=g)
    q, k, v = (t.to(device, torch.bfloat16) for t in (q, k, v))
    exact = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    print(f"  [{device}] 4-bit attention vs exact attention, (B, H, N, D) = {(b, h, n, d)}, seed {DEMO_SEED}:")
    for mode in ("bf16", "attn_qat"):
        out = attn_qat.scaled_dot_product_attention(q, k, v, mode=mode).float()
        cos = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0)
        print(f"    mode={mode:9s} cosine similarity {float(cos):.5f}, relative error {rel_error(out, exact):.3e}")
    print("    An error of ~20% for attn_qat is expected: it is 4-bit quantization of Q, K, V and P, not a bug (the "
          "self-check above\n    shows the kernels match the reference). QAT training teaches a model to work "
          "with this error; see below.")
    if device == "cuda":
        flops = 4 * b * h * n * n * d
        for name, fn in (("attn_qat", lambda: attn_qat.scaled_dot_product_attention(q, k, v)),
                         ("torch SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 10
            print(f"    {name:10s} forward {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (benchmarks/ has the real numbers)")


def main() -> int:
    environment()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _C.with_cuda else [])
    # fresh inputs every run, unless ATTN_QAT_SEED repeats a run's
    seed = int(os.environ.get("ATTN_QAT_SEED") or time.time())
    print(f"Self-check against attn_qat.reference (float64, numerics.md), seed {seed} (ATTN_QAT_SEED={seed} "
          "repeats it):")
    ok = all([self_check(dev, seed) for dev in devices])
    print("Demo:")
    demo(devices[-1])
    print("Training with FP4 attention: examples/train_lm.py (Qwen3) and examples/train_wan.py (Wan 2.1); "
          "measured results in docs/results.md.")
    print("Self-check passed." if ok else "Self-check FAILED.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
