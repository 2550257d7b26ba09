"""What a module's forward saves for backward, measured with saved-tensor hooks (for the memory estimate's tests)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def saved_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct storages forward() saves for backward, the model's parameters and buffers left out."""
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in fixed:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())
