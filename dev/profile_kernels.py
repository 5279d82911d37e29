"""Where the time goes: per-kernel CUDA time (torch.profiler) of one attn_qat training forward + backward and one
inference forward, at one shape (default the Wan 2.1 14B self-attention).

    python dev/profile_kernels.py [--shape B,H,N,D] [--kv-heads H_kv] [--causal] [--mode attn_qat|bf16]
"""
import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import attn_qat


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1,40,32760,128")
    parser.add_argument("--kv-heads", type=int, default=None, help="grouped KV heads (default: H)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--mode", default="attn_qat")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps (the table averages over calls)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_kernels needs a CUDA GPU")
    b, h, n, d = (int(x) for x in args.shape.split(","))
    h_kv = args.kv_heads or h
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, h_kv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)

    def step():
        out = attn_qat.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=h_kv != h,
                                                   mode=args.mode)
        torch.autograd.grad(out, (q, k, v), dout)
        with torch.no_grad():
            attn_qat.scaled_dot_product_attention(q, k, v, is_causal=args.causal, enable_gqa=h_kv != h, mode=args.mode)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(f"shape (B, H, H_kv, N, D) = {(b, h, h_kv, n, d)}, causal {args.causal}, mode {args.mode}: {args.steps} x (one training forward + backward, one inference forward)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=90))


if __name__ == "__main__":
    main()
