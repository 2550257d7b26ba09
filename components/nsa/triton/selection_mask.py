"""The selected branch's masked layout: its selection as one byte per (query, KV group, key block).

The selected branch attends, per query, over the causal keys of the blocks its group selected. Where
those blocks cover much of the causal keys (short rows: n * l' is half of 2,048), it can run as
causal flash attention (interval_attention.py's kernels, key_stride 1, unbounded window) that hides
each key block from the queries that did not select it: more products than the gather layouts, in
kernels built like dense flash attention. Selections hold distinct blocks, so the masked sum is the
gathered one.

chosen[b, g, j, t] = 1 where query t of batch row b selected key block j of its document for KV
group g (blocks counted from the document start, as the selection counts them). Laid out [B, Hkv,
blocks, T]: a key tile reads one contiguous run of bytes for its query tile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

class Chosen(NamedTuple):
    mask: torch.Tensor  # uint8 [B, Hkv, blocks, T]
    sel_block_size: int

    @staticmethod
    def of(sel_idx: torch.Tensor, sel_block_size: int, num_keys: int) -> "Chosen":
        """From a selection [B, T, Hkv, n] (block indices, -1 for unused slots) over rows of num_keys keys
        (more than T where queries are their documents' last ones)."""
        B, T, Hkv, _ = sel_idx.shape
        blocks = -(-num_keys // sel_block_size)
        mask = torch.zeros(B, Hkv, blocks + 1, T, dtype=torch.uint8, device=sel_idx.device)
        # Unused slots land in the extra last block, left out of the view; so would an index past the blocks,
        # which only a selection never computed holds (bench.kernel_resources compiles kernels without running them).
        slots = torch.where((sel_idx >= 0) & (sel_idx < blocks), sel_idx, blocks).permute(0, 2, 3, 1)
        mask.scatter_(2, slots, 1)
        return Chosen(mask[:, :, :blocks], sel_block_size)

    def key_tile(self, block_n: int) -> int:
        """The key tile (at most block_n) that lies inside one selection block: the largest power of
        two dividing sel_block_size (tile_configs.masked_layout_pays asks for 16 or more)."""
        tile = block_n
        while self.sel_block_size % tile:
            tile //= 2
        return tile

    @staticmethod
    def arguments(chosen: "Chosen | None") -> tuple:
        return (None if chosen is None else chosen.mask,)

    @staticmethod
    def strides(chosen: "Chosen | None") -> tuple[int, int, int]:
        return (0, 0, 0) if chosen is None else chosen.mask.stride()[:3]

    @staticmethod
    def block(chosen: "Chosen | None") -> tuple[int]:
        return (0 if chosen is None else chosen.sel_block_size,)
