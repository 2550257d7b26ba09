"""Rotary position embedding: one table, one rotation for queries and keys alike.

Positions are explicit so the training forward, the decode path and NSA's compressed keys
(rotated at their block's last token) all go through the same function.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_seq_len, head_dim/2], kept as non-persistent buffers.

    They are derived from the arguments, so checkpoints do not carry them; `reset_parameters`
    recomputes them after `to_empty` (meta-device construction leaves them uninitialised).
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        if not self.cos.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # float64 angles: position * frequency loses digits in fp32 at long positions
        device = self.cos.device
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float64) / self.head_dim
        inv_freq = self.theta ** -exponents
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] at positions [T] (long) with tables cos/sin [L, D/2].

    Half-split pairing: feature i pairs with feature i + D/2. Computed in at least fp32.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    c = cos.index_select(0, positions).to(dtype)[None, :, None, :]
    s = sin.index_select(0, positions).to(dtype)[None, :, None, :]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
