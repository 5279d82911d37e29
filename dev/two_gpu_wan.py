"""Times one Wan training step on one GPU and under Ulysses sequence parallelism over two (dev/two_gpu.sh runs it).

The model is diffusers' WanTransformer3DModel at Wan 2.1 1.3B's width (12 heads of 128, FFN 8960, text_dim
4096) with fewer blocks (--layers, default 6: the 30 of the real model do not fit one H100 without gradient
checkpointing), on a latent video of Wan's 480x832, 81-frame size: 21 x 60 x 104 latents, 32760 tokens, so each
self-attention is Wan 1.3B's (1, 12, 32760, 128). Self-attention runs attn_qat (the examples' attn_qat arm); weights
fp32, autocast bf16, fused AdamW; a step is forward, backward, (the gradient all-reduce,) optimizer step.

Both ranks first time the one-GPU step, each on its own GPU (no communication), then the Ulysses step together:
each GPU holds 16380 of the tokens, and every self-attention runs 6 heads over all 32760. Prints a table (median ms
per step, tokens, peak memory) and the first step's loss of both (same seed, same inputs: they agree to bf16
rounding); writes JSON to --out.

    python3 dev/two_gpu_wan.py [--layers 6] [--frames 21 --height 60 --width 104] [--steps 5] [--out file.json]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_qat  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ffn-dim", type=int, default=8960)
    p.add_argument("--text-dim", type=int, default=4096)
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--height", type=int, default=60, help="latent height (a multiple of 2)")
    p.add_argument("--width", type=int, default=104, help="latent width (a multiple of 2)")
    p.add_argument("--mode", default="attn_qat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON file")
    p.add_argument("--cpu", action="store_true", help="smoke run on the CPU over gloo (use a tiny size)")
    return p.parse_args(argv)


def build(args, device):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=args.heads,
                                  attention_head_dim=args.head_dim, in_channels=16, out_channels=16,
                                  text_dim=args.text_dim, freq_dim=256, ffn_dim=args.ffn_dim, num_layers=args.layers,
                                  rope_max_seq_len=1024).to(device)
    attn_qat.prepare(model, attn_qat.QATConfig(mode=args.mode, strict=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    g = torch.Generator(device=device).manual_seed(1)
    videos = torch.randn(1, 16, args.frames, args.height, args.width, generator=g, device=device)
    noise = torch.randn(videos.shape, generator=g, device=device)
    text = torch.randn(1, args.text_tokens, args.text_dim, generator=g, device=device)
    t = torch.full((1,), 0.6, device=device)
    return model, optimizer, (videos, noise, text, t)


def step(model, optimizer, batch, group=None):
    videos, noise, text, t = batch
    x = (1 - t) * videos + t * noise
    with torch.autocast(videos.device.type, dtype=torch.bfloat16):
        if group is None:
            pred = model(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text).sample
        else:
            with attn_qat.ulysses_wan(model, group):
                pred = model(hidden_states=x, timestep=t * 1000, encoder_hidden_states=text).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise - videos)
    loss.backward()
    if group is not None:
        attn_qat.all_reduce_gradients(model, group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def measure(args, device, group=None):
    """Median ms per step, peak memory (GiB) and the first step's loss; 'OOM' when it does not fit."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        model, optimizer, batch = build(args, device)
        first = step(model, optimizer, batch, group).item()
        for _ in range(args.warmup - 1):
            step(model, optimizer, batch, group)
        times = []
        for _ in range(args.steps):
            if group is not None:
                dist.barrier(group)
            _sync(device)
            start = time.perf_counter()
            step(model, optimizer, batch, group)
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        result = dict(ms=statistics.median(times), ms_all=times, first_loss=first,
                      peak_gib=_peak_gib(device))
    except torch.cuda.OutOfMemoryError:
        result = dict(ms=None, error="OOM", peak_gib=_peak_gib(device))
    model = optimizer = batch = None  # noqa: F841 (free before the next measurement)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def worker(rank, world, port, args, results):
    if args.cpu:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device(f"cuda:{rank}")
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
    try:
        single = measure(args, device)
        dist.barrier()
        ulysses = measure(args, device, dist.group.WORLD)
        gathered = [None] * world
        dist.all_gather_object(gathered, dict(single=single, ulysses=ulysses))
        if rank == 0:
            results.update(enumerate(gathered))
    finally:
        dist.destroy_process_group()


def device_name(args):
    return "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(0)


def main(argv=None):
    args = parse_args(argv)
    if torch.cuda.device_count() < 2 and not args.cpu:
        raise SystemExit("needs 2 CUDA GPUs (or --cpu for a smoke run)")
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.start_processes(worker, args=(world, port, args, shared), nprocs=world, start_method="spawn")
        per_rank = dict(shared)

    tokens = args.frames * (args.height // 2) * (args.width // 2)
    single, ulysses = per_rank[0]["single"], per_rank[0]["ulysses"]
    rows = [("1 GPU (rank 0)", 1, tokens, single), ("1 GPU (rank 1)", 1, tokens, per_rank[1]["single"]),
            ("Ulysses, 2 GPUs", 2, tokens // world, ulysses)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"\nWan step: {args.layers} blocks, {args.heads} heads x {args.head_dim}, FFN {args.ffn_dim} (Wan 2.1 1.3B: "
          f"30 blocks, 12 x 128, 8960), {tokens} video tokens, {args.text_tokens} text tokens, self-attention "
          f"{args.mode}, {device_name(args)}, torch {torch.__version__}")
    print(f"{'run':<18}{'GPUs':>5}{'tokens/GPU':>12}{'ms/step':>10}{'tokens/s':>11}{'peak GiB':>10}{'step-1 loss':>13}")
    for name, gpus, per_gpu, r in rows:
        tok_s = tokens / r["ms"] * 1e3 if r.get("ms") else None
        error = f"  {r['error']}" if "error" in r else ""
        print(f"{name:<18}{gpus:>5}{per_gpu:>12}{fmt(r.get('ms'), '.1f'):>10}{fmt(tok_s, ',.0f'):>11}"
              f"{fmt(r.get('peak_gib'), '.1f'):>10}{fmt(r.get('first_loss'), '.6f'):>13}{error}")
    if single.get("ms") and ulysses.get("ms"):
        memory = (f"; per-GPU peak memory {ulysses['peak_gib'] / single['peak_gib']:.2f}x"
                  if single.get("peak_gib") else "")
        print(f"speed-up {single['ms'] / ulysses['ms']:.2f}x on 2 GPUs{memory}")
    if args.out:
        record = dict(config=vars(args), tokens=tokens, gpu=device_name(args), torch=torch.__version__,
                      commit=os.environ.get("ATTN_QAT_COMMIT"), per_rank=per_rank)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
