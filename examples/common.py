"""What the example training scripts (train_lm.py, train_wan.py) share: the arms, the command-line options
common to both, the learning-rate schedule, the per-arm training loop (DDP, GradScaler, time budget,
fp4_inference evaluation of the bf16 arm) and the outputs (CSV per arm, loss.png, grad_norm.png,
summary.json).

A script subclasses `ArmRunner` with its model, batches, loss and evaluation, and calls `run(runner, ...)`.
"""
import csv
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import attn_qat

ALL_ARMS = ("bf16", "fp4_inference", "drop_in", "attn_qat", "high_precision_p", "low_precision_o")
TRAINED_MODES = ("attn_qat", "high_precision_p", "low_precision_o", "drop_in")
CSV_FIELDS = ("step", "train_loss", "grad_norm", "lr", "val_loss", "elapsed_s")


# ------------------------------------------------------------------------------------------ options

def add_common_args(parser, *, lr, out, gpu, cpu):
    """The options every example takes. gpu and cpu are dicts of the run-size defaults (steps, batch_size,
    eval_every, eval_batches, and the script's own size): a GPU-sized run takes hours on the CPU, so
    finish_args fills each option left unset from the dict that --device picks."""
    parser.add_argument("--arms", default=",".join(ALL_ARMS), help=f"comma list of {', '.join(ALL_ARMS)}")
    sized = lambda key: f"default: {gpu[key]} on a GPU, {cpu[key]} on the CPU"
    parser.add_argument("--steps", type=int, default=None, help=sized("steps"))
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"global batch (samples per step, all ranks; {sized('batch_size')})")
    parser.add_argument("--lr", type=float, default=lr, help="peak AdamW learning rate")
    parser.add_argument("--warmup-steps", type=int, default=None, help="linear warmup (default: 5%% of --steps)")
    parser.add_argument("--eval-every", type=int, default=None, help=sized("eval_every"))
    parser.add_argument("--eval-batches", type=int, default=None, help=sized("eval_batches"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda when a GPU is present, else cpu; picks the run-size defaults")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                        help="autocast dtype (weights and optimizer stay fp32; fp16 adds a GradScaler)")
    parser.add_argument("--time-budget-s", type=float, default=None, help="stop an arm's training after this long")
    parser.set_defaults(size_defaults={"gpu": gpu, "cpu": cpu})


def on_gpu(args):
    return torch.device(args.device).type == "cuda"


def finish_args(parser, args):
    """Validates and completes the common options (after parse_args)."""
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = set(args.arms) - set(ALL_ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ALL_ARMS)}")
    if "fp4_inference" in args.arms and "bf16" not in args.arms:
        args.arms.insert(0, "bf16")  # fp4_inference evaluates the bf16 arm's model, so that arm has to train
    for key, value in args.size_defaults["gpu" if on_gpu(args) else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    del args.size_defaults
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)
    return args


def warmup_cosine_schedule(optimizer, warmup_steps, steps):
    """transformers' schedule: linear warmup to the optimizer's lr, then cosine decay to 10% of it. Update k (from 1)
    trains at the schedule's value for step k: last_epoch=0 starts it one step in, so the first update does not
    train at step 0's lr of 0. Call step() after each optimizer step."""
    try:
        from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup  # not top-level in 4.56
    except ImportError as e:
        raise ImportError('the learning-rate schedule is transformers\' (the examples extra: python -m pip install '
                          '-e ".[examples]")') from e
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # what a schedule resumed at last_epoch >= 0 decays from
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup_steps, steps, min_lr_rate=0.1, last_epoch=0)


def progress_bar(total, desc):
    """A tqdm bar over `total` steps; off a terminal (a log file) it redraws at most every 30 s."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 30.0)


# -------------------------------------------------------------------------------------------- runner

class ArmRunner:
    """Holds what all arms share (the distributed layout, autocast, progress bars) and trains one arm.

    Subclasses provide:
        build_model()             a fresh fp32 model on args.device, drawn from args.seed
        batch_generator()         a torch.Generator seeded from args.seed (same batches for every arm)
        train_batch(generator)    the next global batch: a tensor or a tuple of tensors, batch first
        loss(model, batch)        scalar loss of this rank's slice of a batch
        evaluate(model)           validation loss (a float, averaged over ranks)
        tokens_per_step           attention tokens per step (for tokens/s)
        prepare_config(mode)      the attn_qat.QATConfig to prepare the model with (default: mode, strict)
    """

    tokens_per_step = 0

    def __init__(self, args):
        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.is_main = self.rank == 0
        if self.world > 1:
            if args.device.startswith("cuda"):
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
                args.device = f"cuda:{local_rank}"
                torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
            if args.batch_size % self.world:
                raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of WORLD_SIZE {self.world}")
        self.device_type = torch.device(args.device).type
        self.amp_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16

    def log(self, message):
        if self.is_main:
            print(message, flush=True)

    def local_rows(self, batch):
        """This rank's slice of a global batch (rows rank, rank + world, ...), on the device."""
        if isinstance(batch, (tuple, list)):
            return type(batch)(self.local_rows(b) for b in batch)
        return batch[self.rank::self.world].to(self.args.device, non_blocking=True)

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.amp_dtype)

    def mean_over_ranks(self, value):
        if self.world > 1:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.world
        return value

    def prepare_config(self, mode):
        return attn_qat.QATConfig(mode=mode, strict=True)

    def train_arm(self, arm, fp4_eval=False):
        """Trains one arm; returns {arm name: list of CSV rows} (two arms when fp4_eval is set)."""
        args = self.args
        model = self.build_model()
        if arm in TRAINED_MODES:
            # strict: an attention call attn_qat cannot take raises instead of quietly running bf16 SDPA.
            attn_qat.prepare(model, self.prepare_config(arm))
        elif fp4_eval:
            # Train with the library's attention (disabled attn_qat runs it); enable only to evaluate in FP4.
            attn_qat.convert(attn_qat.prepare(model, self.prepare_config("attn_qat")))
            attn_qat.disable(model)
        train_model = model
        if self.world > 1:
            train_model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[torch.device(args.device).index] if self.device_type == "cuda" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                      fused=self.device_type == "cuda")
        schedule = warmup_cosine_schedule(optimizer, args.warmup_steps, args.steps)
        scaler = torch.amp.GradScaler(self.device_type, enabled=self.amp_dtype == torch.float16)
        # Same generator seed for every arm: identical batches in identical order.
        batch_gen = self.batch_generator()
        rows = {arm: []}
        if fp4_eval:
            rows["fp4_inference"] = []
        bar = progress_bar(args.steps, arm) if self.is_main else None
        shown = {}  # the bar's numbers: the last step's, and the last evaluation's
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.train()
        for step in range(1, args.steps + 1):
            batch = self.train_batch(batch_gen)
            lr = schedule.get_last_lr()[0]
            loss = self.loss(train_model, self.local_rows(batch))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            # clip_grad_norm_ returns the norm before clipping: that is what shows QAT instability.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            row = {"step": step, "train_loss": self.mean_over_ranks(loss).item(), "grad_norm": grad_norm.item(),
                   "lr": lr, "val_loss": ""}
            elapsed = time.perf_counter() - start
            out_of_time = args.time_budget_s is not None and elapsed > args.time_budget_s
            if self.world > 1:  # every rank must stop at the same step, and rank 0's clock decides
                flag = torch.tensor(float(out_of_time), device=args.device)
                dist.broadcast(flag, 0)
                out_of_time = bool(flag.item())
            last = step == args.steps or out_of_time
            if step % args.eval_every == 0 or last:
                row["val_loss"] = self.evaluate(model)
                if fp4_eval:
                    attn_qat.enable(model)
                    rows["fp4_inference"].append({"step": step, "train_loss": "", "grad_norm": "", "lr": "",
                                                  "val_loss": self.evaluate(model), "elapsed_s": elapsed})
                    attn_qat.disable(model)
                shown["val"] = f"{row['val_loss']:.4f}"
                if fp4_eval:
                    shown["val_fp4"] = f"{rows['fp4_inference'][-1]['val_loss']:.4f}"
            row["elapsed_s"] = time.perf_counter() - start
            rows[arm].append(row)
            if bar is not None:
                shown.update(loss=f"{row['train_loss']:.3f}", gnorm=f"{row['grad_norm']:.2f}",
                             tok_s=f"{step * self.tokens_per_step / elapsed:,.0f}")
                bar.set_postfix(shown, refresh=False)
                bar.update()
            if out_of_time:
                break
        if bar is not None:
            bar.close()
        elapsed = rows[arm][-1]["elapsed_s"]
        steps_done = rows[arm][-1]["step"]
        if steps_done < args.steps:
            self.log(f"{arm}: time budget of {args.time_budget_s} s reached after {steps_done} steps")
        self.log(f"{arm}: {steps_done} steps in {elapsed:.1f} s, {steps_done * self.tokens_per_step / elapsed:,.0f} "
                 f"tokens/s (evaluation included), val loss {rows[arm][-1]['val_loss']:.4f}"
                 + (f", fp4_inference val loss {rows['fp4_inference'][-1]['val_loss']:.4f}" if fp4_eval else ""))
        del train_model, model, optimizer
        if self.device_type == "cuda":
            torch.cuda.empty_cache()
        return rows


# ------------------------------------------------------------------------------------------ outputs

def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def smooth(values, weight=0.9):
    """Bias-corrected exponential moving average, as TensorBoard draws it."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def plot(results, out, loss_label, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (arm, rows) in enumerate(results.items()):
        color = f"C{i}"
        trained = [r for r in rows if r["train_loss"] != ""]
        if trained:
            ax.plot([r["step"] for r in trained], smooth([r["train_loss"] for r in trained]), color=color, lw=1,
                    alpha=0.6, label=f"{arm} train (EMA)")
        evals = [r for r in rows if r["val_loss"] != ""]
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--", color=color, ms=4,
                label=f"{arm} val")
    ax.set(xlabel="step", ylabel=loss_label, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (arm, rows) in enumerate(results.items()):
        trained = [r for r in rows if r["grad_norm"] != ""]
        if trained:
            steps, norms = [r["step"] for r in trained], [r["grad_norm"] for r in trained]
            ax.plot(steps, norms, color=f"C{i}", lw=0.5, alpha=0.3)
            ax.plot(steps, smooth(norms), color=f"C{i}", lw=1.2, label=arm)
    ax.set(xlabel="step", ylabel="gradient norm before clipping", yscale="log", title="Gradient norm (clip at 1.0)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "grad_norm.png", dpi=120)
    plt.close(fig)


def git_commit():
    """ATTN_QAT_COMMIT wins (the GPU machine gets a copy of the working tree without this .git), else git."""
    commit = os.environ.get("ATTN_QAT_COMMIT")
    if commit:
        return commit
    here = pathlib.Path(__file__).resolve().parent
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, text=True,
                                         stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, text=True,
                                        stderr=subprocess.DEVNULL).strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def summarize(results, runner):
    """The per-arm part of summary.json and the run facts every example records."""
    args = runner.args
    final = {arm: rows[-1]["val_loss"] for arm, rows in results.items()}
    arms = {}
    for arm, rows in results.items():
        norms = [r["grad_norm"] for r in rows if r["grad_norm"] != ""]
        # Non-finite norms (a skipped fp16 GradScaler step, or a real blow-up) are counted, not averaged in.
        finite_norms = [n for n in norms if math.isfinite(n)]
        entry = {"final_val_loss": final[arm],
                 "gap_to_bf16": final[arm] - final["bf16"] if "bf16" in final else None,
                 "steps": rows[-1]["step"]}
        if finite_norms:
            entry.update(max_grad_norm=max(finite_norms), median_grad_norm=statistics.median(finite_norms),
                         nonfinite_grad_norms=len(norms) - len(finite_norms),
                         elapsed_s=rows[-1]["elapsed_s"],
                         tokens_per_s=rows[-1]["step"] * runner.tokens_per_step / rows[-1]["elapsed_s"])
        arms[arm] = entry
    device = torch.cuda.get_device_name(args.device) if runner.device_type == "cuda" else platform.processor() or "cpu"
    return {"arms": arms, "seed": args.seed, "steps": args.steps, "size": args.size, "batch_size": args.batch_size,
            "lr": args.lr, "dtype": args.dtype, "world_size": runner.world, "device": device,
            "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit()}


def run(runner, summary_extra=None, loss_label="loss", title=""):
    """Trains every arm of runner.args.arms, then (rank 0) writes the outputs and prints a table.
    summary_extra(summary) may add run-specific facts to summary.json."""
    args = runner.args
    results = {}
    for arm in args.arms:
        if arm != "fp4_inference":  # produced by the bf16 arm
            results.update(runner.train_arm(arm, fp4_eval=arm == "bf16" and "fp4_inference" in args.arms))
    if runner.is_main:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for arm, rows in results.items():
            write_csv(out / f"{arm}.csv", rows)
        summary = summarize(results, runner)
        if summary_extra is not None:
            summary_extra(summary)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot(results, out, loss_label, title)
        print(f"{'arm':<18}{'val loss':>10}{'vs bf16':>10}{'max |g|':>10}{'median |g|':>12}")
        for arm, s in summary["arms"].items():
            gap = f"{s['gap_to_bf16']:+.4f}" if s["gap_to_bf16"] is not None else "-"
            max_norm = f"{s['max_grad_norm']:.3f}" if "max_grad_norm" in s else "-"  # fp4_inference: no training
            median_norm = f"{s['median_grad_norm']:.3f}" if "median_grad_norm" in s else "-"
            print(f"{arm:<18}{s['final_val_loss']:>10.4f}{gap:>10}{max_norm:>10}{median_norm:>12}")
        print(f"wrote {out}/")
    if runner.world > 1:
        dist.destroy_process_group()
    return results
