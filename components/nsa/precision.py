"""The reference computes in the precision NSA_SPEC.md states, whatever autocast region calls it."""

from __future__ import annotations

import functools

import torch


def without_autocast(fn):
    """Run fn with autocast off on its first tensor argument's device (positional or keyword). A matmul
    inside an autocast region runs in bf16 even on fp32 operands: the group scores (fp32 by the spec)
    would change which blocks are selected, and the backward, run outside autocast, would select others
    than the forward did."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next(a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if device == "meta":  # shapes only (no autocast for meta tensors)
            return fn(*args, **kwargs)
        with torch.autocast(device_type=device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper
