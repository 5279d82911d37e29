"""What every integration shares: the user's `QATConfig`, the per-module state that `prepare` installs,
and one routine that runs an SDPA-shaped call through attn_qat or, for inputs attn_qat does not take,
through PyTorch's SDPA with a warning (or an error under `strict`)."""
import dataclasses
import importlib
import re
import threading
import warnings
from typing import Optional, Set

import torch

# unsupported_reason: the input rules attn_qat.scaled_dot_product_attention raises from; here they decide fallbacks
from ..attention import scaled_dot_product_attention, unsupported_reason  # noqa: F401 (unsupported_reason re-exported)
from ..ops import MODES, V_BLOCK_AXES
from . import sequence_parallel

# The attribute under which `prepare` hangs an `AttentionState` on each attention module it handles.
STATE_ATTR = "_attn_qat_state"


# The oldest releases each integration works with (pyproject's extras ask for the higher transformers floor, which
# NVFP4Cache needs): transformers' AttentionInterface with set_attn_implementation and masking_utils (4.54), its Cache
# built from layers (4.56, for NVFP4Cache); diffusers' WanAttention and attention dispatcher (0.35).
TRANSFORMERS_MIN = (4, 54)
TRANSFORMERS_CACHE_MIN = (4, 56)
DIFFUSERS_MIN = (0, 35)


def require_version(package: str, minimum: tuple, what: str) -> None:
    """Imports `package`; raises ImportError when it is older than `minimum` (its release numbers)."""
    version = getattr(importlib.import_module(package), "__version__", "0")
    found = re.match(r"\d+(?:\.\d+)*", version)
    if found is None or tuple(int(p) for p in found.group().split(".")) < minimum:
        floor = ".".join(map(str, minimum))
        raise ImportError(f"{what} needs {package} >= {floor}, found {version}; upgrade it: "
                          f"pip install -U '{package}>={floor}'")


class AttnQATFallbackWarning(UserWarning):
    """An attention call that attn_qat does not support ran through PyTorch's SDPA instead."""


@dataclasses.dataclass(frozen=True)
class QATConfig:
    """How attn_qat replaces a model's attention.

    mode: the numerics (docs/numerics.md §5): "attn_qat" (the default), "high_precision_p",
        "low_precision_o", "drop_in" or "bf16" (no quantization, for baselines).
    self_attention, cross_attention: which attentions `prepare` converts. Wan and other diffusion
        transformers quantize self-attention by default; the text (and I2V image) cross-attention is
        opt-in. `patch_sdpa` cannot tell them apart and ignores both fields.
    strict: raise `NotImplementedError` for an attention call attn_qat does not support instead of
        falling back to PyTorch's SDPA with an `AttnQATFallbackWarning`.
    v_block_axis: the axis of V's 16-value blocks (numerics.md §2): "auto" (the default) blocks along
        head_dim in causal or masked calls, where a key a query cannot see must not set a scale of what it
        sees, and along tokens where every query sees every key; "tokens" or "head_dim" forces one
        ("tokens" under a mask lets hidden keys leak; an `NVFP4Cache` needs "auto" or "head_dim").
    rotate_qk: multiply Q and K by one fixed orthogonal (random-sign Hadamard) matrix along head_dim before
        quantizing them (numerics.md §9): the scores are unchanged in exact arithmetic, FP4 rounds less.
    shift_k: subtract a fixed per-(KV head, channel) mean from K before quantizing it (numerics.md §9; softmax
        cancels it); the means come from `attn_qat.calibrate_k_shift(model, batches)`, run after `prepare`.
    balance_qk: None (off), or an exponent alpha in (0, 1]: multiply Q's channels by a fixed per-(KV head,
        channel) s and divide K's by it, after the shift and before the rotation (numerics.md §9; q·k unchanged),
        s = (max|k| / max|q|)^alpha over the calibration batches of the same `attn_qat.calibrate_k_shift` call.
    The transforms are part of the trained model's numerics: train, evaluate and deploy with the same
    settings. `prepare` (transformers and Wan models) supports them; `patch_sdpa` and the diffusers backend on its
    own, which see no module to keep a K shift in, raise.
    """

    mode: str = "attn_qat"
    self_attention: bool = True
    cross_attention: bool = False
    strict: bool = False
    v_block_axis: str = "auto"
    rotate_qk: bool = False
    shift_k: bool = False
    balance_qk: Optional[float] = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"attn_qat.QATConfig: mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.v_block_axis not in V_BLOCK_AXES:
            raise ValueError(f"attn_qat.QATConfig: v_block_axis must be one of {', '.join(V_BLOCK_AXES)}; got "
                             f"{self.v_block_axis!r}")
        if not (self.self_attention or self.cross_attention):
            raise ValueError("attn_qat.QATConfig: self_attention and cross_attention are both False, so nothing "
                             "would be converted")
        for name in ("rotate_qk", "shift_k"):  # a truthy string such as "false" must not switch a numerics on
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"attn_qat.QATConfig: {name} must be True or False; got {getattr(self, name)!r}")
        alpha = self.balance_qk
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or
                                  not 0 < alpha <= 1):
            raise ValueError(f"attn_qat.QATConfig: balance_qk must be None or a number in (0, 1]; got {alpha!r}")

    @property
    def transforms_qk(self) -> bool:
        """Whether Q and K pass through a §9 transform before quantization."""
        return self.rotate_qk or self.shift_k or self.balance_qk is not None

    @property
    def calibrated_qk(self) -> bool:
        """Whether a §9 transform needs `calibrate_k_shift`'s measurements (the K shift, the Q/K balance)."""
        return self.shift_k or self.balance_qk is not None

    def refuse_qk_transforms(self, where: str) -> None:
        """Raises for an integration that does not implement the §9 transforms."""
        if self.transforms_qk:
            raise NotImplementedError(f"{where}: rotate_qk, shift_k and balance_qk (numerics.md §9) need a model "
                                      "prepared with attn_qat.prepare (transformers or Wan), which keeps each "
                                      "module's calibrated K shift and Q/K balance")

    @property
    def inference_mode(self) -> str:
        """The numerics `convert` switches to: every FP4 training mode shares the §3 forward, so a model trained
        in any of them runs the "attn_qat" forward; a "bf16" baseline stays unquantized."""
        return "bf16" if self.mode == "bf16" else "attn_qat"


@dataclasses.dataclass
class AttentionState:
    """Per-module switchboard that `prepare` installs and `enable`, `disable` and `convert` flip.

    The integrations read it on every forward (under torch.compile: while tracing; dynamo guards on the
    values read, so a flip recompiles). `selected` is False for modules that `prepare` saw but left out
    (filter_fn, self/cross choice): they keep running the library's own attention whatever `enable` says.
    `warned` is shared by all modules of one `prepare` call, so each fallback reason warns once per model.
    """

    config: QATConfig
    selected: bool = True
    enabled: bool = True
    inference: bool = False
    warned: Set[str] = dataclasses.field(default_factory=set)
    # While `calibrate_k_shift` runs: the module's qk_transforms.QKStats
    calibration: Optional[object] = None

    @property
    def active(self) -> bool:
        return self.selected and self.enabled


def module_state(module: torch.nn.Module) -> Optional[AttentionState]:
    return getattr(module, STATE_ATTR, None)


# Per thread: how many fallbacks to PyTorch's SDPA are running, during which `patch_sdpa` lets the call through.
_fallbacks = threading.local()


def passing_through() -> bool:
    """Whether a fallback to PyTorch's SDPA runs on this thread now (`patch_sdpa` must not intercept it)."""
    return getattr(_fallbacks, "depth", 0) > 0


def torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """PyTorch's SDPA (`torch.nn.functional.scaled_dot_product_attention` as installed now), past every
    `patch_sdpa` active on this thread, so that a fallback never re-enters attn_qat; other torch function modes
    still see the call."""
    _fallbacks.depth = getattr(_fallbacks, "depth", 0) + 1
    try:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                                dropout_p=dropout_p, is_causal=is_causal,
                                                                scale=scale, enable_gqa=enable_gqa)
    finally:
        _fallbacks.depth -= 1


@torch.compiler.disable
def warn_once(message: str, warned: Set[str], category=AttnQATFallbackWarning) -> None:
    """Warns once per distinct message per `warned` set (one set per patch_sdpa context, per prepared
    model). Kept out of torch.compile graphs: it runs eagerly at every call, so the once-only bookkeeping
    holds in compiled code too. (Python's default warning filter may further show an identical message
    only once per process.)"""
    if message not in warned:
        warned.add(message)
        warnings.warn(f"attn_qat: {message}", category, stacklevel=3)


def inference_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa, mode, warned, v_block_axis="auto"):
    """The attention of a module that `convert` switched to inference.

    Today this is the training kernels' forward without autograd (no O', numerics.md §5 "inference").
    It is the single place where a real NVFP4 inference kernel will slot in. A converted attention is
    not differentiable: when a gradient was wanted, that is said once rather than silently dropped.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        warn_once("this attention was converted for inference (attn_qat.convert); its output carries no "
                  "gradient", warned, UserWarning)
    with torch.no_grad():
        return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                            scale=scale, enable_gqa=enable_gqa, mode=mode, v_block_axis=v_block_axis)


def run_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, config: QATConfig,
             warned: Set[str], inference: bool = False, where: str = "attn_qat",
             v_block_axis: Optional[str] = None) -> torch.Tensor:
    """One SDPA-shaped call (torch's argument conventions, top-left causal) through attn_qat, or through
    PyTorch's SDPA when attn_qat does not support it: a warning once per reason, or, with
    `config.strict`, a `NotImplementedError` naming the reason. `v_block_axis` (default: the config's) lets an
    integration that knows the model is causal keep V blocked along head_dim in calls that hide no key.
    Inside a module that `ulysses_wan` runs sequence-parallel, the call goes through its all-to-all first."""
    ulysses = sequence_parallel.current()
    if ulysses is not None:
        return ulysses.sdpa(run_sdpa, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            config=config, warned=warned, inference=inference, where=where, v_block_axis=v_block_axis)
    v_block_axis = config.v_block_axis if v_block_axis is None else v_block_axis
    reason = unsupported_reason(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        if config.strict:
            raise NotImplementedError(f"{where}: {reason} (strict=True forbids falling back to PyTorch SDPA)")
        warn_once(f"falling back to PyTorch scaled_dot_product_attention: {reason}", warned)
        return torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    if inference:
        return inference_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                   config.inference_mode, warned, v_block_axis)
    return scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                        enable_gqa=enable_gqa, mode=config.mode, v_block_axis=v_block_axis)
