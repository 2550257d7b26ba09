"""Gradient clipping that is right for sharded (DTensor) gradients too."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0 disables clipping) and return the global norm before clipping.

    With sharded gradients each rank holds a piece; the norm of the pieces is a partial result that
    `full_tensor()` reduces over the mesh, so every rank clips by the same global norm.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0 and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
