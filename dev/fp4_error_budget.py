"""Which operand of FP4 attention costs the pretrained SmolLM2 its held-out loss (issue 29's PTQ gap, by part).

SmolLM2-135M (examples/finetune_lm.py's GGUF and held-out windows), bf16 weights under bf16 autocast, no training:
the held-out loss with the model's attention replaced by an fp32 emulation of docs/numerics.md that quantizes
only some of Q, K, V and P (blocks of 16; K and Q along head_dim, V along head_dim as in causal calls, P in blocks
of 16 keys with the 2^11 headroom and the integer frame), beside the real attn_qat kernels (PTQ). Also: K
shifted by a per-(layer, KV head) channel mean before quantization, measured once on training windows (fixed, so
no key's value reaches another query's scale; softmax is exactly invariant to the shift, only the rounding moves),
and Q and K both rotated by one random-sign Hadamard matrix along head_dim (q.k unchanged in exact arithmetic).

    python dev/fp4_error_budget.py --gguf PATH [--windows 128] [--calibration 16]
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import attn_qat  # noqa: E402
import finetune_lm as lm  # noqa: E402
from attn_qat import reference  # noqa: E402
from attn_qat.transforms import qk_rotation  # noqa: E402

NAME = "fp4_budget"
# what the emulation quantizes: set by main() before each evaluation
STATE = {"parts": frozenset(), "k_shift": None, "collect": None, "rotation": None}


def quantized_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention in fp32 with the parts in STATE["parts"] fake-quantized (numerics.md §1-§3)."""
    parts, layer = STATE["parts"], module.layer_idx
    q, k, v = query.float(), key.float(), value.float()
    if STATE["collect"] is not None:
        STATE["collect"].setdefault(layer, []).append(k.mean(dim=2).sum(0).double())  # (Hkv, D) sums of means
    if STATE["k_shift"] is not None:
        k = k - STATE["k_shift"][layer].to(k.device)[None, :, None, :]
    if STATE["rotation"] is not None:  # q.k unchanged: the rotation is orthogonal
        q, k = q @ STATE["rotation"], k @ STATE["rotation"]
    out = fake_quant_attention(q, k, v, parts, scaling)
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def fake_quant(x):
    """x fake-quantized in blocks of 16 along its last axis (reference.fake_quantize), float32; where x needs a
    gradient, the straight-through one (identity), as attn_qat's backward passes through the rounding (numerics.md
    §4). The values are the rounding's either way, up to one float32 rounding of x + (fq(x) - x) with a gradient."""
    y = reference.fake_quantize(x.detach(), -1).float()
    return x + (y - x).detach() if x.requires_grad else y


def fake_quant_attention(q, k, v, parts, scaling=None, q_block=None):
    """Causal attention, (B, H, N, D) float32, of float32 q (B, H, N, D) and k, v (B, H_kv, N, D), with the operands
    named in `parts` ("q", "k", "v", "p") fake-quantized as numerics.md §1-§3 say; q_block: fake_quant_scores'."""
    n, d = q.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    if "v" in parts:
        v = fake_quant(v)
    v = v.repeat_interleave(group, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    t = fake_quant_scores(q, k, parts, q_block) * (scale * math.log2(math.e))
    hidden = torch.ones(n, n, dtype=torch.bool, device=t.device).triu(1)
    t = t.masked_fill(hidden, -math.inf)
    frame = torch.ceil(t.amax(-1, keepdim=True))
    w = torch.exp2(t - (frame - 11.0))  # P̂ * 2^11; hidden keys 0
    l = w.sum(-1, keepdim=True)
    if "p" in parts:
        pad = (-n) % 16
        wp = F.pad(w, (0, pad)) if pad else w
        w = fake_quant(wp)[..., :n]
    return torch.matmul(w, v) / l


def fake_quant_scores(q, k, parts, q_block=None):
    """The unscaled scores q kᵀ (B, H, N, N) of q (B, H, N, D) and k (B, H_kv, N, D), with "q" and "k" of `parts`
    fake-quantized along head_dim.

    q_block: Q smoothing as in SageAttention2. Per block of q_block consecutive query rows of one head, q̄ = the
    block's mean query (per channel); the scores become fq(q - q̄) fq(k)ᵀ + q̄ fq(k)ᵀ, the second term in q's
    precision with q̄ unquantized: exact when nothing is quantized, and one extra row of scores per block."""
    n, group = q.shape[2], q.shape[1] // k.shape[1]
    if q_block is not None:
        q_mean = torch.stack([b.mean(2) for b in q.split(q_block, dim=2)], 2)  # (B, H, ceil(N / q_block), D)
        q = q - q_mean.repeat_interleave(q_block, dim=2)[:, :, :n]
    if "q" in parts:
        q = fake_quant(q)
    if "k" in parts:
        k = fake_quant(k)
    k = k.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2))
    if q_block is not None:  # + q̄ kᵀ, one row per block shared by its queries
        s = s + torch.matmul(q_mean, k.transpose(-1, -2)).repeat_interleave(q_block, dim=2)[:, :, :n]
    return s


def query_dim(model):
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@torch.no_grad()
def heldout_loss(model, stream, starts, batch, seq_len, device):
    losses = []
    for chunk in starts.split(batch):
        windows = lm.gather_windows(stream, chunk, seq_len + 1).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(input_ids=windows[:, :-1], use_cache=False).logits
        losses.append(F.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:], reduction="none").mean(1))
    return torch.cat(losses).double().cpu()


def load_experiment(args, name, attention):
    """The pretrained model (args.gguf on args.device, `attention` registered as the attention implementation
    `name`, not yet selected), the training token stream, and a function returning the held-out losses per window
    (args.windows windows of args.seq_len tokens, evenly spaced over the held-out files)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    model, tokenizer = lm.load_gguf_model(args.gguf, lm.GGUF_SHA256, torch.bfloat16, args.device)
    model.eval()
    root = lm.stdlib_root()
    train_files, heldout_files = lm.corpus_files(root)
    heldout, _ = lm.tokenize_files(tokenizer, root, heldout_files)
    train, _ = lm.tokenize_files(tokenizer, root, train_files)
    starts = lm.evenly_spaced(len(heldout), args.windows, args.seq_len + 1)
    return model, train, lambda: heldout_loss(model, heldout, starts, args.batch, args.seq_len, args.device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--windows", type=int, default=128, help="held-out windows (finetune_lm's are 256)")
    parser.add_argument("--calibration", type=int, default=16, help="training windows for the K channel means")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=None, help="JSON of the results")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model, train, run = load_experiment(args, NAME, quantized_attention)

    results = {}
    original = model.config._attn_implementation
    base = run()
    results["bf16 (model's own attention)"] = base
    model.set_attn_implementation(NAME)
    # the channel means of K from training windows, in the model's own (unquantized) attention
    STATE.update(parts=frozenset(), collect={})
    heldout_loss(model, train, lm.evenly_spaced(len(train), args.calibration, args.seq_len + 1), args.batch,
                 args.seq_len, args.device)
    shift = {layer: torch.stack(v).sum(0).float() / args.calibration for layer, v in STATE["collect"].items()}
    STATE["collect"] = None
    variants = [("none (emulation, fp32)", ""), ("Q", "q"), ("K", "k"), ("V", "v"), ("P", "p"), ("Q K", "qk"),
                ("Q K V", "qkv"), ("Q K V P (emulated attn_qat)", "qkvp")]
    for label, parts in variants:
        STATE.update(parts=frozenset(parts), k_shift=None)
        results[label] = run()
    for label, parts in [("K, shifted by its channel means", "k"), ("Q K V P, K shifted", "qkvp")]:
        STATE.update(parts=frozenset(parts), k_shift=shift)
        results[label] = run()
    STATE.update(rotation=qk_rotation(query_dim(model), args.device))
    for label, parts, k_shift in [("Q K, rotated", "qk", None), ("Q K V P, Q K rotated", "qkvp", None),
                                  ("Q K V P, Q K rotated, K shifted", "qkvp", shift)]:
        STATE.update(parts=frozenset(parts), k_shift=k_shift)
        results[label] = run()
    STATE.update(parts=frozenset(), k_shift=None, rotation=None)
    model.set_attn_implementation(original)
    attn_qat.prepare(model, attn_qat.QATConfig(mode="attn_qat", strict=True))
    results["attn_qat kernels (PTQ)"] = run()

    gen = torch.Generator().manual_seed(0)
    boot = torch.randint(0, len(base), (2000, len(base)), generator=gen)
    rows = []
    print(f"held-out windows {len(base)} x {args.seq_len} tokens; loss gap vs bf16 with a paired bootstrap 95% CI")
    print("| quantized | held-out loss | gap vs bf16 [95% CI] | gap % |\n|---|---|---|---|")
    for label, losses in results.items():
        gap = losses - base
        means = gap[boot].mean(1)
        lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype)).tolist()
        rows.append({"quantized": label, "loss": float(losses.mean()), "gap": float(gap.mean()), "ci": [lo, hi]})
        print(f"| {label} | {losses.mean():.4f} | {gap.mean():+.4f} [{lo:+.4f}, {hi:+.4f}] | "
              f"{100 * gap.mean() / base.mean():+.2f}% |")
    if args.out:
        meta = {"commit": os.environ.get("ATTN_QAT_COMMIT"), "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "torch": torch.__version__, "windows": len(base),
                "seq_len": args.seq_len, "calibration_windows": args.calibration}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
