"""Score-preserving transforms of Q and K before FP4 quantization (docs/numerics.md §9).

Each leaves every softmax row unchanged in exact arithmetic and moves only where FP4 rounds:

- rotation: Q and K both multiplied by one orthogonal matrix R = diag(s) H / sqrt(D) along head_dim (H Sylvester's
  Hadamard matrix, s fixed random signs), so q·k = (qR)·(kR); it spreads a channel's outliers over all D channels,
  which shrinks the 16-channel blocks' amax relative to their other values;
- K shift: a fixed per-(KV head, channel) vector mu subtracted from K, so q·(k − mu) = q·k − q·mu, a constant of the
  query's row that softmax cancels; mu is calibrated once (`attn_qat.calibrate_k_shift`), never taken from the
  call's keys, so no key reaches another key's scale and a hidden key stays absent (numerics.md §2);
- Q/K balance: Q's channel c multiplied by a fixed s_c and K's divided by it, so sum_c (q_c s_c)(k_c / s_c) = q·k;
  with s_c = (max|k_c| / max|q_c|)^alpha (calibrated like mu) it moves range from the operand with the larger
  channel to the other, as SmoothQuant does between activations and weights.

With QATConfig(learn_qk_transforms=True) the balance and the rotation are trained with the model
(integrations/qk_transforms.LearnedQK): s = s_calibrated * exp(delta) and R = R_hadamard exp(A − Aᵀ)
(`learned_rotation`), delta and A parameters that start at 0, so training starts from the fixed transforms and every
value of them keeps the scores.
"""
import math
from typing import Dict, Optional, Tuple

import torch

# The seed of the rotation's signs: fixed, so a model trained with the rotation runs the same matrix everywhere.
ROTATION_SEED = 0

_rotations: Dict[Tuple[int, str], torch.Tensor] = {}


def qk_rotation(head_dim: int, device=None) -> torch.Tensor:
    """The (head_dim, head_dim) float32 orthogonal matrix diag(s) H / sqrt(head_dim) of numerics.md §9 (cached)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"attn_qat: the Q/K rotation needs a power-of-two head_dim, got {head_dim}")
    device = torch.device("cpu") if device is None else torch.device(device)
    key = (head_dim, str(device))
    rotation = _rotations.get(key)
    if rotation is None:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(ROTATION_SEED)) * 2 - 1
        rotation = (signs[:, None] * h / math.sqrt(head_dim)).to(device)
        _rotations[key] = rotation
    return rotation


def learned_rotation(generator: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """R = qk_rotation(D) · exp(A − Aᵀ), A the strictly lower triangle of the (D, D) `generator`, computed in
    `dtype` promoted with the generator's and float32 (autocast off; differentiable): orthogonal for every
    generator (the exponential of a skew-symmetric matrix is), the Hadamard rotation of numerics.md §9 at 0."""
    if generator.dim() != 2 or generator.shape[0] != generator.shape[1]:
        raise ValueError(f"attn_qat: a rotation generator must be a square (D, D) matrix, got {tuple(generator.shape)}")
    dtype = torch.promote_types(torch.promote_types(generator.dtype, dtype), torch.float32)
    with torch.autocast(generator.device.type, enabled=False):
        a = generator.to(dtype).tril(-1)
        return qk_rotation(generator.shape[0], generator.device).to(dtype) @ torch.linalg.matrix_exp(a - a.mT)


def transform_qk(query: torch.Tensor, key: torch.Tensor, rotate: bool = False,
                 k_shift: Optional[torch.Tensor] = None,
                 balance: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                 rotation: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(query', key') = ((query * s_q) R, ((key − k_shift) / s_k) R) along the last axis, computed in float32
    (float64 for float64 inputs; autocast off, which would round K − k_shift and R first) and returned in the inputs'
    dtypes (differentiable). `k_shift` broadcasts against `key` (e.g. (H_kv, 1, D) for (B, H_kv, S, D)); `balance`
    is (s_q, s_k), the same per-channel scales laid out to broadcast against `query` (each KV head's repeated for
    its query heads) and `key`; R is the identity unless `rotate`, `rotation` (D, D) when given (a learned one), else
    qk_rotation's. Gradients reach the inputs and whichever of k_shift, balance and rotation require them."""
    if rotation is not None and not rotate:
        raise ValueError("attn_qat: transform_qk got a rotation matrix but rotate=False")
    if not rotate and k_shift is None and balance is None:
        return query, key
    dtype = torch.promote_types(query.dtype, torch.float32)
    with torch.autocast(query.device.type, enabled=False):
        q, k = query.to(dtype), key.to(dtype)
        if k_shift is not None:
            k = k - k_shift.to(device=k.device, dtype=dtype)
        if balance is not None:
            q = q * balance[0].to(device=q.device, dtype=dtype)
            k = k / balance[1].to(device=k.device, dtype=dtype)
        if rotate:
            if rotation is None:
                rotation = qk_rotation(query.shape[-1], query.device)
            elif rotation.shape != (query.shape[-1], query.shape[-1]):
                raise ValueError(f"attn_qat: a ({query.shape[-1]}, {query.shape[-1]}) rotation is needed for "
                                 f"head_dim {query.shape[-1]}, got {tuple(rotation.shape)}")
            rotation = rotation.to(device=q.device, dtype=dtype)
            q, k = q @ rotation, k @ rotation
    return q.to(query.dtype), k.to(key.dtype)
