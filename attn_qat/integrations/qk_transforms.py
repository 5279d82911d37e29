"""The Q/K transforms of numerics.md §9 in a prepared model: each attention module's K shift and Q/K balance (buffers,
calibrated by `calibrate_k_shift`), its learned balance and rotation (`LearnedQK`, with learn_qk_transforms) and the
transform an integration applies to a call's query and key before attn_qat quantizes them. The transforms themselves
are `attn_qat.transforms`."""
import dataclasses
from typing import Dict, Optional

import torch

from ..host_cache import HostCache
from ..transforms import learned_rotation, transform_qk
from .config import QATConfig, module_state
from .models import unwrap_peft

# The buffers of an attention module that hold its calibrated K shift and Q/K balance scales, (H_kv, D) float32.
K_SHIFT_BUFFER = "attn_qat_k_shift"
QK_BALANCE_BUFFER = "attn_qat_qk_balance"
# The submodule of a prepared attention module that holds its learned balance and rotation (learn_qk_transforms).
LEARNED_QK_MODULE = "attn_qat_learned_qk"
# The balance scales' range: s_c beyond it would move a channel out of bf16's normal range
BALANCE_LIMIT = 2.0 ** 24

# Whether a calibrated buffer (K shift, Q/K balance) holds values (no NaN): read on the host once per calibration or
# state_dict load, not once a layer and step.
_calibrated_buffers = HostCache()
# A learned rotation per generator version, for calls that need no gradient of it (inference, decoding step by step).


class LearnedQK(torch.nn.Module):
    """The trained part of a prepared attention module's Q/K transforms (QATConfig(learn_qk_transforms=True),
    numerics.md §9): float32 parameters, 0 at the start, where the transforms are the fixed ones.

    log_balance (H_kv, D), with balance_qk: s = (the calibrated s) · exp(log_balance), positive for every value;
    rotation_generator (D, D), with rotate_qk: R = `attn_qat.transforms.learned_rotation(rotation_generator)`, the
    Hadamard rotation times exp(A − Aᵀ) (A the strictly lower triangle), orthogonal for every value.

    R is computed at every call, but after `freeze` (`attn_qat.convert`) once per device and dtype: an optimiser's
    fused step or a write through `.data` (EMA weights) changes a parameter without a trace a cache could check, so
    only a converted model, whose parameters no longer train, keeps R; loading a state dict or moving the module
    drops it."""

    def __init__(self, heads_kv: int, head_dim: int, balance: bool, rotate: bool, device=None):
        super().__init__()
        self.frozen = False
        self._rotations = {}  # (device, dtype): R, while frozen
        self.register_parameter("log_balance", torch.nn.Parameter(torch.zeros(heads_kv, head_dim, device=device))
                                if balance else None)
        self.register_parameter("rotation_generator", torch.nn.Parameter(
            torch.zeros(head_dim, head_dim, device=device)) if rotate else None)

    def fits(self, heads_kv: int, head_dim: int, config: QATConfig) -> bool:
        """Whether these parameters are the ones `config` learns for `heads_kv` KV heads of `head_dim` channels."""
        balance, generator = self.log_balance, self.rotation_generator
        return ((balance is not None) == (config.balance_qk is not None) and (generator is not None) ==
                config.rotate_qk and (balance is None or balance.shape == (heads_kv, head_dim)) and
                (generator is None or generator.shape == (head_dim, head_dim)))

    def balance(self, calibrated: torch.Tensor) -> torch.Tensor:
        """The learned s, float32 (float64 for a float64 calibration) of the calibrated (H_kv, D) s, within the
        calibrated one's bounds [1 / BALANCE_LIMIT, BALANCE_LIMIT] (q·s and k/s stay in the 16-bit range)."""
        dtype = torch.promote_types(calibrated.dtype, torch.float32)
        return (calibrated.to(dtype) * self.log_balance.to(dtype).exp()).clamp(1 / BALANCE_LIMIT, BALANCE_LIMIT)

    def rotation(self, dtype: torch.dtype) -> torch.Tensor:
        """The learned (D, D) rotation, computed in `dtype` (at least float32), the same bits whether kept or not."""
        generator = self.rotation_generator
        if (torch.is_grad_enabled() and generator.requires_grad) or torch.compiler.is_compiling():
            return learned_rotation(generator, dtype)
        key = (generator.device, dtype)
        rotation = self._rotations.get(key) if self.frozen else None
        if rotation is None:
            with torch.inference_mode(False), torch.no_grad():  # usable after inference mode, by a later backward
                rotation = learned_rotation(generator.detach(), dtype)
            if self.frozen:
                self._rotations[key] = rotation
        return rotation

    def freeze(self, frozen: bool = True) -> None:
        """Keep R from its next computation on (a converted model's), or (False) compute it at every call again."""
        self.frozen, self._rotations = frozen, {}

    def _apply(self, fn, *args, **kwargs):  # .to(), .cuda(), .half(): R of the moved parameters
        self._rotations = {}
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._rotations = {}
        super()._load_from_state_dict(*args, **kwargs)


def _calibrated(buffer: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True  # not read while tracing; an uncalibrated (NaN) buffer then makes the outputs NaN
    return _calibrated_buffers.get(buffer, lambda: not bool(buffer.isnan().any()))


def _calibrated_buffer(module, name: str, key, heads_axis: int, what: str, setting: str, where: str):
    """`module`'s calibrated (H_kv, D) buffer `name`, checked against the call's key and viewed to broadcast
    against it."""
    buffer = getattr(module, name, None)
    if buffer is None or not _calibrated(buffer):
        raise RuntimeError(f"{where}: {type(module).__name__} runs with QATConfig({setting}) but has no calibrated "
                           f"{what}: call attn_qat.calibrate_k_shift(model, batches) after attn_qat.prepare (a "
                           f"checkpoint saved after calibration holds it as the buffer '{name}' of each attention "
                           "module; load it after prepare)")
    if buffer.shape != (key.shape[heads_axis], key.shape[-1]):
        raise ValueError(f"{where}: the calibrated {what} of {type(module).__name__} has shape "
                         f"{tuple(buffer.shape)}, but its keys have {key.shape[heads_axis]} heads of "
                         f"{key.shape[-1]} channels; calibrate again")
    return buffer


def _along(t: torch.Tensor, like: torch.Tensor, heads_axis: int) -> torch.Tensor:
    """An (H, D) tensor viewed to broadcast against `like` with its heads on `heads_axis` and channels last."""
    return t.view((t.shape[0],) + (1,) * (like.dim() - 2 - heads_axis) + (t.shape[1],))


def transform_module_qk(module, query, key, config: QATConfig, heads_axis: int, where: str):
    """(query, key) after `config`'s transforms with `module`'s K shift and Q/K balance; the query's heads and the
    key's KV heads on `heads_axis` and their channels last ((B, H, S, D): 1; (B, S, H, D): 2). Unchanged without
    transforms."""
    if not config.transforms_qk:
        return query, key
    shift = balance = rotation = None
    learned = _learned(module, key, heads_axis, config, where) if config.learn_qk_transforms else None
    if config.shift_k:
        shift = _along(_calibrated_buffer(module, K_SHIFT_BUFFER, key, heads_axis, "K shift", "shift_k=True", where),
                       key, heads_axis)
    if config.balance_qk is not None:
        s = _calibrated_buffer(module, QK_BALANCE_BUFFER, key, heads_axis, "Q/K balance",
                               f"balance_qk={config.balance_qk}", where)
        if learned is not None:
            s = learned.balance(s)
        group = query.shape[heads_axis] // s.shape[0]  # the query heads of a KV head share its scales
        balance = (_along(s.repeat_interleave(group, 0), query, heads_axis), _along(s, key, heads_axis))
    if learned is not None and config.rotate_qk:
        rotation = learned.rotation(torch.promote_types(query.dtype, torch.float32))
    return transform_qk(query, key, config.rotate_qk, shift, balance, rotation)


def _learned(module, key, heads_axis: int, config: QATConfig, where: str) -> LearnedQK:
    """`module`'s learned transform parameters, checked against `config` and the call's key."""
    learned = getattr(module, LEARNED_QK_MODULE, None)
    if not isinstance(learned, LearnedQK):
        raise RuntimeError(f"{where}: {type(module).__name__} runs with QATConfig(learn_qk_transforms=True) but has no "
                           f"learned Q/K transform ('{LEARNED_QK_MODULE}'): attn_qat.prepare(model, config) creates it")
    if not learned.fits(key.shape[heads_axis], key.shape[-1], config):
        raise ValueError(f"{where}: the learned Q/K transform of {type(module).__name__} does not fit its keys "
                         f"({key.shape[heads_axis]} KV heads of {key.shape[-1]} channels) or the config (rotate_qk="
                         f"{config.rotate_qk}, balance_qk={config.balance_qk}); prepare the model with the config it "
                         "was trained with")
    return learned


def prepare_module(module: torch.nn.Module, config: QATConfig, name: str, heads_kv: Optional[int],
                   head_dim: Optional[int]) -> None:
    """What `prepare` does for the transforms on a selected module with `heads_kv` KV heads of `head_dim` channels
    (None where the integration cannot tell): refuse a rotation the head_dim does not allow, give a module with
    a K shift or a Q/K balance its placeholder buffers and one with learned transforms its parameters."""
    if config.rotate_qk and head_dim and head_dim & (head_dim - 1):  # qk_rotation's rule, said before training
        raise ValueError(f"attn_qat.prepare: rotate_qk needs a power-of-two head_dim; {name} has {head_dim}")
    if config.shift_k:
        _placeholder(module, K_SHIFT_BUFFER, heads_kv, head_dim)
    if config.balance_qk is not None:
        _placeholder(module, QK_BALANCE_BUFFER, heads_kv, head_dim)
    learned = getattr(module, LEARNED_QK_MODULE, None)
    if learned is not None and not isinstance(learned, LearnedQK):
        raise TypeError(f"attn_qat.prepare: {name} already has an attribute '{LEARNED_QK_MODULE}' that is not "
                        "attn_qat's learned Q/K transform")
    if not config.learn_qk_transforms:
        if learned is not None:
            delattr(module, LEARNED_QK_MODULE)  # prepared again without learning: the fixed transforms run
        return
    if not heads_kv or not head_dim:
        raise ValueError(f"attn_qat.prepare: learn_qk_transforms needs the KV heads and head_dim of {name}, which "
                         f"{type(module).__name__}'s attributes do not tell")
    if learned is None or not learned.fits(heads_kv, head_dim, config):  # else prepared again: keep what it learned
        param = next(module.parameters(), None)
        setattr(module, LEARNED_QK_MODULE, LearnedQK(heads_kv, head_dim, config.balance_qk is not None,
                                                     config.rotate_qk, param.device if param is not None else None))
    else:
        learned.freeze(False)  # trains again


def learned_qk_parameters(model: torch.nn.Module, requires_grad: Optional[bool] = None
                          ) -> Dict[str, torch.nn.Parameter]:
    """{name: parameter} of the learned Q/K transforms (QATConfig(learn_qk_transforms=True), numerics.md §9) of a
    prepared model, named as `model.named_parameters()` names them (a PeftModel's too). `requires_grad` (if given)
    is set on each: a PEFT model made from a prepared one has frozen them, `requires_grad=True` trains them again.
    Save them with the model (PEFT's save_pretrained keeps only the adapters): they are part of its numerics."""
    found = {f"{prefix}.{name}" if prefix else name: p for prefix, m in model.named_modules()
             if isinstance(m, LearnedQK) for name, p in m.named_parameters()}
    if not found:
        raise ValueError(f"attn_qat.learned_qk_parameters: {type(model).__name__} has no learned Q/K transform; "
                         "prepare it with QATConfig(learn_qk_transforms=True, rotate_qk=True and/or balance_qk=...)")
    if requires_grad is not None:
        for p in found.values():
            p.requires_grad_(requires_grad)
    return found


def _placeholder(module: torch.nn.Module, name: str, heads: Optional[int], head_dim: Optional[int]) -> None:
    """Gives a module prepared with a calibrated transform its buffer before calibration, filled with NaN (not
    calibrated), so that a state_dict saved after `calibrate_k_shift` loads into a freshly prepared model."""
    if getattr(module, name, None) is not None or not heads or not head_dim:
        return  # calibrated (or loaded) already; or of unknown shape, then calibrate_k_shift creates it
    param = next(module.parameters(), None)
    module.register_buffer(name, torch.full((heads, head_dim), float("nan"),
                                            device=param.device if param is not None else None))


@dataclasses.dataclass
class QKStats:
    """What `calibrate_k_shift` gathers for one module: the sum of the keys it was given, (H_kv, D) float64, how
    many tokens that sum holds, and the largest |k| and |q| of each (KV head, channel), a KV head's query heads
    together."""

    total: Optional[torch.Tensor] = None
    count: int = 0
    k_max: Optional[torch.Tensor] = None
    q_max: Optional[torch.Tensor] = None


def record_qk(calibration: QKStats, query: torch.Tensor, key: torch.Tensor, heads_axis: int) -> None:
    """Adds a call's query and keys to a module's calibration statistics."""
    others = tuple(a for a in range(key.dim() - 1) if a != heads_axis)
    key = key.detach()
    total = key.double().sum(dim=others)
    calibration.total = total if calibration.total is None else calibration.total + total
    calibration.count += key[..., 0].numel() // key.shape[heads_axis]
    k_max = key.abs().amax(dim=others).double()
    q_max = query.detach().abs().amax(dim=others).double()  # (H, D) -> the max over each KV head's group
    q_max = q_max.view(key.shape[heads_axis], -1, q_max.shape[-1]).amax(1)
    calibration.k_max = k_max if calibration.k_max is None else torch.maximum(calibration.k_max, k_max)
    calibration.q_max = q_max if calibration.q_max is None else torch.maximum(calibration.q_max, q_max)


def balance_scales(stats: QKStats, alpha: float) -> torch.Tensor:
    """The Q/K balance s = (max|k| / max|q|)^alpha, (H_kv, D) float32: 1 where a channel of either is all zero (or
    not finite), and within [1 / BALANCE_LIMIT, BALANCE_LIMIT]."""
    k_max, q_max = stats.k_max, stats.q_max
    usable = (k_max > 0) & (q_max > 0) & torch.isfinite(k_max) & torch.isfinite(q_max)
    ratio = torch.where(usable, k_max / torch.where(usable, q_max, 1.0), 1.0)
    return ratio.pow(alpha).clamp(1 / BALANCE_LIMIT, BALANCE_LIMIT).float()


def _keep(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Stores a calibrated (H_kv, D) value as the module's buffer `name`, in place where it already is one."""
    current = getattr(module, name, None)
    if current is not None and name not in module._buffers:
        raise TypeError(f"attn_qat.calibrate_k_shift: {type(module).__name__} already has an attribute '{name}' "
                        "that is not a buffer")
    if current is not None and current.shape == value.shape and not current.is_inference():
        current.copy_(value)  # the same tensor: wrappers that hold the buffer (DDP) see the new values
    else:
        module.register_buffer(name, value.clone(), persistent=True)


@torch.no_grad()
def calibrate_k_shift(model, batches, run=None):
    """Measures what the calibrated transforms of numerics.md §9 need on each prepared attention module and keeps it as
    the module's buffers, (H_kv, D) float32, saved with the model's state_dict: for QATConfig(shift_k=True) the K
    channel means (`attn_qat_k_shift`), for QATConfig(balance_qk=alpha) the Q/K balance scales (max|k| /
    max|q|)^alpha (`attn_qat_qk_balance`). Returns the model.

    Call it after `attn_qat.prepare(model, QATConfig(shift_k=True, ...))` (and after any cast of the model's dtype),
    with a few batches of the training data (about 16 sequences in all): `run(model, batch)` runs one (default
    `model(**batch)` for a dict, else `model(batch)`).
    Meanwhile the modules record the queries and keys they are given (after RoPE and norms) and attend as the model's own
    attention does (transformers' "sdpa", PyTorch's SDPA in Wan). The shift stays fixed afterwards, in training and
    inference alike: any fixed shift keeps the scores exact; only FP4's rounding depends on it. Padding tokens in the
    batches count like any other token. Under data parallelism, calibrate every rank on the same batches (or load
    one rank's buffers everywhere; DDP's default broadcast_buffers sends rank 0's): the shift is part of the
    model's numerics.
    """

    base, _, _ = unwrap_peft(model, None)
    targets = [(m, s) for m in base.modules() if (s := module_state(m)) is not None and s.selected and
               s.config.calibrated_qk]
    if not targets:
        raise ValueError(f"attn_qat.calibrate_k_shift: {type(base).__name__} has no attention module prepared with "
                         "QATConfig(shift_k=True) or balance_qk; call attn_qat.prepare(model, QATConfig(shift_k=True)) "
                         "first")
    run = run if run is not None else (lambda m, b: m(**b) if isinstance(b, dict) else m(b))
    for _, state in targets:
        state.calibration = QKStats()
    try:
        for batch in batches:
            run(model, batch)
        empty = [type(m).__name__ for m, s in targets if s.calibration.count == 0]
        if empty:
            raise ValueError(f"attn_qat.calibrate_k_shift: {len(empty)} prepared attention module(s) saw no keys; "
                             "pass at least one batch that runs the whole model")
        with torch.inference_mode(False):  # a buffer made in inference mode could never be updated in place
            for module, state in targets:
                stats = state.calibration
                if state.config.shift_k:
                    _keep(module, K_SHIFT_BUFFER, (stats.total / stats.count).float())
                if state.config.balance_qk is not None:
                    _keep(module, QK_BALANCE_BUFFER, balance_scales(stats, state.config.balance_qk))
    finally:
        for _, state in targets:
            state.calibration = None
    return model
