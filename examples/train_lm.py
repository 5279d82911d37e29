"""Train a small Qwen3-architecture byte-level LM from scratch with each attention numerics, and compare.

The corpus is the Python standard library's own source (*.py under sysconfig's "stdlib" path, sorted;
every 10th file held out for validation), read as bytes (vocabulary 256). Every arm starts from the same
initial weights (same seed) and sees the same batches in the same order, so loss and gradient-norm
differences come from the attention alone. Arms:

    bf16              PyTorch SDPA (transformers' "sdpa"), the baseline
    fp4_inference     the bf16 arm's model evaluated with FP4 attention (attn_qat.convert), no QAT:
                      validation loss only, at every evaluation of the bf16 arm
    attn_qat, high_precision_p, low_precision_o, drop_in
                      trained with attn_qat in that mode (docs/numerics.md §5)

Needs the `examples` extra: python -m pip install -e ".[examples]" (transformers; tqdm and matplotlib, for
progress bars and plots, are optional).

Usage:
    python examples/train_lm.py                                   # all arms, default size (58-69 s/arm measured on an H100)
                                                                  # no GPU: tiny size, 300 steps (~2 min on 2 CPU cores)
    python examples/train_lm.py --arms bf16,attn_qat --steps 1000 --out examples/out/lm_long
    python examples/train_lm.py --size tiny --steps 50 --device cpu   # CPU smoke run
    torchrun --nproc_per_node=2 examples/train_lm.py              # DDP: each rank takes a slice of every batch

Writes <out>/<arm>.csv (step, train_loss, grad_norm, lr, val_loss, elapsed_s), <out>/loss.png,
<out>/grad_norm.png (needs matplotlib) and <out>/summary.json.
"""
import argparse
import pathlib
import sys
import sysconfig

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import ArmRunner, add_common_args, finish_args, run  # noqa: E402

VOCAB_SIZE = 256  # bytes; already a multiple of 64, so the embedding and LM head need no padding
SIZES = {
    "default": dict(num_hidden_layers=6, hidden_size=512, head_dim=128, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=1408, seq_len=512),
    "tiny": dict(num_hidden_layers=2, hidden_size=128, head_dim=64, num_attention_heads=2,
                 num_key_value_heads=1, intermediate_size=352, seq_len=64),
}
# The run sizes: on the CPU (no GPU, or --device cpu) a GPU-sized run would take hours.
GPU_DEFAULTS = dict(size="default", steps=1500, batch_size=32, eval_every=150, eval_batches=8)
CPU_DEFAULTS = dict(size="tiny", steps=300, batch_size=16, eval_every=50, eval_batches=4)
# --help's epilog; transformers is imported only after parse_args, so --help works without it.
EXTRA = 'needs the examples extra: python -m pip install -e ".[examples]" (transformers)'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXTRA,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, lr=1e-3, out="examples/out/lm", gpu=GPU_DEFAULTS, cpu=CPU_DEFAULTS)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help=f"default: {GPU_DEFAULTS['size']} on a GPU, {CPU_DEFAULTS['size']} on the CPU")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: 512, tiny: 64)")
    args = finish_args(parser, parser.parse_args(argv))
    if args.seq_len is None:
        args.seq_len = SIZES[args.size]["seq_len"]
    return args


# --------------------------------------------------------------------------------------------- data

def load_corpus():
    """(train bytes, validation bytes, file counts) from the standard library's .py files, sorted so the
    split is the same on every machine with the same Python; every 10th file is validation."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    # Some installs keep site-packages under the stdlib directory: third-party code is not the corpus.
    files = sorted(f for f in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(f.parts))
    train = [f.read_bytes() for i, f in enumerate(files) if i % 10 != 0]
    val = [f.read_bytes() for i, f in enumerate(files) if i % 10 == 0]
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    return as_tensor(train), as_tensor(val), {"train_files": len(train), "val_files": len(val), "root": str(root)}


def window_starts(data, count, seq_len, generator):
    return torch.randint(0, len(data) - seq_len - 1, (count,), generator=generator)


def gather_windows(data, starts, seq_len):
    """(len(starts), seq_len + 1) int64 token windows: inputs are [:, :-1], targets [:, 1:]."""
    offsets = starts[:, None] + torch.arange(seq_len + 1)
    return data[offsets].long()


# -------------------------------------------------------------------------------------------- model

def build_model(args):
    """A fresh Qwen3 (fp32 weights) drawn from args.seed, so every arm starts from the same weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dims = {k: v for k, v in SIZES[args.size].items() if k != "seq_len"}
    config = Qwen3Config(vocab_size=VOCAB_SIZE, max_position_embeddings=max(args.seq_len, 512),
                         tie_word_embeddings=True, attn_implementation="sdpa", **dims)
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(config).to(args.device)


class Runner(ArmRunner):
    """The byte-level LM: data, the fixed validation windows, model, loss (common.ArmRunner trains the arms)."""

    def __init__(self, args):
        super().__init__(args)
        self.train_data, self.val_data, self.corpus_info = load_corpus()
        # One fixed set of validation windows, the same for every evaluation of every arm.
        val_gen = torch.Generator().manual_seed(args.seed + 1)
        self.val_starts = window_starts(self.val_data, args.eval_batches * args.batch_size, args.seq_len, val_gen)
        self.tokens_per_step = args.batch_size * args.seq_len

    def build_model(self):
        return build_model(self.args)

    def batch_generator(self):
        return torch.Generator().manual_seed(self.args.seed)

    def train_batch(self, generator):
        args = self.args
        return gather_windows(self.train_data, window_starts(self.train_data, args.batch_size, args.seq_len,
                                                             generator), args.seq_len)

    def loss(self, model, windows):
        with self.autocast():
            logits = model(input_ids=windows[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), windows[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model):
        was_training = model.training
        model.eval()
        total = torch.zeros((), device=self.args.device)
        for starts in self.val_starts.split(self.args.batch_size):
            total += self.loss(model, self.local_rows(gather_windows(self.val_data, starts, self.args.seq_len)))
        model.train(was_training)
        return self.mean_over_ranks(total / self.args.eval_batches).item()


def main(argv=None):
    args = parse_args(argv)
    import transformers  # after parse_args: --help works without it
    runner = Runner(args)
    runner.log(f"corpus: {runner.corpus_info['train_files']} train files ({len(runner.train_data) / 1e6:.1f} MB), "
               f"{runner.corpus_info['val_files']} val files ({len(runner.val_data) / 1e6:.1f} MB); device "
               f"{args.device} x{runner.world}; arms {', '.join(args.arms)}")

    def summary_extra(summary):
        summary.update(seq_len=args.seq_len, transformers=transformers.__version__,
                       corpus=dict(runner.corpus_info, train_bytes=len(runner.train_data),
                                   val_bytes=len(runner.val_data)))

    run(runner, summary_extra, loss_label="cross-entropy (nats/byte)", title="Byte-level Qwen3 on the Python stdlib")


if __name__ == "__main__":
    sys.exit(main())
