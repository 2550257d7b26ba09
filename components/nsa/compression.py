"""Compression of raw keys/values into one vector per block of l tokens taken every d tokens.

Block i covers tokens [i*d, i*d + l); only complete blocks exist. The caller rotates the
compressed keys at `compressed_block_positions` (each block's last token): phi sees un-rotated keys.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from components.errors import UserError

COMPRESS_MODES = ("mlp", "mean")


def num_compressed_blocks(num_tokens: int, block_size: int, block_stride: int) -> int:
    """Tc = floor((T - l) / d) + 1 when T >= l, else 0."""
    if num_tokens < block_size:
        return 0
    return (num_tokens - block_size) // block_stride + 1


def compressed_block_positions(
    num_blocks: int, block_size: int, block_stride: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """LongTensor [Tc]: the last token i*d + l - 1 of each block, where its compressed key is rotated."""
    return torch.arange(num_blocks, device=device) * block_stride + (block_size - 1)


def unfold_blocks(x: torch.Tensor, block_size: int, block_stride: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, Tc, Hkv, l, D], a strided view (no copy) of the complete blocks."""
    if x.dim() != 4:
        raise ValueError(f"expected keys/values [B, T, Hkv, D], got shape {tuple(x.shape)}")
    B, T, Hkv, D = x.shape
    if T < block_size:
        # unfold rejects a window longer than the sequence; there are simply no blocks. Slicing
        # (not new_zeros) keeps the input in the graph, so it still gets a (zero) gradient.
        return x[:, :0].unsqueeze(3).expand(B, 0, Hkv, block_size, D)
    return x.unfold(1, block_size, block_stride).transpose(-1, -2)


class KVCompressor(nn.Module):
    """phi: raw keys or values [B, T, Hkv, D] -> compressed [B, Tc, Hkv, D], weights shared by heads.

    mode "mean": the block mean (no parameters).
    mode "mlp": add a learned intra-block position embedding [l, D], flatten the block to l*D,
    then Linear(l*D, hidden) -> GELU -> Linear(hidden, D).
    """

    def __init__(self, mode: str, block_size: int, block_stride: int, head_dim: int, hidden_dim: int | None = None):
        super().__init__()
        if mode not in COMPRESS_MODES:
            raise UserError(f"unknown compress mode {mode!r}; choose one of {', '.join(COMPRESS_MODES)}")
        for name, value in (("block_size", block_size), ("block_stride", block_stride), ("head_dim", head_dim)):
            if value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        if block_size % block_stride:
            raise UserError(f"block_stride {block_stride} must divide block_size {block_size}")
        self.mode = mode
        self.block_size = block_size
        self.block_stride = block_stride
        self.head_dim = head_dim
        if mode == "mlp":
            # A modest bottleneck: l*D inputs (2048 at the defaults) would make an l*D-wide hidden layer
            # cost millions of parameters per layer for little gain.
            self.hidden_dim = hidden_dim if hidden_dim is not None else 4 * head_dim
            if self.hidden_dim < 1:
                raise UserError(f"hidden_dim must be >= 1, got {self.hidden_dim}")
            self.pos_embed = nn.Parameter(torch.empty(block_size, head_dim))
            self.fc1 = nn.Linear(block_size * head_dim, self.hidden_dim)
            self.fc2 = nn.Linear(self.hidden_dim, head_dim)
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Variance-preserving init: for unit-scale tokens the output starts at unit scale too.

        So at step 0 compressed keys give logits on the same scale as token keys, whatever l is.
        """
        if self.mode != "mlp":
            return
        nn.init.zeros_(self.pos_embed)
        nn.init.normal_(self.fc1.weight, std=1.0 / math.sqrt(self.fc1.in_features))
        nn.init.zeros_(self.fc1.bias)
        # E[gelu(z)^2] is about 0.425 for z ~ N(0, 1); undo that shrinkage in the second layer.
        nn.init.normal_(self.fc2.weight, std=1.0 / math.sqrt(0.425 * self.fc2.in_features))
        nn.init.zeros_(self.fc2.bias)

    def extra_repr(self) -> str:
        extra = f", hidden_dim={self.hidden_dim}" if self.mode == "mlp" else ""
        sizes = f"block_size={self.block_size}, block_stride={self.block_stride}, head_dim={self.head_dim}"
        return f"mode={self.mode}, {sizes}{extra}"

    def forward(self, x: torch.Tensor, block_starts: torch.Tensor | None = None) -> torch.Tensor:
        """block_starts [Tc] (packed documents, components.nsa.documents.document_layout): compress the
        blocks of l tokens starting there instead of every d-th token of the row."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"expected [B, T, Hkv, {self.head_dim}], got shape {tuple(x.shape)}")
        if block_starts is None:
            blocks = unfold_blocks(x, self.block_size, self.block_stride)  # [B, Tc, Hkv, l, D]
        else:
            rows = block_starts[:, None] + torch.arange(self.block_size, device=x.device)  # [Tc, l]
            blocks = x[:, rows].transpose(2, 3)  # [B, Tc, l, Hkv, D] -> [B, Tc, Hkv, l, D]
        if self.mode == "mean":
            return blocks.mean(dim=-2)
        B, Tc, Hkv, _, D = blocks.shape
        flat = (blocks + self.pos_embed).reshape(B, Tc, Hkv, self.block_size * D)
        return self.fc2(nn.functional.gelu(self.fc1(flat)))
