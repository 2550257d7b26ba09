"""Key/value cache for incremental decoding.

One `LayerKV` per attention layer holds that layer's buffers [B, capacity, Hkv, D] by name (the
attention module decides which it needs); `KVCache` holds them all and the number of cached tokens.
"""

from __future__ import annotations

import torch


class LayerKV:
    """Named buffers along the token axis, plus NSA's count of compressed blocks already emitted."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self.buffers = buffers
        self.num_compressed = 0

    def write(self, start: int, **tensors: torch.Tensor) -> None:
        for name, x in tensors.items():
            self.buffers[name][:, start:start + x.shape[1]] = x

    def read(self, name: str, end: int) -> torch.Tensor:
        return self.buffers[name][:, :end]

    def reset(self) -> None:
        self.num_compressed = 0


class KVCache:
    """Every layer's `LayerKV` and how many tokens they hold (`length`, a host int: decode is eager)."""

    def __init__(self, layers: list[LayerKV], batch_size: int, capacity: int):
        self.layers = layers
        self.batch_size = batch_size
        self.capacity = capacity
        self.length = 0

    def reset(self) -> None:
        """Forget the cached tokens (buffers are reused, stale values are overwritten before use)."""
        self.length = 0
        for layer in self.layers:
            layer.reset()
