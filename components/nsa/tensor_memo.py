"""Values derived from a tensor, kept for as long as the tensor lives and made again after it changes in place."""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

Built = TypeVar("Built")


class TensorMemo:
    """build() results by (tensor, key). Keyed weakly by the tensor's identity, so an entry goes with its tensor and
    a later tensor at the same address is never taken for it; an in-place change (the tensor's version counter)
    drops all of its entries. The caller rules out tensors without a counter (inference tensors), and what build
    returns must not hold the tensor (it would keep itself alive)."""

    def __init__(self):
        self._entries = WeakIdKeyDictionary()  # tensor -> (its version, {key: built})

    def get(self, tensor: torch.Tensor, key: Hashable, build: Callable[[], Built]) -> Built:
        entry = self._entries.get(tensor)
        if entry is None or entry[0] != tensor._version:
            entry = self._entries[tensor] = (tensor._version, {})
        if key not in entry[1]:
            entry[1][key] = build()
        return entry[1][key]

    def __len__(self) -> int:
        return len(self._entries)
