"""Activation checkpointing per block (the model part's plan names the blocks), applied in place
(state-dict keys unchanged)."""

from __future__ import annotations

from typing import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward):
    # A plain Python function (not functools.partial of `checkpoint`, which dynamo skips) so that a
    # compiled block traces through it and emits one graph with the checkpointed region inside.
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(blocks: Sequence[nn.Module], mode: str, every: int) -> int:
    """Recompute the chosen blocks' activations in backward; returns how many blocks were wrapped.

    Wrapping `forward` instead of the module keeps parameter names intact, so checkpoints do not
    depend on the activation-checkpointing setting.
    """
    if mode == "none":
        return 0
    wrapped = 0
    for index, block in enumerate(blocks):
        if mode == "full" or (mode == "selective" and index % every == 0):
            block.forward = _checkpointed(block.forward)
            wrapped += 1
    return wrapped
