"""The selected branch's masked layout: the selection, read by the interval kernels as a mask.

The selected branch attends, per query, over the causal keys of the blocks its group selected. Where
those blocks cover much of the causal keys (short rows: n * l' is half of 2,048), it can run as
causal flash attention (interval_attention.py's kernels, key_stride 1, unbounded window) that hides
each key block from the queries that did not select it: more products than the gather layouts, in
kernels built like dense flash attention. Selections hold distinct blocks, so the masked sum is the
gathered one.

A program loads the n selected blocks of each of its queries once (as int16 where the blocks fit, counted
from the document start) and, per key tile, tests whether the tile's block is among them: no mask to build or
to size by a document's length, which a packed row's tables hold only on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from components.nsa.triton.tile_configs import next_pow2


class Chosen(NamedTuple):
    selection: torch.Tensor  # int16 or int32 [B, T, Hkv, n], contiguous; -1 for unused slots
    sel_block_size: int

    @staticmethod
    def of(sel_idx: torch.Tensor, sel_block_size: int, num_keys: int) -> "Chosen":
        """From a selection [B, T, Hkv, n] (block indices, -1 for unused slots) over rows of num_keys keys:
        int16 where every block index fits (half the bytes each program loads per query), else int32."""
        narrow = -(-num_keys // sel_block_size) <= torch.iinfo(torch.int16).max
        return Chosen(sel_idx.to(torch.int16 if narrow else torch.int32).contiguous(), sel_block_size)

    def key_tile(self, block_n: int) -> int:
        """The key tile (at most block_n) that lies inside one selection block: the largest power of
        two dividing sel_block_size (tile_configs.masked_layout_fits asks for 16 or more)."""
        tile = block_n
        while self.sel_block_size % tile:
            tile //= 2
        return tile

    # The interval kernels' arguments, with stand-ins where no selection masks the keys (the compressed and window
    # branches).
    @staticmethod
    def arguments(chosen: "Chosen | None") -> tuple:
        """(CHOSEN, its strides of the batch row, query and KV group (a query's slots are contiguous),
        SEL_BLOCK, NUM_SEL)."""
        if chosen is None:
            return None, 0, 0, 0, 0, 0
        return (chosen.selection, *chosen.selection.stride()[:3], chosen.sel_block_size, chosen.selection.shape[-1])

    @staticmethod
    def constants(chosen: "Chosen | None") -> dict:
        """SELECTED, and BLOCK_S: the slots a program loads per query, n padded to a power of two."""
        if chosen is None:
            return {"SELECTED": False, "BLOCK_S": 2}
        return {"SELECTED": True, "BLOCK_S": max(2, next_pow2(chosen.selection.shape[-1]))}
