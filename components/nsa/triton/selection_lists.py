"""The selection turned around: for every key block, the queries that chose it, cut into work items.

The block-major kernels of the selected branch (its dK/dV backward always; its forward and dQ where
tile_configs.selected_layout says "block") visit each selection block once, with the list of
queries whose selection holds it, so the block's keys and values are read once per work item
instead of once per query. A bin is (batch, KV group, selection block); its list holds the
queries ascending (a stable sort). Long lists (block 0 and the current blocks are chosen by almost
every query) are cut into work items of at most `segment` queries. Everything is sized from shapes
alone: no host sync, nothing data-dependent for torch.compile.

An entry is one (query, slot) of the selection, and its place in the sorted lists names it: the
block-major kernels write per-entry partial results there, and entry_of finds them again for each
query's slots in order, so every sum runs in a fixed order (bitwise reproducible).

Packed documents (cu_seqlens, B = 1): selections count blocks from each query's document start; the
lists number the key blocks document after document (packing.selection_blocks), a block ending at
its document's end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from components.errors import UserError
from components.nsa.triton.tile_configs import cdiv
from components.nsa.triton.packing import SelectionBlocks, document_starts, kept, selection_blocks
from components.nsa.triton.tiles import grid_position

Tensor = torch.Tensor
MAX_ENTRIES = 2**31 - 1  # entry_of and query_list are int32


class SelectionLists(NamedTuple):
    query_list: Tensor  # int32 [E]: each bin's queries, ascending, bin after bin (E = B * Hkv * T * n)
    list_start: Tensor  # int64 [bins + 1]: where each bin's list starts in query_list
    item_bin: Tensor  # int64 [max_items]: each work item's bin; spare grid slots get bins (and exit)
    item_start: Tensor  # int64 [bins + 1]: each bin's first work item
    max_items: int  # the launch size: an upper bound on the work items
    num_bins: int
    num_sel_blocks: int  # key blocks per (batch, KV group)
    entry_of: Tensor | None  # int32 [B, Hkv, T, n]: where entry (b, g, t, slot) stands in query_list
    blocks: Tensor | None  # packed: (document, block in it) of every key block number; else None
    starts: Tensor | None  # packed: each document's first key, then the end twice; else None


def _document_blocks(cu_seqlens: Tensor, cu_seqlens_q: Tensor | None, sel_block_size: int, num_keys: int,
                     num_queries: int) -> tuple[Tensor, SelectionBlocks]:
    """(each document's first key, then the end twice; the documents' selection blocks)."""
    starts = document_starts(cu_seqlens)
    query_starts = starts if cu_seqlens_q is None else document_starts(cu_seqlens_q)
    return starts, selection_blocks(starts, sel_block_size, num_keys, query_starts, num_queries)


def selection_lists(sel_idx: Tensor, sel_block_size: int, num_keys: int, segment: int,
                    cu_seqlens: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
                    entries: bool = False) -> SelectionLists:
    """The lists of sel_idx [B, T, Hkv, n] over num_keys keys per row, in items of at most `segment`
    queries. Unused slots (-1) sort past the last bin and belong to no list. entry_of only with
    `entries` (the kernels that write per-entry partials need it); else None."""
    B, T, HKV, N = sel_idx.shape
    device = sel_idx.device
    if entries and sel_idx.numel() > MAX_ENTRIES:
        raise UserError(f"the selected branch's block layout numbers {sel_idx.numel()} (query, slot) entries, more "
                        f"than its int32 tables hold ({MAX_ENTRIES}); use a smaller batch or sequence per step")
    if cu_seqlens is not None:
        starts, (blocks, token_first_block) = kept(cu_seqlens, cu_seqlens_q, ("selection blocks", sel_block_size,
                                                                              num_keys, T),
                                                   lambda: _document_blocks(cu_seqlens, cu_seqlens_q, sel_block_size,
                                                                            num_keys, T))
        num_sel_blocks = blocks.shape[1]
    else:
        starts = blocks = token_first_block = None
        num_sel_blocks = cdiv(num_keys, sel_block_size)
    num_bins = B * HKV * num_sel_blocks

    # Entries ordered (b, g, t, slot): a stable sort by bin keeps each list's queries ascending.
    idx = sel_idx.permute(0, 2, 1, 3).to(torch.int64)
    if token_first_block is not None:
        idx = torch.where(idx >= 0, idx + token_first_block.view(1, 1, T, 1), idx)
    bh = torch.arange(B * HKV, device=device).view(B, HKV, 1, 1) * num_sel_blocks
    # int32 bins when they fit (they do unless the lists are huge): a radix sort of half the key bits.
    bin_dtype = torch.int32 if num_bins < MAX_ENTRIES else torch.int64
    bins = torch.where(idx >= 0, bh + idx, num_bins).reshape(-1).to(bin_dtype)
    sorted_bins, order = torch.sort(bins, stable=True)
    query_list = (order // N % T).to(torch.int32)
    entry_of = None
    if entries:
        entry_of = torch.empty_like(order, dtype=torch.int32)
        entry_of[order] = torch.arange(order.numel(), device=device, dtype=torch.int32)
        entry_of = entry_of.view(B, HKV, T, N)

    list_start = torch.searchsorted(sorted_bins, torch.arange(num_bins + 1, device=device, dtype=bin_dtype))
    counts = list_start[1:] - list_start[:-1]
    item_end = torch.cumsum((counts + segment - 1) // segment, 0)
    item_start = torch.cat([item_end.new_zeros(1), item_end])
    # Items number at most E / segment + bins; unused grid slots get bin = num_bins and exit.
    max_items = bins.numel() // segment + num_bins
    item_bin = torch.searchsorted(item_end, torch.arange(max_items, device=device), right=True)
    return SelectionLists(query_list, list_start, item_bin, item_start, max_items, num_bins, num_sel_blocks,
                          entry_of, blocks, starts)


WORK_ITEM_TARGET = 2048  # work items to aim for: enough to fill a GPU several times over
MIN_ITEM_STEPS, MAX_ITEM_STEPS = 32, 512


def work_item_segment(queries_per_step: int, entries: int) -> int:
    """Queries per work item, for `entries` (query, slot) pairs: about WORK_ITEM_TARGET items of
    MIN_ITEM_STEPS to MAX_ITEM_STEPS steps. Block 0's list holds every query, so its items are the
    longest a launch runs: few entries (short rows) take short items, lest one program walk a whole
    row while the GPU idles; many take long ones, which keeps the dK/dV per-item partials near the
    size of the result."""
    steps = entries // (queries_per_step * WORK_ITEM_TARGET)
    return queries_per_step * min(MAX_ITEM_STEPS, max(MIN_ITEM_STEPS, steps))


@triton.jit
def work_item(item, ITEM_BIN, ITEM_START, LIST_START, NUM_SEL_BLOCKS, HKV, SEGMENT):
    """(first entry, end entry, key block, KV group, batch) of work item `item` of a live bin."""
    bin_id = tl.load(ITEM_BIN + item)
    seg = item - tl.load(ITEM_START + bin_id)
    e_lo = tl.load(LIST_START + bin_id) + seg * SEGMENT
    e_hi = tl.minimum(tl.load(LIST_START + bin_id + 1), e_lo + SEGMENT)
    blk, hk, b = bin_position(bin_id, NUM_SEL_BLOCKS, HKV)
    return e_lo, e_hi, blk, hk, b


@triton.jit
def bin_position(bin_id, NUM_SEL_BLOCKS, HKV):
    """(key block, KV group, batch) of a bin: bin = (b * Hkv + g) * blocks + block."""
    bh = bin_id // NUM_SEL_BLOCKS
    return bin_id % NUM_SEL_BLOCKS, (bh % HKV).to(tl.int64), (bh // HKV).to(tl.int64)


@triton.jit
def key_block_span(BLOCKS, STARTS, blk, NUM_BLOCKS, SEL_BLOCK, T, PACKED: tl.constexpr):
    """(first token, end of its document) of key block blk: block blk of the row, or with PACKED
    the blk-th of the packed row's per-document blocks (a tile table over tokens in tiles of l')."""
    if PACKED:
        doc = tl.load(BLOCKS + blk)
        start = tl.load(STARTS + doc)
        return start + tl.load(BLOCKS + NUM_BLOCKS + blk) * SEL_BLOCK, tl.load(STARTS + doc + 1)
    else:
        return blk * SEL_BLOCK, T


@triton.jit
def query_entries(IDX, ENTRY_OF, sib, sit, sih, T, HKV, NUM_SEL, BLOCK_N: tl.constexpr):
    """(batch, KV group, query, used slots, their entries) of this program in a launch of
    flat_grid(T, B * Hkv): where each of the query's selection slots stands in the lists."""
    t, pid_bh = grid_position(T)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    t64 = t.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    used = tl.load(IDX + b * sib + t64 * sit + hk * sih + offs_n, mask=offs_n < NUM_SEL, other=-1) >= 0
    entry = tl.load(ENTRY_OF + ((b * HKV + hk) * T + t64) * NUM_SEL + offs_n, mask=used, other=0).to(tl.int64)
    return b, hk, t64, used, entry
