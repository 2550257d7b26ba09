"""Activation checkpointing per transformer block, applied in place (state-dict keys unchanged)."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(blocks: nn.ModuleList, mode: str, every: int) -> int:
    """Recompute the chosen blocks' activations in backward; returns how many blocks were wrapped.

    Wrapping `forward` instead of the module keeps parameter names intact, so checkpoints do not
    depend on the activation-checkpointing setting.
    """
    if mode == "none":
        return 0
    wrapped = 0
    for index, block in enumerate(blocks):
        if mode == "full" or (mode == "selective" and index % every == 0):
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
            wrapped += 1
    return wrapped
