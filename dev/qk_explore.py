"""Other score-preserving transforms of Q and K than numerics.md §9's, ranked by the FP4 loss gap they leave.

dev/fp4_error_budget.py's emulation (fp32 attention, only the chosen operands fake-quantized) on the pretrained
SmolLM2, with Q and K passed through candidate transforms that keep every score q.k exactly (in exact arithmetic):

- per-channel balancing (SmoothQuant-like): q_c * s_c and k_c / s_c, s_c = (max|k_c| / max|q_c|)^alpha per (layer,
  KV head, channel), the query heads of a KV group sharing s (q.k = sum_c (q_c s_c)(k_c / s_c));
- the K shift of numerics.md §9 (softmax cancels q.mu), taken in the balanced frame (mean of k / s = mu / s);
- an orthogonal R on both (q.k = (qR).(kR)): §9's random-sign Hadamard, other sign seeds, a random orthogonal
  matrix (QR of a Gaussian), one per (layer, KV head), or a channel permutation (also orthogonal).
- Q smoothing (SageAttention2) after the transform: per block of B consecutive query rows (B = 128, the Hopper
  kernel's query tile, or 64), the block's mean query q̄ is taken out before Q's rounding and q̄ fq(k)ᵀ added back
  unquantized (fp4_error_budget.fake_quant_scores).
- learned (--learn-steps N): balance alpha (--learn-alpha) + shift + Hadamard as QATConfig(learn_qk_transforms=True)
  trains it, s = s_alpha exp(delta) and R = H exp(A - Aᵀ) per layer (attn_qat.transforms.learned_rotation), delta
  and A starting at 0 (the fixed transform, bit for bit) and trained alone (the model frozen) with Adam on training
  windows, the fake-quant loss (parts "qkvp", straight-through gradients through the rounding). Then evaluated on
  the held-out windows like every candidate; a second table gives each learned candidate minus its fixed start.

Order: balance, shift, rotate. Every candidate runs in one process against "none" and the baseline "rotation + K
shift" on the same windows; the table gives each gap vs bf16 and each candidate's difference from the baseline,
both with paired bootstrap 95% intervals. Few windows on a CPU: the numbers rank candidates, nothing more.

    python dev/qk_explore.py --gguf PATH --device cpu --windows 16 --seq-len 512 --calibration 8
    python dev/qk_explore.py --gguf PATH --device cpu --windows 16 --seq-len 256 --parts qkvp --only "balance a=0.3 \
        + shift + rotation" --calibration-more 0 --learn-steps 40
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_error_budget as budget  # noqa: E402
lm = budget.lm
from attn_qat.transforms import learned_rotation, qk_rotation  # noqa: E402

NAME = "qk_explore"
# parts: what is fake-quantized; transform: a Transform or None; collect: dict filled by calibration or None
STATE = {"parts": frozenset(), "transform": None, "collect": None}


class Transform:
    """Per layer: scale (H_kv, D) or None, shift (H_kv, D) in the scaled frame or None, rotation (D, D) or
    (H_kv, D, D) or None. Q' = (Q * s) R, K' = (K / s - shift) R. q_block: Q smoothing after the transform
    (fp4_error_budget.fake_quant_attention's q_block: the block's mean query is taken out before Q's rounding and
    its scores added back unquantized), or None."""

    def __init__(self, scale=None, shift=None, rotation=None, q_block=None):
        self.scale, self.shift, self.rotation, self.q_block = scale, shift, rotation, q_block

    def __call__(self, layer, q, k):
        group = q.shape[1] // k.shape[1]
        if self.scale is not None:
            s = self.scale[layer].to(q.device)
            q = q * s.repeat_interleave(group, 0)[None, :, None, :]
            k = k / s[None, :, None, :]
        if self.shift is not None:
            k = k - self.shift[layer].to(k.device)[None, :, None, :]
        if self.rotation is not None:
            r = self.rotation(layer) if callable(self.rotation) else self.rotation
            r = r.to(q.device)
            if r.dim() == 2:
                q, k = q @ r, k @ r
            else:  # one matrix per KV head, shared by its query heads
                q = torch.einsum("bhnd,hde->bhne", q, r.repeat_interleave(group, 0))
                k = torch.einsum("bhnd,hde->bhne", k, r)
        return q, k


class LearnedTransform(torch.nn.Module):
    """Transform(scale, scaled_shift(mu, scale), Hadamard) with s = scale exp(delta[layer]) (learn_balance) and R =
    learned_rotation(generator[layer]) (learn_rotation), delta and generator parameters starting at 0: what
    QATConfig(rotate_qk=True, shift_k=True, balance_qk=alpha, learn_qk_transforms=True) trains (its balance and
    rotation, per layer, a KV head's query heads sharing s)."""

    q_block = None

    def __init__(self, scale, mu, d, learn_balance=True, learn_rotation=True):
        super().__init__()
        layers = sorted(scale)
        self.register_buffer("scale", torch.stack([scale[layer] for layer in layers]).float())
        self.register_buffer("mu", torch.stack([mu[layer] for layer in layers]).float())
        self.register_buffer("hadamard", qk_rotation(d))
        self.delta = torch.nn.Parameter(torch.zeros_like(self.scale)) if learn_balance else None
        self.generator = torch.nn.Parameter(torch.zeros(len(layers), d, d)) if learn_rotation else None

    def forward(self, layer, q, k):
        group = q.shape[1] // k.shape[1]
        s = self.scale[layer] if self.delta is None else self.scale[layer] * self.delta[layer].exp()
        q = q * s.repeat_interleave(group, 0)[None, :, None, :]
        k = k / s[None, :, None, :] - (self.mu[layer] / s)[None, :, None, :]  # Transform's order, bit for bit
        r = self.hadamard if self.generator is None else learned_rotation(self.generator[layer])
        return q @ r, k @ r


def learn(model, train, transform, args):
    """Trains only `transform`'s parameters (the model frozen): args.learn_steps Adam steps, each on args.learn_batch
    of args.learn_windows training windows (an epoch without replacement, reshuffled), minimising the next-token
    loss with args.learn_parts fake-quantized, straight-through. Returns the per-step losses."""
    for p in model.parameters():
        p.requires_grad_(False)
    groups = [{"params": [p], "lr": lr} for p, lr in ((transform.delta, args.lr_balance),
                                                      (transform.generator, args.lr_rotation)) if p is not None]
    opt = torch.optim.Adam(groups)
    starts = lm.evenly_spaced(len(train), args.learn_windows, args.seq_len + 1)
    gen = torch.Generator().manual_seed(0)
    order, losses = [], []
    STATE.update(parts=frozenset(args.learn_parts), transform=transform)
    for step in range(args.learn_steps):
        t = time.time()
        if len(order) < args.learn_batch:
            order = torch.randperm(len(starts), generator=gen).tolist()
        chunk, order = order[:args.learn_batch], order[args.learn_batch:]
        windows = lm.gather_windows(train, starts[chunk], args.seq_len + 1).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = model(input_ids=windows[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"learn step {step}: loss {losses[-1]:.4f} ({time.time() - t:.0f} s)", flush=True)
    STATE.update(parts=frozenset(), transform=None)
    for p in transform.parameters():
        p.requires_grad_(False)
    return losses


def quantized_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """fp4_error_budget.quantized_attention with STATE["transform"] applied to Q and K before quantization."""
    parts, layer = STATE["parts"], module.layer_idx
    hq, d, hkv = query.shape[1], query.shape[3], key.shape[1]
    q, k, v = query.float(), key.float(), value.float()
    if STATE["collect"] is not None:  # calibration: keep K (bf16 values, exact) and the running max |q|
        c = STATE["collect"].setdefault(layer, {"k": [], "qmax": torch.zeros(hq, d)})
        c["k"].append(key.detach().to("cpu", torch.bfloat16).transpose(0, 1).reshape(hkv, -1, d))
        c["qmax"] = torch.maximum(c["qmax"], q.abs().amax(dim=(0, 2)).cpu())
    if STATE["transform"] is not None:
        q, k = STATE["transform"](layer, q, k)
    out = budget.fake_quant_attention(q, k, v, parts, scaling, q_block=getattr(STATE["transform"], "q_block", None))
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def calibrate(model, stream, count, args):
    """Per layer: K (H_kv, count * seq_len, D) as float32 and max |q| per (KV head, channel) over its query heads."""
    STATE.update(parts=frozenset(), transform=None, collect={})
    budget.heldout_loss(model, stream, lm.evenly_spaced(len(stream), count, args.seq_len + 1), args.batch,
                        args.seq_len, args.device)
    stats = {}
    for layer, c in STATE["collect"].items():
        k = torch.cat(c["k"], 1).float()
        hkv, d = k.shape[0], k.shape[-1]
        stats[layer] = {"k": k, "qmax": c["qmax"].reshape(hkv, -1, d).amax(1)}
    STATE["collect"] = None
    return stats


def k_mean(stats):
    return {layer: s["k"].mean(1) for layer, s in stats.items()}


def balance(stats, alpha, shifted=False):
    """s = (max|k_c| / max|q_c|)^alpha per (layer, KV head, channel); shifted: max|k_c - mu_c| instead."""
    out = {}
    for layer, s in stats.items():
        k = s["k"] - s["k"].mean(1, keepdim=True) if shifted else s["k"]
        kmax = k.abs().amax(1).clamp_min(1e-6)
        out[layer] = (kmax / s["qmax"].clamp_min(1e-6)) ** alpha
    return out


def scaled_shift(mu, scale):
    return {layer: mu[layer] / scale[layer] for layer in mu} if scale is not None else mu


def signed_hadamard(d, seed):
    h = qk_rotation(d)  # diag(s0) H / sqrt(d) with §9's signs s0: undo them, then apply seed's
    s0 = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    s = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (s * s0)[:, None].float() * h


def random_orthogonal(d, seed):
    g = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    qm, r = torch.linalg.qr(g)
    return (qm * torch.sign(torch.diagonal(r))).float()  # Haar-distributed


def sort_permutation(stats):
    """Per (layer, KV head): the permutation matrix that sorts channels by their balanced magnitude
    sqrt(max|q_c| s_c * max|k_c| / s_c), so channels of like size share a 16-channel block."""
    out = {}
    for layer, s in stats.items():
        size = s["qmax"] * s["k"].abs().amax(1)  # (H_kv, D); balancing leaves the product unchanged
        order = size.argsort(dim=-1)
        eye = torch.eye(size.shape[-1])
        out[layer] = torch.stack([eye[:, o] for o in order])  # x @ P = x[..., order]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--calibration", type=int, default=8, help="training windows for mu and the balancing")
    parser.add_argument("--calibration-more", type=int, default=32, help="windows for the 'more windows' K shift (0: skip it)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parts", default="qk,qkvp", help="comma-separated sets of parts; '-' for none (checks "
                        "that every transform keeps the loss)")
    parser.add_argument("--alphas", default="0.3,0.5,0.7", help="balancing exponents tried with shift + rotation")
    parser.add_argument("--alpha-other", type=float, default=0.5,
                        help="the exponent tried without rotation and with the other rotations")
    parser.add_argument("--seeds", default="1,2", type=lambda x: [int(v) for v in x.split(",")],
                        help="sign seeds of the other Hadamard rotations")
    parser.add_argument("--only", default=None, help="';'-separated labels of the candidates to run, beside 'none' "
                        "and the baseline (default: all)")
    parser.add_argument("--out", default=None, help="JSON of the per-window losses and the table")
    parser.add_argument("--learn-steps", type=int, default=0, help="train the learned candidates this many steps "
                        "(0: none)")
    parser.add_argument("--learn", default="balance+rotation", help="comma-separated learned candidates: "
                        "balance+rotation, balance, rotation (what is learned; the rest stays fixed)")
    parser.add_argument("--learn-alpha", type=float, default=0.3, help="the fixed balance the learning starts from")
    parser.add_argument("--learn-windows", type=int, default=64, help="training windows the learning draws from")
    parser.add_argument("--learn-batch", type=int, default=4)
    parser.add_argument("--learn-parts", default="qkvp")
    parser.add_argument("--lr-balance", type=float, default=1e-2, help="Adam's step on the log-balance offsets")
    parser.add_argument("--lr-rotation", type=float, default=1e-3, help="Adam's step on the rotation generators")
    parser.add_argument("--learn-insample", type=int, default=0, help="also compare each learned candidate with its "
                        "start on this many of the windows it was trained on (did the objective go down?)")
    args = parser.parse_args()
    t0 = time.time()
    model, train, run = budget.load_experiment(args, NAME, quantized_attention)
    print(f"load + tokenize {time.time() - t0:.0f} s", flush=True)

    results = {}
    t = time.time()
    results["bf16 (model's own attention)"] = base = run()
    print(f"one evaluation {time.time() - t:.0f} s", flush=True)
    model.set_attn_implementation(NAME)
    stats = calibrate(model, train, args.calibration, args)
    d = budget.query_dim(model)
    hkv = stats[0]["k"].shape[0]
    mu = k_mean(stats)
    hadamard = qk_rotation(d)
    alphas = [float(a) for a in args.alphas.split(",")]
    bal = {a: balance(stats, a) for a in {*alphas, 0.5, args.alpha_other}}
    bal_shifted = balance(stats, 0.5, shifted=True)
    per_head_hadamard = {layer: torch.stack([signed_hadamard(d, 1000 + layer * hkv + h) for h in range(hkv)])
                         for layer in stats}
    other_rotations = {f"Hadamard, sign seed {seed}": signed_hadamard(d, seed) for seed in args.seeds}
    other_rotations["random orthogonal (QR)"] = random_orthogonal(d, 0)
    candidates = {
        "none": None,
        "rotation + K shift (baseline)": Transform(shift=mu, rotation=hadamard),
        "K shift only": Transform(shift=mu),
        "rotation only": Transform(rotation=hadamard),
    }
    for a in alphas:
        candidates[f"balance a={a} + shift + rotation"] = Transform(bal[a], scaled_shift(mu, bal[a]), hadamard)
        for b in (128, 64):  # SageAttention2's Q smoothing per query tile (128: the Hopper kernel's)
            candidates[f"balance a={a} + shift + rotation + Q smoothing (B={b})"] = Transform(
                bal[a], scaled_shift(mu, bal[a]), hadamard, q_block=b)
    candidates["rotation + K shift + Q smoothing (B=128)"] = Transform(shift=mu, rotation=hadamard, q_block=128)
    candidates["balance a=0.5 (shifted-K max) + shift + rotation"] = Transform(
        bal_shifted, scaled_shift(mu, bal_shifted), hadamard)
    candidates["balance a=0.5 + shift + sorted channels"] = Transform(
        bal[0.5], scaled_shift(mu, bal[0.5]), lambda layer, p=sort_permutation(stats): p[layer])
    a = args.alpha_other
    candidates[f"balance a={a} + shift (no rotation)"] = Transform(bal[a], scaled_shift(mu, bal[a]))
    for label, r in other_rotations.items():
        candidates[f"{label} + shift"] = Transform(shift=mu, rotation=r)
        candidates[f"balance a={a} + shift + {label}"] = Transform(bal[a], scaled_shift(mu, bal[a]), r)
    candidates["Hadamard per (layer, KV head) + shift"] = Transform(
        shift=mu, rotation=lambda layer: per_head_hadamard[layer])
    if args.calibration_more:
        more = k_mean(calibrate(model, train, args.calibration_more, args))
        candidates[f"rotation + K shift from {args.calibration_more} windows"] = Transform(shift=more,
                                                                                        rotation=hadamard)
    if args.only:
        keep = {"none", "rotation + K shift (baseline)", *args.only.split(";")}
        candidates = {label: t for label, t in candidates.items() if label in keep}
    print(f"calibration done {time.time() - t0:.0f} s", flush=True)
    start = f"balance a={args.learn_alpha} + shift + rotation"
    learned, curves = {}, {}
    if args.learn_steps:
        scale0 = bal.get(args.learn_alpha) or balance(stats, args.learn_alpha)
        candidates.setdefault(start, Transform(scale0, scaled_shift(mu, scale0), hadamard))
        for what in args.learn.split(","):
            t = time.time()
            label = f"learned {what} ({args.learn_steps} steps) from {start}"
            transform = LearnedTransform(scale0, mu, d, "balance" in what, "rotation" in what).to(args.device)
            curves[label] = learn(model, train, transform, args)
            candidates[label] = learned[label] = transform
            print(f"{label}: learned in {time.time() - t:.0f} s", flush=True)

    rows = []
    gen = torch.Generator().manual_seed(0)
    boot = torch.randint(0, len(base), (2000, len(base)), generator=gen)

    def interval(x):
        means = x[boot].mean(1)
        lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype)).tolist()
        return float(x.mean()), lo, hi

    for parts in args.parts.split(","):
        for label, transform in candidates.items():
            t = time.time()
            STATE.update(parts=frozenset(parts.strip("-")), transform=transform)
            results[(label, parts)] = run()
            print(f"{parts} | {label}: gap {float((results[(label, parts)] - base).mean()):+.4f} "
                  f"({time.time() - t:.0f} s)", flush=True)
    STATE.update(parts=frozenset(), transform=None)

    print(f"\nheld-out windows {len(base)} x {args.seq_len} tokens, bf16 loss {base.mean():.4f}; paired bootstrap "
          f"95% intervals (2000 resamples of windows); total {time.time() - t0:.0f} s")
    print("| parts | transform | gap vs bf16 [95% CI] | gap % | minus baseline [95% CI] |\n|---|---|---|---|---|")
    for parts in args.parts.split(","):
        ref = results[("rotation + K shift (baseline)", parts)]
        for label in candidates:
            losses = results[(label, parts)]
            g, lo, hi = interval(losses - base)
            dg, dlo, dhi = interval(losses - ref)
            rows.append({"parts": parts, "transform": label, "gap": g, "ci": [lo, hi], "minus_baseline": dg,
                         "minus_baseline_ci": [dlo, dhi]})
            print(f"| {parts} | {label} | {g:+.4f} [{lo:+.4f}, {hi:+.4f}] | {100 * g / base.mean():+.2f}% | "
                  f"{dg:+.4f} [{dlo:+.4f}, {dhi:+.4f}] |")
    if learned:
        print(f"\n| parts | learned candidate | minus its start ({start}) [95% CI] |\n|---|---|---|")
    for parts in args.parts.split(",") if learned else ():
        for label in learned:
            dg, dlo, dhi = interval(results[(label, parts)] - results[(start, parts)])
            rows.append({"parts": parts, "transform": label, "minus_start": dg, "minus_start_ci": [dlo, dhi]})
            print(f"| {parts} | {label} | {dg:+.4f} [{dlo:+.4f}, {dhi:+.4f}] |")
    insample = {}
    if learned and args.learn_insample:
        starts = lm.evenly_spaced(len(train), args.learn_windows, args.seq_len + 1)[:args.learn_insample]
        for label, transform in [(start, candidates[start]), *learned.items()]:
            STATE.update(parts=frozenset(args.learn_parts), transform=transform)
            insample[label] = budget.heldout_loss(model, train, starts, args.batch, args.seq_len, args.device)
        STATE.update(parts=frozenset(), transform=None)
        print(f"\n| in-sample ({len(starts)} training windows, parts {args.learn_parts}) | minus its start [95% CI] |"
              "\n|---|---|")
        boot_in = torch.randint(0, len(starts), (2000, len(starts)), generator=torch.Generator().manual_seed(0))
        for label in learned:
            means = (insample[label] - insample[start])[boot_in].mean(1)
            lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype)).tolist()
            d = float((insample[label] - insample[start]).mean())
            rows.append({"parts": args.learn_parts, "transform": label, "insample_minus_start": d,
                         "insample_minus_start_ci": [lo, hi]})
            print(f"| {label} | {d:+.4f} [{lo:+.4f}, {hi:+.4f}] |")
    if args.out:
        meta = {"commit": os.environ.get("ATTN_QAT_COMMIT"), "date": time.strftime("%Y-%m-%d"), "device": args.device,
                "torch": torch.__version__, "windows": len(base), "seq_len": args.seq_len,
                "calibration_windows": args.calibration, "bf16_loss": float(base.mean()),
                "seconds": time.time() - t0, "learn_curves": curves,
                "learn": {k: getattr(args, k) for k in ("learn_steps", "learn_alpha", "learn_windows", "learn_batch",
                                                        "learn_parts", "lr_balance", "lr_rotation", "learn",
                                                        "learn_insample")}}
        losses = {f"{k[1]} | {k[0]}" if isinstance(k, tuple) else k: v.tolist() for k, v in results.items()}
        losses.update({f"in-sample {args.learn_parts} | {k}": v.tolist() for k, v in insample.items()})
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "losses": losses}, f, indent=1)


if __name__ == "__main__":
    main()
