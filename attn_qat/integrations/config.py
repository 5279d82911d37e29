"""What every integration shares: the user's `QATConfig`, the per-module state that `prepare` installs, the
library version floors. How a call is routed lives in routing.py, which model a call comes from in models.py."""
import dataclasses
import importlib
import re
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch

from ..ops import MODES, V_BLOCK_AXES

# The attribute under which `prepare` hangs an `AttentionState` on each attention module it handles.
STATE_ATTR = "_attn_qat_state"
# The buffer `prepare` gives each module that QATConfig.bf16_modules keeps in bf16: the plan, in the state dict.
KEEP_BF16_BUFFER = "attn_qat_keep_bf16"


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
    learn_qk_transforms: train the balance and the rotation with the model instead of keeping them fixed
        (numerics.md §9): `prepare` gives each attention module parameters (submodule `attn_qat_learned_qk`: a
        per-(KV head, channel) log-offset of the calibrated s, a per-module rotation generator) that start at the
        fixed transforms and keep the scores for every value; needs rotate_qk and/or balance_qk, learns those that
        are on (the K shift stays calibrated). `attn_qat.learned_qk_parameters(model)` lists them (a PEFT model
        freezes them when it wraps a prepared model: set requires_grad on them, and save them beside the adapters).
    The transforms are part of the trained model's numerics: train, evaluate and deploy with the same
    settings. `prepare` (transformers and Wan models) supports them; `patch_sdpa` and the diffusers backend on its
    own, which see no module to keep a K shift in, raise.
    bf16_modules: fully qualified names (as `model.named_modules()` of the model given to `prepare`, a PeftModel's
        included) of attention modules kept in bf16: they run mode "bf16" (exact softmax attention, no Q/K
        transform) in training, after `convert`, in packed batches and in an `NVFP4Cache` (a bf16 cache layer).
        `attn_qat.plan_precision(attn_qat.sensitivity(...), keep=k)` picks them. A name that is no attention module
        `prepare` converts raises. Only `prepare` takes them (`patch_sdpa` and the registered defaults raise).
    """

    mode: str = "attn_qat"
    self_attention: bool = True
    cross_attention: bool = False
    strict: bool = False
    v_block_axis: str = "auto"
    rotate_qk: bool = False
    shift_k: bool = False
    balance_qk: Optional[float] = None
    learn_qk_transforms: bool = False
    bf16_modules: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"attn_qat.QATConfig: mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.v_block_axis not in V_BLOCK_AXES:
            raise ValueError(f"attn_qat.QATConfig: v_block_axis must be one of {', '.join(V_BLOCK_AXES)}; got "
                             f"{self.v_block_axis!r}")
        if not (self.self_attention or self.cross_attention):
            raise ValueError("attn_qat.QATConfig: self_attention and cross_attention are both False, so nothing "
                             "would be converted")
        for name in ("rotate_qk", "shift_k", "learn_qk_transforms"):  # a truthy "false" must not switch a numerics on
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"attn_qat.QATConfig: {name} must be True or False; got {getattr(self, name)!r}")
        alpha = self.balance_qk
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or
                                  not 0 < alpha <= 1):
            raise ValueError(f"attn_qat.QATConfig: balance_qk must be None or a number in (0, 1]; got {alpha!r}")
        if self.learn_qk_transforms and not (self.rotate_qk or alpha is not None):
            raise ValueError("attn_qat.QATConfig: learn_qk_transforms learns the rotation and the Q/K balance; switch "
                             "on rotate_qk=True and/or balance_qk=alpha (e.g. 0.3) to learn them")
        names = self.bf16_modules
        if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):  # a str would give its letters
            raise TypeError("attn_qat.QATConfig: bf16_modules must be a sequence of module names (str), e.g. "
                            f"('model.layers.3.self_attn',); got {names!r}")
        object.__setattr__(self, "bf16_modules", tuple(dict.fromkeys(names)))  # hashable, order kept, no repeats

    @property
    def transforms_qk(self) -> bool:
        """Whether Q and K pass through a §9 transform before quantization."""
        return self.rotate_qk or self.shift_k or self.balance_qk is not None

    @property
    def calibrated_qk(self) -> bool:
        """Whether a §9 transform needs `calibrate_k_shift`'s measurements (the K shift, the Q/K balance)."""
        return self.shift_k or self.balance_qk is not None

    def refuse_qk_transforms(self, where: str) -> None:
        """Raises for an integration that does not implement the §9 transforms (learned ones need them on)."""
        if self.transforms_qk:
            raise NotImplementedError(f"{where}: rotate_qk, shift_k and balance_qk (numerics.md §9) need a model "
                                      "prepared with attn_qat.prepare (transformers or Wan), which keeps each "
                                      "module's calibrated K shift and Q/K balance")

    def refuse_bf16_modules(self, where: str) -> None:
        """Raises for an integration that sees no module names, so cannot keep chosen layers in bf16."""
        if self.bf16_modules:
            raise ValueError(f"{where}: bf16_modules needs a model prepared with attn_qat.prepare (transformers or "
                             "Wan), which knows each attention module's name")

    def kept_in_bf16(self) -> "QATConfig":
        """The config a module that `bf16_modules` keeps runs with: exact bf16 attention, no Q/K transform."""
        return dataclasses.replace(self, mode="bf16", rotate_qk=False, shift_k=False, balance_qk=None,
                                   learn_qk_transforms=False)

    @property
    def inference_mode(self) -> str:
        """The numerics `convert` switches to: every FP4 training mode shares the §3 forward, so a model trained
        in any of them runs the "attn_qat" forward; a "bf16" baseline stays unquantized."""
        return "bf16" if self.mode == "bf16" else "attn_qat"


@dataclasses.dataclass
class AttentionRecord:
    """How one attention module's calls run, for `attn_qat.attention_report` (report.py): its name in the prepared
    model, the reason `prepare` found from its shapes that its calls will fall back (None: supported, or shapes
    unknown), and a count of its eager calls per outcome ("fp4", "bf16", "fallback: <reason>", "disabled")."""

    name: Optional[str] = None
    static_fallback: Optional[str] = None
    calls: Dict[str, int] = dataclasses.field(default_factory=dict)

    def count(self, outcome: str) -> None:
        # Not inside a torch.compile graph: dynamo would guard on the count it reads and recompile at every call.
        if not torch.compiler.is_compiling():
            self.calls[outcome] = self.calls.get(outcome, 0) + 1


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
    # QATConfig.bf16_modules keeps this module in bf16: `config` is then the user's config.kept_in_bf16()
    kept_bf16: bool = False
    # While `calibrate_k_shift` runs: the module's qk_transforms.QKStats
    calibration: Optional[object] = None
    record: AttentionRecord = dataclasses.field(default_factory=AttentionRecord)

    @property
    def active(self) -> bool:
        return self.selected and self.enabled


def module_state(module: torch.nn.Module) -> Optional[AttentionState]:
    return getattr(module, STATE_ATTR, None)


def plan_states(candidates: Iterable[Tuple[str, torch.nn.Module, bool]], config: QATConfig, prefix: str,
                warned: Set[str]) -> List[Tuple[str, torch.nn.Module, AttentionState]]:
    """[(name, module, AttentionState)] for the attention modules a `prepare` found, `candidates` (name, module,
    selected), those that `config.bf16_modules` names kept in bf16. `prefix` is what the names the user sees carry
    before the candidates' (a PeftModel's "base_model.model."). Raises, before anything is installed, for a planned
    name that is not a module `prepare` converts."""
    candidates = list(candidates)
    selected = {prefix + name for name, _, chosen in candidates if chosen}
    found = {prefix + name for name, _, _ in candidates}
    unknown = [n for n in config.bf16_modules if n not in found]
    left_out = [n for n in config.bf16_modules if n in found and n not in selected]
    if unknown or left_out:
        problem = (f"{unknown} match no attention module" if unknown else
                   f"{left_out} are attention modules that prepare leaves out (filter_fn, self_attention / "
                   "cross_attention), which run the library's own attention anyway")
        examples = [prefix + name for name, _, chosen in candidates if chosen][:3]
        raise ValueError(f"attn_qat.prepare: QATConfig.bf16_modules {problem}; the modules it converts are named "
                         f"like {examples} (fully qualified, as model.named_modules() gives them)")
    plan = set(config.bf16_modules)
    kept = config.kept_in_bf16() if plan else config
    return [(name, module, AttentionState(kept if prefix + name in plan else config, selected=chosen, warned=warned,
                                          kept_bf16=prefix + name in plan)) for name, module, chosen in candidates]


def install_state(module: torch.nn.Module, state: AttentionState) -> None:
    """Hangs `state` on `module`; a module kept in bf16 also gets the KEEP_BF16_BUFFER marker, so that the plan is
    in the state dict: a checkpoint loads only into a model with the same plan, or adopts its plan where the model
    was prepared without one (`_adopt_saved_plan`)."""
    setattr(module, STATE_ATTR, state)
    if state.kept_bf16:
        if KEEP_BF16_BUFFER not in module._buffers:
            param = next(module.parameters(), None)
            module.register_buffer(KEEP_BF16_BUFFER, torch.ones((), dtype=torch.bool,
                                                                device=param.device if param is not None else None))
    else:
        module._buffers.pop(KEEP_BF16_BUFFER, None)  # prepared again with another plan
    if not getattr(module, "_attn_qat_plan_hook", False):
        module.register_load_state_dict_pre_hook(_adopt_saved_plan)
        module._attn_qat_plan_hook = True


def _adopt_saved_plan(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    """load_state_dict pre-hook of a prepared attention module: a checkpoint that keeps this module in bf16, loaded
    into a model prepared without bf16_modules, keeps it in bf16 here too; into a model prepared with another plan,
    it raises. (A model whose plan keeps the module but a checkpoint without the marker: the strict load reports the
    marker as a missing key.)"""
    state = module_state(module)
    if prefix + KEEP_BF16_BUFFER not in state_dict or state is None or not state.selected or state.kept_bf16:
        return
    if state.config.bf16_modules:
        raise ValueError(f"attn_qat: this checkpoint keeps {prefix.rstrip('.')} in bf16, but the model was prepared "
                         f"with QATConfig(bf16_modules={state.config.bf16_modules}); prepare it with the checkpoint's "
                         "plan, or without bf16_modules to adopt it")
    # a kept module has no Q/K transform to calibrate or learn
    from .qk_transforms import K_SHIFT_BUFFER, LEARNED_QK_MODULE, QK_BALANCE_BUFFER
    for name in (K_SHIFT_BUFFER, QK_BALANCE_BUFFER):
        if prefix + name not in state_dict:
            module._buffers.pop(name, None)
    if not any(k.startswith(f"{prefix}{LEARNED_QK_MODULE}.") for k in state_dict):
        module._modules.pop(LEARNED_QK_MODULE, None)
    install_state(module, dataclasses.replace(state, config=state.config.kept_in_bf16(), kept_bf16=True))
