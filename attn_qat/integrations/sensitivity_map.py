"""Where FP4 attention hurts a model: `sensitivity` measures, layer by layer, the held-out loss that FP4 attention
adds, with paired bootstrap intervals; `plan_precision` turns that into the layers to keep in bf16
(`QATConfig(bf16_modules=...)`). See docs/integrations.md, "Sensitivity and the precision knob"."""
import dataclasses
import warnings
from collections.abc import Mapping
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .config import QATConfig, module_state
from .lifecycle import prepare
from .models import is_transformers_model, unwrap_peft

LossFn = Callable[[torch.nn.Module, object], torch.Tensor]
RANKINGS = ("leave_one_out", "single")


@dataclasses.dataclass(frozen=True)
class Effect:
    """A mean loss difference over the held-out items and its paired bootstrap percentile interval."""

    mean: float
    low: float
    high: float

    def to_dict(self) -> dict:
        return {"mean": self.mean, "ci": [self.low, self.high]}


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
    """What `sensitivity` measured, every loss a mean over the same held-out items.

    layers: the attention modules measured, fully qualified names in model order.
    single[i]: loss(FP4 attention in layers[i] only, every other layer bf16) - loss(all bf16).
    leave_one_out[i] (None unless asked for): loss(all FP4) - loss(all FP4 but layers[i], which runs bf16), the loss
        that keeping layers[i] in bf16 saves in an otherwise FP4 model.
    all_fp4: loss(all FP4) - loss(all bf16). bf16_loss, fp4_loss: the two losses.
    Each effect's interval resamples the items (paired: both losses of an item together), one set of `resamples`
    index vectors for every effect.
    """

    layers: Tuple[str, ...]
    single: Tuple[Effect, ...]
    leave_one_out: Optional[Tuple[Effect, ...]]
    all_fp4: Effect
    bf16_loss: float
    fp4_loss: float
    items: int
    confidence: float
    resamples: int

    def effects(self, by: Optional[str] = None) -> Tuple[Effect, ...]:
        """The effects a ranking `by` ("leave_one_out", the default when measured, or "single") reads."""
        by = self._by(by)
        return self.leave_one_out if by == "leave_one_out" else self.single

    def ranking(self, by: Optional[str] = None) -> Tuple[str, ...]:
        """The layers, most sensitive (largest effect) first; ties keep model order."""
        effects = self.effects(by)
        order = sorted(range(len(self.layers)), key=lambda i: -effects[i].mean)
        return tuple(self.layers[i] for i in order)

    def _by(self, by: Optional[str]) -> str:
        if by is None:
            return "leave_one_out" if self.leave_one_out is not None else "single"
        if by not in RANKINGS:
            raise ValueError(f"attn_qat: rank by one of {', '.join(RANKINGS)}; got {by!r}")
        if by == "leave_one_out" and self.leave_one_out is None:
            raise ValueError("attn_qat: this report has no leave-one-out effects (sensitivity(..., leave_one_out=True) "
                             "measures them)")
        return by

    def table(self, by: Optional[str] = None, digits: int = 4) -> str:
        """A markdown table of the layers, most sensitive first (ranked `by`, as `ranking`)."""
        by = self._by(by)
        level = f"{100 * self.confidence:g}%"
        index = {name: i for i, name in enumerate(self.layers)}
        head = ["rank", "layer", f"FP4 in this layer only ({level} interval)"]
        if self.leave_one_out is not None:
            head.append(f"saved by keeping it bf16 ({level} interval)")
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        fmt = f"{{:+.{digits}f}}"

        def cell(e: Effect) -> str:
            return f"{fmt.format(e.mean)} [{fmt.format(e.low)}, {fmt.format(e.high)}]"

        for rank, name in enumerate(self.ranking(by), 1):
            i = index[name]
            row = [str(rank), f"`{name}`", cell(self.single[i])]
            if self.leave_one_out is not None:
                row.append(cell(self.leave_one_out[i]))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines.append(f"Loss differences over the {self.items} items measured on, ranked by "
                     f"{'the leave-one-out effect' if by == 'leave_one_out' else 'the single-layer effect'}; all "
                     f"bf16 {self.bf16_loss:.{digits}f}, all FP4 {self.fp4_loss:.{digits}f} "
                     f"(FP4 - bf16 {cell(self.all_fp4)}); paired bootstrap, {self.resamples} resamples.")
        return "\n".join(lines) + "\n"

    def plot(self, path) -> None:
        """Saves a bar chart of the effects per layer, in model order, with their intervals (matplotlib)."""
        from matplotlib.figure import Figure  # no pyplot: no display backend needed

        series = [("FP4 in this layer only", self.single)]
        if self.leave_one_out is not None:
            series.append(("saved by keeping it bf16 (leave one out)", self.leave_one_out))
        n = len(self.layers)
        fig = Figure(figsize=(max(6.0, 0.35 * n + 2), 4.5), layout="constrained")
        ax = fig.add_subplot()
        width = 0.8 / len(series)
        for k, (label, effects) in enumerate(series):
            x = [i + (k - (len(series) - 1) / 2) * width for i in range(n)]
            means = [e.mean for e in effects]
            err = [[e.mean - e.low for e in effects], [e.high - e.mean for e in effects]]
            ax.bar(x, means, width, yerr=err, capsize=2, label=label)
        ax.axhline(0, color="black", linewidth=0.6)
        ax.set_xticks(range(n), [_short(name) for name in self.layers], rotation=90, fontsize=7)
        ax.set_ylabel("loss difference")
        ax.set_title(f"FP4 attention sensitivity ({100 * self.confidence:g}% paired bootstrap intervals); "
                     f"all FP4 - all bf16 = {self.all_fp4.mean:+.4f}", fontsize=9)
        ax.legend(fontsize=8)
        fig.savefig(path, dpi=120)

    def to_dict(self) -> dict:
        out = {"layers": list(self.layers), "single": [e.to_dict() for e in self.single],
               "leave_one_out": None if self.leave_one_out is None else [e.to_dict() for e in self.leave_one_out],
               "all_fp4": self.all_fp4.to_dict(), "bf16_loss": self.bf16_loss, "fp4_loss": self.fp4_loss,
               "items": self.items, "confidence": self.confidence, "resamples": self.resamples,
               "interval": f"{100 * self.confidence:g}% percentile interval, paired bootstrap over {self.items} items"}
        return out


def _short(name: str) -> str:
    """A layer name for an axis label: its last path parts that tell layers apart."""
    parts = name.split(".")
    return ".".join(parts[-3:]) if len(parts) > 3 else name


def causal_lm_losses(model: torch.nn.Module, batch) -> torch.Tensor:
    """Per-example next-token cross-entropy (nats per predicted token) of a transformers causal LM: `batch` is the
    token ids (B, S), or a dict of the model's inputs (input_ids, attention_mask, ...) and optionally `labels`
    (-100 = not scored; default: the ids, padding not scored)."""
    if isinstance(batch, torch.Tensor):
        inputs, labels = {"input_ids": batch}, None
    elif isinstance(batch, Mapping) and "input_ids" in batch:
        inputs = dict(batch)
        labels = inputs.pop("labels", None)
    else:
        raise TypeError("attn_qat.sensitivity: the default loss takes batches of token ids (B, S) or dicts with "
                        f"'input_ids'; got {type(batch).__name__} (pass loss_fn(model, batch) -> per-example losses)")
    ids = inputs["input_ids"]
    if labels is None:
        mask = inputs.get("attention_mask")
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    targets = labels[:, 1:]
    token = F.cross_entropy(logits.float().transpose(1, 2), targets, ignore_index=-100, reduction="none")
    scored = (targets != -100).to(token.dtype)
    return (token * scored).sum(1) / scored.sum(1).clamp_min(1)


def _to_device(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class _PairedBootstrap:
    """Percentile intervals of mean differences over `n` items; every statistic resamples the same index vectors
    (regenerated from `seed` in chunks, so memory stays at chunk x n)."""

    CHUNK = 1000

    def __init__(self, n: int, resamples: int, confidence: float, seed: int):
        self.n, self.resamples, self.confidence, self.seed = n, resamples, confidence, seed

    def effect(self, diff: torch.Tensor) -> Effect:
        diff = diff.double()
        generator = torch.Generator().manual_seed(self.seed)
        means = []
        for start in range(0, self.resamples, self.CHUNK):
            count = min(self.CHUNK, self.resamples - start)
            means.append(diff[torch.randint(0, self.n, (count, self.n), generator=generator)].mean(1))
        tail = (1 - self.confidence) / 2
        q = torch.quantile(torch.cat(means), torch.tensor([tail, 1 - tail], dtype=torch.float64))
        return Effect(float(diff.mean()), float(q[0]), float(q[1]))


@torch.no_grad()
def sensitivity(model: torch.nn.Module, batches: Sequence, loss_fn: Optional[LossFn] = None, *,
                config: Optional[QATConfig] = None, leave_one_out: bool = True, confidence: float = 0.95,
                resamples: int = 10_000, seed: int = 0) -> SensitivityReport:
    """Measures, for each attention layer of a model `attn_qat.prepare` takes (transformers, Wan; PEFT-wrapped too),
    how much held-out loss FP4 attention in that layer adds: alone (every other layer bf16) and, with
    `leave_one_out`, as the loss that keeping it in bf16 saves in an otherwise FP4 model. Returns a
    `SensitivityReport` (ranked `.table()`, `.plot(path)`, `.to_dict()`); `attn_qat.plan_precision` reads it.

    batches: the held-out batches (each is run 2 + layers (+ layers with leave_one_out) times; keep them few).
        Tensors in them are moved to the model's device.
    loss_fn(model, batch) -> per-example losses (B,) (a scalar counts as one item): default, for a transformers
        causal LM, `causal_lm_losses` (next-token cross-entropy of token ids or a dict with input_ids / labels). A
        diffusers model has no default: pass one.
    config: `prepare(model, config)` first (also done with QATConfig() when the model is not prepared yet; the model
        stays prepared). Otherwise the model's own preparation is measured: its selected modules, except those
        `bf16_modules` keeps in bf16. FP4 layers run the prepared numerics (mode, Q/K transforms); bf16 layers the
        library's own attention (`attn_qat.disable`).
    confidence, resamples, seed: the paired bootstrap over the items (percentile intervals).

    The model runs in eval mode without gradients and is left as it was (train/eval, enabled modules). Attention
    attn_qat cannot take (float64, a head_dim its kernels lack) falls back to PyTorch's SDPA with a warning and
    measures nothing; `attn_qat.attention_report(model)` says which modules do.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"attn_qat.sensitivity: confidence must be in (0, 1); got {confidence!r}")
    if not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"attn_qat.sensitivity: resamples must be a positive int; got {resamples!r}")
    base, _, _ = unwrap_peft(model, None)
    if loss_fn is None:
        if not is_transformers_model(base):
            raise TypeError(f"attn_qat.sensitivity: {type(base).__name__} has no default loss; pass loss_fn(model, "
                            "batch) -> per-example losses (B,), e.g. the diffusion loss on held-out latents at fixed "
                            "noise and timesteps")
        loss_fn = causal_lm_losses
    if config is not None or not any(module_state(m) is not None for m in base.modules()):
        prepare(model, config)
    states = {name: s for name, m in model.named_modules()
              if (s := module_state(m)) is not None and s.selected and not s.kept_bf16}
    if not states:
        raise ValueError("attn_qat.sensitivity: every prepared attention module is kept in bf16 (bf16_modules); "
                         "nothing runs FP4")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    batches = [_to_device(b, device) for b in batches]
    if not batches:
        raise ValueError("attn_qat.sensitivity: no batches")
    enabled = {name: s.enabled for name, s in states.items()}
    training = model.training
    model.eval()
    try:
        def losses(fp4) -> torch.Tensor:
            for name, s in states.items():
                s.enabled = name in fp4
            out = []
            for b in batches:
                value = loss_fn(model, b)
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"attn_qat.sensitivity: loss_fn must return a tensor of per-example losses; got "
                                    f"{type(value).__name__}")
                out.append(value.detach().double().reshape(-1).cpu())
            return torch.cat(out)

        names = list(states)
        bf16 = losses(())
        fp4 = losses(names)
        single = [losses((name,)) for name in names]
        kept = [losses([n for n in names if n != name]) for name in names] if leave_one_out else None
    finally:
        for name, s in states.items():
            s.enabled = enabled[name]
        model.train(training)
    if not bool(torch.isfinite(bf16).all() and torch.isfinite(fp4).all()):
        raise ValueError("attn_qat.sensitivity: the losses are not finite")
    if torch.equal(fp4, bf16):
        warnings.warn("attn_qat.sensitivity: FP4 attention changed no loss at all; did the attention fall back to "
                      "PyTorch's SDPA (an AttnQATFallbackWarning; attn_qat.attention_report(model) says why)?",
                      RuntimeWarning, stacklevel=2)
    boot = _PairedBootstrap(len(bf16), resamples, confidence, seed)
    return SensitivityReport(
        layers=tuple(names), single=tuple(boot.effect(x - bf16) for x in single),
        leave_one_out=None if kept is None else tuple(boot.effect(fp4 - x) for x in kept),
        all_fp4=boot.effect(fp4 - bf16), bf16_loss=float(bf16.mean()), fp4_loss=float(fp4.mean()), items=len(bf16),
        confidence=confidence, resamples=resamples)


def plan_precision(report: SensitivityReport, keep: int = 3, by: Optional[str] = None) -> Tuple[str, ...]:
    """The `keep` attention modules to keep in bf16, most sensitive first: `QATConfig(bf16_modules=...)`.

    Ranked by the leave-one-out effect when the report has it (`by="single"` for the single-layer effect): keeping
    a layer in bf16 saves, to first order, exactly its leave-one-out effect in the model that runs FP4 everywhere
    else, which is the model the plan deploys; the single-layer effect measures FP4 in an otherwise bf16 model and
    misses how the layers' errors compound.
    """
    if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep <= len(report.layers):
        raise ValueError(f"attn_qat.plan_precision: keep must be an int from 0 to {len(report.layers)} (the layers "
                         f"measured); got {keep!r}")
    return report.ranking(by)[:keep]
