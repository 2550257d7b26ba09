"""Which keys each query may see, per branch, for a chunk of queries at a time.

A rule answers, for the queries at absolute positions [q0, q1):
  key_range(q0, q1) -> (k0, k1): the only keys any of them can see (python ints, from shapes alone);
  mask_(scores, q0, q1, k0, k1): adds -inf in place to the scores [B, Hkv, q1 - q0, G, k1 - k0]
      of keys a query cannot see (the G query heads of a group share the mask);
  first_seeing: the first position that sees any key (earlier queries see nothing at all).
Chunked attention slices keys to key_range, so a chunk only touches keys some query in it can see.
Masks are additive floats, built as 1 - 1/keep from a 0/1 float keep-mask (exact: 1 - 1 = 0 and
1 - inf = -inf). On CPU that is an order of magnitude faster than masked_fill or where with a
boolean mask, or log(keep), whose log(0) takes a slow path.
"""

from __future__ import annotations

import torch


def _positions(start: int, stop: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, stop, device=device)


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keep-mask (bool, or float 0/1) -> 0 where kept, -inf elsewhere."""
    return keep.to(dtype).reciprocal_().neg_().add_(1.0)


def _add_positional(scores: torch.Tensor, keep_2d: torch.Tensor) -> torch.Tensor:
    """Mask scores [B, Hkv, C, G, K] with a [C, K] keep-mask shared by every batch row and head."""
    C, K = keep_2d.shape
    return scores.add_(additive(keep_2d, scores.dtype).view(1, 1, C, 1, K))


class WindowRule:
    """Query t sees keys s with max(0, t - w + 1) <= s <= t.

    `key_start`: the position of the first key held (a decode cache keeps only the recent ones); key
    indices (key_range, mask_'s k0, k1) count from it."""

    first_seeing = 0

    def __init__(self, window_size: int, device: torch.device, key_start: int = 0):
        self.window_size = window_size
        self.device = device
        self.key_start = key_start

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        return max(0, q0 - self.window_size + 1) - self.key_start, q1 - self.key_start

    def mask_(self, scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        t = _positions(q0, q1, self.device)[:, None]
        s = _positions(k0 + self.key_start, k1 + self.key_start, self.device)[None, :]
        return _add_positional(scores, (s <= t) & (s > t - self.window_size))


class CompressedRule:
    """Query t sees compressed block i iff the block's last token i*d + l - 1 <= t."""

    def __init__(self, block_size: int, block_stride: int, num_blocks: int, device: torch.device):
        self.block_size = block_size
        self.block_stride = block_stride
        self.num_blocks = num_blocks
        self.device = device
        self.first_seeing = block_size - 1

    def visible_blocks(self, position: int) -> int:
        """How many compressed blocks the query at `position` sees (they are blocks 0 .. count-1)."""
        if position < self.block_size - 1:
            return 0
        return min(self.num_blocks, (position - self.block_size + 1) // self.block_stride + 1)

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        return 0, self.visible_blocks(q1 - 1)

    def mask_(self, scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        t = _positions(q0, q1, self.device)[:, None]
        last_token = _positions(k0, k1, self.device)[None, :] * self.block_stride + (self.block_size - 1)
        return _add_positional(scores, last_token <= t)


class SelectedRule:
    """Query t sees the tokens s <= t inside the selection blocks chosen for its group.

    `selection` is [B, Tq, Hkv, n] (block indices, -1 for unused slots) for the queries at
    positions q_start .. q_start + Tq - 1. A query's selection never holds a block after its
    own, so causality only needs enforcing inside the chunk's own blocks.
    """

    first_seeing = 0

    def __init__(self, selection: torch.Tensor, sel_block_size: int, q_start: int):
        self.selection = selection
        self.sel_block_size = sel_block_size
        self.q_start = q_start
        self.device = selection.device

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        return 0, q1

    def mask_(self, scores: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        lp = self.sel_block_size
        B, Hkv, C, G, K = scores.shape
        chosen = self.selection[:, q0 - self.q_start : q1 - self.q_start]  # [B, C, Hkv, n]
        first, last = k0 // lp, (k1 - 1) // lp
        num = last - first + 1
        # Unused slots (-1) and blocks outside [first, last] land in a spare column that is dropped.
        inside = (chosen >= first) & (chosen <= last)
        column = torch.where(inside, chosen - first, torch.full_like(chosen, num))
        picked = torch.zeros(B, C, Hkv, num + 1, dtype=scores.dtype, device=self.device)
        picked.scatter_(-1, column, 1.0)
        block_bias = additive(picked[..., :num], scores.dtype).permute(0, 2, 1, 3)  # [B, Hkv, C, num]
        # Add each block's entry to its l' keys through a blocked view of the scores: no
        # token-level mask is ever materialised. Blocks cut by k0 or k1 are added on their own.
        head = min(K, (first + 1) * lp - k0)  # keys of the first (possibly cut) block
        scores[..., :head].add_(block_bias[:, :, :, None, :1])
        whole = (K - head) // lp
        if whole:
            body = scores[..., head : head + whole * lp].unflatten(-1, (whole, lp))
            body.add_(block_bias[:, :, :, None, 1 : 1 + whole, None])
        if head + whole * lp < K:
            scores[..., head + whole * lp :].add_(block_bias[:, :, :, None, num - 1 : num])
        # A query's selection never holds a block after its own, so future keys can only sit in
        # blocks from the chunk's first query's block onwards.
        causal_from = max(k0, (q0 // lp) * lp)
        if causal_from < k1:
            t = _positions(q0, q1, self.device)[:, None]
            s = _positions(causal_from, k1, self.device)[None, :]
            future = additive(s <= t, scores.dtype)
            scores[..., causal_from - k0 :].add_(future.view(1, 1, C, 1, k1 - causal_from))
        return scores
