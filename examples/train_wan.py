"""Train a small Wan 2.1 video transformer from scratch with rectified flow matching, with each attention
numerics, and compare.

The model is diffusers' `WanTransformer3DModel` built from a config (no pretrained weights). The data are
synthetic latent "videos" generated on the fly on the device: a few Gaussian blobs and soft squares, each
with a random colour per channel, moving at constant velocity over a random smooth background. Each video
comes with a "caption": text-encoder-like token embeddings computed from its shape parameters by a fixed
random map, so the cross-attention has something to attend to. Training is rectified flow matching:
x_t = (1 - t) x0 + t noise, the model predicts v = noise - x0 (MSE), t logit-normal (or uniform). The
validation loss is the same MSE on a fixed held-out set (its own seed) at t = 0.1, 0.2, ..., 0.9.

Every arm starts from the same initial weights (same seed) and sees the same batches in the same order, so
loss and gradient-norm differences come from the attention alone. Self-attention is converted by default;
--cross-attention also converts the text cross-attention. Arms:

    bf16              the model's own attention (diffusers' Wan processor, PyTorch SDPA), the baseline
    fp4_inference     the bf16 arm's model evaluated with FP4 attention (attn_qat.convert), no QAT:
                      validation loss only, at every evaluation of the bf16 arm
    attn_qat, high_precision_p, low_precision_o, drop_in
                      trained with attn_qat in that mode (docs/numerics.md §5)

Needs the `examples` extra: python -m pip install -e ".[examples]" (diffusers; transformers for the learning-rate
schedule, tqdm for the progress bars, matplotlib for the plots).

Usage:
    python examples/train_wan.py                                  # all arms, default size (2048 tokens/video)
                                                                  # no GPU: tiny size, 300 steps (~1 min on 2 CPU cores)
    python examples/train_wan.py --arms bf16,attn_qat --steps 2000 --out examples/out/wan_long
    python examples/train_wan.py --size tiny --steps 50 --device cpu  # CPU smoke run
    torchrun --nproc_per_node=2 examples/train_wan.py             # DDP: each rank takes a slice of every batch

Writes <out>/<arm>.csv (step, train_loss, grad_norm, lr, val_loss, elapsed_s), <out>/loss.png,
<out>/grad_norm.png (needs matplotlib) and <out>/summary.json.
"""
import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

import attn_qat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import ArmRunner, add_common_args, finish_args, run  # noqa: E402

PATCH_SIZE = (1, 2, 2)
VAL_TIMES = tuple(round(0.1 * i, 1) for i in range(1, 10))
SIZES = {
    # 8 frames of 32x32 latents in 1x2x2 patches: 8 * 16 * 16 = 2048 self-attention tokens per video.
    "default": dict(num_layers=4, num_attention_heads=4, attention_head_dim=128, ffn_dim=1536, text_dim=256,
                    freq_dim=256, channels=16, frames=8, height=32, width=32, text_tokens=16, blobs=4),
    # 2 frames of 8x8: 32 tokens.
    "tiny": dict(num_layers=2, num_attention_heads=2, attention_head_dim=64, ffn_dim=256, text_dim=32,
                 freq_dim=32, channels=4, frames=2, height=8, width=8, text_tokens=8, blobs=2),
}
MODEL_KEYS = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim", "freq_dim")
# The run sizes: on the CPU (no GPU, or --device cpu) a GPU-sized run would take hours.
GPU_DEFAULTS = dict(size="default", steps=2000, batch_size=8, eval_every=200, eval_batches=4)
CPU_DEFAULTS = dict(size="tiny", steps=300, batch_size=8, eval_every=50, eval_batches=2)
# --help's epilog; diffusers is imported only after parse_args, so --help works without it.
EXTRA = 'needs the examples extra: python -m pip install -e ".[examples]" (diffusers, transformers)'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXTRA,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, lr=5e-4, out="examples/out/wan", gpu=GPU_DEFAULTS, cpu=CPU_DEFAULTS)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help=f"default: {GPU_DEFAULTS['size']} on a GPU, {CPU_DEFAULTS['size']} on the CPU")
    parser.add_argument("--frames", type=int, default=None, help="latent frames per video (default: 8, tiny: 2)")
    parser.add_argument("--resolution", type=int, default=None,
                        help="latent height = width, a multiple of 2 (default: 32, tiny: 8)")
    parser.add_argument("--cross-attention", action="store_true",
                        help="also convert the text cross-attention (default: self-attention only)")
    parser.add_argument("--t-sampling", choices=("logit_normal", "uniform"), default="logit_normal",
                        help="training timestep distribution")
    args = finish_args(parser, parser.parse_args(argv))
    args.dims = dict(SIZES[args.size])
    if args.frames is not None:
        args.dims["frames"] = args.frames
    if args.resolution is not None:
        if args.resolution % PATCH_SIZE[1]:
            parser.error("--resolution must be a multiple of 2 (the 1x2x2 patch)")
        args.dims["height"] = args.dims["width"] = args.resolution
    return args


# --------------------------------------------------------------------------------------------- data

class VideoSource:
    """Synthetic latent videos (B, C, F, H, W) and their captions (B, text_tokens, text_dim).

    Per video: `blobs` shapes, each a Gaussian blob or a soft square, with centre (in [0.2, 0.8] of the
    frame), velocity (up to half the frame over the clip), size, kind and a colour per channel; the caption
    is one token per shape (its parameters through a fixed random two-layer map), a background token
    (its coarse noise through another), then fixed padding tokens. All random draws for a batch come from
    the generator passed in; the caption maps come from `map_seed` and are the same for every arm.
    """

    def __init__(self, dims, map_seed, device):
        self.dims, self.device = dims, device
        c, d, k = dims["channels"], dims["text_dim"], dims["blobs"]
        self.param_dim = 6 + c  # cx, cy, vx, vy, size, kind, colour
        g = torch.Generator().manual_seed(map_seed)
        hidden = 4 * d
        self.blob_w1 = torch.randn(self.param_dim, hidden, generator=g) / math.sqrt(self.param_dim)
        self.blob_w2 = torch.randn(hidden, d, generator=g) / math.sqrt(hidden)
        self.bg_w = torch.randn(c * 16, d, generator=g) / math.sqrt(c * 16)
        self.slot = 0.5 * torch.randn(k + 1, d, generator=g)  # tells the shape tokens and the background apart
        self.pad = torch.randn(dims["text_tokens"] - k - 1, d, generator=g)
        for name in ("blob_w1", "blob_w2", "bg_w", "slot", "pad"):
            setattr(self, name, getattr(self, name).to(device))

    def sample(self, n, generator):
        """(videos, captions), both float32 on the device."""
        dims, dev = self.dims, self.device
        c, f, h, w, k = dims["channels"], dims["frames"], dims["height"], dims["width"], dims["blobs"]
        rand = lambda *shape: torch.rand(*shape, generator=generator, device=dev)
        coarse = torch.randn(n, c, 4, 4, generator=generator, device=dev)
        background = 0.5 * F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=True)[:, :, None]
        centre = 0.2 + 0.6 * rand(n, k, 2)                # (x, y) in frame units at the first frame
        velocity = (rand(n, k, 2) - 0.5) / max(f - 1, 1)  # up to half the frame over the clip
        size = 0.06 + 0.1 * rand(n, k, 1)
        kind = (rand(n, k, 1) < 0.5).float()              # 0: Gaussian blob, 1: soft square
        colour = torch.randn(n, k, c, generator=generator, device=dev)

        t = torch.arange(f, device=dev, dtype=torch.float32)
        pos = centre[:, :, None] + velocity[:, :, None] * t[None, None, :, None]  # (n, k, f, 2)
        xs = (torch.arange(w, device=dev) + 0.5) / w
        ys = (torch.arange(h, device=dev) + 0.5) / h
        dx = xs.view(1, 1, 1, 1, w) - pos[..., 0, None, None]  # (n, k, f, 1, w)
        dy = ys.view(1, 1, 1, h, 1) - pos[..., 1, None, None]  # (n, k, f, h, 1)
        s = size[..., None, None]  # (n, k, 1, 1, 1)
        gauss = torch.exp(-(dx.square() + dy.square()) / (2 * s.square()))
        edge = 0.25 * s
        square = torch.sigmoid((s - dx.abs()) / edge) * torch.sigmoid((s - dy.abs()) / edge)
        kind5 = kind[..., None, None]
        shapes = (1 - kind5) * gauss + kind5 * square  # (n, k, f, h, w)
        videos = 2 * (background + torch.einsum("nkc,nkfhw->ncfhw", colour, shapes))  # std about 1, like latents

        params = torch.cat([centre, velocity * max(f - 1, 1), size * 10, kind, colour], dim=-1)  # (n, k, P)
        blob_tokens = F.gelu(params @ self.blob_w1) @ self.blob_w2 + self.slot[:k]
        bg_token = (coarse.flatten(1) @ self.bg_w)[:, None] + self.slot[k:]
        captions = torch.cat([blob_tokens, bg_token, self.pad.expand(n, -1, -1)], dim=1)
        return videos, captions


# -------------------------------------------------------------------------------------------- model

def build_model(args):
    """A fresh WanTransformer3DModel (fp32 weights) drawn from args.seed, so every arm starts the same."""
    from diffusers import WanTransformer3DModel

    dims = args.dims
    torch.manual_seed(args.seed)
    model = WanTransformer3DModel(patch_size=PATCH_SIZE, in_channels=dims["channels"], out_channels=dims["channels"],
                                  rope_max_seq_len=1024, **{k: dims[k] for k in MODEL_KEYS})
    return model.to(args.device)


class Runner(ArmRunner):
    """Wan flow matching: synthetic videos, the fixed validation set, model, loss (common.ArmRunner trains)."""

    def __init__(self, args):
        super().__init__(args)
        dims = args.dims
        self.source = VideoSource(dims, map_seed=args.seed + 2, device=args.device)
        self.tokens_per_video = (dims["frames"] // PATCH_SIZE[0]) * (dims["height"] // PATCH_SIZE[1]) * (
            dims["width"] // PATCH_SIZE[2])
        self.tokens_per_step = args.batch_size * self.tokens_per_video
        # One fixed validation set (videos, captions, noise), the same for every evaluation of every arm.
        val_gen = self.make_generator(args.seed + 1)
        self.val_batches = []
        for _ in range(args.eval_batches):
            videos, captions = self.source.sample(args.batch_size, val_gen)
            noise = torch.randn(videos.shape, generator=val_gen, device=args.device)
            self.val_batches.append((videos, noise, captions))

    def make_generator(self, seed):
        return torch.Generator(device=self.args.device).manual_seed(seed)

    def build_model(self):
        return build_model(self.args)

    def prepare_config(self, mode):
        return attn_qat.QATConfig(mode=mode, self_attention=True, cross_attention=self.args.cross_attention,
                                  strict=True)

    def batch_generator(self):
        return self.make_generator(self.args.seed)

    def train_batch(self, generator):
        """(videos, noise, t, captions) for the whole global batch (every rank draws it, then takes its rows)."""
        n = self.args.batch_size
        videos, captions = self.source.sample(n, generator)
        noise = torch.randn(videos.shape, generator=generator, device=self.args.device)
        if self.args.t_sampling == "uniform":
            t = torch.rand(n, generator=generator, device=self.args.device)
        else:
            t = torch.sigmoid(torch.randn(n, generator=generator, device=self.args.device))
        return videos, noise, t, captions

    def flow_loss(self, model, videos, noise, t, captions):
        """Rectified flow matching: MSE between the model's velocity at x_t and noise - x0."""
        tb = t.view(-1, 1, 1, 1, 1)
        x_t = (1 - tb) * videos + tb * noise
        with self.autocast():
            pred = model(hidden_states=x_t, timestep=t * 1000, encoder_hidden_states=captions).sample
        return F.mse_loss(pred.float(), noise - videos)

    def loss(self, model, batch):
        return self.flow_loss(model, *batch)

    @torch.no_grad()
    def evaluate(self, model):
        was_training = model.training
        model.eval()
        total = torch.zeros((), device=self.args.device)
        for videos, noise, captions in self.val_batches:
            videos, noise, captions = self.local_rows((videos, noise, captions))
            for t in VAL_TIMES:
                t = torch.full((videos.shape[0],), t, device=self.args.device)
                total += self.flow_loss(model, videos, noise, t, captions)
        model.train(was_training)
        return self.mean_over_ranks(total / (len(self.val_batches) * len(VAL_TIMES))).item()


def main(argv=None):
    args = parse_args(argv)
    import diffusers  # after parse_args: --help works without it
    runner = Runner(args)
    dims = args.dims
    runner.log(f"videos: {dims['channels']} x {dims['frames']} x {dims['height']} x {dims['width']} latents, "
               f"{runner.tokens_per_video} tokens each, {dims['text_tokens']} caption tokens; attention: self"
               f"{' + cross' if args.cross_attention else ''}; device {args.device} x{runner.world}; "
               f"arms {', '.join(args.arms)}")

    def summary_extra(summary):
        summary.update(dims=dims, tokens_per_video=runner.tokens_per_video, cross_attention=args.cross_attention,
                       t_sampling=args.t_sampling, val_times=list(VAL_TIMES), diffusers=diffusers.__version__)

    run(runner, summary_extra, loss_label="flow-matching MSE (v = noise - x0)",
        title="Tiny Wan 2.1 on synthetic moving-shape videos")


if __name__ == "__main__":
    sys.exit(main())
