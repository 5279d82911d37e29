"""Pretrain a small Wan 2.1 video transformer in bf16 once, then fine-tune it with each attention numerics, and compare.

The model and data are examples/train_wan.py's: diffusers' WanTransformer3DModel from a config (default: 4 layers,
4 heads of head_dim 128, 17.2M parameters) on synthetic latent videos of moving shapes with a caption computed from
their parameters, trained by rectified flow matching (predict v = noise - x0). It is pretrained once with bf16
attention (PyTorch SDPA) and its weights are kept in a checkpoint (--pretrained); every arm is then fine-tuned from
it with the protocol of examples/finetune_common.py (the one finetune_lm.py follows): arms bf16, attn_qat, drop_in,
high_precision_p, low_precision_o, attn_qat_qk, attn_qat_qk_distill and attn_qat_qk_distill_frozen (distilled
from a bf16 teacher in lockstep, or from the finished one) with the same steps, batches and schedule;
base / base_ptq / ptq are the pretrained and the bf16 fine-tuned models evaluated with FP4 attention, untrained.

Held-out set: a fixed set of videos with their noise (its own seed, the same for every arm and seed), each video's
loss the flow-matching MSE averaged over t = 0.1, ..., 0.9: the bootstrap's items. Samples: the captions of the first
held-out videos and fixed noise, integrated from t = 1 to 0 with Euler steps; each entry's samples are compared
with the bf16 fine-tune's samples of the same seed (same noise, same captions) by PSNR (peak: the bf16 sample's
range), and with the video the caption was computed from. Models evaluated with FP4 attention are also run through
the real NVFP4 path (self-attention on packed NVFP4Tensors: attn_qat.quantize_qkv + attn_qat.nvfp4_attention), for
the held-out loss and the samples, and compared with the fake-quant forward.

Needs the `examples` extra: python -m pip install -e ".[examples]" (diffusers; transformers for the learning-rate
schedule, scipy for the report's bootstrap, matplotlib for the plots).

Usage:
    python examples/finetune_wan.py                                  # --preset h100: pretrain + every arm, 3 seeds
    python examples/finetune_wan.py --seeds 0 --out /tmp/ft_wan       # a subset; the checkpoint is reused
    python examples/finetune_wan.py --preset smoke --device cpu      # CPU smoke run
"""
import argparse
import hashlib
import importlib.util
import json
import pathlib
import sys
import time
import types

import torch

import attn_qat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from finetune_common import (BASE_ENTRIES, Bootstrap, add_protocol_args, finish_args, qat_config,  # noqa: E402
                             run_experiment, to_bf16_weights, train)
from finetune_common import add_pareto_args, finish_pareto_args  # noqa: E402
from train_wan import MODEL_KEYS, PATCH_SIZE, SIZES, VAL_TIMES, VideoSource  # noqa: E402

PRESETS = {
    # Measured on an H100 (docs/results.md): pretraining 65 s, a fine-tune 16-23 s with its evaluation and sampling
    # (the distilled arm ~30 s), one seed's eight arms ~3 min. Under a per-command time limit, add --max-minutes and
    # run the same command again for what is left (the pretrained checkpoint is reused).
    "h100": dict(size="default", pretrain_steps=1500, pretrain_lr=5e-4, pretrain_warmup=75, steps=300, lr=2e-4,
                 warmup_steps=30, batch_size=8, eval_every=100, curve_videos=16, eval_videos=64, sample_videos=32,
                 sample_steps=20, val_times=VAL_TIMES, seeds="0,1,2", max_minutes=None),
    # CPU smoke run (CI): a few steps of the tiny model.
    "smoke": dict(size="tiny", pretrain_steps=2, pretrain_lr=5e-4, pretrain_warmup=1, steps=3, lr=2e-4,
                  warmup_steps=1, batch_size=2, eval_every=2, curve_videos=2, eval_videos=2, sample_videos=2,
                  sample_steps=2, val_times=(0.3, 0.7), seeds="0", max_minutes=None),
}
PRETRAIN_SEED = 0        # the initial weights and the pretraining batches
HELDOUT_SEED = 10_000    # the held-out videos, their noise and the sampling noise
FINETUNE_SEED_BASE = 1_000  # fine-tuning batches of seed s come from generator seed 1000 + s
CALIBRATION_SEED = 20_000  # the batches that calibrate the K shift (numerics.md §9), the same for every arm and seed
CALIBRATION_BATCHES = 4
SENSITIVITY_SEED = 30_000  # the batches the sensitivity map of the Pareto runs (--keep-bf16) is measured on
SENSITIVITY_BATCHES = 4
EXTRA = 'needs the examples extra: python -m pip install -e ".[examples]" (diffusers, transformers, scipy)'


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXTRA,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_protocol_args(parser, PRESETS, out="docs/results/finetune_wan")
    add_pareto_args(parser)
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model and video size (train_wan.py's)")
    parser.add_argument("--pretrain-steps", type=int, default=None)
    parser.add_argument("--pretrain-lr", type=float, default=None)
    parser.add_argument("--pretrain-warmup", type=int, default=None)
    parser.add_argument("--pretrained", default=None,
                        help="checkpoint of the pretrained model: loaded when it exists (and matches the size and "
                             "pretraining options), else written after pretraining (default: examples/out/"
                             "wan_pretrained_<size>_<steps>.pt)")
    parser.add_argument("--curve-videos", type=int, default=None, help="held-out videos of the training curves")
    parser.add_argument("--eval-videos", type=int, default=None, help="held-out videos (the bootstrap's items)")
    parser.add_argument("--sample-videos", type=int, default=None, help="captions and noises sampled per entry")
    parser.add_argument("--sample-steps", type=int, default=None, help="Euler steps from t = 1 to 0")
    parser.add_argument("--cross-attention", action="store_true",
                        help="also convert the text cross-attention (default: self-attention only)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = finish_args(parser, parser.parse_args(argv))
    args = finish_pareto_args(parser, args)
    args.dims = dict(SIZES[args.size])
    if args.pretrained is None:
        args.pretrained = f"examples/out/wan_pretrained_{args.size}_{args.pretrain_steps}.pt"
    return args


# ------------------------------------------------------------------------------ the real NVFP4 path

class packed_attention:
    """Context: the attn_qat attention of the model's Wan processors runs on packed NVFP4 operands
    (attn_qat.quantize_qkv + attn_qat.nvfp4_attention) instead of the fake-quant forward; restored on exit. It takes
    the attention the processors hand to attn_qat (after any numerics.md §9 transform), in the shared routine they
    call (`run_sdpa`); `calls` counts the attentions it ran, so an evaluation can check that it ran at all."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def _packed(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, inference, **kwargs):
        from attn_qat.attention import run_dtype
        if kwargs["config"].mode == "bf16":  # a module QATConfig.bf16_modules keeps: exact attention, as prepared
            self.calls += 1
            return self.original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 inference=inference, **kwargs)
        if not inference or attn_mask is not None or dropout_p or is_causal or enable_gqa:
            raise NotImplementedError("the packed path runs converted, unmasked, non-causal attention only")
        dtype = run_dtype(query)
        qp, kp, vp = attn_qat.quantize_qkv(query.to(dtype), key.to(dtype), value.to(dtype), layout="bhsd",
                                           causal=False)
        self.calls += 1
        return attn_qat.nvfp4_attention(qp, kp, vp, causal=False, softmax_scale=scale, layout="bhsd").type_as(query)

    def __enter__(self):
        from attn_qat.integrations import diffusers as integration
        self.integration, self.original = integration, integration.run_sdpa
        integration.run_sdpa = self._packed
        return self

    def __exit__(self, *exc):
        self.integration.run_sdpa = self.original


def psnr(samples, reference):
    """(N,) PSNR in dB of each sample against its reference, the peak being the reference's range (max - min)."""
    dims = tuple(range(1, reference.dim()))
    mse = (samples.double() - reference.double()).square().mean(dims)
    peak = reference.double().amax(dims) - reference.double().amin(dims)
    return 10 * torch.log10(peak.square() / mse.clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------- task

class WanTask:
    name = "finetune_wan"
    loss_label = "flow-matching MSE (v = noise - x0)"
    title = "Tiny Wan 2.1: pretrained in bf16, fine-tuned per arm"
    weight_decay = 0.0
    table_columns = {"psnr_vs_bf16": "sample PSNR vs bf16 fine-tune (dB)",
                     "psnr_vs_source": "sample PSNR vs caption's video (dB)",
                     "fake_vs_real": "fake-quant vs real NVFP4 path"}

    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        dims = args.dims
        self.tokens_per_video = (dims["frames"] // PATCH_SIZE[0]) * (dims["height"] // PATCH_SIZE[1]) * (
            dims["width"] // PATCH_SIZE[2])
        self.tokens_per_step = args.batch_size * self.tokens_per_video
        self.base_state = None
        self.samples = {}  # in-memory bf16 / base samples, mirrored under <out>/samples/ for later invocations
        self.pretrain_info = None

    def generator(self, seed):
        return torch.Generator(device=self.device).manual_seed(seed)

    def setup(self):
        args = self.args
        dims = args.dims
        self.source = VideoSource(dims, map_seed=PRETRAIN_SEED + 2, device=self.device)
        gen = self.generator(HELDOUT_SEED)
        videos, captions, noises = [], [], []
        for chunk in range(0, args.eval_videos, args.batch_size):
            v, c = self.source.sample(min(args.batch_size, args.eval_videos - chunk), gen)
            videos.append(v)
            captions.append(c)
            noises.append(torch.randn(v.shape, generator=gen, device=self.device))
        self.val_videos, self.val_captions, self.val_noise = (torch.cat(x) for x in (videos, captions, noises))
        n = args.sample_videos
        self.sample_captions = self.val_captions[:n]
        self.sample_sources = self.val_videos[:n]
        self.sample_noise = torch.randn(self.val_videos[:n].shape, generator=gen, device=self.device)
        self.sample_dir = pathlib.Path(args.out) / "samples"
        self.base_state, self.pretrain_info = self.pretrained()

    # ----------------------------------------------------------------- model and pretraining

    def build_model(self):
        from diffusers import WanTransformer3DModel
        dims = self.args.dims
        torch.manual_seed(PRETRAIN_SEED)
        model = WanTransformer3DModel(patch_size=PATCH_SIZE, in_channels=dims["channels"], out_channels=dims["channels"],
                                      rope_max_seq_len=1024, **{k: dims[k] for k in MODEL_KEYS})
        return to_bf16_weights(model).to(self.device)

    def pretrain_config(self):
        args = self.args
        return {"size": args.size, "dims": args.dims, "steps": args.pretrain_steps, "lr": args.pretrain_lr,
                "warmup_steps": args.pretrain_warmup, "batch_size": args.batch_size, "seed": PRETRAIN_SEED,
                "weight_decay": 0.1}

    def pretrained(self):
        """(state_dict, info) of the pretrained model: from --pretrained when it holds this configuration, else
        pretrained here (bf16 attention, with an FP4 evaluation of the curve subset at every evaluation) and saved."""
        args = self.args
        path = pathlib.Path(args.pretrained)
        config = self.pretrain_config()
        if path.exists():
            checkpoint = torch.load(path, map_location=self.device, weights_only=True)
            if json.loads(checkpoint["config"]) == json.loads(json.dumps(config)):
                print(f"pretrained model from {path}", flush=True)
                info = json.loads(checkpoint["info"])
                info["loaded_from"] = str(path)
                return checkpoint["state_dict"], info
            print(f"{path} holds another configuration: pretraining again", flush=True)
        model = self.build_model()
        attn_qat.disable(attn_qat.convert(attn_qat.prepare(model, self.qat_config("attn_qat"))))
        pretrain_args = types.SimpleNamespace(steps=args.pretrain_steps, lr=args.pretrain_lr,
                                              warmup_steps=args.pretrain_warmup,
                                              eval_every=max(1, args.pretrain_steps // 5))
        start = time.perf_counter()
        rows = train(self, model, "bf16", "pretrain", pretrain_args, progress="pretraining",
                     generator=self.generator(PRETRAIN_SEED), weight_decay=0.1)
        seconds = time.perf_counter() - start
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        digest = hashlib.sha256()
        for key in sorted(state):
            digest.update(key.encode())
            digest.update(state[key].float().cpu().numpy().tobytes())
        info = {"seconds": seconds, "weights_sha256": digest.hexdigest(), "final_train_loss": rows[-1]["train_loss"],
                "curve": rows}
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": state, "config": json.dumps(config), "info": json.dumps(info)}, path)
        print(f"pretrained in {seconds:.0f} s; saved {path}", flush=True)
        return state, info

    def config_summary(self):
        import diffusers
        args = self.args
        keys = ("preset", "size", "dims", "steps", "batch_size", "lr", "warmup_steps", "eval_every", "eval_videos",
                "curve_videos", "sample_videos", "sample_steps", "cross_attention", "balance_qk")
        config = {k: getattr(args, k) for k in keys}
        config.update(diffusers=diffusers.__version__, tokens_per_video=self.tokens_per_video,
                      val_times=list(args.val_times), pretrain=self.pretrain_config(),
                      weights="bf16 (the model's fp32 modules kept fp32), AdamW on fp32 master weights (betas 0.9, "
                              "0.95; weight decay 0.1 pretraining, 0 fine-tuning)",
                      autocast="bf16", lr_schedule="linear warmup, cosine decay to 10%", grad_clip=1.0,
                      seeds_note=f"fine-tuning batches of seed s from generator seed {FINETUNE_SEED_BASE} + s; "
                                 f"held-out set and sampling noise from seed {HELDOUT_SEED}")
        if self.pretrain_info is not None:
            config["pretrain_result"] = {k: v for k, v in self.pretrain_info.items() if k != "curve"}
            config["pretrain_curve"] = [{k: r[k] for k in ("step", "train_loss", "val_loss", "val_loss_fp4")}
                                        for r in self.pretrain_info["curve"] if r["val_loss"] != ""]
        return config

    # ----------------------------------------------------------------- what training needs

    def qat_config(self, arm):
        return qat_config(arm, self.args.balance_qk, self_attention=True, cross_attention=self.args.cross_attention,
                          strict=True)

    @torch.no_grad()
    def calibrate(self, model):
        """The K shift and Q/K balance of a model prepared with them over CALIBRATION_BATCHES training batches."""
        generator = self.generator(CALIBRATION_SEED)
        batches = [self.train_batch(generator) for _ in range(CALIBRATION_BATCHES)]
        with self.autocast():
            attn_qat.calibrate_k_shift(model, batches, run=self.loss)

    def sensitivity_batches(self):
        """Training batches (videos, noise, t, captions) for attn_qat.sensitivity, the same for every seed."""
        generator = self.generator(SENSITIVITY_SEED)
        return [self.train_batch(generator) for _ in range(SENSITIVITY_BATCHES)]

    def sensitivity_loss(self, model, batch):
        """Per-video flow-matching loss at the batch's fixed noise and times (attn_qat.sensitivity's loss_fn)."""
        return self.per_video_loss(model, *batch)

    def fresh_model(self):
        model = self.build_model()
        model.load_state_dict(self.base_state)
        return model.eval()

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def batch_generator(self, seed):
        return self.generator(FINETUNE_SEED_BASE + seed)

    def train_batch(self, generator):
        n = self.args.batch_size
        videos, captions = self.source.sample(n, generator)
        noise = torch.randn(videos.shape, generator=generator, device=self.device)
        t = torch.sigmoid(torch.randn(n, generator=generator, device=self.device))  # logit-normal, as train_wan
        return videos, noise, t, captions

    def velocity(self, model, x_t, t, captions):
        return model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=captions).sample

    def output(self, model, batch):
        """The predicted velocity at the batch's noised videos."""
        videos, noise, t, captions = batch
        tb = t.view(-1, 1, 1, 1, 1)
        return self.velocity(model, (1 - tb) * videos + tb * noise, t, captions)

    @staticmethod
    def per_video_loss_from_output(pred, batch):
        videos, noise = batch[:2]
        return (pred.float() - (noise - videos)).square().mean(dim=(1, 2, 3, 4))

    def per_video_loss(self, model, videos, noise, t, captions):
        batch = (videos, noise, t, captions)
        return self.per_video_loss_from_output(self.output(model, batch), batch)

    def loss_from_output(self, pred, batch):
        return self.per_video_loss_from_output(pred, batch).mean()

    def loss(self, model, batch):
        return self.loss_from_output(self.output(model, batch), batch)

    @staticmethod
    def distillation_loss(pred, teacher_pred):
        """The MSE between the student's and the teacher's velocities."""
        return (pred.float() - teacher_pred.float()).square().mean()

    @torch.no_grad()
    def video_losses(self, model, count=None):
        """(N,) held-out loss of each video: the MSE averaged over the val_times (t = 0.1, ..., 0.9 in h100)."""
        count = len(self.val_videos) if count is None else count
        out = []
        for i in range(0, count, self.args.batch_size):
            j = min(i + self.args.batch_size, count)
            videos, noise, captions = self.val_videos[i:j], self.val_noise[i:j], self.val_captions[i:j]
            total = torch.zeros(j - i, device=self.device)
            for t in self.args.val_times:
                with self.autocast():
                    total += self.per_video_loss(model, videos, noise, torch.full((j - i,), t, device=self.device),
                                                 captions)
            out.append(total / len(self.args.val_times))
        return torch.cat(out).double().cpu()

    def heldout_losses(self, model):
        return self.video_losses(model)

    def curve_loss(self, model):
        was_training = model.training
        model.eval()
        value = float(self.video_losses(model, self.args.curve_videos).mean())
        model.train(was_training)
        return value

    @torch.no_grad()
    def sample(self, model):
        """Euler integration of the learned velocity from the fixed noise (t = 1) to t = 0: (N, C, F, H, W) float32."""
        steps = self.args.sample_steps
        times = torch.linspace(1.0, 0.0, steps + 1, device=self.device)
        out = []
        for i in range(0, len(self.sample_noise), self.args.batch_size):
            x = self.sample_noise[i:i + self.args.batch_size].clone()
            captions = self.sample_captions[i:i + self.args.batch_size]
            for k in range(steps):
                t = times[k].expand(len(x))
                with self.autocast():
                    v = self.velocity(model, x, t, captions).float()
                x = x + (times[k + 1] - times[k]) * v
            out.append(x)
        return torch.cat(out)

    # ----------------------------------------------------------------- evaluation

    def reference_samples(self, key):
        if key not in self.samples:
            path = self.sample_dir / f"{key}.pt"
            if not path.exists():
                return None
            self.samples[key] = torch.load(path, map_location=self.device, weights_only=True)
        return self.samples[key]

    def keep_samples(self, key, samples):
        self.samples[key] = samples
        self.sample_dir.mkdir(parents=True, exist_ok=True)
        torch.save(samples, self.sample_dir / f"{key}.pt")

    @torch.no_grad()
    def evaluate(self, model, fp4, entry, seed):
        """Per-video held-out losses and samples; PSNR of the samples against the caption's video and against the bf16
        fine-tune's samples of the same seed (the bf16 arm runs first in each seed, and also scores the base models'
        samples against its own); for FP4 the packed path too."""
        losses = self.video_losses(model)
        samples = self.sample(model)
        payload = {"numerics": "fp4" if fp4 else "bf16", "item_losses": losses.tolist(), "loss": float(losses.mean()),
                   "psnr_vs_source": psnr(samples, self.sample_sources).tolist()}
        if fp4:
            with packed_attention(model) as packed:
                packed_losses = self.video_losses(model)
                packed_samples = self.sample(model)
            if packed.calls == 0:
                raise RuntimeError("the packed NVFP4 path ran no attention: the comparison would be empty")
            payload["real_path"] = {
                "packed_item_losses": packed_losses.tolist(), "packed_loss": float(packed_losses.mean()),
                "max_abs_item_loss_difference": float((packed_losses - losses).abs().max()),
                "sample_max_abs_difference": float((packed_samples - samples).abs().max()),
                "sample_psnr_packed_vs_fake": psnr(packed_samples, samples).tolist()}
        if entry in BASE_ENTRIES:
            self.keep_samples(entry, samples)
        elif entry == "bf16":
            self.keep_samples(f"bf16_seed{seed}", samples)
            payload["base_psnr_vs_this"] = {
                key: psnr(base, samples).tolist() for key in BASE_ENTRIES
                if (base := self.reference_samples(key)) is not None}
        else:
            reference = self.reference_samples(f"bf16_seed{seed}")
            if reference is not None:
                payload["psnr_vs_bf16"] = psnr(samples, reference).tolist()
        return payload

    # ----------------------------------------------------------------- report

    def report_extras(self, runs, boot, config):
        columns, psnr_bf16, psnr_source, real = {}, {}, {}, {}
        for entry, seeds in runs.items():
            rows = [torch.tensor(p["psnr_vs_source"]) for p in seeds.values() if "psnr_vs_source" in p]
            if rows:
                value = video_boot(len(rows[0])).mean(torch.stack(rows).mean(0))
                psnr_source[entry] = value
                columns.setdefault(entry, {})["psnr_vs_source"] = f"{value[0]:.1f} [{value[1][0]:.1f}, {value[1][1]:.1f}]"
            per_seed = [torch.tensor(p["psnr_vs_bf16"]) for p in seeds.values() if "psnr_vs_bf16" in p]
            if entry in BASE_ENTRIES:
                per_seed = [torch.tensor(v) for p in runs.get("bf16", {}).values()
                            for e, v in p.get("base_psnr_vs_this", {}).items() if e == entry]
            if per_seed:
                finite = torch.stack(per_seed).clamp(max=200.0)  # identical samples give +inf: cap for the mean
                value = video_boot(finite.shape[1]).mean(finite.mean(0))
                psnr_bf16[entry] = {"mean": value[0], "ci": value[1], "seeds": len(per_seed)}
                columns.setdefault(entry, {})["psnr_vs_bf16"] = f"{value[0]:.1f} [{value[1][0]:.1f}, {value[1][1]:.1f}]"
            for seed, payload in seeds.items():
                if "real_path" in payload:
                    rp = payload["real_path"]
                    real.setdefault(entry, {})[str(seed)] = {
                        "max_abs_item_loss_difference": rp["max_abs_item_loss_difference"],
                        "sample_max_abs_difference": rp["sample_max_abs_difference"],
                        "sample_psnr_packed_vs_fake_min": min(rp["sample_psnr_packed_vs_fake"]),
                        "loss_fake": payload["loss"], "loss_packed": rp["packed_loss"]}
        for entry, seeds in real.items():
            worst = max(v["max_abs_item_loss_difference"] for v in seeds.values())
            worst_sample = max(v["sample_max_abs_difference"] for v in seeds.values())
            columns.setdefault(entry, {})["fake_vs_real"] = (f"max \\|Δ loss\\| {worst:.1e}, max \\|Δ sample\\| "
                                                             f"{worst_sample:.1e}")
        return {"columns": columns, "sample_psnr_vs_bf16": psnr_bf16, "sample_psnr_vs_source": psnr_source,
                "fake_quant_vs_real_nvfp4": real,
                "sampling": {"videos": config.get("sample_videos"), "euler_steps": config.get("sample_steps"),
                             "psnr_peak": "range (max - min) of each reference video",
                             "interval": "95% percentile interval, bootstrap over the sampled videos"}}


def video_boot(n):
    boot = Bootstrap(n, seed=1)
    return types.SimpleNamespace(mean=lambda x: list(boot.mean(x)))


def main(argv=None):
    args = parse_args(argv)
    # checked after parse_args: --help works without them
    if any(importlib.util.find_spec(m) is None for m in ("diffusers", "transformers", "scipy")):
        raise SystemExit(EXTRA)
    task = WanTask(args)
    dims = args.dims
    print(f"finetune_wan: preset {args.preset}, {dims['channels']} x {dims['frames']} x {dims['height']} x "
          f"{dims['width']} latents ({task.tokens_per_video} tokens), arms {', '.join(args.arms)}, seeds {args.seeds}, "
          f"pretraining {args.pretrain_steps} steps, fine-tuning {args.steps} steps of {args.batch_size} videos, "
          f"device {args.device}, out {args.out}", flush=True)
    run_experiment(task, args)


if __name__ == "__main__":
    sys.exit(main())
