"""The Q/K transforms of numerics.md §9 in a prepared model: each attention module's K shift (a buffer, calibrated by
`calibrate_k_shift`) and the transform an integration applies to a call's query and key before attn_qat quantizes
them. The transforms themselves are `attn_qat.transforms`."""
import dataclasses
from typing import Optional

import torch

from ..host_cache import HostCache
from ..transforms import transform_qk
from .config import QATConfig, module_state

# The buffer of an attention module that holds its calibrated K shift, (H_kv, D) float32.
K_SHIFT_BUFFER = "attn_qat_k_shift"

# Whether a K-shift buffer holds calibrated values (no NaN): read on the host once per calibration or state_dict
# load, not once a layer and step.
_calibrated_shifts = HostCache()


def _calibrated(shift: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True  # not read while tracing; an uncalibrated (NaN) shift then makes the outputs NaN
    return _calibrated_shifts.get(shift, lambda: not bool(shift.isnan().any()))


def transform_module_qk(module, query, key, config: QATConfig, heads_axis: int, where: str):
    """(query, key) after `config`'s transforms with `module`'s K shift; the key's KV heads on `heads_axis` and its
    channels last ((B, H_kv, S, D): 1; (B, S, H_kv, D): 2). Unchanged without transforms."""
    if not config.transforms_qk:
        return query, key
    shift = None
    if config.shift_k:
        shift = getattr(module, K_SHIFT_BUFFER, None)
        if shift is None or not _calibrated(shift):
            raise RuntimeError(f"{where}: {type(module).__name__} runs with QATConfig(shift_k=True) but has no "
                               "calibrated K shift: call attn_qat.calibrate_k_shift(model, batches) after "
                               "attn_qat.prepare (a checkpoint saved after calibration holds it as the buffer "
                               f"'{K_SHIFT_BUFFER}' of each attention module; load it after prepare)")
        if shift.shape != (key.shape[heads_axis], key.shape[-1]):
            raise ValueError(f"{where}: the calibrated K shift of {type(module).__name__} has shape "
                             f"{tuple(shift.shape)}, but its keys have {key.shape[heads_axis]} heads of "
                             f"{key.shape[-1]} channels; calibrate again")
        shift = shift.view((shift.shape[0],) + (1,) * (key.dim() - 2 - heads_axis) + (shift.shape[1],))
    return transform_qk(query, key, config.rotate_qk, shift)


def prepare_module(module: torch.nn.Module, config: QATConfig, name: str, heads_kv: Optional[int],
                   head_dim: Optional[int]) -> None:
    """What `prepare` does for the transforms on a selected module with `heads_kv` KV heads of `head_dim` channels
    (None where the integration cannot tell): refuse a rotation the head_dim does not allow, and give a module with
    a K shift its placeholder buffer."""
    if config.rotate_qk and head_dim and head_dim & (head_dim - 1):  # qk_rotation's rule, said before training
        raise ValueError(f"attn_qat.prepare: rotate_qk needs a power-of-two head_dim; {name} has {head_dim}")
    if config.shift_k:
        _k_shift_placeholder(module, heads_kv, head_dim)


def _k_shift_placeholder(module: torch.nn.Module, heads: Optional[int], head_dim: Optional[int]) -> None:
    """Gives a module prepared with shift_k its K-shift buffer before calibration, filled with NaN (not calibrated),
    so that a state_dict saved after `calibrate_k_shift` loads into a freshly prepared model."""
    if getattr(module, K_SHIFT_BUFFER, None) is not None or not heads or not head_dim:
        return  # calibrated (or loaded) already; or of unknown shape, then calibrate_k_shift creates it
    param = next(module.parameters(), None)
    module.register_buffer(K_SHIFT_BUFFER, torch.full((heads, head_dim), float("nan"),
                                                      device=param.device if param is not None else None))


@dataclasses.dataclass
class KeySums:
    """What `calibrate_k_shift` gathers for one module: the sum of the keys it was given, (H_kv, D) float64, and
    how many tokens that sum holds."""

    total: Optional[torch.Tensor] = None
    count: int = 0


def record_keys(calibration: KeySums, key: torch.Tensor, heads_axis: int) -> None:
    """Adds a call's keys to a module's calibration sums."""
    others = tuple(a for a in range(key.dim() - 1) if a != heads_axis)
    total = key.detach().double().sum(dim=others)
    calibration.total = total if calibration.total is None else calibration.total + total
    calibration.count += key[..., 0].numel() // key.shape[heads_axis]


@torch.no_grad()
def calibrate_k_shift(model, batches, run=None):
    """Measures each prepared attention module's K channel means for QATConfig(shift_k=True) (numerics.md §9) and
    keeps them as the module's buffer `attn_qat_k_shift` (H_kv, D), float32, saved with the model's state_dict.
    Returns the model.

    Call it after `attn_qat.prepare(model, QATConfig(shift_k=True, ...))` (and after any cast of the model's dtype),
    with a few batches of the training data (about 16 sequences in all): `run(model, batch)` runs one (default
    `model(**batch)` for a dict, else `model(batch)`).
    Meanwhile the modules record the keys they are given (after RoPE and norms) and attend as the model's own
    attention does (transformers' "sdpa", PyTorch's SDPA in Wan). The shift stays fixed afterwards, in training and
    inference alike: any fixed shift keeps the scores exact; only FP4's rounding depends on it. Padding tokens in the
    batches count like any other token. Under data parallelism, calibrate every rank on the same batches (or load
    one rank's buffers everywhere; DDP's default broadcast_buffers sends rank 0's): the shift is part of the
    model's numerics.
    """
    from .lifecycle import _unwrap_peft

    base, _ = _unwrap_peft(model, None)
    targets = [(m, s) for m in base.modules() if (s := module_state(m)) is not None and s.selected and
               s.config.shift_k]
    if not targets:
        raise ValueError(f"attn_qat.calibrate_k_shift: {type(base).__name__} has no attention module prepared with "
                         "QATConfig(shift_k=True); call attn_qat.prepare(model, QATConfig(shift_k=True)) first")
    run = run if run is not None else (lambda m, b: m(**b) if isinstance(b, dict) else m(b))
    for _, state in targets:
        state.calibration = KeySums()
    try:
        for batch in batches:
            run(model, batch)
        empty = [type(m).__name__ for m, s in targets if s.calibration.count == 0]
        if empty:
            raise ValueError(f"attn_qat.calibrate_k_shift: {len(empty)} prepared attention module(s) saw no keys; "
                             "pass at least one batch that runs the whole model")
        with torch.inference_mode(False):  # a buffer made in inference mode could never be updated in place
            for module, state in targets:
                shift = (state.calibration.total / state.calibration.count).float()
                current = getattr(module, K_SHIFT_BUFFER, None)
                if current is not None and K_SHIFT_BUFFER not in module._buffers:
                    raise TypeError(f"attn_qat.calibrate_k_shift: {type(module).__name__} already has an attribute "
                                    f"'{K_SHIFT_BUFFER}' that is not a buffer")
                if current is not None and current.shape == shift.shape and not current.is_inference():
                    current.copy_(shift)  # the same tensor: wrappers that hold the buffer (DDP) see the new means
                else:
                    module.register_buffer(K_SHIFT_BUFFER, shift.clone(), persistent=True)
    finally:
        for _, state in targets:
            state.calibration = None
    return model
