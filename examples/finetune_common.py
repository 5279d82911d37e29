"""The fine-tuning protocol that finetune_lm.py and finetune_wan.py share.

One pretrained model (bf16 weights) is fine-tuned once per arm and seed. Every arm of a seed takes the same
steps, the same batches in the same order and the same learning-rate schedule; the seed picks the batches. Arms:

    bf16              the model's own attention (PyTorch SDPA): the control
    attn_qat, drop_in, high_precision_p, low_precision_o
                      attn_qat in that mode (docs/numerics.md §5), evaluated with FP4 attention
    attn_qat_qk       attn_qat with Q and K rotated and K shifted before quantization (numerics.md §9; the K shift
                      calibrated on the pretrained model before fine-tuning, task.calibrate)
    attn_qat_qk_distill
                      attn_qat_qk trained to match a bf16 teacher instead of the data: the teacher is the bf16 arm
                      itself, fine-tuned in lockstep on the same batches (same seed, schedule and optimizer), and
                      each step the student's loss is task.distillation_loss against the teacher's output on that
                      batch before the teacher's update (the LM: KL(teacher || student) of the next-token
                      distributions; Wan: the MSE to the teacher's velocity). Its curve's train_loss is the
                      student's loss on the data, as every arm's, its distill_loss the objective, whose gradient
                      grad_norm is; the teacher's final held-out loss is in the payload and the summary.
    attn_qat_qk_distill_frozen
                      the same, but the teacher is fine-tuned first (the bf16 arm: the whole schedule on the same
                      batches), then frozen: every step the student matches the finished teacher's output on the
                      batch. It tests whether the lockstep arm lags only because its teacher moves.

Evaluations without training (post-training quantization, PTQ):

    base, base_ptq    the pretrained model with bf16 / FP4 attention
    ptq               each seed's bf16 fine-tune evaluated with FP4 attention
    base_ptq_qk, ptq_qk
                      the same with the §9 transforms (K shift calibrated on the model evaluated), with attn_qat_qk

Every entry is evaluated item by item on one fixed held-out set (the same items for every arm and seed), so
entries are compared pairwise over the items: 95% intervals are percentile intervals of a paired bootstrap over
the held-out items (scipy.stats.bootstrap, 10,000 resamples, one set of resamples for every statistic of a
report). An interval covers the variation of the held-out sample, not that of the seeds: the seeds are reported
one by one next to it.

Training: AdamW on fp32 master copies of the bf16 weights (a bf16 weight rounds away updates below half its
last bit, which at fine-tuning learning rates are most of them), bf16 autocast, linear warmup then cosine decay
to 10% of the peak (transformers' get_cosine_with_min_lr_schedule_with_warmup), gradient clipping at 1.0; the
logged gradient norm is before clipping.

Outputs under --out: runs/<entry>_seed<k>.json (per-item held-out losses and the task's extras) and
runs/<arm>_seed<k>.csv (the training curve), each written as its run ends, so a timeout loses at most the run in
progress and a rerun skips the runs already there; then summary.json, results.csv, table.md, loss.png,
grad_norm.png and gaps.png, recomputed over every run in the folder (runs of several invocations merge).
"""
import csv
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
import torch

import attn_qat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import git_commit, progress_bar, smooth, warmup_cosine_schedule  # noqa: E402

ARMS = ("bf16", "attn_qat", "drop_in", "high_precision_p", "low_precision_o", "attn_qat_qk", "attn_qat_qk_distill",
        "attn_qat_qk_distill_frozen")
FP4_ARMS = ARMS[1:]
# Arms that break one of the paper's two principles (docs/numerics.md §5): compared with attn_qat pairwise.
PRINCIPLE_ABLATIONS = ("high_precision_p", "low_precision_o")
# What each arm sets in its QATConfig (every other arm: mode=arm).
ARM_SETTINGS = {arm: dict(mode="attn_qat", rotate_qk=True, shift_k=True)
                for arm in ("attn_qat_qk", "attn_qat_qk_distill", "attn_qat_qk_distill_frozen")}
# Arms that learn from a bf16 teacher rather than from the data alone: fine-tuned in lockstep, or first and frozen.
DISTILLED_ARMS = frozenset({"attn_qat_qk_distill", "attn_qat_qk_distill_frozen"})
FROZEN_TEACHER_ARMS = frozenset({"attn_qat_qk_distill_frozen"})
# Entries of a report, in table order. "base" and "base_ptq*" have no seed (stored as seed "base").
ENTRIES = ("base", "base_ptq", "base_ptq_qk", "bf16", "ptq", "ptq_qk") + FP4_ARMS
BASE_ENTRIES = ("base", "base_ptq", "base_ptq_qk")
# Entries evaluated without training, and their twins with the Q/K transforms (the attn_qat_qk arm's numerics).
QK_PTQ = {"base_ptq": "base_ptq_qk", "ptq": "ptq_qk"}
DESCRIPTIONS = {
    "base": "pretrained model, bf16 attention",
    "base_ptq": "pretrained model, FP4 attention (PTQ, no training)",
    "base_ptq_qk": "pretrained model, FP4 attention with Q/K rotated and K shifted (PTQ, no training)",
    "bf16": "bf16 fine-tune (control)",
    "ptq": "bf16 fine-tune, FP4 attention (PTQ, no training)",
    "ptq_qk": "bf16 fine-tune, FP4 attention with Q/K rotated and K shifted (PTQ, no training)",
    "attn_qat": "Attn-QAT fine-tune",
    "drop_in": "drop-in QAT fine-tune (FP4 forward, bf16 backward)",
    "high_precision_p": "QAT, dV from the unquantized P (breaks principle 1)",
    "low_precision_o": "QAT, D = dO·O (breaks principle 2)",
    "attn_qat_qk": "Attn-QAT fine-tune, Q/K rotated and K shifted (numerics.md §9)",
    "attn_qat_qk_distill": "attn_qat_qk distilled from the bf16 fine-tune, trained in lockstep",
    "attn_qat_qk_distill_frozen": "attn_qat_qk distilled from the finished bf16 fine-tune, frozen",
}
# distill_loss: the distilled arms' objective (task.distillation_loss), whose gradient grad_norm is
CURVE_FIELDS = ("step", "train_loss", "distill_loss", "grad_norm", "lr", "val_loss", "val_loss_fp4", "elapsed_s")
BASE_SEED = "base"
RESAMPLES = 10_000


# ------------------------------------------------------------------------------------------ options

def qat_config(arm, balance_qk=None, learn_qk=False, **fields):
    """The QATConfig of an arm ("bf16" evaluates in FP4 as "attn_qat"), with the task's other `fields`;
    `balance_qk` (--balance-qk) adds the Q/K balance to the transformed arm and its PTQ twins, `learn_qk` (--learn-qk)
    trains the transformed arm's rotation and balance (learn_qk_transforms; its PTQ twins, untrained, keep the
    fixed transforms the learning starts from)."""
    settings = ARM_SETTINGS.get(arm, dict(mode="attn_qat" if arm == "bf16" else arm))
    if balance_qk is not None and settings.get("rotate_qk"):
        settings = dict(settings, balance_qk=balance_qk)
    if learn_qk and settings.get("rotate_qk"):
        settings = dict(settings, learn_qk_transforms=True)
    return attn_qat.QATConfig(**settings, **fields)


def add_protocol_args(parser, presets, out):
    """The options both experiments take; `presets` maps a preset name to the defaults of every option set to
    None here (finish_args fills them)."""
    names = ", ".join(presets)
    parser.add_argument("--preset", choices=sorted(presets), default=None,
                        help=f"run size ({names}; default: h100 when a GPU is present, else smoke)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--seeds", default=None, help="comma list of seeds (they pick the batches; preset default)")
    parser.add_argument("--steps", type=int, default=None, help="fine-tuning steps per arm")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate of the fine-tunes")
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None, help="steps between curve evaluations")
    parser.add_argument("--out", default=out, help="results folder (runs already in it are kept and merged)")
    parser.add_argument("--balance-qk", type=float, default=None, metavar="ALPHA",
                        help="attn_qat_qk and its PTQ twins also balance Q and K channels (QATConfig(balance_qk="
                             "ALPHA), numerics.md §9); use its own --out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no run that would end after this many minutes of the invocation (measured per "
                             "run; the rest is left for a later invocation, which skips the runs done)")
    parser.add_argument("--overwrite", action="store_true", help="redo runs whose results are in --out")
    parser.add_argument("--report-only", action="store_true",
                        help="only recompute summary.json, results.csv and the plots from the runs in --out")
    parser.set_defaults(presets=presets)


def finish_args(parser, args):
    presets = args.presets
    del args.presets
    if args.preset is None:
        args.preset = "h100" if torch.device(args.device).type == "cuda" else "smoke"
    for key, value in presets[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    args.arms = [a for a in ARMS if a in args.arms]  # bf16 first: the report pairs every arm with it
    try:
        args.seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    if not args.seeds:
        parser.error("--seeds is empty")
    if args.balance_qk is not None:
        try:  # QATConfig's own check, said before the minutes of setup rather than at the first transformed arm
            attn_qat.QATConfig(balance_qk=args.balance_qk)
        except ValueError as e:
            parser.error(f"--balance-qk: {e}")
    return args


# ------------------------------------------------------------------------------------------ training

def to_bf16_weights(model):
    """Casts the model's floating-point weights to bf16, leaving those the model keeps in fp32
    (`_keep_in_fp32_modules`, e.g. Wan's time embedder, norms and scale-shift tables) in fp32; returns the model."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep & set(name.split(".")) else torch.bfloat16)
    return model


class MasterWeightAdamW:
    """AdamW on fp32 master copies of a (bf16) model's parameters: gradients are copied to the masters, clipped
    there, the masters step, and the model's weights are set to the masters rounded to their dtype. `own_lr`:
    (parameters, lr) that train at another peak learning rate (the learned Q/K transforms, --learn-qk-lr)."""

    def __init__(self, params, lr, weight_decay=0.0, betas=(0.9, 0.95), own_lr=None):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        fused = all(p.device.type == "cuda" for p in self.params)
        own = {id(p) for p in own_lr[0]} if own_lr is not None else set()
        groups = [{"params": [m for m, p in zip(self.master, self.params) if id(p) not in own]}]
        if own:
            groups.append({"params": [m for m, p in zip(self.master, self.params) if id(p) in own], "lr": own_lr[1]})
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                           weight_decay=weight_decay, fused=fused)

    @torch.no_grad()
    def step(self, clip=1.0):
        """One step from the model's gradients at the optimizer's learning rate (self.optimizer's, which a schedule
        sets); returns the gradient norm before clipping (a 0-d tensor)."""
        with_grad = [(m.grad, p.grad) for m, p in zip(self.master, self.params) if p.grad is not None]
        for m, p in zip(self.master, self.params):
            if p.grad is None:
                m.grad.zero_()
            p.grad = None
        if with_grad:
            torch._foreach_copy_(*map(list, zip(*with_grad)))  # one launch per dtype group, not per tensor
        norm = torch.nn.utils.clip_grad_norm_(self.master, clip)
        self.optimizer.step()
        torch._foreach_copy_(self.params, self.master)
        return norm


class Deadline:
    """Decides whether another run fits in --max-minutes, from the longest run so far in bf16-arm units (plus 25%: an
    FP4 arm can take longer than the bf16 arm before it; a distilled arm, which also trains or runs its teacher,
    2.5 times it)."""

    def __init__(self, minutes):
        self.start = time.perf_counter()
        self.limit = None if minutes is None else 60 * minutes
        self.longest = 0.0

    def elapsed(self):
        return time.perf_counter() - self.start

    @staticmethod
    def factor(arm):
        return 2.5 if arm in DISTILLED_ARMS else 1.25

    def record(self, arm, seconds):
        self.longest = max(self.longest, seconds * 1.25 / self.factor(arm))  # a distilled run counts as ~2 plain ones

    def allows(self, arm):
        return self.limit is None or self.elapsed() + self.factor(arm) * self.longest <= self.limit


def train(task, model, arm, seed, args, progress=True, generator=None, weight_decay=None, teacher=None,
          teacher_learns=True):
    """Fine-tunes `model` (prepared for `arm`) in place for args.steps steps (schedule: args.lr, args.warmup_steps;
    evaluations every args.eval_every); returns the curve rows (CURVE_FIELDS). A tqdm bar shows the progress and the
    last evaluation (`progress`: its label, True for "<arm> seed <seed>", False for no bar). Batches come from
    `generator` (default: task.batch_generator(seed)). With a `teacher` (a bf16 model), `model` learns from the
    teacher's output on each batch (task.distillation_loss) instead of the data; unless teacher_learns=False (a
    finished teacher, frozen), the teacher takes the bf16 arm's step on each batch first.

    The gradient norm and loss stay on the device until an evaluation, so the host does not wait for the device at
    every step. At each evaluation the held-out curve subset is evaluated; the bf16 arm also evaluates it with FP4
    attention (its PTQ curve).
    """
    weight_decay = task.weight_decay if weight_decay is None else weight_decay
    own_lr = None
    if getattr(args, "learn_qk_lr", None) is not None and task.qat_config(arm).learn_qk_transforms:
        own_lr = (list(attn_qat.learned_qk_parameters(model).values()), args.learn_qk_lr)
    optimizer = MasterWeightAdamW(model.parameters(), lr=args.lr, weight_decay=weight_decay, own_lr=own_lr)
    schedule = warmup_cosine_schedule(optimizer.optimizer, args.warmup_steps, args.steps)
    if teacher is not None and teacher_learns:
        teacher_optimizer = MasterWeightAdamW(teacher.parameters(), lr=args.lr, weight_decay=weight_decay)
        teacher_schedule = warmup_cosine_schedule(teacher_optimizer.optimizer, args.warmup_steps, args.steps)
        teacher.train()
    generator = task.batch_generator(seed) if generator is None else generator
    rows, pending = [], []
    sync = (lambda: torch.cuda.synchronize(model_device(model))) if task.device.type == "cuda" else (lambda: None)
    bar = progress_bar(args.steps, f"{arm} seed {seed}" if progress is True else progress) if progress else None
    sync()
    start = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        batch = task.train_batch(generator)
        lr = schedule.get_last_lr()[0]
        if teacher is None:
            with task.autocast():
                loss = task.loss(model, batch)
            loss.backward()
            data_loss = distill_loss = loss.detach()
        else:
            if teacher_learns:
                with task.autocast():
                    target = task.output(teacher, batch)
                    teacher_loss = task.loss_from_output(target, batch)
                teacher_loss.backward()
                teacher_optimizer.step()
                teacher_schedule.step()
            else:
                with torch.no_grad(), task.autocast():
                    target = task.output(teacher, batch)
            with task.autocast():
                output = task.output(model, batch)
                loss = task.distillation_loss(output, target.detach())
            loss.backward()
            distill_loss = loss.detach()
            with torch.no_grad():
                data_loss = task.loss_from_output(output.detach(), batch)
            del target, output
        norm = optimizer.step()
        schedule.step()
        pending.append((step, data_loss, distill_loss, norm, lr))
        if step % args.eval_every == 0 or step == args.steps:
            values = torch.stack([torch.stack((l.float(), d.float(), n.float())) for _, l, d, n, _ in pending]).tolist()
            for (s, *_, r), (l, d, n) in zip(pending, values):
                rows.append({"step": s, "train_loss": l, "distill_loss": d if teacher is not None else "",
                             "grad_norm": n, "lr": r, "val_loss": "", "val_loss_fp4": "", "elapsed_s": ""})
            pending = []
            row = rows[-1]
            row["val_loss"] = task.curve_loss(model)
            if arm == "bf16":
                attn_qat.enable(model)
                row["val_loss_fp4"] = task.curve_loss(model)
                attn_qat.disable(model)
            row["elapsed_s"] = time.perf_counter() - start
            if bar is not None:  # the numbers of the last step before the evaluation, and the curve subset's loss
                shown = {"train": f"{row['train_loss']:.4f}", "|g|": f"{row['grad_norm']:.3f}",
                         "held-out": f"{row['val_loss']:.4f}"}
                if arm == "bf16":
                    shown["FP4"] = f"{row['val_loss_fp4']:.4f}"
                bar.set_postfix(shown, refresh=False)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    model.eval()
    return rows


def model_device(model):
    return next(model.parameters()).device


def finetune(task, arm, seed, args):
    """One fine-tune and its evaluations: {entry: payload} ("bf16" also gives "ptq"), and the curve rows."""
    if arm == "bf16":
        model = fresh_bf16_model(task)
    else:
        # strict: an attention call attn_qat cannot take raises instead of quietly running bf16 SDPA.
        model = prepare_arm(task, task.fresh_model(), arm)
    teacher = fresh_bf16_model(task) if arm in DISTILLED_ARMS else None
    t0 = time.perf_counter()
    frozen = arm in FROZEN_TEACHER_ARMS
    if frozen:  # the bf16 arm of this seed, fine-tuned first (without the bf16 arm's FP4 curve); its curve is not kept
        train(task, teacher, "teacher", seed, args, progress=f"{arm} seed {seed}: its teacher")
        teacher.requires_grad_(False)
    rows = train(task, model, arm, seed, args, teacher=teacher, teacher_learns=not frozen)
    train_s = time.perf_counter() - t0
    payloads = {}
    if arm == "bf16":
        payloads["bf16"] = task.evaluate(model, fp4=False, entry="bf16", seed=seed)
        payloads.update(evaluate_ptq(task, model, "ptq", seed))
    else:
        attn_qat.convert(model)  # the inference forward (numerics.md §3), as a deployed model runs it
        payloads[arm] = task.evaluate(model, fp4=True, entry=arm, seed=seed)
    if teacher is not None:
        teacher.eval()
        # the bf16 arm of this seed again, up to the GPU's nondeterminism (the report gives both)
        payloads[arm]["teacher_loss"] = float(task.heldout_losses(teacher).mean())
        del teacher
    for payload in payloads.values():
        payload.update(train_s=train_s, steps=args.steps, tokens_per_step=task.tokens_per_step)
    del model
    if task.device.type == "cuda":
        torch.cuda.empty_cache()
    return payloads, rows


def fresh_bf16_model(task):
    """The pretrained model with the library's attention: attn_qat prepared, converted and disabled (a disabled
    attn_qat runs bf16 SDPA), so that enabling it evaluates the same model in FP4."""
    return attn_qat.disable(attn_qat.convert(attn_qat.prepare(task.fresh_model(), task.qat_config("bf16"))))


def prepare_arm(task, model, arm):
    """attn_qat.prepare for `arm`; with the K shift or the Q/K balance, calibrated on `model` as it is now
    (task.calibrate)."""
    config = task.qat_config(arm)
    attn_qat.prepare(model, config)
    if config.calibrated_qk:
        task.calibrate(model)
    return model


def evaluate_ptq(task, model, entry, seed):
    """{entry: payload} of `model` (trained in bf16; prepared, converted and disabled) evaluated with FP4 attention,
    and as QK_PTQ[entry] with the Q/K transforms (the K shift calibrated on `model`)."""
    attn_qat.enable(model)
    payloads = {entry: task.evaluate(model, fp4=True, entry=entry, seed=seed)}
    attn_qat.convert(prepare_arm(task, model, "attn_qat_qk"))
    payloads[QK_PTQ[entry]] = task.evaluate(model, fp4=True, entry=QK_PTQ[entry], seed=seed)
    return payloads


def evaluate_base(task):
    model = fresh_bf16_model(task)
    model.eval()
    payloads = {"base": task.evaluate(model, fp4=False, entry="base", seed=BASE_SEED)}
    payloads.update(evaluate_ptq(task, model, "base_ptq", BASE_SEED))
    del model
    return payloads


# ------------------------------------------------------------------------------------------ results

class RunStore:
    """runs/<entry>_seed<seed>.json payloads and runs/<arm>_seed<seed>.csv curves under `out`."""

    def __init__(self, out):
        self.out = pathlib.Path(out)
        self.runs = self.out / "runs"

    def path(self, entry, seed, ext="json"):
        return self.runs / f"{entry}_seed{seed}.{ext}"

    def has(self, entry, seed):
        return self.path(entry, seed).exists()

    def save(self, entry, seed, payload):
        self.runs.mkdir(parents=True, exist_ok=True)
        path = self.path(entry, seed)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(payload, entry=entry, seed=seed)) + "\n")
        os.replace(tmp, path)  # a run killed while writing leaves no half file behind

    def save_curve(self, arm, seed, rows):
        self.runs.mkdir(parents=True, exist_ok=True)
        with open(self.path(arm, seed, "csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CURVE_FIELDS)
            writer.writeheader()
            writer.writerows(rows)

    def setups(self):
        """What each invocation that ran something recorded after its setup (machine, versions, data hashes)."""
        path = self.runs / "setup.json"
        return json.loads(path.read_text()) if path.exists() else []

    def add_setup(self, record):
        self.runs.mkdir(parents=True, exist_ok=True)
        records = self.setups() + [record]
        tmp = self.runs / "setup.json.tmp"
        tmp.write_text(json.dumps(records, indent=1) + "\n")
        os.replace(tmp, self.runs / "setup.json")

    def load_all(self):
        """{entry: {seed: payload}} of every run in the folder."""
        found = {}
        for path in sorted(self.runs.glob("*_seed*.json")):
            payload = json.loads(path.read_text())
            found.setdefault(payload["entry"], {})[payload["seed"]] = payload
        return found

    def load_curves(self):
        """{arm: {seed: rows}} with numbers parsed ('' stays '')."""
        curves = {}
        for path in sorted(self.runs.glob("*_seed*.csv")):
            arm, seed = path.stem.rsplit("_seed", 1)
            with open(path, newline="") as f:
                rows = [{k: (float(v) if v != "" else "") for k, v in row.items()} for row in csv.DictReader(f)]
            curves.setdefault(arm, {})[int(seed)] = rows
        return curves


def run_experiment(task, args, log=print):
    """Runs the base evaluations and every (seed, arm) not yet in --out, seed by seed (bf16 first), within
    --max-minutes; then writes the report over all runs in --out. Returns the summary."""
    store = RunStore(args.out)
    if not args.report_only:
        deadline = Deadline(args.max_minutes)
        todo = [(seed, arm) for seed in args.seeds for arm in args.arms
                if args.overwrite or not store.has(arm, seed)]
        need_base = args.overwrite or not all(store.has(e, BASE_SEED) for e in BASE_ENTRIES)
        if todo or need_base:
            task.setup()
            task.setup_done = True  # run_pareto's cue
            log(f"setup done in {deadline.elapsed():.0f} s")
            store.add_setup(dict(environment(args.device), config=task.config_summary(),
                                 arms=args.arms, seeds=args.seeds))
        if need_base:
            t0 = time.perf_counter()
            for entry, payload in evaluate_base(task).items():
                store.save(entry, BASE_SEED, payload)
            log(f"base model evaluated in {time.perf_counter() - t0:.0f} s")
        skipped = []
        for seed, arm in todo:
            if not deadline.allows(arm):
                skipped.append(f"{arm} seed {seed}")
                continue
            t0 = time.perf_counter()
            payloads, rows = finetune(task, arm, seed, args)
            store.save_curve(arm, seed, rows)
            for entry, payload in payloads.items():
                store.save(entry, seed, payload)
            seconds = time.perf_counter() - t0
            deadline.record(arm, seconds)
            log(f"{arm} seed {seed}: {seconds:.0f} s, held-out loss " + ", ".join(
                f"{e} {p['loss']:.4f}" for e, p in payloads.items()))
        if skipped:
            log(f"--max-minutes {args.max_minutes} reached: not run ({len(skipped)}): {', '.join(skipped)}; run the "
                "same command again to do them (runs already in --out are skipped)")
        if getattr(args, "keep_bf16", None):
            run_pareto(task, args, store, deadline, log)
    summary = report(task, store, args, log)
    return summary


# --------------------------------------------------------------------------------------- statistics

class Bootstrap:
    """Paired bootstrap over `n` held-out items: scipy.stats.bootstrap (paired, 95% percentile intervals). Every
    statistic's resamples come from the same seed, so all intervals of a report resample the same items together."""

    def __init__(self, n, resamples=RESAMPLES, seed=0):
        self.n, self.resamples, self.seed = n, resamples, seed

    def _interval(self, statistic, *samples):
        from scipy.stats import bootstrap
        samples = [s.double().cpu().numpy() for s in samples]
        if any(len(s) != self.n for s in samples):
            raise ValueError(f"the bootstrap is over {self.n} items; got samples of {[len(s) for s in samples]}")
        with np.errstate(divide="ignore", invalid="ignore"):  # a degenerate resample gives a NaN interval instead
            result = bootstrap(samples, statistic, n_resamples=self.resamples, paired=True, vectorized=True,
                               method="percentile", rng=np.random.default_rng(self.seed))
        return [float(result.confidence_interval.low), float(result.confidence_interval.high)]

    def mean(self, x):
        """(mean, [low, high]) of the mean of x (n,)."""
        return float(x.double().mean()), self._interval(np.mean, x)

    def ratio(self, num, den):
        """(mean(num) / mean(den), interval) over the same resamples."""
        value = float(num.double().mean() / den.double().mean())
        return value, self._interval(lambda a, b, axis: a.mean(axis) / b.mean(axis), num, den)


def stack_seeds(per_seed, seeds):
    return torch.stack([torch.tensor(per_seed[s], dtype=torch.float64) for s in seeds])


def loss_report(runs, curves, item_key="item_losses"):
    """The loss part of the summary: per entry, the held-out loss, its gap to bf16, the fraction of the PTQ gap
    recovered and gradient-norm statistics, each with paired bootstrap intervals (see the module docstring)."""
    items = {e: {s: p[item_key] for s, p in seeds.items()} for e, seeds in runs.items() if e in ENTRIES}
    sizes = {len(v) for seeds in items.values() for v in seeds.values()}
    if len(sizes) != 1:
        raise ValueError(f"runs in this folder have different numbers of held-out items ({sorted(sizes)}); they do "
                         "not come from one configuration: use one --out per configuration")
    boot = Bootstrap(sizes.pop())
    out = {}
    for entry in ENTRIES:
        if entry not in items:
            continue
        seeds = sorted(items[entry], key=str)
        x = stack_seeds(items[entry], seeds)
        mean, ci = boot.mean(x.mean(0))
        info = {"description": DESCRIPTIONS[entry], "seeds": seeds, "loss": mean, "loss_ci": ci,
                "loss_per_seed": {str(s): float(x[i].mean()) for i, s in enumerate(seeds)}}
        reference = "base" if entry in BASE_ENTRIES[1:] else ("bf16" if entry not in ("base", "bf16") else None)
        if reference is not None and reference in items:
            common = [s for s in seeds if s in items[reference]]
            if common:
                d = stack_seeds(items[entry], common) - stack_seeds(items[reference], common)
                gap, gap_ci = boot.mean(d.mean(0))
                ref_loss = float(stack_seeds(items[reference], common).mean())
                info[f"gap_to_{reference}"] = {
                    "seeds": common, "mean": gap, "ci": gap_ci, "relative": gap / ref_loss,
                    "per_seed": {str(s): dict(zip(("mean", "ci"), boot.mean(d[i]))) for i, s in enumerate(common)}}
        if (entry in FP4_ARMS or entry == "ptq_qk") and "ptq" in items and "bf16" in items:
            common = [s for s in seeds if s in items["ptq"] and s in items["bf16"]]
            if common:
                arm, ptq, bf16 = (stack_seeds(items[e], common) for e in (entry, "ptq", "bf16"))
                value, ci = boot.ratio((ptq - arm).mean(0), (ptq - bf16).mean(0))
                # The ratio's interval means something only when the PTQ gap itself is resolved (its interval above 0).
                _, gap_ci = boot.mean((ptq - bf16).mean(0))
                info["recovered"] = {
                    "seeds": common, "mean": value, "ci": ci, "ptq_gap_resolved": gap_ci[0] > 0,
                    "per_seed": {str(s): dict(zip(("mean", "ci"), boot.ratio(ptq[i] - arm[i], ptq[i] - bf16[i])))
                                 for i, s in enumerate(common)}}
        if entry in PRINCIPLE_ABLATIONS and "attn_qat" in items:
            # each principle's cost, paired item by item (the recovered fractions' intervals overlap either way)
            common = [s for s in seeds if s in items["attn_qat"]]
            if common:
                d = stack_seeds(items[entry], common) - stack_seeds(items["attn_qat"], common)
                diff, diff_ci = boot.mean(d.mean(0))
                info["diff_to_attn_qat"] = {
                    "seeds": common, "mean": diff, "ci": diff_ci,
                    "per_seed": {str(s): dict(zip(("mean", "ci"), boot.mean(d[i]))) for i, s in enumerate(common)}}
        if entry in curves:
            info["grad_norm"] = grad_norm_stats(curves, entry)
        if entry in DISTILLED_ARMS:
            # the teacher's held-out loss beside the bf16 arm's of the same seed (equal on the CPU)
            info["teacher_loss_per_seed"] = {str(s): runs[entry][s].get("teacher_loss") for s in seeds}
        out[entry] = info
    return out, boot


def grad_norm_stats(curves, arm):
    """Gradient-norm statistics of an arm's curves: median over all steps, largest after warmup (first 10% of the
    steps), median over the last quarter, and that last-quarter median over bf16's of the same seed."""
    per_seed = {}
    for seed, rows in sorted(curves[arm].items()):
        norms = [r["grad_norm"] for r in rows]
        finite = [n for n in norms if math.isfinite(n)]
        n = len(norms)
        late = [x for x in norms[3 * n // 4:] if math.isfinite(x)]
        entry = {"median": statistics.median(finite) if finite else float("nan"),
                 "max_after_warmup": max((x for x in norms[n // 10:] if math.isfinite(x)), default=float("nan")),
                 "late_median": statistics.median(late) if late else float("nan"),
                 "nonfinite": n - len(finite)}
        bf16_rows = curves.get("bf16", {}).get(seed)
        if bf16_rows:
            ref = [r["grad_norm"] for r in bf16_rows[3 * len(bf16_rows) // 4:] if math.isfinite(r["grad_norm"])]
            if ref:
                entry["late_median_over_bf16"] = entry["late_median"] / statistics.median(ref)
        per_seed[str(seed)] = entry
    keys = ("median", "max_after_warmup", "late_median", "late_median_over_bf16")
    mean = {k: statistics.fmean(v[k] for v in per_seed.values()) for k in keys
            if all(k in v for v in per_seed.values())}
    mean["nonfinite"] = sum(v["nonfinite"] for v in per_seed.values())
    return {"mean_over_seeds": mean, "per_seed": per_seed}


# ------------------------------------------------------------------------------------------ report

def environment(device):
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {"git_commit": git_commit(), "date": datetime.date.today().isoformat(), "device": name,
            "torch": torch.__version__, "python": platform.python_version(), "attn_qat": attn_qat.__version__}


def fmt_ci(value, ci, digits=4, scale=1.0, sign=False):
    if value is None or not math.isfinite(value):
        return "–"
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{f.format(value * scale)} [{f.format(ci[0] * scale)}, {f.format(ci[1] * scale)}]"


def report(task, store, args, log=print):
    """summary.json, results.csv, table.md and the plots from every run under --out."""
    runs, curves = store.load_all(), store.load_curves()
    if not runs:
        log(f"no runs in {store.runs}: nothing to report")
        return None
    setups = store.setups()
    # The configuration of the runs (not of this invocation, which may be --report-only on another machine).
    config = setups[-1]["config"] if setups else task.config_summary()
    losses, boot = loss_report(runs, curves)
    extras = task.report_extras(runs, boot, config)  # {"columns": {entry: {column: value}}, ...}
    # The data, its sampling and the model behind the runs must be the same in every invocation that added runs to
    # this folder (runs recorded without "train_windows" drew their LM windows with replacement).
    keys = [json.dumps({k: v for k, v in r["config"].items()
                        if k in ("data", "train_windows", "pretrain", "gguf_sha256", "dims")}, sort_keys=True)
            for r in setups]
    consistent = len(set(keys)) <= 1
    if not consistent:
        log("WARNING: the invocations that wrote these runs saw different data, sampling or pretrained weights "
            "(runs/setup.json)")
    all_seeds = sorted(set(args.seeds) | {s for r in setups for s in r["seeds"]})
    all_arms = [a for a in ARMS if a in set(args.arms) | {a for r in setups for a in r["arms"]}]
    summary = {
        "experiment": task.name,
        "environment": ({k: v for k, v in setups[-1].items() if k not in ("config", "arms", "seeds")} if setups
                        else environment(args.device)),
        "config": config,
        "invocations": [{k: r[k] for k in ("git_commit", "date", "device", "torch", "arms", "seeds")} for r in setups],
        "invocations_consistent": consistent,
        "loss_label": task.loss_label,
        "interval": f"95% percentile interval, paired bootstrap over {boot.n} held-out items, {RESAMPLES} resamples",
        "entries": losses,
        "extras": extras,
        "runs": {e: sorted(map(str, seeds)) for e, seeds in runs.items()},
        "missing": [f"{arm} seed {s}" for s in all_seeds for arm in all_arms if not store.has(arm, s)],
    }
    out = store.out
    pareto = pareto_report(out)
    if pareto is not None:
        summary["pareto"] = {k: v for k, v in pareto.items() if k != "table"}
        log("fraction of the PTQ gap recovered vs layers kept in bf16 (pareto.md):\n" + pareto["table"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_results_csv(out / "results.csv", losses, extras.get("columns", {}))
    table = markdown_table(task, losses, extras.get("columns", {}))
    (out / "table.md").write_text(table)
    plot(task, out, runs, curves, losses)
    log(table)
    log(f"wrote {out}/ (summary.json, results.csv, table.md, plots)")
    return summary


def write_results_csv(path, losses, extra_columns):
    rows = []
    for entry, info in losses.items():
        gap = info.get("gap_to_bf16") or info.get("gap_to_base") or {}
        rec = info.get("recovered", {})
        gn = info.get("grad_norm", {}).get("mean_over_seeds", {})
        row = {"entry": entry, "description": info["description"], "seeds": " ".join(map(str, info["seeds"])),
               "loss": info["loss"], "loss_ci_low": info["loss_ci"][0], "loss_ci_high": info["loss_ci"][1],
               "loss_per_seed": " ".join(f"{v:.5f}" for v in info["loss_per_seed"].values()),
               "gap_reference": "bf16" if "gap_to_bf16" in info else ("base" if "gap_to_base" in info else ""),
               "gap": gap.get("mean", ""), "gap_ci_low": gap.get("ci", ["", ""])[0],
               "gap_ci_high": gap.get("ci", ["", ""])[1], "gap_relative": gap.get("relative", ""),
               "recovered": rec.get("mean", ""), "recovered_ci_low": rec.get("ci", ["", ""])[0],
               "recovered_ci_high": rec.get("ci", ["", ""])[1],
               "recovered_per_seed": " ".join(f"{v['mean']:.3f}" for v in rec.get("per_seed", {}).values()),
               "recovered_ptq_gap_resolved": rec.get("ptq_gap_resolved", ""),
               "grad_norm_median": gn.get("median", ""), "grad_norm_max_after_warmup": gn.get("max_after_warmup", ""),
               "grad_norm_late_over_bf16": gn.get("late_median_over_bf16", ""),
               "nonfinite_grad_norms": gn.get("nonfinite", "")}
        row.update(extra_columns.get(entry, {}))
        rows.append(row)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(task, losses, extra_columns):
    present = {k for cols in extra_columns.values() for k in cols}
    extra_names = [k for k in task.table_columns if k in present]
    head = ["entry", "seeds", "held-out loss [95% CI]", "gap [95% CI]", "gap %", "PTQ gap recovered [95% CI]",
            "recovered per seed", "median \\|g\\|", "late \\|g\\| / bf16"] + [task.table_columns[k] for k in extra_names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry, info in losses.items():
        gap_key = "gap_to_bf16" if "gap_to_bf16" in info else ("gap_to_base" if "gap_to_base" in info else None)
        gap = info.get(gap_key, {}) if gap_key else {}
        rec = info.get("recovered", {})
        gn = info.get("grad_norm", {}).get("mean_over_seeds", {})
        cells = [f"`{entry}`", str(len(info["seeds"])) if entry not in BASE_ENTRIES else "–",
                 fmt_ci(info["loss"], info["loss_ci"]),
                 (fmt_ci(gap["mean"], gap["ci"], sign=True) + f" (vs {gap_key[7:]})") if gap else "–",
                 f"{100 * gap['relative']:+.2f}%" if gap else "–",
                 (fmt_ci(rec.get("mean"), rec.get("ci"), digits=0, scale=100) + " %"
                  + ("" if rec["ptq_gap_resolved"] else " (PTQ gap not resolved)")) if rec else "–",
                 " / ".join(f"{100 * v['mean']:.0f}%" for v in rec.get("per_seed", {}).values()) if rec else "–",
                 f"{gn['median']:.3f}" if "median" in gn else "–",
                 f"{gn['late_median_over_bf16']:.2f}" if "late_median_over_bf16" in gn else "–"]
        cells += [str(extra_columns.get(entry, {}).get(k, "–")) for k in extra_names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(task, out, runs, curves, losses):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    colors.update(ptq="C8", ptq_qk="C9")

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(13, 5))
    for arm, seeds in curves.items():
        for i, (seed, rows) in enumerate(sorted(seeds.items())):
            label = arm if i == 0 else None
            ax_train.plot([r["step"] for r in rows], smooth([r["train_loss"] for r in rows]), color=colors[arm],
                          lw=1, alpha=0.7, label=label)
            evals = [r for r in rows if r["val_loss"] != ""]
            ax_val.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color=colors[arm], ms=3,
                        lw=1, alpha=0.8, label=label)
            if arm == "bf16":
                ax_val.plot([r["step"] for r in evals], [r["val_loss_fp4"] for r in evals], "s--", color=colors["ptq"],
                            ms=3, lw=1, alpha=0.8, label="ptq (bf16 fine-tune, FP4 attention)" if i == 0 else None)
    for entry, style in (("base", ":"), ("base_ptq", "-.")):
        if entry in losses:
            ax_val.axhline(losses[entry]["loss"], color="gray", ls=style, lw=1, label=f"{entry} (all held-out items)")
    ax_train.set(xlabel="step", ylabel=task.loss_label, title="training loss (EMA), every seed")
    ax_val.set(xlabel="step", ylabel=task.loss_label, title="held-out loss (curve subset), every seed")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(task.title)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for arm, seeds in curves.items():
        for i, (seed, rows) in enumerate(sorted(seeds.items())):
            steps, norms = [r["step"] for r in rows], [r["grad_norm"] for r in rows]
            ax.plot(steps, norms, color=colors[arm], lw=0.4, alpha=0.25)
            ax.plot(steps, smooth(norms), color=colors[arm], lw=1.2, label=arm if i == 0 else None)
    ax.set(xlabel="step", ylabel="gradient norm before clipping", yscale="log",
           title=f"{task.title}: gradient norm (clip at 1.0), every seed (EMA bold, raw faint)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "grad_norm.png", dpi=110)
    plt.close(fig)

    bars = [(e, info.get("gap_to_bf16") or info.get("gap_to_base")) for e, info in losses.items()]
    bars = [(e, g) for e, g in bars if g]
    if bars:
        fig, ax = plt.subplots(figsize=(9, 0.6 * len(bars) + 1.5))
        for y, (entry, gap) in enumerate(bars):
            lo, hi = gap["ci"]
            ax.errorbar([gap["mean"]], [y], xerr=[[gap["mean"] - lo], [hi - gap["mean"]]], fmt="o",
                        color=colors.get(entry, "gray"), capsize=4)
            for seed, v in gap["per_seed"].items():
                ax.plot([v["mean"]], [y], "x", color=colors.get(entry, "gray"), alpha=0.5)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(range(len(bars)), [f"{e} − {'base' if e in BASE_ENTRIES else 'bf16'}" for e, _ in bars])
        ax.set(xlabel=f"held-out loss difference ({task.loss_label})",
               title="gap with 95% paired bootstrap interval (o) and per seed (x)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "gaps.png", dpi=110)
        plt.close(fig)


# --------------------------------------------------------------------------------------- agreement

def prefix_fraction(a, b):
    """(B,) fraction of the T positions before the first disagreement of rows of a and b (B, T)."""
    agree = (a == b).to(torch.int64)
    return agree.cumprod(dim=1).sum(dim=1).double() / a.shape[1]



# ------------------------------------------------------------------ the precision knob's Pareto (issue 46, item 3)
#
# --keep-bf16 0,1,2,3,4,8 --keep-by sensitivity,random: for each seed, the bf16 fine-tune is trained again (the same
# batches and schedule as the bf16 arm), its sensitivity map measured (attn_qat.sensitivity on task.sensitivity_batches,
# training windows, not the held-out set the entries are evaluated on), and then, for each K and each choice of the K
# layers kept in bf16 (QATConfig.bf16_modules): "sensitivity" = attn_qat.plan_precision of that map (leave-one-out
# ranking), "single" = plan_precision(by="single") (the single-layer ranking, which chose better layers than the
# leave-one-out one in the CPU proxy, docs/results.md), "random" = the first K of a permutation of the layers seeded
# by the seed (the control):
#     ptq_keep<K>_<by>           the bf16 fine-tune evaluated with FP4 attention in every other layer (PTQ)
#     attn_qat_qk_keep<K>_<by>   the attn_qat_qk arm fine-tuned with those layers in bf16
# K = 0 is plain PTQ and plain attn_qat_qk. Each entry's "fraction of the PTQ gap recovered" is
# (ptq_keep0 - entry) / (ptq_keep0 - bf16), all from this folder's bf16 fine-tune of the same seed, with the paired
# bootstrap over the held-out items (loss_report's). Everything lives in <out>/runs/pareto/, apart from the main runs.

PARETO_KINDS = ("ptq", "attn_qat_qk")
KEEP_BY = ("sensitivity", "random")  # the default of --keep-by
KEEP_BY_CHOICES = KEEP_BY + ("single",)


def add_pareto_args(parser):
    parser.add_argument("--keep-bf16", default=None, metavar="K,K,...",
                        help="the precision knob's Pareto: numbers of attention layers kept in bf16 (e.g. "
                             "0,1,2,3,4,8), for PTQ and the attn_qat_qk arm (see finetune_common's 'Pareto' section)")
    parser.add_argument("--keep-by", default=",".join(KEEP_BY),
                        help=f"how the kept layers are chosen, comma list of {', '.join(KEEP_BY_CHOICES)} (random: "
                             "the control)")
    parser.add_argument("--keep-kinds", default=",".join(PARETO_KINDS),
                        help=f"which entries the Pareto runs, comma list of {', '.join(PARETO_KINDS)}")


def finish_pareto_args(parser, args):
    if args.keep_bf16 is None:
        args.keep_bf16 = []
        return args
    try:
        args.keep_bf16 = sorted({int(k) for k in str(args.keep_bf16).split(",") if k.strip()})
    except ValueError:
        parser.error(f"--keep-bf16 must be a comma list of integers, got {args.keep_bf16!r}")
    if any(k < 0 for k in args.keep_bf16):
        parser.error("--keep-bf16: layer counts must be 0 or more")
    args.keep_by = [b.strip() for b in args.keep_by.split(",") if b.strip()]
    args.keep_kinds = [b.strip() for b in args.keep_kinds.split(",") if b.strip()]
    if not args.keep_by or set(args.keep_by) - set(KEEP_BY_CHOICES):
        parser.error(f"--keep-by: choose from {', '.join(KEEP_BY_CHOICES)}; got {args.keep_by}")
    if not args.keep_kinds or set(args.keep_kinds) - set(PARETO_KINDS):
        parser.error(f"--keep-kinds: choose from {', '.join(PARETO_KINDS)}; got {args.keep_kinds}")
    return args


def pareto_entry(kind, keep, by):
    return f"{kind}_keep0" if keep == 0 else f"{kind}_keep{keep}_{by}"


def kept_layers(sensitivity, keep, by, seed):
    """The `keep` layers of a sensitivity map (to_dict) to keep in bf16: the map's ranking, or a seeded random pick
    (the first `keep` of one permutation per seed, so that the random sets are nested as the ranked ones are)."""
    if by in ("sensitivity", "single"):
        return tuple(sensitivity["ranking" if by == "sensitivity" else "ranking_single"][:keep])
    order = torch.randperm(len(sensitivity["layers"]), generator=torch.Generator().manual_seed(10_000 + seed))
    return tuple(sensitivity["layers"][i] for i in order[:keep].tolist())


def sensitivity_map(task, model):
    """attn_qat.sensitivity of a prepared (and disabled) model on the task's sensitivity batches, as a dict with the
    ranking plan_precision uses."""
    with task.autocast():
        report = attn_qat.sensitivity(model, task.sensitivity_batches(), getattr(task, "sensitivity_loss", None))
    return dict(report.to_dict(), ranking=list(report.ranking()), ranking_single=list(report.ranking("single")),
                table=report.table())


def run_pareto(task, args, store, deadline, log=print):
    """The Pareto runs of every seed not yet in <out>/runs/pareto (see the section comment)."""
    import dataclasses

    folder = RunStore(store.out / "runs" / "pareto")
    folder.runs = folder.out  # payloads and curves directly in runs/pareto
    for seed in args.seeds:
        wanted = [(kind, k, by) for kind in args.keep_kinds for k in args.keep_bf16 for by in args.keep_by
                  if not (k == 0 and by != args.keep_by[0])]
        todo = [w for w in wanted if args.overwrite or not folder.has(pareto_entry(*w), seed)]
        if not todo:
            continue
        if not getattr(task, "setup_done", False):
            task.setup()
            task.setup_done = True
        if not deadline.allows("bf16"):
            log(f"--max-minutes reached: the Pareto runs of seed {seed} are left for a later invocation")
            return
        t0 = time.perf_counter()
        stored = None if args.overwrite else folder.load_all().get("bf16", {}).get(seed)
        if stored is None or any(kind == "ptq" for kind, _, _ in todo):
            # A bf16 fine-tune run before keeps its map: entries done with it and those to come keep the same layers.
            log(f"Pareto, seed {seed}: the bf16 fine-tune, its sensitivity map and PTQ with layers kept in bf16")
            model = fresh_bf16_model(task)
            rows = train(task, model, "bf16", seed, args)
            if stored is None:
                folder.save_curve("bf16", seed, rows)
                # entry "pareto_bf16": evaluated as a bf16 fine-tune, not replacing the main bf16 arm's references
                stored = task.evaluate(model, fp4=False, entry="pareto_bf16", seed=seed)
                stored["sensitivity"] = sensitivity_map(task, model)
                folder.save("bf16", seed, stored)
                log(stored["sensitivity"]["table"])
            for kind, keep, by in todo:
                if kind != "ptq":
                    continue
                names = kept_layers(stored["sensitivity"], keep, by, seed)
                attn_qat.prepare(model, dataclasses.replace(task.qat_config("bf16"), bf16_modules=names))
                attn_qat.convert(model)
                entry = pareto_entry(kind, keep, by)
                result = task.evaluate(model, fp4=True, entry=entry, seed=seed)
                folder.save(entry, seed, dict(result, kept=list(names)))
                log(f"  {entry} seed {seed}: held-out loss {result['loss']:.4f}")
            del model
        sensitivity = stored["sensitivity"]
        deadline.record("bf16", time.perf_counter() - t0)
        for kind, keep, by in todo:
            if kind != "attn_qat_qk":
                continue
            entry = pareto_entry(kind, keep, by)
            if not deadline.allows(kind):
                log(f"--max-minutes reached: {entry} seed {seed} is left for a later invocation")
                continue
            t0 = time.perf_counter()
            names = kept_layers(sensitivity, keep, by, seed)
            model = task.fresh_model()
            config = dataclasses.replace(task.qat_config("attn_qat_qk"), bf16_modules=names)
            attn_qat.prepare(model, config)
            if config.calibrated_qk and len(set(names)) < len(sensitivity["layers"]):  # a kept layer has no K shift
                task.calibrate(model)
            rows = train(task, model, entry, seed, args)
            folder.save_curve(entry, seed, rows)
            attn_qat.convert(model)
            result = task.evaluate(model, fp4=True, entry=entry, seed=seed)
            folder.save(entry, seed, dict(result, kept=list(names), train_s=time.perf_counter() - t0))
            deadline.record(kind, time.perf_counter() - t0)
            log(f"  {entry} seed {seed}: held-out loss {result['loss']:.4f} ({time.perf_counter() - t0:.0f} s)")
            del model
        if task.device.type == "cuda":
            torch.cuda.empty_cache()


def pareto_report(out):
    """The fraction of the PTQ gap recovered against the layers kept in bf16, per kind and choice, from
    <out>/runs/pareto: {"entries": {...}, "table": markdown}; None when there are no Pareto runs. Also writes
    pareto.json, pareto.md and pareto.png under `out`."""
    out = pathlib.Path(out)
    folder = out / "runs" / "pareto"
    runs = {}
    for path in sorted(folder.glob("*_seed*.json")) if folder.is_dir() else ():
        payload = json.loads(path.read_text())
        runs.setdefault(payload["entry"], {})[payload["seed"]] = payload
    if "bf16" not in runs or "ptq_keep0" not in runs:
        return None
    n = len(runs["bf16"][next(iter(runs["bf16"]))]["item_losses"])
    boot = Bootstrap(n)
    entries = {}
    for entry, seeds in sorted(runs.items()):
        if entry == "bf16":
            continue
        common = sorted(s for s in seeds if s in runs["bf16"] and s in runs["ptq_keep0"])
        if not common:
            continue
        x, ptq, bf16 = (stack_seeds({s: r[s]["item_losses"] for s in common}, common)
                        for r in (seeds, runs["ptq_keep0"], runs["bf16"]))
        kind, rest = entry.split("_keep")
        keep, _, by = rest.partition("_")
        value, ci = boot.ratio((ptq - x).mean(0), (ptq - bf16).mean(0))
        loss, loss_ci = boot.mean(x.mean(0))
        entries[entry] = {"kind": kind, "keep": int(keep), "by": by or "none", "seeds": common, "loss": loss,
                          "loss_ci": loss_ci, "recovered": value, "recovered_ci": ci,
                          "recovered_per_seed": {str(s): boot.ratio(ptq[i] - x[i], ptq[i] - bf16[i])[0]
                                                 for i, s in enumerate(common)},
                          "kept_per_seed": {str(s): seeds[s].get("kept", []) for s in common}}
    lines = ["| entry | layers kept in bf16 | chosen by | seeds | held-out loss [95% CI] | PTQ gap recovered [95% CI] "
             "| per seed |", "|---|---|---|---|---|---|---|"]
    for entry, info in sorted(entries.items(), key=lambda kv: (kv[1]["kind"], kv[1]["by"], kv[1]["keep"])):
        lines.append(f"| `{entry}` | {info['keep']} | {info['by']} | {len(info['seeds'])} | "
                     f"{fmt_ci(info['loss'], info['loss_ci'])} | "
                     f"{fmt_ci(info['recovered'], info['recovered_ci'], digits=0, scale=100)} % | "
                     + " / ".join(f"{100 * v:.0f}%" for v in info["recovered_per_seed"].values()) + " |")
    table = "\n".join(lines) + "\n"
    result = {"entries": entries, "table": table,
              "interval": f"95% percentile interval, paired bootstrap over {n} held-out items, {RESAMPLES} resamples",
              "recovered": "(ptq_keep0 - entry) / (ptq_keep0 - bf16), the bf16 fine-tune of runs/pareto"}
    (out / "pareto.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "pareto.md").write_text(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return result
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind in PARETO_KINDS:
        for by in KEEP_BY:
            points = sorted((info["keep"], info["recovered"], info["recovered_ci"]) for info in entries.values()
                            if info["kind"] == kind and info["by"] in (by, "none"))
            if len(points) < 2:
                continue
            ax.errorbar([p[0] for p in points], [100 * p[1] for p in points], capsize=3, marker="o",
                        yerr=[[100 * (p[1] - p[2][0]) for p in points], [100 * (p[2][1] - p[1]) for p in points]],
                        linestyle="-" if by == "sensitivity" else "--", label=f"{kind}, layers by {by}")
    ax.axhline(90, color="gray", linewidth=0.6, linestyle=":")
    ax.set_xlabel("attention layers kept in bf16")
    ax.set_ylabel("PTQ gap recovered (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)
    plt.close(fig)
    return result
