"""Key/value cache for incremental decoding.

One `LayerKV` per attention layer holds that layer's buffers by name (the attention module decides which it
needs): full-length ones [B, capacity, Hkv, D] for what a step may read at any position, and `RecentTokens`
for what a step reads only near its own tokens (NSA's window and its raw keys/values awaiting compression);
`KVCache` holds them all and the number of cached tokens.
"""

from __future__ import annotations

import torch


class RecentTokens:
    """The last `keep` tokens of one stream [B, T, Hkv, D], contiguous at the front of a buffer of at most
    2 * keep + 1 tokens: a step appends in place and reads a view, and the tokens no later step needs are moved
    out of the way only when the buffer is full (one copy of `keep` tokens every `keep + 1` single-token steps)."""

    def __init__(self, keep: int, capacity: int, shape: tuple[int, ...], device, dtype):
        self.keep = keep
        self.data = torch.zeros((shape[0], min(capacity, 2 * keep + 1)) + tuple(shape[1:]), device=device, dtype=dtype)
        self.first = 0  # the position of data[:, 0]
        self.count = 0  # tokens held

    def extend(self, start: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Append x [B, Tn, ...] (positions start .. start + Tn - 1, right after the held ones) and return
        (the tokens from position `first` to the end, first), with first <= start - min(start, keep)."""
        if start != self.first + self.count:
            raise ValueError(f"tokens at position {start} do not follow the {self.count} held up to "
                             f"{self.first + self.count}")
        n, room = x.shape[1], self.data.shape[1]
        held = min(self.count, self.keep)
        if self.count + n > room and held + n <= room:  # move the needed tail to the front, then append in place
            self.data[:, :held] = self.data[:, self.count - held:self.count].clone()
            self.first, self.count = start - held, held
        if self.count + n <= room:
            self.data[:, self.count:self.count + n] = x
            self.count += n
            return self.data[:, :self.count], self.first
        # a chunk longer than the buffer: read it whole with the held tail, keep its last `keep` tokens in a new
        # buffer (the old one stays whole for rewind())
        tokens = torch.cat([self.data[:, self.count - held:self.count], x], dim=1)
        kept = min(self.keep, tokens.shape[1])
        self.data = torch.empty_like(self.data)
        self.data[:, :kept] = tokens[:, tokens.shape[1] - kept:]
        self.first, self.count = start + n - kept, kept
        return tokens, start - held

    def state(self) -> tuple[torch.Tensor, int, int]:
        """What rewind() goes back to: no copy, since extend() keeps the held tokens a step reads before its own (in
        this buffer, or for a long chunk in the one it replaces)."""
        return self.data, self.first, self.count

    def rewind(self, state: tuple[torch.Tensor, int, int]) -> None:
        """Forget the tokens extend() appended since state() (a step that failed midway)."""
        data, first, count = state
        if data is self.data:  # appended in place, perhaps after moving the held tail to the front
            self.count = first + count - self.first
        else:
            self.data, self.first, self.count = state

    def reset(self) -> None:
        self.first = self.count = 0


class LayerKV:
    """Named full-length buffers and recent-token streams, plus NSA's count of compressed blocks already emitted."""

    def __init__(self, buffers: dict[str, torch.Tensor], recent: dict[str, RecentTokens] | None = None):
        self.buffers = buffers
        self.recent = recent or {}
        self.num_compressed = 0

    def write(self, start: int, **tensors: torch.Tensor) -> None:
        for name, x in tensors.items():
            self.buffers[name][:, start:start + x.shape[1]] = x

    def read(self, name: str, end: int) -> torch.Tensor:
        return self.buffers[name][:, :end]

    def extend_recent(self, start: int, name: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """RecentTokens.extend of the stream `name`."""
        return self.recent[name].extend(start, x)

    def state(self) -> tuple:
        """What rewind() goes back to: the compressed blocks emitted and each stream's state (the full-length buffers
        need nothing: a step writes them only at its own positions)."""
        return self.num_compressed, {name: stream.state() for name, stream in self.recent.items()}

    def rewind(self, state: tuple) -> None:
        self.num_compressed, streams = state
        for name, stream in streams.items():
            self.recent[name].rewind(stream)

    def nbytes(self) -> int:
        """Bytes the layer's buffers hold."""
        tensors = list(self.buffers.values()) + [r.data for r in self.recent.values()]
        return sum(x.numel() * x.element_size() for x in tensors)

    def reset(self) -> None:
        self.num_compressed = 0
        for stream in self.recent.values():
            stream.reset()


class KVCache:
    """Every layer's `LayerKV` and how many tokens they hold (`length`, a host int: decode is eager)."""

    def __init__(self, layers: list[LayerKV], batch_size: int, capacity: int):
        self.layers = layers
        self.batch_size = batch_size
        self.capacity = capacity
        self.length = 0

    def state(self) -> list:
        """What rewind() goes back to: every layer's state (taken before a step)."""
        return [layer.state() for layer in self.layers]

    def rewind(self, state: list) -> None:
        """Back to `state`, as if the steps since had not run (one that failed after some layers took its tokens)."""
        for layer, saved in zip(self.layers, state):
            layer.rewind(saved)

    def nbytes(self) -> int:
        """Bytes every layer's buffers hold."""
        return sum(layer.nbytes() for layer in self.layers)

    def reset(self) -> None:
        """Forget the cached tokens (buffers are reused, stale values are overwritten before use)."""
        self.length = 0
        for layer in self.layers:
            layer.reset()
